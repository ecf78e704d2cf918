"""PTX lint: the compiled kernels keep the synchronisation and streaming rules (``kernels/verify/ptx_lint.py``), and
each rule fails on a planted violation of the real PTX.

The kernels compiled here are the ones the compile tests build (same disk cache), so this adds seconds, not a
second compile.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from kimik3.kernels.toolchain import build as B  # noqa: E402
from kimik3.kernels.toolchain import registry as R  # noqa: E402
from kimik3.kernels.verify import ptx_lint as L  # noqa: E402

pytestmark = pytest.mark.host

MEGAKERNEL_SRC = Path(B.__file__).parents[1] / "megakernel" / "vm.py"  # the VM: its launch
H200_SMS = 132
# the dense variants, the one for MXFP4 routed experts (its expert opcodes decode codes and scales in registers) and
# one for rank programs: all among tests/test_megakernel_compile.py's CI builds, so these are disk-cache hits there
MEGAKERNELS = ["megakernel/tiny/b1", "megakernel/k3-shard/b8", "megakernel/tiny/b1-mxfp4", "megakernel/tiny-rank/b1"]
# a kernel built for rank programs (the code k3-rank's kernel compiles at the rack's shapes): its peers' counter
# words are signalled and polled at system scope
RANKS = "megakernel/tiny-rank/b1"


@pytest.fixture(autouse=True)
def _arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@pytest.fixture(scope="module")
def mk() -> B.BuildResult:
    return B.build(R.get_variant("megakernel/tiny/b1"), "sm_90a")


def _lint_megakernel(ptx: str, res: dict, *, registers: int | None = None, grid: int = H200_SMS,
                     source: str | Path = MEGAKERNEL_SRC) -> dict[str, list[str]]:
    return L.lint(ptx, registers=registers or res["registers"], shared_bytes=res["shared_bytes"], grid=grid,
                  num_sms=H200_SMS, arch="sm_90a", persistent=True, source=source, launch_function="megakernel")


@pytest.mark.parametrize("name", MEGAKERNELS)
def test_shipped_megakernel_passes(name: str) -> None:
    r = B.build(R.get_variant(name), "sm_90a")
    report = _lint_megakernel(r.ptx, r.resources)
    assert list(L.violations(report)) == []
    # the rules looked at something: a spin loop, a signal, a copy
    blocks = L.parse_blocks(r.ptx)
    assert any(any("ld.acquire.gpu" in s for i in body for _, s in blocks[i].lines)
               for _, body in L.natural_loops(blocks)), "no acquire spin loop found"
    assert "red.release.gpu" in r.ptx and "cp.async.cg.shared.global" in r.ptx


@pytest.mark.parametrize("v", [v for v in R.ci_variants() if v.family != "megakernel"], ids=lambda v: v.name)
def test_shipped_fused_kernels_pass(v: R.KernelVariant) -> None:
    r = B.build(v, "sm_90a")
    report = L.lint(r.ptx, registers=r.resources["registers"], shared_bytes=r.resources["shared_bytes"], grid=1,
                    num_sms=H200_SMS, arch="sm_90a", persistent=False)
    assert list(L.violations(report)) == []


@pytest.fixture(scope="module")
def mk_ranks() -> B.BuildResult:
    return B.build(R.get_variant(RANKS), "sm_90a")


def test_rank_kernel_signals_its_peers_at_system_scope(mk_ranks: B.BuildResult) -> None:
    assert L.peer_scope(mk_ranks.ptx) == []
    assert "red.release.sys.global.add" in mk_ranks.ptx  # the rule looked at a peer signal
    assert L.peer_scope(B.build(R.get_variant("megakernel/tiny/b1"), "sm_90a").ptx) == []  # no peers: nothing


@pytest.mark.parametrize("planted, message", [
    (("red.release.sys.global", "red.release.gpu.global"), "not a release at system scope"),
    (("red.release.sys.global", "red.relaxed.sys.global"), "not a release at system scope"),
    (("ld.acquire.sys.global", "ld.acquire.gpu.global"), "polls no counter word with a system-scope acquire"),
])
def test_planted_peer_scope_violation(mk_ranks: B.BuildResult, planted: tuple[str, str], message: str) -> None:
    ptx = mk_ranks.ptx.replace(*planted)
    assert ptx != mk_ranks.ptx
    assert any(message in m for m in L.peer_scope(ptx))


def test_planted_push_after_the_barrier(mk_ranks: B.BuildResult) -> None:
    """A store between the barrier and a peer signal (a push the release does not cover) is caught."""
    lines = mk_ranks.ptx.splitlines()
    sig = next(i for i, s in enumerate(lines) if "red.release.sys" in s)
    ptx = "\n".join(lines[:sig] + ["\tst.global.b32 \t[%rd1], %r1;"] + lines[sig:])
    assert any("not preceded by a CTA barrier" in m for m in L.release_after_barrier(ptx))


def test_planted_relaxed_signal(mk: B.BuildResult) -> None:
    ptx = mk.ptx.replace("red.release.gpu.global.add", "red.relaxed.gpu.global.add")
    assert any("not a release" in m for m in L.release_after_barrier(ptx))


def test_planted_missing_barrier_before_signal(mk: B.BuildResult) -> None:
    lines = mk.ptx.splitlines()
    sig = next(i for i, s in enumerate(lines) if "red.release.gpu" in s)
    bar = max(i for i in range(sig) if "bar.sync" in lines[i])
    ptx = "\n".join(lines[:bar] + lines[bar + 1:])
    assert any("not preceded by a CTA barrier" in m for m in L.release_after_barrier(ptx))


def test_planted_write_between_barrier_and_signal(mk: B.BuildResult) -> None:
    lines = mk.ptx.splitlines()
    sig = next(i for i, s in enumerate(lines) if "red.release.gpu" in s)
    planted = "\tst.global.b32 \t[%rd1], %r1;"
    ptx = "\n".join(lines[:sig] + [planted] + lines[sig:])
    assert any("not preceded by a CTA barrier" in m for m in L.release_after_barrier(ptx))


def test_planted_spin_without_backoff(mk: B.BuildResult) -> None:
    ptx = re.sub(r"^\s*nanosleep\.u32.*$", "", mk.ptx, flags=re.M)
    assert any("no back-off" in m for m in L.acquire_spin(ptx))


def test_planted_relaxed_spin(mk: B.BuildResult) -> None:
    ptx = mk.ptx.replace("ld.acquire.gpu.global", "ld.relaxed.gpu.global")
    assert any("without a GPU-scope acquire" in m for m in L.acquire_spin(ptx))


def test_planted_narrow_copy(mk: B.BuildResult) -> None:
    ptx = re.sub(r"(cp\.async\.)cg(\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*)16, 16", r"\1ca\g<2>8, 8",
                 mk.ptx)
    assert ptx != mk.ptx
    assert any("8-byte asynchronous copy" in m for m in L.wide_weight_copies(ptx))


def _plant_loop(ptx: str, load: str) -> str:
    """The real PTX with one more loop before the entry's last ``ret``: ``load``, then a counted back edge."""
    lines = ptx.splitlines()
    ret = max(i for i, s in enumerate(lines) if re.match(r"^\s*ret;", s))
    plant = ["$L__PLANTED:", f"\t{load}", "\tadd.s32 \t%r1, %r1, 1;", "\tsetp.lt.s32 \t%p1, %r1, 64;",
             "\t@%p1 bra \t$L__PLANTED;"]
    return "\n".join(lines[:ret] + plant + lines[ret:])


