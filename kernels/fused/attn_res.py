"""Attention-Residuals mix for decode (spec §2.2): a softmax over depth of NC candidate vectors per token.

out[b] = bf16(Σ_j α_j V_j) over the raw candidates V_j (slots first, the running partial sum last), α the softmax of
their RMS-normalised dots with ω = norm_w ⊙ proj_w (fp32, per site). One CTA per token, a thread owning 16-byte
chunks of H; up to ``KEEP_MAX_CANDIDATES`` candidates stay in registers, more are re-read for the mix (L1/L2).
Entry points: ``compile_for`` / ``launch`` (host), ``attn_res_mix`` (the op); ``attn_res_kernel`` is the GPU layer
around the per-thread helpers (``attn_res_partials``, ``attn_res_store``) that ``kernels/verify/host_exec.py`` runs.
Design: ``docs/architecture.md`` §2.2; the thread layout, the two paths and the reduction:
docs/architecture.md#appendix-design-notes-by-room (``kernels/fused/attn_res.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr
from kimik3.kernels.common import device as C
from kimik3.kernels.contracts.meta import (
    ARG_ORDER,
    ATTN_RES_CHUNK_BUDGET,
    ATTN_RES_KEEP_MAX_CANDIDATES,
    RMS_EPS,
    attn_res_threads,
)
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

# hash of the source as imported: the build cache and prebuilt manifests key on the code that runs
SOURCE_HASH = kernel_source_hash(__name__.rsplit(".", 1)[-1])
VEC = C.VEC
KEEP_MAX_CANDIDATES = ATTN_RES_KEEP_MAX_CANDIDATES  # (defined in meta.py with the thread rule that depends on it)
CHUNK_BUDGET = ATTN_RES_CHUNK_BUDGET
EPS = RMS_EPS
VARIANTS = ("mix",)
OUTPUTS = {"mix": ("out",)}


def threads_for(H: int, NC: int) -> int:
    """Threads per CTA (the rule is ``meta.attn_res_threads``); one CTA holds at most 1024."""
    nt = attn_res_threads(H, NC)
    assert nt <= 1024, f"H={H} with {NC} candidates needs more than 1024 threads"
    return nt


@cute.jit
def _accumulate(v: Any, w: Any, part: cute.Tensor, j: cutlass.Constexpr):
    """part[2j] += Σ v², part[2j+1] += Σ v ω for one 8-column chunk (fp32 TensorSSAs)."""
    part[2 * j] = part[2 * j] + (v * v).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
    part[2 * j + 1] = part[2 * j + 1] + (v * w).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)


@cute.jit
def _omega_chunk(gW: cute.Tensor, ch: Any, rw: cute.Tensor) -> Any:
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128, invariant=True)
    cute.copy(ld_w, gW[(None, 2 * ch)], rw[None, 0])
    cute.copy(ld_w, gW[(None, 2 * ch + 1)], rw[None, 1])
    return rw.load().reshape((VEC,))  # (4, 2) fp32 pieces -> the chunk's 8 columns


@cute.jit
def attn_res_partials(mCand: cute.Tensor, mOmega: cute.Tensor, b: Int32, tidx: Int32, rv: cute.Tensor,
                      part: cute.Tensor, NT: cutlass.Constexpr):
    """Thread ``tidx`` of token ``b``'s CTA: its 8-column chunks tidx, tidx+NT, ... of every candidate and its
    partial [Σ V², Σ V ω] per candidate into ``part`` (zeroed here). KEEP (few candidates): the chunks stay in
    ``rv`` (NC x CH x 4 registers, all loads issued up front) for the mix. Otherwise: a real loop over the chunks,
    NC loads in flight per step, and the mix reads them again."""
    NC, H = cute.size(mCand, mode=[0]), cute.size(mCand, mode=[2])
    NCH = H // VEC
    CH = C.ceil_div(NCH, NT)
    KEEP = NC <= KEEP_MAX_CANDIDATES
    ld_v = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    gW = cute.zipped_divide(mOmega, (4,))
    rw = cute.make_rmem_tensor((4, 2), Float32)
    part.fill(0.0)
    if const_expr(KEEP):
        for c in cutlass.range_constexpr(CH):
            if tidx + c * NT < NCH:
                for j in cutlass.range_constexpr(NC):
                    gV = cute.zipped_divide(mCand[j, b, None], (VEC,))
                    cute.copy(ld_v, gV[(None, tidx + c * NT)], rv[None, c, j])
        for c in cutlass.range_constexpr(CH):
            if tidx + c * NT < NCH:
                w = _omega_chunk(gW, tidx + c * NT, rw)
                for j in cutlass.range_constexpr(NC):
                    _accumulate(rv[None, c, j].load().to(Float32), w, part, j)
    else:
        for ch in cutlass.range(tidx, NCH, NT, unroll=1):
            for j in cutlass.range_constexpr(NC):
                cute.copy(ld_v, cute.zipped_divide(mCand[j, b, None], (VEC,))[(None, ch)], rv[None, 0, j])
            w = _omega_chunk(gW, ch, rw)
            for j in cutlass.range_constexpr(NC):
                _accumulate(rv[None, 0, j].load().to(Float32), w, part, j)


@cute.jit
def attn_res_store(mCand: cute.Tensor, mOut: cute.Tensor, b: Int32, tidx: Int32, rv: cute.Tensor,
                   alpha: cute.Tensor, NT: cutlass.Constexpr):
    """Thread ``tidx``'s chunks of ``out[b] = bf16(Σ_j α_j V_j)`` (from ``rv`` when KEEP, else read again)."""
    NC, H = cute.size(mCand, mode=[0]), cute.size(mCand, mode=[2])
    NCH = H // VEC
    CH = C.ceil_div(NCH, NT)
    KEEP = NC <= KEEP_MAX_CANDIDATES
    ld_v = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    st = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), BFloat16, num_bits_per_copy=128)
    gO = cute.zipped_divide(mOut[b, None], (VEC,))
    ro = cute.make_rmem_tensor((VEC,), BFloat16)
    if const_expr(KEEP):
        for c in cutlass.range_constexpr(CH):
            if tidx + c * NT < NCH:
                acc = rv[None, c, 0].load().to(Float32) * alpha[0]
                for j in cutlass.range_constexpr(1, NC):
                    acc = acc + rv[None, c, j].load().to(Float32) * alpha[j]
                ro.store(acc.to(BFloat16))
                cute.copy(st, ro, gO[(None, tidx + c * NT)])
    else:
        for ch in cutlass.range(tidx, NCH, NT, unroll=1):  # second read of the same bytes: L1/L2
            for j in cutlass.range_constexpr(NC):
                cute.copy(ld_v, cute.zipped_divide(mCand[j, b, None], (VEC,))[(None, ch)], rv[None, 0, j])
            acc = rv[None, 0, 0].load().to(Float32) * alpha[0]
            for j in cutlass.range_constexpr(1, NC):
                acc = acc + rv[None, 0, j].load().to(Float32) * alpha[j]
            ro.store(acc.to(BFloat16))
            cute.copy(st, ro, gO[(None, ch)])


