"""The persistent megakernel compiles without a GPU, for the requested target, within its budget, and its PTX holds
the synchronisation the design relies on; the host side (static shapes, device contract, prebuilt export, launch
signature) is checked on the CPU.

Compiling is the cost, so by default only tiny B=1 for sm_90a and sm_100a, k3-shard B=8 and tiny B=33 (the GEMV
opcodes' pass groups) for sm_90a, tiny B=1 with MXFP4 routed experts (``MKConfig.fp4``) for sm_90a, and micro B=1
exported through the prebuilt path with TVM-FFI; artefacts are cached by source hash (``build.py``), so a second run
only re-exports micro. The full matrix (every preset x batch 1, 8, 16, 32, 33, 64 x arch, dense and MXFP4) is marked
slow.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

from kimik3.kernels.toolchain import build as B  # noqa: E402
from kimik3.kernels.toolchain import registry as R  # noqa: E402

from kimik3.megakernel import build_program  # noqa: E402
from kimik3.megakernel.gpu import check_device_contract  # noqa: E402
from kimik3.megakernel.instructions import Op, Operand  # noqa: E402
from kimik3.megakernel.kernel_shapes import MAX_BUFS, MAX_CTRS, MAX_INSTR, PROG_WORDS, static_shapes, variant_name  # noqa: E402

# tiny-rank: the loopback check's kernel (every rank of tiny over 2 in one launch: the local-rank table), built for
# rank programs (MKConfig.ranks: the collective opcodes, pushes, system-scope counters); k3-rank, one rank's program
# of the rack, compiles the same code at the rack's shapes (the slow matrix)
# tiny/b33: the GEMV opcodes' pass groups (3 passes for one weight, 2 for two, the last pass partial)
CI_SM90 = ["megakernel/tiny/b1", "megakernel/k3-shard/b8", "megakernel/tiny/b1-mxfp4", "megakernel/tiny-rank/b1",
           "megakernel/tiny/b33"]
CI_SM100 = ["megakernel/tiny/b1"]
# the design's synchronisation, in the PTX: acquire spin with back-off, release signal, first-error CAS, error-word
# poll, timestamps, SM id, asynchronous weight prefetch into smem, CTA barriers
SYNC_FEATURES = ("ld.acquire.gpu.global.b32", "red.release.gpu.global.add", "nanosleep.u32", "atom.global.cas",
                 "ld.relaxed.gpu.global.b32", "%globaltimer", "%smid", "cp.async.cg.shared.global",
                 "cp.async.commit_group", "cp.async.wait_group", "bar.sync")
BUDGET_TEXT = "<= 168 registers (384 threads), 0 spills, 0 stack, <= 160 KiB shared memory"


@pytest.fixture(autouse=True)
def _explicit_arch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # an explicit CUTE_DSL_ARCH that differs from some requested targets: the requested arch must win
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


def _check(result: B.BuildResult, v: R.KernelVariant, arch: str) -> None:
    ptx = result.ptx
    assert B.ptx_target(ptx) == arch, f"{v.name}: PTX targets {B.ptx_target(ptx)!r}, not {arch}"
    assert [k["name"].startswith("kernel_cutlass_megakernel_kernel") for k in result.kernels] == [True]
    assert result.resources["spill_stores"] == 0 and result.resources["spill_loads"] == 0, result.kernels
    assert result.resources["stack"] == 0 and ".local" not in ptx, result.kernels
    assert B.check_budget(result, v.budget) == [], (BUDGET_TEXT, B.check_budget(result, v.budget))
    missing = [f for f in (*v.ptx_features, *SYNC_FEATURES) if f not in ptx]
    assert not missing, f"{v.name}: PTX lacks {missing}"
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    entry = re.search(r"\.entry\s+\w+\((.*?)\)", ptx, re.S).group(1)
    params = re.findall(r"\.param\s+\.align\s+8\s+\.b8\s+\w+\[(\d+)\]", entry)
    assert params == ["8"] * 8, f"every parameter must be one pointer (prebuilt export), got {params}"
    assert result.cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", CI_SM90)
def test_compiles_for_sm90a(name: str) -> None:
    v = R.get_variant(name)
    _check(B.build(v, "sm_90a"), v, "sm_90a")


@pytest.mark.parametrize("name", CI_SM100)
def test_compiles_for_sm100a(name: str) -> None:
    v = R.get_variant(name)
    assert "sm_100a" in v.archs, "no Hopper-only instruction (wgmma/TMA) is used: sm_100a is claimed"
    _check(B.build(v, "sm_100a"), v, "sm_100a")
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a", "arch_scope must restore CUTE_DSL_ARCH"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", [f"megakernel/{p}/b{b}{f}" for p in ("micro", "tiny", "k3-shard")
                                  for b in (1, 8, 16, 32, 33, 64) for f in ("", "-mxfp4")]
                         + [f"megakernel/k3-rank/b{b}-mxfp4" for b in (1, 8)])
def test_full_matrix(name: str, arch: str) -> None:
    v = R.get_variant(name)
    _check(B.build(v, arch), v, arch)


def test_only_a_rank_kernel_carries_the_cross_rank_code() -> None:
    """The kernel built for a rank program signals its peers' counter words with system-scope releases and polls
    its own cross-rank words with system-scope acquires; one GPU's kernel compiles none of it (MKConfig.ranks)."""
    ranks = B.build(R.get_variant("megakernel/tiny-rank/b1"), "sm_90a").ptx
    single = B.build(R.get_variant("megakernel/tiny/b1-mxfp4"), "sm_90a").ptx
    assert "red.release.sys.global.add" in ranks and "ld.acquire.sys.global" in ranks
    assert "red.release.sys" not in single and "ld.acquire.sys" not in single
    assert static_shapes("k3-rank", 1, expert_format="mxfp4")["ranks"] is True
    assert static_shapes("tiny-rank", 1)["ranks"] is True
    assert static_shapes("tiny", 1)["ranks"] is False


