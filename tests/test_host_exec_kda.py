"""The KDA device code executed on the host: the fused ``kda`` kernel and the megakernel's KDA_STEP opcode.

``kimik3.kernels.verify.host_exec_kda`` runs the same ``@cute.jit`` helpers the two kernels call (which channels, state
rows and columns, heads and sequences a CTA / thread owns; the conv + SiLU, decay gate, l2norm scalars, delta-rule
update, Sᵀk / Sᵀq partials and gated RMSNorm) over every CTA and thread of a real launch (the megakernel: every
KDA_STEP instruction of one layer of the scheduled program), does the CTA reductions in the kernel's order, writes
the state and the output into poisoned copies with every store counted, and compares with the model's KDA math.
Host runs go through a subprocess: a device-only instruction reached on the host aborts the process.

In CI: whole launches at ``micro`` (the megakernel; the fused kernel needs a head dim of 32 or more) and ``tiny``
(batch 8: several sequences), one whole ``k3-shard`` layer at batch 1 (every CTA, every KDA_STEP instruction), and
the corners and edges (first and last two heads and sequences) of every instruction's tile at batch 8; the other
batch sizes and the full ``k3-shard`` launches at batch 8 and 64 are marked slow. Planted mutants
(docs/planted-bugs.md) must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from host_exec_runner import run_cases

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[1]


def _cases_ci() -> list[dict]:
    # whole launches; at k3-shard widths one whole layer at batch 1 (every CTA / instruction), and the corners and
    # edges (first and last two heads and sequences) of every KDA_STEP instruction at batch 8
    cases = [{"family": "kda", "preset": p, "batch": b} for p, b in (("tiny", 8), ("k3-shard", 1))]
    cases += [{"family": "mk_kda", "preset": p, "batch": b} for p, b in (("micro", 1), ("tiny", 8), ("k3-shard", 1))]
    cases += [{"family": "mk_kda", "preset": "k3-shard", "batch": 8, "pairs": "corners"}]
    return cases


def _cases_slow() -> list[dict]:
    cases = [{"family": "kda", "preset": p, "batch": b} for p, b in (("tiny", 1), ("tiny", 64), ("k3-shard", 8),
                                                                     ("k3-shard", 64))]
    cases += [{"family": "mk_kda", "preset": p, "batch": b} for p, b in (("micro", 8), ("micro", 64), ("tiny", 1),
                                                                        ("tiny", 64), ("k3-shard", 8),
                                                                        ("k3-shard", 64))]
    return cases


# Planted bugs (docs/planted-bugs.md): (module, [(original, mutated)]) and the case that must then fail. Each
# mutated line is the real one in the kernel module, so a refactor that moves it fails load_mutant loudly.
MUTANTS: dict[str, tuple[list, dict]] = {
    "kda-state-row": (["fused.kda", [["return ks * RS + r\n", "return ks * RS + r + 1\n"]]],
                      {"family": "kda", "preset": "tiny", "batch": 8}),
    "kda-read-before-update": (["fused.kda", [["pacc[cc] = rq * (D**-0.5) * (pj + QK * rk * d)",
                                               "pacc[cc] = rq * (D**-0.5) * pj"]]],
                               {"family": "kda", "preset": "tiny", "batch": 8}),
    "mk-kda-state-row": (["megakernel.kda", [["return p * R + r\n", "return p * R + r + 1\n"]]],
                         {"family": "mk_kda", "preset": "micro", "batch": 1}),
    "mk-kda-state-col": (["megakernel.kda", [["return tidx % dk, tidx // dk", "return tidx % dk + 1, tidx // dk"]]],
                         {"family": "mk_kda", "preset": "micro", "batch": 1}),
    "mk-kda-decay-after-update": (
        ["megakernel.kda",
         [["s = S[kda_state_offset(srow, ii, vcol, dk)] * sf[sdec + ii] + (sf[sk + ii] * rk) * delta",
           "s = (S[kda_state_offset(srow, ii, vcol, dk)] + (sf[sk + ii] * rk) * delta) * sf[sdec + ii]"]]],
        {"family": "mk_kda", "preset": "micro", "batch": 1}),
}


def _run(cases: list[dict], tmp: Path, timeout: int) -> list[dict]:
    return run_cases("kimik3.kernels.verify.host_exec_kda", cases, tmp, timeout)


def _name(c: dict) -> str:
    return f"{c['family']}/{c['preset']}/b{c['batch']}" + (f"-{c['pairs']}" if c.get("pairs") else "")


@pytest.fixture(scope="module")
def all_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The CI cases, then the mutants, in one subprocess (one import of the DSL)."""
    cases = _cases_ci() + [{**case, "mutant": mut} for mut, case in MUTANTS.values()]
    return _run(cases, tmp_path_factory.mktemp("host_kda"), timeout=1200)


@pytest.fixture(scope="module")
def ci_results(all_results: list[dict]) -> dict[str, dict]:
    return {_name(r["case"]): r for r in all_results[:len(_cases_ci())]}


@pytest.fixture(scope="module")
def mutant_results(all_results: list[dict]) -> dict[str, dict]:
    return dict(zip(MUTANTS, all_results[len(_cases_ci()):]))


@pytest.mark.parametrize("name", [_name(c) for c in _cases_ci()])
def test_kda_host_execution_matches_reference(name: str, ci_results: dict[str, dict]) -> None:
    r = ci_results[name]
    assert r["ok"], f"{name}: problems {r['problems']}, errors {r['errors']} (tolerances {r['tol']})"
    assert r["lanes"] > 0


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_kda_planted_mutant_is_caught(mutant: str, mutant_results: dict[str, dict], ci_results: dict[str, dict]
                                     ) -> None:
    r = mutant_results[mutant]
    clean = dict(MUTANTS[mutant][1])
    assert ci_results[_name(clean)]["ok"]  # the same case without the mutant passes: the failure is the mutant's
    assert not r["ok"], f"planted bug {mutant} not caught: errors {r['errors']}, problems {r['problems']}"


def test_kda_state_row_mutant_is_caught_by_the_write_count(mutant_results: dict[str, dict]) -> None:
    """The off-by-one state row is reported as stores, not only as a numeric difference: the first row of a head is
    never stored, the row past the last lands in the next head or past the buffer."""
    for name in ("kda-state-row", "mk-kda-state-row"):
        problems = " ".join(mutant_results[name]["problems"])
        assert "not written exactly once" in problems or "not written as owned" in problems, (name, problems)
        assert "outside the buffer" in problems, (name, problems)


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases_slow(), ids=_name)
def test_kda_host_execution_full(case: dict, tmp_path: Path) -> None:
    (r,) = _run([case], tmp_path, timeout=3600)
    assert r["ok"], f"{_name(case)}: problems {r['problems']}, errors {r['errors']} (tolerances {r['tol']})"


def test_mk_kda_rejects_bad_arguments() -> None:
    from kimik3.kernels.verify.host_exec_kda import run_mk_kda

    with pytest.raises(ValueError, match="pairs"):
        run_mk_kda("micro", 1, pairs="some")
