"""Roofline and latency-roofline figures (plotly), and an interactive panel to explore them (§8).

A roofline puts every block of a decode step on one picture — arithmetic intensity (FLOP per byte moved) against
attained FLOP/s, under each chip's memory and compute ceilings — so it shows at a glance that decode blocks sit far
left of every ridge point (bandwidth-bound) and how close a measured stage gets to its ceiling; the latency
roofline turns the same bound into the least time per step and the most tokens/s per sequence as batch and
context grow. Points are analytic (a :class:`~kimik3.perf.cost.DecodeCost` at its lower bound on a chip) or
measured (the same FLOPs and bytes over a measured time); recordings in ``data/measurements/*.json`` are labelled
"recorded <date> <commit>". Everything builds headless; :func:`save_html` writes self-contained HTML.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kimik3.model.config import PRESET_NAMES, ModelConfig
from kimik3.perf.cost import BYTES_PER_ELEMENT, MLA_FORMS, DecodeCost, decode_cost
from kimik3.perf.hardware import HardwareSpec, get_hardware, hardware_for_device, list_hardware
from kimik3.perf.recorded import load_recorded

__all__ = ["RooflinePanel", "check_ceilings", "declutter_labels", "latency_roofline_figure", "latency_table",
           "points_from_cost", "roofline_figure", "roofline_panel", "save_html"]

POINT_COLUMNS = ["label", "block", "stage", "kind", "flops", "bytes", "seconds", "intensity", "flops_per_s",
                 "hardware"]
_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
_BYTE_COLUMNS = ["weight_bytes", "state_bytes_read", "state_bytes_written", "kv_bytes_read", "kv_bytes_written",
                 "activation_bytes"]


def _hw(h: str | HardwareSpec) -> HardwareSpec:
    return h if isinstance(h, HardwareSpec) else get_hardware(h)


def _compute_dtype_for(expert_dtype: str) -> str:
    """The tensor-core precision a fast kernel would use for the bulk of the FLOPs, given the expert storage."""
    return {"mxfp4": "fp4", "nvfp4": "fp4", "fp8": "fp8"}.get(expert_dtype, "bf16")


# ====================================================================== points


def points_from_cost(cost: DecodeCost, hardware: str | HardwareSpec | None = "h200",
                     seconds: float | Mapping[str, float] | None = None, *, by: str = "kind",
                     compute_dtype: str | None = None, stage: str = "analytic", kind: str | None = None
                     ) -> pd.DataFrame:
    """Roofline points for one decode step, one per block kind (``by="kind"``), per (layer, block)
    (``by="layer"``) or one for the whole step (``by="step"``).

    Without ``seconds`` each point is timed at its own lower bound on ``hardware`` (max of bytes/bandwidth and
    FLOPs/peak), so it lies on that chip's roofline: the best any implementation could do. With ``seconds`` (one
    time for the step, or a block → seconds mapping) the points are measured: same FLOPs and bytes, real time.
    ``kind`` names what such times are when they are not measurements (e.g. "calibrated model v2"): the legend
    shows it instead of "measured", and a point above its ceiling is still flagged.
    """
    if by not in ("kind", "layer", "step"):
        raise ValueError(f"by must be 'kind', 'layer' or 'step', got {by!r}")
    df = cost.by_block.copy()
    df["bytes"] = df[_BYTE_COLUMNS].sum(axis=1)
    if by == "kind":
        g = df.groupby("block", sort=False)[["flops", "bytes"]].sum().reset_index()
        g["label"] = g["block"]
    elif by == "layer":
        g = df[["layer", "block", "flops", "bytes"]].copy()
        g["label"] = g["block"] + " L" + g["layer"].astype(str)
    else:
        g = pd.DataFrame({"block": ["step"], "flops": [df["flops"].sum()], "bytes": [df["bytes"].sum()],
                          "label": [f"step B={cost.batch_size}"]})
    g = g[(g["bytes"] > 0) & (g["flops"] > 0)].reset_index(drop=True)
    spec = _hw(hardware) if hardware is not None else None
    if seconds is None:
        if spec is None:
            raise ValueError("analytic points need a hardware to be timed at their bound (or pass seconds=)")
        peak, _ = spec.compute_ceiling(compute_dtype or _compute_dtype_for(cost.expert_dtype))
        g["seconds"] = np.maximum(g["bytes"] / spec.hbm_bandwidth, g["flops"] / peak)
        kind = "analytic"
    elif isinstance(seconds, Mapping):
        g["seconds"] = g["block"].map(seconds)
        g = g.dropna(subset=["seconds"]).reset_index(drop=True)
        kind = kind or "measured"
    else:
        if by != "step":
            raise ValueError("a single measured time applies to the whole step: use by='step' or a mapping")
        g["seconds"] = float(seconds)
        kind = kind or "measured"
    g["stage"], g["kind"] = stage, kind
    g["hardware"] = spec.name if spec is not None else ""
    g["intensity"] = g["flops"] / g["bytes"]
    g["flops_per_s"] = g["flops"] / g["seconds"]
    return g[POINT_COLUMNS]


def _recorded_points(recorded_dir: str | Path) -> pd.DataFrame:
    rec = load_recorded(recorded_dir)
    if rec.empty:
        return pd.DataFrame(columns=POINT_COLUMNS)
    rec = rec.dropna(subset=["flops", "bytes", "seconds"])
    rec = rec[(rec["flops"].astype(float) > 0) & (rec["bytes"].astype(float) > 0)]
    out = pd.DataFrame({
        "label": rec["label"], "block": rec["block"].fillna("step"), "stage": rec["stage"].fillna(""),
        "kind": "recorded", "flops": rec["flops"].astype(float), "bytes": rec["bytes"].astype(float),
        "seconds": rec["seconds"].astype(float), "hardware": rec["device"].fillna("")})
    out["intensity"] = out["flops"] / out["bytes"]
    out["flops_per_s"] = out["flops"] / out["seconds"]
    out["ceiling_Bps"] = [_record_ceiling(r) for r in rec.to_dict("records")]
    return out[[*POINT_COLUMNS, "ceiling_Bps"]].reset_index(drop=True)


def _recorded_on(device: str, specs: Sequence[HardwareSpec]) -> bool:
    """Whether a recording made on ``device`` belongs under one of ``specs``' ceilings: a GPU run under the datasheet
    entry its name names (:func:`~kimik3.perf.hardware.hardware_for_device`), any other run under a measured (local)
    machine's."""
    key = hardware_for_device(device)
    return any((key is None) if sp.measured else (sp.key == key) for sp in specs)


