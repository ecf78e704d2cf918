"""Loading the model's constants (``data/perf/constants.json``: a point value per constant, a ``range`` on the ones
the model is least sure of) and designs (``data/perf/designs/<name>.json``); docs/architecture.md, appendix
"perfmodel: one instruction's time"."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from dataclasses import field as _dc_field
from pathlib import Path
from typing import Any

from kimik3.util.files import read_json_file

__all__ = ["PERF_DIR", "CURRENT_DESIGN", "SLOWER_WHEN_LARGER", "CORNERS", "Constants", "load_constants",
           "load_design", "design_names"]

PERF_DIR = Path(__file__).resolve().parents[2] / "data" / "perf"
# The design that describes the device code in kernels/ (its compiled numbers are checked against the build by
# tests/test_perfmodel.py); older designs stay as the record of the code they described.
CURRENT_DESIGN = "v4"
_REQUIRED = ("sm_count", "hbm_peak_Bps", "hbm_read_efficiency", "hbm_latency_ns", "l2_latency_ns",
             "l1_latency_cycles", "sm_clock_Hz", "issue_slots_per_sm_cycle", "l1_bandwidth_bytes_per_cycle",
             "l2_bandwidth_Bps", "sm_max_bandwidth_bytes_per_cycle", "l1_capacity_bytes", "max_threads_per_sm",
             "max_ctas_per_sm", "registers_per_sm", "register_alloc_granularity", "kernel_boundary_ns",
             "barrier_ns", "shuffle_latency_cycles", "signal_acquire_ns", "inflight_occupancy", "l1_free_fraction")
# The constants a range may be put on, and which way each moves a step: True where a larger value is slower. A range
# on any other constant is refused (the model would not know which end is the pessimistic one).
SLOWER_WHEN_LARGER = {"hbm_latency_ns": True, "signal_acquire_ns": True, "kernel_boundary_ns": True,
                      "hbm_read_efficiency": False, "inflight_occupancy": False, "l1_free_fraction": False}
CORNERS = ("optimistic", "pessimistic")


@dataclass(frozen=True)
class Constants:
    """Hardware constants, every one with its source in the JSON file. Derived rates are properties."""

    values: dict[str, float]
    sources: dict[str, str]
    hardware: str = "h200"
    # (low, high) of the constants the model is least sure of; the point value lies inside
    ranges: dict[str, tuple[float, float]] = _dc_field(default_factory=dict)
    # constant -> how a measured file set it (kimik3.perfmodel.measured); absent: the value of constants.json
    measured: dict[str, str] = _dc_field(default_factory=dict)
    # measured (bytes in flight per SM, whole-chip bytes/s) with every SM streaming, ascending in both
    sweep: tuple[tuple[float, float], ...] = ()

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

    @property
    def sync_round_trip_ns(self) -> float:
        """One counter round trip of a dependency: the release that signals it and the acquire that sees it are
        charged one each, so a producer-to-waiting-consumer hop costs ``signal_acquire_ns``."""
        return self.signal_acquire_ns / 2

    def inflight(self, design_bytes: float) -> float:
        """The bytes really in flight when the design keeps ``design_bytes`` outstanding."""
        return design_bytes * self.inflight_occupancy

    def rate_Bps(self, inflight: float, latency_ns: float, ctas: int = 1) -> float:
        """What ``inflight`` bytes outstanding per CTA sustain, before any cap: Little's law (in flight / latency),
        or, with a measured sweep, its bandwidth at ``inflight * ctas`` bytes per SM shared by the ``ctas`` CTAs
        (linear between points, through zero below the first, flat above the last)."""
        if not self.sweep:
            return inflight / (latency_ns * 1e-9)
        x = inflight * ctas
        pts = self.sweep
        if x <= pts[0][0]:
            chip = pts[0][1] * x / pts[0][0]
        elif x >= pts[-1][0]:
            chip = pts[-1][1]
        else:
            k = next(i for i in range(1, len(pts)) if pts[i][0] >= x)
            (x0, y0), (x1, y1) = pts[k - 1], pts[k]
            chip = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return chip / self.sm_count / ctas

    def corner(self, which: str) -> Constants:
        """These constants with every ranged one at its ``"optimistic"`` or ``"pessimistic"`` end (no ranges left):
        the model's time is monotone in each, so the two corners bound every combination inside the ranges."""
        if which not in CORNERS:
            raise ValueError(f"corner must be one of {', '.join(CORNERS)}, got {which!r}")
        vals = dict(self.values)
        for k, (lo, hi) in self.ranges.items():
            vals[k] = hi if SLOWER_WHEN_LARGER[k] == (which == "pessimistic") else lo
        return replace(self, values=vals, ranges={})

    def provenance(self) -> dict[str, Any]:
        """Which constants a measured file set (name -> how) and which are still the datasheet / recalled ones."""
        return {"constants_measured": dict(self.measured),
                "constants_recalled": sorted(k for k in self.values if k not in self.measured)}

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
    data = read_json_file(p, "constants file")
    entries = data.get("constants", {}) if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"{p}: expected an object with a 'constants' object")
    missing = [k for k in _REQUIRED if k not in entries]
    if missing:
        raise ValueError(f"{p}: constants missing: {', '.join(missing)}")
    values, sources, ranges = {}, {}, {}
    for k, e in entries.items():
        if not isinstance(e, dict) or "value" not in e or not e.get("source"):
            raise ValueError(f"{p}: constant {k!r} needs a 'value' and a 'source'")
        values[k] = float(e["value"])
        sources[k] = str(e["source"])
        if "range" in e:
            ranges[k] = _range(p, k, e, values[k])
    return Constants(values, sources, str(data.get("hardware", "h200")), ranges)