@pytest.mark.parametrize("load", ["ld.global.f32 \t%r2, [%rd1];", "ld.global.nc.b16 \t%rs1, [%rd1+2];",
                                  "ld.global.L1::evict_last.u8 \t%rs1, [%rd1];"])
def test_planted_scalar_load_loop(mk: B.BuildResult, load: str) -> None:
    """A hot loop of the real megakernel PTX whose one global load per trip is scalar is reported; the same loop
    with a 16-byte (or 2 x 32-bit) load is not."""
    base = L.scalar_load_loops(mk.ptx)  # the shipped kernel's own findings (none: test_shipped_megakernel_passes)
    planted = _plant_loop(mk.ptx, load)
    new = [m for m in L.scalar_load_loops(planted) if m not in base]
    assert len(new) == 1 and "scalar global load per iteration" in new[0] and load.split()[0] in new[0], new
    assert new[0].startswith("kernel_cutlass_megakernel_kernel:")
    assert new[0] in _lint_megakernel(planted, mk.resources)["no-scalar-load-loop"]
    for ok in ("ld.global.nc.v4.b32 \t{%r2, %r3, %r4, %r5}, [%rd1];", "ld.global.v2.b32 \t{%r2, %r3}, [%rd1];"):
        assert L.scalar_load_loops(_plant_loop(mk.ptx, ok)) == base


