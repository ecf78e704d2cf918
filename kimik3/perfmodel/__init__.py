"""A calibrated performance model of the GPU stages (``fused``, ``megakernel``) — a model, not a measurement (§8).

It must not flatter: it charges what the device code actually does (bytes in flight per SM and Little's law, the
shared-memory stage actually allocated, global round trips counted per instruction, serial loops at the latency
each trip waits on) against the achievable HBM read bandwidth, not the datasheet peak. Three inputs, all data:
**constants** (``data/perf/constants.json``, each with its source); **a design** (``data/perf/designs/<name>.json``:
per opcode / kernel threads, loads in flight, staging, loops, round trips; :data:`CURRENT_DESIGN` describes the
kernels in ``kernels/``, older designs stay as the record of the code they described); **bytes and FLOPs**, never
invented here (:func:`kimik3.megakernel.scheduler.instruction_costs`, :func:`kimik3.fused.launch_cost.launch_bytes`).
:func:`predict` scores a design; :func:`compare_opcodes` / :func:`compare_kernels` set a measured run against it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kimik3.fused.plan import EXPERT_DTYPES
from kimik3.perfmodel.data import CURRENT_DESIGN, PERF_DIR, Constants, design_names, field, load_constants, load_design
from kimik3.perfmodel.fused import fused_times
from kimik3.perfmodel.megakernel import instruction_times, simulate_model, stream_ns

__all__ = ["STAGES", "EXPERT_DTYPES", "PERF_DIR", "CURRENT_DESIGN", "Constants", "load_constants", "load_design",
           "design_names", "model_program", "scored_program", "design_tiling",
           "megakernel_model", "predict", "roofline_ms", "compare_opcodes", "compare_kernels", "opcode_report",
           "model_columns", "compare_designs", "design_expert_formats",
           "stream_ns", "instruction_times", "simulate_model", "fused_times"]

STAGES = ("megakernel", "fused")
MAX_BATCH = 4096  # decode rows per step: far past the kernels' 64, short of a program too big to build


def _check_experts(experts: str) -> None:
    """``experts``: how the routed experts are stored, as the fused stage names it (bf16, or MXFP4 — the K3
    release's format; for the megakernel program the expert format "mxfp4")."""
    if experts not in EXPERT_DTYPES:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_DTYPES)}, got {experts!r}")


def design_tiling(design: dict[str, Any]) -> tuple[tuple[str, int | str], ...]:
    """The tile sizes a design was scored with where they differ from the current ``Tiling.auto``
    (``megakernel.tiling``: field name -> an int, or "all" for a whole dimension), as hashable (name, value) pairs;
    () for none."""
    from dataclasses import fields

    from kimik3.megakernel.step import Tiling

    known = {f.name for f in fields(Tiling)}
    out = []
    for name, entry in sorted(field(design["megakernel"].get("tiling", {})).items()):
        v = field(entry)
        if name not in known:
            raise ValueError(f"design {design['name']}: unknown tiling field {name!r}")
        if not (v == "all" or (isinstance(v, int) and v >= 1)):
            raise ValueError(f"design {design['name']}: tiling {name} must be a positive int or 'all', got {v!r}")
        out.append((name, v))
    return tuple(out)


