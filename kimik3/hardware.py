"""Hardware ceilings for roofline bounds: vendor datasheet figures, and what this machine measures right now.

Why both: a bound is only as good as its ceilings. Datasheet peaks (``data/hardware.json``, every entry with its
source and a note where a figure is uncertain) say what a chip could do; :func:`measure_local` says what the
machine running the notebook actually does (copy bandwidth and matmul rate, with spread and provenance), so a
measured step can be placed against the ceiling of the machine it ran on.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

__all__ = ["DATA_DIR", "HardwareSpec", "get_hardware", "hardware_table", "list_hardware", "local_hardware",
           "measure_local"]

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
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


def _timed(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> list[float]:
    fn()
    sync()  # warm-up: allocator, kernels, caches
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _spread(rates: list[float]) -> dict[str, float]:
    q = statistics.quantiles(rates, n=4) if len(rates) >= 2 else [rates[0]] * 3
    return {"min": min(rates), "p25": q[0], "median": statistics.median(rates), "p75": q[2], "max": max(rates),
            "relative_iqr": (q[2] - q[0]) / statistics.median(rates)}


def measure_local(device: str | torch.device = "auto", quick: bool = True, repeats: int | None = None) -> dict:
    """Measure this machine's copy bandwidth and matmul rate now, with provenance and spread.

    Copy bandwidth: a large tensor clone, counting read + write bytes; matmul: square fp32 GEMM on CPU, bf16 on
    GPU, counting 2·n³ FLOPs. Each is the median of ``repeats`` timed runs after a warm-up. ``quick`` keeps the
    whole call to about a second on a laptop CPU (smaller tensors, fewer repeats); use ``quick=False`` for
    numbers worth recording.
    """
    dev = torch.device("cuda" if (device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if device == "auto" else device))
    gpu = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if gpu else (lambda: None)
    repeats = repeats or (5 if quick else 20)
    copy_bytes = (512 if quick else 2048) * 2**20 if gpu else (64 if quick else 512) * 2**20
    n = (8192 if quick else 16384) if gpu else (1024 if quick else 2048)
    mm_dtype = torch.bfloat16 if gpu else torch.float32

    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    copy_times = _timed(src.clone, sync, repeats)
    src = None  # free before the matmul operands are allocated
    a = torch.randn(n, n, device=dev, dtype=mm_dtype)
    b = torch.randn(n, n, device=dev, dtype=mm_dtype)
    mm_times = _timed(lambda: torch.mm(a, b), sync, repeats)

    copy_rates = [2 * copy_bytes / t for t in copy_times]  # read + write
    mm_rates = [2 * n**3 / t for t in mm_times]
    return {
        "device": str(dev),
        "device_name": _device_name(dev),
        "torch_version": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "quick": quick,
        "repeats": repeats,
        "copy_bytes_moved": 2 * copy_bytes,
        "copy_bandwidth_Bps": statistics.median(copy_rates),
        "copy_bandwidth_spread": _spread(copy_rates),
        "matmul_dtype": "bf16" if gpu else "fp32",
        "matmul_n": n,
        "matmul_flops_per_s": statistics.median(mm_rates),
        "matmul_spread": _spread(mm_rates),
    }


def local_hardware(measured: dict | None = None) -> HardwareSpec:
    """A :class:`HardwareSpec` whose ceilings are this machine's measured rates (measures now if not given)."""
    m = measured or measure_local()
    return HardwareSpec(key="local", name=f"local: {m['device_name']} (measured {m['date'][:10]})",
                        hbm_bandwidth=m["copy_bandwidth_Bps"], hbm_capacity=None,
                        dense_flops={m["matmul_dtype"]: m["matmul_flops_per_s"]},
                        source=(f"kimik3.hardware.measure_local, torch {m['torch_version']}",),
                        note="measured copy bandwidth and matmul rate, not datasheet peaks", measured=True,
                        provenance=m)
