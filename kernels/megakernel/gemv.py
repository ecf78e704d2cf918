"""The megakernel's tiled-GEMV opcodes: NORM_PROJ, MLP_GATE_UP, O_PROJ_RESIDUAL, FFN_OUT, LM_HEAD (device code;
what each computes: its ``op_*`` docstring).

Two paths, chosen at trace time by the batch (:func:`_mma`). Below batch 8, CUDA cores: one pass of the whole batch
(``mk_addr.gemv_batch_tile``), each weight chunk a lane loads serving every row of it, so each weight row streams
from memory once (``device_fns.weight_row_dot``). From batch 8, tensor cores: 16-row weight tiles x a group of
passes of 8 batch rows (``device_fns.weight_tile_mma``), each weight chunk loaded once per group
(``mk_addr.gemv_groups``). One work-item loop (:func:`_for_items`: (weight rows, pass or group) items dealt
round-robin over the warps, ``mk_addr.gemv_item``) calls each opcode's item function, which holds both paths and the
opcode's epilogue. Design: ``docs/architecture.md`` (appendix: design notes by room, ``kernels/megakernel/gemv.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from kimik3.kernels.common.device import argmax_take, warp_argmax
from kimik3.kernels.contracts import addr as mk_addr
from kimik3.kernels.contracts.addr import tile_rows
from kimik3.kernels.contracts.isa import (
    C0,
    C1,
    FFN_MLP,
    FFN_ROUTED,
    OPERAND_WORDS,
    OW_MODE,
    R0,
    R1,
    W_ARGS,
    W_OPS,
    Mode,
)
from kimik3.kernels.megakernel.device_fns import (
    NW,
    VEC,
    bf16_round,
    gchunks,
    gflat,
    glu,
    rstd_rows,
    warp_sum,
    weight_row_dot,
    weight_tile_mma,
)
from kimik3.kernels.megakernel.mma import MMA_COLS, acc_col, acc_row
from kimik3.kernels.megakernel.operands import (
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
    return BT, mk_addr.gemv_unroll(cfg.arch, BT), cfg.B // BT


def _mma(cfg: Any, normed: bool = False, sources: int = 1) -> tuple[bool, int, int, int, int]:
    """Whether the GEMV opcodes take the tensor-core path, its weight rows per work item, its k blocks in flight per
    lane (``normed``: for an x normalised as loaded), and for an item accumulating ``sources`` weights at once its
    passes per group and its groups. The two paths:

    * batch 8 and above (``mk_addr.gemv_mma``): tensor cores. A work item is a 16-row weight tile
      (``mk_addr.gemv_tile_rows``) x a group of passes of 8 batch rows (``mk_addr.gemv_group_passes``: up to 32 batch
      rows for one weight, 16 for MLP_GATE_UP's and FFN_OUT's two), one ``mma.sync.m16n8k16`` bf16 product per 16 k and
      pass (``device_fns.weight_tile_mma``, the chunk layout of ``kernels/megakernel/mma.py``): lane (g, q) loads chunk
      q of weight rows g and g + 8 once per 32-element k block and chunk q of x row g of every pass,
      ``mk_addr.gemv_mma_unroll`` k blocks per step (4: 8 weight 16-byte loads in flight per lane, 48 KiB of weights per
      SM; one fewer for an x normalised as loaded; 2 from 4 passes). Each weight chunk is loaded once per group, each x
      chunk once per 16 weight rows. Normalised inputs (NORM_PROJ, MLP_GATE_UP, LM_HEAD, FFN_OUT's latent norm) are
      normalised as loaded, ``bf16(γ·bf16(x·rstd))`` as ``kimik3.model.modeling.rms_norm`` (the mma's B operand is
      bf16), so no rstd is applied afterwards. The accumulators come out in the C fragment layout: lane l's register (i,
      p) is (tile row ``mk_mma.acc_row(l, i)``, batch row ``mk_addr.gemv_group_row(group, p, mk_mma.acc_col(l, i),
      P)``), stored by that lane with no warp sum; rows past the box (the last tile's) and batch rows past the batch are
      never stored.
    * batch 1 to 7 (and LM_HEAD at every batch if ``mk_addr.LM_HEAD_MMA`` is off): CUDA cores, one weight row per
      item through ``device_fns.weight_row_dot`` (``mk_addr.gemv_unroll``: 8 16-byte weight loads in flight per lane
      per step, 384 threads x 8 x 16 B = 48 KiB per SM; 6 at passes of 1 or 2 rows, whose x chunks are loaded next to
      the weights), the warp sum, then the epilogue; gamma is folded into the weight in fp32 and rstd applied to the
      dot; one pass of the batch (``mk_addr.gemv_batch_tile``).

    One flat item loop rather than a pass loop inside the row loop: the nested loops' state did not fit next to the dot
    step at batch 64 (ptxas spilled the megakernel)."""
    B = cfg.B
    P = mk_addr.gemv_group_passes(B, sources)
    return (mk_addr.gemv_mma(B), mk_addr.gemv_tile_rows(B), mk_addr.gemv_mma_unroll(cfg.arch, normed, P), P,
            mk_addr.gemv_groups(B, sources))


@cute.jit
def _for_items(ctx: _Ctx, n: Int32, MMA: cutlass.Constexpr, item: cutlass.Constexpr, sources: cutlass.Constexpr,
               *args: Any) -> None:
    """The GEMV opcodes' work-item loop, written once: (weight rows, batch pass or pass group) items dealt
    round-robin over the warps (``mk_addr.gemv_item``); ``item(ctx, j, t, *args)`` computes and stores one, ``j``
    its first weight row (of a 16-row tile on the tensor-core path, ``MMA``) and ``t`` its pass (CUDA cores) or pass
    group (tensor cores, groups for ``sources`` weights)."""
    if const_expr(MMA):
        _, TR, _, _, NG = _mma(ctx.cfg, False, sources)
        nt = mk_addr.gemv_tiles(n, TR)
        for k in cutlass.range(ctx.warp, nt * NG, NW, unroll=1):
            jt, t = mk_addr.gemv_item(k, nt, NG)
            item(ctx, jt * TR, t, *args)
    else:
        _, _, NBT = _tiling(ctx.cfg)
        for k in cutlass.range(ctx.warp, n * NBT, NW, unroll=1):
            j, t = mk_addr.gemv_item(k, n, NBT)
            item(ctx, j, t, *args)


def _group_row0(t: Any, P: int) -> Any:
    """First batch row of pass group ``t`` (groups of ``P`` passes)."""
    return mk_addr.gemv_group_row(t, 0, 0, P)


@cute.jit
def _mma_store(ctx: _Ctx, j: Int32, t: Int32, n: Int32, P: cutlass.Constexpr, i: cutlass.Constexpr, p: cutlass.Constexpr
               ) -> tuple[Any, Int32, Int32]:
    """(stored?, weight row, batch row) of a lane's accumulator register ``(i, p)`` of tensor-core item ``(j, t)``."""
    jj = j + acc_row(ctx.lane, i)
    b = mk_addr.gemv_group_row(t, p, acc_col(ctx.lane, i), P)
    return (jj < n) & (b < ctx.cfg.B), jj, b


@cute.jit
def _gemv_prologue(ctx: _Ctx, xop: Int32, eps: cutlass.Constexpr) -> tuple[Any, Int32]:
    """x rows of operand ``xop`` as a chunk view + its batch stride in chunks; their rstd into s_f32[0:B]."""
    xaddr = _row0(ctx, xop)
    xs = ctx.s_d1[xop] * ctx.s_d2[xop] // VEC
    rstd_rows(xaddr, xs, Int32(ctx.cfg.B), ctx.s_d2[xop] // VEC, eps, ctx.s_f32)
    return gchunks(xaddr), xs


@cute.jit
def op_norm_proj(ctx: _Ctx) -> None:
    """NORM_PROJ: y = rms_norm(x)·γ · Wᵀ for the instruction's weight rows (its output columns), fp32 or bf16 out
    (``W_ARGS``): the rstd of every batch row first, then the work items; on CUDA cores γ is folded into the weight and
    rstd applied after the dot (guide §3.1), on tensor cores x is normalised as loaded. Known limits: CUDA-core FMAs,
    one CTA per SM: 12 warps keep 48 KiB of weights in flight per SM; the smem stage, copied while the previous
    instruction ran, covers the first 48 KiB of rows; up to batch 8 each weight row is read once, at B = 64 once per
    pass of 8 (L1) and x comes from L1/L2 for every row (FMA/L1-bound on that path). At batch passes of 8 rows (B = 8,
    64) the tensor-core path instead, with 3 k blocks in flight per lane (36 KiB of weights per SM: the γ chunks take
    the registers)."""
    cfg = ctx.cfg
    BT, _, _ = _tiling(cfg)
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
    MMA, _, _, P, _ = _mma(cfg, True)
    acc = cute.make_rmem_tensor((4, P) if const_expr(MMA) else (BT,), Float32)
    _for_items(ctx, n, MMA, _norm_proj_item, 1, staged, wrow0, n, nch, xv, xs, gv, acc, o0, of, ob, fp32)


@cute.jit
def _norm_proj_item(ctx: _Ctx, j: Int32, t: Int32, staged: Int32, wrow0: Int64, n: Int32, nch: Int32, xv: Any,
                    xs: Int32, gv: Any, acc: cute.Tensor, o0: Int32, of: Any, ob: Any, fp32: Int32) -> None:
    """NORM_PROJ's work item ``(j, t)`` (:func:`_for_items`): its dot and its stores."""
    cfg = ctx.cfg
    BT, U, _ = _tiling(cfg)
    MMA, _, UM, P, _ = _mma(cfg, True)
    if const_expr(MMA):
        weight_tile_mma(ctx.s_stage, staged, wrow0, j, n, nch, xv, _group_row0(t, P), Int32(cfg.B), xs, gv,
                        ctx.s_f32, acc, UM)
        for p in cutlass.range_constexpr(P):
            for i in cutlass.range_constexpr(4):
                ok, jj, b = _mma_store(ctx, j, t, n, P, i, p)
                if ok:
                    off = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), o0 + jj)
                    if fp32 != 0:
                        of[off] = acc[i, p]
                    else:
                        ob[off] = acc[i, p].to(BFloat16)
    else:
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
    """MLP_GATE_UP: as NORM_PROJ for the gate and the up row of each channel, then SiTU-GLU (or SwiGLU) in fp32. Known
    limits: as NORM_PROJ; x is read twice per channel (once per weight)."""
    cfg = ctx.cfg
    BT, _, _ = _tiling(cfg)
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    n = tile_rows(_bx(ctx, 2, R0), _bx(ctx, 2, R1))
    nch = ctx.s_d2[2] // VEC
    wg0, wu0 = _row0(ctx, 2), _row0(ctx, 3)
    sg, su = _staged_rows(ctx, Int32(2)), _staged_rows(ctx, Int32(3))
    gv = gchunks(ctx.s_addr[1])
    o0 = _bx(ctx, 4, C0)
    ob = gflat(BFloat16, ctx.s_addr[4])
    MMA, _, _, P, _ = _mma(cfg, True, 2)
    ag = cute.make_rmem_tensor((4, P) if const_expr(MMA) else (BT,), Float32)
    au = cute.make_rmem_tensor((4, P) if const_expr(MMA) else (BT,), Float32)
    _for_items(ctx, n, MMA, _mlp_gate_up_item, 2, sg, su, wg0, wu0, n, nch, xv, xs, gv, ag, au, o0, ob)


