"""Recorded measurements (``data/measurements/*.json``) as one table, for plotting next to the analytic bounds.

Why a loader: measurements are taken on machines that come and go (a borrowed GPU, a CI runner), so each run is
committed as a small JSON file with its provenance (date, commit, device) and every figure that plots it labels the
points "recorded <date> <commit>": a reader can always tell a measurement from a bound, and which code it measured.

File format (documented in ``data/README.md``): an object whose top-level keys (``date``, ``commit``, ``device``,
``preset``, ``stage``, ``batch_size``, ``context_len``, ...) apply to every entry of its ``records`` list; each
record has at least ``seconds`` and usually ``flops`` and ``bytes`` (analytic counts for what was timed) and a
``block`` ("step" for a whole decode step). A file may also be a single record or a list of records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kimik3.perf.cost import decode_cost
from kimik3.perf.hardware import get_hardware, list_hardware

__all__ = ["RECORDED_COLUMNS", "claims_vs_bound", "load_published", "load_recorded", "resolve_data_path",
           "speed_claims"]

RECORDED_COLUMNS = ["label", "date", "commit", "device", "preset", "stage", "block", "batch_size", "context_len",
                    "seconds", "flops", "bytes", "source_file"]
_REPO_ROOT = Path(__file__).resolve().parents[2]
PUBLISHED_JSON = _REPO_ROOT / "data" / "published.json"


MEASURED_CONSTANTS_PREFIX = "constants-"  # data/measurements/constants-<hw>.json: the device's model constants

def resolve_data_path(path: str | Path) -> Path:
    """``path`` as given if it exists (relative to the working directory), else relative to the repository root,
    so notebooks run from ``notebooks/`` and scripts run from the root find the same ``data/``."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return _REPO_ROOT / p


def _records_of(raw, file: Path) -> list[dict]:
    if isinstance(raw, list):
        return [dict(r) for r in raw]
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object or list, got {type(raw).__name__}")
    if "records" in raw:
        meta = {k: v for k, v in raw.items() if k != "records"}
        if not isinstance(raw["records"], list):
            raise ValueError(f"{file}: 'records' must be a list")
        return [{**meta, **r} for r in raw["records"]]
    return [dict(raw)]


def load_recorded(dir: str | Path = "data/measurements") -> pd.DataFrame:
    """Every record in ``dir/*.json`` as one DataFrame (columns ``RECORDED_COLUMNS`` first, then any extra keys),
    sorted by date; an empty frame with those columns when there are none. A malformed file raises ValueError
    naming it: a silently skipped measurement is worse than a failed plot."""
    folder = resolve_data_path(dir)
    rows: list[dict] = []
    for file in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if file.name.startswith(MEASURED_CONSTANTS_PREFIX):  # not timings: kimik3.perfmodel.measured reads them
            continue
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
        for r in _records_of(raw, file):
            if "seconds" not in r and "ms" in r:
                r["seconds"] = float(r["ms"]) / 1e3
            if "seconds" not in r:
                raise ValueError(f"{file}: record without 'seconds' (or 'ms'): {r}")
            r["source_file"] = str(file)
            rows.append(r)
    if not rows:
        return pd.DataFrame(columns=RECORDED_COLUMNS)
    df = pd.DataFrame(rows)
    for c in RECORDED_COLUMNS:
        if c not in df.columns:
            df[c] = None
    df["date"] = df["date"].astype(str)
    df["commit"] = df["commit"].fillna("?").astype(str).str[:12]
    df["label"] = "recorded " + df["date"].str[:10] + " " + df["commit"]
    extra = [c for c in df.columns if c not in RECORDED_COLUMNS]
    return df[RECORDED_COLUMNS + extra].sort_values("date", kind="stable").reset_index(drop=True)


# ====================================================================== published figures


def load_published(path: str | Path | None = None) -> pd.DataFrame:
    """``data/published.json`` as one row per claim, with its source and whether it was verified in the source."""
    raw = json.loads(Path(path or PUBLISHED_JSON).read_text())["claims"]
    rows = [{**{k: v for k, v in c.items() if k != "source"}, "source_title": c["source"].get("title"),
             "source_publisher": c["source"].get("publisher"), "source_date": c["source"].get("date"),
             "source_url": c["source"].get("url")} for c in raw]
    return pd.DataFrame(rows)


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and x != x)


