"""Where the time goes in a megakernel step: per-SM timelines, a Gantt chart, per-instruction-type summaries.

Two sources, one table format: :func:`simulate` (the scheduler's cost model: an instruction starts once its SM is
free and its waits are met, runs ``busy_ns`` plus the weight streaming not hidden behind the wait, then signals)
and :func:`from_timings` (the GPU kernel's timing buffer: ``[N, 2]`` int64 ``%globaltimer`` start and end, row =
instruction id, an optional third column the observed ``%smid``). The calibrated model of the device code,
:func:`kimik3.perfmodel.megakernel_model`, returns the same format. One row per instruction with ``sm, qpos, op,
layer, label, arrive_ns, start_ns, end_ns``: ``start - arrive`` is time waiting on counters, ``end - start`` busy
time; :func:`summary` sums busy / waiting per opcode plus the SMs' idle time, :func:`gantt` draws it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from kimik3.megakernel.instructions import Program

__all__ = ["simulate", "from_timings", "summary", "gantt", "gantt_height", "makespan_ns", "SimulatedDeadlock"]

_COLUMNS = ["sm", "qpos", "op", "layer", "label", "arrive_ns", "start_ns", "end_ns"]


class SimulatedDeadlock(RuntimeError):
    """The cost-model simulation got stuck: some SM's head instruction can never have its waits satisfied."""


def simulate(program: Program, busy_ns: Sequence[float] | None = None, prefetch_ns: Sequence[float] | None = None,
             prefetch: bool = True, peer_delay_ns: Sequence[float] | None = None) -> pd.DataFrame:
    """Event-driven timeline of one step under the cost model (``program.costs`` unless durations are given).

    With ``prefetch`` the weight-streaming part of an instruction overlaps its wait: an instruction that waited
    ``w`` ns runs ``busy + max(0, prefetch - w)`` ns (only static weights may be prefetched, so nothing else can
    be hidden this way). Without it, every instruction runs ``busy + prefetch`` ns after its waits.
    ``peer_delay_ns`` (one per counter) models a rank of a deployment whose peers run the same schedule: a signal
    of a cross-rank counter lands that much later (the peers' words arrive over the link with their pushes)."""
    n = len(program.instructions)
    if busy_ns is None or prefetch_ns is None:
        if program.costs is None:
            raise ValueError("simulate: the program carries no costs; pass busy_ns and prefetch_ns")
        busy_ns = program.costs["busy_ns"].to_numpy() if busy_ns is None else busy_ns
        prefetch_ns = program.costs["prefetch_ns"].to_numpy() if prefetch_ns is None else prefetch_ns
    busy = np.asarray(busy_ns, dtype=float)
    pre = np.asarray(prefetch_ns, dtype=float)
    if busy.shape != (n,) or pre.shape != (n,):
        raise ValueError(f"durations must have one entry per instruction ({n})")
    ins = program.instructions
    counters = [0] * len(program.counters)
    qs = program.queues
    head = [0] * len(qs)
    arrive = np.zeros(n)
    start = np.zeros(n)
    end = np.zeros(n)
    free_at = [0.0] * len(qs)
    events: list[tuple[float, int, int]] = []  # (time, instruction, sm); sm -1: a delayed signal of counter v
    waiting: dict[int, set[int]] = {}  # counter -> the SMs whose head instruction waits on it (its first unmet wait)
    delay = np.zeros(len(program.counters)) if peer_delay_ns is None else np.asarray(peer_delay_ns, dtype=float)
    if delay.shape != (len(program.counters),) or (delay < 0).any():
        raise ValueError(f"peer_delay_ns must hold one non-negative delay per counter ({len(program.counters)})")

    def try_start(sm: int, now: float) -> None:
        if head[sm] >= len(qs[sm]):
            return
        v = qs[sm][head[sm]]
        for c, t in ins[v].waits:
            if counters[c] < t:  # retried when this counter next moves (nothing else can release it)
                waiting.setdefault(c, set()).add(sm)
                return
        start[v] = now
        hidden = min(pre[v], now - arrive[v]) if prefetch else 0.0
        end[v] = now + busy[v] + pre[v] - hidden
        heapq.heappush(events, (end[v], v, sm))

    def moved(c: int, now: float) -> None:
        for other in sorted(waiting.pop(c, ())):
            try_start(other, now)

    for sm in range(len(qs)):
        try_start(sm, 0.0)
    done = 0
    while events:
        now, v, sm = heapq.heappop(events)
        if sm < 0:  # a cross-rank signal lands
            counters[v] += 1
            moved(v, now)
            continue
        done += 1
        c = ins[v].signal
        if c >= 0 and delay[c] > 0:
            for _ in range(ins[v].amount):
                heapq.heappush(events, (now + delay[c], c, -1))
        elif c >= 0:
            counters[c] += ins[v].amount
        head[sm] += 1
        free_at[sm] = now
        if head[sm] < len(qs[sm]):
            arrive[qs[sm][head[sm]]] = now
        try_start(sm, now)
        if c >= 0 and delay[c] == 0:
            moved(c, now)
    if done != n:
        stuck = [f"SM {s} at instruction {qs[s][head[s]]} ({ins[qs[s][head[s]]].label()})"
                 for s in range(len(qs)) if head[s] < len(qs[s])]
        raise SimulatedDeadlock("simulation deadlocked: " + "; ".join(stuck))
    return _frame(program, arrive, start, end)


