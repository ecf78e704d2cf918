"""The megakernel's MLA opcodes (``kernels/megakernel/mla.py``) executed on the host, one instruction at a time.

``kimik3.kernels.verify.host_exec_mk_mla`` runs the opcodes' own ``@cute.jit`` helpers (the W_UK absorption's chunk
column / row-group tiling and its vectorised lane loop, the q_b and W_UV rows through ``device_fns.weight_row_dot``, the
latent RMSNorm lanes, MLA_PARTIAL's query / cache-row loads, partial scores and online-softmax output update, and
MLA_REDUCE's split merge) over every warp task and lane of an instruction, does the warp sums, the online softmax
and the stores the thin GPU layer does, in the kernel's order, into outputs poisoned with NaN (every store counted),
and compares with the CPU interpreter's MLA opcodes. Host runs go through a subprocess: a device-only instruction
reached on the host aborts the process.

Whole instructions at ``micro`` and ``tiny`` (batch 1 and 8); at ``k3-shard`` widths the absorption's first and last
column blocks, the first / last W_UV rows, all 96 heads of a split with sampled lanes, a partial last step and an
empty sequence; the whole ``k3-shard`` instructions are marked slow. A planted W_UK row-stride bug must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_exec_runner import run_cases, run_with_mutants

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[1]


def _cases_ci() -> list[dict]:
    cases = [{"op": "q", "preset": "micro", "batch": 1, "args": {"h0": 3}},
             {"op": "q", "preset": "tiny", "batch": 8, "args": {"h0": 5}},
             {"op": "kv_append", "preset": "micro", "batch": 1},
             {"op": "kv_append", "preset": "tiny", "batch": 8},
             # a split with a sequence before it (empty), one ending inside it (partial last step), one past it
             {"op": "partial", "preset": "micro", "batch": 4, "args": {"split": 1, "nsplit": 3, "T": 61}},
             {"op": "partial", "preset": "tiny", "batch": 8, "args": {"split": 0, "nsplit": 2, "T": 64,
                                                                     "heads": [1, 6]}},
             {"op": "reduce", "preset": "micro", "batch": 1, "args": {"h0": 0}},
             {"op": "reduce", "preset": "tiny", "batch": 8, "args": {"h0": 5, "nsplit": 4}},
             # k3-shard widths: the absorption's first and last column blocks with every nope row (the last head),
             # the first and last W_UV rows over 16 splits, all 96 heads of a split with sampled lanes
             {"op": "q", "preset": "k3-shard", "batch": 8, "args": {"h0": 95, "tasks": [0, 7], "qb_rows": [191]}},
             {"op": "reduce", "preset": "k3-shard", "batch": 8, "args": {"h0": 95, "d_rows": [0, 127],
                                                                        "nsplit": 16}},
             {"op": "partial", "preset": "k3-shard", "batch": 2, "args": {"T": 512, "nsplit": 2, "split": 1,
                                                                         "lanes": [0, 1, 30, 31]}},
             {"op": "kv_append", "preset": "k3-shard", "batch": 8}]
    return cases


def _cases_slow() -> list[dict]:
    return [{"op": "q", "preset": "k3-shard", "batch": 1, "args": {"h0": 0}},
            {"op": "q", "preset": "tiny", "batch": 1, "args": {"h0": 0}},
            {"op": "partial", "preset": "k3-shard", "batch": 4, "args": {"T": 1024, "nsplit": 4, "split": 1}},
            {"op": "reduce", "preset": "k3-shard", "batch": 1, "args": {"h0": 0, "nsplit": 16}},
            {"op": "partial", "preset": "tiny", "batch": 8, "args": {"split": 1, "nsplit": 2, "T": 64}}]


# Planted bugs (docs/planted-bugs.md): (module, [(original, mutated)]) and the case that must then fail.
MUTANTS: dict[str, tuple[list, dict]] = {
    # the W_UK row stride one chunk short: every nope row after the first read from the wrong place
    "mk-mla-wuk-row-stride": (["megakernel.mla", [["wv[((row0 + n0 + RG * u) * nchr + cb, None)]",
                                                   "wv[((row0 + n0 + RG * u) * (nchr - 1) + cb, None)]"]]],
                              {"op": "q", "preset": "micro", "batch": 1, "args": {"h0": 3}}),
}


def _run(cases: list[dict], tmp: Path, timeout: int) -> list[dict]:
    return run_cases("kimik3.kernels.verify.host_exec_mk_mla", cases, tmp, timeout)


def _name(c: dict) -> str:
    extra = ",".join(f"{k}{v}" for k, v in c.get("args", {}).items())
    return f"{c['op']}/{c['preset']}/b{c['batch']}" + (f"-{extra}" if extra else "")


@pytest.fixture(scope="module")
def ci_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_with_mutants("kimik3.kernels.verify.host_exec_mk_mla", _cases_ci(), MUTANTS,
                            tmp_path_factory.mktemp("mk_mla"), 900, _name)


@pytest.mark.parametrize("name", [_name(c) for c in _cases_ci()])
def test_mla_opcode_host_execution_matches_the_interpreter(name: str, ci_results: dict[str, dict]) -> None:
    r = ci_results[name]
    assert r["ok"], f"{name}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"
    assert r["lanes"] > 0


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_mla_mutant_is_caught(mutant: str, ci_results: dict[str, dict]) -> None:
    clean = MUTANTS[mutant][1]
    assert ci_results[_name(clean)]["ok"], "the same case without the mutant must pass"
    r = ci_results[f"mutant:{mutant}"]
    assert not r["ok"], f"planted bug {mutant} not caught: errors {r['errors']}, problems {r['problems']}"


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases_slow(), ids=_name)
def test_mla_opcode_host_execution_full(case: dict, tmp_path: Path) -> None:
    (r,) = _run([case], tmp_path, timeout=3600)
    assert r["ok"], f"{_name(case)}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"


def test_absorption_tiles_cover_every_column_once() -> None:
    """The absorption's tiling (``contracts.addr.absorb_cw``, shared with the device; the lane split of
    ``mk_mla.absorb_coords`` restated): every W_UK chunk column is owned with every row group exactly once."""
    from kimik3.kernels.contracts.addr import absorb_cw

    for kvl in (32, 128, 512, 96, 40):
        cw = absorb_cw(kvl)
        assert (kvl // 8) % cw == 0 and 32 % cw == 0
        seen = [(t * cw + lane % cw, lane // cw) for t in range(kvl // 8 // cw) for lane in range(32)]
        assert sorted(seen) == sorted({(c, g) for c in range(kvl // 8) for g in range(32 // cw)})


def test_score_sum_chain_is_two_warp_sums_bit_for_bit() -> None:
    """MLA_PARTIAL's thin layer sums the latent and rope partial scores in one shuffle chain (``mk_mla._score_sum``,
    device-only, restated here lane by lane); the host execution replays it as two full butterflies
    (``host_exec.warp_sum``). The two agree bit for bit on every lane, scores over many binades included."""
    from kimik3.kernels.verify.host_exec import warp_sum

    g = torch.Generator().manual_seed(0)
    lane = torch.arange(32)
    sl = torch.randn(500, 32, generator=g) * torch.exp(3 * torch.randn(500, 32, generator=g))
    sr = torch.randn(500, 32, generator=g) * torch.exp(3 * torch.randn(500, 32, generator=g))
    hi = (lane & 16) != 0
    v = torch.where(hi, sr, sl) + torch.where(hi, sl, sr)[:, lane ^ 16]
    for off in (8, 4, 2, 1):
        v = v + v[:, lane ^ off]
    other = v[:, lane ^ 16]

    def bf(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float()

    dev = bf(bf(v) + bf(other))
    ref = bf(bf(warp_sum(sl, 1)) + bf(warp_sum(sr, 1)))
    assert torch.equal(dev, ref[:, None].expand(500, 32))
