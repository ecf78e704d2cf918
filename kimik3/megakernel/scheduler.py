"""Build the megakernel program for a model config: instructions, dependencies, costs, per-SM queues, waits.

The pipeline, one function per step so a notebook can show it: :func:`~kimik3.megakernel.step.build_step` (the
instructions in sequential order, the only model-specific step), :func:`hazard_predecessors` (RAW, WAR and WAW
edges from the declarations alone), :func:`instruction_costs` (bytes and FLOPs per instruction, split from
:func:`kimik3.perf.cost.decode_cost`, §8), a queue policy (``"round_robin"`` or ``"critical_path"``),
:func:`compute_waits` (counter waits, transitively reduced) and
:func:`~kimik3.megakernel.instructions.assign_stages` (weight stages). Waits are on whole groups: a consumer waits
until a group's counter reaches its member count (``s·total + total`` in step ``s``). Every edge points forward in
dispatch order, so no schedule built here can deadlock (the hazard checker verifies it independently). The steps
in full: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import reduce

import numpy as np
import pandas as pd
import torch

from kimik3.megakernel.instructions import (
    BufferSpec,
    Counter,
    Instruction,
    Kind,
    Operand,
    Program,
    assign_stages,
)
from kimik3.megakernel.ranks import SINGLE, Shard
from kimik3.megakernel.step import StepSpec, Tiling, build_step
from kimik3.model.config import ModelConfig

__all__ = [
    "POLICIES",
    "CostModel",
    "hazard_predecessors",
    "instruction_costs",
    "assign_round_robin",
    "assign_critical_path",
    "compute_waits",
    "build_program",
]

POLICIES = ("round_robin", "critical_path")


# ====================================================================================================== hazards


def hazard_predecessors(buffers: Sequence[BufferSpec], instructions: Sequence[Instruction]) -> list[set[int]]:
    """For each instruction (in sequential order), the earlier instructions it conflicts with *nearest*: the last
    writer of each element it reads (RAW) or writes (WAW), and the readers since that write of each element it
    writes (WAR). Weights and inputs have no writers inside a step and are skipped.

    Each buffer is cut into cells along every box boundary used on it; a cell is the unit of "same element"."""
    n = len(instructions)
    preds: list[set[int]] = [set() for _ in range(n)]
    per_buf: dict[int, list[tuple[int, Operand]]] = defaultdict(list)
    for i, ins in enumerate(instructions):
        for o in ins.operands:
            if buffers[o.buf].kind not in (Kind.WEIGHT, Kind.INPUT):
                per_buf[o.buf].append((i, o))
    for _, acc in per_buf.items():
        cuts = [sorted({o.box[2 * d] for _, o in acc} | {o.box[2 * d + 1] for _, o in acc}) for d in range(3)]
        at = [{x: k for k, x in enumerate(c)} for c in cuts]
        shape = tuple(len(c) - 1 for c in cuts)
        last_w = np.full(shape, -1, dtype=np.int64)
        readers = np.zeros(shape, dtype=object)  # per cell: bitset (Python int) of readers since the last write
        i_prev, pending_w = -1, []
        for i, o in acc + [(n, None)]:
            if i != i_prev:  # finish the previous instruction: its writes land after all its reads
                for c in pending_w:
                    last_w[c] = i_prev
                    readers[c] = 0
                pending_w, i_prev = [], i
            if o is None:
                break
            c = tuple(slice(at[d][o.box[2 * d]], at[d][o.box[2 * d + 1]]) for d in range(3))
            lw = np.unique(last_w[c])
            if o.reads or o.writes:
                preds[i].update(int(x) for x in lw if x >= 0 and x != i)
            if o.writes:
                rd = reduce(lambda a, x: a | x, readers[c].flat, 0)
                while rd:
                    low = rd & -rd
                    r = low.bit_length() - 1
                    if r != i:
                        preds[i].add(r)
                    rd ^= low
                pending_w.append(c)
            if o.reads:
                readers[c] = readers[c] | (1 << i)
    return preds


# ====================================================================================================== costs


@dataclass(frozen=True)
class CostModel:
    """Durations from bytes and FLOPs: ``overhead + bytes / (HBM bandwidth / SMs) + flops / (peak / SMs)``.

    One instruction runs on one SM; when all SMs stream, each gets its fair share of HBM bandwidth, which is the
    regime a decode megakernel lives in. Weight bytes may stream during the instruction's waits (prefetch)."""

    hbm_bandwidth: float  # bytes/s, whole chip
    sm_count: int
    peak_flops: float  # dense bf16 FLOP/s, whole chip
    overhead_ns: float = 500.0
    name: str = ""

    @classmethod
    def for_hardware(cls, name: str = "h200", overhead_ns: float = 500.0) -> CostModel:
        from kimik3.perf.hardware import get_hardware

        h = get_hardware(name)
        return cls(h.hbm_bandwidth, h.sm_count or 132, h.peak_flops("bf16"), overhead_ns, h.name)

    @property
    def sm_bandwidth(self) -> float:
        return self.hbm_bandwidth / self.sm_count

    @property
    def sm_flops(self) -> float:
        return self.peak_flops / self.sm_count