@cute.jit
def _mlp_gate_up_item(ctx: _Ctx, j: Int32, t: Int32, sg: Int32, su: Int32, wg0: Int64, wu0: Int64, n: Int32,
                      nch: Int32, xv: Any, xs: Int32, gv: Any, ag: cute.Tensor, au: cute.Tensor, o0: Int32,
                      ob: Any) -> None:
    """MLP_GATE_UP's work item ``(j, t)`` (:func:`_for_items`): the gate and up dots, SiTU-GLU, the stores."""
    cfg = ctx.cfg
    BT, U, _ = _tiling(cfg)
    MMA, _, UM, P, _ = _mma(cfg, True, 2)
    if const_expr(MMA):
        b0 = _group_row0(t, P)
        weight_tile_mma(ctx.s_stage, sg, wg0, j, n, nch, xv, b0, Int32(cfg.B), xs, gv, ctx.s_f32, ag, UM)
        weight_tile_mma(ctx.s_stage, su, wu0, j, n, nch, xv, b0, Int32(cfg.B), xs, gv, ctx.s_f32, au, UM)
        for p in cutlass.range_constexpr(P):
            for i in cutlass.range_constexpr(4):
                ok, jj, b = _mma_store(ctx, j, t, n, P, i, p)
                h = glu(bf16_round(ag[i, p]), bf16_round(au[i, p]), cfg.situ, cfg.situ_beta, cfg.situ_lin)
                if ok:
                    ob[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), o0 + jj)] = h.to(BFloat16)
    else:
        weight_row_dot(ctx.s_stage, sg, wg0, j, nch, xv, t * BT * xs, xs, False, gv, ag, BT, U, wide_tail=True)
        weight_row_dot(ctx.s_stage, su, wu0, j, nch, xv, t * BT * xs, xs, False, gv, au, BT, U, wide_tail=True)
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
    """O_PROJ_RESIDUAL: one o_proj row (a column of the stream) per work item: its dot over the mixer output, rounded to
    bf16, added into (or, per ``W_ARGS``, starting) the block's partial sum. Known limits: as NORM_PROJ."""
    cfg = ctx.cfg
    BT, _, _ = _tiling(cfg)
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
    MMA, _, _, P, _ = _mma(cfg)
    acc = cute.make_rmem_tensor((4, P) if const_expr(MMA) else (BT,), Float32)
    _for_items(ctx, n, MMA, _o_proj_item, 1, staged, wrow0, n, nch, xv, xs, acc, entry, c0, sb, accumulate)


