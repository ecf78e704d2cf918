"""Megakernel opcodes that are not tiled GEMVs: EMBED, ATTN_RES_MIX, ARGMAX (device code; see ``OPCODE_NOTES``
in ``megakernel.py``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from .device_fns import (
    NT,
    NW,
    VEC,
    block_allreduce,
    exp_fast,
    gchunks,
    gflat,
)
from .isa import (
    B0,
    B1,
    W_ARGS,
)
from .mk_operands import (
    F32_RED,
    _bx,
    _Ctx,
    _eoff,
)


@cute.jit
def op_embed(ctx: _Ctx) -> None:
    ids = gflat(Int64, ctx.s_addr[0])
    nch = ctx.s_d2[1] // VEC
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    for b in cutlass.range(_bx(ctx, 0, B0), _bx(ctx, 0, B1), unroll=1):
        tok = Int32(ids[Int64(b) * Int64(ctx.s_d1[0]) * Int64(ctx.s_d2[0])])
        src = gchunks(ctx.s_addr[1] + Int64(tok) * Int64(ctx.s_d2[1]) * 2)
        dst = gchunks(ctx.s_addr[2] + _eoff(ctx.s_d1[2], ctx.s_d2[2], b, 0, 0) * 2)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            cute.copy(ld, src[(c, None)], r)
            cute.copy(st, r, dst[(c, None)])


@cute.jit
def op_attn_res_mix(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    KM = cfg.kmax
    K = ctx.s_ins[W_ARGS + 1]
    nch = ctx.s_d2[0] // VEC
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    gn, gp = gchunks(ctx.s_addr[1]), gchunks(ctx.s_addr[2])
    rn = cute.make_rmem_tensor((VEC,), BFloat16)
    rp = cute.make_rmem_tensor((VEC,), BFloat16)
    rv = cute.make_rmem_tensor((VEC,), BFloat16)
    ro = cute.make_rmem_tensor((VEC,), BFloat16)
    acc = cute.make_rmem_tensor((VEC,), Float32)
    vals = cute.make_rmem_tensor((2 * KM,), Float32)
    s_red = cute.make_tensor(ctx.s_f32.iterator + F32_RED, cute.make_layout(NW * 2 * KM))
    inv_h = 1.0 / cfg.H
    for b in cutlass.range(_bx(ctx, 0, B0), _bx(ctx, 0, B1), unroll=1):
        sv = gchunks(ctx.s_addr[0] + _eoff(ctx.s_d1[0], ctx.s_d2[0], b, 0, 0) * 2)
        vals.fill(0.0)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            cute.copy(ld_w, gn[(c, None)], rn)
            cute.copy(ld_w, gp[(c, None)], rp)
            om = rn.load().to(Float32) * rp.load().to(Float32)
            for k in cutlass.range_constexpr(KM):
                if k < K:
                    cute.copy(ld_x, sv[(k * nch + c, None)], rv)
                    v = rv.load().to(Float32)
                    vals[k] += (v * v).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
                    vals[KM + k] += (v * om).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
        block_allreduce(vals, s_red, 2 * KM)
        m = -Float32.inf
        for k in cutlass.range_constexpr(KM):
            lg = vals[KM + k] * cute.math.rsqrt(vals[k] * inv_h + cfg.eps, fastmath=True)
            vals[KM + k] = lg if k < K else -Float32.inf
            m = cute.arch.fmax(m, vals[KM + k])
        den = Float32(0.0)
        for k in cutlass.range_constexpr(KM):
            vals[k] = exp_fast(vals[KM + k] - m)  # exp(-inf) = 0 for k >= K
            den = den + vals[k]
        inv = 1.0 / den
        dst = gchunks(ctx.s_addr[3] + _eoff(ctx.s_d1[3], ctx.s_d2[3], b, 0, 0) * 2)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            acc.fill(0.0)
            for k in cutlass.range_constexpr(KM):
                if k < K:
                    cute.copy(ld_x, sv[(k * nch + c, None)], rv)
                    acc.store(acc.load() + rv.load().to(Float32) * (vals[k] * inv))
            ro.store(acc.load().to(BFloat16))
            cute.copy(st, ro, dst[(c, None)])



@cute.jit
def op_argmax(ctx: _Ctx) -> None:
    bv = gflat(Float32, ctx.s_addr[0])
    bi = gflat(Int64, ctx.s_addr[1])
    nxt = gflat(Int64, ctx.s_addr[2])
    if ctx.tidx < ctx.cfg.B:
        b = ctx.tidx
        T = ctx.s_d2[0]
        best, bt = -Float32.inf, Int32(0)
        for t in cutlass.range(T, unroll=1):
            v = bv[_eoff(ctx.s_d1[0], T, b, Int32(0), t)]
            take = v > best  # first maximum = lowest tile = lowest vocabulary id
            best, bt = (v, t) if take else (best, bt)
        tok = bi[_eoff(ctx.s_d1[1], ctx.s_d2[1], b, Int32(0), bt)]
        nxt[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), Int32(0))] = tok
