"""What executes the kernel launches of a fused step's plan (:class:`kimik3.fused.plan.FusedStep`).

A runner is bound to a step and called once per kernel launch; the glue ops run themselves. Two exist so the one
plan serves both machines: :class:`KernelRunner` calls the compiled kernels (on a GPU, recordable into a CUDA
graph), :class:`ReferenceRunner` calls each op's PyTorch reference, so the composition is tested on a CPU.

Design: docs/architecture.md (map: one decode step, end to end; how to add a kernel).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from kimik3.fused.plan import Launch
from kimik3.kernels.contracts.meta import ARG_ORDER

__all__ = ["KernelRunner", "ReferenceRunner"]


class KernelRunner:
    """Launches compiled ops (JIT ``JitCompiledFunction`` or prebuilt TVM-FFI functions) with their parameters in
    the compiled order; the current torch stream is used, so graph capture records them."""

    def __init__(self, fns: dict[tuple[str, str, str], Callable[..., Any]]) -> None:
        self.fns = fns

    def __call__(self, ln: Launch) -> None:
        op = ln.op
        # ARG_ORDER, not the kernel module: a GPU machine running prebuilt kernels has no CuTe DSL to import it
        order = ARG_ORDER[(op.module_name, op.variant)]
        self.fns[op.key](*[ln.args.get(k) for k in order])


class ReferenceRunner:
    """Each kernel replaced by its PyTorch reference (``kimik3.kernels.reference.<op>``: ``reference``, or
    ``heads_reference`` for the per-head GEMV), outputs written into the launch's buffers: runs the whole
    composition on a CPU, to test the wiring (layouts, weight preparation, residual slots, cache format) against
    the model without a GPU. Needs the kernel modules (the CuTe DSL installed), which the references read
    their constants from."""

    def __call__(self, ln: Launch) -> None:
        op, t = ln.op, ln.args
        ref = importlib.import_module(f"kimik3.kernels.reference.{op.module_name}")
        if op.family == "moe.heads":
            out = ref.heads_reference(t)
        else:
            out = ref.reference(op.variant, t, **op.shapes, **op.runtime)
        for name, val in out.items():
            dst = t.get(name)
            if isinstance(dst, torch.Tensor):
                dst.copy_(val.to(dst.dtype))
