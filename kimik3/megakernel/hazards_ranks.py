"""Prove a deployment's rank programs race- and deadlock-free together: every cross-rank read after its write.

The W programs are merged into one: every rank's buffers, counters (one per word: a cross-rank counter becomes a
counter per source rank) and SM queues side by side, a PUSH operand becomes a write to each destination rank's
copy of the mailbox, and its signal a signal of each destination's word. :func:`~kimik3.megakernel.hazards.
check_program` then proves the merged program for one step (RAW, WAR, WAW across ranks; deadlocks across ranks;
counter totals per word). Two rules only a deployment has are checked on top: every mailbox cell a rank reads is
written in the step (a wrong slot or peer reads stale data), and a read of a peer's cell is over before that peer's
next step rewrites it: the read happens before the end of the writer's step, or the write itself waits on the
reader's rank (so next step, on the reader's next step). Protocol: kernels/contracts/peers.py; the argument:
docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from kimik3.kernels.contracts.peers import counter_words
from kimik3.megakernel.hazards import HappensBefore, Violation, check_program
from kimik3.megakernel.instructions import BufferSpec, Counter, Instruction, Kind, Mode, Operand, Program

__all__ = ["Merged", "merge_ranks", "check_deployment"]


class Merged:
    """The merged program, the extra signals of its pushing instructions and where each instruction came from."""

    def __init__(self, program: Program, extra_signals: dict[int, list[int]], origin: list[tuple[int, int]],
                 nb: int) -> None:
        self.program, self.extra_signals, self.origin, self.nb = program, extra_signals, origin, nb

    def rank_of_buffer(self, b: int) -> tuple[int, int]:
        return divmod(b, self.nb)

    def describe(self, message: str) -> str:
        """A merged-program message with instruction ids as ``rank r #i`` and buffer names as they are."""
        def sub(m: re.Match) -> str:
            r, i = self.origin[int(m.group(1))]
            return f"rank {r} #{i}"
        return re.sub(r"#(\d+)", sub, message)


def _symmetry(programs: list[Program]) -> list[Violation]:
    """The protocol needs the same counter table and the same mailboxes at the same ids on every rank."""
    out = []
    world = len(programs)
    p0 = programs[0]
    for r, p in enumerate(programs):
        if p.world != world or p.rank != r:
            out.append(Violation("protocol", -1, f"program {r} says it is rank {p.rank} of {p.world}, in a "
                                                 f"deployment of {world}"))
        if p.counters != p0.counters:
            out.append(Violation("protocol", -1, f"rank {r}'s counter table differs from rank 0's: a signal to a "
                                                 "peer names the counter by its id"))
        mb = [(i, b) for i, b in enumerate(p.buffers) if b.kind == Kind.MAILBOX]
        mb0 = [(i, b) for i, b in enumerate(p0.buffers) if b.kind == Kind.MAILBOX]
        if mb != mb0:
            out.append(Violation("protocol", -1, f"rank {r}'s mailboxes differ from rank 0's (ids, names or shapes): "
                                                 "a push writes the peer's buffer of the same id"))
    return out


def merge_ranks(programs: list[Program]) -> Merged:
    """Every rank's instructions in one program; sequential order interleaves the ranks instruction by
    instruction (rank programs are built alike, so a producer precedes its consumers on every rank)."""
    world = len(programs)
    nb = max(len(p.buffers) for p in programs)
    buffers: list[BufferSpec] = []
    for r, p in enumerate(programs):
        buffers += [BufferSpec(f"r{r}:{b.name}", b.kind, b.shape, b.dtype) for b in p.buffers]
        buffers += [BufferSpec(f"r{r}:pad{k}", Kind.ACT, (1, 1, 1), p.buffers[0].dtype)
                    for k in range(nb - len(p.buffers))]
    counters: list[Counter] = []
    cid: dict[tuple[int, int, int], int] = {}  # (rank, counter, word) -> merged counter
    for r, p in enumerate(programs):
        for c, ctr in enumerate(p.counters):
            for k in range(counter_words(ctr.sources)):
                cid[(r, c, k)] = len(counters)
                counters.append(Counter(f"r{r}:{ctr.name}" + (f"<-r{k}" if ctr.sources else ""), ctr.total))
    order = sorted(((i, r) for r, p in enumerate(programs) for i in range(len(p.instructions))))
    mid = {(r, i): k for k, (i, r) in enumerate(order)}
    nsm = max(p.num_sms for p in programs)
    instructions: list[Instruction] = []
    extra: dict[int, list[int]] = {}
    for k, (i, r) in enumerate(order):
        p = programs[r]
        x = p.instructions[i]
        lo, hi = x.peers
        dests = [d for d in range(lo, hi) if 0 <= d < world]
        ops, remote = [], []
        for o in x.operands:
            if o.mode & Mode.PUSH:  # the own copy in place (if in range), every other destination appended
                mode = o.mode & ~int(Mode.PUSH)
                ops.append(Operand(o.buf + r * nb, mode if r in dests else int(Mode.READ), o.box))
                remote += [Operand(o.buf + d * nb, mode, o.box) for d in dests if d != r]
            else:
                ops.append(Operand(o.buf + r * nb, o.mode, o.box))
        waits = tuple((cid[(r, c, w)], t) for c, t in x.waits
                      for w in range(counter_words(p.counters[c].sources) if 0 <= c < len(p.counters) else 1)
                      if (r, c, w) in cid)
        signal, more = -1, []
        if 0 <= x.signal < len(p.counters):
            if p.counters[x.signal].sources:
                sig = [cid[(d, x.signal, r)] for d in dests if (d, x.signal, r) in cid]
                signal, more = (sig[0], sig[1:]) if sig else (-1, [])
            else:
                signal = cid[(r, x.signal, 0)]
        if more:
            extra[k] = more
        nbuf, elem, nch = x.next_stage
        instructions.append(replace(x, operands=tuple(ops + remote), waits=waits, signal=signal,
                                    sm=r * nsm + x.sm, next_stage=(nbuf + r * nb if nbuf >= 0 else nbuf, elem, nch),
                                    peers=(0, 0)))
    queues = [[] for _ in range(world * nsm)]
    for r, p in enumerate(programs):
        for s, q in enumerate(p.queues):
            queues[r * nsm + s] = [mid[(r, v)] for v in q if (r, v) in mid]
    p0 = programs[0]
    merged = Program(buffers, instructions, queues, counters, p0.batch, p0.max_seq_len, p0.num_layers, p0.policy,
                     p0.expert_format)
    return Merged(merged, extra, [(r, i) for i, r in order], nb)


