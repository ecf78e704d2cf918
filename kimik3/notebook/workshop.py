"""Workshop mode: exercises in notebooks 01–05 where the learner writes the key idea, checked right or wrong.

Each :class:`Exercise` has a task, a hint, a reference solution, a checker that runs an answer on fresh inputs and
says *why* it is wrong (common mistakes recognised by name), and known wrong answers the tests prove it catches::

    workshop.check("absorbed_mla_score", absorbed_scores, solutions=solutions)  # reveal(...): the solution

``solutions=True`` (what ``make run`` and CI pass) checks the reference solution instead of the learner's cell,
so an executed notebook shows every exercise passing; learners run with ``solutions=False`` (the default). A check
never raises — an exception is reported as a wrong answer, an unattempted exercise says so — so a notebook still
runs top to bottom. See docs/architecture.md (map).
"""

from __future__ import annotations

import inspect
import math
import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kimik3.kernels.contracts.meta import GEMV_UNROLL, GEMV_WARPS

__all__ = ["EXERCISES", "Exercise", "Result", "check", "exercises", "reveal"]


@dataclass(frozen=True)
class Result:
    """What a check found: ``ok`` and a sentence saying why."""

    name: str
    ok: bool
    message: str
    attempted: bool = True

    def __str__(self) -> str:
        mark = "RIGHT" if self.ok else ("NOT ATTEMPTED" if not self.attempted else "WRONG")
        return f"[{mark}] {self.name}: {self.message}"

    def _repr_html_(self) -> str:
        color = "#2ca02c" if self.ok else ("#7f7f7f" if not self.attempted else "#d62728")
        import html

        return f'<div style="border-left:4px solid {color};padding:4px 8px">{html.escape(str(self))}</div>'


class Wrong(Exception):
    """Raised by a checker with the reason an answer is wrong."""


@dataclass(frozen=True)
class Exercise:
    name: str
    notebook: str
    task: str
    hint: str
    solution: Callable
    checker: Callable[[Callable], str]  # returns what was verified; raises Wrong(reason)
    wrong_answers: tuple[Callable, ...] = field(default=())


# ====================================================================== 01: attention over the cache


def _attend_solution(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [H, d], k [T, H, d], v [T, H, dv] -> [H, dv]: softmax over the T cached positions of q·k / √d."""
    scores = torch.einsum("hd,thd->ht", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("ht,thv->hv", scores.softmax(dim=-1), v)


def _attend_unscaled(q, k, v):
    return torch.einsum("ht,thv->hv", torch.einsum("hd,thd->ht", q, k).softmax(-1), v)


def _attend_wrong_axis(q, k, v):
    scores = torch.einsum("hd,thd->ht", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("ht,thv->hv", scores.softmax(dim=0), v)


def _check_attend(fn: Callable) -> str:
    g = torch.Generator().manual_seed(1)
    H, T, d, dv = 3, 7, 16, 5
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((H, d), (T, H, d), (T, H, dv)))
    out = fn(q, k, v)
    want = _attend_solution(q, k, v)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (H, dv):
        raise Wrong(f"expected a tensor of shape (H, dv) = {(H, dv)}, got "
                    f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    if torch.allclose(out.double(), want, atol=1e-9):
        return "softmax over the cached positions of q·k/√d, weighting the values"
    if torch.allclose(out.double(), _attend_unscaled(q, k, v), atol=1e-9):
        raise Wrong("the scores are not scaled by 1/√d (d = the head dimension): without it the softmax is far "
                    "too peaked for wide heads")
    if torch.allclose(out.double(), _attend_wrong_axis(q, k, v), atol=1e-9):
        raise Wrong("the softmax normalises over heads; each head's weights must sum to 1 over the T cached "
                    "positions (the last axis of the scores [H, T])")
    raise Wrong("the output differs from softmax(q·kᵀ/√d)·v for each head")


# ====================================================================== 02: bytes a decode step must read


def _distinct_solution(num_experts: int, top_k: int, batch_size: int) -> float:
    """Expected distinct experts when batch_size tokens each pick top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch_size)


def _distinct_no_overlap(num_experts, top_k, batch_size):
    return float(min(batch_size * top_k, num_experts))


def _check_distinct(fn: Callable) -> str:
    from kimik3.perf.cost import expected_distinct_experts

    cases = [(896, 16, 1), (896, 16, 8), (896, 16, 64), (384, 8, 32), (64, 6, 1000)]
    for e, k, b in cases:
        got, want = float(fn(e, k, b)), expected_distinct_experts(e, k, b)
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        if math.isclose(got, min(b * k, e), rel_tol=1e-6):
            raise Wrong(f"E={e}, k={k}, B={b}: {got:g} counts an expert once per token that picks it; tokens "
                        f"share experts, so fewer distinct ones are read ({want:.1f}): each expert is missed by "
                        "all B tokens with probability (1 − k/E)^B")
        raise Wrong(f"E={e}, k={k}, B={b}: got {got:g}, expected {want:.2f}")
    return "E·(1 − (1 − k/E)^B): k at B=1, approaching E as the batch grows"


