"""Stage "fused" (CuTe DSL kernels composed into one decode step).

On a CPU: the stage refuses (device, shapes), the plan covers tiny and k3-shard and refuses micro and non-K3
configs, the host-side replicas of kernel constants and parameter orders match the kernel modules, every launch
of the program matches its compiled TVM-FFI signature, and the whole composition — with each kernel replaced by
its PyTorch reference — matches naive (bf16 teacher-forced, and with MXFP4 experts against the dequantised model).

On a GPU (skipped here with "no CUDA device"): the real kernels against naive with ``compare_to_reference``,
tiny and k3-shard, batch 1 / 8 / 64, bf16 teacher-forced; MXFP4 experts; determinism. Kernels come from the JIT
when the CuTe DSL is installed, else from ``$KIMIK3_PREBUILT`` (``scripts/device_check.py --build-prebuilt``).
``KIMIK3_QUICK=1`` drops batch 64.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest
import torch
from kimik3.kernels.contracts.meta import (
    ARG_ORDER,
    attn_res_threads,
    head_routing,
    kda_head_dim_ok,
    mla_default_splits,
    mla_head_layout,
)
from kimik3.kernels.toolchain.targets import fused_cases

import kimik3
from kimik3.fused.loading import _find_prebuilt, _prebuilt_cache_len, load_kernels
from kimik3.fused.plan import FAMILY_MODULES, FusedStep, fused_ops, plan_errors
from kimik3.fused.runners import ReferenceRunner
from kimik3.model.config import get_preset
from kimik3.model.quant import mxfp4_quantize as mxfp4_pack
from kimik3.model.random_init import build_model
from kimik3.stages.fused import FusedStage
from kimik3.validation import bf16_pair, mixed_lengths
from kimik3.validation.metric import TOL, rel_error

CUDA = torch.cuda.is_available()
QUICK = os.environ.get("KIMIK3_QUICK") == "1"


def small_cfg():
    """tiny's widths (every kernel supports them) with fewer layers, experts and vocabulary, so the CPU
    composition test runs in seconds: KDA x3, MLA, KDA, MLA; AttnRes blocks of 4 (mixes of 2 and 3 candidates);
    a dense first layer, LatentMoE after."""
    return get_preset("tiny").replace(name="tiny-fused-test", num_hidden_layers=6, kda_layers=(0, 1, 2, 4),
                                      vocab_size=2048, n_routed_experts=16, intermediate_size=512)


def _meta(cfg):
    return build_model(cfg, "meta").cast_(torch.bfloat16)


def _with_mxfp4_experts(model):
    """A copy whose routed experts hold exactly their MXFP4 values (dequantised, exact in bf16)."""
    from kimik3.model.checkpoint import mxfp4_dequantize

    out = copy.deepcopy(model)
    for layer in out.model.layers:
        if layer.is_moe:
            ex = layer.block_sparse_moe.experts
            for name in ("w1", "w3", "w2"):
                w = getattr(ex, name).data
                E, R, C = w.shape
                step = max(1, 2**26 // (R * C))  # experts per chunk: bounded temporaries on a GPU too
                for e0 in range(0, E, step):
                    packed, scale = mxfp4_pack(w[e0:e0 + step])
                    n = packed.shape[0] * R
                    deq = mxfp4_dequantize(packed.reshape(n, C // 2), scale.reshape(n, C // 32), torch.float32)
                    w[e0:e0 + step] = deq.view(-1, R, C).to(w.dtype)
    return out


# ====================================================================== refusals and the plan


def test_refuses_cpu():
    model = kimik3.from_preset("micro", seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"stage 'fused' runs the CuTe DSL kernels on a CUDA GPU .*on cpu"):
        FusedStage(model, 1, 16)
    from kimik3.stages import STAGES

    if "fused" in STAGES:  # registered by kimik3/stages/__init__.py
        with pytest.raises(ValueError, match="stage 'fused' runs the CuTe DSL kernels on a CUDA GPU"):
            kimik3.Decoder(model, stage="fused", batch_size=1, max_seq_len=16)


def test_refuses_micro_head_dim():
    errs = plan_errors(get_preset("micro"), 1, 64)
    assert any("kda_head_dim=16" in e for e in errs), errs
    assert any("kv_lora_rank % 128" in e for e in errs), errs
    with pytest.raises(ValueError, match=r"no kernel path for micro .*head dims 32, 64 and 128"):
        FusedStep(_meta(get_preset("micro")), 1, 64)


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-linear-48b-a3b"])
def test_refuses_other_families(preset):
    errs = plan_errors(get_preset(preset), 1, 64)
    assert any("Attention Residuals" in e for e in errs) and any("SiTU" in e for e in errs), errs


def test_refuses_bad_options():
    assert any("expert_format" in e for e in plan_errors(get_preset("tiny"), 1, 64, "fp8"))
    with pytest.raises(ValueError, match="kernels must be one of"):
        load_kernels([], "sm_90a", "magic")
    with pytest.raises(ValueError, match="not sm_80a"):
        load_kernels([], "sm_80a", "prebuilt")


@pytest.mark.parametrize("preset", ["tiny", "k3-shard"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_plan_supports_tiny_and_k3_shard(preset, fmt):
    assert plan_errors(get_preset(preset), 8, 4096, fmt) == []
    ops = fused_ops(preset, 8, fmt)
    fams = {o.family for o in ops}
    assert fams <= set(FAMILY_MODULES)
    assert {"gemv.rmsnorm", "gemv.residual", "gemv.lm_head", "kda", "mla", "router", "attn_res", "moe.heads",
            f"moe.{fmt}"} <= fams
    assert len({o.key for o in ops}) == len(ops)  # deduplicated: one kernel per distinct shape


def test_k3_shard_ops_reuse_the_registry_shapes():
    """Where a registry variant has the shape the step needs, the op is the same kernel (a prebuilt directory built
    with `python -m kimik3 kernels build` serves the stage)."""
    from kimik3.kernels.toolchain import registry

    ops = {(o.family, json.dumps(o.shapes, sort_keys=True, default=str)) for o in fused_ops("k3-shard", 8)}
    for fam in ("gemv.rmsnorm", "gemv.residual", "gemv.lm_head", "kda", "mla", "router", "moe.bf16", "attn_res"):
        v = registry.get_variant(f"{fam}/k3-shard/b8")
        assert (fam, json.dumps(v.shapes, sort_keys=True, default=str)) in ops, fam


def test_program_bytes_match_the_cost_model():
    """The kernels' own shapes move what kimik3.perf.cost says one step must move (±2 %), and the PyTorch glue that is
    left is small."""
    from kimik3.perf.cost import decode_cost

    fs = FusedStep(_meta(get_preset("k3-shard")), 1, 4096)
    df = fs.describe(context=1024)
    kernel = df[df.kind == "kernel"].bytes.sum()
    glue = df[df.kind == "glue"].bytes.sum()
    assert abs(kernel / decode_cost("k3-shard", 1, 1024).total_bytes - 1) < 0.02
    assert glue < 1e-3 * kernel
    assert set(df.kind) == {"kernel", "glue"} and (df[df.kind == "glue"].note != "").all()


def test_residual_slots_follow_the_model():
    """Mix sizes: every AttnRes mix reads a prefix of the residual slots, as DecoderLayer.residual builds R + [p]."""
    fs = FusedStep(_meta(small_cfg()), 2, 64)
    nc = [ln.op.shapes["NC"] for ln in fs.program if ln.op is not None and ln.op.family == "attn_res"]
    # layer 0: only the FFN mix (R empty before it); layers 1-3: R = [embedding] + p; layer 4 mixes before its
    # block boundary (2), then R holds two block sums (3); layer 5 and the output mix: 3
    assert nc == [2] + [2, 2] * 3 + [2, 3] + [3, 3] + [3]
    assert fs.n_slots == 3


def test_prebuilt_cache_len_choice(tmp_path: Path):
    cfg = get_preset("k3-shard")
    shapes = dict(B=8, nh=96, DL=512, DR=64)
    kernels = {f"k{S}": {"module": "mla_decode", "arch": "sm_90a", "shapes": {**shapes, "S": S}} for S in (512, 4096)}
    (tmp_path / "manifest.json").write_text(json.dumps({"kernels": kernels}))
    assert _prebuilt_cache_len(tmp_path, cfg, 8, "sm_90a", 300) == 512
    assert _prebuilt_cache_len(tmp_path, cfg, 8, "sm_90a", 600) == 4096
    assert _prebuilt_cache_len(tmp_path, cfg, 8, "sm_90a", 5000) is None
    assert _prebuilt_cache_len(tmp_path, cfg, 1, "sm_90a", 300) is None
    assert _prebuilt_cache_len(tmp_path, cfg, 8, "sm_100a", 300) is None


# ====================================================================== replicas vs the kernel modules


def test_replicas_match_the_kernel_modules():
    pytest.importorskip("cutlass")
    from kimik3.kernels.fused import attn_res, gemv, kda, mla_decode, moe
    from kimik3.kernels.reference import moe as moe_ref
    from kimik3.kernels.toolchain import registry

    for nh in (1, 2, 3, 6, 16, 96, 128):
        assert mla_head_layout(nh) == mla_decode.head_layout(nh)
        for B in (1, 8, 64):
            for S in (64, 256, 4096):
                assert mla_default_splits(B, nh, S) == mla_decode.default_splits(B, nh, S)
    for H in (64, 384, 7168):
        for NC in range(1, 10):
            assert attn_res_threads(H, NC) == attn_res.threads_for(H, NC)
    for D in (16, 32, 48, 64, 96, 128, 256):
        try:
            kda._layout(D)
            ok = True
        except AssertionError:
            ok = False
        assert kda_head_dim_ok(D) == ok, D
    for B, NH in ((1, 96), (8, 6), (64, 3)):
        a, b = head_routing(B, NH), moe_ref.head_routing(B, NH)
        assert all(torch.equal(a[k], b[k]) for k in b)
    from kimik3.fused import plan as fused
    from kimik3.scope import gates  # the fused gate's rules read the same constants

    assert gates.GEMV_RMS_EPS == gemv.RMS_EPS == attn_res.EPS == kda.NORM_EPS
    assert fused.LM_ROWS_PER_CTA == gates.LM_ROWS_PER_CTA == gemv.WARPS * gemv.LM_ROWS_PER_WARP
    assert gates.SITU_BETAS == (moe.SITU_BETA, moe.SITU_BETA_LIN)
    for fam, (mod, var) in FAMILY_MODULES.items():
        if fam in registry.FAMILIES:
            assert (registry.FAMILIES[fam].module, registry.FAMILIES[fam].variant) == (mod, var)


def test_arg_order_matches_module_launch(monkeypatch):
    """ARG_ORDER (used on GPU machines without the DSL) = the order each module's launch() passes."""
    pytest.importorskip("cutlass")
    from kimik3.kernels.toolchain import dsl as C
    from kimik3.kernels.toolchain import registry
    from kimik3.kernels.toolchain.source import OPS

    for (mod_name, variant), order in ARG_ORDER.items():
        mod = __import__(f"kimik3.kernels.{OPS[mod_name]}", fromlist=["launch"])
        t = {k: f"<{k}>" for k in order}
        passed: list = []
        monkeypatch.setattr(C, "launch", lambda c, args, tvm_ffi, out=passed: out.extend(args))
        if variant == "heads":
            mod.launch_heads(None, t, tvm_ffi=True)
        else:
            mod.launch(None, variant, t, tvm_ffi=True)
        assert passed == [f"<{k}>" for k in order], (mod_name, variant)
    assert {(f.module, f.variant) for f in registry.FAMILIES.values()} <= set(ARG_ORDER)