def _record_ceiling(r: Mapping) -> float:
    """The bandwidth ceiling a record was measured against (a CPU bench's ceiling at the step's working-set size,
    else the read bandwidth where it has one; older records carry only a copy figure), NaN when it carries none."""
    for key in ("bandwidth_ceiling", "copy_bandwidth"):
        m = r.get(key)
        if isinstance(m, Mapping):
            ws = m.get("step_working_set")  # a CPU bench: the ceiling measured at this batch's step size
            if isinstance(ws, Mapping) and str(r.get("batch_size", r.get("batch"))) in ws:
                return float(ws[str(r.get("batch_size", r.get("batch")))]["ceiling_Bps"])
            v = m.get("read_bandwidth_Bps") or m.get("copy_bandwidth_Bps")
            if v:
                return float(v)
    for key in ("ceiling_Bps", "read_bandwidth_Bps", "copy_bandwidth_Bps"):
        v = r.get(key)
        if isinstance(v, (int, float)) and v == v and v > 0:
            return float(v)
    return float("nan")


def check_ceilings(points, hardware: Sequence[str | HardwareSpec] = ()) -> pd.DataFrame:
    """``points`` with each one's fraction of its own roof, unclamped: ``pct_of_ceiling`` = 100 · max(bytes/s ÷
    bandwidth, FLOP/s ÷ peak), and ``above_ceiling`` where a measured or recorded point exceeds it.

    Why: a point above its roof is not a fast kernel but a wrong measurement (the byte count, the clock or the
    ceiling), and must be shown as such, never as a result. A point's roof is its ``ceiling_Bps`` column when it
    has one (a record carries the bandwidth it was measured against), else that of the entry of ``hardware`` (or
    the datasheet) whose name or key is the point's ``hardware``; the compute peak is the chip's highest. Points
    with no known ceiling get NaN and are not flagged; analytic points sit on their roof by construction.
    """
    pts = _as_points(points).copy()
    specs: dict[str, HardwareSpec] = {}
    for h in hardware:
        sp = _hw(h)
        specs[sp.name], specs[sp.key] = sp, sp
    known = set(list_hardware())
    bw_col = pts["ceiling_Bps"].astype(float) if "ceiling_Bps" in pts else pd.Series(np.nan, index=pts.index)
    bws, peaks = [], []
    for (_, r), own in zip(pts.iterrows(), bw_col):
        name = str(r.get("hardware") or "")
        sp = specs.get(name) or (get_hardware(name) if name and name.lower() in known else None)
        flops = [v for v in sp.dense_flops.values() if v] if sp is not None else []
        bws.append(own if own == own else (sp.hbm_bandwidth if sp is not None else np.nan))
        peaks.append(max(flops) if flops else np.nan)
    pts["ceiling_Bps"], peak = bws, np.array(peaks, dtype=float)
    bps = pts["bytes"].astype(float) / pts["seconds"].astype(float)
    frac = np.fmax(bps.to_numpy() / pts["ceiling_Bps"].to_numpy(dtype=float),
                   pts["flops_per_s"].astype(float).to_numpy() / peak)
    pts["pct_of_ceiling"] = 100 * frac
    pts["above_ceiling"] = (pts["kind"] != "analytic") & (np.nan_to_num(frac, nan=0.0) > 1 + 1e-9)
    return pts


