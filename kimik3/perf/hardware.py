"""Hardware ceilings for roofline bounds: vendor datasheet figures, and what this machine measures right now.

Why both: a bound is only as good as its ceilings. Datasheet peaks (``data/hardware.json``, every entry with its
source and a note where a figure is uncertain) say what a chip could do; :func:`measure_local` says what the
machine running the notebook actually does (STREAM-style read, copy and triad bandwidth and the matmul rate, with
spread and provenance), so a measured step can be placed against the ceiling of the machine it ran on. Decode's
ceiling is the read bandwidth: a step reads weights and cache and writes almost nothing.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

__all__ = ["DATA_DIR", "STREAM_KERNELS", "HardwareSpec", "get_hardware", "hardware_table", "list_hardware",
           "local_hardware", "measure_bandwidth", "measure_local", "read_ceiling_Bps"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
HARDWARE_JSON = DATA_DIR / "hardware.json"

_ALIASES = {"h100": "h100-sxm", "h100sxm": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200",
            "hgx-b200": "b200", "gb200-nvl72": "gb200", "gb300-nvl72": "gb300", "b300": "gb300"}
_PRECISION_ORDER = ("fp4", "fp8", "bf16", "fp16", "fp32")  # lower precision = higher peak


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's ceilings in SI units (bytes, bytes/s, FLOP/s). ``None`` = not applicable / unknown."""

    key: str
    name: str
    hbm_bandwidth: float
    hbm_capacity: float | None
    dense_flops: dict[str, float | None]
    sm_count: int | None = None
    l2_bytes: float | None = None
    smem_per_sm_bytes: float | None = None
    nvlink_bandwidth: float | None = None
    source: tuple[str, ...] = ()
    uncertain: tuple[str, ...] = ()
    note: str = ""
    measured: bool = False
    provenance: dict = field(default_factory=dict, compare=False)

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense tensor peak for ``dtype``; raises if the chip has none (e.g. fp4 on Hopper)."""
        v = self.dense_flops.get(dtype)
        if not v:
            have = [d for d, x in self.dense_flops.items() if x]
            raise ValueError(f"{self.name}: no {dtype} peak (has {', '.join(have)})")
        return float(v)

    def compute_ceiling(self, dtype: str = "bf16") -> tuple[float, str]:
        """(FLOP/s, dtype used): ``dtype``'s peak, else the next wider precision the chip has. Why: an fp4
        roofline on a chip without fp4 tensor cores should show what that chip would actually run."""
        if self.dense_flops.get(dtype):
            return float(self.dense_flops[dtype]), dtype
        start = _PRECISION_ORDER.index(dtype) if dtype in _PRECISION_ORDER else 0
        for d in (*_PRECISION_ORDER[start:], *self.dense_flops):
            if self.dense_flops.get(d):
                return float(self.dense_flops[d]), d
        raise ValueError(f"{self.name}: no compute peak at all")

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOP per byte at which the compute ceiling meets the bandwidth ceiling."""
        return self.compute_ceiling(dtype)[0] / self.hbm_bandwidth


def _load() -> dict[str, dict]:
    return json.loads(HARDWARE_JSON.read_text())["hardware"]


def _normalise(name: str) -> str:
    k = name.strip().lower().replace("_", "-").replace(" ", "-")
    return _ALIASES.get(k, k)


def hardware_for_device(device: str) -> str | None:
    """The datasheet key a device's name names (torch's ``get_device_name``: "NVIDIA H200" -> "h200", "NVIDIA H100
    80GB HBM3" -> "h100-sxm"), or None (a CPU, or a chip with no entry): a key or alias as whole words of the
    name, the longest first."""
    words = _normalise(device).split("-")
    for name in sorted(set(_load()) | set(_ALIASES), key=len, reverse=True):
        n = name.split("-")
        if any(words[i:i + len(n)] == n for i in range(len(words) - len(n) + 1)):
            return _ALIASES.get(name, name)
    return None


def list_hardware() -> list[str]:
    """Keys of the datasheet entries in ``data/hardware.json``."""
    return list(_load())


