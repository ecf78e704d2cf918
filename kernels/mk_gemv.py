"""The megakernel's tiled-GEMV opcodes, sharing the tile-GEMV helper ``device_fns.weight_row_dot``: NORM_PROJ,
MLP_GATE_UP, O_PROJ_RESIDUAL, FFN_OUT, LM_HEAD (device code; see ``OPCODE_NOTES`` in ``megakernel.py``).

The batch goes in passes of ``mk_addr.gemv_batch_tile(B)`` rows (up to 8): each weight chunk a lane loads serves
every row of the pass, so up to batch 8 each weight row streams from memory once. A warp computes one (weight row,
pass) work item at a time, items dealt round-robin (``mk_addr.gemv_item``: pass by pass, so the warps share one
pass's x rows; up to batch 8, one pass: rows ``w, w + NW, ...`` of the box for warp ``w``). One flat item loop
rather than a pass loop inside the row loop: the nested loops' state did not fit next to the dot step at batch 64
(ptxas spilled the megakernel). Each lane keeps ``mk_addr.GEMV_UNROLL`` (8) 16-byte weight loads in flight per step:
384 threads x 8 x 16 B = 48 KiB per SM. The RMSNorm prologue (``device_fns.rstd_rows``) issues 8 loads per lane
per round trip."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from . import mk_addr
from .device_fns import (
    NW,
    VEC,
    bf16_round,
    gchunks,
    gflat,
    glu,
    rstd_rows,
    warp_sum,
    weight_row_dot,
)
from .isa import (
    C0,
    C1,
    FFN_MLP,
    FFN_ROUTED,
    R0,
    R1,
    W_ARGS,
)
from .mk_addr import tile_rows
from .mk_operands import (
    F32_VEC,
    _bx,
    _Ctx,
    _eoff,
    _row0,
    _staged_rows,
)


def _tiling(cfg: Any) -> tuple[int, int, int]:
    """Trace-time constants of a GEMV opcode: batch rows per pass, 16-byte weight loads in flight per lane (for the
    compile target, ``cfg.arch``) and passes."""
    BT = mk_addr.gemv_batch_tile(cfg.B)
    return BT, mk_addr.gemv_unroll(cfg.arch), cfg.B // BT


@cute.jit
def _gemv_prologue(ctx: _Ctx, xop: Int32, eps: cutlass.Constexpr) -> tuple[Any, Int32]:
    """x rows of operand ``xop`` as a chunk view + its batch stride in chunks; their rstd into s_f32[0:B]."""
    xaddr = _row0(ctx, xop)
    xs = ctx.s_d1[xop] * ctx.s_d2[xop] // VEC
    rstd_rows(xaddr, xs, Int32(ctx.cfg.B), ctx.s_d2[xop] // VEC, eps, ctx.s_f32)
    return gchunks(xaddr), xs


@cute.jit
def op_norm_proj(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT, U, NBT = _tiling(cfg)
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    fp32 = ctx.s_ins[W_ARGS]
    n = tile_rows(_bx(ctx, 2, R0), _bx(ctx, 2, R1))
    nch = ctx.s_d2[2] // VEC
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    gv = gchunks(ctx.s_addr[1])
    o0 = _bx(ctx, 3, C0)
    of = gflat(Float32, ctx.s_addr[3])
    ob = gflat(BFloat16, ctx.s_addr[3])
    acc = cute.make_rmem_tensor((BT,), Float32)
    for k in cutlass.range(ctx.warp, n * NBT, NW, unroll=1):
        j, t = mk_addr.gemv_item(k, n, NBT)
        weight_row_dot(ctx.s_stage, staged, wrow0, j, nch, xv, t * BT * xs, xs, False, gv, acc, BT, U,
                       wide_tail=True)
        for bb in cutlass.range_constexpr(BT):
            b = t * BT + bb
            d = warp_sum(acc[bb]) * ctx.s_f32[b]
            if ctx.lane == bb % 32:
                off = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), o0 + j)
                if fp32 != 0:
                    of[off] = d
                else:
                    ob[off] = d.to(BFloat16)


@cute.jit
def op_mlp_gate_up(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT, U, NBT = _tiling(cfg)
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    n = tile_rows(_bx(ctx, 2, R0), _bx(ctx, 2, R1))
    nch = ctx.s_d2[2] // VEC
    wg0, wu0 = _row0(ctx, 2), _row0(ctx, 3)
    sg, su = _staged_rows(ctx, Int32(2)), _staged_rows(ctx, Int32(3))
    gv = gchunks(ctx.s_addr[1])
    o0 = _bx(ctx, 4, C0)
    ob = gflat(BFloat16, ctx.s_addr[4])
    ag = cute.make_rmem_tensor((BT,), Float32)
    au = cute.make_rmem_tensor((BT,), Float32)
    for k in cutlass.range(ctx.warp, n * NBT, NW, unroll=1):
        j, t = mk_addr.gemv_item(k, n, NBT)
        weight_row_dot(ctx.s_stage, sg, wg0, j, nch, xv, t * BT * xs, xs, False, gv, ag, BT, U,
                       wide_tail=True)
        weight_row_dot(ctx.s_stage, su, wu0, j, nch, xv, t * BT * xs, xs, False, gv, au, BT, U,
                       wide_tail=True)
        for bb in cutlass.range_constexpr(BT):
            b = t * BT + bb
            r = ctx.s_f32[b]
            a = bf16_round(warp_sum(ag[bb]) * r)
            u = bf16_round(warp_sum(au[bb]) * r)
            h = glu(a, u, cfg.situ, cfg.situ_beta, cfg.situ_lin)
            if ctx.lane == bb % 32:
                ob[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), o0 + j)] = h.to(BFloat16)


@cute.jit
def op_o_proj_residual(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT, U, NBT = _tiling(cfg)
    accumulate = ctx.s_ins[W_ARGS]
    xaddr = _row0(ctx, 0)
    xs = ctx.s_d1[0] * ctx.s_d2[0] // VEC
    xv = gchunks(xaddr)
    n = tile_rows(_bx(ctx, 1, R0), _bx(ctx, 1, R1))
    nch = ctx.s_d2[1] // VEC
    wrow0 = _row0(ctx, 1)
    staged = _staged_rows(ctx, Int32(1))
    entry, c0 = _bx(ctx, 2, R0), _bx(ctx, 2, C0)
    sb = gflat(BFloat16, ctx.s_addr[2])
    acc = cute.make_rmem_tensor((BT,), Float32)
    for k in cutlass.range(ctx.warp, n * NBT, NW, unroll=1):
        j, t = mk_addr.gemv_item(k, n, NBT)
        weight_row_dot(ctx.s_stage, staged, wrow0, j, nch, xv, t * BT * xs, xs, False, None, acc, BT, U,
                       wide_tail=True)
        for bb in cutlass.range_constexpr(BT):
            b = t * BT + bb
            y = bf16_round(warp_sum(acc[bb]))
            if ctx.lane == bb % 32:
                off = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, entry, c0 + j)
                if accumulate != 0:
                    y = sb[off].to(Float32) + y
                sb[off] = y.to(BFloat16)


@cute.jit
def op_ffn_out(ctx: _Ctx) -> None:
    """Operand order (scheduler ``out_cols``): [latent sum, (latent norm), up rows] if routed, [mlp hidden,
    down rows] if mlp, stream column tile last."""
    cfg = ctx.cfg
    BT, U, NBT = _tiling(cfg)
    flags = ctx.s_ins[W_ARGS]
    routed = (flags & FFN_ROUTED) != 0
    mlp = (flags & FFN_MLP) != 0
    ln = 1 if cfg.latent_norm else 0
    ia = Int32(0)
    iu = Int32(1 + ln)
    ih = Int32(0)
    if routed:
        ih = Int32(2 + ln)
    idn = ih + 1
    io = ih + 2 if mlp else ih
    # routed source (its x is the fp32-combined latent sum, cast to bf16 by EXPERT_DOWN)
    xa = _row0(ctx, ia)
    xas = ctx.s_d1[ia] * ctx.s_d2[ia] // VEC
    if const_expr(cfg.latent_norm):
        if routed:
            rstd_rows(xa, xas, Int32(cfg.B), ctx.s_d2[ia] // VEC, cfg.eps, ctx.s_f32)
    av = gchunks(xa)
    gv = gchunks(ctx.s_addr[1]) if const_expr(cfg.latent_norm) else None
    nch_u = ctx.s_d2[iu] // VEC
    wu0 = _row0(ctx, iu)
    su = _staged_rows(ctx, iu)
    # mlp source
    xh = _row0(ctx, ih)
    xhs = ctx.s_d1[ih] * ctx.s_d2[ih] // VEC
    hv = gchunks(xh)
    nch_d = ctx.s_d2[idn] // VEC
    wd0 = _row0(ctx, idn)
    sd = _staged_rows(ctx, idn)
    n = tile_rows(_bx(ctx, io, C0), _bx(ctx, io, C1))
    entry, c0 = _bx(ctx, io, R0), _bx(ctx, io, C0)
    sb = gflat(BFloat16, ctx.s_addr[io])
    ar = cute.make_rmem_tensor((BT,), Float32)
    am = cute.make_rmem_tensor((BT,), Float32)
    for k in cutlass.range(ctx.warp, n * NBT, NW, unroll=1):
        j, t = mk_addr.gemv_item(k, n, NBT)
        ar.fill(0.0)
        am.fill(0.0)
        if routed:
            weight_row_dot(ctx.s_stage, su, wu0, j, nch_u, av, t * BT * xas, xas, False, gv, ar, BT, U,
                           wide_tail=True)
        if mlp:
            weight_row_dot(ctx.s_stage, sd, wd0, j, nch_d, hv, t * BT * xhs, xhs, False, None, am, BT, U,
                           wide_tail=True)
        for bb in cutlass.range_constexpr(BT):
            b = t * BT + bb
            yr = warp_sum(ar[bb])
            ym = warp_sum(am[bb])
            out = Float32(0.0)
            if routed:
                if const_expr(cfg.latent_norm):
                    yr = yr * ctx.s_f32[b]
                out = bf16_round(yr)
            if mlp:
                out = bf16_round(out + bf16_round(ym))
            if ctx.lane == bb % 32:
                off = _eoff(ctx.s_d1[io], ctx.s_d2[io], b, entry, c0 + j)
                sb[off] = (sb[off].to(Float32) + out).to(BFloat16)


@cute.jit
def op_lm_head(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT, U, NBT = _tiling(cfg)
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    ti, r0 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 2]
    n = tile_rows(r0, ctx.s_ins[W_ARGS + 3])
    nch = ctx.s_d2[2] // VEC
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    gv = gchunks(ctx.s_addr[1])
    logits = gflat(Float32, ctx.s_addr[3])
    # per-(warp, token) running arg-max in smem; slot (w, b) is only ever touched by lane b % BT of warp w (the
    # lane that stores token b's results below), so no intra-warp synchronisation is needed
    s_bv = cute.make_tensor(ctx.s_f32.iterator + F32_VEC, cute.make_layout(NW * cfg.B))
    s_bi = ctx.s_i32
    if ctx.lane < BT:
        for b in cutlass.range(ctx.lane, cfg.B, BT, unroll=1):
            s_bv[ctx.warp * cfg.B + b] = -Float32.inf
            s_bi[ctx.warp * cfg.B + b] = 2**31 - 1
    acc = cute.make_rmem_tensor((BT,), Float32)
    for k in cutlass.range(ctx.warp, n * NBT, NW, unroll=1):
        j, t = mk_addr.gemv_item(k, n, NBT)
        weight_row_dot(ctx.s_stage, staged, wrow0, j, nch, xv, t * BT * xs, xs, False, gv, acc, BT, U,
                       wide_tail=True)
        for bb in cutlass.range_constexpr(BT):
            b = t * BT + bb
            d = bf16_round(warp_sum(acc[bb]) * ctx.s_f32[b])  # the reference's bf16 linear, then fp32
            if ctx.lane == bb % 32:
                logits[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), r0 + j)] = d
                slot = ctx.warp * cfg.B + b
                if d > s_bv[slot]:  # a warp's rows ascend: strict > keeps the lowest id
                    s_bv[slot] = d
                    s_bi[slot] = j
    cute.arch.sync_threads()
    best_v = gflat(Float32, ctx.s_addr[4])
    best_i = gflat(Int64, ctx.s_addr[5])
    if ctx.tidx < cfg.B:
        b = ctx.tidx
        v, i = s_bv[b], s_bi[b]
        for w in cutlass.range_constexpr(1, NW):
            ov, oi = s_bv[w * cfg.B + b], s_bi[w * cfg.B + b]
            take = (ov > v) | ((ov == v) & (oi < i))
            v, i = (ov, oi) if take else (v, i)
        best_v[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), ti)] = v
        best_i[_eoff(ctx.s_d1[5], ctx.s_d2[5], b, Int32(0), ti)] = Int64(r0 + i)