@lru_cache(maxsize=16)
def model_program(preset: str, batch: int, num_sms: int = 132, max_seq_len: int = 4096,
                  context_len: int | None = None, experts: str = "bf16",
                  tiling: tuple[tuple[str, int | str], ...] = ()) -> Any:
    """The megakernel program the GPU stage would run (critical-path policy), carrying its config and costs.
    ``tiling``: (field, value) overrides of ``Tiling.auto`` (:func:`design_tiling`; "all" = the whole dimension)."""
    from dataclasses import replace

    from kimik3.megakernel import build_program
    from kimik3.megakernel.ranks import of_slice
    from kimik3.megakernel.step import Tiling
    from kimik3.model.config import get_preset

    _check_experts(experts)
    cfg, shard = of_slice(get_preset(preset))  # a rank slice runs its rank's program of the whole model
    t = None
    if tiling:
        t = Tiling.auto(shard.slice_of(cfg), batch, num_sms, max_seq_len)
        whole = {"mla_partial_heads": cfg.num_attention_heads}
        over = {}
        for name, v in tiling:
            if v == "all" and name not in whole:
                raise ValueError(f"tiling {name}: 'all' is defined only for {', '.join(whole)}")
            over[name] = whole[name] if v == "all" else int(v)
        t = replace(t, **over)
    prog = build_program(cfg, batch, num_sms, "critical_path", max_seq_len, tiling=t, context_len=context_len,
                         expert_format="mxfp4" if experts == "mxfp4" else "dense", shard=shard)
    prog.cfg = cfg
    return prog


def megakernel_model(preset: str, batch: int, design: str | dict[str, Any] = CURRENT_DESIGN,
                     constants: Constants | None = None, context_len: int = 4096,
                     program: Any = None, experts: str = "bf16") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-instruction times, simulated timeline) of one megakernel step under a design (the program of
    :func:`model_program` with the design's tiling and the expert format, unless ``program`` is given)."""
    d = load_design(design) if isinstance(design, str) else design
    c = constants or load_constants()
    prog = program if program is not None else _design_program(preset, batch, d, c, context_len, experts)
    if getattr(prog, "cfg", None) is None:
        from kimik3.model.config import get_preset

        prog.cfg = get_preset(preset).whole()
    times = instruction_times(prog, d, c, context_len)
    tl = simulate_model(prog, times, **_timeline_options(d))
    return times, tl


def _timeline_options(d: dict[str, Any]) -> dict[str, bool]:
    """The design's staging options of the model timeline (refused where inconsistent)."""
    mk = d["megakernel"]
    ahead = bool(field(mk["prefetch_ahead"]))
    if ahead and int(field(mk.get("stage_buffers", {"value": 1}))) < 2:
        raise ValueError(f"design {d['name']}: prefetch_ahead needs at least two stage buffers (the next "
                         "instruction's weights cannot land in the stage the current one still reads)")
    if field(mk["stage_wait"]) not in ("all", "rows"):
        raise ValueError(f"design {d['name']}: stage_wait must be 'all' (every thread waits for the whole stage) or "
                         f"'rows' (a warp waits only for its own rows), got {field(mk['stage_wait'])!r}")
    return {"prefetch_ahead": ahead, "stage_wait_all": field(mk["stage_wait"]) == "all"}


def _rank(preset: str, batch: int, d: dict[str, Any], c: Constants, context_len: int, experts: str,
          out: dict[str, Any], times: pd.DataFrame, nbytes: float) -> dict[str, Any]:
    """A rank slice's step with the wire and the rack-level tokens/s (:mod:`kimik3.perfmodel.ranks`); ``times``:
    the point constants' instruction times of its program; ``nbytes``: the bytes its step moves (the roofline's)."""
    from kimik3.perfmodel.ranks import rank_extras

    prog = _design_program(preset, batch, d, c, context_len, experts)
    opts = _timeline_options(d)

    def makespan(delay: np.ndarray) -> float:
        return float(simulate_model(prog, times, peer_delay_ns=delay, **opts)["end_ns"].max())

    rng = out.get("predicted_ms_range", [out["predicted_ms"]] * 2)
    return rank_extras(prog, makespan, batch, c.kernel_boundary_ns, out["predicted_ms"], (rng[0], rng[1]), nbytes)


def roofline_ms(preset: str, batch: int, context_len: int = 4096, constants: Constants | None = None,
                experts: str = "bf16") -> float:
    """Bytes the step must move (``kimik3.perf.cost.decode_cost``, routed experts in ``experts``) over the achievable
    HBM read bandwidth."""
    from kimik3.perf.cost import decode_cost

    _check_experts(experts)
    c = constants or load_constants()
    return decode_cost(preset, batch, context_len, expert_dtype=experts).total_bytes / c.achievable_Bps * 1e3


def _check(preset: str, stage: str, batch: int, context_len: int, experts: str = "bf16") -> None:
    _check_experts(experts)
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r} for the performance model; expected one of {', '.join(STAGES)}")
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be an integer in 1..{MAX_BATCH} (the batches the model is built for), "
                         f"got {batch!r}")
    if not isinstance(context_len, int) or not 1 <= context_len <= 4096:
        raise ValueError(f"context must be between 1 and 4096 (the modelled cache capacity), got {context_len!r}")
    from kimik3.model.config import get_preset

    get_preset(preset)  # a clear ValueError for an unknown preset