def get_hardware(name: str) -> HardwareSpec:
    """The datasheet entry ``name`` (case and separators ignored; e.g. "H100", "h100-sxm", "GB300 NVL72")."""
    table, key = _load(), _normalise(name)
    if key not in table:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(table)}")
    e = table[key]

    def scaled(v, unit: float) -> float | None:
        return None if v is None else float(v) * unit

    return HardwareSpec(
        key=key, name=e["name"], hbm_bandwidth=e["hbm_bandwidth_TBps"] * 1e12,
        hbm_capacity=scaled(e.get("hbm_capacity_GB"), 1e9),
        dense_flops={d: scaled(v, 1e12) for d, v in e["dense_tflops"].items()},
        sm_count=e.get("sm_count"), l2_bytes=scaled(e.get("l2_MB"), 2**20),
        smem_per_sm_bytes=scaled(e.get("smem_per_sm_KB"), 2**10), nvlink_bandwidth=scaled(e.get("nvlink_GBps"), 1e9),
        source=tuple(e.get("source", ())), uncertain=tuple(e.get("uncertain", ())), note=e.get("note", ""),
    )


def hardware_table() -> pd.DataFrame:
    """All datasheet entries in human units, one row each (for display)."""
    rows = []
    for key in list_hardware():
        h = get_hardware(key)
        rows.append({"key": key, "name": h.name, "HBM TB/s": h.hbm_bandwidth / 1e12,
                     "HBM GB": None if h.hbm_capacity is None else h.hbm_capacity / 1e9,
                     **{f"{d} TFLOP/s": (v or 0) / 1e12 for d, v in h.dense_flops.items()},
                     "SMs": h.sm_count, "ridge bf16 FLOP/B": h.ridge_point("bf16"),
                     "uncertain": ", ".join(h.uncertain)})
    return pd.DataFrame(rows).set_index("key")