_CATS = ("weight_bytes", "state_bytes", "act_bytes", "flops")


def instruction_costs(spec: StepSpec, context_len: int | None = None, expert_dtype: str = "bf16",
                      weight_dtype: str = "bf16", cost_model: CostModel | None = None) -> pd.DataFrame:
    """Per instruction: weight / state+cache / activation bytes, FLOPs, blocks, and durations (ns).

    Per-block totals come from ``kimik3.perf.cost.decode_cost`` (the model's own parameter shapes, D(B) expected
    distinct experts); each block's total is split between the instructions that carry it in proportion to their
    tile shapes. Every weight-carrying block of ``decode_cost`` must be carried by some instruction (checked). A rank
    program is priced by ``decode_cost`` of its rank's slice (``ModelConfig.rank_slice``). The shape-based totals
    before that calibration ride along as ``attrs["shape_totals"]`` (an independent count of the same bytes)."""
    cfg, B = spec.cfg, spec.batch
    ctx = spec.max_seq_len if context_len is None else context_len
    raw = np.zeros((len(spec.instructions), 4))
    owners: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = defaultdict(list)
    for i, contrib in enumerate(spec.raw_costs):
        for key, vals in contrib.items():
            v = np.asarray(vals, dtype=float)
            owners[key].append((i, v))
    calibrated = False
    try:
        from kimik3.perf.cost import decode_cost
    except ImportError:  # the cost model is optional: fall back to the raw shape-based numbers
        decode_cost = None
    shape_totals = dict(zip(_CATS, sum((v for own in owners.values() for _, v in own), np.zeros(4)).tolist()))
    if decode_cost is not None:
        sh = spec.shard
        priced = sh.slice_of(cfg)
        dc = decode_cost(priced, batch_size=B, context_len=ctx, weight_dtype=weight_dtype, expert_dtype=expert_dtype,
                         act_dtype="bf16").by_block
        calibrated = True
        for _, row in dc.iterrows():
            key = (int(row["layer"]), str(row["block"]))
            target = np.array([row["weight_bytes"],
                               row["state_bytes_read"] + row["state_bytes_written"] + row["kv_bytes_read"]
                               + row["kv_bytes_written"], row["activation_bytes"], row["flops"]], dtype=float)
            own = owners.get(key, [])
            if not own:
                if target[0] > 0:
                    raise AssertionError(f"cost model block {key} ({target[0]:.0f} weight bytes) is carried by no "
                                         "instruction")
                continue
            tot = sum(v for _, v in own)
            for c in range(4):
                for i, v in own:
                    if tot[c] > 0:
                        raw[i, c] += target[c] * v[c] / tot[c]
                    else:  # no shape-based split for this category: share it evenly
                        raw[i, c] += target[c] / len(own)
        missing = set(owners) - {(int(r["layer"]), str(r["block"])) for _, r in dc.iterrows()}
        for key in missing:  # carried by instructions but unknown to decode_cost (should not happen): keep raw
            for i, v in owners[key]:
                raw[i] += v
    else:
        for own in owners.values():
            for i, v in own:
                raw[i] += v
    cm = cost_model or CostModel.for_hardware()
    df = pd.DataFrame(raw, columns=list(_CATS))
    df.insert(0, "op", [ins.op.name for ins in spec.instructions])
    df.insert(1, "layer", [ins.layer for ins in spec.instructions])
    df.insert(2, "label", [ins.label() for ins in spec.instructions])
    df["blocks"] = [",".join(sorted({blk for _, blk in c})) for c in spec.raw_costs]
    df["prefetch_ns"] = df["weight_bytes"] / cm.sm_bandwidth * 1e9
    df["busy_ns"] = cm.overhead_ns + (df["state_bytes"] + df["act_bytes"]) / cm.sm_bandwidth * 1e9 \
        + df["flops"] / cm.sm_flops * 1e9
    df["ns"] = df["prefetch_ns"] + df["busy_ns"]
    df.attrs["calibrated_by_decode_cost"] = calibrated
    df.attrs["shape_totals"] = shape_totals
    df.attrs["cost_model"] = cm
    df.index.name = "id"
    return df