def _check_fits(preset: str, experts: str, c: Constants) -> None:
    """The model scores one GPU's program: a preset whose weights that GPU cannot hold is refused (the full K3 is
    served across a rack; ``k3-shard`` is one rank's share), rather than simulated for minutes to a meaningless
    figure."""
    cap = _capacity(c)
    need = _need_bytes(preset, experts)
    if cap is not None and need > cap:
        raise ValueError(f"preset {preset!r} holds {need / 1e9:.0f} GB of weights ({experts} experts), more than "
                         f"the {cap / 1e9:.0f} GB of one {c.hardware}: the performance model scores one GPU's "
                         "program (k3-shard is one expert-parallel rank's share of Kimi K3)")


def _capacity(c: Constants) -> float | None:
    from kimik3.perf.hardware import get_hardware

    return get_hardware(c.hardware).hbm_capacity


def _need_bytes(preset: str, experts: str) -> float:
    """Weight bytes the preset's modules hold with the routed experts in ``experts``."""
    from kimik3.perf.cost import parameter_counts

    n = parameter_counts(preset)
    per_expert = 2.0 if experts == "bf16" else 17 / 32  # MXFP4: half a byte per weight, a scale byte per 32
    return (n["total"] - n["routed_experts"]) * 2 + n["routed_experts"] * per_expert


def _step(preset: str, stage: str, batch: int, d: dict[str, Any], c: Constants, context_len: int, experts: str
          ) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """(step ms, by opcode / kernel family, stage-specific extras) under one set of constants."""
    if stage == "megakernel":
        times, tl = megakernel_model(preset, batch, d, c, context_len, experts=experts)
        span = float(tl["end_ns"].max())
        predicted = (span + c.kernel_boundary_ns) / 1e6
        dur = tl["end_ns"] - tl["start_ns"]
        t = times.assign(model_us=dur / 1e3)
        by = {}
        for op, g in t.groupby("op", sort=False):
            by[op] = {"count": int(len(g)), "mean_us": round(float(g["model_us"].mean()), 3),
                      "total_us": round(float(g["model_us"].sum()), 3),
                      "limited_by": str(g["limited_by"].mode().iloc[0])}
        return predicted, by, {"makespan_ms": span / 1e6, "instructions": int(len(tl)), "_times": times}
    ft = fused_times(preset, batch, d, c, context_len, expert_format=experts)
    by = {}
    for fam, g in ft.groupby("family", sort=False):
        by[fam] = {"count": int(len(g)), "mean_us": round(float(g["ns"].mean() / 1e3), 3),
                   "total_us": round(float(g["ns"].sum() / 1e3), 3),
                   "limited_by": str(g["limited_by"].mode().iloc[0])}
    return float(ft["ns"].sum()) / 1e6, by, {"kernels": int(len(ft))}


def _design_program(preset: str, batch: int, d: dict[str, Any], c: Constants, context_len: int, experts: str) -> Any:
    """The program a design is scored on: :func:`model_program` at the constants' SM count and the design's tiling."""
    return model_program(preset, batch, int(c.sm_count), 4096, context_len, experts, design_tiling(d))


def _default_experts(preset: str, c: Constants) -> str:
    """bf16, or mxfp4 where bf16 experts would not fit the GPU (a rank slice of K3)."""
    return "bf16" if _need_bytes(preset, "bf16") <= (_capacity(c) or float("inf")) else "mxfp4"


