"""SASS audit: the machine code of every kernel CI compiles keeps the loads in flight, fences, read-only path and
reconvergence the design relies on (``kernels/verify/sass_audit.py``), and each check fails on a planted
violation of a real disassembly.

The cubins come from the disk cache the compile tests fill in the same run (tests/test_kernels_compile.py,
tests/test_megakernel_compile.py), so this file disassembles and reads; it compiles only on a cold cache.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from kimik3.kernels.toolchain import build as B  # noqa: E402
from kimik3.kernels.toolchain import registry as R  # noqa: E402
from kimik3.kernels.verify import ptx_lint as L  # noqa: E402
from kimik3.kernels.verify import sass as S  # noqa: E402
from kimik3.kernels.verify import sass_audit as A  # noqa: E402

pytestmark = pytest.mark.host

ARCH = "sm_90a"
# the sm_90a megakernels tests/test_megakernel_compile.py builds in CI, and every fused CI variant
MEGAKERNELS = ["megakernel/tiny/b1", "megakernel/k3-shard/b8", "megakernel/tiny/b1-mxfp4"]
FUSED = [v.name for v in R.ci_variants()]

_BUILT: dict[str, tuple[B.BuildResult, str]] = {}
_REPORTS: dict[str, dict] = {}


@pytest.fixture(autouse=True)
def _arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)


def _built(name: str) -> tuple[B.BuildResult, str]:
    """The build (a disk-cache hit after the compile tests) and its SASS listing, once per run."""
    if name not in _BUILT:
        r = B.build(R.get_variant(name), ARCH)
        _BUILT[name] = (r, S.disassemble(r.cubin))
    return _BUILT[name]


def _report(name: str) -> dict:
    if name not in _REPORTS:
        r, text = _built(name)
        _REPORTS[name] = A.audit(r, sass_text=text)
    return _REPORTS[name]


@pytest.mark.parametrize("check", A.CHECKS)
@pytest.mark.parametrize("name", MEGAKERNELS + FUSED)
def test_shipped_kernels_pass(name: str, check: str) -> None:
    assert [str(x) for x in _report(name)[check]] == []


def test_audit_reads_the_megakernel() -> None:
    """The shipped megakernel gives every check something to hold: a spin loop that leaves on an acquire poll, a
    fenced counter add, read-only loads, lane-dependent branches, hot loops with the weight stream in flight."""
    r, text = _built("megakernel/tiny/b1")
    f = S.parse(text)[0]
    assert any("STRONG" in i.mods and f.instrs[k + 1].opcode == "CCTL.IVALL" for k, i in enumerate(f.instrs))
    assert any(i.op == "REDG" and "ADD" in i.mods for i in f.instrs)
    assert any(i.op == "LDG" and "CONSTANT" in i.mods for i in f.instrs)
    assert A.divergent_regions(f)
    promise = A.promises_for("megakernel", ARCH)[0].loads
    assert any(lp.innermost and lp.stream_in_flight >= promise for lp in _report("megakernel/tiny/b1")["loops"])
    assert "loop /*" in A.format_report(_report("megakernel/k3-shard/b8"), loops=True)


# ---------------------------------------------------------------------------------------------- planted in SASS
def _mk() -> tuple[B.BuildResult, str]:
    return _built("megakernel/tiny/b1")


def _insert_after(text: str, offset: int, instr: str) -> tuple[str, int]:
    """The listing with ``instr`` as a new instruction right after the one at ``offset`` (at ``offset + 8``)."""
    lines = text.splitlines()
    k = next(i for i, s in enumerate(lines) if f"/*{offset:04x}*/" in s)
    new = offset + 8
    lines.insert(k + 1, f"        /*{new:04x}*/                   {instr} ;")
    return "\n".join(lines), new


def test_planted_release_without_membar() -> None:
    r, text = _mk()
    planted = re.sub(r"^.*MEMBAR\.ALL\.GPU.*$\n", "", text, flags=re.M)
    assert planted != text
    funcs = S.parse(planted)
    add = next(i for i in funcs[0].instrs if i.op == "REDG")
    found = A.fences(funcs, r.ptx)
    assert any(x.offset == add.offset and "without a GPU-scope MEMBAR" in x.message for x in found), found
    assert any("release add(s)" in x.message for x in found)


def test_planted_spin_without_acquire() -> None:
    r, text = _mk()
    planted = re.sub(r"^.*CCTL\.IVALL.*$\n", "", text, flags=re.M)
    found = A.fences(S.parse(planted), r.ptx)
    assert any("without acquire order" in x.message and "STRONG" in x.instruction for x in found), found


def test_planted_hmma_in_divergent_region() -> None:
    """An HMMA planted between a BSSY and its BSYNC, after a lane-dependent branch, is named; the shipped
    kernel has no reconvergence finding (test_shipped_kernels_pass)."""
    _, text = _mk()
    f = S.parse(text)[0]
    spans = []  # (BSSY offset, its BSYNC offset)
    for ins in f.instrs:
        if ins.op == "BSSY":
            label = re.search(r"`\((\S+?)\)", ins.text).group(1)
            spans.append((ins.offset, f.instrs[f.labels[label]].offset))
    spot = None
    for _, region in sorted(A.divergent_regions(f).items()):
        for x in sorted(region):
            blk = f.blocks[x]
            first = f.instrs[blk.start]
            if blk.end - blk.start > 1 and first.op not in ("BRA", "BSYNC", "BSSY") and any(
                    lo < first.offset < hi for lo, hi in spans):
                spot = first.offset
                break
        if spot is not None:
            break
    assert spot is not None, "no divergent region inside a BSSY/BSYNC span in the megakernel"
    planted, at = _insert_after(text, spot, "HMMA.16816.F32.BF16 R200, R204, R208, R200")
    found = A.reconvergence(S.parse(planted))
    assert [x.offset for x in found] == [at] and "HMMA" in found[0].instruction, found


def test_planted_fewer_loads_in_flight() -> None:
    """A consumer planted after the second weight load of a loop that keeps its promised loads in flight."""
    _, text = _mk()
    promises = A.promises_for("megakernel", ARCH)
    funcs = S.parse(text)
    base, table = A.loads_in_flight(funcs, promises)
    loop = next(lp for lp in table if lp.innermost and lp.stream_loads >= 8 and lp.stream_in_flight >= 8)
    f = funcs[0]
    start = f.index_at(loop.header)
    stream = [i for i in f.instrs[start:] if i.op == "LDG" and {"128", "CONSTANT"} <= set(i.mods)][:2]
    dest = S.dests_sources(stream[0])[0][0]
    planted, at = _insert_after(text, stream[1].offset, f"FADD R250, {dest}, {dest}")
    found, _ = A.loads_in_flight(S.parse(planted), promises)
    new = [x for x in found if x not in base]
    assert len(new) == 1 and new[0].offset == at, new
    assert f"loop /*{loop.header:04x}*/" in new[0].message and "but only 2 before" in new[0].message


def test_planted_read_only_load() -> None:
    """Plain 16-byte loads turned into read-only ones: one more than the PTX's ld.global.nc of that width is
    named; as many as the PTX allows is not."""
    r, text = _mk()
    funcs = S.parse(text)
    assert A.read_only_path(funcs, r.ptx) == []
    ro = sum(1 for f in funcs for i in f.instrs if i.opcode.startswith("LDG.E.128.CONSTANT"))
    nc = sum(1 for line in r.ptx.splitlines() if re.match(r"\s*(@!?%\w+\s+)?ld\.global\.nc", line)
             and (L.global_load_bytes(line) or (0,))[0] == 16)
    spare = nc - ro

    def flip(n: int) -> str:
        return re.sub(r"LDG\.E\.128 (?=R)", "LDG.E.128.CONSTANT ", text, count=n)

    if spare:
        assert A.read_only_path(S.parse(flip(spare)), r.ptx) == []
    found = A.read_only_path(S.parse(flip(spare + 1)), r.ptx)
    assert len(found) == 1 and f"{nc + 1} 16-byte read-only loads in the SASS, {nc} ld.global.nc" in found[0].message


# ---------------------------------------------------------------------------------------------- hand-written SASS
def _listing(body: str, name: str = "k") -> str:
    """A listing in nvdisasm's layout: ``.label:`` lines kept, every other line an instruction at the next
    offset."""
    out = [f"//--------------------- .text.{name} --------------------------", f"        .type {name},@function",
           f"{name}:"]
    off = 0
    for line in body.strip().splitlines():
        line = line.strip()
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{off:04x}*/                   {line} ;")
            off += 0x10
    return "\n".join(out) + "\n"


_DIVERGE = """
S2R R0, SR_TID.X
{cond}
BSSY B0, `(.L_x_1)
@P0 BRA `(.L_x_0)
MOV R2, RZ
{inside}
.L_x_0:
BSYNC B0
.L_x_1:
{after}
EXIT
"""


@pytest.mark.parametrize("cond, flagged", [
    ("ISETP.GE.AND P0, PT, R0, 0x10, PT", True),  # lanes 16..31 skip: divergent
    ("ISETP.GE.U32.AND P0, PT, R0, 0x40, PT", False),  # threadIdx.x >= 64: whole warps
    ("SHF.R.U32.HI R3, RZ, 0x5, R0\nISETP.NE.AND P0, PT, R3, 0x1, PT", False),  # on the warp index
    ("LDS R3, [R0]\nISETP.NE.AND P0, PT, R3, RZ, PT", True),  # a value loaded from a lane's own address
    ("LDS R3, [UR4]\nISETP.NE.AND P0, PT, R3, RZ, PT", False),  # the same address on every lane
])
def test_reconvergence_rules(cond: str, flagged: bool) -> None:
    shfl = "SHFL.BFLY PT, R5, R2, 0x10, 0x1f"
    inside = S.parse(_listing(_DIVERGE.format(cond=cond, inside=shfl, after="MOV R6, RZ")))
    assert bool(A.reconvergence(inside)) == flagged
    # the same shuffle after the BSYNC, where the paths have met again, is never named
    after = S.parse(_listing(_DIVERGE.format(cond=cond, inside="MOV R4, RZ", after=shfl)))
    assert A.reconvergence(after) == []
    # without a whole-warp block extent the warp index is not known to be uniform
    if "SHF.R" in cond:
        assert A.reconvergence(inside, warp_x=False)


def test_reconvergence_after_a_lane_exit() -> None:
    body = "S2R R0, SR_TID.X\nISETP.GE.AND P0, PT, R0, 0x3, PT\n@P0 EXIT\nSHFL.BFLY PT, R5, R0, 0x1, 0x1f\nEXIT"
    found = A.reconvergence(S.parse(_listing(body)))
    assert len(found) == 1 and "SHFL" in found[0].instruction and "@P0 EXIT" in found[0].message


_SPIN = """
LDC.64 R2, c[0x0][0x210]
.L_x_0:
NANOSLEEP 0x20
LDG.E.STRONG.GPU R4, desc[UR4][R2.64]
{fence}
ISETP.LT.AND P0, PT, R4, 0x5, PT
@P0 BRA `(.L_x_0)
{before_add}
MEMBAR.ALL.GPU
{between}
REDG.E.ADD.S32.STRONG.GPU desc[UR4][R2.64], R4
EXIT
"""


def test_fences_on_a_hand_written_spin() -> None:
    def run(**kw: str) -> list[str]:
        parts = {"fence": "CCTL.IVALL", "before_add": "STG.E desc[UR4][R2.64+0x4], R4", "between": "NOP"} | kw
        return [x.message for x in A.fences(S.parse(_listing(_SPIN.format(**parts))))]

    assert run() == []
    assert any("without acquire order" in m for m in run(fence="NOP"))
    assert any("without a GPU-scope MEMBAR" in m for m in run(between="STG.E desc[UR4][R2.64+0x8], R4"))
    ptx = "red.release.gpu.global.add.s32 [%rd1], 1;\nred.release.gpu.global.add.s32 [%rd2], 1;\n"
    assert any("2 release add(s)" in x.message for x in A.fences(S.parse(_listing(_SPIN.format(
        fence="CCTL.IVALL", before_add="NOP", between="NOP"))), ptx))


def test_loads_in_flight_on_a_hand_written_loop() -> None:
    loads = "\n".join(f"LDG.E.128.CONSTANT R{8 + 4 * k}, desc[UR4][R2.64+0x{k * 0x200:x}]" for k in range(4))
    body = f".L_x_0:\n{loads}\nFFMA R40, R8, R9, R40\nISETP.NE.AND P0, PT, R40, RZ, PT\n@P0 BRA `(.L_x_0)\nEXIT"
    funcs = S.parse(_listing(body))
    (lp,) = A.loop_loads(funcs[0])
    assert (lp.stream_loads, lp.stream_in_flight, lp.in_flight, lp.first_consumer.op) == (4, 4, 4, "FFMA")
    assert A.loads_in_flight(funcs, [A.Promise(4, "four")])[0] == []
    early = S.parse(_listing(body.replace("LDG.E.128.CONSTANT R16", "FADD R41, R8, R8\nLDG.E.128.CONSTANT R16")))
    (msg,) = [x.message for x in A.loads_in_flight(early, [A.Promise(4, "four")])[0]]
    assert "but only 2 before" in msg and "four" in msg
    # a loop with fewer loads per trip than any promise is not held to it (a tail loop)
    assert A.loads_in_flight(funcs, [A.Promise(5, "five")])[0] == []