def _as_points(points) -> pd.DataFrame:
    if points is None:
        return pd.DataFrame(columns=POINT_COLUMNS)
    if isinstance(points, DecodeCost):
        return points_from_cost(points)
    if isinstance(points, pd.DataFrame):
        return points
    frames = [p if isinstance(p, pd.DataFrame) else points_from_cost(p) if isinstance(p, DecodeCost)
              else pd.DataFrame([p]) for p in points]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=POINT_COLUMNS)
    if "intensity" not in df:
        df["intensity"] = df["flops"] / df["bytes"]
    if "flops_per_s" not in df:
        df["flops_per_s"] = df["flops"] / df["seconds"]
    for c in POINT_COLUMNS:
        if c not in df:
            df[c] = ""
    return df


# ====================================================================== classic roofline


def declutter_labels(x: Sequence[float], y: Sequence[float], labels: Sequence[str],
                     min_decades: float = 0.18) -> list[str]:
    """Labels to print beside log-log points so that none lands on another: a point keeps its label only when no
    point already labelled lies within ``min_decades`` (in both log10 x and log10 y) of it, taken in the given
    order; the rest get "" (their label stays in the hover text). Non-positive coordinates are never labelled."""
    kept: list[tuple[float, float]] = []
    out = []
    for xi, yi, lab in zip(x, y, labels):
        if not (xi > 0 and yi > 0):
            out.append("")
            continue
        lx, ly = math.log10(float(xi)), math.log10(float(yi))
        if any(abs(lx - kx) < min_decades and abs(ly - ky) < min_decades for kx, ky in kept):
            out.append("")
            continue
        kept.append((lx, ly))
        out.append(str(lab))
    return out


def _ceiling_xy(spec: HardwareSpec, dtype: str, x_lo: float, x_hi: float) -> tuple[np.ndarray, np.ndarray, str]:
    peak, used = spec.compute_ceiling(dtype)
    ridge = peak / spec.hbm_bandwidth
    xs = np.array(sorted({x_lo, min(max(ridge, x_lo), x_hi), x_hi}))
    return xs, np.minimum(peak, xs * spec.hbm_bandwidth), used