def _bound_solution(bytes_: float, flops: float, bandwidth: float, peak_flops: float) -> float:
    """Least seconds for a step: memory and compute overlap, so the slower of the two binds."""
    return max(bytes_ / bandwidth, flops / peak_flops)


def _bound_sum(bytes_, flops, bandwidth, peak_flops):
    return bytes_ / bandwidth + flops / peak_flops


def _bound_min(bytes_, flops, bandwidth, peak_flops):
    return min(bytes_ / bandwidth, flops / peak_flops)


def _check_bound(fn: Callable) -> str:
    for b, f, bw, pk in [(60e9, 120e9, 4.8e12, 989e12), (1e9, 5e15, 4.8e12, 989e12), (1.0, 1.0, 2.0, 4.0)]:
        got, want = float(fn(b, f, bw, pk)), _bound_solution(b, f, bw, pk)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        if math.isclose(got, _bound_sum(b, f, bw, pk), rel_tol=1e-9):
            raise Wrong("the sum assumes memory and compute take turns; a kernel streams bytes while it computes, "
                        "so the bound is the longer of the two, not their sum")
        if math.isclose(got, _bound_min(b, f, bw, pk), rel_tol=1e-9):
            raise Wrong("the shorter time is not a bound: the step cannot finish before its slower resource does")
        raise Wrong(f"bytes={b:g}, flops={f:g}: got {got:g} s, expected {want:g} s")
    return "max(bytes / bandwidth, FLOPs / peak): decode is on the bytes side"


# ====================================================================== 03: the absorbed MLA score