def scored_program(preset: str, batch: int, design: str = CURRENT_DESIGN, context_len: int = 4096,
                   constants: Constants | None = None, experts: str | None = None) -> Any:
    """The megakernel program :func:`predict` scores for these arguments (the same cached build of
    :func:`model_program`: a caller that also wants the program, e.g. its collectives, does not build it again)."""
    c = constants or load_constants()
    experts = _default_experts(preset, c) if experts is None else experts
    return _design_program(preset, batch, load_design(design), c, context_len, experts)


def predict(preset: str = "k3-shard", stage: str = "megakernel", batch: int = 1, design: str = CURRENT_DESIGN,
            context_len: int = 4096, constants: Constants | None = None, experts: str | None = None,
            ranges: bool = True) -> dict[str, Any]:
    """``{"predicted_ms", "roofline_ms", "fraction_of_roofline", "by_opcode", ...}`` for one step with the routed
    experts stored as ``experts`` ("bf16" or "mxfp4"; the roofline moves the same format's bytes).

    ``by_opcode``: megakernel — per opcode the instruction count, mean and summed modelled time (start stamp to
    end stamp, the span the kernel's timing buffer records) and what limits most of them; fused — the same per
    kernel family. ``ranges``: also ``predicted_ms_range`` ([optimistic, pessimistic] ms: every ranged constant at
    its fast end, then at its slow end) and ``fraction_of_roofline_range`` ([pessimistic, optimistic], of the same
    roofline as the point), with the corner values in ``range_constants``. ``constants_measured`` /
    ``constants_recalled``: which constants a measured file set and which are still constants.json's.
    ``experts=None``: bf16, or mxfp4 where bf16 experts would not fit the GPU (a rank slice of K3). A rank slice
    also gets ``rank``: its step with the wire and the rack-level tokens/s (:mod:`kimik3.perfmodel.ranks`)."""
    c = constants or load_constants()
    experts = _default_experts(preset, c) if experts is None else experts
    _check(preset, stage, batch, context_len, experts)
    _check_fits(preset, experts, c)
    d = load_design(design)
    roof = roofline_ms(preset, batch, context_len, c, experts)
    predicted, by, extra = _step(preset, stage, batch, d, c, context_len, experts)
    times = extra.pop("_times", None)
    out = {"preset": preset, "stage": stage, "batch": batch, "context": context_len, "design": d["name"],
           "experts": experts, "predicted_ms": round(predicted, 6), "roofline_ms": round(roof, 6),
           "fraction_of_roofline": round(roof / predicted, 4), "by_opcode": by,
           "ceiling_Bps": c.achievable_Bps, "label": "model (not a measurement)", **extra}
    if ranges:
        corners = {w: c.corner(w) for w in ("optimistic", "pessimistic")}
        ms = {w: _step(preset, stage, batch, d, k, context_len, experts)[0] if c.ranges else predicted
              for w, k in corners.items()}
        out.update(predicted_ms_range=[round(ms["optimistic"], 6), round(ms["pessimistic"], 6)],
                   fraction_of_roofline_range=[round(roof / ms["pessimistic"], 4), round(roof / ms["optimistic"], 4)],
                   range_constants={k: {w: corners[w].values[k] for w in corners} for k in sorted(c.ranges)})
    from kimik3.model.config import get_preset

    if stage == "megakernel" and get_preset(preset).rank_slice:
        out.update(_rank(preset, batch, d, c, context_len, experts, out, times, roof / 1e3 * c.achievable_Bps))
    return {**out, **c.provenance()}