# ====================================================================================================== policies


def _group_structure(spec_groups: Sequence[str], preds: Sequence[set[int]]
                     ) -> tuple[list[int], list[list[int]], list[str], list[list[int]]]:
    """Group ids per instruction, members per group, group names, and the groups each instruction depends on."""
    names: list[str] = []
    index: dict[str, int] = {}
    gid = []
    for g in spec_groups:
        if g not in index:
            index[g] = len(names)
            names.append(g)
        gid.append(index[g])
    members: list[list[int]] = [[] for _ in names]
    for i, g in enumerate(gid):
        members[g].append(i)
    gdeps = []
    for v, ps in enumerate(preds):
        gs = sorted({gid[u] for u in ps})
        if gid[v] in gs:
            raise AssertionError(f"instruction {v} depends on a member of its own group {names[gid[v]]}")
        gdeps.append(gs)
    return gid, members, names, gdeps


def assign_round_robin(n: int, num_sms: int) -> list[list[int]]:
    """Instruction ``i`` (sequential order) goes to SM ``i mod S``: the simplest policy, blind to cost."""
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    for i in range(n):
        queues[i % num_sms].append(i)
    return queues


def assign_critical_path(busy_ns: Sequence[float], prefetch_ns: Sequence[float], gid: Sequence[int],
                         members: Sequence[Sequence[int]], gdeps: Sequence[Sequence[int]], num_sms: int,
                         prefetch: bool = True) -> tuple[list[list[int]], float]:
    """Cost-balanced critical-path-first list scheduling, aware of weight prefetch.

    Priority of an instruction = its *bottom level*: its own duration plus the longest duration-weighted path
    from it to the end of the step. SMs are served in order of the time they become free. A free SM takes the
    highest-priority instruction that is ready (every group it waits on has finished); if none is ready it
    commits to the one that becomes ready first and streams that instruction's weights while it waits — the same
    execution model as :func:`kimik3.megakernel.timeline.simulate`. An instruction becomes a candidate once every
    group it waits on is fully dispatched, so dispatch order is topological and the queues cannot deadlock.
    Returns the queues (dispatch order) and the estimated makespan (ns)."""
    busy = [float(x) for x in busy_ns]
    pre = [float(x) for x in prefetch_ns]
    n = len(busy)
    ng = len(members)
    succ_best = [0.0] * ng
    bl = [0.0] * n
    for v in range(n - 1, -1, -1):  # sequential order is topological: producers precede consumers
        bl[v] = busy[v] + pre[v] + succ_best[gid[v]]
        for g in gdeps[v]:
            if bl[v] > succ_best[g]:
                succ_best[g] = bl[v]
    waiters: list[list[int]] = [[] for _ in range(ng)]
    pending = [len(gs) for gs in gdeps]
    for v, gs in enumerate(gdeps):
        for g in gs:
            waiters[g].append(v)
    left = [len(m) for m in members]
    gfinish = [0.0] * ng
    ready_at = [0.0] * n
    future = [(0.0, -bl[v], v) for v in range(n) if pending[v] == 0]  # (ready time, -priority, id)
    heapq.heapify(future)
    ready: list[tuple[float, int]] = []  # (-priority, id), ready time <= now
    sms = [(0.0, s) for s in range(num_sms)]
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    makespan = 0.0
    for _ in range(n):
        now, sm = heapq.heappop(sms)
        while future and future[0][0] <= now:
            _, nb, v = heapq.heappop(future)
            heapq.heappush(ready, (nb, v))
        if ready:
            _, v = heapq.heappop(ready)
        elif future:
            _, _, v = heapq.heappop(future)
        else:
            raise AssertionError("list scheduling stalled: dependency cycle between groups")
        start = max(now, ready_at[v])
        hidden = min(pre[v], start - now) if prefetch else 0.0
        end = start + busy[v] + pre[v] - hidden
        makespan = max(makespan, end)
        queues[sm].append(v)
        heapq.heappush(sms, (end, sm))
        g = gid[v]
        gfinish[g] = max(gfinish[g], end)
        left[g] -= 1
        if left[g] == 0:
            for w in waiters[g]:
                pending[w] -= 1
                ready_at[w] = max(ready_at[w], gfinish[g])
                if pending[w] == 0:
                    heapq.heappush(future, (ready_at[w], -bl[w], w))
    return queues, makespan


