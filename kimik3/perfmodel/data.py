"""Loading the model's constants (``data/perf/constants.json``) and designs (``data/perf/designs/<name>.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PERF_DIR", "CURRENT_DESIGN", "Constants", "load_constants", "load_design", "design_names"]

PERF_DIR = Path(__file__).resolve().parents[2] / "data" / "perf"
# The design that describes the device code in kernels/ (its compiled numbers are checked against the build by
# tests/test_perfmodel.py); older designs stay as the record of the code they described.
CURRENT_DESIGN = "v2"
_REQUIRED = ("sm_count", "hbm_peak_Bps", "hbm_read_efficiency", "hbm_latency_ns", "l2_latency_ns",
             "l1_latency_cycles", "sm_clock_Hz", "issue_slots_per_sm_cycle", "l1_bandwidth_bytes_per_cycle",
             "l2_bandwidth_Bps", "sm_max_bandwidth_bytes_per_cycle", "l1_capacity_bytes", "max_threads_per_sm",
             "max_ctas_per_sm", "registers_per_sm", "register_alloc_granularity", "kernel_boundary_ns",
             "barrier_ns", "shuffle_latency_cycles")


@dataclass(frozen=True)
class Constants:
    """Hardware constants, every one with its source in the JSON file. Derived rates are properties."""

    values: dict[str, float]
    sources: dict[str, str]
    hardware: str = "h200"

    def __getattr__(self, name: str) -> float:
        v = self.__dict__.get("values", {})
        if name in v:
            return v[name]
        raise AttributeError(name)

    @property
    def achievable_Bps(self) -> float:
        """The real ceiling: achievable HBM read bandwidth, not the datasheet peak."""
        return self.hbm_peak_Bps * self.hbm_read_efficiency

    @property
    def sm_share_Bps(self) -> float:
        """One SM's share of the achievable bandwidth when every SM streams."""
        return self.achievable_Bps / self.sm_count

    @property
    def sm_max_Bps(self) -> float:
        return self.sm_max_bandwidth_bytes_per_cycle * self.sm_clock_Hz

    @property
    def l1_Bps(self) -> float:
        return self.l1_bandwidth_bytes_per_cycle * self.sm_clock_Hz

    @property
    def l2_share_Bps(self) -> float:
        return self.l2_bandwidth_Bps / self.sm_count

    @property
    def cycle_ns(self) -> float:
        return 1e9 / self.sm_clock_Hz

    def latency_ns(self, level: str) -> float:
        if level == "hbm":
            return self.hbm_latency_ns
        if level == "l2":
            return self.l2_latency_ns
        if level == "l1":
            return self.l1_latency_cycles * self.cycle_ns
        if level == "none":
            return 0.0
        raise ValueError(f"unknown memory level {level!r}; expected hbm, l2, l1 or none")


def load_constants(path: str | Path | None = None) -> Constants:
    p = Path(path) if path is not None else PERF_DIR / "constants.json"
    data = json.loads(p.read_text())
    entries = data.get("constants", {})
    missing = [k for k in _REQUIRED if k not in entries]
    if missing:
        raise ValueError(f"{p}: constants missing: {', '.join(missing)}")
    values, sources = {}, {}
    for k, e in entries.items():
        if not isinstance(e, dict) or "value" not in e or not e.get("source"):
            raise ValueError(f"{p}: constant {k!r} needs a 'value' and a 'source'")
        values[k] = float(e["value"])
        sources[k] = str(e["source"])
    return Constants(values, sources, str(data.get("hardware", "h200")))


def design_names() -> list[str]:
    return sorted(p.stem for p in (PERF_DIR / "designs").glob("*.json"))


def load_design(name_or_path: str | Path = CURRENT_DESIGN) -> dict[str, Any]:
    """A design by name (``data/perf/designs/<name>.json``) or path; its expressions are parsed (not run) here."""
    from kimik3.perfmodel.expr import check

    p = Path(name_or_path)
    if not p.suffix:
        p = PERF_DIR / "designs" / f"{name_or_path}.json"
        if not p.exists():
            raise ValueError(f"unknown design {str(name_or_path)!r}; known: {', '.join(design_names())}")
    d = json.loads(p.read_text())
    for key in ("name", "megakernel", "fused"):
        if key not in d:
            raise ValueError(f"design {p}: missing {key!r}")
    for op, e in d["megakernel"]["opcodes"].items():
        for s in e.get("streams", []):
            for f in ("bytes", "threads", "loads", "load_bytes"):
                check(s[f])
        for r in e.get("rereads", []):
            check(r["bytes"])
            check(r["footprint"])
        for s in e.get("serial", []):
            check(s["trips"])
            check(s["cycles"])
            if s["level"] not in ("hbm", "l2", "l1", "none"):
                raise ValueError(f"design {p}: {op}: serial level {s['level']!r}")
    return d


def field(entry: Any) -> Any:
    """A design field's value (``{"value": v, "how": ...}`` or a bare value)."""
    return entry["value"] if isinstance(entry, dict) and "value" in entry else entry