def roofline_figure(points=None, hardware: Sequence[str | HardwareSpec] = ("h200",),
                    compute_dtypes: Sequence[str] = ("bf16",), *, recorded: bool = True,
                    recorded_dir: str | Path = "data/measurements", title: str | None = None,
                    label_points: bool | None = None) -> go.Figure:
    """Classic log-log roofline: arithmetic intensity (FLOP/byte) vs attained FLOP/s.

    ``points``: a DataFrame from :func:`points_from_cost` (or several, or a DecodeCost), one marker per row,
    grouped into traces by ``stage``/``kind``. ``hardware``: names or specs; each gets its memory ceiling and one
    compute ceiling per entry of ``compute_dtypes`` (a chip without that precision shows the next wider one it
    has, once). Recorded measurements are added when ``recorded``. ``label_points``: write each point's label
    next to it (default: only when there are at most 15 points; hover always shows it).
    """
    pts = _as_points(points)
    specs = [_hw(h) for h in hardware]
    elsewhere = 0
    if recorded:
        rec = _recorded_points(recorded_dir)
        if not rec.empty:  # a recording is placed only under the ceilings of the kind of machine it ran on
            here = np.array([_recorded_on(str(d), specs) for d in rec["hardware"]], dtype=bool)
            elsewhere = int((~here).sum())
            rec = rec[here]
        if not rec.empty:
            pts = pd.concat([pts, rec], ignore_index=True) if not pts.empty else rec
    if not pts.empty:
        pts = check_ceilings(pts, specs)
        flagged, pts = pts[pts["above_ceiling"]], pts[~pts["above_ceiling"]]
    else:
        flagged = pts
    ridges = [s.ridge_point(d) for s in specs for d in compute_dtypes]
    ai = pts["intensity"].astype(float).to_numpy() if not pts.empty else np.array([1.0])
    x_lo = 10 ** math.floor(math.log10(max(min(ai.min(), min(ridges, default=1.0)) / 3, 1e-3)))
    x_hi = 10 ** math.ceil(math.log10(max(ai.max(), max(ridges, default=1.0)) * 3))

    fig = go.Figure()
    for i, spec in enumerate(specs):
        color = _PALETTE[i % len(_PALETTE)]
        drawn: set[str] = set()
        for j, dtype in enumerate(compute_dtypes):
            xs, ys, used = _ceiling_xy(spec, dtype, x_lo, x_hi)
            if used in drawn:
                continue
            drawn.add(used)
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines", name=f"{spec.name} · {used} ceiling",
                line=dict(color=color, dash=["solid", "dash", "dot", "dashdot"][j % 4]),
                hovertemplate=f"{spec.name}<br>%{{x:.3g}} FLOP/B → %{{y:.3g}} FLOP/s<extra>{used}</extra>"))
    if label_points is None:
        label_points = len(pts) <= 15
    if not pts.empty:
        groups = pts.assign(_g=pts["stage"].astype(str) + " (" + pts["kind"].astype(str) + ")")
        # printed labels are decluttered over the whole figure (a label that would land on another is left to the
        # hover text), so small neighbouring blocks do not print their names on top of each other
        printed = pd.Series(declutter_labels(groups["intensity"], groups["flops_per_s"], groups["label"]),
                            index=groups.index)
        for k, (name, g) in enumerate(groups.groupby("_g", sort=False)):
            is_rec = (g["kind"] == "recorded").all()
            fig.add_trace(go.Scatter(
                x=g["intensity"], y=g["flops_per_s"], mode="markers+text" if label_points else "markers",
                name=f"{g['stage'].iloc[0]} · {g['label'].iloc[0]}" if is_rec else name, text=printed[g.index].tolist(),
                hovertext=g["label"], textposition="top center",
                marker=dict(size=9, symbol="diamond" if is_rec else "circle",
                            color=_PALETTE[(len(specs) + k) % len(_PALETTE)]),
                customdata=np.stack([g["bytes"] / 1e9, g["flops"] / 1e9, g["seconds"] * 1e3], axis=-1),
                hovertemplate="%{hovertext}<br>%{x:.3g} FLOP/B, %{y:.3g} FLOP/s<br>%{customdata[0]:.3g} GB, "
                              "%{customdata[1]:.3g} GFLOP, %{customdata[2]:.3g} ms<extra></extra>"))
    if not flagged.empty:  # drawn apart, as what they are: evidence of a measurement problem, not results
        fig.add_trace(go.Scatter(
            x=flagged["intensity"], y=flagged["flops_per_s"], mode="markers",
            name=f"above its ceiling: measurement problem, not a result ({len(flagged)})",
            text=flagged["label"].astype(str) + " · " + flagged["stage"].astype(str),
            marker=dict(size=11, symbol="x-open", color="#7f7f7f"), customdata=flagged[["pct_of_ceiling"]],
            hovertemplate="%{text}<br>%{customdata[0]:.0f}% of its own ceiling: a wrong byte count, clock or "
                          "ceiling<extra>measurement problem</extra>"))
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOP / byte moved)")
    fig.update_yaxes(type="log", title="attained FLOP/s")
    fig.update_layout(title=title or "Roofline: decode blocks against memory and compute ceilings",
                      template="plotly_white", legend=dict(font=dict(size=10)), height=560)
    if elsewhere:
        fig.add_annotation(text=f"{elsewhere} recorded point(s) from machines not drawn here left out",
                           xref="paper", yref="paper", x=1.0, y=0.0, xanchor="right", yanchor="bottom",
                           showarrow=False, font=dict(size=10, color="#777"))
    if any(sp.measured for sp in specs):
        fig.add_annotation(text="measured memory ceiling = read bandwidth (STREAM-style): decode's ceiling, "
                                "since a step reads weights and cache and writes almost nothing",
                           xref="paper", yref="paper", x=0, y=1.0, yanchor="bottom", showarrow=False,
                           font=dict(size=10, color="#555"))
    return fig