def test_mxfp4_pack_matches_checkpoint():
    from kimik3.model.checkpoint import mxfp4_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=g) * torch.logspace(-3, 1, 96)
    w[0, 0, :32] = 0.0  # an all-zero block
    w[1, 2, 5] = 6.0 * 2.0**-3  # an exact E2M1 maximum
    packed, scale = mxfp4_pack(w.to(torch.bfloat16), rows_per_chunk=7)
    ref_p, ref_s = mxfp4_quantize(w.to(torch.bfloat16).reshape(120, 96))
    assert torch.equal(packed.reshape(120, 48), ref_p) and torch.equal(scale.reshape(120, 3), ref_s)
    mp, ms = mxfp4_pack(torch.empty(2, 8, 64, device="meta"))
    assert mp.shape == (2, 8, 32) and ms.shape == (2, 8, 2)


# ====================================================================== the compiled signatures


_SIG = re.compile(r"(\w+): ((?:Tensor\(\[[\d, ]*\], \w+\))|None|float|[\w.]+)")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "uint8": torch.uint8}


def test_every_launch_matches_its_compiled_signature():
    """Each op of the program, compiled with TVM-FFI for sm_90a, called with the very tensors the program passes
    (on the CPU): the call checks the parameter count, then refuses argument #0 for its device only, printing the
    compiled signature, which must match every tensor's shape and dtype (and contiguity, None-ness, scalars)."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    model = build_model(small_cfg(), "cpu").cast_(torch.bfloat16)
    seen: set = set()
    for fmt in ("mxfp4", "bf16"):
        fs = FusedStep(model, 2, 64, fmt)
        for ln in fs.program:
            if ln.kind != "kernel" or ln.op.key in seen:
                continue
            seen.add(ln.op.key)
            compiled = ln.op.compile("sm_90a", tvm_ffi=True)
            args = [ln.args.get(k) for k in ARG_ORDER[(ln.op.module_name, ln.op.variant)]]
            with pytest.raises(ValueError, match="expected device_type=cuda") as err:
                compiled(*args)
            body = re.search(r"when calling: `\w+\((.*)\)`", str(err.value), re.S).group(1)
            sig = [(m.group(1), m.group(2)) for m in _SIG.finditer(body)]
            assert len(sig) == len(args), (ln.name, sig)
            for (pname, ptype), a in zip(sig, args):
                where = f"{ln.name}: {pname}"
                if ptype == "None":
                    assert a is None, where
                elif ptype.startswith("Tensor"):
                    shape, dt = re.match(r"Tensor\(\[([\d, ]*)\], (\w+)\)", ptype).groups()
                    assert isinstance(a, torch.Tensor) and a.is_contiguous() and not a.requires_grad, where
                    assert tuple(a.shape) == tuple(int(s) for s in shape.split(",") if s.strip()), where
                    assert a.dtype == _DTYPES[dt], where
                    assert a.data_ptr() % 16 == 0, where  # the kernels assume 16-byte aligned tensors
                else:
                    assert isinstance(a, float), where
    assert len(seen) >= 20


def test_prebuilt_loader_finds_and_verifies(tmp_path: Path):
    """One op exported as a TVM-FFI .so: found by shapes, loaded, callable (refusing CPU tensors); the other ops
    of the program are reported missing, all at once, with the build command."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    from kimik3.kernels.toolchain import prebuilt

    fs = FusedStep(build_model(small_cfg(), "cpu").cast_(torch.bfloat16), 2, 64)
    ln = next(x for x in fs.program if x.op is not None and x.op.family == "attn_res")
    prebuilt.build_prebuilt("sm_90a", tmp_path, [ln.op], fmt="tvm-ffi", log=None)
    manifest = prebuilt.read_manifest(tmp_path)
    assert _find_prebuilt(manifest, ln.op, "sm_90a") == ln.op.name
    fns = load_kernels([ln.op], "sm_90a", "prebuilt", tmp_path)
    with pytest.raises(ValueError, match="expected device_type=cuda"):
        fns[ln.op.key](*[ln.args.get(k) for k in ARG_ORDER[("attn_res", "mix")]])
    with pytest.raises(ValueError, match=r"no usable kernel in .* op\(s\): .*not built for sm_90a.*--build-prebuilt"):
        load_kernels(list(fs.ops.values()), "sm_90a", "prebuilt", tmp_path)
    with pytest.raises(ValueError, match="not built for sm_100a"):
        load_kernels([ln.op], "sm_100a", "prebuilt", tmp_path)