def compare_designs(preset: str = "k3-shard", batch: int = 1, designs: tuple[str, ...] | None = None,
                    context_len: int = 4096, constants: Constants | None = None, experts: str = "bf16"
                    ) -> pd.DataFrame:
    """Designs side by side, opcode by opcode, on the same program and constants: per opcode and design the SM time
    summed over instructions (start stamp to end stamp, as the kernel's timing buffer records it) and the modelled
    limit of most of them; ``attrs["summary"]`` holds each design's step time and fraction of the roofline."""
    names = tuple(designs) if designs is not None else tuple(design_names())
    if not names:
        raise ValueError("no design to compare")
    c = constants or load_constants()
    roof = roofline_ms(preset, batch, context_len, c, experts)
    cols, summary = {}, {}
    for name in names:
        times, tl = megakernel_model(preset, batch, name, c, context_len, experts=experts)
        t = times.assign(model_us=(tl["end_ns"] - tl["start_ns"]).to_numpy() / 1e3)
        g = t.groupby("op", sort=False)
        cols[(name, "total_us")] = g["model_us"].sum()
        cols[(name, "limited_by")] = g["limited_by"].agg(lambda s: s.mode().iloc[0])
        step = (float(tl["end_ns"].max()) + c.kernel_boundary_ns) / 1e6
        summary[name] = {"predicted_ms": step, "roofline_ms": roof, "fraction_of_roofline": roof / step}
    out = pd.DataFrame(cols)
    out.columns = pd.MultiIndex.from_tuples(out.columns, names=["design", "value"])
    out = out.sort_values((names[0], "total_us"), ascending=False)
    out.index.name = "op"
    out.attrs["summary"] = summary
    return out


def model_columns(preset: str, stage: str, batch: int, context_len: int) -> dict[str, Any]:
    """Bench columns for a modelled stage: ``model_ms`` (the current design on an H200, a model, not a measurement),
    its range ``model_ms_min`` / ``model_ms_max`` (optimistic / pessimistic constants) and ``model_roofline_ms``;
    empty for stages the model does not cover, ``model_note`` when the preset is not modelled (say why, do not
    guess)."""
    if stage not in STAGES:
        return {}
    try:
        r = predict(preset, stage, batch, CURRENT_DESIGN, max(1, min(int(context_len), 4096)))
    except (ValueError, AssertionError) as e:
        return {"model_note": f"not modelled: {e}"}
    lo, hi = r["predicted_ms_range"]
    return {"model_ms": r["predicted_ms"], "model_ms_min": lo, "model_ms_max": hi,
            "model_roofline_ms": r["roofline_ms"]}


def compare_opcodes(times: pd.DataFrame | None, model_timeline: pd.DataFrame, measured: pd.DataFrame
                    ) -> pd.DataFrame:
    """Model vs measured per opcode. ``model_timeline`` from :func:`megakernel_model`, ``measured`` from
    :func:`kimik3.megakernel.timeline.from_timings` of the same program (one row per instruction, same ids).
    Columns: count, model/measured mean and total µs (start stamp to end stamp), measured ÷ model, and the
    modelled limit."""
    if len(model_timeline) != len(measured):
        raise ValueError(f"model has {len(model_timeline)} instructions, the measurement {len(measured)}: "
                         "not the same program")
    if list(model_timeline["op"]) != list(measured["op"]):
        raise ValueError("model and measurement disagree on the opcodes: not the same program")
    m = (model_timeline["end_ns"] - model_timeline["start_ns"]) / 1e3
    x = (measured["end_ns"] - measured["start_ns"]) / 1e3
    df = pd.DataFrame({"op": model_timeline["op"], "model_us": m.to_numpy(), "measured_us": x.to_numpy()})
    if times is not None:
        df["limited_by"] = times["limited_by"].to_numpy()
    g = df.groupby("op", sort=False)
    out = pd.DataFrame({"count": g.size(), "model_mean_us": g["model_us"].mean(),
                        "measured_mean_us": g["measured_us"].mean(), "model_total_us": g["model_us"].sum(),
                        "measured_total_us": g["measured_us"].sum()})
    out["measured_over_model"] = out["measured_total_us"] / out["model_total_us"].where(out["model_total_us"] > 0)
    if "limited_by" in df:
        out["model_limited_by"] = g["limited_by"].agg(lambda s: s.mode().iloc[0])
    out.attrs["model_makespan_us"] = float(model_timeline["end_ns"].max()) / 1e3
    out.attrs["measured_makespan_us"] = float(measured["end_ns"].max() - measured["start_ns"].min()) / 1e3
    return out.sort_values("model_total_us", ascending=False)