# ====================================================================== latency roofline


def _devices_needed(cost: DecodeCost, spec: HardwareSpec) -> int:
    if not spec.hbm_capacity:
        return 1
    return max(1, math.ceil((cost.resident_weight_bytes + cost.cache_bytes) / spec.hbm_capacity))


def latency_table(preset: str | ModelConfig = "kimi-k3", hardware: Sequence[str | HardwareSpec] = ("h200",),
                  batch_sizes: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                  context_lens: Iterable[int] = (0, 8192), expert_dtype: str = "mxfp4", *,
                  weight_dtype: str = "bf16", kv_dtype: str = "bf16", compute_dtype: str | None = None,
                  n_devices: int | Mapping[str, int] | None = None, mla_form: str = "absorbed") -> pd.DataFrame:
    """The numbers behind :func:`latency_roofline_figure`: one row per (hardware, context, batch) with bytes,
    FLOPs, devices, the lower bound ms/step = max(bytes / (n·BW), FLOPs / (n·peak)), which bound binds, and
    tokens/s per user (= 1000 / ms) and in aggregate.

    ``n_devices``: None = the fewest devices of that kind whose HBM holds the weights plus the largest batch's
    cache in the sweep (the same count for every point of one hardware, so curves stay comparable); an int or a
    per-hardware mapping fixes it. Devices are assumed perfectly parallel (no communication cost): a bound.
    """
    specs = [_hw(h) for h in hardware]
    batch_sizes, context_lens = list(batch_sizes), list(context_lens)
    dtype = compute_dtype or _compute_dtype_for(expert_dtype)
    costs = {(b, t): decode_cost(preset, b, t, weight_dtype=weight_dtype, expert_dtype=expert_dtype,
                                 kv_dtype=kv_dtype, mla_form=mla_form)
             for b in batch_sizes for t in context_lens}
    rows = []
    for spec in specs:
        if n_devices is None:
            n = max(_devices_needed(c, spec) for c in costs.values())
        elif isinstance(n_devices, Mapping):
            n = int(n_devices.get(spec.key, n_devices.get(spec.name, 1)))
        else:
            n = int(n_devices)
        peak, used = spec.compute_ceiling(dtype)
        for (b, t), c in costs.items():
            t_mem, t_cmp = c.total_bytes / (n * spec.hbm_bandwidth), c.total_flops / (n * peak)
            ms = 1e3 * max(t_mem, t_cmp)
            rows.append({"hardware": spec.key, "hardware_name": spec.name, "devices": n, "compute_dtype": used,
                         "batch_size": b, "context_len": t, "bytes": c.total_bytes, "flops": c.total_flops,
                         "ms_per_step": ms, "bound": "memory" if t_mem >= t_cmp else "compute",
                         "tokens_per_s_per_user": 1e3 / ms, "tokens_per_s": b * 1e3 / ms})
    return pd.DataFrame(rows)


