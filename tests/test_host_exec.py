"""The kernels' device code executed on the host: the GEMV family, the routed MXFP4 / bf16 experts, the AttnRes
mix, the router's scores GEMV and the megakernel's tile-GEMV helper.

``kimik3.kernels.verify.host_exec`` runs the same ``@cute.jit`` helpers the GPU kernels call (which rows, batch rows,
expert and chunks a block / warp / lane touches; the lane's dot products, MXFP4 code expansion and E8M0 scale; the MoE
combine) over every block, warp and lane of a real launch, does the warp sums in the shuffle order and the epilogue,
stores into outputs poisoned with NaN, counts every store, and compares with the module's reference. Host runs go
through a subprocess: a device-only instruction reached on the host aborts the process.

Whole launches at ``micro`` and ``tiny`` (batch 1, 8, 64); at ``k3-shard`` widths the GEMV's first and last row
blocks (every batch tile, every lane, the full K walk) and the MXFP4 experts at the real L / I with fewer experts;
the full ``k3-shard`` launches are marked slow. Planted mutants of the helpers (docs/planted-bugs.md) must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_exec_runner import run_cases

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[1]
GEMV = ("gemv.plain", "gemv.rmsnorm", "gemv.residual", "gemv.f32out")


def _cases_ci() -> list[dict]:
    cases: list[dict] = []
    for fam in GEMV:
        cases += [{"family": fam, "preset": "micro", "batch": b} for b in (1, 8, 64)]
        cases += [{"family": fam, "preset": "tiny", "batch": b} for b in (1, 64)]
    cases += [{"family": "gemv.lm_head", "preset": "micro", "batch": b} for b in (1, 8, 64)]
    cases += [{"family": "gemv.lm_head", "preset": "tiny", "batch": 8}]
    for fam in ("moe.bf16", "moe.mxfp4"):
        cases += [{"family": fam, "preset": "micro", "batch": b} for b in (1, 8, 64)]
        cases += [{"family": fam, "preset": "tiny", "batch": 8}]
    cases += [{"family": "attn_res", "preset": p, "batch": b} for p, b in (("micro", 1), ("micro", 64), ("tiny", 8),
                                                                          ("k3-shard", 8))]
    # the router's scores GEMV (gemv_kernel with the sigmoid epilogue); its top-k kernel is warp shuffles only
    cases += [{"family": "router", "preset": p, "batch": b} for p, b in (("micro", 1), ("tiny", 8), ("k3-shard", 64))]
    # k3-shard widths: the K walk (full lane rounds, unrolled steps, no partial round at K = 7168 / 12288) and
    # the last row blocks of the real grids; the experts at the real L / I (expert stride) with 8 of them
    cases += [{"family": "gemv.plain", "preset": "k3-shard", "batch": 8, "row_blocks": "corners"},
              {"family": "gemv.residual", "preset": "k3-shard", "batch": 64, "row_blocks": "corners"},
              {"family": "gemv.f32out", "preset": "k3-shard", "batch": 8},
              {"family": "moe.mxfp4", "preset": "k3-shard", "batch": 1, "shapes": {"E": 8, "topk": 4}},
              # batch 1 at K = 7168 (4 steps): the software-pipelined step loop (next step's loads, then the use)
              {"family": "gemv.rmsnorm", "preset": "k3-shard", "batch": 1, "row_blocks": "corners"},
              {"family": "moe.bf16", "preset": "k3-shard", "batch": 1, "shapes": {"E": 8, "topk": 4}}]
    # the megakernel's tile-GEMV helper (device_fns.weight_row_dot): staged and global rows, a partial last lane
    # round (K = 392: 49 chunks), batch tiles of 1 / 8 with unroll 6 / 8, with and without gamma
    cases += [_mk(1, 12, 392, 5, True), _mk(8, 12, 392, 5, False), _mk(64, 9, 2056, 0, True),
              _mk(8, 40, 7168, 40, True), _mk(1, 12, 7168, 5, True)]  # batch 1: 4 full steps of 6 chunks
    # as compiled for sm_100a (MKConfig.arch: unroll 2): full steps, then a 1-chunk tail (K = 2056: 257 chunks)
    sm100 = _mk(8, 12, 2056, 5, False)
    sm100["shapes"]["arch"] = "sm_100a"
    cases += [sm100]
    return cases


def _mk(B: int, N: int, K: int, staged: int, gamma: bool) -> dict:
    return {"family": "megakernel.tile_gemv", "preset": f"N{N}-K{K}-staged{staged}-gamma{int(gamma)}", "batch": B,
            "shapes": {"B": B, "N": N, "K": K, "staged": staged, "gamma": gamma}}


def _cases_slow() -> list[dict]:
    cases = [{"family": fam, "preset": "tiny", "batch": 8} for fam in GEMV]
    cases += [{"family": "gemv.lm_head", "preset": "tiny", "batch": b} for b in (1, 64)]
    cases += [{"family": fam, "preset": "tiny", "batch": b} for fam in ("moe.bf16", "moe.mxfp4") for b in (1, 64)]
    cases += [{"family": fam, "preset": "k3-shard", "batch": b} for fam in ("gemv.plain", "gemv.residual",
                                                                            "gemv.f32out") for b in (1, 8, 64)]
    cases += [{"family": "moe.mxfp4", "preset": "k3-shard", "batch": 8, "shapes": {"E": 16, "topk": 4}}]
    return cases


# Planted bugs (docs/planted-bugs.md): (module, [(original, mutated)]) and the case that must then fail. Each
# mutated line is the real one in the kernel module, so a refactor that moves it fails load_mutant loudly.
MUTANTS: dict[str, tuple[list, dict]] = {
    "gemv-row-tile": (["fused.gemv", [["return rg * WARPS + warp, bt * BT", "return rg * WARPS + warp + 1, bt * BT"]]],
                      {"family": "gemv.plain", "preset": "micro", "batch": 8}),
    "gemv-batch-tile": (["fused.gemv", [["return rg * WARPS + warp, bt * BT", "return rg * WARPS + warp, bt"]]],
                        {"family": "gemv.plain", "preset": "tiny", "batch": 64}),
    "gemv-lane-tail": (["fused.gemv", [["_dot_step(gW, gG, mX, x0, rounds * 32 + lane, acc, ssq, 1, BT)",
                                        "_dot_step(gW, gG, mX, x0, rounds * 32 + lane - 1, acc, ssq, 1, BT)"]]],
                       {"family": "gemv.rmsnorm", "preset": "tiny", "batch": 1}),
    # the pipelined step loop (batch below ROW_LOOP_FROM) loads the current step again instead of the next one
    "gemv-pipeline-next": (["fused.gemv", [["_load_w(gW, c0 + 32 * unroll, rn, unroll)",
                                            "_load_w(gW, c0, rn, unroll)"]]],
                           {"family": "gemv.rmsnorm", "preset": "k3-shard", "batch": 1, "row_blocks": "corners"}),
    # the batch-row loop (ROW_LOOP_FROM rows or more) keeps accumulating into row 0's accumulator
    "gemv-row-rotate": (["fused.gemv", [["acc[r] = acc[r + 1]", "acc[r] = acc[r]"]]],
                        {"family": "gemv.plain", "preset": "micro", "batch": 8}),
    # the MXFP4 decode lives in common.device (shared with the megakernel's expert opcodes): the fused kernel runs with
    # the mutated helpers through its import (host_exec.load_case_mutant)
    "mxfp4-nibble-order": (["common.device", [["return 8 * j + s + 4 * hi", "return 8 * j + 2 * s + hi"]]],
                           {"family": "moe.mxfp4", "preset": "micro", "batch": 8}),
    "mxfp4-scale-bias": (["common.device", [["((Uint32(e) + 14) << 23)", "((Uint32(e) + 15) << 23)"]]],
                         {"family": "moe.mxfp4", "preset": "micro", "batch": 1}),
    "mxfp4-sign-bit": (["common.device", [["((t & 0x00080008) << 12)", "((t & 0x00080008) << 11)"]]],
                       {"family": "moe.mxfp4", "preset": "micro", "batch": 1}),
    "moe-expert-slot": (["fused.moe", [["return mActE[a], mActStart[a], mActCount[a]",
                                        "return a, mActStart[a], mActCount[a]"]]],
                        {"family": "moe.bf16", "preset": "micro", "batch": 1}),
    "moe-token-tile": (["fused.moe", [["pair[t] = mSorted[start + cutlass.min(t0 + t, cnt - 1)]",
                                       "pair[t] = mSorted[start + cutlass.min(t, cnt - 1)]"]]],
                       {"family": "moe.bf16", "preset": "micro", "batch": 64}),
    "attn-res-chunk-order": (["fused.attn_res", [["cute.copy(ld_v, gV[(None, tidx + c * NT)], rv[None, c, j])",
                                                  "cute.copy(ld_v, gV[(None, tidx * CH + c)], rv[None, c, j])"]]],
                             {"family": "attn_res", "preset": "k3-shard", "batch": 8}),
    "mk-weight-row": (["megakernel.device_fns", [["gchunks(wrow0 + Int64(j) * Int64(nch) * 16)",
                                                  "gchunks(wrow0 + Int64(j - 1) * Int64(nch) * 16)"]]],
                      _mk(8, 12, 392, 5, False)),
    "mk-stage-row": (["megakernel.device_fns", [["row_dot(stage, j * nch, True,",
                                                 "row_dot(stage, (j + 1) * nch, True,"]]],
                     _mk(8, 12, 392, 5, False)),
    # the tile GEMV's last, predicated step: chunks past the row's end (read at its last chunk) keep weight 1
    "mk-tail-mask": (["megakernel.device_fns", [["w = w * (Float32(1.0) if c + 32 * u < lim else Float32(0.0))",
                                                 "w = w * Float32(1.0)"]]], _mk(1, 12, 392, 5, True)),
    # the tile GEMV's batch-row loop (3 or more rows per pass) drops the x row stride
    "mk-row-stride": (["megakernel.device_fns", [["xb = x0 + b * xs  # row b of the pass", "xb = x0 + b"]]],
                      _mk(8, 12, 392, 5, False)),
}


def _run(cases: list[dict], tmp: Path, timeout: int) -> list[dict]:
    return run_cases("kimik3.kernels.verify.host_exec", cases, tmp, timeout)


def _name(c: dict) -> str:
    extra = "-corners" if c.get("row_blocks") else ("-" + ",".join(f"{k}{v}" for k, v in c["shapes"].items())
                                                    if c.get("shapes") else "")
    return f"{c['family']}/{c['preset']}/b{c['batch']}{extra}"


@pytest.fixture(scope="module")
def ci_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    res = _run(_cases_ci(), tmp_path_factory.mktemp("host"), timeout=900)
    return {_name(r["case"]): r for r in res}


@pytest.fixture(scope="module")
def mutant_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cases = [{**case, "mutant": mut} for mut, case in MUTANTS.values()]
    res = _run(cases, tmp_path_factory.mktemp("mutants"), timeout=600)
    return dict(zip(MUTANTS, res))


@pytest.mark.parametrize("name", [_name(c) for c in _cases_ci()])
def test_host_execution_matches_reference(name: str, ci_results: dict[str, dict]) -> None:
    r = ci_results[name]
    assert r["ok"], f"{name}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"
    assert r["lanes"] > 0


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_mutant_is_caught(mutant: str, mutant_results: dict[str, dict], ci_results: dict[str, dict]
                                  ) -> None:
    r = mutant_results[mutant]
    clean = dict(MUTANTS[mutant][1])
    if _name(clean) in ci_results:  # the same case without the mutant passes: the failure is the mutant's
        assert ci_results[_name(clean)]["ok"]
    assert not r["ok"], f"planted bug {mutant} not caught: errors {r['errors']}, problems {r['problems']}"


def test_batch_tile_mutant_needs_a_large_batch(tmp_path: Path) -> None:
    """Why the CI runs batch 64: the dropped batch-tile offset is invisible while one tile holds the batch."""
    mut, case = MUTANTS["gemv-batch-tile"]
    (r,) = _run([{**case, "batch": 8, "mutant": mut}], tmp_path, timeout=300)
    assert r["ok"], r


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases_slow(), ids=_name)
def test_host_execution_full(case: dict, tmp_path: Path) -> None:
    (r,) = _run([case], tmp_path, timeout=3600)
    assert r["ok"], f"{_name(case)}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"


def test_warp_sum_is_the_butterfly_order() -> None:
    from kimik3.kernels.verify.host_exec import warp_sum

    p = torch.randn(3, 32, 5)
    lane = torch.arange(32)
    ref = p.clone()
    for off in (16, 8, 4, 2, 1):  # lane l: x += shfl_bfly(x, off), i.e. its partner l ^ off
        ref = ref + ref[:, lane ^ off, :]
    assert torch.equal(warp_sum(p, 1), ref[:, 0, :])
    assert torch.allclose(warp_sum(p, 1), p.sum(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lanes"):
        warp_sum(p, 2)


def test_moe_align_specification() -> None:
    from kimik3.kernels.verify.host_exec import moe_align

    ids = torch.tensor([[3, 1], [1, 0], [3, 2]], dtype=torch.int32)
    al = moe_align(ids, 6)
    assert al["sorted"].tolist() == [3, 1, 2, 5, 0, 4]  # pairs of experts 0, 1, 1, 2, 3, 3 (stable)
    assert al["act_e"].tolist()[:4] == [0, 1, 2, 3] and al["act_start"].tolist()[:4] == [0, 1, 3, 4]
    assert al["act_count"].tolist()[:4] == [1, 2, 1, 2] and int(al["n_act"][0]) == 4
    with pytest.raises(ValueError, match="slots"):
        moe_align(ids, 3)


def test_load_mutant_rejects_a_missing_line() -> None:
    from kimik3.kernels.verify.host_exec import load_mutant

    with pytest.raises(ValueError, match="occurs 0 times"):
        load_mutant("fused.gemv", [("this line is not in fused/gemv.py", "x")])


def test_shared_module_mutant_reaches_the_kernel_module_that_imports_it() -> None:
    """A mutant of common.device comes back as the case's kernel module importing the mutated copy (both import
    forms: ``from kimik3.kernels.common import device as C`` in fused.moe, ``from kimik3.kernels.common.device import
    ...`` in megakernel.moe); a module that does not import it is refused, since the mutant could not reach its
    device code."""
    from kimik3.kernels.verify.host_exec import load_case_mutant

    mut = MUTANTS["mxfp4-nibble-order"][0]
    name, moe = load_case_mutant(mut, "fused.moe")
    assert name == "fused.moe" and moe.__name__ == "kimik3.kernels.fused._mutant_moe"
    assert moe.C.__name__ == "kimik3.kernels.common._mutant_device"
    assert [moe.C.fp4_pair_col(q) for q in range(4)] == [0, 1, 2, 3]  # the mutant's adjacent columns (was 0, 4, 1, 5)
    name, mk = load_case_mutant(mut, "megakernel.moe")
    assert name == "megakernel.moe" and mk.x_pair_bf16x2.__module__ == "kimik3.kernels.common._mutant_device"
    assert load_case_mutant(["fused.gemv", []], "fused.moe")[0] == "fused.gemv"  # a kernel module's own mutant
    with pytest.raises(ValueError, match="does not import common.device"):
        load_case_mutant(mut, "contracts.meta")
    with pytest.raises(ValueError, match="no kernel module 'gemv'"):  # named by the dotted path under kernels/
        load_case_mutant(["gemv", []], "fused.moe")


def _mutant_names(path: Path) -> set[str]:
    """The keys of the ``MUTANTS`` dict a host-execution test module defines (read from its source, not imported)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "MUTANTS" for t in targets):
            keys = node.value.keys if isinstance(node.value, ast.Dict) else [None]
            assert all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys), (
                f"{path.name}: MUTANTS must be a dict literal with string keys (this test reads it from the source)")
            return {k.value for k in keys}
    return set()


def test_planted_bug_table_matches_the_tests() -> None:
    """docs/planted-bugs.md lists exactly the mutants above and those of the other host-execution test modules
    (tests/test_host_exec_*.py), and every test it names exists."""
    import re

    doc = (ROOT / "docs" / "planted-bugs.md").read_text()
    others = [_mutant_names(f) for f in sorted((ROOT / "tests").glob("test_host_exec_*.py"))]
    assert set(re.findall(r"\[([a-z0-9-]+)\]`", doc)) == set(MUTANTS).union(*others)
    defined = {m for f in (ROOT / "tests").glob("test_*.py")
               for m in re.findall(r"^def (test_\w+)", f.read_text(), re.M)}
    modules = {f.stem for f in (ROOT / "tests").glob("test_*.py")}
    named = set(re.findall(r"(test_\w+)", doc)) - {"test_host_exec", "test_ptx_lint", "test_megakernel_hazards"}
    named -= modules  # a test module named in a path (tests/test_x.py::...), not a test function
    assert named and named <= defined, sorted(named - defined)