@cute.jit
def _o_proj_item(ctx: _Ctx, j: Int32, t: Int32, staged: Int32, wrow0: Int64, n: Int32, nch: Int32, xv: Any,
                 xs: Int32, acc: cute.Tensor, entry: Int32, c0: Int32, sb: Any, accumulate: Int32) -> None:
    """O_PROJ_RESIDUAL's work item ``(j, t)`` (:func:`_for_items`): the dot, rounded to bf16, into the partial sum."""
    cfg = ctx.cfg
    BT, U, _ = _tiling(cfg)
    MMA, _, UM, P, _ = _mma(cfg)
    if const_expr(MMA):
        weight_tile_mma(ctx.s_stage, staged, wrow0, j, n, nch, xv, _group_row0(t, P), Int32(cfg.B), xs, None, None,
                        acc, UM)
        for p in cutlass.range_constexpr(P):
            for i in cutlass.range_constexpr(4):
                ok, jj, b = _mma_store(ctx, j, t, n, P, i, p)
                if ok:
                    off = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, entry, c0 + jj)
                    y = bf16_round(acc[i, p])
                    if accumulate != 0:
                        y = sb[off].to(Float32) + y
                    sb[off] = y.to(BFloat16)
    else:
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
    """FFN_OUT: per hidden column, the routed part (latent RMSNorm applied after the dot) and / or the shared or dense
    down row, each rounded to bf16 as the reference does, added into the stream. Operand order (scheduler ``out_cols``):
    [latent sum, (latent norm), up rows] if routed, [mlp hidden, down rows] if mlp, stream column tile last. Known
    limits: as NORM_PROJ."""
    cfg = ctx.cfg
    BT, _, _ = _tiling(cfg)
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
    MMA, _, _, P, _ = _mma(cfg, False, 2)
    ar = cute.make_rmem_tensor((4, P) if const_expr(MMA) else (BT,), Float32)
    am = cute.make_rmem_tensor((4, P) if const_expr(MMA) else (BT,), Float32)
    _for_items(ctx, n, MMA, _ffn_out_item, 2, routed, mlp, av, xas, gv, nch_u, wu0, su, hv, xhs, nch_d, wd0, sd, n, io,
               entry, c0, sb, ar, am)