# ====================================================================== the composition on a CPU


def _emulated_vs_naive(low, ref, expert_format: str, batch: int, prompt_len: int, steps: int, seed: int) -> list:
    """Teacher-forced: naive on the fp32 reference, the fused program (kernels -> references) on the bf16 model."""
    lens = mixed_lengths(batch, prompt_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, low.config.vocab_size, (batch, prompt_len), generator=g)
    dec = kimik3.Decoder(ref, "naive", batch_size=batch, max_seq_len=prompt_len + steps + 1)
    fs = FusedStep(low, batch, prompt_len + steps + 1, expert_format).bind(ReferenceRunner())
    a = dec.prefill(ids, lens)
    pos = torch.tensor(lens)
    b = fs.prefill(ids, pos)
    errors = [rel_error(b, a)]
    for _ in range(steps):
        tok = a.argmax(-1)
        a, b = dec.step(tok), fs.step(tok, pos)
        pos = pos + 1
        errors.append(rel_error(b, a))
        assert (b.argmax(-1) == a.argmax(-1)).float().mean() >= 0.5
    return errors


@pytest.fixture(scope="module")
def small_pair():
    return bf16_pair(kimik3.from_preset(small_cfg(), seed=5))


def test_composition_matches_naive_on_cpu(small_pair):
    """The whole program — weight preparation, residual slots, MLA cache layout and absorption, dense and shared
    experts as one-expert MoEs — with each kernel replaced by its reference, against naive."""
    pytest.importorskip("cutlass")
    low, ref = small_pair
    errors = _emulated_vs_naive(low, ref, "bf16", batch=3, prompt_len=6, steps=2, seed=2)
    assert max(errors) <= TOL["bf16_stage"], errors


