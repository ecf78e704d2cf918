"""Prove a megakernel program race-free and deadlock-free from its declarations alone.

A program is correct if running it on any interleaving the counters allow gives the same result as running its
instructions one by one in sequential order. That holds when every pair of *conflicting* accesses (same element,
at least one a write) is ordered by *happens-before* the same way as in sequential order:

* happens-before on one SM is program order (an instruction starts after its predecessor in the queue ended);
* across SMs it comes from counters: a wait "counter ``c`` ≥ ``t``" orders after it every signaller of ``c``
  without which ``t`` could not be reached (total signalled − its own amount < ``t``), and, transitively,
  everything ordered before those;
* a *prefetch* read is issued before the instruction's waits, so it is ordered only by program order — which is
  why only static weights (never written during a step) may be prefetched.

The checker never looks at the scheduler's dependency analysis: it decodes the program, recomputes conflicts from
the operand boxes, simulates the counters to find deadlocks (counters only grow and waits are ``≥``, so every
maximal execution completes the same set of instructions — one simulation decides), builds happens-before as
ancestor sets along that execution, and reports each violation by instruction with a readable message.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from kimik3.megakernel.instructions import Kind, Program, decode_program

__all__ = ["Violation", "HappensBefore", "check_program", "happens_before", "redundant_waits", "format_violations"]


@dataclass(frozen=True)
class Violation:
    """One problem found. ``kind``: raw, war, waw (unordered conflicting accesses), prefetch (a non-weight read
    before the waits), deadlock, counter (declared per-step total ≠ what is signalled), bounds, static-write,
    queue (an instruction missing from, or duplicated in, the queues)."""

    kind: str
    instr: int
    message: str
    other: int | None = None
    buffer: str | None = None

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


def format_violations(violations: list[Violation], limit: int = 20) -> str:
    lines = [str(v) for v in violations[:limit]]
    if len(violations) > limit:
        lines.append(f"... and {len(violations) - limit} more")
    return "\n".join(lines) if lines else "no violations"


class HappensBefore:
    """Execution order found by the counter simulation and the happens-before relation of a program."""

    def __init__(self, program: Program) -> None:
        self.program = p = program
        ins = p.instructions
        n = len(ins)
        self.n = n
        self.prev = np.full(n, -1, dtype=np.int64)
        for q in p.queues:
            for a, b in zip(q, q[1:]):
                if 0 <= a < n and 0 <= b < n:
                    self.prev[b] = a
        self.signallers: dict[int, list[int]] = defaultdict(list)
        for i, x in enumerate(ins):
            if x.signal >= 0:
                self.signallers[x.signal].append(i)
        self.signalled = defaultdict(int)
        for c, ss in self.signallers.items():
            self.signalled[c] = sum(ins[s].amount for s in ss)
        self._simulate()
        self.anc = np.zeros((n, n), dtype=bool)  # anc[v, u]: u happens before v
        self._closure: dict[tuple[int, int], np.ndarray] = {}
        for v in self.order:
            row = self.base(v).copy()
            for c, t in ins[v].waits:
                row |= self.closure(c, t)
            self.anc[v] = row

    def _simulate(self) -> None:
        """Run the queues on counters alone (one step), greedily; record the order and where SMs got stuck."""
        p = self.program
        ins = p.instructions
        counters = defaultdict(int)
        head = [0] * len(p.queues)
        order: list[int] = []
        progress = True
        while progress:
            progress = False
            for s, q in enumerate(p.queues):
                while head[s] < len(q):
                    v = q[head[s]]
                    if not all(counters[c] >= t for c, t in ins[v].waits):
                        break
                    order.append(v)
                    if ins[v].signal >= 0:
                        counters[ins[v].signal] += ins[v].amount
                    head[s] += 1
                    progress = True
        self.order = order
        self.executed = np.zeros(self.n, dtype=bool)
        self.executed[order] = True
        self.counters = counters
        self.head = head

    def base(self, v: int) -> np.ndarray:
        """What happens before ``v`` through program order alone (also all its prefetches may rely on)."""
        p = self.prev[v]
        if p < 0:
            return np.zeros(self.n, dtype=bool)
        row = self.anc[p].copy()
        row[p] = True
        return row

    def guaranteed(self, c: int, t: int) -> list[int]:
        """Signallers of counter ``c`` that must have signalled before it can reach ``t``."""
        total = self.signalled[c]
        return [s for s in self.signallers[c] if total - self.program.instructions[s].amount < t]

    def closure(self, c: int, t: int) -> np.ndarray:
        key = (c, t)
        if key not in self._closure:
            row = np.zeros(self.n, dtype=bool)
            for s in self.guaranteed(c, t):
                if self.executed[s]:
                    row |= self.anc[s]
                    row[s] = True
            self._closure[key] = row
        return self._closure[key]

    def ordered(self, u: int, v: int) -> bool:
        return bool(self.anc[v, u])


def happens_before(program: Program | torch.Tensor) -> HappensBefore:
    return HappensBefore(decode_program(program) if isinstance(program, torch.Tensor) else program)


def _box_str(box: tuple[int, ...]) -> str:
    return "[" + ",".join(f"{box[2 * d]}:{box[2 * d + 1]}" for d in range(3)) + "]"


def _who(p: Program, i: int) -> str:
    x = p.instructions[i]
    return f"#{i} {x.label()} (SM {x.sm})"


def check_program(program: Program | torch.Tensor) -> list[Violation]:
    """Every violation of the rules in the module docstring, sorted by instruction. Empty list = proven correct
    for one step; with correct per-step totals (checked too) the monotonic targets make every step alike."""
    p = decode_program(program) if isinstance(program, torch.Tensor) else program
    ins, bufs = p.instructions, p.buffers
    n = len(ins)
    out: list[Violation] = []

    # -- structure: queues, operand boxes, prefetch and write permissions, counter ids
    seen = np.zeros(n, dtype=np.int64)
    for s, q in enumerate(p.queues):
        for k, v in enumerate(q):
            if not 0 <= v < n:
                out.append(Violation("queue", -1, f"SM {s} queue position {k} holds instruction id {v}, but the "
                                                   f"program has {n} instructions"))
                continue
            seen[v] += 1
            if ins[v].sm != s or ins[v].qpos != k:
                out.append(Violation("queue", v, f"{_who(p, v)} sits at SM {s} position {k} but declares SM "
                                                 f"{ins[v].sm} position {ins[v].qpos}"))
    for v in np.flatnonzero(seen != 1):
        out.append(Violation("queue", int(v), f"#{v} {ins[v].label()} appears {seen[v]} times in the queues "
                                              "(must be exactly once)"))
    nc = len(p.counters)
    for i, x in enumerate(ins):
        for c, _ in x.waits:
            if not 0 <= c < nc:
                out.append(Violation("counter", i, f"{_who(p, i)} waits on counter {c}, which does not exist"))
        if x.signal >= nc or (x.signal >= 0 and x.amount <= 0):
            out.append(Violation("counter", i, f"{_who(p, i)} signals counter {x.signal} by {x.amount}"))
    # every operand as one row of a table: instruction, buffer, mode, box (vectorised checks)
    rows = [(i, o.buf, o.mode, *o.box) for i, x in enumerate(ins) for o in x.operands]
    tab = np.array(rows, dtype=np.int64).reshape(-1, 9)
    oi, ob, om, obox = tab[:, 0], tab[:, 1], tab[:, 2], tab[:, 3:]
    okbuf = (ob >= 0) & (ob < len(bufs))
    for k in np.flatnonzero(~okbuf):
        out.append(Violation("bounds", int(oi[k]), f"{_who(p, int(oi[k]))} names buffer {ob[k]}, which does not "
                                                   "exist"))
    shapes = np.array([b.shape for b in bufs], dtype=np.int64).reshape(-1, 3)
    kinds = np.array([int(b.kind) for b in bufs], dtype=np.int64)
    obs = np.where(okbuf, ob, 0)
    lo, hi = obox[:, 0::2], obox[:, 1::2]
    inside = np.all((lo >= 0) & (lo < hi) & (hi <= shapes[obs]), axis=1) | ~okbuf
    okind = kinds[obs]
    static = (okind == int(Kind.WEIGHT)) | (okind == int(Kind.INPUT))
    writes, reads, pre = (om & 2) > 0, (om & 1) > 0, (om & 4) > 0
    for k in np.flatnonzero(~inside):
        spec = bufs[ob[k]]
        out.append(Violation("bounds", int(oi[k]), f"{_who(p, int(oi[k]))} declares {spec.name}"
                                                   f"{_box_str(tuple(obox[k]))} outside its shape {list(spec.shape)} "
                                                   "(or empty)", buffer=spec.name))
    for k in np.flatnonzero(okbuf & writes & static):
        spec = bufs[ob[k]]
        out.append(Violation("static-write", int(oi[k]), f"{_who(p, int(oi[k]))} writes {spec.name}, a "
                                                         f"{spec.kind.name.lower()} that must not change during a "
                                                         "step", buffer=spec.name))
    for k in np.flatnonzero(okbuf & pre & ((okind != int(Kind.WEIGHT)) | writes | ~reads)):
        spec = bufs[ob[k]]
        what = "written" if writes[k] else f"a {spec.kind.name.lower()} buffer, not a static weight"
        out.append(Violation("prefetch", int(oi[k]), f"{_who(p, int(oi[k]))} prefetches {spec.name}"
                                                     f"{_box_str(tuple(obox[k]))} before its waits, but {spec.name} "
                                                     f"is {what}: only static weights may be read before the waits",
                             buffer=spec.name))
    if any(v.kind in ("queue", "bounds") for v in out) or any(v.kind == "counter" and "exist" in v.message
                                                              for v in out):
        return sorted(out, key=lambda v: (v.instr, v.kind))

    # -- counters: declared per-step totals must equal what is signalled (targets are step*total + t)
    hb = HappensBefore(p)
    for c, ctr in enumerate(p.counters):
        if hb.signalled[c] != ctr.total:
            who = hb.signallers[c][0] if hb.signallers[c] else -1
            out.append(Violation("counter", who, f"counter {c} '{ctr.name}' declares {ctr.total} signals per step but "
                                                 f"its signallers add {hb.signalled[c]}: from the second step on, "
                                                 "waits on it would release early or never"))

    # -- deadlock: an SM whose head can never run
    for s, q in enumerate(p.queues):
        if hb.head[s] >= len(q):
            continue
        v = q[hb.head[s]]
        reasons = []
        for c, t in ins[v].waits:
            if hb.counters[c] >= t:
                continue
            name = p.counters[c].name if c < nc else str(c)
            if t > hb.signalled[c]:
                reasons.append(f"counter {c} '{name}' >= {t}, but only {hb.signalled[c]} is ever signalled per step")
            else:
                missing = [m for m in hb.signallers[c] if not hb.executed[m]]
                stuck = ", ".join(_who(p, m) for m in missing[:3]) + (" ..." if len(missing) > 3 else "")
                reasons.append(f"counter {c} '{name}' >= {t} (reached {hb.counters[c]}); still missing: {stuck}")
        out.append(Violation("deadlock", v, f"deadlock: SM {s} is stuck at queue position {hb.head[s]}/{len(q)} on "
                                            f"{_who(p, v)}, waiting for " + "; ".join(reasons)))

    # -- conflicts: every pair of conflicting accesses ordered as in sequential order
    tracked = okbuf & ((okind == int(Kind.ACT)) | (okind == int(Kind.STATE)) | (okind == int(Kind.OUTPUT)))
    seen_pairs: set[tuple[int, int, int]] = set()
    for b in np.unique(ob[tracked]):
        sel = np.flatnonzero(tracked & (ob == b))
        ids, rd, wr, pf, box = oi[sel], reads[sel], writes[sel], pre[sel], obox[sel]
        lo, hi = box[:, 0::2], box[:, 1::2]
        ov = np.all((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]), axis=2)
        conflict = ov & (wr[:, None] | wr[None, :]) & (ids[:, None] < ids[None, :])
        ii, jj = np.nonzero(conflict)  # access ii (earlier instruction) vs jj (later)
        if not len(ii):
            continue
        u, v = ids[ii], ids[jj]
        both = hb.executed[u] & hb.executed[v]
        okay = hb.anc[v, u].copy()
        # a prefetched read at the later instruction is ordered by program order only
        pref = pf[jj] & both
        for k in np.flatnonzero(pref):
            okay[k] = bool(hb.base(int(v[k]))[u[k]])
        bad = np.flatnonzero(both & ~okay)
        for k in bad:
            uu, vv, a, c = int(u[k]), int(v[k]), int(ii[k]), int(jj[k])
            kind = "raw" if wr[a] and rd[c] else "war" if rd[a] and wr[c] else "waw"
            key = (uu, vv, int(b))
            if key in seen_pairs:
                continue
            seen_pairs.add(key)
            spec = bufs[int(b)]
            inter = tuple(x for d in range(3) for x in (max(box[a, 2 * d], box[c, 2 * d]),
                                                        min(box[a, 2 * d + 1], box[c, 2 * d + 1])))
            verb = {"raw": ("reads", "written by"), "war": ("overwrites", "read by"),
                    "waw": ("overwrites", "written by")}[kind]
            how = " (a prefetch, issued before its waits)" if pf[c] else ""
            rev = f"; worse, #{vv} is ordered BEFORE #{uu}" if hb.anc[uu, vv] else ""
            out.append(Violation(kind, vv, f"{kind.upper()}: {_who(p, vv)} {verb[0]} {spec.name}{_box_str(inter)}"
                                           f"{how}, {verb[1]} {_who(p, uu)} earlier in sequential order, but no wait "
                                           f"or program order makes #{uu} happen before #{vv}{rev}",
                                 other=uu, buffer=spec.name))
    return sorted(out, key=lambda x: (x.instr, x.kind))


def redundant_waits(program: Program | torch.Tensor) -> list[tuple[int, int, str]]:
    """Waits implied by the others: (instruction, wait index, why). A wait is redundant when every signaller it
    guarantees already happens before the instruction through program order and its other waits."""
    p = decode_program(program) if isinstance(program, torch.Tensor) else program
    hb = HappensBefore(p)
    out = []
    for v in hb.order:
        waits = p.instructions[v].waits
        for k, (c, t) in enumerate(waits):
            rest = hb.base(v)
            for j, (c2, t2) in enumerate(waits):
                if j != k:
                    rest |= hb.closure(c2, t2)
            g = hb.guaranteed(c, t)
            if g and all(rest[s] for s in g):
                out.append((v, k, f"{_who(p, v)}: wait on '{p.counters[c].name}' >= {t} is implied by program "
                                  "order and its other waits"))
    return out