@cute.jit
def _ffn_out_item(ctx: _Ctx, j: Int32, t: Int32, routed: Any, mlp: Any, av: Any, xas: Int32, gv: Any, nch_u: Int32,
                  wu0: Int64, su: Int32, hv: Any, xhs: Int32, nch_d: Int32, wd0: Int64, sd: Int32, n: Int32,
                  io: Int32, entry: Int32, c0: Int32, sb: Any, ar: cute.Tensor, am: cute.Tensor) -> None:
    """FFN_OUT's work item ``(j, t)`` (:func:`_for_items`): the routed and / or the mlp dot, their bf16 sum into the
    stream; on tensor cores the routed latent sum is normalised as loaded when the model has the latent norm."""
    cfg = ctx.cfg
    BT, U, _ = _tiling(cfg)
    MMA, _, UM, P, _ = _mma(cfg, False, 2)
    ar.fill(0.0)
    am.fill(0.0)
    if const_expr(MMA):
        _, _, UN, _, _ = _mma(cfg, cfg.latent_norm, 2)
        b0 = _group_row0(t, P)
        if routed:
            r = ctx.s_f32 if const_expr(cfg.latent_norm) else None
            weight_tile_mma(ctx.s_stage, su, wu0, j, n, nch_u, av, b0, Int32(cfg.B), xas, gv, r, ar, UN)
        if mlp:
            weight_tile_mma(ctx.s_stage, sd, wd0, j, n, nch_d, hv, b0, Int32(cfg.B), xhs, None, None, am, UM)
        for p in cutlass.range_constexpr(P):
            for i in cutlass.range_constexpr(4):
                ok, jj, b = _mma_store(ctx, j, t, n, P, i, p)
                out = Float32(0.0)
                if routed:
                    out = bf16_round(ar[i, p])
                if mlp:
                    out = bf16_round(out + bf16_round(am[i, p]))
                if ok:
                    off = _eoff(ctx.s_d1[io], ctx.s_d2[io], b, entry, c0 + jj)
                    sb[off] = _ffn_store(ctx, sb, off, out, io)
    else:
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
                sb[off] = _ffn_store(ctx, sb, off, out, io)