def rv_shape(NC: int, H: int, NT: int) -> tuple[int, int, int]:
    """Register tile of a thread's candidate chunks: [8, CH, NC] when kept (KEEP), else [8, 1, NC]."""
    CH = C.ceil_div(H // VEC, NT)
    return (VEC, CH if NC <= KEEP_MAX_CANDIDATES else 1, NC)


@cute.kernel
def attn_res_kernel(mCand: cute.Tensor, mOmega: cute.Tensor, mOut: cute.Tensor, NT: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    NC, H = cute.size(mCand, mode=[0]), cute.size(mCand, mode=[2])
    NW = NT // 32
    alloc = cutlass.memory.SmemAllocator()
    red = C.smem_tensor(alloc, Float32, (NW, 2 * NC), "attn_res")
    part = cute.make_rmem_tensor((2 * NC,), Float32)  # [Σ V², Σ V ω] per candidate
    rv = cute.make_rmem_tensor(rv_shape(NC, H, NT), BFloat16)
    attn_res_partials(mCand, mOmega, b, tidx, rv, part, NT)
    # block reduction with one barrier; every warp re-reduces the per-warp partials
    for i in cutlass.range_constexpr(2 * NC):
        s = C.warp_sum(part[i])
        if lane == 0:
            red[warp, i] = s
    cute.arch.sync_threads()
    for i in cutlass.range_constexpr(2 * NC):
        v = Float32(0.0)
        if lane < NW:
            v = red[lane, i]
        part[i] = C.warp_sum(v)
    # scores and softmax over the NC candidates (all threads, redundantly); α folded with 1/Σ
    alpha = cute.make_rmem_tensor((NC,), Float32)
    mx = -Float32.inf
    for j in cutlass.range_constexpr(NC):
        alpha[j] = part[2 * j + 1] * cute.math.rsqrt(part[2 * j] * (1.0 / H) + EPS)
        mx = cute.arch.fmax(mx, alpha[j])
    tot = Float32(0.0)
    for j in cutlass.range_constexpr(NC):
        alpha[j] = C.exp_fast(alpha[j] - mx)
        tot = tot + alpha[j]
    inv = 1.0 / tot
    for j in cutlass.range_constexpr(NC):
        alpha[j] = alpha[j] * inv
    attn_res_store(mCand, mOut, b, tidx, rv, alpha, NT)


@cute.jit
def attn_res_mix(mCand: cute.Tensor, mOmega: cute.Tensor, mOut: cute.Tensor, stream: Any):
    NC, B, H = cute.size(mCand, mode=[0]), cute.size(mCand, mode=[1]), cute.size(mCand, mode=[2])
    assert H % VEC == 0 and NC >= 1
    NT = threads_for(H, NC)
    attn_res_kernel(mCand, mOmega, mOut, NT).launch(grid=[B, 1, 1], block=[NT, 1, 1], stream=stream)


def compile_for(arch: str, *, variant: str = "mix", B: int, H: int, NC: int, tvm_ffi: bool = False,
                remark_file: str | None = None) -> Any:
    f = [dsl.fake(BFloat16, (NC, B, H)), dsl.fake(Float32, (H,)), dsl.fake(BFloat16, (B, H))]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(attn_res_mix, *f, dsl.fake_stream(tvm_ffi), options=opts)


def launch(compiled: Any, variant: str, t: dict[str, torch.Tensor], tvm_ffi: bool = False) -> None:
    dsl.launch(compiled, [t[k] for k in ARG_ORDER[("attn_res", variant)]], tvm_ffi)
