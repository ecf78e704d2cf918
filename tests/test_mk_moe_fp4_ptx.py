"""The MXFP4 expert opcodes' hot loops as compiled (PTX of megakernel/tiny/b1-mxfp4 for sm_90a, the build the
compile tests make, cached by source hash): PTX instructions per weight per pass on the common path, the decode as
integer ops plus ``mul.bf16x2`` (no fp32 round trip), the x pairs as ``prmt``.

Method (``hot_loop_counts``): the k-block loop of each opcode is the innermost loop holding ``mma.sync`` and
``prmt`` (the x pairs); its
instructions, less the blocks the scale > 128 branch skips (``@p bra`` on ``setp.lt.u32 p, e, 129``), are issued once
per k block; the enclosing step loop's own instructions (the L1 prefetches) once per U blocks. Per lane and block:
GATE_UP 2 weights x 2 rows x 32 = 128 weights, DOWN 64."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

INSTR_SKIP = ("$", "//", ".pragma", "{", "}")


def _instrs(lines: list[str]) -> list[str]:
    return [s.strip() for s in lines if s.strip() and not s.strip().startswith(INSTR_SKIP)]


def _mma_loops(lines: list[str]) -> list[tuple[int, int]]:
    """(header line, back-edge line) of every loop whose body holds an mma.sync."""
    lab = {s.strip()[:-1]: i for i, s in enumerate(lines) if re.fullmatch(r"\$L__BB\d+_\d+:", s.strip())}
    out = []
    for i, s in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", s)
        if m and lab.get(m.group(1), i) < i and any("mma.sync" in t for t in lines[lab[m.group(1)]:i]):
            out.append((lab[m.group(1)], i))
    return out


def _big_scale_lines(lines: list[str], h: int, e: int) -> set[int]:
    preds = set(re.findall(r"setp\.lt\.u32\s+(%p\d+), %r\d+, 129;", "\n".join(lines[h:e + 1])))
    skip: set[int] = set()
    for i in range(h, e + 1):
        m = re.search(r"@(%p\d+) bra\s+(\$L__BB\d+_\d+);", lines[i])
        if m and m.group(1) in preds:
            j = i + 1
            while lines[j].strip() != m.group(2) + ":":
                skip.add(j)
                j += 1
    return skip


def hot_loop_counts(ptx: str) -> list[dict]:
    """Per innermost mma loop, in program order: its common-path instructions per iteration (``block``), the
    enclosing loop's own instructions (``step``), the mma count and the instruction kinds of the block."""
    lines = ptx.splitlines()
    loops = _mma_loops(lines)
    res = []
    for h, e in loops:
        if any(x != (h, e) and h <= x[0] and x[1] <= e for x in loops) or not any(
                "prmt.b32" in s for s in lines[h:e]):  # (the GEMV opcodes' mma loops at batch 8 have no prmt)
            continue
        outer = min((x for x in loops if x != (h, e) and x[0] <= h and e <= x[1]), key=lambda x: x[1] - x[0])
        skip = _big_scale_lines(lines, h, e)
        block = _instrs([lines[i] for i in range(h, e + 1) if i not in skip])
        step = _instrs([lines[i] for i in range(outer[0], outer[1] + 1) if not h <= i <= e])
        kinds: dict[str, int] = {}
        for s in block:
            op = s.split()[1] if s.startswith("@") else s.split()[0]
            kinds[op] = kinds.get(op, 0) + 1
        res.append({"block": len(block), "step": len(step), "mma": sum("mma.sync" in s for s in block),
                    "kinds": kinds})
    return res


def test_mxfp4_hot_loops_instruction_budget() -> None:
    from kimik3.kernels.megakernel import moe as MK
    from kimik3.kernels.toolchain import build as B
    from kimik3.kernels.toolchain import registry as R

    ptx = B.build(R.get_variant("megakernel/tiny/b1-mxfp4"), "sm_90a").ptx
    gate_up, down = hot_loop_counts(ptx)
    assert (gate_up["mma"], down["mma"]) == (16, 8)
    for loop, U, weights in ((gate_up, MK.GATE_UP_BLOCKS, 128), (down, MK.DOWN_BLOCKS, 64)):
        per_weight = (loop["block"] + loop["step"] / U) / weights
        assert per_weight <= 4.0, (per_weight, loop)
        k = loop["kinds"]
        assert k.get("mul.bf16x2", 0) == weights // 2, k  # one bf16x2 multiply per register of decoded codes
        assert not any(op.startswith("cvt") and "bf16" in op for op in k), k  # no fp32 round trip
        assert k.get("prmt.b32", 0) == 16, k  # one per x register of the block's 4 words
    sels = set(re.findall(r"prmt\.b32\s+%r\d+, %r\d+, %r\d+, (0x[0-9a-f]+);", ptx))
    assert sels == {"0x5410", "0x7632"}, sels  # low halves (columns s, s + 4 of words 0 / 2), high halves
