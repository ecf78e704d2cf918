"""The CuTe DSL kernels compile without a GPU, for the right target, within their resource budgets.

CI subset (``registry.ci_variants()``: every kernel family at k3-shard B=8 and tiny B=1) for sm_90a,
the same families at tiny B=1 for sm_100a, and the launch glue of every family checked against the
TVM-FFI signature of the compiled op. The full matrix (66 variants x 2 archs) is marked slow.
Compiled artefacts are cached under .cache/kimik3-kernels/ (keyed by source hash, DSL version,
arch and shapes), so a second run is fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess

import pytest
from kimik3.kernels.toolchain import build as B
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain import registry as R

# how many @cute.kernel launches each op makes (one ptxas report block per kernel)
KERNELS_PER_FAMILY = {"gemv.plain": 1, "gemv.rmsnorm": 1, "gemv.residual": 1, "gemv.f32out": 1, "gemv.lm_head": 2,
                      "router": 2, "kda": 1, "mla": 2, "moe.bf16": 4, "moe.mxfp4": 4, "attn_res": 1}
TINY_B1 = [v for v in R.ci_variants() if v.preset == "tiny" and v.batch == 1]


def _check(result: B.BuildResult, v: R.KernelVariant, arch: str) -> None:
    ptx = result.ptx
    assert B.ptx_target(ptx) == arch, f"{v.name}: PTX targets {B.ptx_target(ptx)!r}, not {arch}"
    assert f".target {arch}" in ptx
    assert len(result.kernels) == KERNELS_PER_FAMILY[v.family], [k["name"] for k in result.kernels]
    assert all(k["arch"] == arch for k in result.kernels)
    assert result.resources["spill_stores"] == 0 and result.resources["spill_loads"] == 0, result.kernels
    assert result.resources["stack"] == 0, result.kernels
    assert ".local" not in ptx, f"{v.name}: local-memory depot in the PTX"
    assert B.check_budget(result, v.budget) == [], B.check_budget(result, v.budget)
    missing = [f for f in v.ptx_features if f not in ptx]
    assert not missing, f"{v.name}: PTX lacks {missing}"
    assert result.cubin[:4] == b"\x7fELF", "cubin is not an ELF image"


@pytest.fixture(autouse=True)
def _explicit_arch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # the build sets CUTE_DSL_ARCH itself; start each test from an explicit, different value to
    # prove that the requested arch (not the environment) decides the target
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@pytest.mark.parametrize("v", R.ci_variants(), ids=lambda v: v.name)
def test_ci_variant_compiles_for_sm90a(v: R.KernelVariant) -> None:
    _check(B.build(v, "sm_90a"), v, "sm_90a")


@pytest.mark.parametrize("v", TINY_B1, ids=lambda v: v.name)
def test_compiles_for_sm100a(v: R.KernelVariant, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "sm_100a" in v.archs, "every kernel here claims sm_100a (none uses Hopper-only instructions)"
    _check(B.build(v, "sm_100a"), v, "sm_100a")
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a", "arch_scope must restore CUTE_DSL_ARCH"


def test_arch_gating(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family that relied on Hopper-only instructions would list only sm_90a: build refuses others."""
    hopper_only = dataclasses.replace(R.FAMILIES["gemv.plain"], archs=("sm_90a",))
    monkeypatch.setitem(R.FAMILIES, "gemv.hopper_only", hopper_only)
    (v,) = R.variants_for(["tiny"], [1], ["gemv.hopper_only"])
    with pytest.raises(ValueError, match="does not support sm_100a"):
        B.build(v, "sm_100a")
    with pytest.raises(ValueError, match="unsupported arch"):
        B.build(R.get_variant("gemv.plain/tiny/b1"), "sm_80")


def test_arch_scope_sets_and_restores_env() -> None:
    from cutlass.cutlass_dsl import CuTeDSL

    with dsl.arch_scope("sm_100a"):
        assert os.environ["CUTE_DSL_ARCH"] == "sm_100a"
        assert CuTeDSL._get_dsl().envar.arch == "sm_100a"
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"
    with pytest.raises(ValueError, match="unsupported arch"):
        with dsl.arch_scope("sm_70"):
            pass


