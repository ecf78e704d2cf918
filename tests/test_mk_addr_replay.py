"""The megakernel's address replay: every instruction of a decoded int32 program, its opcode's address arithmetic
replayed on the host (``kimik3.kernels.contracts.addr``), checked against the instruction's declared operand boxes.

The arithmetic that decides which rows, columns and elements an opcode touches (``elem_offset``, ``tile_rows``,
``expert_row_offset``) is defined once in ``kernels/contracts/addr.py`` and called by the device opcodes
(``kernels/megakernel/gemv.py``, ``moe.py``, ``operands.py``); the replay (``kernels/verify/addr_replay.py``) calls the
same functions on Python ints, and one test executes them as traced DSL integers on the host. Planted mutants of
those functions (loaded from a modified copy of the file, as ``tests/test_host_exec.py`` does) must be reported, and
so must a program whose declarations disagree with the device code.

Whole ``micro`` and ``tiny`` programs at batch 1, 8, 33 (a partial last pass) and 64 under both policies; ``k3-shard``
at batch 1 with the write count and at batch 64 every instruction's access corners (bounds and prefetch); the other
``k3-shard`` batches with the write count are marked slow; programs carrying MXFP4 routed experts (codes and E8M0
scales, ``contracts.addr.fp4_row_offsets``) at ``micro`` / ``tiny`` and ``k3-shard`` batch 1. Each of them replays every
weight-stage copy too (an instruction's own stage and the next-stage descriptor the device copies before the waits):
only static weights, every staged element in the declared box, each descriptor equal to the next instruction's own
stage; planted descriptors into an activation or a state, and rows past the box, are reported.
"""

from __future__ import annotations

import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest
from kimik3.kernels.contracts.isa import CHUNK_BYTES, DEVICE_OPS, Kind, Mode, Op
from kimik3.kernels.verify import addr_replay
from kimik3.kernels.verify.host_exec import load_mutant

from kimik3.megakernel import POLICIES, build_program, decode_program, encode_program
from kimik3.model.config import get_preset

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[1]
SMS = {"micro": 8, "tiny": 8, "k3-shard": 132}


@cache
def _program(preset: str, batch: int, policy: str = "critical_path", expert_format: str = "dense"):
    """The int32 program as the device reads it: built, encoded, decoded."""
    return decode_program(encode_program(build_program(preset, batch, SMS[preset], policy=policy,
                                                       expert_format=expert_format)))


@pytest.mark.parametrize("preset, world, rank, batch", [("micro", 2, 1, 2), ("micro", 4, 3, 8), ("tiny", 2, 1, 3)])
def test_rank_program_replays_clean(preset: str, world: int, rank: int, batch: int) -> None:
    """One rank's program (decoded as the device reads it, on the weights as the rank holds them): the collective
    opcodes, the mailbox rows LM_HEAD and EXPERT_DOWN store into, every PUSH operand's box, the GEMVs over a rank's
    input columns and the head weights KDA_STEP and MLA_Q index by the rank's heads all stay in their boxes."""
    from kimik3.megakernel.ranks import Shard

    cfg = get_preset(preset)
    p = decode_program(encode_program(build_program(preset, batch, SMS[preset], shard=Shard(world, world, rank))))
    rep = addr_replay.replay(p, cfg)
    assert rep.ok, rep.summary()
    assert rep.instructions == len(p.instructions)
    assert {x.op for x in p.instructions} >= {Op.ALLREDUCE_MIX, Op.ARGMAX_ALL, Op.MOE_COMBINE, Op.KDA_STEP,
                                               Op.MLA_Q, Op.O_PROJ_RESIDUAL, Op.FFN_OUT}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("batch", [1, 8, 33, 64])
