"""Lint compiled PTX for the synchronisation and streaming rules the device code relies on (no GPU needed).

A wrong fence, a spin without back-off or a narrow weight copy compiles and passes every CPU test; on a GPU it is
a rare hang, a stale read or a slow kernel. These rules read the PTX the DSL emitted (the code that will run) as a
control-flow graph of basic blocks, so they hold on every path, not on the text order of one:

* ``release-after-barrier`` — every counter signal (a global ``red``/``atom`` add) is a *release at GPU scope*, and on
  every path to it a CTA barrier follows the last global write: the one thread that signals publishes the whole
  CTA's output, so all of it must be ordered before the release.
* ``acquire-spin`` — every loop that polls global memory with an ordered load (acquire/relaxed/volatile) spins on an
  acquire load at GPU scope (so the consumer's later reads see the producer's writes) and backs off (``nanosleep``)
  instead of hammering the memory system.
* ``occupancy`` — registers x threads and shared memory leave room for ``ceil(grid / SMs)`` CTAs per SM; a
  persistent kernel whose CTAs are not all resident deadlocks on its own counters.
* ``cooperative-launch`` — the host launch of a persistent kernel asks for a cooperative launch (which fails instead
  of under-scheduling when the grid cannot be co-resident).
* ``wide-weight-copies`` — asynchronous global→shared copies move 16 bytes each (``cp.async.cg ... 16``): a narrower
  copy needs 2-4x the instructions for the same bytes in flight.

Each rule returns a list of human-readable violations (empty = pass); :func:`lint` runs them all.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ArchLimits", "LIMITS", "BasicBlock", "parse_blocks", "natural_loops", "release_after_barrier",
           "acquire_spin", "occupancy", "cooperative_launch", "wide_weight_copies", "lint"]


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM resources (CUDA programming guide, compute capability 9.0 / 10.0 tables)."""

    registers: int = 65536
    threads: int = 2048
    shared_bytes: int = 228 * 1024
    reserved_shared_per_cta: int = 1024
    register_granularity: int = 8  # registers per thread are allocated in warp-wide units of 256


LIMITS = {"sm_90a": ArchLimits(), "sm_100a": ArchLimits()}

_LABEL = re.compile(r"^\s*(\$?[\w$]+):\s*$")
_BRANCH = re.compile(r"^\s*(@!?%\w+\s+)?bra(\.uni)?\s+(\$?[\w$]+)\s*;")
_EXIT = re.compile(r"^\s*(@!?%\w+\s+)?(ret|exit|trap)\b")
_BARRIER = re.compile(r"^\s*(@!?%\w+\s+)?(bar\.sync|barrier\.sync|barrier\.cta\.sync|bar\.cta\.sync)\b")
_GLOBAL_WRITE = re.compile(r"^\s*(@!?%\w+\s+)?(st\.(?:\w+\.)*global|red\.(?:\w+\.)*global|atom\.(?:\w+\.)*global|"
                           r"st\.global|cp\.async\.bulk\.global)")
_SIGNAL = re.compile(r"^\s*(@!?%\w+\s+)?(red|atom)\.((?:\w+\.)*)global\.(?:\w+\.)*?add\b")
_ORDERED_LOAD = re.compile(r"^\s*(@!?%\w+\s+)?ld\.(acquire|relaxed|volatile)\.(?:(\w+)\.)?global")
_CP_ASYNC = re.compile(r"^\s*(@!?%\w+\s+)?cp\.async\.(ca|cg)\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(\d+)")


@dataclass
class BasicBlock:
    index: int
    label: str | None
    lines: list[tuple[int, str]] = field(default_factory=list)  # (1-based PTX line, text)
    succ: list[int] = field(default_factory=list)
    pred: list[int] = field(default_factory=list)


def _entry_bodies(ptx: str) -> list[list[tuple[int, str]]]:
    """The instruction lines of each ``.entry`` body (between its opening brace and the matching closing one)."""
    bodies: list[list[tuple[int, str]]] = []
    cur: list[tuple[int, str]] | None = None
    in_entry, depth = False, 0
    for no, line in enumerate(ptx.splitlines(), 1):
        s = line.split("//", 1)[0].strip()
        if not in_entry:
            in_entry = bool(re.match(r"(\.visible\s+)?\.entry\b", s))
            depth = 0
            cur = None
            if not in_entry:
                continue
        opened = s.count("{")
        if cur is None and not opened:
            continue
        if cur is None:
            cur = []
        depth += opened - s.count("}")
        if s and s not in ("{", "}"):
            cur.append((no, s))
        if depth == 0:
            bodies.append(cur)
            in_entry, cur = False, None
    return bodies