def test_disk_cache_hit_and_key() -> None:
    v = R.get_variant("gemv.plain/tiny/b1")
    first = B.build(v, "sm_90a")
    again = B.build(v, "sm_90a")
    assert again.cached and again.key == first.key and again.resources == first.resources
    assert str(B.cache_root()) in again.directory
    assert B.cache_key(v, "sm_100a") != B.cache_key(v, "sm_90a")
    assert B.cache_key(v, "sm_90a", source_hash="0" * 64) != first.key  # source changes invalidate
    other = R.get_variant("gemv.plain/tiny/b8")
    assert B.cache_key(other, "sm_90a") != first.key  # so do shapes


def test_fresh_compile_skips_cache(tmp_path) -> None:
    v = R.get_variant("gemv.f32out/tiny/b1")
    r = B.build(v, "sm_90a", use_cache=False, cache_dir=tmp_path)
    assert not r.cached and r.compiled is not None and r.compile_seconds > 0
    assert (tmp_path / os.path.basename(r.directory) / "result.json").exists()
    assert not list(tmp_path.glob(".build-*")), "temporary build directories must be cleaned up"


def test_export_compile_is_stored_as_the_build(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ahead-of-time export (TVM-FFI where available) compiles the same device code as build(): it puts that
    compile into the disk cache, and a later build() loads it; a fresh build() gives the same PTX and report."""
    from kimik3.kernels.toolchain import prebuilt as P

    monkeypatch.setenv("KIMIK3_KERNEL_CACHE", str(tmp_path / "cache"))
    name = "gemv.plain/tiny/b1"
    manifest = P.build_prebuilt("sm_90a", tmp_path / "out", [name], log=None)
    e = manifest["kernels"][name]
    v = R.get_variant(name)
    hit = B.build(v, "sm_90a")
    assert hit.cached and hit.ptx == (tmp_path / "out" / e["files"]["ptx"]).read_text()
    assert hit.kernels == e["ptxas"] and hit.cubin == (tmp_path / "out" / e["files"]["cubin"]).read_bytes()
    fresh = B.build(v, "sm_90a", use_cache=False, cache_dir=tmp_path / "fresh")
    assert fresh.ptx == hit.ptx and fresh.kernels == hit.kernels, f"export format {e['format']}: device code differs"


def test_no_artefacts_in_working_directory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    R.get_variant("gemv.plain/tiny/b1").compile("sm_90a")
    assert not list(tmp_path.iterdir()), "kept PTX/cubin must go to a dump dir, not the cwd"


PTXAS_SAMPLE = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kernel_cutlass_lm_head_kernel_abc_0' for 'sm_90a'
ptxas info    : Function properties for kernel_cutlass_lm_head_kernel_abc_0
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 85 registers, used 1 barriers
ptxas info    : Compiling entry function ''kernel_cutlass_argmax_kernel_def_1'' for ''sm_90a''
ptxas info    : Function properties for kernel_cutlass_argmax_kernel_def_1
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 16 registers, used 1 barriers, 512 bytes smem
"""


def test_parse_ptxas_report() -> None:
    ks = B.parse_ptxas_report(PTXAS_SAMPLE)
    assert [k["name"] for k in ks] == ["kernel_cutlass_lm_head_kernel_abc_0", "kernel_cutlass_argmax_kernel_def_1"]
    assert ks[0]["registers"] == 85 and ks[0]["spill_stores"] == 0 and ks[0]["barriers"] == 1
    assert (ks[1]["stack"], ks[1]["spill_stores"], ks[1]["spill_loads"], ks[1]["static_smem"]) == (24, 8, 12, 512)
    B._attach_smem(ks, {"lm_head": 256, "argmax": 32})
    assert ks[0]["shared_bytes"] == 256 and ks[1]["shared_bytes"] == 544
    res = B.BuildResult(name="x", arch="sm_90a", key="k", directory="", ptx_path="", cubin_path="", kernels=ks,
                        resources=B._aggregate(ks), shapes={}, source_hash="", dsl_version="", compile_seconds=0.0)
    bad = B.check_budget(res, R.Budget(max_registers=64, max_shared_bytes=512))
    assert any("85 registers" in b for b in bad) and any("spills" in b for b in bad)
    assert any("stack" in b for b in bad) and any("544 bytes shared" in b for b in bad)


def test_registry_shapes_follow_the_config() -> None:
    from kimik3.model.config import get_preset

    shard = get_preset("k3-shard")
    v = R.get_variant("moe.mxfp4/k3-shard/b64")
    assert v.shapes == dict(B=64, E=shard.n_routed_experts, L=shard.moe_latent_size, I=shard.moe_intermediate_size,
                            topk=shard.num_experts_per_tok)
    assert R.get_variant("mla/k3-shard/b1").runtime["scale"] == pytest.approx(192**-0.5)
    assert R.get_variant("kda/tiny/b8").shapes["lower_bound"] == -5.0
    names = [v.name for v in R.all_variants()]
    assert len(names) == len(set(names)) == len(R.FAMILIES) * len(R.PRESETS) * len(R.BATCHES)
    ci = R.ci_variants()
    assert {v.family for v in ci} == set(R.FAMILIES) and len(ci) == 2 * len(R.FAMILIES)
    with pytest.raises(ValueError, match="bad kernel variant name"):
        R.get_variant("gemv.plain/tiny")


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no standalone ptxas (CUDA toolkit) on PATH")
@pytest.mark.parametrize("name", ["moe.mxfp4/k3-shard/b8", "mla/k3-shard/b8", "kda/tiny/b1"])
def test_report_agrees_with_standalone_ptxas(name: str) -> None:
    """Cross-check the DSL's ptxas report with a CUDA toolkit ptxas run on the kept PTX."""
    r = B.build(R.get_variant(name), "sm_90a")
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", r.ptx_path, "-o", os.devnull], capture_output=True,
                         text=True, check=True)
    ours = {k["name"]: (k["registers"], k["spill_stores"]) for k in r.kernels}
    theirs = {k["name"]: (k["registers"], k["spill_stores"]) for k in B.parse_ptxas_report(out.stdout + out.stderr)}
    assert ours == theirs



