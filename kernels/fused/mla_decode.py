"""Weight-absorbed MLA decode attention in the latent space (spec §4.4), flash-decoding style.

Multi-query attention of ``nh`` query heads of width DQ = kv_lora + rope over the compressed cache ``kv`` [B, S, DQ]
(bf16; key ``[c_t ; k_r,t]``, value ``c_t``), each sequence over its own first ``lens[b]`` tokens (ragged batches).
``mla_split_kernel`` (grid: head groups x splits x B) writes fp32 partial (m, l, o) per split from an online softmax
in the log2 domain; ``mla_combine_kernel`` (grid: nh x B) merges the splits and casts to bf16.
Entry points: ``compile_for`` / ``launch`` (host), ``mla_decode`` (the op); the address arithmetic and per-lane math
are ``@cute.jit`` helpers (``mla_*``) that ``kernels/verify/host_exec_mla.py`` also runs on the host.
Design: ``docs/architecture.md`` §4.4; lane layout, loads, softmax, combine and known limits:
docs/architecture.md#appendix-design-notes-by-room (``kernels/fused/mla_decode.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from kimik3.kernels.common import device as C
from kimik3.kernels.common.trace import tracing_for_host
from kimik3.kernels.contracts.meta import ARG_ORDER, mla_default_splits, mla_head_layout
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

# hash of the source as imported: the build cache and prebuilt manifests key on the code that runs
SOURCE_HASH = kernel_source_hash(__name__.rsplit(".", 1)[-1])
TT = 4  # tokens per step (loads in flight per lane: TT x (latent + rope) chunks)
VARIANTS = ("mla",)
OUTPUTS = {"mla": ("o",)}


# (heads per warp, warps per CTA) and the default split count are defined in meta.py: the fused stage sizes its
# partial buffers with the same functions
head_layout = mla_head_layout
default_splits = mla_default_splits


# ---------------------------------------------------------------------------------------------- device code
# The @cute.jit helpers below hold the kernels' address arithmetic (which heads, splits and cache positions a
# block / warp / lane owns; which dims it loads and stores) and per-lane math (the q·c partial dot, the online
# softmax pieces, the combine); the two @cute.kernel functions are the thin GPU-only layer around them (thread and
# block indices, the butterfly warp sum, the stores). kernels/verify/host_exec_mla.py runs the same helpers on the host.
def _exp2(x: Any) -> Any:
    """2^x: ``ex2.approx`` on the GPU; exact on the host, where the approximate instruction aborts."""
    return cute.math.exp2(x, approx=not tracing_for_host())


def _fmax(a: Any, b: Any) -> Any:
    """max(a, b): the ``max.f32`` instruction on the GPU; on the host (where it aborts) a plain compare-select."""
    return cutlass.max(a, b) if tracing_for_host() else cute.arch.fmax(a, b)


@cute.jit
def mla_warp_heads(hg: Int32, warp: Int32, HPW: cutlass.Constexpr, WARPS: cutlass.Constexpr) -> Int32:
    """First query head of warp ``warp`` in head group ``hg`` (grid x): HPW consecutive heads per warp, WARPS
    warps per CTA."""
    return (hg * WARPS + warp) * HPW


@cute.jit
def mla_split_range(n: Int32, split: Int32, NSPLIT: cutlass.Constexpr) -> tuple[Int32, Int32]:
    """Cache positions [t0, t1) that split ``split`` of a sequence of length ``n`` attends to: NSPLIT equal
    slices, the slice length rounded up to TT tokens (a late split may be short or empty: t0 >= t1)."""
    chunk = (((n + NSPLIT - 1) // NSPLIT + TT - 1) // TT) * TT
    t0 = split * chunk
    return t0, cutlass.min(t0 + chunk, n)


@cute.jit
def mla_row(tb: Int32, u: cutlass.Constexpr, t1: Int32) -> Int32:
    """Cache position loaded as row ``u`` of the step at ``tb``: the tail clamps to the split's last position (a
    valid row reloaded; ``mla_score`` masks it)."""
    return cutlass.min(tb + u, t1 - 1)


@cute.jit
def mla_load_q(mQ: cute.Tensor, b: Int32, h0: Int32, lane: Int32, rq: cute.Tensor, qs: Float32,
               DL: cutlass.Constexpr, DR: cutlass.Constexpr, HPW: cutlass.Constexpr):
    """Lane ``lane``'s dims of q for heads h0..h0+HPW-1, pre-scaled by ``qs`` (scores in the log2 domain): latent
    dims [lane·DL/32, (lane+1)·DL/32) into rq[hh, :DL/32], rope dims [DL + lane·DR/32, ...) after them."""
    DLL, DRL = DL // 32, DR // 32
    for hh in cutlass.range_constexpr(HPW):
        for d in cutlass.range_constexpr(DLL):
            rq[hh, d] = mQ[b, h0 + hh, lane * DLL + d].to(Float32) * qs
        for d in cutlass.range_constexpr(DRL):
            rq[hh, DLL + d] = mQ[b, h0 + hh, DL + lane * DRL + d].to(Float32) * qs


@cute.jit
def mla_load_rows(mKV: cute.Tensor, b: Int32, tb: Int32, t1: Int32, lane: Int32, rkv: cute.Tensor,
                  rkr: cute.Tensor, DL: cutlass.Constexpr, DR: cutlass.Constexpr) -> tuple[Any, Any]:
    """The TT cache rows of the step at ``tb`` (positions ``mla_row``), all requested before any math: lane
    ``lane``'s latent dims as NL loads of LV bf16 into rkv[:, c, u], its rope dims as one load into rkr[:, u].
    Returns both in fp32 (kv[(d % LV, d // LV, u)], kr[(d, u)])."""
    DLL, DRL = DL // 32, DR // 32
    LV = min(8, DLL)
    NL = DLL // LV
    ld_lat = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=16 * LV, invariant=True)
    ld_rope = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=16 * DRL, invariant=True)
    for u in cutlass.range_constexpr(TT):
        t = mla_row(tb, u, t1)
        gLat = cute.zipped_divide(mKV[b, t, None], (LV,))
        for c in cutlass.range_constexpr(NL):
            cute.copy(ld_lat, gLat[(None, lane * NL + c)], rkv[None, c, u])
        gRope = cute.zipped_divide(mKV[b, t, None], (DRL,))
        cute.copy(ld_rope, gRope[(None, DL // DRL + lane)], rkr[None, u])
    return rkv.load().to(Float32), rkr.load().to(Float32)


@cute.jit
def mla_dot(rq: cute.Tensor, kv: Any, kr: Any, hh: cutlass.Constexpr, u: cutlass.Constexpr,
            DLL: cutlass.Constexpr, DRL: cutlass.Constexpr) -> Float32:
    """Lane partial of head hh's score against row u: its latent dims, then its rope dims (fp32, in order)."""
    LV = min(8, DLL)
    acc = Float32(0.0)
    for d in cutlass.range_constexpr(DLL):
        acc = acc + rq[hh, d] * kv[(d % LV, d // LV, u)]
    for d in cutlass.range_constexpr(DRL):
        acc = acc + rq[hh, DLL + d] * kr[(d, u)]
    return acc


@cute.jit
def mla_score(s: cute.Tensor, sc: Float32, mx: Float32, tb: Int32, u: cutlass.Constexpr, t1: Int32) -> Float32:
    """Row u's warp-summed score into s[u] (-inf past the split's end), and the running max with it."""
    s[u] = sc if tb + u < t1 else -Float32.inf
    return _fmax(mx, s[u])


@cute.jit
def mla_online_update(m: cute.Tensor, lsum: cute.Tensor, o: cute.Tensor, s: cute.Tensor, kv: Any, mx: Float32,
                      hh: cutlass.Constexpr, DLL: cutlass.Constexpr):
    """Online softmax for head hh after a step with new max ``mx``: rescale the running sum and the lane's o dims
    by 2^(m - mx) (0 on the first step, m = -inf), then add p_u = 2^(s_u - mx) and p_u · c_u for the TT rows."""
    LV = min(8, DLL)
    corr = _exp2(m[hh] - mx)  # m = -inf on the first step -> 0
    m[hh] = mx
    lsum[hh] = lsum[hh] * corr
    for d in cutlass.range_constexpr(DLL):
        o[d % 4, d // 4, hh] = o[d % 4, d // 4, hh] * corr
    for u in cutlass.range_constexpr(TT):
        p = _exp2(s[u] - mx)
        lsum[hh] = lsum[hh] + p
        for d in cutlass.range_constexpr(DLL):
            o[d % 4, d // 4, hh] = o[d % 4, d // 4, hh] + p * kv[(d % LV, d // LV, u)]


@cute.jit
def mla_o_chunk(lane: Int32, c: cutlass.Constexpr, DLL: cutlass.Constexpr) -> Int32:
    """Index of lane ``lane``'s c-th 4-float (16-byte) piece of a partial o row: its latent dims, in order."""
    return lane * (DLL // 4) + c


@cute.jit
def mla_combine_thread(mPartO: cute.Tensor, mPartM: cute.Tensor, mPartL: cute.Tensor, b: Int32, h: Int32,
                       tidx: Int32, acc: cute.Tensor, r: cute.Tensor) -> Float32:
    """Combine thread ``tidx`` of (head h, sequence b): acc = Σ_s 2^(m_s - M) o_s[4·tidx : 4·tidx + 4] over the
    splits, returns 1 / Σ_s 2^(m_s - M) l_s (M the largest m_s; an empty split has m = -inf and drops out)."""
    NSPLIT = cute.size(mPartM, mode=[2])
    M = mPartM[b, h, 0]
    for sp in cutlass.range_constexpr(1, NSPLIT):
        M = _fmax(M, mPartM[b, h, sp])
    L = Float32(0.0)
    acc.fill(0.0)
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128)
    for sp in cutlass.range(NSPLIT, unroll=1):
        w = _exp2(mPartM[b, h, sp] - M)  # empty split: 2^-inf = 0
        L = L + w * mPartL[b, h, sp]
        cute.copy(ld, cute.zipped_divide(mPartO[b, h, sp, None], (4,))[(None, tidx)], r)
        for i in cutlass.range_constexpr(4):
            acc[i] = acc[i] + w * r[i]
    return 1.0 / L


@cute.jit
def mla_out_col(tidx: Int32, i: cutlass.Constexpr) -> Int32:
    """Column of o that combine thread ``tidx`` writes as its i-th value (4 consecutive latent dims per thread)."""
    return tidx * 4 + i


@cute.kernel
def mla_split_kernel(mQ: cute.Tensor, mKV: cute.Tensor, mLens: cute.Tensor, mPartO: cute.Tensor,
                     mPartM: cute.Tensor, mPartL: cute.Tensor, scale: Float32, DL: cutlass.Constexpr,
                     HPW: cutlass.Constexpr, WARPS: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    hg, split, b = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    DQ = cute.size(mQ, mode=[2])
    NSPLIT = cute.size(mPartM, mode=[2])
    DR = DQ - DL
    DLL, DRL = DL // 32, DR // 32  # dims per lane
    LV = min(8, DLL)  # bf16 per latent load (16 bytes when DLL >= 8)
    NL = DLL // LV
    h0 = mla_warp_heads(hg, warp, HPW, WARPS)

    rq = cute.make_rmem_tensor((HPW, DLL + DRL), Float32)
    mla_load_q(mQ, b, h0, lane, rq, scale * C.LOG2E, DL, DR, HPW)
    o = cute.make_rmem_tensor((4, DLL // 4, HPW), Float32)  # o[(d % 4, d // 4, h)]: 16-byte pieces
    o.fill(0.0)
    m = cute.make_rmem_tensor((HPW,), Float32)
    lsum = cute.make_rmem_tensor((HPW,), Float32)
    m.fill(-Float32.inf)
    lsum.fill(0.0)

    t0, t1 = mla_split_range(mLens[b], split, NSPLIT)
    rkv = cute.make_rmem_tensor((LV, NL, TT), BFloat16)
    rkr = cute.make_rmem_tensor((DRL, TT), BFloat16)
    s = cute.make_rmem_tensor((TT,), Float32)
    for tb in cutlass.range(t0, t1, TT, unroll=1):
        kv, kr = mla_load_rows(mKV, b, tb, t1, lane, rkv, rkr, DL, DR)
        for hh in cutlass.range_constexpr(HPW):
            mx = m[hh]
            for u in cutlass.range_constexpr(TT):
                mx = mla_score(s, C.warp_sum(mla_dot(rq, kv, kr, hh, u, DLL, DRL)), mx, tb, u, t1)
            mla_online_update(m, lsum, o, s, kv, mx, hh, DLL)

    st = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), Float32, num_bits_per_copy=128)
    for hh in cutlass.range_constexpr(HPW):
        gO = cute.zipped_divide(mPartO[b, h0 + hh, split, None], (4,))
        for c in cutlass.range_constexpr(DLL // 4):  # 16-byte stores of this lane's dims
            cute.copy(st, o[None, c, hh], gO[(None, mla_o_chunk(lane, c, DLL))])
        if lane == 0:
            mPartM[b, h0 + hh, split] = m[hh]
            mPartL[b, h0 + hh, split] = lsum[hh]


@cute.kernel
def mla_combine_kernel(mPartO: cute.Tensor, mPartM: cute.Tensor, mPartL: cute.Tensor, mO: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    h, b, _ = cute.arch.block_idx()
    acc = cute.make_rmem_tensor((4,), Float32)
    r = cute.make_rmem_tensor((4,), Float32)
    inv = mla_combine_thread(mPartO, mPartM, mPartL, b, h, tidx, acc, r)
    for i in cutlass.range_constexpr(4):
        mO[b, h, mla_out_col(tidx, i)] = (acc[i] * inv).to(BFloat16)


@cute.jit
def mla_decode(mQ: cute.Tensor, mKV: cute.Tensor, mLens: cute.Tensor, mPartO: cute.Tensor, mPartM: cute.Tensor,
               mPartL: cute.Tensor, mO: cute.Tensor, scale: Float32, stream: Any, DL: cutlass.Constexpr):
    B, nh, DQ = cute.size(mQ, mode=[0]), cute.size(mQ, mode=[1]), cute.size(mQ, mode=[2])
    NSPLIT = cute.size(mPartM, mode=[2])
    assert DL % 128 == 0 and (DQ - DL) % 32 == 0 and DQ - DL > 0, "needs kv_lora % 128 == 0, rope % 32 == 0"
    HPW, WARPS = head_layout(nh)
    mla_split_kernel(mQ, mKV, mLens, mPartO, mPartM, mPartL, scale, DL, HPW, WARPS).launch(
        grid=[nh // (HPW * WARPS), NSPLIT, B], block=[WARPS * 32, 1, 1], stream=stream)
    mla_combine_kernel(mPartO, mPartM, mPartL, mO).launch(grid=[nh, B, 1], block=[DL // 4, 1, 1], stream=stream)


def _specs(B: int, nh: int, DL: int, DR: int, S: int, nsplit: int) -> dict[str, tuple[Any, tuple[int, ...]]]:
    DQ = DL + DR
    return {"q": (BFloat16, (B, nh, DQ)), "kv": (BFloat16, (B, S, DQ)), "lens": (Int32, (B,)),
            "part_o": (Float32, (B, nh, nsplit, DL)), "part_m": (Float32, (B, nh, nsplit)),
            "part_l": (Float32, (B, nh, nsplit)), "o": (BFloat16, (B, nh, DL))}


def compile_for(arch: str, *, variant: str = "mla", B: int, nh: int, DL: int, DR: int, S: int,
                nsplit: int | None = None, tvm_ffi: bool = False, remark_file: str | None = None) -> Any:
    nsplit = nsplit or default_splits(B, nh, S)
    f = [dsl.fake(dt, shp) for dt, shp in _specs(B, nh, DL, DR, S, nsplit).values()]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(mla_decode, *f, Float32(1.0), dsl.fake_stream(tvm_ffi), DL, options=opts)


def launch(compiled: Any, variant: str, t: dict[str, Any], tvm_ffi: bool = False) -> None:
    dsl.launch(compiled, [t[k] for k in ARG_ORDER[("mla_decode", variant)]],
             tvm_ffi)