def parse_blocks(ptx: str) -> list[BasicBlock]:
    """Basic blocks of the first kernel entry with their successor and predecessor edges."""
    bodies = _entry_bodies(ptx)
    if not bodies:
        raise ValueError("no .entry function found in the PTX")
    blocks: list[BasicBlock] = [BasicBlock(0, None)]
    for no, s in bodies[0]:
        m = _LABEL.match(s)
        if m:
            if blocks[-1].lines or blocks[-1].label is not None:
                blocks.append(BasicBlock(len(blocks), m.group(1)))
            else:
                blocks[-1].label = m.group(1)
            continue
        blocks[-1].lines.append((no, s))
        if _BRANCH.match(s) or _EXIT.match(s):
            blocks.append(BasicBlock(len(blocks), None))
    blocks = [b for b in blocks if b.lines or b.label is not None]
    for i, b in enumerate(blocks):
        b.index = i
    by_label = {b.label: b.index for b in blocks if b.label}
    for b in blocks:
        last = b.lines[-1][1] if b.lines else ""
        br, ex = _BRANCH.match(last), _EXIT.match(last)
        if br:
            target = br.group(3)
            if target not in by_label:
                raise ValueError(f"branch to unknown label {target}")
            b.succ.append(by_label[target])
            if br.group(1) and b.index + 1 < len(blocks):  # predicated: may fall through
                b.succ.append(b.index + 1)
        elif ex:
            if ex.group(1) and b.index + 1 < len(blocks):
                b.succ.append(b.index + 1)
        elif b.index + 1 < len(blocks):
            b.succ.append(b.index + 1)
    for b in blocks:
        for s in b.succ:
            blocks[s].pred.append(b.index)
    return blocks


