"""The megakernel's cross-rank device code (``kernels/megakernel/collective.py``, ``misc.argmax_pick``) executed on the
host over one rank's program of a deployment.

``kimik3.kernels.verify.host_exec_mk_ranks`` runs ALLREDUCE_MIX's rank-order sum over every thread and chunk, then
its AttnRes mix, ARGMAX_ALL's walk over every rank's tiles and MOE_COMBINE's latent sum and norm, against the CPU
interpreter's bodies on the same buffers; every PUSH operand's copy is checked to cover its box byte for byte, once.
micro and tiny, worlds of 2 and 4, ranks at both ends; planted bugs (a source dropped from either sum, start and
accumulate swapped, every batch row pushed as the first, one rank's tiles only, the norm weight's chunk) must fail.
Through a subprocess, as every host execution.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from host_exec_runner import run_with_mutants

pytestmark = pytest.mark.host

CASES: list[dict] = [
    {"family": "mk.ranks", "preset": "micro", "batch": 2, "world": 2, "rank": 0, "local_ranks": True},
    {"family": "mk.ranks", "preset": "micro", "batch": 8, "world": 4, "rank": 3},
    {"family": "mk.ranks", "preset": "tiny", "batch": 3, "world": 2, "rank": 1},
]

_B8 = {"family": "mk.ranks", "preset": "micro", "batch": 8, "world": 4, "rank": 3}
MUTANTS: dict[str, tuple[list, dict]] = {
    # the second rank's partial left out of the sum
    "mk-allreduce-source-dropped": (["megakernel.collective", [["for r in cutlass.range(r0 + 1, r1, unroll=1):",
                                                                "for r in cutlass.range(r0 + 2, r1, unroll=1):"]]],
                                    CASES[0]),
    # a block's first all-reduce accumulates onto stale data, a later one starts anew
    "mk-allreduce-start-vs-accumulate": (["megakernel.collective", [[
        "if (operand_mode(ctx, Int32(2)) & MODE_READ) != 0:", "if (operand_mode(ctx, Int32(2)) & MODE_READ) == 0:"]]],
        CASES[0]),
    # every batch row of a push copied from (and to) the box's first
    "mk-push-batch-row": (["megakernel.collective", [["_bx(ctx, j, B0) + db, _bx(ctx, j, R0) + dr",
                                                      "_bx(ctx, j, B0), _bx(ctx, j, R0) + dr"]]], CASES[0]),
    # ARGMAX_ALL walks rank 0's tiles only (ARGMAX, one rank's d1 = 1, cannot tell)
    "mk-argmax-all-one-rank": (["megakernel.misc", [["T = ctx.s_d1[0] * ctx.s_d2[0]", "T = ctx.s_d2[0]"]]], _B8),
    # the latent combine leaves the first rank's expert partial out
    "mk-combine-source-dropped": (["megakernel.collective", [["for r in cutlass.range(r0, r1, unroll=1):",
                                                              "for r in cutlass.range(r0 + 1, r1, unroll=1):"]]],
                                  CASES[2]),
    # a launch of several ranks whose grid they do not divide splits it anyway (the last CTAs past every rank)
    "mk-local-ranks-uneven": (["megakernel.vm", [["split = split & (cpr * nloc == grid)", "split = split"]]],
                              CASES[0]),
    # every chunk normalised with the norm weight's first chunk
    "mk-combine-norm-chunk": (["megakernel.collective", [["gchunks(ctx.s_addr[1])[(c, None)]",
                                                          "gchunks(ctx.s_addr[1])[(0, None)]"]]], CASES[2]),
}


def _name(c: dict) -> str:
    return f"{c['preset']}-b{c['batch']}-w{c['world']}-r{c['rank']}"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_with_mutants("kimik3.kernels.verify.host_exec_mk_ranks", CASES, MUTANTS,
                            tmp_path_factory.mktemp("mk_ranks"), 900, _name)


@pytest.mark.parametrize("name", [_name(c) for c in CASES])
def test_collective_host_execution_matches_the_interpreter(name: str, results: dict[str, dict]) -> None:
    r = results[name]
    assert r["ok"], r["problems"]
    assert r["errors"]["ALLREDUCE_MIX.stream"] == 0.0  # the rank-order fp32 sum, bit for bit
    assert r["lanes"] > 0


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_collective_mutant_is_caught(mutant: str, results: dict[str, dict]) -> None:
    assert results[_name(MUTANTS[mutant][1])]["ok"], "the clean case must pass first"
    r = results[f"mutant:{mutant}"]
    assert not r["ok"], f"{mutant} was not caught"


def test_a_single_gpu_program_has_no_collective_to_run(tmp_path: Path) -> None:
    from host_exec_runner import run_cases

    r = run_cases("kimik3.kernels.verify.host_exec_mk_ranks",
                  [{"family": "mk.ranks", "preset": "micro", "batch": 2, "world": 1, "rank": 0}], tmp_path, 600)[0]
    assert not r["ok"] and any("no ['ALLREDUCE_MIX', 'ARGMAX_ALL', 'MOE_COMBINE', 'PUSH']" in p for p in r["problems"])