@pytest.mark.parametrize("preset", ["micro", "tiny"])
def test_whole_program_replays_clean(preset: str, batch: int, policy: str) -> None:
    p = _program(preset, batch, policy)
    rep = addr_replay.replay(p, get_preset(preset))
    assert rep.ok, rep.summary()
    assert rep.instructions == len(p.instructions)
    # every opcode the device runs was replayed, and the write count covered the step's activations
    assert {ins.op for ins in p.instructions} == set(DEVICE_OPS)
    assert rep.elements_counted > 0 and rep.runs > len(p.instructions)
    _assert_stages_replayed(p, rep)


def _assert_stages_replayed(p, rep) -> None:
    """Every stage copy of the program was replayed (each staged instruction's own rows and every next-stage
    descriptor), and there were some."""
    own = sum(ins.stage[0] >= 0 for ins in p.instructions)
    nxt = sum(ins.next_stage[0] >= 0 for ins in p.instructions)
    assert own > len(p.instructions) // 4 and nxt >= own - len(p.queues)
    assert rep.stage_copies == own + nxt and rep.elements_staged > 0


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("preset", ["micro", "tiny"])
def test_mxfp4_whole_program_replays_clean(preset: str, batch: int) -> None:
    """MXFP4 routed experts: the expert opcodes read whole 16-byte code groups and their scale bytes of every
    expert's rows (and x up to the last group's column), inside the code and scale boxes."""
    p = _program(preset, batch, expert_format="mxfp4")
    assert p.expert_format == "mxfp4"
    rep = addr_replay.replay(p, get_preset(preset))
    assert rep.ok, rep.summary()
    assert rep.instructions == len(p.instructions)
    _assert_stages_replayed(p, rep)


def test_mxfp4_k3_shard_batch1_whole_program() -> None:
    rep = addr_replay.replay(_program("k3-shard", 1, expert_format="mxfp4"), get_preset("k3-shard"))
    assert rep.ok, rep.summary()


def test_k3_shard_batch1_whole_program() -> None:
    rep = addr_replay.replay(_program("k3-shard", 1), get_preset("k3-shard"))
    assert rep.ok, rep.summary()
    _assert_stages_replayed(_program("k3-shard", 1), rep)


def test_k3_shard_batch64_every_instruction_corners() -> None:
    """Every instruction, every access group's first and last run (tile corners and edges); the write count over
    a batch-64 k3-shard step (370 M elements) is the slow test's."""
    p = _program("k3-shard", 64)
    rep = addr_replay.replay(p, get_preset("k3-shard"), check_writes=False)
    assert rep.ok, rep.summary()
    assert rep.instructions == len(p.instructions)
    _assert_stages_replayed(p, rep)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_k3_shard_whole_program_slow(batch: int, policy: str) -> None:
    rep = addr_replay.replay(_program("k3-shard", batch, policy), get_preset("k3-shard"))
    assert rep.ok, rep.summary()