def _dominators(blocks: list[BasicBlock]) -> list[set[int]]:
    n = len(blocks)
    every = set(range(n))
    dom = [every.copy() for _ in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in blocks[1:]:
            preds = [dom[p] for p in b.pred]
            new = (set.intersection(*preds) if preds else set()) | {b.index}
            if new != dom[b.index]:
                dom[b.index], changed = new, True
    return dom


def natural_loops(blocks: list[BasicBlock]) -> list[tuple[int, set[int]]]:
    """(header, body blocks) of every natural loop: a back edge u -> h where h dominates u."""
    dom = _dominators(blocks)
    loops = []
    for u in blocks:
        for h in u.succ:
            if h in dom[u.index]:
                body, stack = {h, u.index}, [u.index]
                while stack:
                    x = stack.pop()
                    for p in blocks[x].pred:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                loops.append((h, body))
    return loops


def release_after_barrier(ptx: str) -> list[str]:
    """Every global add is a GPU-scope release reached, on every path, through a barrier after the last write."""
    blocks = parse_blocks(ptx)
    problems = []
    # must-analysis: fenced[b] = on every path into b, a barrier follows the last global write
    fenced_in = [True] * len(blocks)
    fenced_in[0] = False

    def transfer(b: BasicBlock, state: bool, report: bool) -> bool:
        for no, s in b.lines:
            sig = _SIGNAL.match(s)
            if sig:
                sem = sig.group(3)
                if report and ("release" not in sem or "gpu" not in sem):
                    problems.append(f"line {no}: counter signal is not a release at GPU scope: {s}")
                if report and not state:
                    problems.append(f"line {no}: counter signal not preceded by a CTA barrier on every path "
                                    f"after the last global write: {s}")
                state = False  # the signal itself is a global write
            elif _BARRIER.match(s):
                state = True
            elif _GLOBAL_WRITE.match(s):
                state = False
        return state

    changed = True
    while changed:
        changed = False
        for b in blocks:
            if b.index:
                new = all(transfer(blocks[p], fenced_in[p], False) for p in b.pred) if b.pred else False
                if new != fenced_in[b.index]:
                    fenced_in[b.index], changed = new, True
    for b in blocks:
        transfer(b, fenced_in[b.index], True)
    return problems


def acquire_spin(ptx: str) -> list[str]:
    """Every loop polling global memory with an ordered load spins on a GPU-scope acquire and backs off."""
    blocks = parse_blocks(ptx)
    problems = []
    for _header, body in natural_loops(blocks):
        lines = [(no, s) for i in sorted(body) for no, s in blocks[i].lines]
        polls = [(no, s) for no, s in lines if _ORDERED_LOAD.match(s)]
        if not polls:
            continue
        first = min(no for no, _ in lines) if lines else 0
        acquires = [s for _, s in polls if _ORDERED_LOAD.match(s).group(2) == "acquire"
                    and _ORDERED_LOAD.match(s).group(3) == "gpu"]
        if not acquires:
            problems.append(f"loop at line {first}: polls global memory without a GPU-scope acquire load "
                            f"({polls[0][1]})")
        if not any("nanosleep" in s for _, s in lines):
            problems.append(f"loop at line {first}: spins on {polls[0][1]!r} with no back-off (nanosleep)")
    return problems


def _reqntid(ptx: str) -> int | None:
    m = re.search(r"\.reqntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", ptx)
    if not m:
        return None
    return math.prod(int(x) for x in m.groups() if x)


def occupancy(ptx: str, registers: int, shared_bytes: int, grid: int, num_sms: int, arch: str,
              threads: int | None = None) -> list[str]:
    """``ceil(grid / num_sms)`` CTAs fit on one SM by registers, threads and shared memory."""
    lim = LIMITS.get(arch)
    if lim is None:
        raise ValueError(f"no per-SM limits recorded for {arch!r} (known: {sorted(LIMITS)})")
    threads = threads or _reqntid(ptx)
    if not threads:
        return ["the kernel declares no .reqntid: its threads per CTA cannot be checked"]
    need = math.ceil(grid / num_sms)
    regs = math.ceil(max(registers, 1) / lim.register_granularity) * lim.register_granularity
    fit_regs = lim.registers // (regs * threads)
    fit_threads = lim.threads // threads
    fit_smem = lim.shared_bytes // (shared_bytes + lim.reserved_shared_per_cta) if shared_bytes else need
    fits = min(fit_regs, fit_threads, fit_smem)
    if fits < need:
        return [f"{need} CTA(s) per SM needed (grid {grid} on {num_sms} SMs) but only {fits} fit: "
                f"registers {regs}x{threads} -> {fit_regs}, threads -> {fit_threads}, "
                f"shared {shared_bytes} B -> {fit_smem}"]
    return []


def cooperative_launch(source: str | Path, function: str) -> list[str]:
    """The ``.launch(...)`` inside ``function`` of a kernel module passes ``cooperative=True``."""
    text = Path(source).read_text() if isinstance(source, Path) else source
    tree = ast.parse(text)
    fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    if not fns:
        return [f"no function {function!r} in the kernel source"]
    launches = [c for c in ast.walk(fns[0]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                and c.func.attr == "launch"]
    if not launches:
        return [f"{function} makes no .launch(...) call"]
    problems = []
    for c in launches:
        kw = {k.arg: k.value for k in c.keywords}
        v = kw.get("cooperative")
        if not (isinstance(v, ast.Constant) and v.value is True):
            problems.append(f"{function}: launch at line {c.lineno} is not cooperative")
    return problems


def wide_weight_copies(ptx: str) -> list[str]:
    """Every cp.async global->shared copy moves 16 bytes."""
    problems = []
    for no, line in enumerate(ptx.splitlines(), 1):
        m = _CP_ASYNC.match(line)
        if m and int(m.group(3)) != 16:
            problems.append(f"line {no}: {m.group(3)}-byte asynchronous copy (16 expected): {line.strip()}")
    return problems


def lint(ptx: str, *, registers: int, shared_bytes: int, grid: int, num_sms: int, arch: str,
         persistent: bool, source: str | Path | None = None, launch_function: str | None = None
         ) -> dict[str, list[str]]:
    """All rules for one compiled kernel; ``persistent`` adds the occupancy and cooperative-launch rules."""
    out = {"release-after-barrier": release_after_barrier(ptx), "acquire-spin": acquire_spin(ptx),
           "wide-weight-copies": wide_weight_copies(ptx)}
    if persistent:
        out["occupancy"] = occupancy(ptx, registers, shared_bytes, grid, num_sms, arch)
        if source is None or launch_function is None:
            raise ValueError("a persistent kernel's lint needs its source and launch function")
        out["cooperative-launch"] = cooperative_launch(source, launch_function)
    return out


def violations(report: dict[str, list[str]]) -> Iterable[str]:
    return (f"{rule}: {msg}" for rule, msgs in report.items() for msg in msgs)