def _frame(program: Program, arrive: np.ndarray, start: np.ndarray, end: np.ndarray,
           sm: Sequence[int] | None = None) -> pd.DataFrame:
    ins = program.instructions
    df = pd.DataFrame({
        "sm": [i.sm for i in ins] if sm is None else list(sm),
        "qpos": [i.qpos for i in ins],
        "op": [i.op.name for i in ins],
        "layer": [i.layer for i in ins],
        "label": [i.label() for i in ins],
        "arrive_ns": arrive, "start_ns": start, "end_ns": end,
    })
    df.index.name = "id"
    return df[_COLUMNS]


def from_timings(program: Program, timings: torch.Tensor | np.ndarray) -> pd.DataFrame:
    """A timing buffer ``[N, 2]`` (start, end ns; optional third column: SM id) → timeline table. Times are
    shifted so the earliest start is 0; ``arrive`` is the end of the previous instruction on the same SM."""
    t = np.asarray(timings.cpu() if isinstance(timings, torch.Tensor) else timings, dtype=np.int64)
    n = len(program.instructions)
    if t.ndim != 2 or t.shape[0] != n or t.shape[1] not in (2, 3):
        raise ValueError(f"timings must be [{n}, 2] or [{n}, 3] (start ns, end ns[, sm]), got {list(t.shape)}")
    t0 = t[:, 0].min() if n else 0
    start, end = (t[:, 0] - t0).astype(float), (t[:, 1] - t0).astype(float)
    sm = t[:, 2].tolist() if t.shape[1] == 3 else [i.sm for i in program.instructions]
    arrive = np.zeros(n)
    by_sm: dict[int, list[int]] = {}
    for v in np.argsort(start, kind="stable"):
        by_sm.setdefault(sm[v], []).append(int(v))
    for vs in by_sm.values():
        for a, b in zip(vs, vs[1:]):
            arrive[b] = end[a]
        if vs:
            arrive[vs[0]] = 0.0
    return _frame(program, arrive, start, end, sm)


def makespan_ns(timeline: pd.DataFrame) -> float:
    return float(timeline["end_ns"].max() - min(0.0, timeline["start_ns"].min())) if len(timeline) else 0.0