def latency_roofline_figure(preset: str | ModelConfig = "kimi-k3", hardware: Sequence[str | HardwareSpec] = ("h200",),
                            batch_sizes: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                            context_lens: Iterable[int] = (0, 8192), expert_dtype: str = "mxfp4",
                            **kwargs) -> go.Figure:
    """Lower-bound ms/step and tokens/s per user vs batch size, one line per (hardware, context).

    Why: the roofline says decode is bandwidth-bound; this says what that costs a user. Per-user speed falls with
    batch size only as fast as the bytes per step grow (more experts touched, more state and cache), which is
    slowly at first — the reason batching is nearly free until the experts are all read. Extra keyword
    arguments go to :func:`latency_table`.
    """
    table = latency_table(preset, hardware, batch_sizes, context_lens, expert_dtype, **kwargs)
    # short names (the chip's key, its count, the context) and titles: the datasheet names filled half the width
    # with legend and the two subplot titles ran into each other
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("ms per step (lower bound)", "tokens/s per user (upper bound)"))
    dashes = ["solid", "dash", "dot", "dashdot", "longdash"]
    for i, ((_, n), g_hw) in enumerate(table.groupby(["hardware", "devices"], sort=False)):
        for j, (t, g) in enumerate(g_hw.groupby("context_len", sort=False)):
            name = f"{g['hardware'].iloc[0].upper()} ×{n}, T={t:,}"
            style = dict(color=_PALETTE[i % len(_PALETTE)], dash=dashes[j % len(dashes)])
            hover = ("B=%{x}<br>%{y:.3g}<br>%{text}<extra>" + f"{g['hardware_name'].iloc[0]} ×{n}, T={t:,}"
                     + "</extra>")
            text = [f"{b / 1e9:.1f} GB/step, {bd}-bound" for b, bd in zip(g["bytes"], g["bound"])]
            fig.add_trace(go.Scatter(x=g["batch_size"], y=g["ms_per_step"], mode="lines+markers", name=name,
                                     legendgroup=name, line=style, text=text, hovertemplate=hover), row=1, col=1)
            fig.add_trace(go.Scatter(x=g["batch_size"], y=g["tokens_per_s_per_user"], mode="lines+markers",
                                     name=name, legendgroup=name, showlegend=False, line=style, text=text,
                                     hovertemplate=hover), row=1, col=2)
    name = preset if isinstance(preset, str) else (preset.name or preset.family)
    fig.update_xaxes(type="log", title="batch size (sequences)")
    fig.update_yaxes(type="log", title="ms / step", row=1, col=1)
    fig.update_yaxes(type="log", title="tokens / s / user", row=1, col=2)
    fig.update_layout(title=f"Latency roofline: {name}, experts {expert_dtype} (no communication, perfect overlap)",
                      template="plotly_white", height=520, legend=dict(font=dict(size=10)))
    return fig


# ====================================================================== interactive panel

_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
_PANEL_HOVER = "%{hovertext}<br>%{x:.3g} FLOP/B → %{y:.3g} FLOP/s<extra></extra>"
_CONTEXTS = [0, 1024, 4096, 8192, 32768, 131072, 1048576]


def _figure_widget(fig: go.Figure):
    """A FigureWidget when the widget backend (anywidget) is installed, else the plain Figure: the panel still
    builds, updates its data, and renders through an Output widget."""
    try:
        return go.FigureWidget(fig), True
    except ImportError:
        return fig, False


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and getattr(ip, "kernel", None) is not None
    except ImportError:
        return False


try:
    import ipywidgets as _widgets

    _VBox = _widgets.VBox
except ImportError:  # pragma: no cover - ipywidgets is a hard dependency; keep the module importable anyway
    _widgets = None
    _VBox = object