def test_scalar_load_loop_rule_on_a_hand_written_kernel() -> None:
    """What counts: exactly one global load per trip, scalar and narrower than 16 bytes, in any entry; a wait spin
    (ordered load or nanosleep) and an allow-listed entry do not; nested loops count their inner loads."""
    def entry(name: str, body: str) -> str:
        return f".visible .entry {name}(\n    .param .u64 p\n)\n{{\n{body}\n    ret;\n}}\n"

    one = "$L__A:\n    ld.global.b32 %r1, [%rd1];\n    setp.lt.s32 %p1, %r1, 2;\n    @%p1 bra $L__A;"
    assert len(L.scalar_load_loops(entry("k", one))) == 1
    # a second entry is linted too
    assert len(L.scalar_load_loops(entry("ok", "    mov.b32 %r1, 0;") + entry("k2", one))) == 1
    two = one.replace("[%rd1];", "[%rd1];\n    ld.global.b32 %r2, [%rd1+4];")
    assert L.scalar_load_loops(entry("k", two)) == []
    wide = one.replace("ld.global.b32 %r1", "ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}")
    assert L.scalar_load_loops(entry("k", wide)) == []
    spin = one.replace("ld.global.b32", "ld.acquire.gpu.global.b32")
    assert L.scalar_load_loops(entry("k", spin)) == []
    backoff = one.replace("@%p1", "nanosleep.u32 32;\n    @%p1")
    assert L.scalar_load_loops(entry("k", backoff)) == []
    assert L.scalar_load_loops(entry("kernel_cutlass_moe_align_kernel_x", one)) == []
    assert len(L.scalar_load_loops(entry("kernel_cutlass_moe_align_kernel_x", one), allow={})) == 1
    # an outer loop whose one scalar load sits next to an inner loop of wide loads: the inner loop carries the
    # stream, the outer's body holds more than one load, neither is reported; the inner loop alone would be
    nested = ("$L__O:\n    ld.global.b32 %r9, [%rd2];\n$L__I:\n    ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];"
              "\n    setp.lt.s32 %p1, %r1, 2;\n    @%p1 bra $L__I;\n    setp.lt.s32 %p2, %r9, 2;\n    @%p2 bra $L__O;")
    assert L.scalar_load_loops(entry("k", nested)) == []
    assert len(L.scalar_load_loops(entry("k", nested.replace("ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}",
                                                             "ld.global.nc.b16 %rs1")))) == 1
    # with line info (CUTE_DSL_LINEINFO=1: .loc lines, the .file table at the end) the source line is named
    located = entry("k", one.replace("    ld.global.b32", "    .loc 1 7 3\n    ld.global.b32"))
    located += '.file 1 "/x/mk_k.py"\n'
    assert "(source mk_k.py:7)" in L.scalar_load_loops(located)[0]
    assert L.global_load_bytes("ld.global.nc.L1::no_allocate.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];") == (16, False)
    assert L.global_load_bytes("ld.global.v2.b16 {%rs1, %rs2}, [%rd1];") == (4, True)
    assert L.global_load_bytes("ld.shared.b32 %r1, [%r2];") is None
    assert L.global_load_bytes("@%p1 ld.global.b64 %rd1, [%rd2];") == (8, True)


def test_planted_occupancy(mk: B.BuildResult) -> None:
    # two CTAs per SM (grid twice the SM count) cannot be resident with 384 threads x 128 registers each
    assert L.occupancy(mk.ptx, 128, mk.resources["shared_bytes"], 2 * H200_SMS, H200_SMS, "sm_90a")
    assert L.occupancy(mk.ptx, 200, mk.resources["shared_bytes"], H200_SMS, H200_SMS, "sm_90a")
    assert L.occupancy(mk.ptx, 64, 240 * 1024, H200_SMS, H200_SMS, "sm_90a")
    assert L.occupancy(mk.ptx, mk.resources["registers"], mk.resources["shared_bytes"], H200_SMS, H200_SMS,
                       "sm_90a") == []


def test_planted_non_cooperative_launch() -> None:
    src = MEGAKERNEL_SRC.read_text()
    assert "cooperative=True" in src
    assert L.cooperative_launch(src, "megakernel") == []
    assert L.cooperative_launch(src.replace("cooperative=True", "cooperative=False"), "megakernel")
    assert L.cooperative_launch(src.replace("cooperative=True,", ""), "megakernel")


def test_cfg_on_a_hand_written_kernel() -> None:
    """A small hand-written entry: a fenced signal on one path and an unfenced one on the other."""
    ptx = """
.visible .entry k(
    .param .u64 p
)
{
    ld.param.u64 %rd1, [p];
    setp.eq.s32 %p1, %r1, 0;
    @%p1 bra $L__A;
    st.global.b32 [%rd1], %r2;
    bar.sync 0;
    bra.uni $L__B;
$L__A:
    st.global.b32 [%rd1], %r3;
$L__B:
    red.release.gpu.global.add.s32 [%rd1], 1;
$L__SPIN:
    ld.acquire.gpu.global.b32 %r4, [%rd1];
    setp.lt.s32 %p2, %r4, 2;
    @%p2 bra $L__SPIN;
    ret;
}
"""
    assert any("not preceded by a CTA barrier" in m for m in L.release_after_barrier(ptx))
    fenced = ptx.replace("$L__B:\n", "$L__B:\n    bar.sync 0;\n")
    assert L.release_after_barrier(fenced) == []
    assert any("no back-off" in m for m in L.acquire_spin(ptx))
    assert L.acquire_spin(ptx.replace("@%p2 bra $L__SPIN;", "nanosleep.u32 64;\n    @%p2 bra $L__SPIN;")) == []