MODE_READ = int(Mode.READ)


@cute.jit
def _ffn_store(ctx: _Ctx, sb: Any, off: Int64, out: Float32, io: Int32) -> BFloat16:
    """FFN_OUT's bf16 result for the stream column: added into the block's partial sum — or, on a rank of several
    (its output a mailbox row it writes: operand mode without READ), the rank's partial as it is."""
    y = (sb[off].to(Float32) + out).to(BFloat16)
    if const_expr(ctx.cfg.ranks):
        if (ctx.s_ins[W_OPS + OPERAND_WORDS * io + OW_MODE] & MODE_READ) == 0:
            y = out.to(BFloat16)
    return y


@cute.jit
def op_lm_head(ctx: _Ctx) -> None:
    """LM_HEAD: the final RMSNorm and one vocabulary row per work item: bf16-rounded fp32 logits and a per-warp running
    arg-max per token, merged across the warps through shared memory (ties to the lowest id). CUDA cores at every batch
    unless ``mk_addr.LM_HEAD_MMA`` (off: why there); on tensor cores from batch 8: the logits of a lane's accumulators,
    the tile's winner per batch column by a butterfly over the 8 lane groups, kept per (warp, token) by the column's
    quad lane. Known limits: as NORM_PROJ's CUDA-core path; above batch 8 the vocabulary is read once per pass."""
    cfg = ctx.cfg
    BT, _, _ = _tiling(cfg)
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    ti, r0 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 2]
    n = tile_rows(r0, ctx.s_ins[W_ARGS + 3])
    nch = ctx.s_d2[2] // VEC
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    gv = gchunks(ctx.s_addr[1])
    logits = gflat(Float32, ctx.s_addr[3])
    # per-(warp, token) running arg-max in smem; slot (w, b) is only ever touched by one lane of warp w, the lane
    # that holds token b's winner below (CUDA cores: lane b % BT; tensor cores: lane (b % 8) // 2), so no
    # intra-warp synchronisation is needed
    s_bv = cute.make_tensor(ctx.s_f32.iterator + F32_VEC, cute.make_layout(NW * cfg.B))
    s_bi = ctx.s_i32
    MMA, _, _, P, _ = _mma(cfg, True)
    if const_expr(MMA and mk_addr.LM_HEAD_MMA):
        # the slots of batch columns 2q, 2q + 1 of every pass belong to lane q < 4 (it holds the tile's winner)
        if ctx.lane < MMA_COLS // 2:
            for b in cutlass.range(2 * ctx.lane, cfg.B, MMA_COLS, unroll=1):
                for c in cutlass.range_constexpr(2):
                    if b + c < cfg.B:
                        s_bv[ctx.warp * cfg.B + b + c] = -Float32.inf
                        s_bi[ctx.warp * cfg.B + b + c] = 2**31 - 1
        acc = cute.make_rmem_tensor((4, P), Float32)
        _for_items(ctx, n, True, _lm_head_item, 1, staged, wrow0, n, nch, xv, xs, gv, acc, logits, r0, s_bv, s_bi)
    else:
        if ctx.lane < BT:
            for b in cutlass.range(ctx.lane, cfg.B, BT, unroll=1):
                s_bv[ctx.warp * cfg.B + b] = -Float32.inf
                s_bi[ctx.warp * cfg.B + b] = 2**31 - 1
        acc = cute.make_rmem_tensor((BT,), Float32)
        _for_items(ctx, n, False, _lm_head_item, 1, staged, wrow0, n, nch, xv, xs, gv, acc, logits, r0, s_bv, s_bi)
    cute.arch.sync_threads()
    best_v = gflat(Float32, ctx.s_addr[4])
    best_i = gflat(Int64, ctx.s_addr[5])
    if ctx.tidx < cfg.B:
        b = ctx.tidx
        v, i = s_bv[b], s_bi[b]
        for w in cutlass.range_constexpr(1, NW):
            ov, oi = s_bv[w * cfg.B + b], s_bi[w * cfg.B + b]
            v, i = (ov, oi) if argmax_take(ov, oi, v, i) else (v, i)
        row = Int32(0)  # [b, 0, ti]; a rank's bests: its row of the mailbox, [b, rank, ti]
        if const_expr(cfg.ranks):
            row = _bx(ctx, 4, R0)
        best_v[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, row, ti)] = v
        best_i[_eoff(ctx.s_d1[5], ctx.s_d2[5], b, row, ti)] = Int64(r0 + i)