def test_a_step_loop_around_a_row_loop_is_held_to_its_promise() -> None:
    """A weight step whose batch rows are an inner loop of x loads (no weight loads inside) is the innermost loop of
    its weight stream: its loads in flight are checked; a loop whose weight loads sit in an inner loop is not."""
    loads = "\n".join(f"LDG.E.128.CONSTANT R{8 + 4 * k}, desc[UR4][R2.64+0x{k * 0x200:x}]" for k in range(4))
    rows = ".L_x_1:\nLDG.E.128 R30, desc[UR4][R4.64]\nFFMA R40, R30, R9, R40\nISETP.NE.AND P1, PT, R40, RZ, PT\n" \
           "@P1 BRA `(.L_x_1)"
    body = (f".L_x_0:\n{loads}\nFFMA R41, R8, R12, R41\n{rows}\nISETP.NE.AND P0, PT, R41, RZ, PT\n"
            "@P0 BRA `(.L_x_0)\nEXIT")
    funcs = S.parse(_listing(body))
    step = max(A.loop_loads(funcs[0]), key=lambda lp: lp.blocks)
    assert step.innermost and (step.stream_loads, step.stream_in_flight) == (4, 4)
    early = S.parse(_listing(body.replace("LDG.E.128.CONSTANT R16", "FADD R42, R8, R8\nLDG.E.128.CONSTANT R16")))
    (msg,) = [x.message for x in A.loads_in_flight(early, [A.Promise(4, "four")])[0]]
    assert "but only 2 before" in msg
    nested = S.parse(_listing(body.replace("LDG.E.128 R30", "LDG.E.128.CONSTANT R30")))
    assert not max(A.loop_loads(nested[0]), key=lambda lp: lp.blocks).innermost


