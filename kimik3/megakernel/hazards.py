"""Prove a megakernel program race-free and deadlock-free from its declarations alone.

A program is correct if every interleaving the counters allow gives the result of running its instructions one by
one in sequential order: every pair of conflicting accesses (same element, at least one a write) must be ordered by
happens-before as in sequential order. Happens-before is program order on one SM and, across SMs, what counter
waits imply; prefetched and staged reads are issued before their waits, so only static weights may be read that
way, and every staged-read descriptor and MXFP4 codes/scales pair is checked too. The checker never looks at the
scheduler's dependency analysis: it decodes the program, recomputes conflicts from the operand boxes, simulates
the counters to find deadlocks, and reports each violation by instruction (:func:`check_program`). The rules in
full: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from kimik3.megakernel.instructions import (
    CHUNK_BYTES,
    MXFP4_OPERANDS,
    NO_STAGE,
    STAGE_BYTES,
    Kind,
    Mode,
    Op,
    Program,
    decode_program,
    stage_descriptor,
)
from kimik3.model.quant import MXFP4_GROUP

__all__ = ["Violation", "HappensBefore", "check_program", "happens_before", "redundant_waits", "format_violations"]


@dataclass(frozen=True)
class Violation:
    """One problem found. ``kind``: raw, war, waw (unordered conflicting accesses), prefetch (a non-weight read
    before the waits, or a non-weight stage / next-stage descriptor), stage (a stage or next-stage descriptor that
    is malformed, outside the box it feeds, or not the next instruction's own stage), deadlock, counter (declared
    per-step total ≠ what is signalled), bounds, static-write, queue (an instruction missing from, or duplicated
    in, the queues), mxfp4 (an MXFP4 expert operand pair whose scales do not cover its codes, or not uint8
    weights)."""

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
    """Execution order found by the counter simulation and the happens-before relation of a program.
    ``extra_signals``: instruction -> further counters it adds its amount to (the merged program of a deployment,
    :mod:`kimik3.megakernel.hazards_ranks`, where one push signals a counter on every rank)."""

    def __init__(self, program: Program, extra_signals: dict[int, list[int]] | None = None) -> None:
        self.program = p = program
        self.signals = {i: ([x.signal] if x.signal >= 0 else []) + list((extra_signals or {}).get(i, ()))
                        for i, x in enumerate(program.instructions)}
        ins = p.instructions
        n = len(ins)
        self.n = n
        self.prev = np.full(n, -1, dtype=np.int64)
        for q in p.queues:
            for a, b in zip(q, q[1:]):
                if 0 <= a < n and 0 <= b < n:
                    self.prev[b] = a
        self.signallers: dict[int, list[int]] = defaultdict(list)
        for i in range(n):
            for c in self.signals[i]:
                self.signallers[c].append(i)
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
                    for c in self.signals[v]:
                        counters[c] += ins[v].amount
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
    """The :class:`HappensBefore` of a program (or its encoding)."""
    return HappensBefore(decode_program(program) if isinstance(program, torch.Tensor) else program)


def _box_str(box: tuple[int, ...]) -> str:
    return "[" + ",".join(f"{box[2 * d]}:{box[2 * d + 1]}" for d in range(3)) + "]"


def _who(p: Program, i: int) -> str:
    x = p.instructions[i]
    return f"#{i} {x.label()} (SM {x.sm})"


def _elem_box(elem: int, n: int, dims: tuple[int, int, int]) -> tuple[int, ...]:
    """The smallest box holding the contiguous elements ``[elem, elem + n)`` of a ``[d0, d1, d2]`` buffer."""
    _, d1, d2 = dims
    (b, r, c), (b2, r2, c2) = _at(elem, dims), _at(elem + n - 1, dims)
    if b != b2:
        return b, b2 + 1, 0, d1, 0, d2
    if r != r2:
        return b, b + 1, r, r2 + 1, 0, d2
    return b, b + 1, r, r + 1, c, c2 + 1


def _at(off: int, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    _, d1, d2 = dims
    return off // (d1 * d2), off // d2 % d1, off % d2


def _range_in_box(elem: int, n: int, dims: tuple[int, int, int], box: tuple[int, ...]) -> bool:
    """Whether every element of ``[elem, elem + n)`` lies in ``box``: its ends do, and where the range crosses a
    row (a ``D0`` slice) the box spans whole rows (slices), or the range holds elements between them it does not."""
    _, d1, d2 = dims
    b0, b1, r0, r1, c0, c1 = box
    first, last = _at(elem, dims), _at(elem + n - 1, dims)
    ends = all(b0 <= x[0] < b1 and r0 <= x[1] < r1 and c0 <= x[2] < c1 for x in (first, last))
    rows_ok = first[:2] == last[:2] or (c0 == 0 and c1 == d2)
    slices_ok = first[0] == last[0] or (r0 == 0 and r1 == d1)
    return ends and rows_ok and slices_ok


def _stage_reads(p: Program) -> tuple[list[Violation], list[tuple[int, int, tuple[int, ...], int]]]:
    """The stage and next-stage checks (module docstring), and every staged read as (reader, buffer, box, issuer):
    ``reader`` is the instruction whose stage it fills, ``issuer`` the one at whose start the device issues it
    (ordered only by what happens before the issuer through program order)."""
    ins, bufs = p.instructions, p.buffers
    out: list[Violation] = []
    reads: list[tuple[int, int, tuple[int, ...], int]] = []
    for i, x in enumerate(ins):
        j, rows, chunks = x.stage
        if j == -1:
            if (rows, chunks) != (0, 0):
                out.append(Violation("stage", i, f"{_who(p, i)} stages no operand but declares {rows} rows / "
                                                 f"{chunks} chunks"))
            continue
        if not 0 <= j < len(x.operands):
            out.append(Violation("stage", i, f"{_who(p, i)} stages operand {j}, but has {len(x.operands)}"))
            continue
        o = x.operands[j]
        if not 0 <= o.buf < len(bufs):
            continue  # reported as bounds
        spec = bufs[o.buf]
        b0, b1, r0, r1, c0, c1 = o.box
        d2, esize = spec.shape[2], spec.element_size
        what = f"{_who(p, i)} stages operand {j} {spec.name}{_box_str(o.box)}"
        bad = []
        if spec.kind != Kind.WEIGHT:
            out.append(Violation("prefetch", i, f"{what}, a {spec.kind.name.lower()} buffer, before its waits: only "
                                                "static weights may be staged", buffer=spec.name))
            bad.append("kind")
        if not (o.prefetch and o.reads and not o.writes):
            bad.append("it is not declared a PREFETCH read")
        if spec.dtype != torch.bfloat16:
            bad.append(f"it is {str(spec.dtype).removeprefix('torch.')}, the stage holds bf16")
        if not (b1 - b0 == 1 and c0 == 0 and c1 == d2 and d2 % 8 == 0):
            bad.append("its box is not whole rows of one D0 slice (b1-b0 == 1, c0 == 0, c1 == d2, d2 % 8 == 0)")
        if not 1 <= rows <= r1 - r0:
            bad.append(f"{rows} rows of a {r1 - r0}-row box")
        if chunks * CHUNK_BYTES != rows * d2 * esize:
            bad.append(f"{chunks} chunks of {CHUNK_BYTES} bytes are not {rows} rows of {d2} elements")
        if chunks * CHUNK_BYTES > STAGE_BYTES or rows * d2 * esize > STAGE_BYTES:
            bad.append(f"more than the {STAGE_BYTES}-byte stage")
        if x.op == Op.EMBED:
            bad.append("EMBED's table rows are data-dependent")
        for b in bad:
            if b != "kind":
                out.append(Violation("stage", i, f"{what}: {b}", buffer=spec.name))
    nb = len(bufs)
    for s, q in enumerate(p.queues):
        for k, u in enumerate(q):
            if not 0 <= u < len(ins):
                continue
            w = q[k + 1] if k + 1 < len(q) and 0 <= q[k + 1] < len(ins) else None
            if k == 0 and 0 <= ins[u].stage[0] < len(ins[u].operands):
                # the head of a queue copies its own stage before its waits (nothing happens before it)
                o = ins[u].operands[ins[u].stage[0]]
                if 0 <= o.buf < nb:
                    reads.append((u, o.buf, (o.box[0], o.box[0] + 1, o.box[2], o.box[2] + max(1, ins[u].stage[1]),
                                             o.box[4], o.box[5]), u))
            buf, elem, chunks = ins[u].next_stage
            want = NO_STAGE
            if w is not None and 0 <= ins[w].stage[0] < len(ins[w].operands) and \
                    0 <= ins[w].operands[ins[w].stage[0]].buf < nb:
                want = stage_descriptor(ins[w], bufs)
            nxt = f"#{w} {ins[w].label()}" if w is not None else "nothing (the last of its queue)"
            if buf == -1:
                if (elem, chunks) != (0, 0) or want != NO_STAGE:
                    out.append(Violation("stage", u, f"{_who(p, u)} streams no next stage {(buf, elem, chunks)}, but "
                                                     f"the next instruction {nxt} stages {want}: it would read a "
                                                     "stage nobody filled"))
                continue
            if not 0 <= buf < nb:
                out.append(Violation("bounds", u, f"{_who(p, u)}'s next-stage descriptor names buffer {buf}, which "
                                                  "does not exist"))
                continue
            spec = bufs[buf]
            esize = spec.element_size
            n = chunks * CHUNK_BYTES // esize
            numel = spec.shape[0] * spec.shape[1] * spec.shape[2]
            if chunks < 1 or chunks * CHUNK_BYTES % esize or elem < 0 or elem + n > numel or \
                    chunks * CHUNK_BYTES > STAGE_BYTES:
                out.append(Violation("stage", u, f"{_who(p, u)}'s next-stage descriptor {spec.name} elements "
                                                 f"{elem}+{chunks}x{CHUNK_BYTES}B does not fit the buffer "
                                                 f"({numel} elements) or the {STAGE_BYTES}-byte stage",
                                     buffer=spec.name))
                continue
            region = f"{spec.name}{_box_str(_elem_box(elem, n, spec.shape))}"
            if spec.kind != Kind.WEIGHT:
                out.append(Violation("prefetch", u, f"{_who(p, u)} streams {region} into the stage of {nxt} while it "
                                                    f"starts, before its own waits, but {spec.name} is a "
                                                    f"{spec.kind.name.lower()} buffer: only static weights may be "
                                                    "prefetched across an instruction boundary", buffer=spec.name))
            if w is None:
                out.append(Violation("stage", u, f"{_who(p, u)} is the last of SM {s}'s queue but streams {region} "
                                                 "for a next instruction"))
                continue
            reads.append((w, buf, _elem_box(elem, n, spec.shape), u))
            boxed = any(o.buf == buf and o.prefetch and o.reads and not o.writes
                        and _range_in_box(elem, n, spec.shape, o.box) for o in ins[w].operands)
            if not boxed:
                out.append(Violation("stage", u, f"{_who(p, u)} streams {region} for {nxt}, outside every PREFETCH "
                                                 f"operand box #{w} declares", other=w, buffer=spec.name))
            if (buf, elem, chunks) != want:
                out.append(Violation("stage", u, f"{_who(p, u)} streams {region} ({chunks} chunks from element "
                                                 f"{elem}) for {nxt}, but #{w} stages {want} (buffer, element, "
                                                 "chunks): it would compute with other bytes than the rows "
                                                 "it declares",
                                     other=w, buffer=spec.name))
    return out, reads


_MX_COLS_PER_SCALE = MXFP4_GROUP // 2  # code bytes (two E2M1 values each) per E8M0 scale


def _mxfp4_pairs(p: Program) -> list[Violation]:
    """The MXFP4 rule of the module docstring, for every expert opcode of an ``"mxfp4"`` program."""
    if p.expert_format != "mxfp4":
        return []
    out: list[Violation] = []
    bufs = p.buffers
    for i, x in enumerate(p.instructions):
        for j, js in MXFP4_OPERANDS.get(x.op, ()):
            if max(j, js) >= len(x.operands):
                out.append(Violation("mxfp4", i, f"{_who(p, i)} has {len(x.operands)} operands; an MXFP4 program "
                                                 f"declares codes in operand {j} and their scales in operand {js}"))
                continue
            c, sc = x.operands[j], x.operands[js]
            if not (0 <= c.buf < len(bufs) and 0 <= sc.buf < len(bufs)):
                continue  # reported as bounds
            cb, sb = bufs[c.buf], bufs[sc.buf]
            for k, b in ((j, cb), (js, sb)):
                if b.kind != Kind.WEIGHT or b.dtype != torch.uint8:
                    out.append(Violation("mxfp4", i, f"{_who(p, i)} operand {k} ({b.name}) is a "
                                                     f"{str(b.dtype).removeprefix('torch.')} {b.kind.name.lower()} "
                                                     "buffer; MXFP4 codes and scales are uint8 weights",
                                         buffer=b.name))
            if (cb.shape[0], cb.shape[1], cb.shape[2]) != (sb.shape[0], sb.shape[1], sb.shape[2] * _MX_COLS_PER_SCALE):
                out.append(Violation("mxfp4", i, f"{_who(p, i)}: scales {sb.name} {list(sb.shape)} do not match codes "
                                                 f"{cb.name} {list(cb.shape)} (one scale per {_MX_COLS_PER_SCALE} code "
                                                 "bytes)", buffer=sb.name))
                continue
            b0, b1, r0, r1, c0, c1 = c.box
            need = (b0, b1, r0, r1, c0 // _MX_COLS_PER_SCALE, -(-c1 // _MX_COLS_PER_SCALE))
            have = sc.box
            if not all(have[2 * d] <= need[2 * d] and need[2 * d + 1] <= have[2 * d + 1] for d in range(3)):
                out.append(Violation("mxfp4", i, f"{_who(p, i)} reads codes {cb.name}{_box_str(c.box)}, whose scales "
                                                 f"are {sb.name}{_box_str(need)}, but declares only "
                                                 f"{sb.name}{_box_str(have)} (operand {js}): the device would read "
                                                 "scales it does not declare", buffer=sb.name))
    return out


def _peer_rules(p: Program) -> list[Violation]:
    """The protocol's local rules (kernels/contracts/peers.py): a PUSH writes a MAILBOX and needs a peer range
    inside the world; a cross-rank counter has one word per rank and is signalled over a peer range only."""
    out = []
    for i, x in enumerate(p.instructions):
        lo, hi = x.peers
        pushes = [o for o in x.operands if o.mode & Mode.PUSH]
        if (lo, hi) != (0, 0) and not 0 <= lo < hi <= p.world:
            out.append(Violation("peer", i, f"{_who(p, i)} names peer ranks [{lo}, {hi}) outside the world of "
                                            f"{p.world}"))
        for o in pushes:
            if not 0 <= o.buf < len(p.buffers) or p.buffers[o.buf].kind != Kind.MAILBOX or not o.writes:
                out.append(Violation("peer", i, f"{_who(p, i)} pushes operand buffer {o.buf}: only a write to a "
                                                "mailbox may be pushed"))
        if pushes and (lo, hi) == (0, 0):
            out.append(Violation("peer", i, f"{_who(p, i)} pushes with no peer range"))
        if 0 <= x.signal < len(p.counters):
            sources = p.counters[x.signal].sources
            if sources and (sources != p.world or (lo, hi) == (0, 0)):
                out.append(Violation("peer", i, f"{_who(p, i)} signals cross-rank counter "
                                                f"'{p.counters[x.signal].name}' ({sources} sources, world "
                                                f"{p.world}) over peer range [{lo}, {hi})"))
            if not sources and (lo, hi) != (0, 0):
                out.append(Violation("peer", i, f"{_who(p, i)} has a peer range but signals local counter "
                                                f"'{p.counters[x.signal].name}': its peers would never hear of it"))
    return out


def check_program(program: Program | torch.Tensor, extra_signals: dict[int, list[int]] | None = None
                  ) -> list[Violation]:
    """Every violation of the rules in the module docstring, sorted by instruction. Empty list = proven correct
    for one step; with correct per-step totals (checked too) the monotonic targets make every step alike. A rank
    program of several is checked as this rank sees it (its peers' words of a cross-rank counter taken to arrive as
    its own do); :func:`kimik3.megakernel.hazards_ranks.check_deployment` checks the ranks together."""
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
    out.extend(_peer_rules(p))
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
    stage_violations, staged = _stage_reads(p)
    out.extend(stage_violations)
    out.extend(_mxfp4_pairs(p))
    if any(v.kind in ("queue", "bounds") for v in out) or any(v.kind == "counter" and "exist" in v.message
                                                              for v in out):
        return sorted(out, key=lambda v: (v.instr, v.kind))

    # -- counters: declared per-step totals must equal what is signalled (targets are step*total + t)
    hb = HappensBefore(p, extra_signals)
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

    # -- conflicts: every pair of conflicting accesses ordered as in sequential order. An access issued early is
    # ordered only by program order up to its issuer: a prefetch operand by its own instruction, a staged read by
    # the instruction at whose start the device copies it (column ``early``; -1: after the waits).
    early = np.where(pre, oi, -1)
    if staged:
        st = np.array([(v, b, 1, *box, e) for v, b, box, e in staged], dtype=np.int64)
        oi, ob, obox = np.concatenate([oi, st[:, 0]]), np.concatenate([ob, st[:, 1]]), np.concatenate([obox,
                                                                                                       st[:, 3:9]])
        reads, writes = np.concatenate([reads, np.ones(len(st), bool)]), np.concatenate([writes,
                                                                                        np.zeros(len(st), bool)])
        early = np.concatenate([early, st[:, 9]])
        okind = np.concatenate([okind, kinds[st[:, 1]]])
        okbuf = np.concatenate([okbuf, np.ones(len(st), bool)])
    is_staged = np.arange(len(oi)) >= len(tab)
    tracked = okbuf & np.isin(okind, [int(Kind.ACT), int(Kind.STATE), int(Kind.OUTPUT), int(Kind.MAILBOX)])
    seen_pairs: set[tuple[int, int, int]] = set()
    for b in np.unique(ob[tracked]):
        sel = np.flatnonzero(tracked & (ob == b))
        ids, rd, wr, ea, box = oi[sel], reads[sel], writes[sel], early[sel], obox[sel]
        stg = is_staged[sel]
        lo, hi = box[:, 0::2], box[:, 1::2]
        ov = np.all((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]), axis=2)
        conflict = ov & (wr[:, None] | wr[None, :]) & (ids[:, None] < ids[None, :])
        ii, jj = np.nonzero(conflict)  # access ii (earlier instruction) vs jj (later)
        if not len(ii):
            continue
        u, v = ids[ii], ids[jj]
        both = hb.executed[u] & hb.executed[v]
        okay = hb.anc[v, u].copy()
        # a read issued early at the later instruction is ordered by program order (up to its issuer) only
        for k in np.flatnonzero((ea[jj] >= 0) & both):
            okay[k] = bool(hb.base(int(ea[jj[k]]))[u[k]])
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
            how = ""
            if stg[c]:
                how = (f" (streamed into its stage by #{ea[c]} as #{ea[c]} starts, before #{ea[c]}'s waits)"
                       if ea[c] != vv else " (its own stage, copied before its waits)")
            elif ea[c] >= 0:
                how = " (a prefetch, issued before its waits)"
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
