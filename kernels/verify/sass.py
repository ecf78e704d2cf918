"""Disassemble a cubin with ``nvdisasm`` and read the SASS as functions, basic blocks, loops and register operands.

The machine code is what runs: ptxas schedules, fences and caches loads its own way, so the audit
(``kernels/verify/sass_audit.py``) reads SASS, not PTX. ``nvdisasm`` comes from the ``nvidia-cuda-nvdisasm`` wheel
(the project's test dependencies); :func:`nvdisasm_path` finds it in that installed package. :func:`parse` takes the
listing ``nvdisasm -c`` prints (one instruction per line, ``/*offset*/``, branch targets as ``.L_x_N`` labels) and
returns one :class:`Function` per ``.type @function`` symbol, with its control-flow graph (:class:`Block`).
Why SASS and what is checked on it: docs/validation.md (SASS audit); the PTX-level sibling: docs/architecture.md,
appendix "kernels/verify/ptx_lint.py: the PTX rules".
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

__all__ = ["NVDISASM_PACKAGE", "nvdisasm_path", "disassemble", "Instr", "Block", "Function", "parse", "regs_of",
           "natural_loops", "dominators", "post_dominators", "reverse_postorder", "dests_sources", "is_conditional"]

NVDISASM_PACKAGE = "nvidia-cuda-nvdisasm"

_SECTION = re.compile(r"^//-+ \.text\.(\S+) -+$")
_FUNC = re.compile(r"^\s*\.type\s+(\S+?),\s*@function")
_LABEL = re.compile(r"^([.$\w]+):\s*$")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_TARGET = re.compile(r"`\(([^)]+)\)")
_BRX_TARGETS = re.compile(r'BRANCH_TARGETS ([^"]+)"')
_REG = re.compile(r"(?<![\w.])(U?R(?:Z|\d+)|U?P(?:T|\d+))((?:\.64|\.128)?)")

# control transfers that end a basic block
_BRANCHES = {"BRA", "BRX", "JMP", "JMX"}
_ENDS = {"EXIT", "RET", "KILL", "BPT"}


def nvdisasm_path() -> Path:
    """The ``nvdisasm`` binary of the installed ``nvidia-cuda-nvdisasm`` wheel."""
    try:
        files = metadata.files(NVDISASM_PACKAGE) or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "nvdisasm":
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"nvdisasm not found: the SASS audit needs the {NVDISASM_PACKAGE!r} wheel (a test "
                            f"dependency in pyproject.toml; `make setup`, or pip install -e '.[test]')")


def disassemble(cubin: bytes | str | Path) -> str:
    """``nvdisasm -c`` of a cubin (its bytes or its path): the code sections as text."""
    if isinstance(cubin, (bytes, bytearray)):
        if cubin[:4] != b"\x7fELF":
            raise ValueError("not a cubin: no ELF header")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
            tmp.write(cubin)
            tmp.flush()
            return disassemble(Path(tmp.name))
    path = Path(cubin)
    if not path.is_file():
        raise FileNotFoundError(f"no cubin at {path}")
    # the DSL's cubins make nvdisasm fall back to its older listing format (a warning on stderr): the same text
    run = subprocess.run([str(nvdisasm_path()), "-c", str(path)], capture_output=True, text=True, timeout=300)
    if run.returncode != 0 or "/*0000*/" not in run.stdout:
        raise RuntimeError(f"nvdisasm failed on {path} (exit {run.returncode}): {run.stderr.strip()[:500]}")
    return run.stdout


@dataclass
class Instr:
    """One SASS instruction: ``pred`` is the guard (``P0``, ``!UP1``, None when unguarded)."""

    offset: int
    pred: str | None
    opcode: str
    operands: list[str]
    text: str
    targets: list[str] = field(default_factory=list)  # branch target labels
    _regs: tuple[list[str], list[str]] | None = field(default=None, repr=False, compare=False)
    op: str = field(init=False, compare=False)  # the opcode without modifiers
    mods: list[str] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self.op, *self.mods = self.opcode.split(".")

    def __str__(self) -> str:
        return f"/*{self.offset:04x}*/ {self.text}"


@dataclass
class Block:
    index: int
    start: int  # index of its first instruction in Function.instrs
    end: int  # one past its last
    labels: list[str] = field(default_factory=list)
    succ: list[int] = field(default_factory=list)
    pred: list[int] = field(default_factory=list)


@dataclass
class Function:
    name: str  # the symbol as nvdisasm prints it
    kernel: str  # the .text section (the kernel entry) it lies in
    instrs: list[Instr]
    labels: dict[str, int]  # label -> index of the instruction it precedes
    blocks: list[Block] = field(default_factory=list)

    def block_of(self, i: int) -> Block:
        lo, hi = 0, len(self.blocks) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks[mid].start <= i:
                lo = mid
            else:
                hi = mid - 1
        return self.blocks[lo]

    def index_at(self, offset: int) -> int:
        for i, ins in enumerate(self.instrs):
            if ins.offset == offset:
                return i
        raise KeyError(f"no instruction at offset {offset:#x} in {self.name}")


def _split_operands(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _targets(op: str, rest: str) -> list[str]:
    if op in ("BRX", "JMX"):
        m = _BRX_TARGETS.search(rest)
        return [t.strip() for t in m.group(1).split(",")] if m else []
    if op in _BRANCHES:
        m = _TARGET.search(rest)
        return [m.group(1)] if m else []
    return []


def is_conditional(ins: Instr) -> bool:
    """A branch that may fall through: guarded (other than ``@PT``), with a condition operand, or a divergence
    test (``BRA.DIV``)."""
    if ins.pred not in (None, "@PT"):
        return True
    return ins.op == "BRA" and ("DIV" in ins.mods or "CONV" in ins.mods or any(
        re.fullmatch(r"!?U?P\d+", o) for o in ins.operands))


def parse(text: str) -> list[Function]:
    """Every function of an ``nvdisasm -c`` listing (kernel entries and the subroutines ptxas adds)."""
    funcs: list[Function] = []
    kernel = ""
    pending: list[str] = []
    cur: Function | None = None
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            kernel = m.group(1)
            continue
        m = _FUNC.match(line)
        if m:
            cur = Function(m.group(1), kernel or m.group(1), [], {})
            funcs.append(cur)
            pending = []
            continue
        if cur is None:
            continue
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        for lab in pending:
            cur.labels[lab] = len(cur.instrs)
        pending = []
        off, pred, opcode, rest = m.groups()
        ops_text = re.sub(r"\(\*.*?\*\)", "", rest).strip()
        text = " ".join(x for x in (pred, opcode, " ".join(ops_text.split())) if x)
        ins = Instr(int(off, 16), pred, opcode, _split_operands(ops_text), text)
        ins.targets = _targets(ins.op, rest)
        cur.instrs.append(ins)
    funcs = [f for f in funcs if f.instrs]
    if not funcs:
        raise ValueError("no SASS function found in the listing (not nvdisasm -c output?)")
    for f in funcs:
        _build_cfg(f)
    return funcs


def _build_cfg(f: Function) -> None:
    n = len(f.instrs)
    leaders = {0}
    for i, ins in enumerate(f.instrs):
        if ins.op in _BRANCHES or ins.op in _ENDS:
            leaders.add(i + 1)
    leaders.update(f.labels.values())
    starts = sorted(x for x in leaders if x < n)
    f.blocks = [Block(k, s, starts[k + 1] if k + 1 < len(starts) else n) for k, s in enumerate(starts)]
    at = {b.start: b.index for b in f.blocks}
    for lab, i in f.labels.items():
        if i < n:
            f.blocks[at[i]].labels.append(lab)
    for b in f.blocks:
        last = f.instrs[b.end - 1]
        nxt = b.index + 1 if b.index + 1 < len(f.blocks) else None
        succ: list[int] = []
        if last.op in _BRANCHES:
            if last.pred == "@!PT":
                succ = [nxt] if nxt is not None else []
            else:
                if not last.targets:
                    raise ValueError(f"{f.name}: branch without a known target: {last}")
                for t in last.targets:
                    if t not in f.labels:
                        raise ValueError(f"{f.name}: branch to unknown label {t}: {last}")
                    if f.labels[t] < n:
                        succ.append(at[f.labels[t]])
                if is_conditional(last) and nxt is not None:
                    succ.append(nxt)
        elif last.op in _ENDS:
            if last.pred not in (None, "@PT") and nxt is not None:
                succ = [nxt]
        elif nxt is not None:
            succ = [nxt]
        b.succ = list(dict.fromkeys(succ))
    for b in f.blocks:
        for s in b.succ:
            f.blocks[s].pred.append(b.index)


def regs_of(operand: str, width: int = 1) -> list[str]:
    """Register names an operand reads or writes (``R16.64`` -> R16, R17; ``RZ``/``PT`` dropped); ``width``
    widens a bare register (a 128-bit load's destination is written as its first register)."""
    out = []
    for name, suffix in _REG.findall(operand):
        if name in ("RZ", "URZ", "PT", "UPT"):
            continue
        w = {".64": 2, ".128": 4}.get(suffix, width if operand.strip().lstrip("-|!~").startswith(name) else 1)
        m = re.match(r"(U?R)(\d+)$", name)
        if m and w > 1:
            out.extend(f"{m.group(1)}{int(m.group(2)) + k}" for k in range(w))
        else:
            out.append(name)
    return out


def dominators(f: Function) -> list[int]:
    """Per block, the bit set (an int) of the blocks that dominate it."""
    n = len(f.blocks)
    full = (1 << n) - 1
    dom = [full] * n
    dom[0] = 1
    order = reverse_postorder(f)
    changed = True
    while changed:
        changed = False
        for b in order[1:] if order and order[0] == 0 else order:
            blk = f.blocks[b]
            new = full
            for p in blk.pred:
                new &= dom[p]
            new = (new if blk.pred else 0) | (1 << b)
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


def post_dominators(f: Function) -> list[int]:
    """Per block, the bit set of the blocks that post-dominate it (paths end at a block without successors)."""
    n = len(f.blocks)
    full = (1 << n) - 1
    pdom = [full] * n
    for b in f.blocks:
        if not b.succ:
            pdom[b.index] = 1 << b.index
    order = list(reversed(reverse_postorder(f)))
    changed = True
    while changed:
        changed = False
        for b in order:
            blk = f.blocks[b]
            if not blk.succ:
                continue
            new = full
            for s in blk.succ:
                new &= pdom[s]
            new |= 1 << b
            if new != pdom[b]:
                pdom[b], changed = new, True
    return pdom


def reverse_postorder(f: Function) -> list[int]:
    """Block indices in reverse post-order from the entry (blocks no path reaches last)."""
    seen, post = set(), []
    stack = [(0, iter(f.blocks[0].succ))] if f.blocks else []
    seen.add(0)
    while stack:
        b, it = stack[-1]
        nxt = next((s for s in it if s not in seen), None)
        if nxt is None:
            post.append(b)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(f.blocks[nxt].succ)))
    rest = [b.index for b in f.blocks if b.index not in seen]  # unreachable (padding): after the rest
    return list(reversed(post)) + rest


