"""Megakernel scheduler: int32 serialisation, minimal (transitively reduced) waits, valid programs for every batch
and SM count, cost model consistent with kimik3.perf.cost, and critical-path scheduling not slower than round robin.

Expectation sources: the program's own decode (round trip), the independent hazard checker in
``kimik3.megakernel.hazards`` (validity, redundancy), ``kimik3.perf.cost.decode_cost`` (per-block bytes, which it reads
from the model's parameter shapes on the meta device) and the cost-model simulation in
``kimik3.megakernel.timeline`` (makespans). No weights are needed: k3-shard programs are built from its config.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kimik3.kernels.contracts.isa import (
    W_NEXT_BUF,
    W_NEXT_CHUNKS,
    W_NEXT_ELEM_HI,
    W_NEXT_ELEM_LO,
    W_STAGE_CHUNKS,
    W_STAGE_OP,
)

from kimik3.megakernel.hazards import check_program, format_violations, redundant_waits
from kimik3.megakernel.instructions import (
    CHUNK_BYTES,
    INSTR_WORDS,
    MAGIC,
    MAX_WAITS,
    NO_STAGE,
    STAGE_BYTES,
    Kind,
    Op,
    Program,
    assign_stages,
    decode_program,
    encode_program,
    encoding_table,
    instruction_set_table,
)
from kimik3.megakernel.scheduler import POLICIES, build_program, instruction_costs
from kimik3.megakernel.step import Tiling, build_step
from kimik3.megakernel.timeline import from_timings, gantt, gantt_height, makespan_ns, simulate, summary
from kimik3.model.config import get_preset

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see tests/conftest.py


def _copy(p: Program, **changes) -> Program:
    q = Program(p.buffers, list(p.instructions), [list(x) for x in p.queues], list(p.counters), p.batch,
                p.max_seq_len, p.num_layers, p.policy)
    for k, v in changes.items():
        setattr(q, k, v)
    return q


# ---------------------------------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("policy", POLICIES)
def test_serialisation_round_trips(policy):
    for preset, B, S, T in [("micro", 3, 4, 24), ("micro", 33, 8, 40), ("k3-shard", 2, 132, 1024)]:
        p = build_program(preset, B, S, policy, max_seq_len=T)
        t = encode_program(p)
        assert t.dtype == torch.int32 and t.dim() == 1
        q = decode_program(t)
        assert q == p, f"{preset} B={B}: decode(encode(p)) differs"
        assert torch.equal(encode_program(q), t), "encode(decode(t)) is not bit-identical"
        assert q.num_sms == S and q.batch == B and q.policy == policy
        assert [b.name for b in q.buffers] == [b.name for b in p.buffers]


def test_encoding_layout_is_as_documented():
    p = build_program("micro", 2, 3, "critical_path", max_seq_len=16)
    t = encode_program(p)
    hdr = t[:32].tolist()
    assert hdr[0] == MAGIC and hdr[3] == len(p.instructions) and hdr[4] == INSTR_WORDS and hdr[5] == 3
    off_ins = hdr[15]
    rows = t[off_ins : off_ins + len(p.instructions) * INSTR_WORDS].view(-1, INSTR_WORDS)
    for i in (0, len(p.instructions) // 2, len(p.instructions) - 1):
        ins, r = p.instructions[i], rows[i].tolist()
        assert r[0] == int(ins.op) and r[1] == ins.layer and r[2] == ins.sm and r[3] == ins.qpos
        assert r[8] == ins.signal and r[10] == len(ins.waits) and r[19] == len(ins.operands)
        for j, (c, tgt) in enumerate(ins.waits):
            assert r[11 + 2 * j : 13 + 2 * j] == [c, tgt]
        o = ins.operands[0]
        assert r[20:28] == [o.buf, o.mode, *o.box]
        # unused operand slots are zero; words 116..122 hold the weight stage (VERSION 2); the rest is zero
        assert all(x == 0 for x in r[20 + 8 * len(ins.operands) : W_STAGE_OP])
        assert r[W_STAGE_OP : W_STAGE_CHUNKS + 1] == list(ins.stage)
        nb, elem, chunks = ins.next_stage
        assert (r[W_NEXT_BUF], r[W_NEXT_CHUNKS]) == (nb, chunks)
        assert (r[W_NEXT_ELEM_HI] << 32) | (r[W_NEXT_ELEM_LO] & 0xFFFFFFFF) == elem
        assert all(x == 0 for x in r[W_NEXT_CHUNKS + 1 :])
    assert any(r[W_STAGE_OP] >= 0 for r in rows.tolist()) and any(r[W_NEXT_BUF] >= 0 for r in rows.tolist())
    bad = t.clone()
    bad[0] = 0
    with pytest.raises(ValueError, match="not a megakernel program"):
        decode_program(bad)
    assert len(encoding_table()) >= 6
    ops = instruction_set_table()
    assert set(ops["name"]) == {op.name for op in Op if op != Op.NOP}


def test_next_stage_offset_spans_two_words():
    """The element offset of a next-stage descriptor is an int64 in two int32 words (low word: unsigned bits)."""
    p = build_program("micro", 2, 3, "critical_path", max_seq_len=16)
    for elem in (2**31 - 1, 2**31, 2**32 + 5, 3 * 2**40 + 2**31 + 7):
        q = _copy(p)
        q.instructions[0] = dataclasses.replace(q.instructions[0], next_stage=(1, elem, 4))
        t = encode_program(q)
        row = t[t[15] : t[15] + INSTR_WORDS].tolist()
        assert row[W_NEXT_ELEM_LO] == (elem & 0xFFFFFFFF) - (2**32 if elem & 0x80000000 else 0)
        assert row[W_NEXT_ELEM_HI] == elem >> 32
        assert decode_program(t).instructions[0].next_stage == (1, elem, 4)
    q.instructions[0] = dataclasses.replace(q.instructions[0], next_stage=(1, -8, 4))
    with pytest.raises(ValueError, match="element offset"):
        encode_program(q)


def _stage_rule(p: Program, ins) -> tuple[int, int, int]:
    """The contract's stage rule, restated: the largest (box rows x d2) bf16 WEIGHT operand marked PREFETCH whose box
    is whole rows of one slice (d2 % 8 == 0), whole rows up to STAGE_BYTES; EMBED none."""
    cands = [((o.box[3] - o.box[2]) * p.buffers[o.buf].shape[2], -j, j) for j, o in enumerate(ins.operands)
             if o.prefetch and p.buffers[o.buf].kind == Kind.WEIGHT and p.buffers[o.buf].dtype == torch.bfloat16
             and o.box[1] - o.box[0] == 1 and o.box[4] == 0 and o.box[5] == p.buffers[o.buf].shape[2]
             and p.buffers[o.buf].shape[2] % 8 == 0]
    # EMBED's rows are data; EXPERT_DOWN's stage buffer is its combine scratch (isa.STAGE_SCRATCH_OPS)
    best = max(cands) if cands and ins.op not in (Op.EMBED, Op.EXPERT_DOWN) else None  # the first of equally large
    if best is None:
        return NO_STAGE
    j = best[2]
    d2 = p.buffers[ins.operands[j].buf].shape[2]
    rows = min(best[0] // d2, STAGE_BYTES // (2 * d2))
    return (j, rows, rows * d2 * 2 // CHUNK_BYTES) if rows else NO_STAGE


@pytest.mark.parametrize(("preset", "B", "S"), [("micro", 4, 8), ("tiny", 8, 16), ("k3-shard", 1, 132)])
def test_stages_follow_the_rule_and_the_queues(preset, B, S):
    """Each instruction's stage is the contract's choice; each queue position streams its successor's stage (the
    last streams nothing); the stage is full where a box is larger than it; an fp32 program stages nothing."""
    p = build_program(preset, B, S, "critical_path", max_seq_len=64)
    assert [ins.stage for ins in p.instructions] == [_stage_rule(p, ins) for ins in p.instructions]
    for q in p.queues:
        for u, w in zip(q, q[1:]):
            j, _, chunks = p.instructions[w].stage
            if j < 0:
                assert p.instructions[u].next_stage == NO_STAGE
            else:
                o = p.instructions[w].operands[j]
                _, d1, d2 = p.buffers[o.buf].shape
                assert p.instructions[u].next_stage == (o.buf, (o.box[0] * d1 + o.box[2]) * d2, chunks)
        assert not q or p.instructions[q[-1]].next_stage == NO_STAGE
    capped = [ins for ins in p.instructions if ins.stage[0] >= 0 and ins.stage[1] < ins.operands[ins.stage[0]].box[3]
              - ins.operands[ins.stage[0]].box[2]]
    assert all(STAGE_BYTES - CHUNK_BYTES * ins.stage[2] < 2 * p.buffers[ins.operands[ins.stage[0]].buf].shape[2]
               for ins in capped)
    if preset == "k3-shard":
        assert capped  # k3 tiles are larger than the stage
    assert assign_stages(p) == p  # idempotent: one place decides
    with pytest.raises(ValueError, match="outside the program"):
        assign_stages(_copy(p, queues=[[len(p.instructions)]] + p.queues[1:]))
    if preset == "micro":
        f32 = build_program(preset, B, S, "critical_path", max_seq_len=64, act_dtype=torch.float32)
        assert all(ins.stage == NO_STAGE and ins.next_stage == NO_STAGE for ins in f32.instructions)


def test_an_expert_down_never_stages():
    """EXPERT_DOWN uses its own stage buffer as the combine's scratch (isa.STAGE_SCRATCH_OPS): the host chooses no
    stage for it, and the encoder refuses a program that gives it one (no copy may land in that buffer)."""
    from kimik3.kernels.contracts.isa import STAGE_SCRATCH_OPS

    assert Op.EXPERT_DOWN in STAGE_SCRATCH_OPS
    p = build_program("micro", 8, 3, "critical_path", max_seq_len=16)
    down = [v for v, ins in enumerate(p.instructions) if ins.op == Op.EXPERT_DOWN]
    assert down and all(p.instructions[v].stage == NO_STAGE for v in down)
    q = _copy(p)
    q.instructions[down[0]] = dataclasses.replace(q.instructions[down[0]], stage=(4, 1, 4))
    with pytest.raises(ValueError, match="stage buffer as scratch"):
        encode_program(q)


# ---------------------------------------------------------------------------------------------------- waits


@pytest.mark.parametrize("policy", POLICIES)
def test_waits_are_a_transitive_reduction(policy):
    """No wait is implied by program order plus the instruction's other waits — and the check has teeth: a
    planted redundant wait (one implied transitively through an earlier group) is reported."""
    for preset, B, S in [("micro", 1, 4), ("micro", 33, 8), ("tiny", 4, 8)]:
        p = build_program(preset, B, S, policy, max_seq_len=32)
        assert redundant_waits(p) == [], f"{preset} B={B} S={S}: redundant waits"
        assert max(len(i.waits) for i in p.instructions) <= MAX_WAITS
    # plant one: v waits on counter c; a signaller m of c itself waits on counter c2 (full count), so every
    # signaller of c2 already happens before v -> a wait of v on c2 is implied by v's wait on c
    ins = p.instructions
    signallers = {}
    for i, x in enumerate(ins):
        signallers.setdefault(x.signal, []).append(i)

    def implied(x):
        return [(c2, t2) for c, _ in x.waits for m in signallers[c] for c2, t2 in ins[m].waits
                if c2 not in {w for w, _ in x.waits}]

    v = next(i for i, x in enumerate(ins) if implied(x))
    x, hit = ins[v], implied(ins[v])
    q = _copy(p)
    q.instructions[v] = dataclasses.replace(x, waits=x.waits + (hit[0],))
    assert check_program(q) == []  # still correct ...
    red = redundant_waits(q)
    assert [(i, k) for i, k, _ in red] == [(v, len(x.waits))], red  # ... but the planted wait is redundant


@pytest.mark.parametrize("policy", POLICIES)
def test_programs_valid_for_all_batches_and_sm_counts(policy):
    for B in (1, 2, 7, 33, 64):
        for S in (1, 3, 8, 32):
            p = build_program("micro", B, S, policy, max_seq_len=40)
            bad = check_program(p)
            assert bad == [], f"B={B} S={S}:\n{format_violations(bad)}"
            assert redundant_waits(p) == []
            assert sorted(v for q in p.queues for v in q) == list(range(len(p.instructions)))
            if S == 1:
                assert all(not i.waits for i in p.instructions), "one SM: program order alone suffices"


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_programs_valid_for_every_batch_1_to_64(policy):
    for B in range(1, 65):
        for S in (1, 5, 16, 132):
            p = build_program("micro", B, S, policy, max_seq_len=40)
            assert check_program(p) == [], f"B={B} S={S}"
            assert redundant_waits(p) == [], f"B={B} S={S}"
    for B in (1, 33, 64):
        p = build_program("tiny", B, 16, policy, max_seq_len=64)
        assert check_program(p) == [] and redundant_waits(p) == []
    p = build_program("k3-shard", 64, 132, policy, max_seq_len=8192)
    assert check_program(p) == [] and redundant_waits(p) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_k3_shard_program_valid(policy):
    p = build_program("k3-shard", 4, 132, policy, max_seq_len=4096)  # from the config alone, no weights
    bad = check_program(p)
    assert bad == [], format_violations(bad)
    assert sum(len(q) > 0 for q in p.queues) == 132


def test_unsupported_config_is_refused():
    with pytest.raises(ValueError, match="unsupported features"):
        build_program("deepseek-v3", 1, 8)


# ---------------------------------------------------------------------------------------------------- costs


def test_instruction_costs_follow_decode_cost():
    """Per (layer, block), the instructions' bytes add up to decode_cost's, and the shape-based split (before
    calibration) already agrees on weight bytes: the tiles cover every parameter of the model."""
    from kimik3.perf.cost import decode_cost

    cfg = get_preset("k3-shard")
    for B in (1, 16):
        spec = build_step(cfg, B, 4096, num_sms=132)
        costs = instruction_costs(spec, context_len=2048)
        assert costs.attrs["calibrated_by_decode_cost"]
        dc = decode_cost(cfg, batch_size=B, context_len=2048).by_block
        got = costs["weight_bytes"].sum()
        assert got == pytest.approx(dc["weight_bytes"].sum(), rel=1e-9)
        state = dc[["state_bytes_read", "state_bytes_written", "kv_bytes_read", "kv_bytes_written"]].to_numpy().sum()
        assert costs["state_bytes"].sum() == pytest.approx(state, rel=1e-9)
        raw = {}
        for contrib in spec.raw_costs:
            for (layer, block), v in contrib.items():
                raw[(layer, block)] = raw.get((layer, block), 0.0) + v[0]
        for _, row in dc.iterrows():
            key = (int(row["layer"]), row["block"])
            if row["weight_bytes"] > 1e6:  # big blocks: the tile shapes alone get within 2 %
                assert raw[key] == pytest.approx(row["weight_bytes"], rel=0.02), key
        assert (costs["ns"] > 0).all()


# ---------------------------------------------------------------------------------------------------- makespan


@pytest.mark.parametrize("B,S", [(1, 132), (64, 132), (8, 32)])
def test_critical_path_not_slower_than_round_robin(B, S):
    spans = {}
    for policy in POLICIES:
        p = build_program("k3-shard", B, S, policy, max_seq_len=8192)
        spans[policy] = makespan_ns(simulate(p))
    assert spans["critical_path"] <= spans["round_robin"], spans


@pytest.mark.slow
@pytest.mark.parametrize("B", [1, 2, 4, 16, 32, 64])
@pytest.mark.parametrize("S", [16, 66, 132])
def test_critical_path_not_slower_than_round_robin_full(B, S):
    spans = {policy: makespan_ns(simulate(build_program("k3-shard", B, S, policy, max_seq_len=8192)))
             for policy in POLICIES}
    assert spans["critical_path"] <= spans["round_robin"], spans


# ---------------------------------------------------------------------------------------------------- timeline


def test_timeline_simulation_and_timing_buffer():
    p = build_program("micro", 4, 4, "critical_path", max_seq_len=24)
    tl = simulate(p)
    assert (tl["start_ns"] >= tl["arrive_ns"]).all() and (tl["end_ns"] > tl["start_ns"]).all()
    for q in p.queues:  # each SM runs its queue in order
        assert (tl.loc[q, "start_ns"].diff().dropna() > 0).all()
    for i, ins in enumerate(p.instructions):  # waits respected: start after every guaranteed signaller ended
        for c, _ in ins.waits:
            sig = [j for j, x in enumerate(p.instructions) if x.signal == c]
            assert tl.loc[i, "start_ns"] >= tl.loc[sig, "end_ns"].max()
    s = summary(tl, p.num_sms)
    assert set(s.index) >= {"NORM_PROJ", "KDA_STEP", "(idle)"}
    assert s["share_of_sm_time"].sum() == pytest.approx(1.0, rel=1e-6)
    # a GPU timing buffer: [N, 2] int64 ns (globaltimer), arbitrary origin
    tim = torch.tensor(tl[["start_ns", "end_ns"]].round().to_numpy(), dtype=torch.int64) + 10**12
    tl2 = from_timings(p, tim)
    assert makespan_ns(tl2) == pytest.approx(makespan_ns(tl), abs=2)
    fig = gantt(tl2)
    assert len(fig.data) >= len(set(tl["op"]))
    assert fig.layout.yaxis.title.text.startswith("SM") and fig.layout.height == gantt_height(p.num_sms)
    cpu = gantt(tl2, unit="CPU worker")
    assert cpu.layout.yaxis.title.text.startswith("CPU worker")
    # a figure's height fits its rows: two workers are not a page tall, 132 SMs still fit a screen
    assert gantt_height(2) == 340 and gantt_height(132) == 760 and gantt_height(16) == 120 + 18 * 16
    with pytest.raises(ValueError, match="timings must be"):
        from_timings(p, tim[:5])


def test_tiling_is_a_parameter():
    cfg = get_preset("micro")
    t = dataclasses.replace(Tiling.auto(cfg, 2, 4, 24), kda_heads=1, out_cols=8, lm_rows=64)
    p = build_program(cfg, 2, 4, max_seq_len=24, tiling=t)
    counts = {op: sum(i.op == op for i in p.instructions) for op in Op}
    L = cfg.num_hidden_layers
    assert counts[Op.LM_HEAD] == cfg.vocab_size // 64
    assert counts[Op.O_PROJ_RESIDUAL] == L * cfg.hidden_size // 8
    assert counts[Op.KDA_STEP] == len(cfg.kda_layers) * cfg.kda_num_heads * -(-2 // t.kda_batch_rows)
    assert check_program(p) == []
    assert all(b.kind != Kind.WEIGHT or b.shape[0] >= 1 for b in p.buffers)