# ====================================================================== measuring this machine


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timer(dev: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of ``fn`` averaged over ``inner`` back-to-back calls. On a GPU, CUDA events around the
    batch: a host clock plus a synchronize would swamp a launch-sized kernel."""
    if dev.type == "cuda":
        def gpu(fn: Callable[[], object], inner: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        return gpu

    def cpu(fn: Callable[[], object], inner: int) -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner
    return cpu


def _spread(rates: list[float]) -> dict[str, float]:
    q = statistics.quantiles(rates, n=4) if len(rates) >= 2 else [rates[0]] * 3
    return {"min": min(rates), "p25": q[0], "median": statistics.median(rates), "p75": q[2], "max": max(rates),
            "relative_iqr": (q[2] - q[0]) / statistics.median(rates), "n": len(rates)}


# Bytes each STREAM-style kernel moves per element, counted as STREAM counts them (write-allocate traffic of a
# cache that reads a line before writing it is not counted: the figure is what the program asked for).
STREAM_KERNELS = {"read": 1, "copy": 2, "triad": 3}


def measure_bandwidth(device: str | torch.device = "auto", nbytes: int | None = None, repeats: int = 10,
                      warmup: int = 2, threads: int | None = None) -> dict:
    """STREAM-style memory bandwidth of this machine now: read (``sum``), copy and triad (``a = b + s·c``).

    Every kernel writes into buffers allocated before timing (a fresh allocation per call would time page faults,
    not memory), runs ``warmup`` times first, then ``repeats`` timed samples interleaved across the kernels (so a
    drift in the machine's speed lands on all three alike). ``nbytes`` is the size of one buffer (default: 512 MiB
    on a CPU, far past any last-level cache; 2 GiB on a GPU). On a CPU the kernels run on torch's intra-op thread
    pool, ``threads`` threads (default: torch's current setting), as the decode stages do. Rates are in bytes/s
    with min/median/max over the samples. Decode reads weights and cache and writes little, so ``read`` is its
    ceiling; ``copy`` and ``triad`` are there to compare with published STREAM figures.
    """
    dev = torch.device("cuda" if (device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if device == "auto" else device))
    gpu = dev.type == "cuda"
    nbytes = int(nbytes or (2 * 2**30 if gpu else 512 * 2**20))
    if nbytes < 4 * 2**10 or repeats < 1 or warmup < 0:
        raise ValueError(f"need nbytes >= 4 KiB, repeats >= 1, warmup >= 0; got {nbytes}, {repeats}, {warmup}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    from kimik3.model.checks import require_memory

    require_memory(3 * nbytes, dev, f"the bandwidth probe's three buffers of {nbytes} bytes",
                   "the step's working set this large cannot be measured here")
    n = nbytes // 4
    # several calls per sample on a GPU: one call there is short next to the events' resolution
    inner = 10 if gpu else 1
    old_threads = torch.get_num_threads()
    if threads is not None and not gpu:
        torch.set_num_threads(threads)
    try:
        a = torch.empty(n, dtype=torch.float32, device=dev).fill_(1.0)  # fill: touch every page before timing
        b = torch.empty(n, dtype=torch.float32, device=dev).fill_(2.0)
        c = torch.empty(n, dtype=torch.float32, device=dev).fill_(0.5)
        acc = torch.empty((), dtype=torch.float32, device=dev)
        kernels: dict[str, Callable[[], object]] = {
            "read": lambda: torch.sum(b, 0, out=acc),
            "copy": lambda: a.copy_(b),
            "triad": lambda: torch.add(b, c, alpha=3.0, out=a),
        }
        timer = _timer(dev)
        for fn in kernels.values():
            for _ in range(warmup):
                timer(fn, inner)
        seconds: dict[str, list[float]] = {k: [] for k in kernels}
        for _ in range(repeats):
            for k, fn in kernels.items():
                seconds[k].append(timer(fn, inner))
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    out: dict = {"bandwidth_method": "STREAM-style read (sum), copy, triad into preallocated fp32 buffers; "
                                     "bytes counted as STREAM counts them",
                 "bandwidth_buffer_bytes": nbytes, "bandwidth_repeats": repeats, "bandwidth_warmup": warmup,
                 "bandwidth_calls_per_sample": inner, "bandwidth_threads": None if gpu else used_threads}
    for k, per in STREAM_KERNELS.items():
        rates = [per * 4 * n / t for t in seconds[k]]
        out[f"{k}_bandwidth_Bps"] = statistics.median(rates)
        out[f"{k}_bandwidth_spread"] = _spread(rates)
    return out


def _provenance(dev: torch.device) -> dict:
    from kimik3.perf.provenance import provenance

    # the one provenance record, plus what a bandwidth figure depends on: the device's name and the thread count
    return {**provenance(dev), "device_name": _device_name(dev), "torch_version": torch.__version__,
            "threads": torch.get_num_threads()}


def measure_local(device: str | torch.device = "auto", quick: bool = True, repeats: int | None = None,
                  threads: int | None = None) -> dict:
    """Measure this machine's memory bandwidth and matmul rate now, with provenance and spread.

    Bandwidth: :func:`measure_bandwidth` (STREAM-style read, copy and triad into preallocated buffers).
    ``read_bandwidth_Bps`` is decode's ceiling (:func:`local_hardware` uses it); ``copy_bandwidth_Bps`` counts
    read + write bytes of a copy into a preallocated buffer. Matmul: square fp32 GEMM on CPU, bf16 on GPU,
    counting 2·n³ FLOPs. Each rate is the median of ``repeats`` timed runs after a warm-up, with its spread.
    ``quick`` keeps the call to a second or two (smaller buffers, fewer repeats; the buffers still far exceed a
    CPU's last-level cache); use ``quick=False`` for numbers worth recording.
    """
    dev = torch.device("cuda" if (device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if device == "auto" else device))
    gpu = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if gpu else (lambda: None)
    repeats = repeats or (5 if quick else 20)
    buffer_bytes = (1 if quick else 2) * 2**30 if gpu else (256 if quick else 512) * 2**20
    n = (8192 if quick else 16384) if gpu else (1024 if quick else 2048)
    mm_dtype = torch.bfloat16 if gpu else torch.float32

    info = _provenance(dev)
    bw = measure_bandwidth(dev, buffer_bytes, repeats=repeats, threads=threads)
    old_threads = torch.get_num_threads()
    if threads is not None and not gpu:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n, device=dev, dtype=mm_dtype)
        b = torch.randn(n, n, device=dev, dtype=mm_dtype)
        c = torch.empty(n, n, device=dev, dtype=mm_dtype)
        timer = _timer(dev)
        timer(lambda: torch.mm(a, b, out=c), 1)
        sync()
        mm_times = [timer(lambda: torch.mm(a, b, out=c), 1) for _ in range(repeats)]
        sync()
    finally:
        torch.set_num_threads(old_threads)
    mm_rates = [2 * n**3 / t for t in mm_times]
    return {
        **info,
        "quick": quick,
        "repeats": repeats,
        **bw,
        "ceiling": "read",
        "ceiling_Bps": bw["read_bandwidth_Bps"],
        "copy_bytes_moved": 2 * buffer_bytes,
        "matmul_dtype": "bf16" if gpu else "fp32",
        "matmul_n": n,
        "matmul_flops_per_s": statistics.median(mm_rates),
        "matmul_spread": _spread(mm_rates),
    }


def read_ceiling_Bps(measured: dict) -> float:
    """Decode's bandwidth ceiling from a :func:`measure_local` record: the read bandwidth. A record from before
    the read kernel was measured has only a copy figure, returned as it is (the caller's plots say which)."""
    return float(measured.get("read_bandwidth_Bps") or measured["copy_bandwidth_Bps"])


def local_hardware(measured: dict | None = None) -> HardwareSpec:
    """A :class:`HardwareSpec` whose ceilings are this machine's measured rates (measures now if not given): the
    bandwidth ceiling is the measured read bandwidth, because a decode step reads its weights and cache and
    writes almost nothing."""
    m = measured or measure_local()
    kind = "read" if m.get("read_bandwidth_Bps") else "copy"
    return HardwareSpec(key="local", name=f"local: {m['device_name']} (measured {m['date'][:10]}, {kind} BW)",
                        hbm_bandwidth=read_ceiling_Bps(m), hbm_capacity=None,
                        dense_flops={m["matmul_dtype"]: m["matmul_flops_per_s"]},
                        source=(f"kimik3.perf.hardware.measure_local, torch {m['torch_version']}",),
                        note=f"measured {kind} bandwidth (decode's ceiling) and matmul rate, not datasheet peaks",
                        measured=True, provenance=m)


def _main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.perf.hardware``: this machine's ceilings, and the read figure checked against a plain
    ``torch.sum`` over the same number of bytes timed in the same run (the two should agree within ~15 %)."""
    import argparse

    from kimik3.util.args import MAX_THREADS, bounded_int, output_file
    from kimik3.util.files import atomic_write_text, check_writable
    from kimik3.util.text import refuse

    ap = argparse.ArgumentParser(prog="python -m kimik3.perf.hardware", description=_main.__doc__)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="smaller buffers and fewer repeats")
    ap.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None)
    ap.add_argument("--out", type=output_file, default=None, help="write the record as JSON here")
    a = ap.parse_args(argv)
    try:  # before measuring: a refused output should cost nothing
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available on this machine")
        if a.out:
            check_writable(a.out)
    except ValueError as e:
        return refuse("hardware", e)
    m = measure_local(a.device, quick=a.quick, threads=a.threads)
    dev = torch.device(m["device"])
    x = torch.ones(m["bandwidth_buffer_bytes"] // 4, device=dev)
    timer = _timer(dev)
    timer(x.sum, 1)
    plain = statistics.median(x.numel() * 4 / timer(x.sum, 1) for _ in range(m["bandwidth_repeats"]))
    m["plain_torch_sum_Bps"] = plain
    for k in STREAM_KERNELS:
        s = m[f"{k}_bandwidth_spread"]
        print(f"{k:6s} {s['median'] / 1e9:8.1f} GB/s  (min {s['min'] / 1e9:.1f}, max {s['max'] / 1e9:.1f}, "
              f"n={s['n']})")
    print(f"plain torch.sum over {m['bandwidth_buffer_bytes'] / 2**20:.0f} MiB: {plain / 1e9:.1f} GB/s "
          f"(read / plain = {m['read_bandwidth_Bps'] / plain:.2f})")
    print(f"matmul {m['matmul_dtype']} n={m['matmul_n']}: {m['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s; "
          f"threads {m['bandwidth_threads']}, load {m['load_average_1m']}, {m['device_name']}")
    if a.out:
        atomic_write_text(a.out, json.dumps(m, indent=1))  # a reader never sees half a record
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
