"""Measured constants: the device check's ``data/measurements/constants-<hardware>.json`` read, checked and laid
over the model's constants (``data/perf/constants.json``), so a GPU run's microbenchmarks score the designs.

A malformed file is refused naming the file and the key. A measured constant replaces the point value and its
spread replaces the range; the unloaded HBM latency only raises the low bound of the latency under load the model
needs; the bandwidth sweep replaces Little's law as the relation from bytes in flight to bandwidth. The file format
and what each name means: ``data/perf/README.md``; docs/architecture.md, appendix "perfmodel: one instruction's
time". Nothing here is used unless asked for (``measured_constants``, ``python -m kimik3 predict --measured``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kimik3.perfmodel.data import PERF_DIR, SLOWER_WHEN_LARGER, Constants, load_constants
from kimik3.util.files import read_json_file

__all__ = ["MEASUREMENTS_DIR", "MEASURED_UNITS", "SWEEP", "Measured", "measured_path", "load_measured",
           "apply_measured", "measured_constants"]

MEASUREMENTS_DIR = PERF_DIR.parent / "measurements"
# the names a measured file may carry and the unit each must be written in (the model works in ns and fractions)
MEASURED_UNITS = {"hbm_read_efficiency": "fraction", "hbm_latency_ns": "ns", "hbm_loaded_latency_ns": "ns",
                  "signal_acquire_ns": "ns", "kernel_boundary_ns": "ns"}
SWEEP = "bandwidth_vs_bytes_in_flight_per_sm"
_TOP = ("hardware", "date", "commit", "device", "source", "constants")


@dataclass(frozen=True)
class Measured:
    """A checked measured-constants file: provenance, per name ``{value, unit, method, samples, spread}``, and the
    sweep as ascending (bytes in flight per SM, whole-chip bytes/s) pairs (empty when the file has none)."""

    path: Path
    hardware: str
    date: str
    commit: str
    device: str
    source: str
    constants: dict[str, dict[str, Any]]
    sweep: tuple[tuple[float, float], ...] = ()


def measured_path(hardware: str = "h200") -> Path:
    """Where the device check writes the measured constants of ``hardware``."""
    return MEASUREMENTS_DIR / f"constants-{hardware}.json"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _text(p: Path, data: dict[str, Any], key: str) -> str:
    v = data.get(key)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{p}: {key} must be a non-empty string, got {v!r}")
    return v


def _constant(p: Path, name: str, e: Any) -> dict[str, Any]:
    where = f"{p}: constants.{name}"
    if name not in MEASURED_UNITS:
        raise ValueError(f"{where}: unknown measured constant (known: {', '.join(MEASURED_UNITS)})")
    if not isinstance(e, dict):
        raise ValueError(f"{where} must be an object, got {e!r}")
    for key in ("value", "unit", "method", "samples", "spread"):
        if key not in e:
            raise ValueError(f"{where}: missing {key!r}")
    v = e["value"]
    if not _number(v) or v <= 0:
        raise ValueError(f"{where}.value must be a finite positive number, got {v!r}")
    unit = e["unit"]
    if not isinstance(unit, str) or not unit.startswith(MEASURED_UNITS[name]):
        raise ValueError(f"{where}.unit must be {MEASURED_UNITS[name]!r} (the unit the model uses), got {unit!r}")
    if not isinstance(e["method"], str) or not e["method"].strip():
        raise ValueError(f"{where}.method must say how it was measured, got {e['method']!r}")
    n = e["samples"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}.samples must be a positive integer, got {n!r}")
    s = e["spread"]
    if not (isinstance(s, list) and len(s) == 2 and all(_number(x) and x > 0 for x in s) and s[0] <= v <= s[1]):
        raise ValueError(f"{where}.spread must be [min, max], positive and finite, around the value {v!r}, got {s!r}")
    if name == "hbm_read_efficiency" and s[1] > 1:
        raise ValueError(f"{where}: a read efficiency above 1 is above the datasheet peak (spread {s!r})")
    return {"value": float(v), "unit": unit, "method": e["method"], "samples": n, "spread": (float(s[0]), float(s[1]))}


def _sweep(p: Path, sweeps: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(sweeps, dict):
        raise ValueError(f"{p}: sweeps must be an object, got {type(sweeps).__name__}")
    unknown = sorted(set(sweeps) - {SWEEP})
    if unknown:
        raise ValueError(f"{p}: sweeps.{unknown[0]}: unknown sweep (known: {SWEEP})")
    if SWEEP not in sweeps:
        return ()
    pts = sweeps[SWEEP]
    if not isinstance(pts, list) or not pts:
        raise ValueError(f"{p}: sweeps.{SWEEP} must be a non-empty list of points")
    out = []
    for i, pt in enumerate(pts):
        where = f"{p}: sweeps.{SWEEP}[{i}]"
        if not isinstance(pt, dict) or "bytes_in_flight_per_sm" not in pt or "Bps" not in pt:
            raise ValueError(f"{where} must be an object with 'bytes_in_flight_per_sm' and 'Bps', got {pt!r}")
        x, y = pt["bytes_in_flight_per_sm"], pt["Bps"]
        if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
            raise ValueError(f"{where}.bytes_in_flight_per_sm must be a positive integer, got {x!r}")
        if not _number(y) or y <= 0:
            raise ValueError(f"{where}.Bps must be a finite positive number, got {y!r}")
        out.append((float(x), float(y)))
    out.sort()
    if len({x for x, _ in out}) != len(out):
        raise ValueError(f"{p}: sweeps.{SWEEP}: a bytes_in_flight_per_sm value appears twice")
    # more bytes in flight never sustain less: a kernel could always keep fewer outstanding
    best, mono = 0.0, []
    for x, y in out:
        best = max(best, y)
        mono.append((x, best))
    return tuple(mono)


def load_measured(path: str | Path, hardware: str | None = None) -> Measured:
    """Read and check a measured-constants file; ``hardware``: the hardware the model's constants describe
    (default: ``data/perf/constants.json``'s). Every problem is a ``ValueError`` naming the file and the key."""
    p = Path(path)
    data = read_json_file(p, "measured-constants file")
    if not isinstance(data, dict):
        raise ValueError(f"{p}: must be a JSON object")
    for key in _TOP:
        if key not in data:
            raise ValueError(f"{p}: missing key {key!r}")
    want = hardware or load_constants().hardware
    hw = _text(p, data, "hardware")
    if hw != want:
        raise ValueError(f"{p}: hardware {hw!r} is unknown to the model, whose constants describe {want!r}")
    if p.name.startswith("constants-") and p.stem != f"constants-{hw}":
        raise ValueError(f"{p}: hardware {hw!r} does not match the file name (constants-{hw}.json)")
    date = _text(p, data, "date")
    try:
        datetime.fromisoformat(date)
    except ValueError:
        raise ValueError(f"{p}: date must be an ISO 8601 date, got {date!r}") from None
    consts = data["constants"]
    if not isinstance(consts, dict):
        raise ValueError(f"{p}: constants must be an object, got {type(consts).__name__}")
    checked = {name: _constant(p, name, e) for name, e in consts.items()}
    sweep = _sweep(p, data["sweeps"]) if "sweeps" in data else ()
    return Measured(p, hw, date, _text(p, data, "commit"), _text(p, data, "device"), _text(p, data, "source"),
                    checked, sweep)


def apply_measured(consts: Constants, m: Measured) -> Constants:
    """``consts`` with ``m``'s measurements in place: each measured constant's value and its spread as the range,
    ``hbm_loaded_latency_ns`` as the model's ``hbm_latency_ns`` (the latency under load Little's law needs), the
    unloaded ``hbm_latency_ns`` as that latency's low bound when no loaded one was measured, the sweep in place of
    Little's law. ``Constants.measured`` says, per model constant, how it was set."""
    if m.hardware != consts.hardware:
        raise ValueError(f"{m.path}: hardware {m.hardware!r}, the constants describe {consts.hardware!r}")
    vals, ranges, how = dict(consts.values), dict(consts.ranges), dict(consts.measured)
    tag = f"{m.path.name} ({m.date}, {m.commit[:12]}, {m.device})"
    for name, e in m.constants.items():
        target = "hbm_latency_ns" if name == "hbm_loaded_latency_ns" else name
        if name == "hbm_latency_ns":
            continue
        vals[target] = e["value"]
        if target in SLOWER_WHEN_LARGER:
            ranges[target] = e["spread"]
        src = f" from {name}" if target != name else ""
        how[target] = f"measured{src}: {e['method']}, {e['samples']} samples, {tag}"
        if name == "hbm_loaded_latency_ns" and "hbm_latency_ns" in m.constants:
            how[target] += "; the unloaded hbm_latency_ns is not used (the model needs the latency under load)"
    unloaded = m.constants.get("hbm_latency_ns")
    if unloaded is not None and "hbm_loaded_latency_ns" not in m.constants:
        floor = unloaded["value"]
        lo, hi = ranges.get("hbm_latency_ns", (vals["hbm_latency_ns"], vals["hbm_latency_ns"]))
        vals["hbm_latency_ns"] = max(vals["hbm_latency_ns"], floor)
        ranges["hbm_latency_ns"] = (floor, max(hi, vals["hbm_latency_ns"]))
        how["hbm_latency_ns"] = (f"low bound measured (unloaded pointer chase, {unloaded['method']}, "
                                 f"{unloaded['samples']} samples, {tag}); value and high bound still recalled")
    sweep = consts.sweep
    if m.sweep:
        sweep = m.sweep
        how[SWEEP] = (f"measured: replaces Little's law (in flight / hbm_latency_ns) as the bandwidth bytes in flight "
                      f"sustain, {len(m.sweep)} points, {tag}")
    return replace(consts, values=vals, ranges=ranges, measured=how, sweep=sweep)


def measured_constants(path: str | Path | None = None, base: Constants | None = None) -> Constants:
    """The model's constants (``base``, default ``data/perf/constants.json``) with a measured file laid over them
    (default :func:`measured_path` of their hardware)."""
    c = base or load_constants()
    return apply_measured(c, load_measured(path if path is not None else measured_path(c.hardware), c.hardware))