def test_composition_mxfp4_matches_dequantised_model(small_pair):
    pytest.importorskip("cutlass")
    low, _ = small_pair
    low_q = _with_mxfp4_experts(low)
    ref_q = copy.deepcopy(low_q).cast_(torch.float32)
    errors = _emulated_vs_naive(low_q, ref_q, "mxfp4", batch=2, prompt_len=4, steps=1, seed=4)
    assert max(errors) <= TOL["bf16_stage"], errors


# ====================================================================== on a GPU

gpu = pytest.mark.skipif(not CUDA, reason="no CUDA device")
# exactly the exported targets (kimik3.kernels.toolchain.targets): the loader refuses others
GPU_CASES = fused_cases("bf16")


class _GpuPairs:
    """(bf16 model, fp32 reference with the same bf16-rounded weights) for one preset at a time, built on the GPU
    (a k3-shard pair is 17 + 34 GB)."""

    def __init__(self) -> None:
        self.cache: dict[str, tuple] = {}

    def __call__(self, preset: str) -> tuple:
        from kimik3.model.random_init import device_model

        if preset not in self.cache:
            self.evict()
            low = device_model(preset, seed=7, dtype=torch.bfloat16, device="cuda")
            self.cache[preset] = (low, copy.deepcopy(low).cast_(torch.float32))
        return self.cache[preset]

    def evict(self) -> None:
        self.cache.clear()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def gpu_pairs():
    pairs = _GpuPairs()
    yield pairs
    pairs.evict()