def _mailbox_rules(m: Merged, hb: HappensBefore) -> list[Violation]:
    """Reads of cells no rank writes in the step, and reads a peer's next step may overwrite before they happen."""
    p = m.program
    out: list[Violation] = []
    by_rank: dict[int, np.ndarray] = {}
    for v, (r, _) in enumerate(m.origin):
        by_rank.setdefault(r, []).append(v)
    by_rank = {r: np.array(vs) for r, vs in by_rank.items()}
    for b, spec in enumerate(p.buffers):
        if spec.kind != Kind.MAILBOX:
            continue
        owner = m.rank_of_buffer(b)[0]
        accesses = [(v, o) for v, x in enumerate(p.instructions) for o in x.operands if o.buf == b]
        writers = [(v, o) for v, o in accesses if o.writes]
        for v, o in accesses:
            if not o.reads:
                continue
            cover = np.zeros([hi - lo for lo, hi in zip(o.box[0::2], o.box[1::2])], dtype=bool)
            remote: dict[int, list[int]] = {}  # writer rank -> its writers of these cells
            for u, w in writers:
                sl = tuple(slice(max(a0, b0) - a0, min(a1, b1) - a0) for a0, a1, b0, b1 in
                           zip(o.box[0::2], o.box[1::2], w.box[0::2], w.box[1::2]))
                if all(s.start < s.stop for s in sl):
                    if u < v:
                        cover[sl] = True
                    if m.origin[u][0] != owner:
                        remote.setdefault(m.origin[u][0], []).append(u)
            if not cover.all():
                out.append(Violation("mailbox", v, f"#{v} {p.instructions[v].label()} reads {spec.name}{list(o.box)}, "
                                                   f"but {int((~cover).sum())} of its cells are written by no rank "
                                                   "earlier in the step: it reads the previous step's data (a wrong "
                                                   "slot or peer)", buffer=spec.name))
            for r, us in sorted(remote.items()):
                # next step, a write that waits on the reader's rank comes after the reader's whole step
                waits_on_reader = all(hb.anc[u, by_rank[owner]].any() for u in us)
                if hb.executed[v] and not waits_on_reader and not hb.anc[by_rank[r], v].any():
                    out.append(Violation("mailbox", v, f"#{v} {p.instructions[v].label()} reads {spec.name}"
                                                       f"{list(o.box)}, which rank {r} writes, but nothing orders the "
                                                       f"read before the end of rank {r}'s step: rank {r}'s next step "
                                                       "may overwrite it first", buffer=spec.name))
    return out


def check_deployment(programs: list[Program]) -> list[Violation]:
    """Every violation of the deployment's rank programs run together (empty: proven for every step), with
    instructions named ``rank r #i`` (that rank program's instruction ``i``)."""
    if not programs:
        raise ValueError("no rank programs given")
    bad = _symmetry(programs)
    if bad:
        return bad
    m = merge_ranks(programs)
    found = check_program(m.program, m.extra_signals)
    if not any(v.kind in ("queue", "bounds", "deadlock") for v in found):
        found += _mailbox_rules(m, HappensBefore(m.program, m.extra_signals))
    out = []
    for v in found:
        r, i = m.origin[v.instr] if 0 <= v.instr < len(m.origin) else (-1, v.instr)
        other = m.origin[v.other][1] if v.other is not None and 0 <= v.other < len(m.origin) else v.other
        out.append(Violation(v.kind, i, f"rank {r}: " + m.describe(v.message), other, v.buffer))
    return out
