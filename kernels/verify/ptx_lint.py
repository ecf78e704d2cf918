"""Lint compiled PTX for the synchronisation and streaming rules the device code relies on (no GPU needed).

A wrong fence, a spin without back-off or a narrow weight copy compiles and passes every CPU test; on a GPU it is
a rare hang, a stale read or a slow kernel. The rules read the emitted PTX as a control-flow graph of basic blocks
(:func:`parse_blocks`, :func:`natural_loops`), so they hold on every path: ``release-after-barrier``,
``acquire-spin``, ``peer-scope``, ``occupancy``, ``cooperative-launch``, ``wide-weight-copies`` and
``no-scalar-load-loop``.
Each rule returns a list of human-readable violations (empty = pass); :func:`lint` runs them all.
Design (what each rule checks, and why): docs/architecture.md#appendix-design-notes-by-room
(``kernels/verify/ptx_lint.py``).
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ArchLimits", "LIMITS", "BasicBlock", "parse_blocks", "natural_loops", "release_after_barrier",
           "acquire_spin", "peer_scope", "occupancy", "cooperative_launch", "wide_weight_copies", "scalar_load_loops",
           "global_load_bytes", "parse_entries", "SCALAR_LOOP_ALLOW", "lint"]


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
    return _blocks_of(bodies[0])


def parse_entries(ptx: str) -> list[tuple[str, list[BasicBlock]]]:
    """(name, basic blocks) of every kernel entry of the PTX, in order."""
    names = re.findall(r"^\s*(?:\.visible\s+)?\.entry\s+([\w$]+)", ptx, re.M)
    bodies = _entry_bodies(ptx)
    if not bodies or len(names) != len(bodies):
        raise ValueError(f"{len(names)} .entry names but {len(bodies)} entry bodies in the PTX")
    return [(n, _blocks_of(b)) for n, b in zip(names, bodies)]


def _blocks_of(body: list[tuple[int, str]]) -> list[BasicBlock]:
    blocks: list[BasicBlock] = [BasicBlock(0, None)]
    for no, s in body:
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
                # walk back from the latch to the header; a self-loop (latch == header) is its own body
                body, stack = {h, u.index}, ([u.index] if u.index != h else [])
                while stack:
                    x = stack.pop()
                    for p in blocks[x].pred:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                loops.append((h, body))
    return loops


_SCOPES = ("gpu", "sys")  # a counter's scope: the GPU's, or the system's for a cross-rank word (peer GPUs)


def release_after_barrier(ptx: str) -> list[str]:
    """Every global add is a GPU- or system-scope release reached, on every path, through a barrier after the last
    write (which scope a peer's word needs: :func:`peer_scope`)."""
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
                if report and ("release" not in sem or not any(x in sem for x in _SCOPES)):
                    problems.append(f"line {no}: counter signal is not a release at GPU or system scope: {s}")
                if report and not state:
                    problems.append(f"line {no}: counter signal not preceded by a CTA barrier on every path "
                                    f"after the last global write: {s}")
                # a release orders everything before it: more signals may follow (one per peer), a data write may not
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
    """Every loop polling global memory with an ordered load spins on a GPU- or system-scope acquire and backs
    off."""
    blocks = parse_blocks(ptx)
    problems = []
    for _header, body in natural_loops(blocks):
        lines = [(no, s) for i in sorted(body) for no, s in blocks[i].lines]
        polls = [(no, s) for no, s in lines if _ORDERED_LOAD.match(s)]
        if not polls:
            continue
        first = min(no for no, _ in lines) if lines else 0
        acquires = [s for _, s in polls if _ORDERED_LOAD.match(s).group(2) == "acquire"
                    and _ORDERED_LOAD.match(s).group(3) in _SCOPES]
        if not acquires:
            problems.append(f"loop at line {first}: polls global memory without a GPU-scope acquire load "
                            f"({polls[0][1]})")
        if not any("nanosleep" in s for _, s in lines):
            problems.append(f"loop at line {first}: spins on {polls[0][1]!r} with no back-off (nanosleep)")
    return problems


_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s+(.*?);")
_REG = re.compile(r"%[\w]+")
_ENTRY_PARAMS = re.compile(r"\.entry\s+\w+\s*\((.*?)\)", re.S)
_PARAM_NAME = re.compile(r"([\w$]+)(?:\[\d+\])?\s*$")
PEER_PARAM = 6  # the megakernel's peer table (kernels/megakernel/vm.py: mPeer, isa.PEER_TABLE), 0-based


def _tainted_from_param(body: list[tuple[int, str]], param: str) -> set[str]:
    """Registers whose value derives from what ``param`` points at: loaded from it, then through any arithmetic and
    any load from a derived address (a fixed point over the body, order ignored: PTX reuses registers in loops)."""
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for _, s in body:
            m = _INSTR.match(s)
            if not m:
                continue
            op, args = m.group(1), m.group(2)
            first = args.split(",", 1)[0].strip()
            if first.startswith("[") or op.startswith(("st.", "red.", "bar", "bra", "setp")):
                continue  # no destination register
            dest = first.split()[0] if first.startswith("%") else None
            if dest is None or dest in tainted:
                continue
            srcs = _REG.findall(args.split(",", 1)[1]) if "," in args else []
            if (op.startswith("ld.param") and param in args) or any(r in tainted for r in srcs):
                tainted.add(dest)
                changed = True
    return tainted


def peer_scope(ptx: str, param_index: int = PEER_PARAM) -> list[str]:
    """A kernel that signals its peers does it at system scope, and polls at system scope: every atomic add to an
    address derived from the peer table (entry parameter ``param_index``: a peer GPU's counter word) is a release
    at ``.sys`` (a ``.gpu`` release orders nothing for another GPU); and such a kernel has a spin loop with a
    system-scope acquire and back-off (its cross-rank counter words are written by peers). A kernel that never
    signals through the table (one GPU's) passes."""
    problems = []
    m = _ENTRY_PARAMS.search(ptx)
    if not m:
        return problems
    params = [_PARAM_NAME.search(p.strip()) for p in m.group(1).split(",")]
    if len(params) <= param_index or params[param_index] is None:
        return problems
    param = params[param_index].group(1)
    blocks = parse_blocks(ptx)
    body = [(no, s) for b in blocks for no, s in b.lines]
    tainted = _tainted_from_param(body, param)
    peer_signals = 0
    for no, s in body:
        sig = _SIGNAL.match(s)
        if not sig:
            continue
        addr = re.search(r"\[([^\]]*)\]", s)
        if addr and any(r in tainted for r in _REG.findall(addr.group(1))):
            peer_signals += 1
            quals = set((sig.group(2) + "." + sig.group(3) + s.split()[0]).split("."))
            if not {"release", "sys"} <= quals:
                problems.append(f"line {no}: a signal to a peer's counter word is not a release at system scope: {s}")
    if peer_signals:
        sys_polls = [h for h, loop in natural_loops(blocks)
                     if any("ld.acquire.sys.global" in s for i in loop for _, s in blocks[i].lines)
                     and any("nanosleep" in s for i in loop for _, s in blocks[i].lines)]
        if not sys_polls:
            problems.append("signals peers but polls no counter word with a system-scope acquire (with back-off): "
                            "a cross-rank word is written by another GPU")
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


_LOAD = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld\.[\w:.]+)\s")
_TYPE_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2, "b32": 4, "u32": 4,
               "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8, "b128": 16}
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')