def _range(p: Path, k: str, e: dict[str, Any], value: float) -> tuple[float, float]:
    r = e["range"]
    if k not in SLOWER_WHEN_LARGER:
        raise ValueError(f"{p}: constant {k!r}: a range is only understood on {', '.join(SLOWER_WHEN_LARGER)}")
    if not e.get("range_source"):
        raise ValueError(f"{p}: constant {k!r}: a range needs a 'range_source' saying why those bounds")
    ok = isinstance(r, list) and len(r) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                     and math.isfinite(x) for x in r)
    if not ok or not r[0] <= value <= r[1]:
        raise ValueError(f"{p}: constant {k!r}: range must be [low, high] around the value {value}, got {r!r}")
    return float(r[0]), float(r[1])


def design_names() -> list[str]:
    return sorted(p.stem for p in (PERF_DIR / "designs").glob("*.json"))


def load_design(name_or_path: str | Path = CURRENT_DESIGN) -> dict[str, Any]:
    """A design by name (``data/perf/designs/<name>.json``) or path; its expressions are parsed (not run) here."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PERF_DIR / "designs" / f"{name_or_path}.json"
        if not p.exists():
            raise ValueError(f"unknown design {str(name_or_path)!r}; known: {', '.join(design_names())}")
    d = read_json_file(p, "design")
    if not isinstance(d, dict):
        raise ValueError(f"design {p}: expected a JSON object, got {type(d).__name__}")
    for key in ("name", "megakernel", "fused"):
        if key not in d:
            raise ValueError(f"design {p}: missing {key!r}")
    try:
        _check_design(d, p)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"design {p}: malformed ({type(e).__name__}: {e})") from None
    return d


def _check_design(d: dict[str, Any], p: Path) -> None:
    from kimik3.perfmodel.schema import check_design

    check_design(d, p)


def field(entry: Any) -> Any:
    """A design field's value (``{"value": v, "how": ...}`` or a bare value)."""
    return entry["value"] if isinstance(entry, dict) and "value" in entry else entry