# ====================================================================================================== waits


def _topological(n: int, queues: Sequence[Sequence[int]], gid: Sequence[int], members: Sequence[Sequence[int]],
                 gdeps: Sequence[Sequence[int]]) -> list[int]:
    """An order of all instructions respecting program order on each SM and every group dependency."""
    prev = [-1] * n
    nxt = [-1] * n
    for q in queues:
        for a, b in zip(q, q[1:]):
            prev[b], nxt[a] = a, b
    waiters: list[list[int]] = [[] for _ in members]
    for v, gs in enumerate(gdeps):
        for g in gs:
            waiters[g].append(v)
    indeg = [len(gdeps[v]) + (prev[v] >= 0) for v in range(n)]
    left = [len(m) for m in members]
    stack = [v for v in range(n) if indeg[v] == 0]
    order = []
    while stack:
        v = stack.pop()
        order.append(v)
        succ = [nxt[v]] if nxt[v] >= 0 else []
        g = gid[v]
        left[g] -= 1
        if left[g] == 0:
            succ += waiters[g]
        for w in succ:
            indeg[w] -= 1
            if indeg[w] == 0:
                stack.append(w)
    if len(order) != n:
        raise AssertionError("queues and dependencies form a cycle: this schedule would deadlock")
    return order


def compute_waits(n: int, queues: Sequence[Sequence[int]], preds: Sequence[set[int]], gid: Sequence[int],
                  members: Sequence[Sequence[int]], gdeps: Sequence[Sequence[int]]) -> list[list[int]]:
    """The groups each instruction waits on: a minimal set that, with program order on its SM, orders every
    hazard predecessor before it.

    Happens-before is tracked as ancestor bitsets along a topological order. Waiting on group ``g`` (for its full
    count) orders every member of ``g`` and all their ancestors before the waiter. Candidate groups are taken
    latest-first (a late group's ancestors often include the earlier ones), then any wait whose required members
    are already covered by the others is dropped — so no remaining wait is implied by the rest."""
    order = _topological(n, queues, gid, members, gdeps)
    prev = [-1] * n
    for q in queues:
        for a, b in zip(q, q[1:]):
            prev[b] = a
    position = [0] * n
    for k, v in enumerate(order):
        position[v] = k
    anc = [0] * n
    member_bits = [sum(1 << m for m in ms) for ms in members]
    last_pos = [max(position[m] for m in ms) for ms in members]
    closure: dict[int, int] = {}

    def close(g: int) -> int:
        if g not in closure:
            closure[g] = reduce(lambda a, m: a | anc[m] | (1 << m), members[g], 0)
        return closure[g]

    waits: list[list[int]] = [[] for _ in range(n)]
    for v in order:
        p = prev[v]
        base = (anc[p] | (1 << p)) if p >= 0 else 0
        need = sum(1 << u for u in preds[v]) & ~base
        if not need:
            anc[v] = base
            continue
        cands = sorted({gid[u] for u in preds[v] if not (base >> u) & 1}, key=lambda g: -last_pos[g])
        kept, covered = [], base
        for g in cands:
            if need & member_bits[g] & ~covered:
                kept.append(g)
                covered |= close(g)
        changed = True
        while changed:
            changed = False
            for g in kept:
                others = reduce(lambda a, h: a | close(h), (h for h in kept if h != g), base)
                if not need & ~others:
                    kept.remove(g)
                    changed = True
                    break
        anc[v] = reduce(lambda a, h: a | close(h), kept, base)
        waits[v] = kept
    return waits


# ====================================================================================================== program


