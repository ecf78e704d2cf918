"""The router's top-k and the megakernel's MoE and misc opcodes executed on the host (``host_exec_router``).

The fused router's ``topk_kernel`` and the megakernel's ROUTER, EXPERT_GATE_UP, EXPERT_DOWN, EMBED, ATTN_RES_MIX and
ARGMAX run the same ``@cute.jit`` helpers the GPU code calls (candidates, lane arg-max, the tie-break, retirement,
weights, slot weights / use flags; which slot, expert, row and token a warp and lane handle, the per-lane dots, the
fp32 combine; the embedding row, the AttnRes partial sums and mix, the arg-max pick) over every warp / lane / thread
of real launches; the butterfly exchanges are replayed in the shuffle order, the router's ballot compaction and the
epilogues in Python, stores counted into poisoned outputs. References: the model's router and a stable top-k
specification (fused router), the CPU interpreter's opcode bodies on the same buffers (megakernel). Host runs go
through a subprocess: a device-only instruction reached on the host aborts the process.

Whole programs at ``micro`` and ``tiny``; at ``k3-shard`` the first MoE layer's tile corners (first / last slot x
first / last row tile, every lane) and the misc opcodes; the full ``tiny`` batch-8 / ``k3-shard`` layers are slow.
Programs carrying MXFP4 routed experts (``expert_format="mxfp4"``: the kernel compiled with ``MKConfig.fp4`` decodes
codes and E8M0 scales to bf16 registers for ``mma.sync``; on the host every lane's code runs and only the mma is
evaluated by ``megakernel.mma.mma_reference``) run their first MoE layer against the interpreter's dequantise-then-dense
bodies (every layer runs the same code on the same shapes); their whole programs are slow.
Planted mutants (docs/planted-bugs.md) must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from host_exec_runner import run_cases

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[1]
GROUPED = {"n_group": 4, "topk_group": 2}
# dense routed experts on tensor cores (batch >= 8), every token routed to expert 0 among others: the dense
# tensor-core mutants' case
DENSE33 = {"family": "mk.moe", "preset": "micro", "batch": 33, "crowd": True}
# MXFP4 routed experts, the first MoE layer of a micro batch-8 program: the MXFP4 mutants' case
MX8 = {"family": "mk.moe", "preset": "micro", "batch": 8, "layers": "first_moe", "expert_format": "mxfp4"}
# rank 1 of 2: the second half of the experts
RANK = {"family": "mk.moe", "preset": "tiny", "batch": 8, "layers": "first_moe", "world": 2, "rank": 1}


def _cases_ci() -> list[dict]:
    cases = [{"family": "router", "preset": p, "batch": b} for p, b in (("micro", 1), ("tiny", 8))]
    # k3-shard: the top-k at E = 56, k = 16 (two candidates per lane) from the reference scores
    cases += [{"family": "router", "preset": "k3-shard", "batch": 64, "gemv": False}]
    cases += [{"family": "router.ties", "preset": "tiny", "batch": 8}]
    # grouped routing (no preset uses it; the kernel compiles it for n_group > topk_group): 4 groups, the best 2
    cases += [{"family": f, "preset": "tiny", "batch": 8, "shapes": GROUPED} for f in ("router", "router.ties")]
    # mk.moe: ROUTER -> EXPERT_GATE_UP -> EXPERT_DOWN all host-executed; mk.<OPCODE>: that opcode, its producers by
    # the reference (batch 64: two combine accumulators per lane, experts with many tokens)
    cases += [{"family": "mk.moe", "preset": p, "batch": b} for p, b in (("micro", 64), ("tiny", 1))]
    # dense experts on tensor cores in pass groups at an odd batch: expert 0 takes every token (three groups of 16
    # list positions, the last one partial), others none
    cases += [DENSE33]
    cases += [{"family": "mk.ROUTER", "preset": "micro", "batch": 8, "ties": True},
              {"family": "mk.EXPERT_DOWN", "preset": "micro", "batch": 8}]
    cases += [{"family": "mk.misc", "preset": p, "batch": b} for p, b in (("micro", 8), ("tiny", 1))]
    cases += [{"family": "mk.moe", "preset": "k3-shard", "batch": 1, "layers": "first_moe", "sample": "corners"},
              {"family": "mk.misc", "preset": "k3-shard", "batch": 1}]
    # MXFP4 experts (tensor cores: 16-row x 8-token work items), the first MoE layer (every layer runs the same code
    # on the same shapes; whole programs, and k3-shard's first MoE layer with its 112 / 96 groups, are slow): a pass
    # of 8 tokens (micro batch 8), several passes and 16 combine accumulators per lane and row (micro batch 64),
    # multi-block rows (tiny: 6 gate/up groups, a partial k block, and 8 down groups)
    cases += [MX8, {**MX8, "batch": 64}, {**MX8, "preset": "tiny", "batch": 1}]
    # tiles whose rows are not a multiple of 16: the work item's rows past the box's end read its last row and are
    # not stored (EXPERT_DOWN: 7 rows; EXPERT_GATE_UP: 20 + 12 rows)
    cases += [{**MX8, "family": "mk.EXPERT_DOWN", "tiling": {"expert_down_rows": 7}},
              {**MX8, "family": "mk.EXPERT_GATE_UP", "tiling": {"expert_rows": 20}}]
    # one rank's program: its experts only take slots, by their index among the rank's (the weights it holds)
    cases += [RANK, {**MX8, "world": 4, "rank": 3}]
    return cases


def _cases_slow() -> list[dict]:
    cases = [{"family": "mk.moe", "preset": "tiny", "batch": b} for b in (8, 64)]
    cases += [{"family": "mk.misc", "preset": "tiny", "batch": 64}]
    cases += [{"family": "mk.moe", "preset": "k3-shard", "batch": b, "layers": "first_moe"} for b in (1, 8)]
    cases += [{"family": "mk.moe", "preset": p, "batch": b, "expert_format": "mxfp4"}
              for p, b in (("micro", 8), ("micro", 64), ("tiny", 1), ("tiny", 8), ("tiny", 64))]
    cases += [{"family": "mk.moe", "preset": "k3-shard", "batch": b, "layers": "first_moe", "expert_format": "mxfp4"}
              for b in (1, 8)]
    cases += [{"family": "router", "preset": "k3-shard", "batch": b} for b in (1, 8, 64)]
    return cases


# Planted bugs (docs/planted-bugs.md): (module, [(original, mutated)]) and the case that must then fail. Each mutated
# line is the real one in the kernel module, so a refactor that moves it fails load_mutant loudly.
MUTANTS: dict[str, tuple[list, dict]] = {
    "topk-tie-break": (["common.device", [["return (v > bv) | ((v == bv) & (i < bi))",
                                          "return (v > bv) | ((v == bv) & (i > bi))"]]],
                       {"family": "router.ties", "preset": "tiny", "batch": 8}),
    "topk-group-keep": (["fused.router", [["keep = keep | ((ix[j] // GS == g) & (rank < TOPK_GROUP))",
                                           "keep = keep | ((ix[j] // GS == g) & (rank <= TOPK_GROUP))"]]],
                        {"family": "router", "preset": "tiny", "batch": 8, "shapes": GROUPED}),
    "mk-router-tie-break": (["common.device", [["return (v > bv) | ((v == bv) & (i < bi))",
                                                "return (v > bv) | ((v == bv) & (i > bi))"]]],
                            {"family": "mk.ROUTER", "preset": "micro", "batch": 8, "ties": True}),
    "mk-router-compaction": (["megakernel.router", [["return base + cute.arch.popc(bal & below)",
                                                     "return base + cute.arch.popc(bal & ~below)"]]],
                             {"family": "mk.ROUTER", "preset": "micro", "batch": 8, "ties": True}),
    "mk-router-rank-expert-id": (["megakernel.router", [["return Int64(e - lo)", "return Int64(e)"]]], RANK),
    "mk-router-rank-range": (["megakernel.router", [["return used & (e >= lo) & (e < hi)",
                                                     "return used & (e < hi)"]]], RANK),
    "mk-down-expert-stride": (["megakernel.moe", [[
        "wv = gchunks(ctx.s_addr[4] + expert_row_offset(ctx.s_d1[4], ctx.s_d2[4], e, r, Int64) * 2)",
        "wv = gchunks(ctx.s_addr[4] + (Int64(e) + Int64(r)) * Int64(ctx.s_d2[4]) * 2)"]]],
        {"family": "mk.moe", "preset": "tiny", "batch": 1}),  # (the CUDA-core path: below batch 8)
    "mk-down-slot-row": (["megakernel.moe", [["(b * ctx.s_d1[0] + j) * hs", "(b * ctx.s_d1[0]) * hs"]]],
                         {"family": "mk.EXPERT_DOWN", "preset": "micro", "batch": 8}),
    "mk-down-list-weight": (["megakernel.moe", [["mw[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), j)]",
                                                 "mw[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), p)]"]]],
                            {"family": "mk.EXPERT_DOWN", "preset": "micro", "batch": 8}),
    "mk-down-out-col": (["megakernel.moe", [["return _eoff(ctx.s_d1[5], ctx.s_d2[5], b, row, r)",
                                             "return _eoff(ctx.s_d1[5], ctx.s_d2[5], b, row, r + 1)"]]],
                        {"family": "mk.EXPERT_DOWN", "preset": "micro", "batch": 8}),
    "mk-argmax-last-max": (["megakernel.misc", [["take = v > best", "take = v >= best"]]],
                           {"family": "mk.misc", "preset": "micro", "batch": 8}),
    # dense experts on tensor cores (kernels/megakernel/moe.py dense_mma_tile and the opcodes' group loops). The
    # token-list offset: each column's x row one list position late (its token's neighbour's activations)
    "mk-dense-token-pos": (["megakernel.moe", [["cutlass.min(t0 + g + p * MMA_COLS, n - 1)",
                                                "cutlass.min(t0 + g + p * MMA_COLS + 1, n - 1)"]]], DENSE33),
    # the list's edge: the pass groups counted for one token fewer (a list of 16m + 1 tokens loses its last group)
    "mk-dense-list-end": (["megakernel.moe", [["return mk_addr.expert_groups(n, P)",
                                               "return mk_addr.expert_groups(n - 1, P)"]]], DENSE33),
    # the accumulator pass: every pass of a group takes the first pass's list positions (its outputs and combine)
    "mk-dense-pass-pos": (["megakernel.moe", [["return mk_addr.gemv_group_row(grp, p, col, P)",
                                               "return mk_addr.gemv_group_row(grp, 0, col, P)"]]], DENSE33),
    # MXFP4 experts (kernels/megakernel/moe.py fp4_mma_tile and around; every case runs the lane code on the host with
    # the mma.sync evaluated by megakernel.mma.mma_reference). w1's scale byte read one group to the right (the next
    # group's, or the next row's first)
    "mk-fp4-scale-group": (["megakernel.moe", [["cute.copy(ld_s, sg[(gi, None)], rs[None, 0])",
                                                "cute.copy(ld_s, sg[(gi + 1, None)], rs[None, 0])"]]], MX8),
    # the two codes of a byte swapped (high nibble taken as the even column) in the x pair order shared with the
    # fused kernel (module common.device: the opcodes run with the mutated helpers): x no longer matches the decoded
    # words
    "mk-fp4-nibble-order": (["common.device", [["return 8 * j + s + 4 * hi", "return 8 * j + ((s + 4 * hi) ^ 1)"]]],
                            MX8),
    # the x registers in column order instead of the decoded words' pair order
    "mk-fp4-x-register-order": (["common.device", [["lo, hi = (fp4_pair_col(VEC * j + 2 * s + h) - VEC * j for h",
                                                    "lo, hi = (2 * s + h for h"]]], MX8),
    # the decode's sign bit dropped (bf16 bit 15 not kept): negative codes decode positive
    "mk-fp4-sign-bit": (["common.device", [["FP4_BF16_BITS = 0x81C081C0", "FP4_BF16_BITS = 0x01C001C0"]]], MX8),
    # the placement multiplier of the odd registers shifted one bit too far (2^3 + 2^9: magnitudes doubled, signs
    # at bit 16 of the low half)
    "mk-fp4-place-shift": (["common.device", [["a = 6 - 4 * (s % 2)", "a = 6 - 3 * (s % 2)"]]], MX8),
    # rows g and g + 8 decoded with each other's scale
    "mk-fp4-row-scale": (["megakernel.moe", [["scales = fp4_group_scales(rs[0, 0], rs[0, 1], keep)",
                                              "scales = fp4_group_scales(rs[0, 1], rs[0, 0], keep)"]]], MX8),
    # EXPERT_DOWN's cross-warp sum reads member m's region from the warp of member m - 1 (member 0's twice)
    "mk-fp4-down-part-slot": (["megakernel.moe", [["ctx.s_part[(t + m * ntiles) * W + k]",
                                                   "ctx.s_part[(t + (m - 1) * ntiles) * W + k]"]]], MX8),
    # EXPERT_DOWN's cross-warp sum stops one member short: the last member's slots are never added
    "mk-fp4-down-last-member": (["megakernel.moe", [["for m in cutlass.range(1, g, unroll=1):",
                                                     "for m in cutlass.range(1, g - 1, unroll=1):"]]], MX8),
    # the x values of the neighbouring group: k no longer matches between A and B
    "mk-fp4-x-group": (["megakernel.moe", [["xv[(xr0 + gi * X_CHUNKS_PER_GROUP + j, None)]",
                                            "xv[(xr0 + (gi ^ 1) * X_CHUNKS_PER_GROUP + j, None)]"]]], MX8),
    # the lane's second A row one too low (row g + 7 in place of g + 8)
    "mk-fp4-second-row": (["megakernel.moe", [["cutlass.min(rt + g + 8, r1 - 1)", "cutlass.min(rt + g + 7, r1 - 1)"]]],
                          MX8),
    # EXPERT_DOWN's combine adds register i at its column's place in the region instead of its row's
    "mk-fp4-down-region-row": (["megakernel.moe", [["acc_row(lane, i) * ctx.cfg.B", "acc_col(lane, i) * ctx.cfg.B"]]],
                               MX8),
    # EXPERT_GATE_UP's epilogue stores register i's value at the other row of the lane's pair
    "mk-fp4-out-row": (["megakernel.moe", [["r = rt + acc_row(lane, i)\n", "r = rt + acc_row(lane, i ^ 2)\n"]]], MX8),
    # the code rows at half their stride (d2 counted in 16-bit units): other rows' codes, still 16-byte aligned
    "mk-fp4-code-row-stride": (["megakernel.moe", [["fp4_row_offsets(ctx.s_d1[jc], ctx.s_d2[jc], ctx.s_d1[js]",
                                                    "fp4_row_offsets(ctx.s_d1[jc], ctx.s_d2[jc] // 2, ctx.s_d1[js]"]]],
                               {**MX8, "preset": "tiny", "batch": 1}),
}


def _run(cases: list[dict], tmp: Path, timeout: int) -> list[dict]:
    return run_cases("kimik3.kernels.verify.host_exec_router", cases, tmp, timeout)


def _name(c: dict) -> str:
    extra = "".join(f"-{k}" if v is True else f"-{k}={v}" for k, v in c.items()
                    if k not in ("family", "preset", "batch", "mutant"))
    return f"{c['family']}/{c['preset']}/b{c['batch']}{extra}"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """The CI cases and the mutants in one subprocess (one import of torch and the DSL); none of the mutants
    reaches a device-only instruction."""
    ci = _cases_ci()
    res = _run(ci + [{**case, "mutant": mut} for mut, case in MUTANTS.values()], tmp_path_factory.mktemp("host"),
               timeout=1200)
    return res[:len(ci)], res[len(ci):]


@pytest.fixture(scope="module")
def ci_results(results: tuple[list[dict], list[dict]]) -> dict[str, dict]:
    return {_name(r["case"]): r for r in results[0]}


@pytest.fixture(scope="module")
def mutant_results(results: tuple[list[dict], list[dict]]) -> dict[str, dict]:
    return dict(zip(MUTANTS, results[1]))


@pytest.mark.parametrize("name", [_name(c) for c in _cases_ci()])
def test_router_moe_host_execution_matches_reference(name: str, ci_results: dict[str, dict]) -> None:
    r = ci_results[name]
    assert r["ok"], f"{name}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"
    assert r["lanes"] > 0 and r["errors"], r  # something was executed and compared


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_router_moe_planted_mutant_is_caught(mutant: str, mutant_results: dict[str, dict],
                                             ci_results: dict[str, dict]) -> None:
    r = mutant_results[mutant]
    clean = _name(MUTANTS[mutant][1])
    # the same case without the mutant is in the CI set and passes: the failure is the mutant's
    assert clean in ci_results and ci_results[clean]["ok"], clean
    assert not r["ok"], f"planted bug {mutant} not caught: errors {r['errors']}, problems {r['problems']}"


def test_down_output_column_mutant_is_a_store_outside_the_box(mutant_results: dict[str, dict]) -> None:
    """The write check, not only the values: each EXPERT_DOWN tile's column r1 is stored (outside its declared box,
    into the next tile's first column) and its column r0 never."""
    problems = " ".join(mutant_results["mk-down-out-col"]["problems"])
    assert "outside the declared box" in problems and "not written exactly once" in problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases_slow(), ids=_name)