def natural_loops(f: Function) -> list[tuple[int, set[int]]]:
    """(header block, body blocks) per loop header, every back edge ``u -> h`` (``h`` dominates ``u``) to one
    header taken together; the trap loop ptxas pads a function with (one ``BRA`` to itself) is left out."""
    dom = dominators(f)
    bodies: dict[int, set[int]] = {}
    for u in f.blocks:
        for h in u.succ:
            if not dom[u.index] >> h & 1:
                continue
            hb = f.blocks[h]
            if u.index == h and hb.end - hb.start == 1 and f.instrs[hb.start].op == "BRA":
                continue
            body, stack = bodies.setdefault(h, {h}), [u.index]
            body.add(u.index)
            while stack:
                x = stack.pop()
                if x == h:
                    continue
                for p in f.blocks[x].pred:
                    if p not in body:
                        body.add(p)
                        stack.append(p)
    return sorted(bodies.items())


# opcodes that write no register (stores, reductions, fences, control, barriers, asynchronous copies)
_NO_DEST = {"ST", "STG", "STS", "STL", "STAS", "RED", "REDG", "REDAS", "BAR", "MEMBAR", "FENCE", "BRA", "BRX", "JMP",
            "JMX", "CALL", "RET", "EXIT", "KILL", "BPT", "BSSY", "BSYNC", "BREAK", "WARPSYNC", "NANOSLEEP", "YIELD",
            "NOP", "CCTL", "CCTLL", "ERRBAR", "CGAERRBAR", "DEPBAR", "LDGDEPBAR", "LDGSTS", "ARRIVES", "SYNCS",
            "UTMALDG", "UBLKCP", "STSM"}