def opcode_report(program: Any, timings: Any, preset: str, context_len: int = 4096, design: str = CURRENT_DESIGN
                  ) -> dict[str, Any]:
    """JSON-ready model vs measured per opcode for one measured megakernel step: ``program`` is the one the GPU
    ran (``stage.program``), ``timings`` its ``[N, 3]`` timing buffer (``stage.timings()``)."""
    from kimik3.megakernel.timeline import from_timings

    experts = "mxfp4" if getattr(program, "expert_format", "dense") == "mxfp4" else "bf16"
    times, tl = megakernel_model(preset, program.batch, design, None, context_len, program=program, experts=experts)
    cmp = compare_opcodes(times, tl, from_timings(program, timings))
    return {"design": design, "label": "model vs measured", "context": context_len,
            "model_makespan_us": cmp.attrs["model_makespan_us"],
            "measured_makespan_us": cmp.attrs["measured_makespan_us"],
            "by_opcode": json.loads(cmp.to_json(orient="index"))}


def compare_kernels(model: pd.DataFrame, measured: Mapping[str, float]) -> pd.DataFrame:
    """Model vs measured per fused kernel family. ``model`` from :func:`kimik3.perfmodel.fused_times`;
    ``measured`` maps a family name (as in the model's ``family`` column) to measured µs per step, summed."""
    bad = {k: v for k, v in measured.items() if not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0}
    if bad:
        raise ValueError(f"measured kernel times must be finite, non-negative µs: {bad}")
    g = model.groupby("family", sort=False)["ns"].sum() / 1e3
    fams = list(dict.fromkeys(list(g.index) + list(measured)))
    out = pd.DataFrame({"model_us": [float(g.get(f, np.nan)) for f in fams],
                        "measured_us": [float(measured[f]) if f in measured else np.nan for f in fams]},
                       index=pd.Index(fams, name="family"))
    out["measured_over_model"] = out["measured_us"] / out["model_us"]
    return out


def design_expert_formats(design: str | dict[str, Any]) -> tuple[str, ...]:
    """The expert formats a design describes (``expert_formats``; bf16 only when absent)."""
    d = load_design(design) if isinstance(design, str) else design
    fmts = tuple(field(d.get("expert_formats", {"value": ["bf16"]})))
    for f in fmts:
        _check_experts(f)
    return fmts


def scores(design: str = CURRENT_DESIGN, preset: str = "k3-shard", batches: tuple[int, ...] = (1, 8, 64),
           context_len: int = 4096) -> dict[str, Any]:
    """The committed score table of a design (``data/perf/scores-<design>.json``): every stage and batch, for each
    expert format the design describes; point values of ``data/perf/constants.json`` only (ranges are computed
    on the fly by :func:`predict`)."""
    c = load_constants()
    out: dict[str, Any] = {"design": design, "preset": preset, "context": context_len,
                           "constants": str((PERF_DIR / "constants.json").relative_to(PERF_DIR.parents[1])),
                           "label": "model (not a measurement)", "results": []}
    for experts in design_expert_formats(design):
        for stage in STAGES:
            for b in batches:
                r = predict(preset, stage, b, design, context_len, c, experts, ranges=False)
                for k in c.provenance():  # the table names its one constants file above
                    r.pop(k)
                out["results"].append(r)
    return out


def write_scores(design: str = CURRENT_DESIGN, path: str | Path | None = None) -> Path:
    """Write :func:`scores` atomically (temp file + rename)."""
    import json
    import os

    p = Path(path) if path is not None else PERF_DIR / f"scores-{design}.json"
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(scores(design), indent=1) + "\n")
    os.replace(tmp, p)
    return p