def global_load_bytes(line: str) -> tuple[int, bool] | None:
    """(bytes, scalar) of a ``ld.*.global`` instruction, None for any other line. ``scalar``: narrower than 16
    bytes and not a vector of 32-bit or wider elements (what ``no-scalar-load-loop`` counts against a loop)."""
    m = _LOAD.match(line)
    if not m:
        return None
    parts = m.group(1).split(".")[1:]
    if "global" not in parts or parts[-1] not in _TYPE_BYTES:
        return None
    elem = _TYPE_BYTES[parts[-1]]
    vec = int(parts[-2][1:]) if len(parts) > 1 and parts[-2] in ("v2", "v4", "v8") else 1
    nbytes = elem * vec
    return nbytes, nbytes < 16 and not (vec > 1 and elem >= 4)


def _source_lines(ptx: str) -> dict[int, str]:
    """PTX line -> ``file:line`` of the nearest ``.loc`` above it (only when the PTX carries line info)."""
    lines = ptx.splitlines()
    files = {f.group(1): f.group(2).rsplit("/", 1)[-1] for f in map(_FILE.match, lines) if f}  # at the end
    out: dict[int, str] = {}
    cur = None
    for no, line in enumerate(lines, 1):
        m = _LOC.match(line)
        if m:
            cur = f"{files.get(m.group(1), m.group(1))}:{m.group(2)}"
        elif cur is not None:
            out[no] = cur
    return out


