"""The megakernel under the calibrated model: per-instruction durations from a design, then an event simulation.

One instruction on one SM costs, in the order ``kernels/megakernel/vm.py`` runs it: **fetch** (dependent global
round trips for the instruction row and operand table), **stage** (the largest row-contiguous bf16 PREFETCH weight,
up to ``stage_bytes``, overlapping the wait), **wait** (until every awaited counter is reached, from the
simulation), **body** (per opcode from the design: Little's-law byte streams, re-reads from L1 or L2, FMA issue
time and serial loops) and **signal** (the release's L2 round trips). Bytes and FLOPs per instruction come from
:func:`kimik3.megakernel.scheduler.instruction_costs` (§8): this module adds time, never bytes. The timeline it
returns has :mod:`kimik3.megakernel.timeline`'s columns (``start`` = the waits are met, as the kernel's start stamp),
so ``timeline.gantt`` and ``timeline.summary`` draw and sum it. The phases in full:
docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np
import pandas as pd
import torch

from kimik3.kernels.contracts.addr import (
    expert_group_passes,
    expert_groups,
    expert_mma,
    gemv_batch_tile,
    gemv_group_passes,
    gemv_groups,
    gemv_mma,
    gemv_mma_passes,
)
from kimik3.kernels.contracts.isa import STAGE_SCRATCH_OPS
from kimik3.megakernel.instructions import Kind, Mode, Op, Program
from kimik3.perfmodel.data import Constants, field
from kimik3.perfmodel.expr import amount, evaluate

__all__ = ["SYMBOLS", "instruction_symbols", "stream_ns", "instruction_times", "simulate_model"]

SYMBOLS = ("B", "bt", "nbt", "gbt", "gnbt", "mma", "mp", "pg", "ng", "pg2", "ng2", "xm", "xpu", "xpd", "xgu", "xgd",
           "NT", "NW", "nops", "nwaits", "rows",
           "row_bytes", "heads", "nb",
           "positions", "splits", "slots", "pairs", "distinct", "k", "E", "Dmax", "H", "dk", "nope", "kvl", "rope",
           "ql", "qk", "dv", "Ie", "Dl", "Is", "tiles", "weight_bytes", "state_bytes", "act_bytes", "flops", "shfl",
           "world")


_EXPERT_OPS = (Op.EXPERT_GATE_UP, Op.EXPERT_DOWN)


def _bt(B: int) -> int:
    """Batch rows per pass of the megakernel's MLA opcodes (``MKConfig.bt``: the largest divisor of B up to 4; v1's
    GEMV opcodes too). ``gbt`` is the GEMV opcodes' pass of the current device code
    (``kernels.contracts.addr.gemv_batch_tile``)."""
    return max(d for d in range(1, min(B, 4) + 1) if B % d == 0)


def stream_ns(nbytes: float, inflight: float, latency_ns: float, cap_Bps: float, rate_Bps: float | None = None
              ) -> float:
    """Time to move ``nbytes`` with ``inflight`` bytes outstanding (Little's law) at ``latency_ns``, capped at
    ``cap_Bps``: the first window costs one latency plus its transfer at the cap, every later byte flows at
    ``min(inflight / latency, cap)`` (``rate_Bps`` in place of ``inflight / latency``: a measured relation,
    :meth:`Constants.rate_Bps`). Continuous in ``nbytes``; 0 for nothing."""
    if nbytes <= 0:
        return 0.0
    if inflight <= 0:
        raise ValueError("a stream with bytes to move needs bytes in flight")
    rate = min(inflight / (latency_ns * 1e-9) if rate_Bps is None else rate_Bps, cap_Bps)
    first = min(nbytes, inflight)
    return latency_ns + first / cap_Bps * 1e9 + max(0.0, nbytes - inflight) / rate * 1e9


def _staged_bytes(program: Program, ins: Any, stage_bytes: int) -> tuple[float, float]:
    """(staged bytes, bytes per staged row) exactly as the kernel chooses: the largest row-contiguous bf16 static
    weight marked PREFETCH (one D0 slice, every column, width a multiple of 8), whole rows up to the stage."""
    if ins.op == Op.EMBED or ins.op in STAGE_SCRATCH_OPS or stage_bytes <= 0:
        return 0.0, 0.0
    best_el, best_d2 = 0, 0
    for o in ins.operands:
        buf = program.buffers[o.buf]
        if buf.kind != Kind.WEIGHT or not (o.mode & Mode.PREFETCH) or buf.dtype != torch.bfloat16:
            continue
        b0, b1, r0, r1, c0, c1 = o.box
        d2 = buf.shape[2]
        if b1 - b0 != 1 or c0 != 0 or c1 != d2 or d2 % 8:
            continue
        el = (r1 - r0) * d2
        if el > best_el:
            best_el, best_d2 = el, d2
    if not best_el:
        return 0.0, 0.0
    rows = min(best_el // best_d2, stage_bytes // (2 * best_d2))
    return float(rows * best_d2 * 2), float(best_d2 * 2)


def _program_facts(program: Program) -> dict[str, Any]:
    """Per-program values every instruction's symbols share (computed once per program)."""
    facts = getattr(program, "_perf_facts", None)
    if facts is None:
        cfg = program_cfg(program)
        splits = 0.0
        if cfg.mla_layers:
            part = next((b for b in program.buffers if b.name == "mla_part"), None)
            splits = float(part.shape[2] // (cfg.kv_lora_rank + 2)) if part is not None else 0.0
        facts = {"tiles": float(sum(1 for x in program.instructions if x.op == Op.LM_HEAD)), "splits": splits,
                 "batch_tiling": {**_gemv_groups(program.batch), **_expert_groups(program.batch, cfg)}}
        program._perf_facts = facts
    return facts


def _gemv_groups(B: int) -> dict[str, float]:
    """The tensor-core GEMV path's batch tiling (``kernels.contracts.addr``): ``mma`` 1 from batch 8, ``mp`` its passes
    of 8 rows, ``pg`` / ``ng`` passes per group and groups for an item of one weight, ``pg2`` / ``ng2`` of two."""
    return {"mma": float(gemv_mma(B)), "mp": float(gemv_mma_passes(B)), "pg": float(gemv_group_passes(B, 1)),
            "ng": float(gemv_groups(B, 1)), "pg2": float(gemv_group_passes(B, 2)), "ng2": float(gemv_groups(B, 2))}


def _expert_groups(B: int, cfg: Any) -> dict[str, float]:
    """The dense routed experts' tensor-core tiling (``kernels.contracts.addr``): ``xm`` 1 from batch 8, ``xpu`` /
    ``xpd`` passes of 8 list positions per group of EXPERT_GATE_UP / EXPERT_DOWN, ``xgu`` / ``xgd`` the expected groups
    of a used slot: E[cdiv(n, 8·passes) | n > 0] for its token count n ~ Binomial(B, k / E) (each token picks k of the E
    experts)."""
    E, k = cfg.n_routed_experts or 0, cfg.num_experts_per_tok or 0
    xpu, xpd = (expert_group_passes(B, op) for op in ("gate_up", "down"))
    out = {"xm": float(expert_mma(B)), "xpu": float(xpu), "xpd": float(xpd), "xgu": 0.0, "xgd": 0.0}
    if E and k:
        q = k / E
        pn = [math.comb(B, n) * q ** n * (1 - q) ** (B - n) for n in range(B + 1)]
        used = 1.0 - pn[0]
        for key, P in (("xgu", xpu), ("xgd", xpd)):
            out[key] = sum(pn[n] * expert_groups(n, P) for n in range(1, B + 1)) / used if used > 0 else 0.0
    return out


def instruction_symbols(program: Program, costs: pd.DataFrame, i: int, context_len: int,
                        consts: Constants, threads: int) -> dict[str, float]:
    """The names a design expression may use for instruction ``i`` (see :data:`SYMBOLS`)."""
    ins = program.instructions[i]
    facts = _program_facts(program)
    cfg = program_cfg(program)
    B = program.batch
    bt = _bt(B)
    gbt = gemv_batch_tile(B)
    a = ins.args
    weights = [(o, program.buffers[o.buf]) for o in ins.operands if program.buffers[o.buf].kind == Kind.WEIGHT]
    big = max(weights, key=lambda w: (w[0].box[3] - w[0].box[2]) * w[1].shape[2] * (w[0].box[1] - w[0].box[0]),
              default=None)
    rows = row_bytes = 0.0
    heads = nb = positions = splits = slots = 0.0
    op = ins.op
    if op in (Op.NORM_PROJ, Op.MLP_GATE_UP, Op.LM_HEAD, Op.EXPERT_GATE_UP, Op.EXPERT_DOWN):
        rows = float(a[3] - a[2])
    elif op in (Op.O_PROJ_RESIDUAL, Op.FFN_OUT):
        rows = float(a[3] - a[2])
    if big is not None:
        row_bytes = float(big[1].shape[2] * big[1].dtype.itemsize)
    if op == Op.FFN_OUT:  # every source's row is dotted per output column
        row_bytes = float(sum(w.shape[2] * w.dtype.itemsize for o, w in weights if w.shape[2] > 1 and
                              o.box[3] - o.box[2] == rows))
    if op in (Op.KDA_STEP,):
        heads, nb = float(a[1] - a[0]), float(a[3] - a[2])
    elif op in (Op.MLA_Q, Op.MLA_REDUCE):
        heads = float(a[1] - a[0])
    elif op == Op.MLA_PARTIAL:
        heads = float(a[1] - a[0])
        q = ins.operands[0].box
        nb = float(q[1] - q[0])
        t0, t1 = ins.operands[2].box[2], ins.operands[2].box[3]
        positions = float(max(0, min(context_len, t1) - t0))
    elif op in (Op.EMBED, Op.ATTN_RES_MIX, Op.ALLREDUCE_MIX):
        nb = float(a[3] - a[2])
    elif op == Op.MOE_COMBINE:
        q = ins.operands[-1].box
        nb = float(q[1] - q[0])
    elif op == Op.EXPERT_GATE_UP:
        slots = float(a[1] - a[0])
    splits = facts["splits"]
    E, k = cfg.n_routed_experts or 0, cfg.num_experts_per_tok or 0
    Dmax = float(min(E, B * k)) if E else 0.0
    world = float(getattr(program, "world", 1) or 1)
    # the distinct experts this program's instructions cover: a rank holds E / world of them
    distinct = E * (1.0 - (1.0 - k / E) ** B) / world if E else 0.0
    c = costs[i] if isinstance(costs, list) else costs.iloc[i]
    return {
        "B": float(B), "bt": float(bt), "nbt": float(B // bt), "gbt": float(gbt), "gnbt": float(B // gbt),
        **facts["batch_tiling"],
        "NT": float(threads), "NW": float(threads // 32),
        "nops": float(len(ins.operands)), "nwaits": float(len(ins.waits)), "rows": rows, "row_bytes": row_bytes,
        "heads": heads, "nb": nb, "positions": positions, "splits": splits, "slots": slots,
        "pairs": (B * k / Dmax) if Dmax else 0.0, "distinct": distinct, "k": float(k), "E": float(E),
        "Dmax": Dmax, "H": float(cfg.hidden_size), "dk": float(cfg.kda_head_dim or 0),
        "nope": float(cfg.qk_nope_head_dim or 0), "kvl": float(cfg.kv_lora_rank or 0),
        "rope": float(cfg.qk_rope_head_dim or 0), "ql": float(cfg.q_lora_rank or 0),
        "qk": float(cfg.qk_head_dim or 0), "dv": float(cfg.v_head_dim or 0),
        "Ie": float(cfg.moe_intermediate_size or 0), "Dl": float(cfg.moe_latent_size or 0),
        "Is": float((cfg.moe_intermediate_size or 0) * (cfg.n_shared_experts or 0)),
        "tiles": facts["tiles"],
        "weight_bytes": float(c["weight_bytes"]), "state_bytes": float(c["state_bytes"]),
        "act_bytes": float(c["act_bytes"]), "flops": float(c["flops"]), "shfl": consts.shuffle_latency_cycles,
        "world": world,
    }


def program_cfg(program: Program) -> Any:
    cfg = getattr(program, "cfg", None)
    if cfg is None:
        raise ValueError("the program carries no model config; build it with kimik3.perfmodel.model_program")
    return cfg


def _in_flight(stream: dict[str, Any], env: dict[str, Any], nbytes: float) -> float:
    """The bytes one CTA keeps in flight for a stream: threads x loads x load_bytes, which must be positive when the
    stream has bytes to move."""
    parts = {f: evaluate(stream[f], env) for f in ("threads", "loads", "load_bytes")}
    total = parts["threads"] * parts["loads"] * parts["load_bytes"]
    if nbytes > 0 and total <= 0:
        raise ValueError(f"a stream of {nbytes:.0f} bytes keeps {total:g} bytes in flight (threads "
                         f"{parts['threads']:g} x loads {parts['loads']:g} x load_bytes {parts['load_bytes']:g})")
    return total


def instruction_times(program: Program, design: dict[str, Any], consts: Constants, context_len: int
                      ) -> pd.DataFrame:
    """Per instruction: fetch, stage, wait round trips, body (its parts) and signal, in ns, plus the bytes."""
    mk = design["megakernel"]
    costs = program.costs
    if costs is None:
        raise ValueError("the program carries no costs (build it with kimik3.megakernel.build_program)")
    threads = int(field(mk["threads"]))
    ctas = int(field(mk.get("ctas_per_sm", {"value": 1})))  # each resident CTA streams its own instruction
    stage_bytes = int(field(mk["stage_bytes"]))
    host_stage = field(mk.get("stage_choice", {"value": "device"})) == "host"
    shared = field(mk.get("shared_bytes", {"value": {}}))
    smem = float(shared.get(str(program.batch), max(shared.values(), default=0))) if isinstance(shared, dict) \
        else float(shared)
    l1_free = max(0.0, consts.l1_capacity_bytes - smem) * consts.l1_free_fraction
    share = consts.sm_share_Bps
    lat = consts.hbm_latency_ns
    rows = []
    cost_rows = costs[["weight_bytes", "state_bytes", "act_bytes", "flops"]].to_dict("records")
    fp4 = getattr(program, "expert_format", "dense") == "mxfp4"  # expert opcodes read the design's ".mxfp4" entries
    for i, ins in enumerate(program.instructions):
        env = instruction_symbols(program, cost_rows, i, context_len, consts, threads)
        key = ins.op.name + (".mxfp4" if fp4 and ins.op in _EXPERT_OPS else "")
        spec = mk["opcodes"].get(key)
        if spec is None:
            what = "MXFP4 experts" if key.endswith(".mxfp4") else "this opcode"
            raise ValueError(f"design {design['name']}: no entry for opcode {key} (the design does not describe "
                             f"{what})")
        try:  # a design entry that cannot be evaluated here is named with its opcode
            if host_stage:  # the host decided (instruction words W_STAGE_*): read it, do not re-derive it
                staged = float(ins.stage[2] * 16) if ins.stage[0] >= 0 else 0.0
            else:
                staged, _ = _staged_bytes(program, ins, stage_bytes)
            staged = min(staged, env["weight_bytes"]) if env["weight_bytes"] > 0 else 0.0
            fetch = evaluate(field(mk["fetch_round_trips_hbm"]), env) * lat + \
                evaluate(field(mk["fetch_round_trips_l2"]), env) * consts.l2_latency_ns
            stage = stream_ns(staged, staged, lat, share)
            waits = evaluate(field(mk["wait_round_trips_l2"]), env) * consts.sync_round_trip_ns
            signal = evaluate(field(mk["signal_round_trips_l2"]), env) * consts.sync_round_trip_ns
            barriers = (evaluate(field(mk["barriers"]), env)
                        + evaluate(spec.get("barriers", 0), env)) * consts.barrier_ns
            hbm_ns = 0.0
            left_staged = staged
            for s in spec.get("streams", []):
                nbytes = amount(s["bytes"], env)
                if s["bytes"] == "weight_bytes" or "weight_bytes" in str(s["bytes"]):
                    take = min(left_staged, nbytes)  # the staged rows are read from shared memory
                    nbytes -= take
                    left_staged -= take
                inflight = consts.inflight(_in_flight(s, env, nbytes))
                hbm_ns += stream_ns(nbytes, inflight, lat, share / ctas, consts.rate_Bps(inflight, lat, ctas))
            l1_bytes = l2_bytes = 0.0
            for r in spec.get("rereads", []):
                nbytes = amount(r["bytes"], env)
                if evaluate(r["footprint"], env) <= l1_free:
                    l1_bytes += nbytes
                else:
                    l2_bytes += nbytes
            act_ns = env["act_bytes"] / consts.l2_share_Bps * 1e9
            reread_ns = l1_bytes / consts.l1_Bps * 1e9 + l2_bytes / consts.l2_share_Bps * 1e9
            fmas = evaluate(spec.get("fmas", 0), env)
            fma_ns = fmas * evaluate(spec.get("issue_per_fma", 1.0), env) / (consts.issue_slots_per_sm_cycle
                                                                     * consts.sm_clock_Hz) * 1e9
            serial_ns = 0.0
            for s in spec.get("serial", []):
                trips = amount(s["trips"], env)
                serial_ns += trips * (consts.latency_ns(s["level"]) + evaluate(s["cycles"], env) * consts.cycle_ns)
        except ValueError as e:
            raise ValueError(f"design {design['name']}: opcode {key} ({ins.label()}): {e}") from None
        mem_ns = max(hbm_ns, act_ns, reread_ns)
        body = max(mem_ns, fma_ns) + serial_ns + barriers
        rows.append({"op": ins.op.name, "layer": ins.layer, "label": ins.label(), "fetch_ns": fetch,
                     "stage_ns": stage, "staged_bytes": staged, "wait_rt_ns": waits, "hbm_ns": hbm_ns,
                     "reread_ns": reread_ns, "act_ns": act_ns, "fma_ns": fma_ns, "serial_ns": serial_ns,
                     "barrier_ns": barriers, "body_ns": body, "signal_ns": signal,
                     "weight_bytes": env["weight_bytes"], "state_bytes": env["state_bytes"],
                     "limited_by": _limit(hbm_ns, act_ns, reread_ns, fma_ns, serial_ns)})
    df = pd.DataFrame(rows)
    df.index.name = "id"
    return df


def _limit(hbm: float, act: float, reread: float, fma: float, serial: float) -> str:
    parts = {"hbm stream": hbm, "activations (L2)": act, "re-reads (L1/L2)": reread, "FMA issue": fma}
    best = max(parts, key=parts.get)
    return "serial loops" if serial > parts[best] else best


def simulate_model(program: Program, times: pd.DataFrame, prefetch_ahead: bool = False,
                   stage_wait_all: bool = True, peer_delay_ns: np.ndarray | None = None) -> pd.DataFrame:
    """Event simulation of one step: every SM walks its queue; instruction ``v`` arriving at ``a`` (its
    predecessor's end) fetches and stages from ``p0`` (``a``, or with ``prefetch_ahead`` the predecessor's start),
    starts at ``max(p0 + fetch, waits met) + wait round trips`` (+ the rest of the stage when ``stage_wait_all``),
    and ends ``body + signal`` later, when its counter is signalled. ``peer_delay_ns`` (one per counter): a rank
    program's peers run the same schedule, their signals of a cross-rank counter landing that much later (the
    wire), as in :func:`kimik3.megakernel.timeline.simulate`."""
    ins = program.instructions
    n = len(ins)
    delay = np.zeros(len(program.counters)) if peer_delay_ns is None else np.asarray(peer_delay_ns, dtype=float)
    if delay.shape != (len(program.counters),) or (delay < 0).any():
        raise ValueError(f"peer_delay_ns must hold one non-negative delay per counter ({len(program.counters)})")
    fetch = times["fetch_ns"].to_numpy()
    stage = times["stage_ns"].to_numpy()
    wrt = times["wait_rt_ns"].to_numpy()
    run = (times["body_ns"] + times["signal_ns"]).to_numpy()
    qs = program.queues
    reach: list[list[float]] = [[] for _ in program.counters]  # time each increment landed, in order
    head = [0] * len(qs)
    arrive = np.zeros(n)
    start = np.zeros(n)
    end = np.zeros(n)
    prev_start = [0.0] * len(qs)
    events: list[tuple[float, int, int]] = []
    waiting: dict[int, set[int]] = {}  # counter -> the SMs whose head instruction waits on it (its first unmet wait)

    def met(v: int) -> tuple[float, int]:
        """(when every wait of ``v`` was met, -1), or (0, the first counter still short)."""
        t = 0.0
        for c, target in ins[v].waits:
            if len(reach[c]) < target:
                return 0.0, c
            t = max(t, reach[c][target - 1])
        return t, -1

    def try_start(sm: int) -> None:
        if head[sm] >= len(qs[sm]):
            return
        v = qs[sm][head[sm]]
        r, short = met(v)
        if short >= 0:  # retried when that counter next moves (nothing else can release it)
            waiting.setdefault(short, set()).add(sm)
            return
        p0 = prev_start[sm] if prefetch_ahead and head[sm] > 0 else arrive[v]
        s = max(p0 + fetch[v], r, arrive[v]) + wrt[v]
        begin = max(s, p0 + fetch[v] + stage[v]) if stage_wait_all else s
        start[v] = s
        end[v] = begin + run[v]
        prev_start[sm] = begin
        heapq.heappush(events, (end[v], v, sm))

    def moved(c: int) -> None:
        for other in sorted(waiting.pop(c, ())):
            try_start(other)

    for sm in range(len(qs)):
        try_start(sm)
    done = 0
    while events:
        now, v, sm = heapq.heappop(events)
        if sm < 0:  # a delayed cross-rank signal of counter v lands
            reach[v].append(now)
            moved(v)
            continue
        done += 1
        c = ins[v].signal
        if c >= 0 and delay[c] > 0:
            for _ in range(ins[v].amount):
                heapq.heappush(events, (now + delay[c], c, -1))
        elif c >= 0:
            for _ in range(ins[v].amount):
                reach[c].append(now)
        head[sm] += 1
        if head[sm] < len(qs[sm]):
            arrive[qs[sm][head[sm]]] = now
        try_start(sm)
        if c >= 0 and delay[c] == 0:
            moved(c)
    if done != n:
        raise ValueError(f"model simulation deadlocked after {done} of {n} instructions")
    df = pd.DataFrame({"sm": [x.sm for x in ins], "qpos": [x.qpos for x in ins], "op": [x.op.name for x in ins],
                       "layer": [x.layer for x in ins], "label": [x.label() for x in ins],
                       "arrive_ns": arrive, "start_ns": start, "end_ns": end})
    df.index.name = "id"
    return df