_TWO_DESTS = {"ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "PLOP3", "UISETP", "UPLOP3", "UPSETP", "VOTE", "VOTEU",
              "FCHK"}
_CARRY_OUT = {"IADD3", "UIADD3", "LEA", "ULEA", "IADD", "IADD32I"}
_PRED = re.compile(r"^U?P(?:T|\d+)$")


def _dest_width(ins: Instr) -> int:
    mods = ins.mods
    if ins.op == "HMMA":
        return 4 if "F32" in mods else 2
    if "128" in mods:
        return 4
    if "64" in mods or "WIDE" in mods or (ins.op in ("CS2R", "DADD", "DMUL", "DFMA") and "32" not in mods):
        return 2
    if ins.op == "LDSM":
        return {"2": 2, "4": 4}.get(mods[-1], 1)
    return 1


def _src_widths(ins: Instr, n: int) -> list[int]:
    """Widths of the ``n`` source operands where a bare register names several (store data, wide adds, mma)."""
    w = [1] * n
    if ins.op == "HMMA" and n >= 3:
        big = "16816" in ins.mods
        w[0], w[1], w[2] = (4 if big else 2), (2 if big else 1), (4 if "F32" in ins.mods else 2)
    elif ins.op in ("STG", "STS", "ST", "STL", "RED", "REDG", "ATOMG", "ATOM", "ATOMS") and n:
        w[-1] = _dest_width(ins)
    elif "WIDE" in ins.mods and n:
        w[-1] = 2
    return w


