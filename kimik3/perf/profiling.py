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


# ---------------------------------------------------------------------- per-kernel DRAM bytes (GPU)

NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
NSIGHT_PYTHON_MIN_NCU = (2026, 2, 1)  # nsight-python >= 1.0 needs at least this ncu


def ncu_version(ncu: str = "ncu") -> tuple[int, ...] | None:
    """The Nsight Compute CLI version as a tuple, or None when it is not installed."""
    import re
    import shutil
    import subprocess

    path = shutil.which(ncu)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"(\d{4})\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else None


def choose_backend(device: str) -> tuple[str, str]:
    """(backend, why): the best kernel-metrics backend available here, in the documented fallback order."""
    if device == "cuda" and torch.cuda.is_available():
        v = ncu_version()
        if v is not None:
            try:
                import nsight  # noqa: F401  (nsight-python)

                if v >= NSIGHT_PYTHON_MIN_NCU:
                    return "nsight-python", f"ncu {'.'.join(map(str, v))} with nsight-python"
            except ImportError:
                pass
            return "ncu", f"ncu {'.'.join(map(str, v))} CLI (nsight-python needs ncu >= 2026.2.1)"
        return "torch-cuda", "no ncu on PATH: kernel durations from the torch profiler, bytes from the cost model"
    return "torch-cpu", "no GPU: CPU profiler for operators, bytes and FLOPs from the cost model"


def ncu_command(child_args: list[str], out_csv: str, metrics: tuple[str, ...] = NCU_METRICS,
                nvtx_include: str | None = None) -> list[str]:
    """The ``ncu`` command line profiling ``python -m kimik3.perf.profiling child ...`` (one decode step per launch)."""
    import sys

    cmd = ["ncu", "--csv", "--log-file", out_csv, "--metrics", ",".join(metrics), "--target-processes", "all"]
    if nvtx_include:
        cmd += ["--nvtx", "--nvtx-include", nvtx_include]
    return cmd + [sys.executable, "-m", "kimik3.perf.profiling", "child", *child_args]


def parse_ncu_csv(text: str) -> pd.DataFrame:
    """ncu ``--csv`` output (one row per kernel × metric) -> one row per kernel launch with bytes, duration and
    achieved bandwidth. Lines before the CSV header (ncu's own log) are skipped."""
    import csv
    import io

    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (\"ID\",...) found in the ncu output")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    recs: dict[str, dict] = {}
    for r in rows:
        key = r["ID"]
        rec = recs.setdefault(key, {"id": int(key), "kernel": r.get("Kernel Name", "")})
        name, unit, value = r["Metric Name"], r.get("Metric Unit", ""), float(r["Metric Value"].replace(",", ""))
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9, "usecond": 1e-6,
                 "msecond": 1e-3, "second": 1.0}.get(unit, 1.0)
        rec[name] = value * scale
    df = pd.DataFrame(list(recs.values()))
    if df.empty:
        return df
    df["dram_bytes"] = df.get("dram__bytes_read.sum", 0) + df.get("dram__bytes_write.sum", 0)
    df["seconds"] = df["gpu__time_duration.sum"]
    df["gb_per_s"] = df["dram_bytes"] / df["seconds"] / 1e9
    return df


def kernel_metrics(preset: str, stage: str, batch: int = 1, context: int = 512, steps: int = 1,
                   out_dir: str | Path = "runs/ncu") -> tuple[pd.DataFrame, str, str]:
    """Per-kernel DRAM bytes and duration of ``steps`` decode steps: (table, backend, why).

    ncu (through the CLI on a child process) where it exists; otherwise the torch profiler's CUDA kernel durations
    with bytes left to the cost model; on a CPU an empty table. Never raises for a missing tool: it says which
    backend answered."""
    import subprocess

    backend, why = choose_backend("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if backend in ("ncu", "nsight-python"):
        csv_path = out_dir / f"{preset}_{stage}_b{batch}.csv"
        args = ["--preset", preset, "--stage", stage, "--batch", str(batch), "--context", str(context),
                "--steps", str(steps)]
        proc = subprocess.run(ncu_command(args, str(csv_path), nvtx_include="decode_step/"), capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode == 0 and csv_path.exists():
            return parse_ncu_csv(csv_path.read_text()), "ncu", why
        why = f"ncu failed (exit {proc.returncode}): {proc.stderr[-300:]}; fell back to the torch profiler"
        backend = "torch-cuda"
    if backend == "torch-cuda":
        import kimik3

        model = kimik3.from_preset(preset, dtype=torch.bfloat16, device="cuda")
        dec = kimik3.Decoder(model, stage, batch_size=batch, max_seq_len=context + steps + 4)
        ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
        nxt = dec.prefill(ids).argmax(-1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec.step(nxt)
            torch.cuda.synchronize()
        k = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        df = pd.DataFrame({"kernel": [e.name for e in k], "seconds": [e.device_time_total * 1e-6 for e in k]})
        return df, "torch-cuda", why
    return pd.DataFrame(columns=["kernel", "dram_bytes", "seconds", "gb_per_s"]), "torch-cpu", why


def _child(argv: list[str]) -> int:
    """The process ncu profiles: builds the decoder, then runs steps inside an NVTX range 'decode_step/'."""
    import argparse

    import kimik3

    ap = argparse.ArgumentParser()
    for a, t in (("--preset", str), ("--stage", str), ("--batch", int), ("--context", int), ("--steps", int)):
        ap.add_argument(a, type=t, required=True)
    a = ap.parse_args(argv)
    model = kimik3.from_preset(a.preset, dtype=torch.bfloat16, device="cuda")
    dec = kimik3.Decoder(model, a.stage, batch_size=a.batch, max_seq_len=a.context + a.steps + 8)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.context), device="cuda")
    nxt = dec.prefill(ids).argmax(-1)
    dec.step(nxt)  # warm-up / capture outside the profiled range
    for _ in range(a.steps):
        with nvtx_range("decode_step/"):
            dec.step(nxt)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(_child(sys.argv[2:]))
    print("usage: python -m kimik3.perf.profiling child --preset P --stage S --batch B --context T --steps N")