class RooflinePanel(_VBox):
    """Controls (preset, hardware, batch, context, dtypes, MLA form) driving a roofline of the step's blocks.

    ``figure`` is a ``plotly.graph_objects.FigureWidget`` when anywidget is installed (else a ``go.Figure``
    rendered through an ``ipywidgets.Output``); ``controls`` maps control names to widgets; ``summary`` is an
    HTML line with the step's totals and bound; ``cost`` is the current :class:`DecodeCost`. Changing any control
    (in a notebook or programmatically) recomputes the cost and updates the figure's data in place.
    """

    def __init__(self, preset: str = "kimi-k3", hardware: str = "h200", batch_size: int = 1,
                 context_len: int = 8192, expert_dtype: str = "mxfp4", weight_dtype: str = "bf16",
                 kv_dtype: str = "bf16", mla_form: str = "absorbed") -> None:
        W = _widgets
        if W is None:
            raise ImportError("roofline_panel needs ipywidgets")
        batches = sorted(set(_BATCHES) | {batch_size})
        contexts = sorted(set(_CONTEXTS) | {context_len})
        style = {"description_width": "90px"}
        self.controls = {
            "preset": W.Dropdown(options=list(PRESET_NAMES), value=preset, description="preset", style=style),
            "hardware": W.Dropdown(options=list_hardware(), value=get_hardware(hardware).key,
                                   description="hardware", style=style),
            "batch_size": W.SelectionSlider(options=batches, value=batch_size, description="batch",
                                            style=style, continuous_update=False),
            "context_len": W.SelectionSlider(options=contexts, value=context_len, description="context",
                                             style=style, continuous_update=False),
            "expert_dtype": W.Dropdown(options=list(BYTES_PER_ELEMENT), value=expert_dtype,
                                       description="experts", style=style),
            "weight_dtype": W.Dropdown(options=["bf16", "fp8", "fp32"], value=weight_dtype,
                                       description="weights", style=style),
            "kv_dtype": W.Dropdown(options=["bf16", "fp8", "fp32"], value=kv_dtype, description="KV cache",
                                   style=style),
            "mla_form": W.Dropdown(options=list(MLA_FORMS), value=mla_form, description="MLA form", style=style),
        }
        self.summary = W.HTML()
        base = go.Figure([go.Scatter(mode="lines", name="memory ceiling", line=dict(color=_PALETTE[0])),
                          go.Scatter(mode="lines", name="compute ceiling", line=dict(color=_PALETTE[0], dash="dash")),
                          go.Scatter(mode="markers+text", name="blocks (at their bound)", textposition="top center",
                                     marker=dict(size=10, color=_PALETTE[1]), hovertemplate=_PANEL_HOVER),
                          go.Scatter(mode="markers", name="whole step", marker=dict(size=14, symbol="star",
                                                                                     color=_PALETTE[2]),
                                     hovertemplate=_PANEL_HOVER)])
        base.update_xaxes(type="log", title="arithmetic intensity (FLOP / byte)")
        base.update_yaxes(type="log", title="attained FLOP/s")
        base.update_layout(template="plotly_white", height=480, margin=dict(t=70),
                           title=dict(font=dict(size=14), y=0.97, x=0.02, xanchor="left"))
        self.figure, self.is_widget = _figure_widget(base)
        self.output = None if self.is_widget else W.Output()
        rows = [W.HBox([self.controls["preset"], self.controls["hardware"], self.controls["mla_form"]]),
                W.HBox([self.controls["batch_size"], self.controls["context_len"]]),
                W.HBox([self.controls["expert_dtype"], self.controls["weight_dtype"], self.controls["kv_dtype"]]),
                self.summary, self.figure if self.is_widget else self.output]
        super().__init__(rows)
        for w in self.controls.values():
            w.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, _change) -> None:
        self.update()

    def update(self) -> None:
        """Recompute the step's cost from the controls and refresh the figure and summary."""
        v = {k: w.value for k, w in self.controls.items()}
        spec = get_hardware(v["hardware"])
        self.cost = decode_cost(v["preset"], v["batch_size"], v["context_len"], weight_dtype=v["weight_dtype"],
                                expert_dtype=v["expert_dtype"], kv_dtype=v["kv_dtype"], mla_form=v["mla_form"])
        dtype = _compute_dtype_for(v["expert_dtype"])
        pts = points_from_cost(self.cost, spec, compute_dtype=dtype)
        step = points_from_cost(self.cost, spec, by="step", compute_dtype=dtype)
        peak, used = spec.compute_ceiling(dtype)
        lo = 10 ** math.floor(math.log10(max(min(pts["intensity"].min(), step["intensity"].min()) / 3, 1e-3)))
        hi = 10 ** math.ceil(math.log10(max(pts["intensity"].max(), spec.ridge_point(dtype)) * 3))
        xs, ys, _ = _ceiling_xy(spec, dtype, lo, hi)
        f = self.figure
        ctx = f.batch_update() if self.is_widget else contextlib.nullcontext()
        with ctx:
            f.data[0].update(x=[lo, hi], y=[lo * spec.hbm_bandwidth, hi * spec.hbm_bandwidth],
                             name=f"{spec.name}: {spec.hbm_bandwidth / 1e12:.2f} TB/s")
            f.data[1].update(x=xs, y=ys, name=f"{used} peak {peak / 1e12:,.0f} TFLOP/s")
            f.data[2].update(x=pts["intensity"].to_numpy(), y=pts["flops_per_s"].to_numpy(),
                             text=declutter_labels(pts["intensity"], pts["flops_per_s"], pts["label"]),
                             hovertext=pts["label"].tolist(), name="blocks (at their bound)")
            # every trace's name is set with its data: a FigureWidget shows the names its front end was last sent,
            # and one built with a name but never updated with it showed "trace 2" in the browser
            f.data[3].update(x=step["intensity"].to_numpy(), y=step["flops_per_s"].to_numpy(),
                             text=step["label"].tolist(), hovertext=step["label"].tolist(), name="whole step")
            f.layout.title.text = (f"{v['preset']} · B={v['batch_size']} · T={v['context_len']:,} · "
                                   f"experts {v['expert_dtype']} on {spec.key}")
        n = _devices_needed(self.cost, spec)
        bound_ms = 1e3 * self.cost.lower_bound_seconds(n * spec.hbm_bandwidth, n * peak)
        self.summary.value = (
            f"<b>{self.cost.total_bytes / 1e9:,.2f} GB</b> per step (weights {self.cost.weight_bytes / 1e9:,.2f}, "
            f"state {self.cost.state_bytes / 1e9:,.3f}, KV {self.cost.kv_bytes / 1e9:,.3f}) · "
            f"{self.cost.total_flops / 1e9:,.1f} GFLOP · {self.cost.arithmetic_intensity:.2f} FLOP/B · "
            f"{n}× {spec.key} hold weights + cache: ≥ {bound_ms:,.3f} ms/step, "
            f"≤ {1e3 / bound_ms:,.0f} tokens/s/user (no communication cost)")
        if self.output is not None and _in_kernel():
            from IPython.display import display

            with self.output:
                self.output.clear_output(wait=True)
                display(self.figure)


def roofline_panel(preset: str = "kimi-k3", hardware: str = "h200", batch_size: int = 1, context_len: int = 8192,
                   expert_dtype: str = "mxfp4", weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                   mla_form: str = "absorbed") -> RooflinePanel:
    """An ipywidgets panel exploring one decode step's roofline; see :class:`RooflinePanel`. Builds without a
    notebook frontend (controls can be set programmatically, e.g. in tests)."""
    return RooflinePanel(preset, hardware, batch_size, context_len, expert_dtype, weight_dtype, kv_dtype, mla_form)


# ====================================================================== output


def save_html(fig: go.Figure, path: str | Path, include_plotlyjs: bool | str = True) -> Path:
    """Write ``fig`` as standalone HTML (plotly.js embedded by default, so it opens offline); returns the path.
    Works for FigureWidgets too, and needs no frontend."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    go.Figure(fig).write_html(str(p), include_plotlyjs=include_plotlyjs, full_html=True)
    return p