def dests_sources(ins: Instr) -> tuple[list[str], list[str]]:
    """(registers written, registers read) by an instruction: R/UR registers and P/UP predicates (the guard is
    read). The split follows the operand order of SASS: destinations first."""
    if ins._regs is None:
        ins._regs = _dests_sources(ins)
    return ins._regs


def _dests_sources(ins: Instr) -> tuple[list[str], list[str]]:
    ops = ins.operands
    guard = [ins.pred.lstrip("@!")] if ins.pred and ins.pred.lstrip("@!") not in ("PT", "UPT") else []
    if ins.op in _NO_DEST:
        nd = 0
    elif ins.op in _TWO_DESTS:
        nd = min(2, len(ops))
    else:
        nd = 0
        while nd < len(ops) and _PRED.match(ops[nd]):
            nd += 1
        if nd < len(ops) and re.match(r"^U?R(?:Z|\d+)", ops[nd]):
            nd += 1
            if ins.op in _CARRY_OUT:
                while nd < len(ops) - 1 and _PRED.match(ops[nd]):
                    nd += 1
    width = _dest_width(ins)
    dests = [r for o in ops[:nd] for r in regs_of(o, width if re.match(r"^U?R\d", o) else 1)]
    srcs = ops[nd:]
    sources = [r for o, w in zip(srcs, _src_widths(ins, len(srcs))) for r in regs_of(o, w)]
    return dests, sources + guard