# ---------------------------------------------------------------------------------------------- planted mutants
MUTANTS = {
    # a GEMV tile one row too long: reads the row past the weight box, writes the column past its output box
    # (the next tile's first column, stored twice)
    "tile-row-off-by-one": ([("    return r1 - r0\n", "    return r1 - r0 + 1\n")], {"bounds", "write_once"},
                            ("micro", 8)),
    # the tensor-core path's tile count rounded down: the rows of a box's last, partial 16-row tile never stored
    "gemv-tiles-floor": ([("    return (n + (rows - 1)) // rows\n", "    return n // rows\n")], {"write_once"},
                         ("tiny", 8)),
    # the expert stride dropped to one row (d2 instead of d1·d2): expert e's rows land in expert 0's
    "expert-stride": ([("return elem_offset(d1, d2, e, r, 0, wide)", "return elem_offset(1, d2, e, r, 0, wide)")],
                      {"bounds"}, ("micro", 8)),
    # the [b, r, c] offset with the row and batch strides swapped: caught wherever d1 > 1
    "elem-offset-stride": ([("(wide(b) * wide(d1) + wide(r)) * wide(d2)", "(wide(b) + wide(r) * wide(d1)) * wide(d2)")],
                           {"bounds"}, ("tiny", 8)),
    # a pass group's batch rows one group short (the group stride forgets its passes): rows of the second group of
    # MLP_GATE_UP / FFN_OUT at batch 64 stored twice, the last 32 rows never
    "gemv-group-stride": ([("    return (group * passes + p) * GEMV_BT + col\n",
                            "    return (group + p) * GEMV_BT + col\n")], {"write_once"}, ("tiny", 64)),
    # the tensor-core passes rounded down: batch 33's last, partial pass (row 32) never computed
    "gemv-passes-floor": ([("    return (batch + (GEMV_BT - 1)) // GEMV_BT\n", "    return batch // GEMV_BT\n")],
                        {"write_once"}, ("tiny", 33)),
    # MXFP4 code rows at the scales' row stride (d2 / 16): runs of codes that start mid-row and cross rows
    "fp4-code-row-stride": ([("return expert_row_offset(d1, d2, e, r, wide), expert_row_offset(sd1,",
                              "return expert_row_offset(d1, sd2, e, r, wide), expert_row_offset(sd1,")],
                            {"bounds"}, ("tiny", 8, "mxfp4")),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_planted_mutant_is_caught(name: str) -> None:
    reps, rules, (preset, batch, *fmt) = MUTANTS[name]
    mutant = load_mutant("contracts.addr", reps)
    rep = addr_replay.replay(_program(preset, batch, expert_format=(fmt or ["dense"])[0]), get_preset(preset),
                         helpers=mutant)
    assert not rep.ok, f"planted mutant {name} not reported"
    assert rules <= {f.rule for f in rep.findings}, rep.summary()


def test_mutated_lines_are_the_ones_the_device_code_calls() -> None:
    """The mutants above change the functions the opcodes call: the device code must keep calling them."""
    k = ROOT / "kernels"
    gemv, moe, operands = ((k / "megakernel" / f"{m}.py").read_text() for m in ("gemv", "moe", "operands"))
    moe_import = re.search(r"from kimik3\.kernels\.contracts\.addr import ([^\n]+)", moe).group(1)
    assert "from kimik3.kernels.contracts.addr import tile_rows\n" in gemv
    assert "from kimik3.kernels.contracts import addr as mk_addr\n" in gemv
    assert {"expert_row_offset", "fp4_row_offsets"} <= {n.strip() for n in moe_import.split(",")}
    assert "from kimik3.kernels.contracts.addr import elem_offset\n" in operands
    assert len(re.findall(r"\btile_rows\(", gemv)) == 5  # NORM_PROJ, MLP_GATE_UP, O_PROJ_RESIDUAL, FFN_OUT, LM_HEAD
    # the tensor-core path's tiles and both paths' item order are written once, in _for_items, and every GEMV
    # opcode's work items go through it
    assert gemv.count("mk_addr.gemv_tiles(n, TR)") == 1 and gemv.count("mk_addr.gemv_item(k, nt, NG)") == 1
    assert gemv.count("mk_addr.gemv_item(k, n, NBT)") == 1 and gemv.count("\ndef _for_items(") == 1
    ops = {b.split("(", 1)[0]: b for b in gemv.split("\ndef ")[1:] if b.startswith("op_")}
    assert sorted(ops) == ["op_ffn_out", "op_lm_head", "op_mlp_gate_up", "op_norm_proj", "op_o_proj_residual"]
    assert all("_for_items(ctx, n, " in body for body in ops.values())
    assert "mk_addr.gemv_tile_rows(B)" in gemv and "mk_addr.gemv_group_row(" in gemv
    # LM_HEAD's path is one switch that the device code and the replay (lm_head_tile_rows) both read
    assert "if const_expr(MMA and mk_addr.LM_HEAD_MMA):" in gemv
    assert '"lm_head_tile_rows", lm_head_tile_rows)(s.B)' in (k / "verify" / "addr_replay.py").read_text()
    # CUDA cores: EXPERT_GATE_UP (w1, w3), EXPERT_DOWN (w2); tensor cores: expert_base (a dense tile's expert)
    assert moe.count("expert_row_offset(") == 4
    assert moe.count("fp4_row_offsets(") == 1  # fp4_row: every MXFP4 code / scale row of both expert opcodes
    assert "return elem_offset(d1, d2, b, r, c, Int64)" in operands  # _eoff: every other [b, r, c] offset


# ---------------------------------------------------------------------------------------------- planted programs
def _with_operand(p, i: int, j: int, **change):
    ins = p.instructions[i]
    ops = list(ins.operands)
    ops[j] = dataclasses.replace(ops[j], **change)
    instrs = list(p.instructions)
    instrs[i] = dataclasses.replace(ins, operands=tuple(ops))
    return dataclasses.replace(p, instructions=instrs)


def _first(p, op: Op) -> int:
    return next(i for i, ins in enumerate(p.instructions) if ins.op == op)


def test_declared_box_narrower_than_the_device_access_is_reported() -> None:
    p = _program("micro", 8)
    i = _first(p, Op.NORM_PROJ)
    b0, b1, r0, r1, c0, c1 = p.instructions[i].operands[3].box
    rep = addr_replay.replay(_with_operand(p, i, 3, box=(b0, b1, r0, r1, c0, c1 - 1)), get_preset("micro"))
    assert {"bounds", "write_once"} <= {f.rule for f in rep.findings}, rep.summary()


# FFN_OUT takes its column count from its output box itself (the walk shrinks with the box); its write edge is
# what the tile-row mutant above moves
EDGES = [(o, side) for o in DEVICE_OPS for side in ("read", "write") if (o, side) != (Op.FFN_OUT, "write")]


@pytest.mark.parametrize(("op", "side"), EDGES, ids=[f"{o.name}-{s}" for o, s in EDGES])
def test_every_opcode_reaches_the_edge_of_its_boxes(op: Op, side: str) -> None:
    """Per opcode, the first operand it reads (and the last it writes), declared one column narrower: the replayed
    accesses reach the last declared column, so the narrower box is reported for that instruction (the replay's
    model of each opcode is not looser than its declarations)."""
    p = _program("micro", 8)
    i = _first(p, op)
    ops = p.instructions[i].operands
    js = [j for j, o in enumerate(ops) if (o.mode & int(Mode.WRITE)) == (int(Mode.WRITE) if side == "write" else 0)]
    j = js[-1] if side == "write" else js[0]
    b0, b1, r0, r1, c0, c1 = ops[j].box
    rep = addr_replay.replay(_with_operand(p, i, j, box=(b0, b1, r0, r1, c0, c1 - 1)), get_preset("micro"),
                         instructions=[i], check_writes=False)
    assert any(f.rule == "bounds" and f.instruction == i for f in rep.findings), (op.name, j, rep.summary())


FP4_EDGES = [(Op.EXPERT_GATE_UP, j) for j in (0, 3, 4, 6, 7)] + [(Op.EXPERT_DOWN, j) for j in (0, 4, 6)]


@pytest.mark.parametrize(("op", "j"), FP4_EDGES, ids=[f"{o.name}-{j}" for o, j in FP4_EDGES])
def test_mxfp4_expert_reads_reach_the_edge_of_their_boxes(op: Op, j: int) -> None:
    """MXFP4 programs: the input rows, the code rows and the scale rows of the expert opcodes, each declared one
    column narrower, are reported (the replay reads every code group and scale byte of a row, and x up to the last
    group's column)."""
    p = _program("micro", 8, expert_format="mxfp4")
    i = _first(p, op)
    b0, b1, r0, r1, c0, c1 = p.instructions[i].operands[j].box
    rep = addr_replay.replay(_with_operand(p, i, j, box=(b0, b1, r0, r1, c0, c1 - 1)), get_preset("micro"),
                         instructions=[i], check_writes=False)
    assert any(f.rule == "bounds" and f.instruction == i for f in rep.findings), (op.name, j, rep.summary())


def test_activation_marked_prefetch_is_reported() -> None:
    p = _program("micro", 8)
    i = _first(p, Op.NORM_PROJ)
    x = p.instructions[i].operands[0]
    assert p.buffers[x.buf].kind == Kind.ACT
    rep = addr_replay.replay(_with_operand(p, i, 0, mode=int(Mode.READ | Mode.PREFETCH)), get_preset("micro"))
    assert any(f.rule == "prefetch" and f.instruction == i for f in rep.findings), rep.summary()


def _restaged(p, **per: dict):
    """A copy of ``p`` with ``stage`` / ``next_stage`` of some instructions replaced (``next_stage={i: desc}``)."""
    instrs = list(p.instructions)
    for name, changes in per.items():
        for i, value in changes.items():
            instrs[i] = dataclasses.replace(instrs[i], **{name: value})
    return dataclasses.replace(p, instructions=instrs)


def _staged_pair(p, reads: Kind):
    """(u, w, operand): consecutive queue entries where w stages rows and reads an operand of kind ``reads``."""
    for q in p.queues:
        for u, w in zip(q, q[1:]):
            x = p.instructions[w]
            o = next((o for o in x.operands if p.buffers[o.buf].kind == reads and o.mode & int(Mode.READ)), None)
            if x.stage[0] >= 0 and o is not None:
                return u, w, o
    raise AssertionError(f"no staged instruction reading a {reads.name} buffer")


@pytest.mark.parametrize("kind", [Kind.ACT, Kind.STATE], ids=["act", "state"])
def test_next_stage_descriptor_into_an_activation_or_state_is_reported(kind: Kind) -> None:
    """A next-stage descriptor retargeted at the first row of an activation / state the next instruction reads:
    the device would copy it while the current instruction starts, before any wait."""
    p = _program("micro", 8)
    u, w, o = _staged_pair(p, kind)
    spec = p.buffers[o.buf]
    _, d1, d2 = spec.shape
    b0, _, r0, _, c0, c1 = o.box
    desc = (o.buf, (b0 * d1 + r0) * d2 + c0, (c1 - c0) * spec.element_size // CHUNK_BYTES)
    rep = addr_replay.replay(_restaged(p, next_stage={u: desc}), get_preset("micro"), instructions=[u],
                         check_writes=False)
    assert any(f.rule == "prefetch" and f.instruction == u and "not a static weight" in f.message
               for f in rep.findings), rep.summary()
    assert any(f.rule == "stage" and f.instruction == u for f in rep.findings), rep.summary()


def test_staged_rows_beyond_the_declared_box_are_reported() -> None:
    """One row more than the box, in the next-stage descriptor and in the instruction's own stage."""
    p = _program("micro", 8)
    u, w, _ = _staged_pair(p, Kind.ACT)
    x = p.instructions[w]
    j, rows, chunks = x.stage
    o = x.operands[j]
    box_rows = o.box[3] - o.box[2]
    assert rows == box_rows  # micro's weight tiles fit the stage whole: one more row leaves the box
    extra = p.buffers[o.buf].shape[2] * 2 // CHUNK_BYTES
    buf, elem, _ = p.instructions[u].next_stage
    bad = _restaged(p, next_stage={u: (buf, elem, chunks + extra)}, stage={w: (j, rows + 1, chunks + extra)})
    rep = addr_replay.replay(bad, get_preset("micro"), instructions=[u, w], check_writes=False)
    for i in (u, w):
        assert any(f.rule == "stage" and f.instruction == i and ("outside the declared box" in f.message
                                                                  or "do not fit the buffer" in f.message)
                   for f in rep.findings), rep.summary()
    assert not any(f.rule == "prefetch" for f in rep.findings)  # still a static weight: only the box is wrong


def test_a_missing_next_stage_is_reported() -> None:
    p = _program("micro", 8)
    u, w, _ = _staged_pair(p, Kind.ACT)
    rep = addr_replay.replay(_restaged(p, next_stage={u: (-1, 0, 0)}), get_preset("micro"), instructions=[u],
                         check_writes=False)
    assert [f.rule for f in rep.findings] == ["stage"] and f"#{w} stages" in rep.findings[0].message


def test_a_dropped_instruction_leaves_its_outputs_unwritten() -> None:
    """Write-once across instructions: the declared writes of the other instructions do not cover a removed one's
    (its output elements are then stored fewer times than the step declares)."""
    p = _program("micro", 8)
    i = _first(p, Op.O_PROJ_RESIDUAL)
    keep = [k for k in range(len(p.instructions)) if k != i]
    full = addr_replay.replay(p, get_preset("micro"))
    assert full.ok
    # the declared writes of every instruction, the device stores of all but one
    rep = addr_replay.replay(p, get_preset("micro"), instructions=keep, declared_from_all=True)
    assert any(f.rule == "write_once" for f in rep.findings), rep.summary()


def test_bad_helpers_module_is_refused() -> None:
    with pytest.raises(ValueError, match="helpers"):
        addr_replay.replay(_program("micro", 1), get_preset("micro"), helpers=object())


# ---------------------------------------------------------------------------------------------- DSL host execution
_DSL_SCRIPT = r"""
import json, sys, torch
from kimik3.megakernel import build_program, decode_program, encode_program
from kimik3.kernels.contracts import addr as mk_addr
from kimik3.kernels.verify import host_exec
rows = set()
for preset, batch, sms in (("tiny", 8, 8), ("k3-shard", 64, 132)):
    p = decode_program(encode_program(build_program(preset, batch, sms)))
    for ins in p.instructions:
        for o in ins.operands:
            _, d1, d2 = p.buffers[o.buf].shape
            b0, b1, r0, r1, c0, c1 = o.box
            rows |= {(d1, d2, b0, r0, c0, r1), (d1, d2, b1 - 1, r1 - 1, c1 - 1, r1)}  # first / last element
rows.add((2048, 7168, 383, 2047, 7167, 2048))  # the last row of expert 383 at k3 widths: past 2^31 elements
rows = torch.tensor(sorted(rows), dtype=torch.int32)
want = torch.tensor([[mk_addr.elem_offset(*r[:5]), mk_addr.tile_rows(r[3], r[5]), mk_addr.expert_row_offset(*r[:4])]
                     for r in rows.tolist()], dtype=torch.int64)
got = host_exec.run_mk_addr(rows)
mut = host_exec.load_mutant("contracts.addr", [("    return r1 - r0\n", "    return r1 - r0 + 1\n")])
got_mut = host_exec.run_mk_addr(rows, module=mut)
print(json.dumps({"n": len(rows), "equal": bool(torch.equal(got, want)), "max": int(want.max()),
                  "mutant_tile_rows_differs": bool((got_mut[:, 1] != want[:, 1]).all()),
                  "mutant_rest_equal": bool(torch.equal(got_mut[:, [0, 2]], want[:, [0, 2]]))}))
"""


def test_shared_address_functions_execute_as_dsl_integers_on_the_host() -> None:
    """The functions the device opcodes call, traced by the CuTe DSL with the device's types (Int32 instruction
    words, 64-bit offsets) and executed on the host, give the replay's numbers for every operand box corner of a
    tiny and a k3-shard program; a mutated copy is what runs (subprocess: device-only code aborts the process)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUTE_DSL_ARCH": os.environ.get("CUTE_DSL_ARCH", "sm_90a")}
    r = subprocess.run([sys.executable, "-c", _DSL_SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["equal"], out
    assert out["max"] > 2**31 and out["n"] > 1000, out
    assert out["mutant_tile_rows_differs"] and out["mutant_rest_equal"], out
