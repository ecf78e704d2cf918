"""Audit the machine code (SASS) of the compiled kernels for what the PTX cannot show (no GPU needed).

ptxas reorders loads, places the fences an acquire or a release needs, may move a load onto the read-only path,
and decides where a warp reconverges; host execution runs lanes in lockstep and sees none of it. Four checks on
the ``nvdisasm`` listing of a cubin (:mod:`kimik3.kernels.verify.sass`), each returning :class:`Finding` s (empty
= pass): :func:`loads_in_flight` (per hot loop, against the unroll the source promises), :func:`fences` (acquire
on every spin exit, a GPU-scope membar before every counter add), :func:`read_only_path` (no more read-only loads
than the PTX's ``ld.global.nc``) and :func:`reconvergence` (no warp-wide instruction where lanes may have
diverged); :func:`audit` runs them on one build. What each check means and why: docs/validation.md (SASS audit);
the PTX rules it complements: docs/architecture.md, appendix "kernels/verify/ptx_lint.py: the PTX rules".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kimik3.kernels.verify import ptx_lint
from kimik3.kernels.verify import sass as S

__all__ = ["Finding", "LoopLoads", "Promise", "loop_loads", "loads_in_flight", "fences", "read_only_path",
           "reconvergence", "divergent_regions", "uniformity", "promises_for", "audit", "format_report",
           "warps_along_x", "CHECKS", "short_name", "main"]

CHECKS = ("loads-in-flight", "fences", "read-only", "reconvergence")


@dataclass(frozen=True)
class Finding:
    check: str
    kernel: str
    function: str
    offset: int
    instruction: str
    message: str

    def __str__(self) -> str:
        fn = "" if self.function == self.kernel else f" [{self.function}]"
        return f"{self.check}: {self.kernel}{fn} /*{self.offset:04x}*/ {self.instruction}: {self.message}"


def short_name(symbol: str) -> str:
    """The kernel symbol without the parameter types the DSL appends."""
    return re.sub(r"_tensorptr.*$", "", symbol)


def _finding(check: str, f: S.Function, ins: S.Instr, message: str) -> Finding:
    return Finding(check, short_name(f.kernel), short_name(f.name), ins.offset, ins.text, message)


# ---------------------------------------------------------------------------------------------- loads in flight
def _is_global_load(ins: S.Instr) -> bool:
    return ins.op in ("LDG", "LD") and bool(ins.operands)


def _is_read_only(ins: S.Instr) -> bool:
    return ins.op in ("LDG", "LD") and "CONSTANT" in ins.mods


def _is_stream_load(ins: S.Instr) -> bool:
    """A 16-byte load through the read-only path: how the kernels stream static weights."""
    return _is_read_only(ins) and "128" in ins.mods


@dataclass
class LoopLoads:
    """One loop as compiled. ``in_flight``: global loads issued (from the header, in address order) before the
    first instruction that reads a destination of one of them; ``stream_in_flight``: the same for the 16-byte
    read-only loads alone (the weight stream), ``first_consumer`` the instruction that ends that count.
    ``innermost``: no loop nested in it issues a 16-byte read-only load (a step loop whose batch rows are an inner
    loop of x loads is the innermost loop of its weight stream)."""

    kernel: str
    function: str
    header: int  # SASS offset of the loop header
    blocks: int
    innermost: bool
    loads: int  # global loads per trip (in the body once)
    stream_loads: int
    in_flight: int
    stream_in_flight: int
    first_consumer: S.Instr | None = field(default=None, repr=False)

    def __str__(self) -> str:
        stop = f", first consumer {self.first_consumer}" if self.first_consumer else ""
        inner = ", innermost" if self.innermost else ""
        return (f"{self.kernel} loop /*{self.header:04x}*/ ({self.blocks} blocks{inner}): {self.loads} global loads "
                f"per trip, {self.in_flight} in flight; 16-byte read-only "
                f"{self.stream_loads} per trip, {self.stream_in_flight} in flight{stop}")


def _in_flight(seq: list[S.Instr], select: Any) -> tuple[int, S.Instr | None]:
    pending: set[str] = set()
    n = 0
    for ins in seq:
        dests, srcs = S.dests_sources(ins)
        if pending.intersection(srcs):
            return n, ins
        if select(ins):
            n += 1
            pending.update(dests)
    return n, None


def loop_loads(f: S.Function) -> list[LoopLoads]:
    """Every loop of a function with its loads per trip and in flight."""
    loops = S.natural_loops(f)
    out = []
    for h, body in loops:
        head = f.blocks[h].start
        order = sorted(body, key=lambda b: (f.blocks[b].start < head, f.blocks[b].start))
        seq = [f.instrs[i] for b in order for i in range(f.blocks[b].start, f.blocks[b].end)]
        nested = set().union(*[b2 for h2, b2 in loops if h2 != h and b2 < body])
        innermost = not any(_is_stream_load(f.instrs[i]) for b in nested
                            for i in range(f.blocks[b].start, f.blocks[b].end))
        n_all, _ = _in_flight(seq, _is_global_load)
        n_ro, stop = _in_flight(seq, _is_stream_load)
        out.append(LoopLoads(short_name(f.kernel), short_name(f.name), f.instrs[head].offset, len(body), innermost,
                             sum(map(_is_global_load, seq)), sum(map(_is_stream_load, seq)), n_all, n_ro, stop))
    return out


@dataclass(frozen=True)
class Promise:
    """A stream depth the source promises: ``loads`` 16-byte read-only loads per lane in flight per loop step."""

    loads: int
    source: str  # where the number is defined


def promises_for(family: str, arch: str, expert_format: str = "dense", batch: int = 1) -> list[Promise]:
    """The weight-stream depths a kernel family's source promises at ``batch`` rows (imported from the constants the
    device code itself uses, so the audit follows them)."""
    if family == "megakernel":
        from kimik3.kernels.contracts.addr import (
            LM_HEAD_MMA,
            gemv_batch_tile,
            gemv_group_passes,
            gemv_mma,
            gemv_mma_unroll,
            gemv_unroll,
        )
        from kimik3.kernels.megakernel import moe as mk_moe

        out = []
        if gemv_mma(batch):  # tensor cores: two weight chunks per k block of a step
            out += [Promise(2 * gemv_mma_unroll(arch, normed, gemv_group_passes(batch, sources)),
                            f"2 x contracts.addr.gemv_mma_unroll({arch!r}, {normed}, passes) (GEMV opcodes, "
                            f"{sources} weight(s))") for normed in (False, True) for sources in (1, 2)]
        if not gemv_mma(batch) or not LM_HEAD_MMA:  # CUDA cores (LM_HEAD at every batch while LM_HEAD_MMA is off)
            bt = gemv_batch_tile(batch)
            out += [Promise(gemv_unroll(arch, bt), f"contracts.addr.gemv_unroll({arch!r}, {bt}) (GEMV opcodes)")]
        if expert_format == "dense":
            out += [Promise(2 * mk_moe.GATE_UP_LOADS, "2 x megakernel.moe.GATE_UP_LOADS (EXPERT_GATE_UP)"),
                    Promise(mk_moe.DOWN_LOADS, "megakernel.moe.DOWN_LOADS (EXPERT_DOWN)")]
        return out
    if family.startswith("gemv.") or family == "router":
        from kimik3.kernels.contracts.meta import GEMV_UNROLL

        return [Promise(GEMV_UNROLL, "contracts.meta.GEMV_UNROLL (fused.gemv.row_dot)")]
    if family in ("moe.bf16", "moe.mxfp4"):
        from kimik3.kernels.fused import moe

        if family == "moe.bf16":
            return [Promise(moe.UNROLL_BF16, "fused.moe.UNROLL_BF16 (down)"),
                    Promise(2 * moe.UNROLL_BF16_GLU, "2 x fused.moe.UNROLL_BF16_GLU (gate/up)")]
        return [Promise(moe.UNROLL_FP4, "fused.moe.UNROLL_FP4 (down)"),
                Promise(2 * moe.UNROLL_FP4_GLU, "2 x fused.moe.UNROLL_FP4_GLU (gate/up)")]
    return []


def loads_in_flight(funcs: list[S.Function], promises: Iterable[Promise]) -> tuple[list[Finding], list[LoopLoads]]:
    """Every innermost loop (:class:`LoopLoads`) whose trip issues at least as many 16-byte read-only loads as a
    promised depth keeps that many in flight before the first of them is consumed (the deepest promise the trip
    covers applies).
    Returns the findings and the per-loop table."""
    promises = sorted(promises, key=lambda p: p.loads)
    findings, table = [], []
    for f in funcs:
        for lp in loop_loads(f):
            table.append(lp)
            due = [p for p in promises if p.loads <= lp.stream_loads]
            if not lp.innermost or not due or lp.stream_in_flight >= due[-1].loads:
                continue
            depth = due[-1].loads
            why = "; ".join(p.source for p in due if p.loads == depth)
            where = lp.first_consumer or f.instrs[f.index_at(lp.header)]
            findings.append(_finding(
                "loads-in-flight", f, where,
                f"loop /*{lp.header:04x}*/ issues {lp.stream_loads} 16-byte read-only loads per trip but only "
                f"{lp.stream_in_flight} before this instruction consumes one; {depth} promised in flight ({why}); "
                f"{lp.in_flight} global loads of any kind in flight"))
    return findings, table


# ---------------------------------------------------------------------------------------------- fences
def _is_poll(ins: S.Instr) -> bool:
    return ins.op in ("LDG", "LD") and ("STRONG" in ins.mods or "VOLATILE" in ins.mods)


def _is_fence(ins: S.Instr) -> bool:
    return (ins.op == "CCTL" and "IVALL" in ins.mods) or ins.op in ("MEMBAR", "FENCE")


def _is_gpu_fence(ins: S.Instr) -> bool:
    return (ins.op == "MEMBAR" and any(m in ins.mods for m in ("GPU", "SYS", "SC"))) or (
        ins.op == "FENCE" and any(m in ins.mods for m in ("GPU", "SYS")))


def _is_global_write(ins: S.Instr) -> bool:
    return ins.op in ("STG", "ST", "RED", "REDG", "ATOM", "ATOMG", "LDGSTS")


def _is_counter_add(ins: S.Instr) -> bool:
    return ins.op in ("RED", "REDG", "ATOM", "ATOMG") and ("ADD" in ins.mods or "INC" in ins.mods)


def _reaching_defs(f: S.Function, at: int, reg: str, within: set[int]) -> list[int]:
    """Instructions (inside the blocks ``within``) whose write of ``reg`` may reach instruction ``at``."""
    out, seen = [], set()
    stack = [(f.block_of(at).index, at - 1)]
    while stack:
        b, i = stack.pop()
        blk = f.blocks[b]
        stop = False
        while i >= blk.start:
            if reg in S.dests_sources(f.instrs[i])[0]:
                out.append(i)
                if f.instrs[i].pred is None:  # an unguarded write ends the search on this path
                    stop = True
                    break
            i -= 1
        if stop:
            continue
        for p in blk.pred:
            if p in within and p not in seen:
                seen.add(p)
                stack.append((p, f.blocks[p].end - 1))
    return out


def _slice_loads(f: S.Function, roots: list[int], within: set[int]) -> set[int]:
    """Loads (inside ``within``) whose values flow into the registers the instructions ``roots`` read."""
    loads, seen = set(), set()
    work = [(i, r) for i in roots for r in S.dests_sources(f.instrs[i])[1]]
    while work:
        i, r = work.pop()
        if (i, r) in seen:
            continue
        seen.add((i, r))
        for d in _reaching_defs(f, i, r, within):
            ins = f.instrs[d]
            if _is_global_load(ins):
                loads.add(d)
            else:
                work.extend((d, s) for s in S.dests_sources(ins)[1])
    return loads


def _ordered_after(f: S.Function, i: int) -> bool:
    """On every path from load ``i``, a fence (``CCTL.IVALL``, ``MEMBAR``, ``FENCE``) comes before the first read
    of the loaded register (what ``ld.acquire`` compiles to)."""
    dest = set(S.dests_sources(f.instrs[i])[0])
    stack, seen = [i + 1], set()
    while stack:
        j = stack.pop()
        if j in seen or j >= len(f.instrs):
            continue
        seen.add(j)
        ins = f.instrs[j]
        if _is_fence(ins) and ins.pred in (None, f.instrs[i].pred):
            continue
        if dest.intersection(S.dests_sources(ins)[1]) or len(seen) > 256:
            return False
        blk = f.block_of(j)
        if j == blk.end - 1:
            stack.extend(f.blocks[s].start for s in blk.succ)
            if not blk.succ:
                return False
        else:
            stack.append(j + 1)
    return True


def _fenced_before(f: S.Function, i: int) -> bool:
    """On every path into instruction ``i``, a GPU-scope fence under the same guard (or none) follows the last
    global write."""
    guard = f.instrs[i].pred
    stack, seen = [(f.block_of(i).index, i - 1)], set()
    while stack:
        b, j = stack.pop()
        blk = f.blocks[b]
        done = False
        while j >= blk.start:
            ins = f.instrs[j]
            if _is_gpu_fence(ins) and ins.pred in (None, guard):
                done = True
                break
            if _is_global_write(ins):
                return False
            j -= 1
        if done:
            continue
        if not blk.pred:
            return False
        for p in blk.pred:
            if p not in seen:
                seen.add(p)
                stack.append((p, f.blocks[p].end - 1))
    return True


def fences(funcs: list[S.Function], ptx: str | None = None) -> list[Finding]:
    """Every spin loop (a loop that polls memory with a strong load or backs off with ``NANOSLEEP``) leaves on a
    polled value read with acquire order, and every global counter add is preceded by a GPU-scope membar on every
    path from the last global write; with ``ptx``, the SASS holds no fewer fenced adds than the PTX has release
    adds."""
    out: list[Finding] = []
    fenced_adds = 0
    for f in funcs:
        loops = S.natural_loops(f)
        for h, body in loops:
            # a spin loop polls or sleeps in its own body, not only in a loop nested in it
            inner = set().union(*(b2 for h2, b2 in loops if h2 != h and b2 < body))
            own = [f.instrs[i] for b in sorted(body - inner) for i in range(f.blocks[b].start, f.blocks[b].end)]
            sleeps = any(ins.op == "NANOSLEEP" for ins in own)
            if not sleeps and not any(map(_is_poll, own)):
                continue
            exits = [f.blocks[b].end - 1 for b in body if any(s not in body for s in f.blocks[b].succ)
                     or h in f.blocks[b].succ]
            polls = sorted(d for d in _slice_loads(f, exits, body) if _is_poll(f.instrs[d]))
            head = f.instrs[f.blocks[h].start]
            if not polls:
                if sleeps:
                    out.append(_finding("fences", f, head, f"spin loop /*{head.offset:04x}*/ backs off but its exit "
                                        f"reads no polled (strong) load"))
                continue
            if not any(_ordered_after(f, d) for d in polls):
                for d in polls:
                    out.append(_finding("fences", f, f.instrs[d], f"spin loop /*{head.offset:04x}*/ leaves on this "
                                        f"poll without acquire order (no CCTL.IVALL / MEMBAR / FENCE before its "
                                        f"value is used)"))
        for i, ins in enumerate(f.instrs):
            if _is_counter_add(ins):
                if _fenced_before(f, i):
                    fenced_adds += 1
                else:
                    out.append(_finding("fences", f, ins, "counter add without a GPU-scope MEMBAR after the last "
                                        "global write on every path (a release needs one)"))
    if ptx is not None:
        want = len(re.findall(r"^\s*(?:@!?%\w+\s+)?(?:red|atom)\.release\.(?:gpu|sys)\.global\.(?:\w+\.)*?add\b",
                              ptx, re.M))
        if fenced_adds < want and funcs:
            f = funcs[0]
            out.append(_finding("fences", f, f.instrs[0], f"the PTX has {want} release add(s), the SASS only "
                                f"{fenced_adds} fenced counter add(s)"))
    return out


# ---------------------------------------------------------------------------------------------- read-only path
def _sass_bytes(ins: S.Instr) -> int:
    for m, n in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if m in ins.mods:
            return n
    return 4


def read_only_path(funcs: list[S.Function], ptx: str) -> list[Finding]:
    """Per access width, the SASS loads through the read-only path (``.CONSTANT``) are no more than the PTX's
    ``ld.global.nc`` of that width: ptxas did not put a buffer the PTX reads coherently on the non-coherent path."""
    want: Counter[int] = Counter()
    for line in ptx.splitlines():
        m = re.match(r"^\s*(?:@!?%\w+\s+)?(ld\.global\.nc[\w:.]*)\s", line)
        if m:
            w = ptx_lint.global_load_bytes(line)
            want[w[0] if w else 0] += 1
    got: dict[int, list[tuple[S.Function, S.Instr]]] = {}
    for f in funcs:
        for ins in f.instrs:
            if _is_read_only(ins):
                got.setdefault(_sass_bytes(ins), []).append((f, ins))
    out = []
    for width, hits in sorted(got.items()):
        if len(hits) > want[width]:
            f, ins = hits[-1]
            where = ", ".join(f"/*{i.offset:04x}*/" for _, i in hits[:12]) + (" ..." if len(hits) > 12 else "")
            out.append(_finding("read-only", f, ins, f"{len(hits)} {width}-byte read-only loads in the SASS, "
                                f"{want[width]} ld.global.nc of that width in the PTX (SASS: {where})"))
    return out


# ---------------------------------------------------------------------------------------------- reconvergence
_VARYING_SR = re.compile(r"SR_(TID|LANEID|[LG][TE]MASK|EQMASK|VIRTID)")
_WARP_WIDE = {"SHFL", "VOTE", "MATCH", "REDUX", "HMMA", "IMMA", "DMMA", "HGMMA", "LDSM", "MOVM", "BAR",
              "WARPSYNC"}


def _varying_result(ins: S.Instr, nonuni: set[str], tid: set[str]) -> bool | None:
    """True / False when the opcode alone decides whether its result differs between lanes, else None. ``tid``:
    registers holding ``threadIdx.x`` (a warp's lanes are consecutive in x: the blocks are 1-D, multiples of 32)."""
    if ins.op in ("S2R", "CS2R") and any(_VARYING_SR.search(o) for o in ins.operands):
        return True
    if ins.op in ("ATOM", "ATOMG", "ATOMS", "MATCH", "LDL", "LDSM", "HMMA", "IMMA", "DMMA"):
        return True
    if ins.op == "SHFL":
        # an index shuffle over the whole warp from one lane hands every lane the same value
        whole = len(ins.operands) >= 5 and ins.operands[4] == "0x1f"
        if "IDX" in ins.mods and whole:
            return bool(nonuni.intersection(S.regs_of(ins.operands[3])))
        return True
    if ins.op in ("VOTE", "REDUX"):
        return False
    ops = ins.operands
    if ins.op == "SHF" and "R" in ins.mods and "HI" in ins.mods and len(ops) == 4 and ops[1] == "RZ" and (
            ops[3].split(".")[0] in tid and ops[2].startswith("0x") and int(ops[2], 16) >= 5):
        return False  # threadIdx.x >> 5 or more: the warp index
    if ins.op == "LEA" and "HI" in ins.mods and len(ops) == 5 and ops[1].split(".")[0] in tid and ops[3] == "RZ" and (
            ops[4].startswith("0x") and 32 - int(ops[4], 16) >= 5):
        return bool(nonuni.intersection(S.regs_of(ops[2])))  # (threadIdx.x >> 5 or more) + b
    if ins.op == "LOP3" and len(ops) >= 5 and ops[1].split(".")[0] in tid and ops[2].startswith("0x") and (
            ops[3] == "RZ" and ops[4] == "0xc0" and int(ops[2], 16) & 31 == 0):
        return False  # threadIdx.x & ~31
    if ins.op == "ISETP" and len(ops) == 5 and ops[2].split(".")[0] in tid and ops[3].startswith("0x") and (
            not nonuni.intersection(S.regs_of(ops[4]))):
        c = int(ops[3], 16)
        edge = {"GT": c + 1, "LE": c + 1, "GE": c, "LT": c}.get(ins.mods[0])
        if edge is not None and edge % 32 == 0:
            return False  # threadIdx.x against a multiple of 32: whole warps on each side
    return None


_ALL = 0xFFFFFFFF


def _bit_mask(ins: S.Instr, cur: dict[str, int]) -> tuple[str, int] | None:
    """(destination, varying bits) of a LOP3 that ands / ors a register with a constant (how ptxas packs
    predicates into the bits of a register, and tests them), else None."""
    ops = ins.operands
    if ins.op != "LOP3" or len(ops) < 6 or ops[-2] not in ("0xc0", "0xfc"):
        return None
    if _PRED_OP.match(ops[0]) and ops[1] == "RZ" and ops[3].startswith("0x") and ops[4] == "RZ":
        src, imm, dest = ops[2].split(".")[0], int(ops[3], 16), ops[0]  # P = (R op imm) != 0
    elif re.match(r"^R\d+$", ops[0]) and ops[2].startswith("0x") and ops[3] == "RZ":
        src, imm, dest = ops[1].split(".")[0], int(ops[2], 16), ops[0]
    else:
        return None
    kept = cur.get(src, 0) & (imm if ops[-2] == "0xc0" else ~imm & _ALL)
    if _PRED_OP.match(dest):  # the predicate is "any bit set": a set constant bit makes an or always true
        return dest, _ALL if kept and (ops[-2] == "0xc0" or not imm) else 0
    return dest, kept


_PRED_OP = re.compile(r"^P\d+$")


def _transfer(ins: S.Instr, cur: dict[str, int], tid: set[str], diverged: bool, warp_x: bool,
              guarded: dict[str, str] | None = None) -> None:
    """Update the varying bits of each register ``cur`` (absent: uniform) and the thread-index copies ``tid`` over
    one instruction. ``guarded`` (within a block): registers a write under a uniform guard left uniform whenever
    that guard holds (register -> the guard, ``@P3`` / ``@!P3``), so an instruction under the same guard, not
    redefined since, reads them as uniform (``@P3 LDS R0, [..]`` then ``@P3 LOP3 R1, R0, ..``)."""
    dests, srcs = S.dests_sources(ins)
    dests = [d for d in dests if not d.startswith("U")]
    if guarded is not None:  # a redefined guard ends the facts it carried
        for r in [r for r, g in guarded.items() if g.lstrip("@!") in dests or r in dests]:
            del guarded[r]
    if not dests:
        return
    guard = ins.pred.lstrip("@!") if ins.pred else None
    view = cur
    if guarded and ins.pred:
        view = {r: m for r, m in cur.items() if guarded.get(r) != ins.pred}
    packed = _bit_mask(ins, view)
    masks: dict[str, int]
    if packed is not None:
        masks = {d: 0 for d in dests}
        masks[packed[0]] = packed[1]
    else:
        fixed = _varying_result(ins, set(view), tid)
        vary = fixed if fixed is not None else any(view.get(r) for r in srcs)
        masks = {d: _ALL if vary else 0 for d in dests}
    if diverged or (guard and cur.get(guard)):
        masks = {d: _ALL for d in dests}
    if guarded is not None and guard and ins.pred not in ("@PT", "@!PT"):
        guarded.update({d: ins.pred for d, m in masks.items() if not m and d != guard})
    is_tid = warp_x and ins.pred is None and (
        (ins.op == "S2R" and ins.operands[1:] == ["SR_TID.X"])
        or (ins.op in ("MOV", "IMAD") and ins.operands[1:] in (srcs[:1], ["RZ", "RZ", srcs[0] if srcs else ""])
            and srcs[:1] and srcs[0] in tid))
    tid.difference_update(dests)
    if is_tid:
        tid.update(dests)
    for d, m in masks.items():
        m |= cur.get(d, 0) if ins.pred is not None else 0  # a guarded write keeps the old value on some lanes
        if m:
            cur[d] = m
        else:
            cur.pop(d, None)


def _join(into: dict[str, int], other: dict[str, int]) -> bool:
    changed = False
    for r, m in other.items():
        if into.get(r, 0) | m != into.get(r, 0):
            into[r] = into.get(r, 0) | m
            changed = True
    return changed


def uniformity(f: S.Function, divergent_blocks: set[int], warp_x: bool = True
               ) -> tuple[list[dict[str, int]], list[set[str]]]:
    """(per block, the R/P registers that may differ between the lanes of a warp on entry, with the bits that may:
    thread-varying sources (thread and lane ids, shuffles, atomics), loads from varying addresses, anything
    computed from those or under a varying guard, and every register written in ``divergent_blocks``; per block,
    the registers holding threadIdx.x on entry). Uniform registers (UR/UP), constants and the warp index
    (threadIdx.x >> 5, with ``warp_x``: the block's x extent is a multiple of 32) do not vary."""
    n = len(f.blocks)
    state_in: list[dict[str, int]] = [{} for _ in range(n)]
    tid_in: list[set[str] | None] = [None] * n
    tid_in[0] = set()
    rank = {b: k for k, b in enumerate(S.reverse_postorder(f))}
    work = {0}
    while work:  # a worklist in reverse post-order: a block is redone only when what flows into it grew
        b = min(work, key=rank.__getitem__)
        work.discard(b)
        blk = f.blocks[b]
        cur, tid, guarded = dict(state_in[b]), set(tid_in[b] or ()), {}
        for i in range(blk.start, blk.end):
            _transfer(f.instrs[i], cur, tid, b in divergent_blocks, warp_x, guarded)
        for s in blk.succ:
            grew = _join(state_in[s], cur)
            new_tid = set(tid) if tid_in[s] is None else tid_in[s] & tid
            if grew or new_tid != tid_in[s]:
                tid_in[s] = new_tid
                work.add(s)
    return state_in, [t or set() for t in tid_in]


def _guard_and_cond(ins: S.Instr) -> list[str]:
    regs = [ins.pred.lstrip("@!")] if ins.pred and ins.pred.lstrip("@!") not in ("PT", "UPT") else []
    if ins.op == "BRA":
        regs += [o.lstrip("!") for o in ins.operands if re.fullmatch(r"!?U?P\d+", o)]
    elif ins.op in ("BRX", "JMX") and ins.operands:
        regs += S.regs_of(ins.operands[0])
    return regs


def _nonuniform_at(f: S.Function, state: tuple[list[dict[str, int]], list[set[str]]], i: int,
                   diverged: bool, warp_x: bool) -> set[str]:
    """The registers that may vary between lanes just before instruction ``i``."""
    blk = f.block_of(i)
    cur, tid, guarded = dict(state[0][blk.index]), set(state[1][blk.index]), {}
    for j in range(blk.start, i):
        _transfer(f.instrs[j], cur, tid, diverged, warp_x, guarded)
    return set(cur)


def divergent_regions(f: S.Function, warp_x: bool = True) -> dict[int, set[int]]:
    """Divergent branches (by block) with the blocks lanes may run apart in: from the branch to its immediate
    post-dominator, or to the end for a lane-dependent exit."""
    pdom = S.post_dominators(f)
    div_blocks: set[int] = set()
    while True:  # divergent regions only grow (values written in them vary): a fixed point within len(blocks)
        state = uniformity(f, div_blocks, warp_x)
        new: dict[int, set[int]] = {}
        for blk in f.blocks:
            last = f.instrs[blk.end - 1]
            branchy = last.op in ("BRA", "BRX", "JMX") and S.is_conditional(last) or last.op in ("BRX", "JMX")
            leaves = last.op in ("EXIT", "RET", "KILL") and last.pred not in (None, "@PT")
            if not (branchy or leaves) or "DIV" in last.mods or "U" in last.mods:
                continue
            regs = _guard_and_cond(last)
            if not _nonuniform_at(f, state, blk.end - 1, blk.index in div_blocks, warp_x).intersection(regs):
                continue
            # lanes that leave never come back: the rest of the function runs on part of the warp
            ipdom = None if leaves else _nearest(f, blk.index, pdom[blk.index] & ~(1 << blk.index))
            region, stack = set(), list(blk.succ)
            while stack:
                x = stack.pop()
                if x == ipdom or x in region:
                    continue
                region.add(x)
                stack.extend(f.blocks[x].succ)
            new[blk.index] = region
        merged = div_blocks.union(*new.values())
        if merged == div_blocks:
            return new
        div_blocks = merged


def _nearest(f: S.Function, b: int, pdoms: int) -> int | None:
    """The immediate post-dominator of block ``b`` among the bit set ``pdoms``: the first one a walk reaches."""
    if not pdoms:
        return None
    frontier, seen = list(f.blocks[b].succ), set()
    while frontier:
        nxt = []
        for x in frontier:
            if pdoms >> x & 1:
                return x
            if x not in seen:
                seen.add(x)
                nxt.extend(f.blocks[x].succ)
        frontier = nxt
    return None


def reconvergence(funcs: list[S.Function], warp_x: bool = True) -> list[Finding]:
    """No warp-wide instruction (shuffle, vote, match, redux, mma, ldmatrix, barrier, warpsync) is reachable
    between a branch on a lane-dependent value and the point where its paths meet again (its immediate
    post-dominator; never, after a lane-dependent exit). ``warp_x``: the block's x extent is a multiple of 32, so
    ``threadIdx.x >> 5`` is the same on all lanes of a warp."""
    out = []
    for f in funcs:
        regions = divergent_regions(f, warp_x)
        flagged: dict[int, int] = {}
        for b, region in sorted(regions.items()):
            for x in region:
                for i in range(f.blocks[x].start, f.blocks[x].end):
                    if f.instrs[i].op in _WARP_WIDE and i not in flagged:
                        flagged[i] = b
        for i, b in sorted(flagged.items()):
            br = f.instrs[f.blocks[b].end - 1]
            out.append(_finding("reconvergence", f, f.instrs[i], f"warp-wide instruction reachable after the "
                                f"lane-dependent branch /*{br.offset:04x}*/ {br.text} before its paths reconverge"))
    return out


def warps_along_x(ptx: str) -> bool:
    """Every entry of the PTX declares ``.reqntid`` with an x extent that is a multiple of 32."""
    found = re.findall(r"\.reqntid\s+(\d+)", ptx)
    entries = len(re.findall(r"^\s*(?:\.visible\s+)?\.entry\s", ptx, re.M))
    return bool(found) and len(found) == entries and all(int(x) % 32 == 0 for x in found)


# ---------------------------------------------------------------------------------------------- all checks
def audit(result: Any, *, sass_text: str | None = None, family: str | None = None,
          expert_format: str | None = None) -> dict[str, Any]:
    """All four checks on one build (a ``toolchain.build.BuildResult``): ``{check: [Finding, ...]}`` plus
    ``"loops"``, the per-loop table. ``sass_text`` replaces the cubin's listing (a planted violation); the family
    and expert format (which promises apply) default to those in the build's variant name."""
    text = sass_text if sass_text is not None else S.disassemble(result.cubin)
    funcs = S.parse(text)
    fam = family or result.name.split("/", 1)[0]
    fmt = expert_format or (result.name.rsplit("-", 1)[1] if re.search(r"/b\d+-\w+$", result.name) else "dense")
    ptx = result.ptx
    batch = int((result.shapes or {}).get("B", 1))
    lif, table = loads_in_flight(funcs, promises_for(fam, result.arch, fmt, batch))
    return {"loads-in-flight": lif, "fences": fences(funcs, ptx), "read-only": read_only_path(funcs, ptx),
            "reconvergence": reconvergence(funcs, warps_along_x(ptx)), "loops": table}


def format_report(report: dict[str, Any], *, loops: bool = True) -> str:
    """The findings of :func:`audit`, then (``loops``) its per-loop table of loads per trip and in flight."""
    lines = [str(x) for c in CHECKS for x in report[c]] or ["no findings"]
    if loops:
        lines += [str(lp) for lp in report["loops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.sass_audit VARIANT [--arch sm_90a]``: build (or load from the disk
    cache) and audit one registry variant; exit 1 when there are findings."""
    import argparse

    from kimik3.kernels.toolchain import build as B
    from kimik3.kernels.toolchain import registry as R

    ap = argparse.ArgumentParser(prog="python -m kimik3.kernels.verify.sass_audit", description=main.__doc__)
    ap.add_argument("variant", help="a registry variant name, e.g. megakernel/tiny/b1 or gemv.plain/k3-shard/b8")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--no-loops", action="store_true", help="findings only, no per-loop table")
    args = ap.parse_args(argv)
    report = audit(B.build(R.get_variant(args.variant), args.arch))
    print(format_report(report, loops=not args.no_loops))
    return 1 if any(report[c] for c in CHECKS) else 0


if __name__ == "__main__":
    raise SystemExit(main())