def _register() -> None:
    from kimik3.stages import STAGES

    STAGES.setdefault("fused", FusedStage)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset,batch", GPU_CASES, ids=[f"{p}-b{b}" for p, b in GPU_CASES])
def test_fused_matches_naive_on_gpu(gpu_pairs, preset, batch):
    from kimik3.validation import compare_to_reference

    if QUICK and batch == 64:
        pytest.skip("KIMIK3_QUICK=1: batch 64 left out")
    _register()
    low, ref = gpu_pairs(preset)
    torch.backends.cuda.matmul.allow_tf32 = False
    steps = 8 if preset == "tiny" else 3
    r = compare_to_reference(low, "fused", batch, prompt_len=12 if preset == "tiny" else 6, steps=steps,
                             seed=batch, reference=ref)
    assert r.passed, r.as_dict()
    assert r.top1_agreement >= 0.9, r.as_dict()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset,batch", fused_cases("mxfp4"))
def test_fused_mxfp4_matches_dequantised_naive_on_gpu(gpu_pairs, preset, batch):
    from kimik3.validation import compare_to_reference

    _register()
    low, _ = gpu_pairs(preset)
    low_q = _with_mxfp4_experts(low)
    gpu_pairs.evict()  # the bf16 pair is not needed any more: room for the quantised pair
    del low
    ref_q = copy.deepcopy(low_q).cast_(torch.float32)
    r = compare_to_reference(low_q, "fused", batch, prompt_len=6, steps=3, seed=11, reference=ref_q,
                             expert_format="mxfp4")
    del low_q, ref_q
    torch.cuda.empty_cache()
    assert r.passed, r.as_dict()


@pytest.mark.gpu
@gpu
def test_fused_is_deterministic_on_gpu(gpu_pairs):
    _register()
    low, _ = gpu_pairs("tiny")
    outs = []
    for _ in range(2):
        dec = kimik3.Decoder(low, "fused", batch_size=8, max_seq_len=32)
        ids = torch.randint(0, low.config.vocab_size, (8, 6), generator=torch.Generator().manual_seed(0)).cuda()
        dec.prefill(ids)
        outs.append(torch.stack([dec.step(torch.arange(8, device="cuda") + i) for i in range(3)]))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@gpu
def test_fused_refuses_micro_on_gpu():
    model = kimik3.from_preset("micro", seed=0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="head dims 32, 64 and 128"):
        FusedStage(model, 1, 16)
