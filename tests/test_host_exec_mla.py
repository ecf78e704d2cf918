"""The fused MLA decode kernels' device code executed on the host (``kimik3.kernels.verify.host_exec_mla``).

The split kernel's helpers (which heads, split and cache positions a block / warp / lane owns, the lane's q·c
partial dots, the mask, running max and online softmax update, the store addresses) and the combine's run over the
blocks, warps and lanes of real launches; the warp sums in the butterfly order; outputs poisoned and every store
counted; every cache position a split loads checked against its sequence, every position attended once per head.

Whole launches at ``tiny`` widths (batch 1 and a ragged batch 8 whose lengths include 1, a full cache and lengths
that are not multiples of the split size, so splits are short or empty) and at a small shape with one head per warp
and three head groups (``micro``'s kv_lora 32 is below the kernel's lane layout: the kernel and the harness refuse
it). At ``k3-shard`` widths: the corner blocks of batch 8 and every block of batch 1 (22 splits), every lane in the
dot pass and sampled lanes in the softmax pass; the full ``k3-shard`` launches are marked slow. Planted mutants
(docs/planted-bugs.md) must fail. Host runs go through a subprocess: a device-only instruction reached on the host
aborts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from host_exec_runner import run_cases

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[1]
RAGGED8 = [256, 1, 37, 130, 255, 4, 5, 67]  # tiny, 4 splits: full, single token, short / empty late splits
SMALL = {"preset": "tiny", "batch": 3, "shapes": {"B": 3, "nh": 9, "S": 40, "nsplit": 3}, "lens": [40, 1, 23]}


def _cases_ci() -> list[dict]:
    return [
        {"preset": "tiny", "batch": 1},
        {"preset": "tiny", "batch": 8, "lens": RAGGED8},
        # one head per warp and several head groups (nh = 9: HPW 1, 3 warps, 3 CTAs), 3 splits of a 40-token cache
        SMALL,
        {"preset": "k3-shard", "batch": 8, "blocks": "corners", "lanes": "sampled",
         "lens": [4096, 1, 3000, 17, 1000, 2051, 4093, 2050]},
        {"preset": "k3-shard", "batch": 1, "lanes": "sampled", "lens": [4093]},
    ]


def _cases_slow() -> list[dict]:
    return [{"preset": "tiny", "batch": 64},
            {"preset": "k3-shard", "batch": 1},
            {"preset": "k3-shard", "batch": 8, "lens": [4096, 1, 3000, 17, 1000, 2051, 4093, 2050]},
            {"preset": "k3-shard", "batch": 64}]


_SPLIT_END = "return t0, cutlass.min(t0 + chunk, n)"
# Planted bugs (docs/planted-bugs.md): (module, [(original, mutated)]) and the case that must then fail. Each
# mutated line is the real one in kernels/fused/mla_decode.py, so a refactor that moves it fails load_mutant loudly.
MUTANTS: dict[str, tuple[list, dict]] = {
    "mla-split-last-dropped": (["fused.mla_decode", [[_SPLIT_END, _SPLIT_END + " - 1"]]],
                               {"preset": "tiny", "batch": 8, "lens": RAGGED8}),
    "mla-split-past-end": (["fused.mla_decode", [[_SPLIT_END, "return t0, cutlass.min(t0 + chunk, n + 1)"]]],
                           {"preset": "tiny", "batch": 8, "lens": RAGGED8}),
    "mla-softmax-sum-rescale": (["fused.mla_decode", [["lsum[hh] = lsum[hh] * corr", "lsum[hh] = lsum[hh]"]]],
                                {"preset": "tiny", "batch": 8, "lens": RAGGED8}),
    "mla-warp-heads": (["fused.mla_decode", [["return (hg * WARPS + warp) * HPW", "return (hg + warp) * HPW"]]], SMALL),
    "mla-combine-weight": (["fused.mla_decode", [["L = L + w * mPartL[b, h, sp]", "L = L + mPartL[b, h, sp]"]]],
                           {"preset": "tiny", "batch": 8, "lens": RAGGED8}),
}


def _run(cases: list[dict], tmp: Path, timeout: int) -> list[dict]:
    return run_cases("kimik3.kernels.verify.host_exec_mla", cases, tmp, timeout)


def _name(c: dict) -> str:
    extra = "".join(f"-{k}{v}" for k, v in c.get("shapes", {}).items())
    extra += "-corners" if c.get("blocks") == "corners" else ""
    extra += "-lanes" if c.get("lanes") == "sampled" else ""
    return f"mla/{c['preset']}/b{c['batch']}{extra}"


@pytest.fixture(scope="module")
def ci_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    res = _run(_cases_ci(), tmp_path_factory.mktemp("host_mla"), timeout=900)
    return {_name(r["case"]): r for r in res}


@pytest.fixture(scope="module")
def mutant_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cases = [{**case, "mutant": mut} for mut, case in MUTANTS.values()]
    res = _run(cases, tmp_path_factory.mktemp("host_mla_mutants"), timeout=600)
    return dict(zip(MUTANTS, res))


@pytest.mark.parametrize("name", [_name(c) for c in _cases_ci()])
def test_mla_host_execution_matches_reference(name: str, ci_results: dict[str, dict]) -> None:
    r = ci_results[name]
    assert r["ok"], f"{name}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"
    assert r["lanes"] > 0 and {"part_o", "part_m", "part_l", "o"} <= set(r["errors"])


def test_mla_ci_cases_cover_short_and_empty_splits(ci_results: dict[str, dict]) -> None:
    """The ragged batch has splits that end inside a step (lengths not multiples of the split size: masked rows)
    and empty splits (sequences shorter than the splits); the k3-shard batch-1 launch walks all its 22 splits."""
    r = ci_results[_name({"preset": "tiny", "batch": 8})]["splits"]
    assert r["tail"] > 0 and r["empty"] > 0, r
    k3 = ci_results[_name({"preset": "k3-shard", "batch": 1, "lanes": "sampled"})]
    assert k3["nsplit"] == 22 and k3["splits"]["empty"] == 0 and k3["splits"]["tail"] > 0, k3["splits"]


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mla_planted_mutant_is_caught(mutant: str, mutant_results: dict[str, dict], ci_results: dict[str, dict]
                                      ) -> None:
    r = mutant_results[mutant]
    clean = _name(MUTANTS[mutant][1])
    assert ci_results[clean]["ok"]  # the same case without the mutant passes: the failure is the mutant's
    assert not r["ok"], f"planted bug {mutant} not caught: errors {r['errors']}, problems {r['problems']}"


def test_mla_split_mutants_are_reported_as_positions(mutant_results: dict[str, dict]) -> None:
    """The off-by-one split ends are named by the position checks, not only by the numbers."""
    dropped = mutant_results["mla-split-last-dropped"]["problems"]
    assert any("never attended" in p for p in dropped), dropped
    past = mutant_results["mla-split-past-end"]["problems"]
    assert any("outside its sequence" in p for p in past), past


def test_mla_host_refuses_shapes_the_kernel_cannot_run() -> None:
    from kimik3.kernels.verify.host_exec_mla import run_case

    with pytest.raises(ValueError, match="multiple of 128"):
        run_case({"preset": "micro", "batch": 1})


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases_slow(), ids=_name)
def test_mla_host_execution_full(case: dict, tmp_path: Path) -> None:
    (r,) = _run([case], tmp_path, timeout=3600)
    assert r["ok"], f"{_name(case)}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"