@cute.jit
def _lm_head_item(ctx: _Ctx, j: Int32, t: Int32, staged: Int32, wrow0: Int64, n: Int32, nch: Int32, xv: Any,
                  xs: Int32, gv: Any, acc: cute.Tensor, logits: Any, r0: Int32, s_bv: cute.Tensor,
                  s_bi: cute.Tensor) -> None:
    """LM_HEAD's work item ``(j, t)`` (:func:`_for_items`): the logits and the warp's running arg-max per token
    (a warp's items ascend, so a strict > keeps the lowest id)."""
    cfg = ctx.cfg
    BT, U, _ = _tiling(cfg)
    MMA, _, UM, P, _ = _mma(cfg, True)
    if const_expr(MMA and mk_addr.LM_HEAD_MMA):
        weight_tile_mma(ctx.s_stage, staged, wrow0, j, n, nch, xv, _group_row0(t, P), Int32(cfg.B), xs, gv,
                        ctx.s_f32, acc, UM)
        for p in cutlass.range_constexpr(P):
            for c in cutlass.range_constexpr(2):  # batch column 2q + c: registers c (row g), c + 2 (row g + 8)
                v = -Float32.inf
                vi = Int32(2**31 - 1)
                b = Int32(0)
                for i in cutlass.range_constexpr(c, 4, 2):  # row g, then g + 8: strict > keeps the lower
                    ok, jj, b = _mma_store(ctx, j, t, n, P, i, p)
                    d = bf16_round(acc[i, p])  # the reference's bf16 linear, then fp32
                    if ok:
                        logits[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), r0 + jj)] = d
                        if d > v:
                            v, vi = d, jj
                v, vi = warp_argmax(v, vi, 3)  # over the 8 lane groups (lane bits 2..4): ties to the lower
                if ctx.lane < MMA_COLS // 2:
                    if b < cfg.B:
                        slot = ctx.warp * cfg.B + b
                        if v > s_bv[slot]:
                            s_bv[slot] = v
                            s_bi[slot] = vi
    else:
        weight_row_dot(ctx.s_stage, staged, wrow0, j, nch, xv, t * BT * xs, xs, False, gv, acc, BT, U,
                       wide_tail=True)
        for bb in cutlass.range_constexpr(BT):
            b = t * BT + bb
            d = bf16_round(warp_sum(acc[bb]) * ctx.s_f32[b])  # the reference's bf16 linear, then fp32
            if ctx.lane == bb % 32:
                logits[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), r0 + j)] = d
                slot = ctx.warp * cfg.B + b
                if d > s_bv[slot]:
                    s_bv[slot] = d
                    s_bi[slot] = j
