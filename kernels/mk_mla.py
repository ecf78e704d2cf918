"""The megakernel's MLA opcodes: MLA_Q, MLA_KV_APPEND, MLA_PARTIAL, MLA_REDUCE (device code; see ``OPCODE_NOTES``
in ``megakernel.py``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from .device_fns import (
    NT,
    NW,
    VEC,
    bf16_round,
    exp_fast,
    gchunks,
    gflat,
    sigmoid,
    warp_sum,
    weight_row_dot,
)
from .isa import (
    B0,
    B1,
    C0,
    R0,
    R1,
    W_ARGS,
    W_NOPS,
)
from .mk_operands import (
    _bx,
    _Ctx,
    _eoff,
    _row0,
    _staged_rows,
)


@cute.jit
def op_mla_q(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT = cfg.bt
    ql, kvl, nope, rope = cfg.ql, cfg.kvl, cfg.nope, cfg.rope
    qk = nope + rope
    h0, h1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1]
    mp = gflat(BFloat16, ctx.s_addr[0])
    qa0 = _bx(ctx, 0, C0)
    gv = gchunks(ctx.s_addr[1])
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    wuk = gflat(BFloat16, ctx.s_addr[3])
    mq = gflat(BFloat16, ctx.s_addr[4])
    xq0 = BT * ql  # s_xb: [0, BT*ql) q_a rows, [BT*ql, BT*ql + BT*nope) the tile's nope queries
    s_xbf, s_f32 = ctx.s_xbf, ctx.s_f32
    acc = cute.make_rmem_tensor((BT,), Float32)
    for t in cutlass.range(cfg.nbt, unroll=1):
        nb = BT
        # the packed projection's row stride need not be a multiple of 8: stage q_a rows in smem (aligned)
        for idx in cutlass.range(ctx.tidx, nb * ql, NT, unroll=1):
            bb, cc = idx // ql, idx % ql
            s_xbf[idx] = mp[_eoff(ctx.s_d1[0], ctx.s_d2[0], t * BT + bb, Int32(0), qa0 + cc)]
        cute.arch.sync_threads()
        for bb in cutlass.range(ctx.warp, nb, NW, unroll=1):
            part = Float32(0.0)
            for cc in cutlass.range(ctx.lane, ql, 32, unroll=1):
                x = s_xbf[bb * ql + cc].to(Float32)
                part = part + x * x
            tot = warp_sum(part)
            if ctx.lane == 0:
                s_f32[bb] = cute.math.rsqrt(tot * (1.0 / ql) + cfg.lora_eps, fastmath=True)
        cute.arch.sync_threads()
        for h in cutlass.range(h0, h1, unroll=1):
            for j in cutlass.range(ctx.warp, qk, NW, unroll=1):
                weight_row_dot(ctx.s_stage, staged, wrow0, (h - h0) * qk + j, Int32(ql // VEC), ctx.s_xb, Int32(0),
                               Int32(ql // VEC), True, gv, acc, nb, cfg.unroll)
                for bb in cutlass.range_constexpr(nb):
                    d = bf16_round(warp_sum(acc[bb]) * s_f32[bb])
                    if ctx.lane == bb % 32:
                        if j < nope:
                            s_xbf[xq0 + bb * nope + j] = d.to(BFloat16)
                        else:
                            mq[_eoff(ctx.s_d1[4], ctx.s_d2[4], t * BT + bb, h, kvl + j - nope)] = d.to(BFloat16)
            cute.arch.sync_threads()
            for col in cutlass.range(ctx.tidx, kvl, NT, unroll=1):  # absorb W_UK: q_lat = q_nope · W_UK[h]
                acc.fill(0.0)
                for nn in cutlass.range(nope, unroll=1):
                    w = wuk[_eoff(Int32(1), ctx.s_d2[3], Int32(0), h * nope + nn, col)].to(Float32)
                    for bb in cutlass.range_constexpr(nb):
                        acc[bb] += s_xbf[xq0 + bb * nope + nn].to(Float32) * w
                for bb in cutlass.range_constexpr(nb):
                    mq[_eoff(ctx.s_d1[4], ctx.s_d2[4], t * BT + bb, h, col)] = acc[bb].to(BFloat16)
            cute.arch.sync_threads()


@cute.jit
def op_mla_kv_append(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    kvl, rope = cfg.kvl, cfg.rope
    mp = gflat(BFloat16, ctx.s_addr[0])
    c0 = _bx(ctx, 0, C0)
    kvn = gflat(BFloat16, ctx.s_addr[1])
    pos = gflat(Int64, ctx.s_addr[2])
    lat = gflat(BFloat16, ctx.s_addr[3])
    kr = gflat(BFloat16, ctx.s_addr[4])
    for b in cutlass.range(ctx.warp, cfg.B, NW, unroll=1):
        p = Int32(pos[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), Int32(0))])
        row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), c0)
        part = Float32(0.0)
        for li in cutlass.range(ctx.lane, kvl, 32, unroll=1):
            x = mp[row + li].to(Float32)
            part = part + x * x
        r = cute.math.rsqrt(warp_sum(part) * (1.0 / kvl) + cfg.lora_eps, fastmath=True)
        for li in cutlass.range(ctx.lane, kvl, 32, unroll=1):  # the reference's order: bf16(x·rstd), then ·w in bf16
            xh = bf16_round(mp[row + li].to(Float32) * r)
            lat[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, p, li)] = (kvn[li].to(Float32) * xh).to(BFloat16)
        for li in cutlass.range(ctx.lane, rope, 32, unroll=1):  # NoPE: the shared key part is cached raw
            kr[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, p, li)] = mp[row + kvl + li]


@cute.jit
def op_mla_partial(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    kvl, rope = cfg.kvl, cfg.rope
    LPL, RPL = -(-kvl // 32), -(-rope // 32)
    h0, h1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1]
    b0, b1 = _bx(ctx, 0, B0), _bx(ctx, 0, B1)
    t0, t1 = _bx(ctx, 2, R0), _bx(ctx, 2, R1)
    col0 = _bx(ctx, 4, C0)
    mq = gflat(BFloat16, ctx.s_addr[0])
    pos = gflat(Int64, ctx.s_addr[1])
    cc = gflat(BFloat16, ctx.s_addr[2])
    kr = gflat(BFloat16, ctx.s_addr[3])
    part = gflat(Float32, ctx.s_addr[4])
    qv = cute.make_rmem_tensor((LPL,), Float32)
    qr = cute.make_rmem_tensor((RPL,), Float32)
    o = cute.make_rmem_tensor((LPL,), Float32)
    for b in cutlass.range(b0, b1, unroll=1):
        last = Int32(pos[_eoff(ctx.s_d1[1], ctx.s_d2[1], b, Int32(0), Int32(0))])
        tend = t1 if t1 < last + 1 else last + 1  # causal: the sequence's own cache up to its position
        for h in cutlass.range(h0 + ctx.warp, h1, NW, unroll=1):
            qrow = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, h, Int32(0))
            for m in cutlass.range_constexpr(LPL):
                lidx = ctx.lane + 32 * m
                qv[m] = mq[qrow + lidx].to(Float32) if lidx < kvl else Float32(0.0)
            for m in cutlass.range_constexpr(RPL):
                ridx = ctx.lane + 32 * m
                qr[m] = mq[qrow + kvl + ridx].to(Float32) if ridx < rope else Float32(0.0)
            o.fill(0.0)
            mrun, lrun = -Float32.inf, Float32(0.0)
            for t in cutlass.range(t0, tend, unroll=1):
                crow = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, t, Int32(0))
                krow = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, t, Int32(0))
                sl, srp = Float32(0.0), Float32(0.0)
                for m in cutlass.range_constexpr(LPL):
                    lidx = ctx.lane + 32 * m
                    if lidx < kvl:
                        sl = sl + qv[m] * cc[crow + lidx].to(Float32)
                for m in cutlass.range_constexpr(RPL):
                    ridx = ctx.lane + 32 * m
                    if ridx < rope:
                        srp = srp + qr[m] * kr[krow + ridx].to(Float32)
                # the reference's two bf16 einsums, their bf16 sum, then fp32 · scale
                s = bf16_round(bf16_round(warp_sum(sl)) + bf16_round(warp_sum(srp))) * cfg.mla_scale
                mnew = cute.arch.fmax(mrun, s)
                corr = exp_fast(mrun - mnew)
                pw = exp_fast(s - mnew)
                lrun = lrun * corr + pw
                for m in cutlass.range_constexpr(LPL):  # the cache row again (an L1 hit), instead of 16 registers
                    lidx = ctx.lane + 32 * m
                    if lidx < kvl:
                        o[m] = o[m] * corr + pw * cc[crow + lidx].to(Float32)
                mrun = mnew
            prow = _eoff(ctx.s_d1[4], ctx.s_d2[4], b, h, col0)
            for m in cutlass.range_constexpr(LPL):
                lidx = ctx.lane + 32 * m
                if lidx < kvl:
                    part[prow + lidx] = o[m]
            if ctx.lane == 0:
                part[prow + kvl] = mrun
                part[prow + kvl + 1] = lrun


@cute.jit
def op_mla_reduce(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT = cfg.bt
    kvl, dv = cfg.kvl, cfg.dv
    h0, h1, gate = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2]
    io = ctx.s_ins[W_NOPS] - 1
    part = gflat(Float32, ctx.s_addr[0])
    ns = ctx.s_d2[0] // (kvl + 2)
    wrow0 = _row0(ctx, 1)
    staged = _staged_rows(ctx, Int32(1))
    mp = gflat(BFloat16, ctx.s_addr[2])
    g0 = Int32(0)
    if gate != 0:
        g0 = _bx(ctx, 2, C0) - h0 * dv
    out = gflat(BFloat16, ctx.s_addr[io])
    s_xbf = ctx.s_xbf
    acc = cute.make_rmem_tensor((BT,), Float32)
    for t in cutlass.range(cfg.nbt, unroll=1):
        nb = BT
        for h in cutlass.range(h0, h1, unroll=1):
            for idx in cutlass.range(ctx.tidx, nb * kvl, NT, unroll=1):  # merge the splits: o_lat in smem (bf16)
                bb, lidx = idx // kvl, idx % kvl
                prow = _eoff(ctx.s_d1[0], ctx.s_d2[0], t * BT + bb, h, Int32(0))
                mx = -Float32.inf
                for s in cutlass.range(ns, unroll=1):
                    mx = cute.arch.fmax(mx, part[prow + s * (kvl + 2) + kvl])
                num, den = Float32(0.0), Float32(0.0)
                for s in cutlass.range(ns, unroll=1):
                    a = exp_fast(part[prow + s * (kvl + 2) + kvl] - mx)  # empty splits: exp(-inf) = 0
                    num = num + a * part[prow + s * (kvl + 2) + lidx]
                    den = den + a * part[prow + s * (kvl + 2) + kvl + 1]
                s_xbf[idx] = (num / den).to(BFloat16)
            cute.arch.sync_threads()
            for d in cutlass.range(ctx.warp, dv, NW, unroll=1):  # absorb W_UV, output gate
                weight_row_dot(ctx.s_stage, staged, wrow0, (h - h0) * dv + d, Int32(kvl // VEC), ctx.s_xb, Int32(0),
                               Int32(kvl // VEC), True, None, acc, nb, cfg.unroll)
                for bb in cutlass.range_constexpr(nb):
                    y = bf16_round(warp_sum(acc[bb]))
                    if ctx.lane == bb % 32:
                        if gate != 0:
                            gr = mp[_eoff(ctx.s_d1[2], ctx.s_d2[2], t * BT + bb, Int32(0), g0 + h * dv + d)]
                            y = bf16_round(y * bf16_round(sigmoid(gr.to(Float32))))
                        out[_eoff(ctx.s_d1[io], ctx.s_d2[io], t * BT + bb, Int32(0), h * dv + d)] = y.to(BFloat16)
            cute.arch.sync_threads()