def test_router_moe_host_execution_full(case: dict, tmp_path: Path) -> None:
    (r,) = _run([case], tmp_path, timeout=3600)
    assert r["ok"], f"{_name(case)}: problems {r['problems']}, errors {r['errors']} (tolerance {r['tol']})"


def test_topk_spec_orders_ties_by_expert_id() -> None:
    import torch
    from kimik3.kernels.verify.host_exec_router import topk_spec

    s = torch.tensor([[0.5, 0.7, 0.5, 0.7, 0.1]])
    ids, w = topk_spec(s, torch.zeros(5), 3)
    assert ids.tolist() == [[1, 3, 0]]  # equal choice scores in ascending id
    assert torch.allclose(w, torch.tensor([[0.7, 0.7, 0.5]]) / (1.9 + 1e-20))
    ids, _ = topk_spec(s, torch.tensor([0.0, 0.0, 0.3, 0.0, 0.0]), 1)  # the bias chooses, the weight is unbiased
    assert ids.tolist() == [[2]]
    # groups {0, 1}, {2, 3}, {4, 5} with two-best sums 1.2, 1.2, 0.2: the lower of the tied groups is kept
    ids, _ = topk_spec(torch.tensor([[0.5, 0.7, 0.5, 0.7, 0.1, 0.1]]), torch.zeros(6), 2, n_group=3, topk_group=1)
    assert ids.tolist() == [[1, 0]]


def test_run_topk_rejects_bad_arguments() -> None:
    import torch
    from kimik3.kernels.verify.host_exec_router import run_topk

    with pytest.raises(ValueError, match="topk"):
        run_topk(torch.zeros(2, 8), torch.zeros(8), topk=9)
    with pytest.raises(ValueError, match="n_group"):
        run_topk(torch.zeros(2, 8), torch.zeros(8), topk=2, n_group=3, topk_group=1)
