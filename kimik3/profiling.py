"""Profiling harness: operators and kernel launches per token, traces, time per token.

Backends degrade in a fixed order and every result says which one produced it:
``ncu`` (Nsight Compute CLI: per-kernel DRAM bytes and duration) → ``torch-cuda`` (torch profiler with CUDA
activity: kernels and their durations, bytes from the cost model) → ``torch-cpu`` (CPU profiler: operators,
bytes and FLOPs analytic) → ``recorded`` (measurements committed under ``data/measurements/``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["OpCount", "count_ops", "time_per_call", "Timing", "nvtx_range", "annotate"]


@dataclass
class OpCount:
    """What one profiled call did. ``launches`` counts CUDA kernels on a GPU; on a CPU it counts top-level
    ATen operators (each would be at least one kernel launch on a GPU in eager mode)."""

    backend: str
    calls: int
    operators: int  # top-level aten operators over all calls
    launches: int  # CUDA kernels (GPU) or top-level operators (CPU)
    by_name: pd.DataFrame
    trace_path: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def operators_per_call(self) -> float:
        return self.operators / self.calls

    @property
    def launches_per_call(self) -> float:
        return self.launches / self.calls


def _top_level_aten(events) -> list:
    out = []
    for e in events:
        if not e.name.startswith("aten::") or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out.append(e)
    return out


def count_ops(fn: Callable[[], object], calls: int = 1, trace_path: str | Path | None = None,
              warmup: int = 1) -> OpCount:
    """Profile ``calls`` invocations of ``fn`` (after ``warmup``) and count operators / kernel launches."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=False) as prof:
        for i in range(calls):
            with record_function(f"call_{i}"):
                fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    top = _top_level_aten(events)
    names = pd.Series([e.name for e in top]).value_counts().rename_axis("operator").reset_index(name="count")
    launches = len(top)
    backend = "torch-cpu"
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = len(kernels)
        backend = "torch-cuda"
    path = None
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        path = str(trace_path)
    return OpCount(backend=backend, calls=calls, operators=len(top), launches=launches, by_name=names,
                   trace_path=path)


@dataclass
class Timing:
    """Seconds per call: median and spread over repeats, warm-up excluded; ``clock`` says how it was taken."""

    clock: str
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.samples), max(self.samples)

    @property
    def iqr(self) -> float:
        if len(self.samples) < 4:
            return max(self.samples) - min(self.samples)
        q = statistics.quantiles(self.samples, n=4)
        return q[2] - q[0]

    def __str__(self) -> str:
        lo, hi = self.spread
        return f"{self.median * 1e3:.3f} ms (min {lo * 1e3:.3f}, max {hi * 1e3:.3f}, n={len(self.samples)}, " \
               f"{self.clock})"


def time_per_call(fn: Callable[[], object], repeats: int = 10, warmup: int = 2, device: str = "cpu") -> Timing:
    """CUDA events on a GPU, wall clock (perf_counter) on a CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return Timing("cuda-events", samples)
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Timing("wall-clock", samples)


@contextmanager
def nvtx_range(name: str):
    """An NVTX range on a GPU (visible in Nsight Systems/Compute) and a profiler label everywhere."""
    pushed = False
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        pushed = True
    try:
        with record_function(name):
            yield
    finally:
        if pushed:
            torch.cuda.nvtx.range_pop()


def annotate(model: torch.nn.Module, stage: str) -> list:
    """Wrap every decoder layer's mixer and FFN in NVTX ranges named ``stage/layer/block``; returns the hooks."""
    hooks = []
    for i, layer in enumerate(getattr(model, "model", model).layers):
        for block_name in ("self_attn", "mlp", "block_sparse_moe"):
            block = getattr(layer, block_name, None)
            if block is None:
                continue
            label = f"{stage}/layer{i}/{block_name}"

            def pre(mod, args, label=label):
                if torch.cuda.is_available():
                    torch.cuda.nvtx.range_push(label)

            def post(mod, args, out):
                if torch.cuda.is_available():
                    torch.cuda.nvtx.range_pop()

            hooks += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return hooks