# Kernels whose loops are exempt from no-scalar-load-loop, matched as a substring of the PTX entry name: only
# kernels that provably read no weight (the rule is about the weight stream's bytes in flight), each with why.
SCALAR_LOOP_ALLOW = {
    "moe_align_kernel": "the MoE align step (kernels/fused/moe.py) reads the B*k routed expert ids, one int32 per "
                        "lane per trip counted with match.any.sync; its only global inputs are ids and counts, no "
                        "weight",
}


def scalar_load_loops(ptx: str, allow: dict[str, str] | None = None) -> list[str]:
    """No hot loop (every loop but a wait spin) of any kernel entry issues exactly one global load per trip that is
    scalar and narrower than 16 bytes. Entries whose name contains a key of ``allow`` (default
    :data:`SCALAR_LOOP_ALLOW`) are skipped."""
    allow = SCALAR_LOOP_ALLOW if allow is None else allow
    where = _source_lines(ptx) if ".loc" in ptx else {}
    problems = []
    for name, blocks in parse_entries(ptx):
        if any(k in name for k in allow):
            continue
        bodies: dict[int, set[int]] = {}
        for header, body in natural_loops(blocks):  # several back edges to one header: one loop
            bodies.setdefault(header, set()).update(body)
        for header in sorted(bodies):
            lines = [(no, s) for i in sorted(bodies[header]) for no, s in blocks[i].lines]
            if any(_ORDERED_LOAD.match(s) or "nanosleep" in s for _, s in lines):
                continue  # a wait spin (acquire-spin's business), not a hot loop
            if any(_SIGNAL.match(s) and ".sys" in s for _, s in lines):
                continue  # a signal to each peer (one peer-table entry per trip, world trips): no weight stream
            loads = [(no, s, global_load_bytes(s)) for no, s in lines]
            loads = [(no, s, w) for no, s, w in loads if w is not None]
            if len(loads) == 1 and loads[0][2][1]:
                no, s, (nbytes, _) = loads[0]
                src = f" (source {where[no]})" if no in where else ""
                short = re.sub(r"_tensorptr.*$", "", name)  # the DSL appends the parameter types
                problems.append(f"{short}: loop at line {min(n for n, _ in lines)}: one {nbytes}-byte scalar global "
                                f"load per iteration, line {no}{src}: {s}")
    return problems


def lint(ptx: str, *, registers: int, shared_bytes: int, grid: int, num_sms: int, arch: str,
         persistent: bool, source: str | Path | None = None, launch_function: str | None = None
         ) -> dict[str, list[str]]:
    """All rules for one compiled kernel; ``persistent`` adds the occupancy and cooperative-launch rules."""
    out = {"release-after-barrier": release_after_barrier(ptx), "acquire-spin": acquire_spin(ptx),
           "peer-scope": peer_scope(ptx) if persistent else [], "wide-weight-copies": wide_weight_copies(ptx),
           "no-scalar-load-loop": scalar_load_loops(ptx)}
    if persistent:
        out["occupancy"] = occupancy(ptx, registers, shared_bytes, grid, num_sms, arch)
        if source is None or launch_function is None:
            raise ValueError("a persistent kernel's lint needs its source and launch function")
        out["cooperative-launch"] = cooperative_launch(source, launch_function)
    return out


def violations(report: dict[str, list[str]]) -> Iterable[str]:
    return (f"{rule}: {msg}" for rule, msgs in report.items() for msg in msgs)