def _speed_claims(claims: pd.DataFrame) -> list[dict]:
    """(claim, batch, hardware, system, devices, tokens/s per user) for every tokens/s figure, sweeps expanded."""
    out = []
    for c in claims.to_dict("records"):
        if c["metric"] == "tokens_per_s_per_user" and isinstance(c["value"], (int, float)):
            out.append(dict(id=c["id"], claim=c["claim"], batch_size=c["batch_size"], hardware=c["hardware"],
                            system=c["system"], devices=c["gpus"], per_user=float(c["value"]),
                            verified=c["verified"], note=c.get("note", "")))
        elif c["metric"] == "tokens_per_s_aggregate" and isinstance(c["value"], dict):
            v = c["value"]
            for hw in (k for k in v if k != "batch_sizes"):
                for b, agg in zip(v["batch_sizes"], v[hw]):
                    out.append(dict(id=f"{c['id']}:{hw}:B{b}", claim=f"{agg} tok/s aggregate at B={b} on {hw}",
                                    batch_size=b, hardware=hw, system=c["system"], devices=c["gpus"],
                                    per_user=agg / b, verified=c["verified"], note=c.get("note", "")))
    return out


def speed_claims(hardware: tuple[str, ...] | None = None, published: str | Path | None = None) -> pd.DataFrame:
    """Every published tokens/s figure as tokens/s per user (sweeps expanded; a figure repeated by a sweep once),
    with a short plot label naming its value, batch, system, publisher and whether it was verified in its source.
    """
    claims = load_published(published)
    publisher = dict(zip(claims["id"], claims["source_publisher"]))
    rows, seen = [], set()
    for c in _speed_claims(claims):
        key = (c["hardware"], c["batch_size"], c["per_user"])
        if key in seen or (hardware and c["hardware"] not in hardware):
            continue
        seen.add(key)
        who = (publisher.get(c["id"].split(":")[0]) or "").split(" (")[0]
        batch = "batch not stated" if _missing(c["batch_size"]) else f"B={c['batch_size']}"
        c["label"] = (f"{c['system'] if c['hardware'] != 'gb200' else '16×GB200'}: {c['per_user']:.0f} at {batch} "
                      f"({who}, {'verified' if c['verified'] else 'unverified'})")
        rows.append(c)
    return pd.DataFrame(rows)


def claims_vs_bound(preset: str = "kimi-k3", expert_dtype: str = "mxfp4", context_len: int = 8192,
                    published: str | Path | None = None, **cost_kwargs) -> pd.DataFrame:
    """What each published tokens/s figure implies about memory bandwidth, under this package's cost model.

    One decode step gives every sequence one token, so steps/s = tokens/s per user, and the step's bytes times
    steps/s is the aggregate bandwidth the system must have sustained (speculative decoding, which accepts several
    tokens per step, would lower it). Divided by one device's datasheet bandwidth it gives the fewest devices
    that could do it at 100 %, and with the device count (stated, or all 72 of an NVL72 if not) the implied
    bandwidth utilisation. A claim without a batch size is evaluated at batch 1 (the fewest bytes per step, so the
    least bandwidth: a conservative reading) and flagged ``batch_assumed``.
    """
    rows, seen = [], set()
    known_hw = set(list_hardware())
    for c in _speed_claims(load_published(published)):
        key = (c["hardware"], c["batch_size"], c["per_user"])
        if key in seen:  # a sweep repeating a figure that is also its own claim
            continue
        seen.add(key)
        b = 1 if _missing(c["batch_size"]) else int(c["batch_size"])
        cost = decode_cost(preset, b, context_len, expert_dtype=expert_dtype, **cost_kwargs)
        implied = cost.total_bytes * c["per_user"]
        spec = get_hardware(c["hardware"]) if c["hardware"] in known_hw else None
        devices, assumed = (None if _missing(c["devices"]) else int(c["devices"])), False
        if devices is None and isinstance(c["system"], str) and "NVL72" in c["system"]:
            devices, assumed = 72, True
        per_device = spec.hbm_bandwidth if spec else None
        rows.append({
            "id": c["id"], "system": c["system"], "batch_size": b, "batch_assumed": _missing(c["batch_size"]),
            "tokens_per_s_per_user": c["per_user"], "ms_per_step": 1e3 / c["per_user"],
            "bytes_per_step_GB": cost.total_bytes / 1e9, "implied_TBps": implied / 1e12,
            "device_TBps": per_device / 1e12 if per_device else None,
            "devices": devices, "devices_assumed": assumed,
            "devices_at_full_bandwidth": implied / per_device if per_device else None,
            "bandwidth_utilisation": implied / (devices * per_device) if (per_device and devices) else None,
            "verified": c["verified"],
        })
    return pd.DataFrame(rows)