def summary(timeline: pd.DataFrame, num_sms: int | None = None) -> pd.DataFrame:
    """Per opcode: count, busy and waiting time (µs, summed over SMs) and their share of all SM-time; plus an
    ``(idle)`` row: SM time after an SM's queue ran dry (or for SMs with no work) until the step's end."""
    span = makespan_ns(timeline)
    sms = num_sms if num_sms is not None else int(timeline["sm"].max()) + 1
    t = timeline.assign(busy_ns=timeline["end_ns"] - timeline["start_ns"],
                        wait_ns=timeline["start_ns"] - timeline["arrive_ns"])
    g = t.groupby("op", sort=False).agg(count=("label", "size"), busy_ns=("busy_ns", "sum"),
                                        wait_ns=("wait_ns", "sum"))
    last_end = t.groupby("sm")["end_ns"].max()
    idle = float(sum(span - last_end.get(s, 0.0) for s in range(sms)))
    g.loc["(idle)"] = [0, 0.0, idle]
    total = span * sms if span > 0 else 1.0
    out = pd.DataFrame({"count": g["count"].astype(int), "busy_us": g["busy_ns"] / 1e3,
                        "waiting_us": g["wait_ns"] / 1e3})
    out.loc["(idle)", "waiting_us"] = 0.0
    out["idle_us"] = 0.0
    out.loc["(idle)", "idle_us"] = idle / 1e3
    out["share_of_sm_time"] = (g["busy_ns"] + g["wait_ns"]) / total
    out.attrs["makespan_us"] = span / 1e3
    return out.sort_values("busy_us", ascending=False)


def gantt(timeline: pd.DataFrame, title: str = "megakernel step", show_waits: bool = True, unit: str = "SM"):
    """Plotly Gantt chart: one row per SM (``unit``: what a row is, "CPU worker" for the native executor), one bar
    per instruction coloured by opcode (hover: label, times); waits drawn as thin grey bars before the instruction
    they delay. The height follows the row count within [340, 760] px, so two workers are not a page tall and 132
    SMs still fit a screen."""
    import plotly.graph_objects as go

    fig = go.Figure()
    if show_waits:
        w = timeline[timeline["start_ns"] > timeline["arrive_ns"]]
        if len(w):
            fig.add_trace(go.Bar(
                y=w["sm"], x=(w["start_ns"] - w["arrive_ns"]) / 1e3, base=w["arrive_ns"] / 1e3, orientation="h",
                marker=dict(color="rgba(160,160,160,0.35)"), width=0.3, name="waiting",
                hovertext=[f"waiting: {lbl}" for lbl in w["label"]], hoverinfo="text"))
    palette = ["#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880", "#FF97FF",
               "#FECB52", "#1F77B4", "#8C564B", "#2CA02C", "#D62728", "#9467BD", "#7F7F7F"]
    for k, (op, d) in enumerate(timeline.groupby("op", sort=False)):
        fig.add_trace(go.Bar(
            y=d["sm"], x=(d["end_ns"] - d["start_ns"]) / 1e3, base=d["start_ns"] / 1e3, orientation="h",
            marker=dict(color=palette[k % len(palette)], line=dict(width=0)), name=op,
            hovertext=[f"#{i} {lbl}<br>{s / 1e3:.2f}–{e / 1e3:.2f} µs" for i, lbl, s, e in
                       zip(d.index, d["label"], d["start_ns"], d["end_ns"])], hoverinfo="text"))
    rows = int(timeline["sm"].max()) + 1 if len(timeline) else 1
    fig.update_layout(barmode="overlay", title=title, xaxis_title="time (µs)", yaxis_title=unit,
                      yaxis=dict(autorange="reversed", dtick=1 if rows <= 16 else None),
                      bargap=0.1, height=gantt_height(rows), legend=dict(traceorder="normal"))
    return fig


def gantt_height(rows: int) -> int:
    """Pixel height of a :func:`gantt` of ``rows`` rows: 120 px of title and axis plus 18 per row, within
    [340, 760] (below 340 px the opcode legend beside it scrolls)."""
    return int(min(760, max(340, 120 + 18 * rows)))