@pytest.mark.parametrize("second_guard, flagged", [("@P3", False), ("@P4", True), ("", True)])
def test_reconvergence_reads_a_guarded_uniform_write(second_guard: str, flagged: bool) -> None:
    """``@P3 LDS R3, [UR4]`` over a lane-dependent R3 leaves R3 uniform wherever P3 (uniform) holds: an instruction
    under the same guard reads it as uniform; under another guard, or none, it reads the lane-dependent value."""
    cond = ("LDS R3, [R0]\nLDS R7, [UR4+0x8]\nISETP.NE.AND P3, PT, R7, RZ, PT\nISETP.NE.AND P4, PT, R7, 0x1, PT\n"
            "MOV R8, 0x1\n@P3 LDS R3, [UR4]\n" + f"{second_guard} LOP3.LUT R8, R3, 0x1, RZ, 0xc0, !PT\n".lstrip()
            + "ISETP.NE.AND P0, PT, R8, RZ, PT")
    shfl = "SHFL.BFLY PT, R5, R2, 0x10, 0x1f"
    found = A.reconvergence(S.parse(_listing(_DIVERGE.format(cond=cond, inside=shfl, after="MOV R6, RZ"))))
    assert bool(found) == flagged


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="not a cubin"):
        S.disassemble(b"not an ELF file")
    with pytest.raises(ValueError, match="no SASS function"):
        S.parse("nothing here")
    with pytest.raises(ValueError, match="unknown label"):
        S.parse(_listing("BRA `(.L_x_9)\nEXIT"))


def test_missing_disassembler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S.metadata, "files", lambda name: [])
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-nvdisasm"):
        S.nvdisasm_path()