# ---------------------------------------------------------------------------------------------- bytes in flight
# The weight-streaming fused kernels must keep >= 32 KiB of weight loads in flight per SM (Little's law at ~600 ns
# HBM latency: below that an SM cannot draw its share of the bandwidth). Per kernel of an op (by launch index, the
# ``_N`` suffix of its name): the 16-byte weight loads a lane issues before its first FMA, from the module's own
# constants and the variant's shapes. Resident CTAs follow from the compiled registers, as in kimik3.perfmodel.
def _gemv_loads(v: R.KernelVariant) -> dict[int, int]:
    g = v.module
    return {0: min(g.UNROLL, v.shapes["K"] // g.VEC // 32)}


def _moe_loads(v: R.KernelVariant) -> dict[int, int]:
    m, sh = v.module, v.shapes
    if v.variant == "mxfp4":  # 32-column groups (16 bytes of codes) per lane of a row
        return {1: 2 * min(m.UNROLL_FP4_GLU, sh["L"] // 32 // 32), 2: min(m.UNROLL_FP4, sh["I"] // 32 // 32)}
    return {1: 2 * min(m.UNROLL_BF16_GLU, sh["L"] // m.VEC // 32), 2: min(m.UNROLL_BF16, sh["I"] // m.VEC // 32)}


STREAMING = {"gemv.plain": _gemv_loads, "gemv.rmsnorm": _gemv_loads, "gemv.residual": _gemv_loads,
             "gemv.f32out": _gemv_loads, "gemv.lm_head": _gemv_loads, "moe.bf16": _moe_loads, "moe.mxfp4": _moe_loads}
THREADS = 128  # gemv.WARPS x 32 and moe.WARPS x 32


def _inflight_per_sm(result: B.BuildResult, loads: dict[int, int]) -> dict[str, int]:
    from kimik3.perfmodel.data import load_constants

    c = load_constants()
    out = {}
    for k in result.kernels:
        idx = int(k["name"].rsplit("_", 1)[1])
        if idx not in loads:
            continue
        alloc = -(-k["registers"] // int(c.register_alloc_granularity)) * int(c.register_alloc_granularity)
        resident = min(int(c.max_ctas_per_sm), int(c.max_threads_per_sm) // THREADS,
                       int(c.registers_per_sm) // (THREADS * alloc))
        out[f"{k['name'][15:40]}.._{idx} ({k['registers']} registers, {resident} CTAs)"] = (
            resident * THREADS * loads[idx] * 16)
    assert len(out) == len(loads), (sorted(loads), [k["name"] for k in result.kernels])
    return out


def _check_inflight(name: str) -> None:
    v = R.get_variant(name)
    got = _inflight_per_sm(B.build(v, "sm_90a"), STREAMING[v.family](v))
    low = {k: b for k, b in got.items() if b < 32 * 1024}
    assert not low, f"{name}: bytes in flight per SM below 32 KiB: {low}"


@pytest.mark.parametrize("family", sorted(STREAMING))
def test_weight_streams_keep_32kib_in_flight(family: str) -> None:
    """At k3-shard B = 8 (the CI compile, cached by the test above)."""
    _check_inflight(f"{family}/k3-shard/b8")


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("family", sorted(STREAMING))
def test_weight_streams_keep_32kib_in_flight_all_batches(family: str, batch: int) -> None:
    _check_inflight(f"{family}/k3-shard/b{batch}")


# ---------------------------------------------------------------------------------------------- launch glue
_SIG = re.compile(r"(\w+): (Tensor\(\[([\d, ]*)\], (\w+)\)|None|float|\w+)")


def _signature(err: str) -> list[tuple[str, str]]:
    body = re.search(r"when calling: `\w+\((.*)\)`", err, re.S).group(1)
    return [(m.group(1), m.group(2)) for m in _SIG.finditer(body)]


@pytest.mark.parametrize("v", TINY_B1, ids=lambda v: v.name)
def test_launch_glue_matches_compiled_signature(v: R.KernelVariant) -> None:
    """module.launch passes every parameter in the compiled order with the compiled shapes/dtypes.

    The op is compiled with TVM-FFI and called with CPU tensors: it checks the parameter count
    first ("Expects N parameters") and then rejects argument #0 for its device only, printing the
    full compiled signature, which is compared with the tensors launch() passed.
    """
    pytest.importorskip("tvm_ffi")
    import torch

    compiled = v.compile("sm_90a", tvm_ffi=True)
    t = v.reference.make_inputs(v.variant, **v.shapes, **v.runtime)
    passed: list = []
    real = dsl.launch

    def spy(c, args, tvm_ffi):  # record what launch() hands to the compiled function
        passed.extend(args)
        return real(c, args, tvm_ffi)

    dsl.launch = spy
    try:
        with pytest.raises(ValueError, match="expected device_type=cuda") as err:
            v.module.launch(compiled, v.variant, t, tvm_ffi=True)
    finally:
        dsl.launch = real
    sig = _signature(str(err.value))
    assert len(sig) == len(passed), (sig, len(passed))
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "uint8": torch.uint8}
    for (pname, ptype), arg in zip(sig, passed):
        if ptype == "None":
            assert arg is None, pname
        elif ptype.startswith("Tensor"):
            shape, dtype = re.match(r"Tensor\(\[([\d, ]*)\], (\w+)\)", ptype).groups()
            assert isinstance(arg, torch.Tensor), pname
            assert tuple(arg.shape) == tuple(int(s) for s in shape.split(",") if s.strip()), pname
            assert arg.dtype == dtypes[dtype], pname
        else:
            assert isinstance(arg, float), (pname, ptype)


# ---------------------------------------------------------------------------------------------- full matrix
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("v", R.all_variants(), ids=lambda v: v.name)
def test_full_matrix_compiles(v: R.KernelVariant, arch: str) -> None:
    _check(B.build(v, arch), v, arch)
