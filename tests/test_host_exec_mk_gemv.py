"""The megakernel's tensor-core GEMV path (``kernels/megakernel/gemv.py`` from batch 8: 16-row tiles x groups of
passes of 8 batch rows) executed on the host.

``kimik3.kernels.verify.host_exec_mk_gemv`` runs the lane-level helper ``device_fns.weight_tile_mma`` (row clamping, the
staged / unstaged choice, chunk addresses of the two weight rows and the x row, the x normalisation, the tail clamp and
zeroing, the registers handed to ``megakernel.mma.mma_chunk``) over every (16-row tile, pass group) item and lane of an
instruction; only the ``mma.sync`` is evaluated by ``megakernel.mma.mma_reference``. The opcodes' epilogues are replayed
per accumulator register into outputs poisoned with NaN (every store counted) and compared with the CPU interpreter's
opcode reference. Boxes that end inside a tile, K not a multiple of 32 (the tail), a tile straddling the stage's end,
batch 8, 17, 33 and 40 (a partial last pass; at 40 the two-weight opcodes' second group has a pass wholly past the
batch) and 64 (8 passes: two groups for one weight, four for two), every FFN_OUT source combination and an LM_HEAD
arg-max tie are covered; planted bugs (wrong register order, wrong chunk, gamma missing, no tail zeroing, the staged
rule, the tile height, a pass's x row, an accumulator column's batch row) must fail. Host runs go through a subprocess:
a device-only instruction reached on the host aborts the process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from host_exec_runner import run_cases, run_with_mutants

pytestmark = pytest.mark.host

# K 200: 25 chunks, a partial last k block; n 37: the last tile has 5 rows; staged 20: the second tile straddles
# the stage's end (read from global memory), the first from the stage (its unstaged rows are poisoned)
CASES: list[dict] = [
    {"op": "norm_proj", "args": {"K": 200, "n": 37, "staged": 20}},
    {"op": "norm_proj", "args": {"K": 256, "n": 37, "fp32": True, "B": 33}},
    {"op": "mlp_gate_up", "args": {"K": 264, "n": 21, "staged": 21, "B": 64}},
    {"op": "o_proj_residual", "args": {"K": 264, "n": 40, "accumulate": True}},
    {"op": "o_proj_residual", "args": {"K": 256, "n": 16, "accumulate": False, "B": 64}},
    {"op": "ffn_out", "args": {"K": 256, "K2": 136, "n": 30, "flags": 7, "staged": 18}},
    {"op": "ffn_out", "args": {"K": 256, "n": 30, "flags": 3}},
    {"op": "ffn_out", "args": {"K": 200, "n": 30, "flags": 2, "staged": 5}},
    {"op": "ffn_out", "args": {"K": 256, "n": 30, "flags": 5, "B": 40}},
    {"op": "lm_head", "args": {"K": 256, "n": 300, "r0": 1000, "staged": 40}},
    {"op": "lm_head", "args": {"K": 200, "n": 250, "r0": 7, "ties": True, "B": 17}},
]

# Planted bugs: (module, [(original, mutated)]) and the case that must then fail.
MUTANTS: dict[str, tuple[list, dict]] = {
    # rows g and g + 8 of the A fragments swapped
    "mk-mma-register-order": (["megakernel.device_fns", [["chunk_mma(acc[None, p], ua[None, u], ub[None, u],",
                                                          "chunk_mma(acc[None, p], ub[None, u], ua[None, u],"]]],
                              {"op": "o_proj_residual", "args": {"K": 264, "n": 40, "accumulate": True}}),
    # k blocks one chunk apart instead of one quad (4 chunks) apart
    "mk-mma-chunk": (["megakernel.device_fns", [["cc = [c + 4 * u if", "cc = [c + u if"]]],
                     {"op": "o_proj_residual", "args": {"K": 264, "n": 40, "accumulate": True}}),
    # x normalised without γ
    "mk-mma-gamma": (["megakernel.device_fns", [["rx[None, u].store((xh.to(Float32) * rg[None, u].load().to(Float32))"
                                                 ".to(BFloat16))", "rx[None, u].store(xh)"]]],
                     {"op": "norm_proj", "args": {"K": 200, "n": 37, "staged": 20}}),
    # the clamped chunks of the tail k block counted (their x not zeroed)
    "mk-mma-tail": (["megakernel.device_fns", [["ux[i, u] = ux[i, u] if c + 4 * u < lim else Uint32(0)",
                                                "ux[i, u] = ux[i, u]"]]],
                    {"op": "ffn_out", "args": {"K": 200, "n": 30, "flags": 2, "staged": 5}}),
    # a tile read from the stage when only its first row is staged (the rest of the stage is poison)
    "mk-mma-staged-rule": (["megakernel.device_fns", [["if cutlass.min(j0 + (MMA_ROWS - 1), n - 1) < staged_rows:",
                                                       "if j0 < staged_rows:"]]],
                           {"op": "norm_proj", "args": {"K": 200, "n": 37, "staged": 20}}),
    # every pass of a group reads the x rows one row (not one pass of 8) after the previous pass's
    "mk-mma-pass-row": (["megakernel.device_fns", [["r = cutlass.min(xr + p * MMA_COLS, rows - 1)",
                                                    "r = cutlass.min(xr + p, rows - 1)"]]],
                        {"op": "o_proj_residual", "args": {"K": 256, "n": 16, "accumulate": False, "B": 64}}),
    # an accumulator column stored at the mirrored batch row of its pass (the C fragment's column -> batch row map)
    "mk-mma-group-col": (["contracts.addr", [["    return (group * passes + p) * GEMV_BT + col\n",
                                              "    return (group * passes + p) * GEMV_BT + (GEMV_BT - 1 - col)\n"]]],
                         {"op": "norm_proj", "args": {"K": 256, "n": 37, "fp32": True, "B": 33}}),
    # work items 8 rows apart while every tile computes 16: rows stored twice
    "mk-mma-tile-rows": (["contracts.addr", [["return GEMV_MMA_ROWS if gemv_mma(batch) else 1",
                                              "return 8 if gemv_mma(batch) else 1"]]],
                         {"op": "o_proj_residual", "args": {"K": 264, "n": 40, "accumulate": True}}),
}


def _name(c: dict) -> str:
    return c["op"] + "-" + ",".join(f"{k}{v}" for k, v in c.get("args", {}).items())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_with_mutants("kimik3.kernels.verify.host_exec_mk_gemv", CASES, MUTANTS,
                            tmp_path_factory.mktemp("mk_gemv"), 900, _name)


@pytest.mark.parametrize("name", [_name(c) for c in CASES])
def test_mma_gemv_host_execution_matches_the_interpreter(name: str, results: dict[str, dict]) -> None:
    r = results[name]
    assert r["ok"], f"{name}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_mma_gemv_mutant_is_caught(mutant: str, results: dict[str, dict]) -> None:
    clean = MUTANTS[mutant][1]
    assert results[_name(clean)]["ok"], "the same case without the mutant must pass"
    r = results[f"mutant:{mutant}"]
    assert not r["ok"], f"planted bug {mutant} not caught: errors {r['errors']}, problems {r['problems']}"


@pytest.mark.slow
@pytest.mark.parametrize("op", ["norm_proj", "lm_head"])
def test_mma_gemv_at_k3_shard_width(op: str, tmp_path: Path) -> None:
    """k3-shard's hidden width (7168: 896 chunks; at the normalised opcodes' 3 k blocks per step on sm_90a, 74 whole
    steps of 12 chunks and a clamped tail step of 8), a box of 3 tiles and a half."""
    case = {"op": op, "args": {"preset": "k3-shard", "K": 7168, "n": 56, "staged": 16}}
    (r,) = run_cases("kimik3.kernels.verify.host_exec_mk_gemv", [case], tmp_path, timeout=1800)
    assert r["ok"], f"{op}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"


def test_tile_registers_are_the_chunk_layout() -> None:
    """In-process (no mutant): lane (g, q) holds chunk 4·kb + q of weight rows g, g + 8 and x row g, unnormalised
    x passed through bit for bit, and a staged tile read from the stage."""
    import torch
    from kimik3.kernels.megakernel import device_fns as F
    from kimik3.kernels.megakernel import mma as M
    from kimik3.kernels.verify.host_exec_mk_gemv import tile_registers

    g = torch.Generator().manual_seed(3)
    W = torch.randn(16, 64, generator=g).bfloat16()
    x = torch.randn(8, 64, generator=g).bfloat16()
    regs = tile_registers(F, W, 16, x, [(0, 0)], None, None, 2)[0, 0]  # one pass: [32, k blocks, 12]
    for lane in (0, 5, 31):
        gg, q = M.lane_group(lane), M.lane_quad(lane)
        for kb in range(2):
            cols = slice(32 * kb + 8 * q, 32 * kb + 8 * q + 8)
            want = [M.f32_to_bf16x2(t[cols].float().reshape(4, 2)) for t in (W[gg], W[gg + 8], x[gg])]
            assert torch.equal(regs[lane, kb], torch.cat(want)), (lane, kb)


def test_mutants_of_other_modules_are_refused() -> None:
    """A host run swaps in a mutated copy of the modules it executes only; a mutant of any other module would run
    the clean code and pass, so it is refused before anything runs."""
    from kimik3.kernels.contracts import addr as mk_addr
    from kimik3.kernels.megakernel import device_fns
    from kimik3.kernels.verify.host_exec import mutated_modules
    from kimik3.kernels.verify.host_exec_mk_gemv import _modules

    assert _modules(None) == (device_fns, mk_addr)
    with pytest.raises(ValueError,
                       match="mutants of megakernel.device_fns or contracts.addr only, got 'megakernel.moe'"):
        _modules(["megakernel.moe", [["a", "b"]]])
    m = mutated_modules(["contracts.addr", [["GEMV_MMA_ROWS = 16", "GEMV_MMA_ROWS = 8"]]], {"contracts.addr": mk_addr},
                        "t")
    assert m["contracts.addr"] is not mk_addr and m["contracts.addr"].GEMV_MMA_ROWS == 8