def build_program(cfg: ModelConfig | str, batch: int, num_sms: int, policy: str = "critical_path",
                  max_seq_len: int = 4096, tiling: Tiling | None = None, act_dtype: torch.dtype = torch.bfloat16,
                  context_len: int | None = None, cost_model: CostModel | None = None,
                  expert_format: str = "dense", shard: Shard = SINGLE) -> Program:
    """The whole pipeline: step instructions → hazards → costs → queues → minimal waits → stages → :class:`Program`.

    Built once per (config, batch, SM count, tiling, expert format) and reused for every decode step: counters are
    monotonic across steps, so nothing is reset between launches. ``expert_format``: ``"dense"`` (routed experts in
    the activation dtype) or ``"mxfp4"`` (uint8 codes + E8M0 scales, costed at MXFP4 bytes). The per-instruction
    costs ride along as ``program.costs`` (not serialised). ``shard``: build rank ``shard.rank``'s program of a
    deployment (:mod:`kimik3.megakernel.ranks`), its collectives as opcodes; the default is one GPU."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if num_sms < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    spec = build_step(cfg, batch, max_seq_len, tiling, num_sms, act_dtype, context_len, expert_format, shard)
    n = len(spec.instructions)
    preds = hazard_predecessors(spec.buffers, spec.instructions)
    gid, members, names, gdeps = _group_structure(spec.groups, preds)
    costs = instruction_costs(spec, context_len, expert_dtype="mxfp4" if expert_format == "mxfp4" else "bf16",
                              cost_model=cost_model)
    if policy == "round_robin":
        queues = assign_round_robin(n, num_sms)
    else:
        queues, _ = assign_critical_path(costs["busy_ns"].tolist(), costs["prefetch_ns"].tolist(), gid, members,
                                         gdeps, num_sms)
    prog = assemble(spec, queues, preds, (gid, members, names, gdeps), policy)
    prog.costs = costs
    return prog


def assemble(spec: StepSpec, queues: Sequence[Sequence[int]], preds: Sequence[set[int]],
             groups: tuple[Sequence[int], Sequence[Sequence[int]], Sequence[str], Sequence[set[int]]],
             policy: str) -> Program:
    """Waits, counters, queue places and weight stages of ``spec``'s instructions on ``queues``: the
    :class:`Program` (``groups``: what :func:`_group_structure` returns for them)."""
    gid, members, names, gdeps = groups
    n = len(spec.instructions)
    waits = compute_waits(n, queues, preds, gid, members, gdeps)
    world = spec.shard.world
    pushed = {gid[i] for i, ins in enumerate(spec.instructions) if ins.peers != (0, 0)}
    _wait_on_peers(spec, preds, gid, pushed, waits)
    # counters: only groups somebody waits on get one (and only their members signal); a group that pushes to its
    # peers gets a cross-rank counter, one word per source rank
    used = sorted({g for ws in waits for g in ws} | pushed)
    cid = {g: i for i, g in enumerate(used)}
    counters = [Counter(names[g], len(members[g]), world if g in pushed else 0) for g in used]
    sm_of, qpos = [0] * n, [0] * n
    for s, q in enumerate(queues):
        for k, v in enumerate(q):
            sm_of[v], qpos[v] = s, k
    instructions = []
    for v, ins in enumerate(spec.instructions):
        g = gid[v]
        instructions.append(replace(
            ins, waits=tuple((cid[w], len(members[w])) for w in waits[v]),
            signal=cid.get(g, -1), amount=1 if g in cid else 0, sm=sm_of[v], qpos=qpos[v]))
    # the weight stages are decided last: the next-stage words follow the final queue order
    return assign_stages(Program(spec.buffers, instructions, [list(q) for q in queues], counters, spec.batch,
                                 spec.max_seq_len, spec.cfg.num_hidden_layers, policy, spec.expert_format,
                                 spec.shard.rank, world))


def _wait_on_peers(spec: StepSpec, preds: Sequence[set[int]], gid: Sequence[int], pushed: set[int],
                   waits: list[list[int]]) -> None:
    """Keep, in place, every wait that orders a MAILBOX read after its producers on the other ranks: a reader of
    a mailbox waits on each pushing group that writes it, even where local order already covers the local members
    (the transitive reduction sees only this rank; the peers' words of the counter are what the wait is for)."""
    if not pushed:
        return
    bufs = spec.buffers
    writes: dict[int, set[int]] = defaultdict(set)  # pushing group -> mailboxes it writes
    for i, ins in enumerate(spec.instructions):
        if gid[i] in pushed:
            writes[gid[i]].update(o.buf for o in ins.operands if o.writes and bufs[o.buf].kind == Kind.MAILBOX)
    for v, ins in enumerate(spec.instructions):
        reads = {o.buf for o in ins.operands if o.reads and bufs[o.buf].kind == Kind.MAILBOX}
        if not reads:
            continue
        for g in sorted({gid[u] for u in preds[v]} & pushed):
            if writes[g] & reads and g not in waits[v]:
                waits[v].append(g)
