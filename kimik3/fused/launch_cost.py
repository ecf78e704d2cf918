"""Bytes and FLOPs of one kernel launch of the fused step, from the launch's own tensor shapes.

The per-launch half of the cost model: :mod:`kimik3.perf.cost` counts a decode step per layer and block from the
model's parameters; this module counts what one launch of the fused step (a :class:`kimik3.fused.plan.Launch`)
must move through device memory and compute, from the tensors it is handed. Used for the plan's description, the
performance model and the measured-bandwidth figures of the device check. Counting rules follow spec §8, as
:mod:`kimik3.perf.cost` does: routed experts count only when selected.

Design: docs/architecture.md §8.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kimik3.perf.cost import expected_distinct_experts

__all__ = ["launch_bytes", "launch_flops"]


class CountedLaunch(Protocol):
    """What is counted of a :class:`kimik3.fused.plan.Launch`. Structural, because the plan imports this module
    (its description counts every launch) and this module must not import the plan back."""

    kind: str
    op: Any
    args: dict[str, Any]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def launch_bytes(ln: CountedLaunch, context: int | None = None, distinct_experts: float | None = None) -> float:
    """Fewest bytes one launch must move through device memory, from its own tensor shapes.

    Every tensor argument is read or written once, with these exceptions: in-place state (KDA ``S`` and
    ``conv``, the in-place residual of o-proj) is read and written; MLA reads ``context`` cache rows per sequence
    (default: the whole static cache); the routed-expert op reads only the experts actually selected
    (``distinct_experts``, default the expected number for uniform routing,
    ``kimik3.perf.cost.expected_distinct_experts``) and writes and re-reads its per-pair scratch; split-softmax
    partials and router scores are written and read.
    """
    if ln.kind == "glue":
        return float(sum(_nbytes(t) for t in ln.args.values()))
    op, a = ln.op, ln.args
    fam = op.family
    total = 0.0
    for name, t in a.items():
        if name in ("norm_w", "proj_w"):  # reference-only extras of the AttnRes op
            continue
        total += _nbytes(t)
    if fam == "kda":
        total += _nbytes(a["S"]) + _nbytes(a["conv"])
    elif fam == "mla":
        B, S, DQ = a["kv"].shape
        n = min(context or S, S)
        total += -_nbytes(a["kv"]) + B * n * DQ * a["kv"].element_size()
        total += _nbytes(a["part_o"]) + _nbytes(a["part_m"]) + _nbytes(a["part_l"])
    elif fam.startswith("moe.") and fam != "moe.heads":
        E = op.shapes["E"]
        if distinct_experts is None or E == 1:
            used = float(expected_distinct_experts(E, op.shapes["topk"], op.shapes["B"]))
        else:
            used = float(distinct_experts)
        wb = sum(_nbytes(a[k]) for k in ("w1", "w3", "w2", "s1", "s3", "s2") if a.get(k) is not None)
        total += -wb + wb * used / E + _nbytes(a["h"]) + _nbytes(a["y"])
    elif fam == "router":
        total += _nbytes(a["scores"])
    elif fam == "gemv.lm_head":
        total += _nbytes(a["part_v"]) + _nbytes(a["part_i"])
    return total


def launch_flops(ln: CountedLaunch, context: int | None = None) -> float:
    """Multiply-adds ×2 of the main loops (analytic; elementwise epilogues ignored)."""
    if ln.kind == "glue" or ln.op is None:
        return 0.0
    sh, fam = ln.op.shapes, ln.op.family
    B = sh["B"]
    if fam.startswith("gemv."):
        return 2.0 * sh["N"] * sh["K"] * B
    if fam == "router":
        return 2.0 * sh["E"] * sh["H"] * B
    if fam == "moe.heads":
        return 2.0 * sh["NH"] * sh["R"] * sh["K"] * B
    if fam.startswith("moe."):
        return 2.0 * 3 * sh["L"] * sh["I"] * B * sh["topk"]
    if fam == "kda":
        return 8.0 * sh["nh"] * sh["D"] ** 2 * B
    if fam == "mla":
        n = min(context or sh["S"], sh["S"])
        return 2.0 * sh["nh"] * (2 * sh["DL"] + sh["DR"]) * n * B
    if fam == "attn_res":
        return 4.0 * sh["NC"] * sh["H"] * B
    return 0.0