def _absorbed_solution(q_nope: torch.Tensor, w_uk: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """q_nope [H, d], w_uk [H, d, r] (key of head h at position t = w_uk[h] @ latent[t]), latent [T, r] ->
    scores [H, T], without building any per-head key: fold w_uk into the query instead."""
    q_latent = torch.einsum("hd,hdr->hr", q_nope, w_uk)  # H·r numbers, independent of T
    return q_latent @ latent.T


def _reexpanded(q_nope, w_uk, latent):
    keys = torch.einsum("hdr,tr->thd", w_uk, latent)  # [T, H, d]: the re-expansion absorption avoids
    return torch.einsum("hd,thd->ht", q_nope, keys)


def _absorbed_transposed(q_nope, w_uk, latent):
    return torch.einsum("hd,hrd->hr", q_nope, w_uk.reshape(w_uk.shape[0], w_uk.shape[2], w_uk.shape[1])) @ latent.T


def _check_absorbed(fn: Callable) -> str:
    from torch.utils._python_dispatch import TorchDispatchMode

    H, d, r, T = 4, 6, 10, 33  # distinct sizes: a tensor with both a T and a d axis is a re-expanded key
    g = torch.Generator().manual_seed(3)
    q, w, c = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((H, d), (H, d, r), (T, r)))
    shapes: list[tuple[int, ...]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor):
                    shapes.append(tuple(o.shape))
            return out

    with Record():
        out = fn(q, w, c)
    want = _absorbed_solution(q, w, c)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (H, T):
        raise Wrong(f"expected scores of shape (H, T) = {(H, T)}, got "
                    f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    if not torch.allclose(out.double(), want, atol=1e-9):
        raise Wrong("the scores differ from q_nope · (w_uk[h] @ latent[t]) for each head h and position t")
    expanded = [s for s in shapes if T in s and d in s]
    if expanded:
        raise Wrong(f"right numbers, but a tensor of shape {expanded[0]} was built: that is every cached position's "
                    "per-head key re-expanded (T·H·d numbers per step). Absorb instead: q_latent[h] = "
                    "q_nope[h] @ w_uk[h] (H·r numbers), then score = q_latent @ latentᵀ")
    return "q_latent = q_nope · W_uk per head, then one product with the cached latents: no keys built"


# ====================================================================== 04: a GEMV tile's index arithmetic

# bf16 per 16-byte chunk, lanes per warp (GEMV_WARPS / GEMV_UNROLL: kernels/contracts/meta.py)
GEMV_VEC, GEMV_LANES = 8, 32


def _gemv_solution(cta: int, warp: int, lane: int, step: int, u: int, v: int) -> tuple[int, int]:
    """(row, k) of W read by thread (cta, warp, lane) at loop step ``step``, unrolled load ``u``, vector element
    ``v``: one warp per row; lane l owns 16-byte chunks l, l+32, l+64, ... (GEMV_VEC elements each)."""
    row = cta * GEMV_WARPS + warp
    chunk = step * (GEMV_LANES * GEMV_UNROLL) + u * GEMV_LANES + lane
    return row, chunk * GEMV_VEC + v


def _gemv_lane_major(cta, warp, lane, step, u, v):
    """Each lane takes its own contiguous stretch: lane l reads chunks 4l..4l+3 — full coverage, uncoalesced."""
    row = cta * GEMV_WARPS + warp
    chunk = step * (GEMV_LANES * GEMV_UNROLL) + lane * GEMV_UNROLL + u
    return row, chunk * GEMV_VEC + v


def _gemv_forgot_step(cta, warp, lane, step, u, v):
    row = cta * GEMV_WARPS + warp
    return row, (u * GEMV_LANES + lane) * GEMV_VEC + v


def _check_gemv(fn: Callable) -> str:
    n_rows, steps = 2 * GEMV_WARPS, 2
    k_len = steps * GEMV_LANES * GEMV_UNROLL * GEMV_VEC
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    for cta in range(n_rows // GEMV_WARPS):
        for warp in range(GEMV_WARPS):
            rows = set()
            for step in range(steps):
                for u in range(GEMV_UNROLL):
                    for v in range(GEMV_VEC):
                        ks = []
                        for lane in range(GEMV_LANES):
                            row, k = (int(x) for x in fn(cta, warp, lane, step, u, v))
                            if not (0 <= row < n_rows and 0 <= k < k_len):
                                raise Wrong(f"thread (cta {cta}, warp {warp}, lane {lane}) step {step} u {u} v {v} "
                                            f"reads ({row}, {k}), outside W [{n_rows}, {k_len}]")
                            if (row, k) in seen:
                                raise Wrong(f"element ({row}, {k}) is read twice: by {seen[(row, k)]} and by "
                                            f"{(cta, warp, lane, step, u, v)} (cta, warp, lane, step, u, v)")
                            seen[(row, k)] = (cta, warp, lane, step, u, v)
                            rows.add(row)
                            ks.append(k)
                        if v == 0 and any(b - a != GEMV_VEC for a, b in zip(ks, ks[1:])):
                            raise Wrong(f"one warp-wide load (cta {cta}, warp {warp}, step {step}, u {u}) has lanes "
                                        f"at k = {ks[:4]}...: consecutive lanes must read consecutive 16-byte "
                                        f"chunks (k {GEMV_VEC} apart) so the warp's 32 loads are one contiguous "
                                        "512-byte transaction (coalesced)")
            if len(rows) != 1:
                raise Wrong(f"warp {warp} of cta {cta} touches rows {sorted(rows)}: one warp owns one output row "
                            "(its dot product is reduced across the warp's lanes)")
    if len(seen) != n_rows * k_len:
        raise Wrong(f"{n_rows * k_len - len(seen)} elements of W are never read")
    return "every element of W read exactly once, one row per warp, each warp-wide load 512 contiguous bytes"


# ====================================================================== 05: find a planted race


def _race_solution(program) -> tuple[int, int]:
    """(producer, consumer) of the first race ``check_program`` reports: the consumer is the instruction that
    is no longer ordered after the producer's write (Violation.instr), the producer is Violation.other."""
    from kimik3.megakernel.hazards import check_program

    races = [v for v in check_program(program) if v.kind in ("raw", "war", "waw")]
    return races[0].other, races[0].instr


def _race_reversed(program):
    p, c = _race_solution(program)
    return c, p


def _check_race(fn: Callable) -> str:
    import dataclasses

    from kimik3.megakernel.hazards import check_program
    from kimik3.megakernel.instructions import Program
    from kimik3.megakernel.scheduler import build_program

    program = build_program("micro", 1, 4, max_seq_len=24, act_dtype=torch.float32)
    rng = random.Random(5)
    candidates = [i for i, x in enumerate(program.instructions) if x.waits]
    for i in rng.sample(candidates, 3):  # a fresh plant each time: the answer must come from the checker
        ins = list(program.instructions)
        ins[i] = dataclasses.replace(ins[i], waits=ins[i].waits[1:])
        bad = Program(program.buffers, ins, [list(q) for q in program.queues], list(program.counters),
                      program.batch, program.max_seq_len, program.num_layers, program.policy)
        races = {(v.other, v.instr) for v in check_program(bad) if v.kind in ("raw", "war", "waw")}
        got = tuple(int(x) for x in fn(bad))
        if got in races:
            continue
        if got[::-1] in races:
            raise Wrong(f"{got} is a racing pair in the wrong order: the producer (Violation.other) comes first "
                        "in sequential order, the consumer that lost its wait (Violation.instr) second")
        raise Wrong(f"{got} is not a race in this program (a wait of #{i} was removed); check_program lists "
                    f"them, e.g. {sorted(races)[:2]}")
    return "the racing (producer, consumer) pair of three freshly planted bugs, read off check_program"


# ====================================================================== registry and the notebook API

EXERCISES: dict[str, Exercise] = {e.name: e for e in [
    Exercise("decode_attention", "01_naive_decode",
             "attend(q, k, v): one decode query per head against the whole cache. q [H, d], k [T, H, d], "
             "v [T, H, dv] -> [H, dv]", "scores q·k per (head, position), scaled; softmax over positions; weight v",
             _attend_solution, _check_attend, (_attend_unscaled, _attend_wrong_axis)),
    Exercise("distinct_experts", "02_memory_and_rooflines",
             "distinct_experts(E, k, B): expected number of distinct experts B tokens read when each picks k of E "
             "uniformly", "the probability that one given expert is picked by none of the B tokens",
             _distinct_solution, _check_distinct, (_distinct_no_overlap,)),
    Exercise("step_lower_bound", "02_memory_and_rooflines",
             "step_lower_bound(bytes, flops, bandwidth, peak_flops): least seconds a step can take",
             "memory traffic and arithmetic overlap in a good kernel", _bound_solution, _check_bound,
             (_bound_sum, _bound_min)),
    Exercise("absorbed_mla_score", "03_absorption_graphs_compile",
             "absorbed_scores(q_nope, w_uk, latent): MLA scores [H, T] from the cached latents [T, r] without "
             "building any per-head key (w_uk [H, d, r] maps a latent to head h's key)",
             "q·(W c) = (Wᵀq)·c: move W_uk to the query side, once per step",
             _absorbed_solution, _check_absorbed, (_reexpanded, _absorbed_transposed)),
    Exercise("gemv_tile_index", "04_fused_kernels",
             f"gemv_element(cta, warp, lane, step, u, v) -> (row, k): the W element a thread loads, with "
             f"{GEMV_WARPS} warps per CTA (one row each), {GEMV_UNROLL} unrolled 16-byte loads per step, "
             f"{GEMV_VEC} bf16 per load, 32 lanes",
             "lane l owns chunks l, l+32, l+64, ...: chunk = step·32·UNROLL + u·32 + lane",
             _gemv_solution, _check_gemv, (_gemv_lane_major, _gemv_forgot_step)),
    Exercise("find_planted_race", "05_megakernel",
             "find_race(program) -> (producer, consumer): the instructions of a race planted by removing one "
             "wait, found with kimik3.megakernel.hazards.check_program",
             "check_program returns Violations; a race has kind raw/war/waw, instr and other",
             _race_solution, _check_race, (_race_reversed,)),
]}


def exercises(notebook: str | None = None) -> list[Exercise]:
    """All exercises, or those of one notebook (by stem or its two-digit prefix)."""
    return [e for e in EXERCISES.values() if notebook is None or e.notebook.startswith(notebook)]


def _get(name: str) -> Exercise:
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; known: {', '.join(EXERCISES)}")
    return EXERCISES[name]


def grade(name: str, answer: Callable) -> Result:
    """Check ``answer`` for exercise ``name`` without printing; never raises for a wrong answer."""
    ex = _get(name)
    try:
        what = ex.checker(answer)
    except NotImplementedError:
        return Result(name, False, f"not attempted yet. Task: {ex.task}. Hint: {ex.hint}. "
                                   f"workshop.reveal({name!r}) shows a solution.", attempted=False)
    except Wrong as w:
        return Result(name, False, str(w))
    except Exception as e:  # the learner's code failing is a wrong answer, reported with its error
        return Result(name, False, f"your code raised {type(e).__name__}: {e}")
    return Result(name, True, what)


def check(name: str, answer: Callable | None = None, *, solutions: bool = False) -> Result:
    """The check cell: grade the learner's ``answer`` (or, with ``solutions=True``, the reference solution, as
    ``make run`` does) and show right or wrong and why."""
    ex = _get(name)
    if solutions:
        answer = ex.solution
    elif answer is None:
        raise ValueError(f"{name}: pass your function, or solutions=True")
    res = grade(name, answer)
    if solutions:
        res = Result(name, res.ok, f"(reference solution, solutions=True) {res.message}", res.attempted)
    print(res)
    return res


def reveal(name: str) -> str:
    """Print and return the source of exercise ``name``'s reference solution (the solution on request)."""
    src = textwrap.dedent(inspect.getsource(_get(name).solution))
    print(src)
    return src