# The VM's header check reads word H_EXPERT_FORMAT (byte 88 of the program) in the entry block, next to the magic
HEADER_FORMAT_LOAD = re.compile(r"ld\.global\.b32\s+%r\d+,\s*\[%rd\d+\+88\]")


def test_mxfp4_variant_reads_codes_and_scales() -> None:
    """The MXFP4 kernel streams the expert codes as 16-byte groups prefetched into L1 with their scale bytes, decodes
    them straight into bf16x2 tensor-core fragments (placed bits times the bf16x2 scale; x put in the same order with
    prmt; no sm_100a-only e2m1 conversion, no round trip through fp32) for mma.sync, and both kernels check the
    program's expert format; the dense kernel has none of the MXFP4 instructions."""
    fp4 = B.build(R.get_variant("megakernel/tiny/b1-mxfp4"), "sm_90a").ptx
    dense = B.build(R.get_variant("megakernel/tiny/b1"), "sm_90a").ptx
    for feature in ("prefetch.global.L1", "ld.global.nc.b8", "mul.bf16x2", "prmt.b32", "ld.global.nc.v4.b32",
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"):
        assert feature in fp4, feature
    assert "mul.bf16x2" not in dense and "prefetch.global.L1" not in dense and "e2m1" not in fp4
    assert "cvt.f32.f16" not in fp4  # the fp16-placement decode of the CUDA-core path is gone
    assert HEADER_FORMAT_LOAD.search(fp4) and HEADER_FORMAT_LOAD.search(dense)


def test_ptx_structure_of_the_wait_loop() -> None:
    """The acquire load sits in a loop with the back-off and the watchdog's error-word poll; the two timestamps
    bracket the dispatch; the release is the only signal (no plain atomic add on a counter)."""
    ptx = B.build(R.get_variant("megakernel/tiny/b1"), "sm_90a").ptx
    order = [m.group(0) for m in re.finditer(r"ld\.acquire\.gpu|nanosleep|ld\.relaxed\.gpu|atom\.global\.cas|"
                                             r"%globaltimer|red\.release\.gpu|cp\.async\.cg|cp\.async\.wait_group",
                                             ptx)]
    assert order.index("cp.async.cg") < order.index("ld.acquire.gpu"), "prefetch is issued before the waits"
    spin = order[order.index("ld.acquire.gpu"):]
    assert {"nanosleep", "ld.relaxed.gpu", "atom.global.cas"} <= set(spin)
    assert order.count("%globaltimer") == 2 and order.count("red.release.gpu") == 1
    assert order.index("red.release.gpu") < len(order) - 1 - order[::-1].index("%globaltimer")
    assert "atom.global.add" not in ptx and "red.global.add" not in ptx, "counters are only ever released"


def test_stage_pipeline_waits_one_group_behind() -> None:
    """Design v2: the next instruction's stage copies are issued before this instruction's waits and stay in
    flight while it runs, so the VM waits for its cp.async groups with ``wait_group 1`` right before the dispatch
    barrier (its own stage has landed, the next one's may not have), after the waits' acquire loads; every copy
    before that wait is committed (the group count is what ``wait_group 1`` counts), and the only full wait
    (``wait_group 0``) before it is warp 0's instruction-row wait, ahead of the stage copies (the others drain the
    copies at a gap in the queue and at the CTA's exit)."""
    ptx = B.build(R.get_variant("megakernel/tiny/b1"), "sm_90a").ptx
    lines = [s.split("//", 1)[0].strip() for s in ptx.splitlines()]
    at = {k: [i for i, s in enumerate(lines) if re.match(p, s)] for k, p in (
        ("copy", r"cp\.async\.cg\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*16\b"),
        ("commit", r"cp\.async\.commit_group"), ("acquire", r"ld\.acquire\.gpu"),
        ("wait0", r"cp\.async\.wait_group\s+0\s*;"), ("wait1", r"cp\.async\.wait_group\s+1\s*;"))}
    assert len(at["wait1"]) == 1, "one wait_group 1: the VM's wait for its own stage"
    (w1,) = at["wait1"]
    assert lines[w1 + 1].startswith("bar.sync"), "the stage wait is followed by the dispatch barrier"
    acq = [i for i in at["acquire"] if i < w1]
    assert acq, "the waits' acquire loads come before the stage wait"
    before = [i for i in at["copy"] if i < acq[0]]
    after = [i for i in at["copy"] if acq[-1] < i < w1]
    # the instruction row (first position), its own stage, the next position's stage: all before the waits;
    # the next position's row after them
    assert len(before) >= 3 and len(after) >= 1, (before, after)
    assert all(any(c < k < w1 for k in at["commit"]) for c in before + after), "a copy left out of every group"
    zeros = at["wait0"]
    assert len([i for i in zeros if i < w1]) == 1 and zeros[0] < before[1], "only warp 0's row wait precedes it"
    assert zeros[-1] > w1, "the CTA drains its copies before it exits"


def test_registered_and_buildable_through_the_cli_paths() -> None:
    v = R.get_variant("megakernel/k3-shard/b8")
    assert v.spec is R.PERSISTENT["megakernel"] and v.module_name == "megakernel"
    assert v.shapes == static_shapes("k3-shard", 8)
    assert "megakernel" not in R.FAMILIES, "kept out of the fused-kernel families their tests enumerate"
    assert any(x.family == "megakernel" for x in R.variants_for(["tiny"], [1])), "built by default"
    assert [x.name for x in R.variants_for(["tiny"], [1], ["megakernel"])] == ["megakernel/tiny/b1"]
    from kimik3.kernels.toolchain.source import DEPENDENCIES, kernel_source_hash

    assert DEPENDENCIES["megakernel"] == ("megakernel.device_fns",)
    from kimik3.kernels.megakernel import vm as mk

    assert mk.SOURCE_HASH == kernel_source_hash("megakernel")
    # MXFP4 routed experts: a variant per format, named and shaped as the host names and shapes it
    f = R.get_variant("megakernel/k3-shard/b8-mxfp4")
    assert f.name == variant_name("k3-shard", 8, "mxfp4") and f.expert_format == "mxfp4"
    assert f.shapes == static_shapes("k3-shard", 8, expert_format="mxfp4") and f.shapes["fp4"] and not v.shapes["fp4"]
    assert [x.name for x in R.variants_for(["tiny"], [1], ["megakernel", "moe.mxfp4"], ("dense", "mxfp4"))] == [
        "megakernel/tiny/b1", "megakernel/tiny/b1-mxfp4", "moe.mxfp4/tiny/b1"]
    for bad in ("megakernel/tiny/b1-dense", "moe.bf16/tiny/b1-mxfp4", "megakernel/tiny/b1-fp8"):
        with pytest.raises(ValueError, match="bad kernel variant name"):
            R.get_variant(bad)
    with pytest.raises(ValueError, match="unknown expert formats"):
        R.variants_for(["tiny"], [1], ["megakernel"], ("fp8",))


def test_static_shapes_follow_the_config() -> None:
    from kimik3.model.config import get_preset

    c = get_preset("k3-shard")
    s = static_shapes(c, 64)
    assert (s["B"], s["H"], s["dk"], s["nh_kda"], s["kvl"], s["rope"], s["E"], s["topk"]) == (
        64, 7168, 128, 96, 512, 64, 56, 16)
    assert s["dmax"] == 56 and s["kmax"] == c.attn_res_slots + 1 and s["kda_lb"] == -5.0 and s["situ"]
    assert s["mla_scale"] == pytest.approx(192**-0.5)
    assert (s["prog_words"], s["max_instr"], s["max_bufs"], s["max_ctrs"]) == (PROG_WORDS, MAX_INSTR, MAX_BUFS,
                                                                               MAX_CTRS)
    assert static_shapes("tiny", 1)["dmax"] == 4  # min(E, B·k)


@pytest.mark.parametrize("preset", ["micro", "tiny", "k3-shard"])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_device_contract_holds(preset: str, batch: int) -> None:
    """Every program the scheduler builds for 132 SMs fits what the device code assumes (dtypes per operand,
    16-byte aligned vector rows, capacities)."""
    from kimik3.model.config import get_preset

    p = build_program(preset, batch, 132, max_seq_len=64)
    assert check_device_contract(p, get_preset(preset), batch) == []


def test_device_contract_catches_planted_problems() -> None:
    from kimik3.model.config import get_preset

    cfg = get_preset("micro")
    p = build_program(cfg, 2, 8, max_seq_len=16)
    i = next(k for k, x in enumerate(p.instructions) if x.op == Op.NORM_PROJ)
    ins = p.instructions[i]
    w = ins.operands[2]
    shifted = Operand(w.buf, w.mode, (*w.box[:4], 3, w.box[5]))  # a weight row read from column 3: misaligned
    p.instructions[i] = dataclasses.replace(ins, operands=(*ins.operands[:2], shifted, ins.operands[3]))
    j = next(k for k, x in enumerate(p.instructions) if x.op == Op.ROUTER)
    r = p.instructions[j]
    p.instructions[j] = dataclasses.replace(r, operands=(*r.operands[:2], r.operands[3], *r.operands[3:]))
    problems = check_device_contract(p, cfg, 2)  # ^ the fp32 slot weights where the int64 expert ids belong
    assert any(f"#{i}" in m and "not 16-byte aligned" in m for m in problems), problems
    assert any(f"#{j}" in m and "operand 2 (moe_w) is torch.float32, device code reads torch.int64" in m
               for m in problems), problems
    assert check_device_contract(p, cfg, 4)[0].startswith("program built for batch 2")
    grouped = dataclasses.replace(cfg, n_group=2, topk_group=1)
    assert any("grouped routing" in m for m in check_device_contract(build_program(cfg, 2, 8, max_seq_len=16),
                                                                     grouped, 2))


def test_prebuilt_export_and_launch_signature(tiny_prebuilt: Path, tmp_path: Path) -> None:
    """The prebuilt path exports the megakernel (pointer-only entry, budget met); with TVM-FFI the loaded function
    takes exactly the eight tensors of the runner (the last two: the peer table and the local-rank table) plus the
    CTA count, and refuses CPU tensors by device only. The export is the device check's (``tiny`` batch 1, built
    once per session)."""
    from kimik3.kernels.toolchain import prebuilt as P

    name = "megakernel/tiny/b1"
    e = P.read_manifest(tiny_prebuilt)["kernels"][name]
    assert e["budget_violations"] == [] and e["module"] == "megakernel"
    (entry,) = e["entries"]
    assert entry["pointer_only"] and entry["param_bytes"] == [8] * 8 and entry["block"] == [384, 1, 1]
    assert entry["dynamic_shared_bytes"] > 64 * 1024
    if e["format"] != "tvm-ffi":
        pytest.skip("apache-tvm-ffi or g++ missing: cubin export only")
    local = shutil.copytree(tiny_prebuilt, tmp_path / "prebuilt")  # loading unpacks the runtime: not in the shared one
    k = P.load_prebuilt(local, name, arch="sm_90a", shapes=R.get_variant(name).shapes)
    s = static_shapes("tiny", 1)
    args = [torch.zeros(s["prog_words"], dtype=torch.int32), torch.zeros(s["max_bufs"], dtype=torch.int64),
            torch.zeros(s["max_ctrs"], dtype=torch.int32), torch.zeros(s["max_instr"], 3, dtype=torch.int64),
            torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), torch.zeros(128, dtype=torch.int64),
            torch.zeros(40, dtype=torch.int64)]
    with pytest.raises(ValueError, match="expected device_type=cuda"):
        k(*args, 1)


def test_timing_buffer_feeds_the_timeline() -> None:
    """The kernel's timing rows (start ns, end ns, %smid) are what ``timeline.from_timings`` reads."""
    from kimik3.megakernel.timeline import from_timings, summary

    p = build_program("micro", 1, 4, max_seq_len=16)
    n = len(p.instructions)
    t = torch.zeros(n, 3, dtype=torch.int64)
    for s, q in enumerate(p.queues):
        clock = 1_000_000 + 100 * s
        for v in q:
            t[v] = torch.tensor([clock + 50, clock + 450, 7 + s])
            clock += 500
    tl = from_timings(p, t)
    assert set(tl["sm"]) <= {7, 8, 9, 10} and tl["start_ns"].min() == 0
    assert (tl["end_ns"] - tl["start_ns"] == 400).all()
    assert summary(tl).attrs["makespan_us"] > 0


def test_stage_refuses_cpu() -> None:
    import kimik3
    import kimik3.megakernel.gpu  # noqa: F401  (registers the stage)
    from kimik3.decoder import Decoder

    model = kimik3.from_preset("micro", seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs on a CUDA GPU .*not on cpu"):
        Decoder(model, "megakernel", batch_size=1, max_seq_len=16)
