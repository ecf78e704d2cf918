"""The megakernel's KDA opcode: KDA_STEP (device code; see ``OPCODE_NOTES`` in ``megakernel.py``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from .device_fns import (
    NW,
    bf16_round,
    block_allreduce,
    gflat,
    sigmoid,
    silu,
)
from .isa import (
    C0,
    W_ARGS,
)
from .mk_operands import (
    F32_RED,
    F32_VEC,
    _bx,
    _Ctx,
    _eoff,
    _kda_groups,
)


@cute.jit
def op_kda_step(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    dk, W = cfg.dk, cfg.conv
    hw = 4 * dk + 1
    KP = _kda_groups(dk)  # row groups of the state (threads per state column)
    R = dk // KP  # state rows per thread
    h0, h1, b0, b1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    mp = gflat(BFloat16, ctx.s_addr[0])
    fa0 = _bx(ctx, 1, C0)
    conv = gflat(BFloat16, ctx.s_addr[2])
    S = gflat(Float32, ctx.s_addr[3])
    fb = gflat(BFloat16, ctx.s_addr[4])
    dt = gflat(Float32, ctx.s_addr[5])
    alog = gflat(Float32, ctx.s_addr[6])
    cw = gflat(Float32, ctx.s_addr[7])
    onorm = gflat(Float32, ctx.s_addr[8])
    out = gflat(BFloat16, ctx.s_addr[9])
    s_red = cute.make_tensor(ctx.s_f32.iterator + F32_RED, cute.make_layout(NW * 2))
    base = F32_VEC
    sq, sk, sv, sdec, sgt, sred = base, base + dk, base + 2 * dk, base + 3 * dk, base + 4 * dk, base + 5 * dk
    sf = ctx.s_f32
    vals = cute.make_rmem_tensor((2,), Float32)
    i = ctx.tidx
    vcol, p = ctx.tidx % dk, ctx.tidx // dk
    for h in cutlass.range(h0, h1, unroll=1):
        for b in cutlass.range(b0, b1, unroll=1):
            row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0))
            beta = sigmoid(mp[row + h * hw + 4 * dk].to(Float32))
            vals.fill(0.0)
            if i < dk:
                c = h * dk + i
                z = [Float32(0.0), Float32(0.0), Float32(0.0)]
                for jj in cutlass.range_constexpr(3):
                    raw = mp[row + h * hw + jj * dk + i].to(Float32)
                    hist = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(jj), c * (W - 1))
                    wrow = _eoff(Int32(1), ctx.s_d2[7], Int32(0), Int32(jj), c * W)
                    win = [conv[hist + t].to(Float32) for t in range(W - 1)] + [raw]  # oldest first
                    a = Float32(0.0)
                    for t in cutlass.range_constexpr(W):
                        a = a + win[t] * cw[wrow + t]
                    for t in cutlass.range_constexpr(W - 1):  # shift the history (this channel is ours alone)
                        conv[hist + t] = win[t + 1].to(BFloat16)
                    z[jj] = bf16_round(silu(a))
                u = Float32(0.0)
                frow = _eoff(Int32(1), ctx.s_d2[4], Int32(0), c, Int32(0))
                for jj in cutlass.range(dk, unroll=1):
                    u = u + mp[row + fa0 + jj].to(Float32) * fb[frow + jj].to(Float32)
                u = bf16_round(u) + dt[c]  # F.linear in bf16 rounds, then fp32 + dt_bias
                lam = cute.math.exp(alog[h])
                g = Float32(0.0)
                if const_expr(cfg.kda_lb is not None):
                    g = cfg.kda_lb * sigmoid(lam * u)
                else:
                    sp = u if u > 20.0 else cute.math.log(1.0 + cute.math.exp(u))
                    g = -lam * sp
                sf[sq + i] = z[0]
                sf[sk + i] = z[1]
                sf[sv + i] = z[2]
                sf[sdec + i] = cute.math.exp(g)
                sf[sgt + i] = mp[row + h * hw + 3 * dk + i].to(Float32)
                vals[0] = z[0] * z[0]
                vals[1] = z[1] * z[1]
            block_allreduce(vals, s_red, 2)
            rq = cute.math.rsqrt(vals[0] + 1e-6) * (dk**-0.5)  # l2norm (eps inside the root), q scaled by dk^-½
            rk = cute.math.rsqrt(vals[1] + 1e-6)
            srow = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, h, Int32(0))
            part = Float32(0.0)
            if p < KP:
                for r in cutlass.range(R, unroll=8):
                    ii = p * R + r
                    s = S[srow + ii * dk + vcol] * sf[sdec + ii]  # decay the key rows first
                    part = part + s * (sf[sk + ii] * rk)
                sf[sred + p * dk + vcol] = part
            cute.arch.sync_threads()
            rv = Float32(0.0)
            if p < KP:
                for pp in cutlass.range_constexpr(KP):
                    rv = rv + sf[sred + pp * dk + vcol]
            cute.arch.sync_threads()
            if p < KP:
                delta = beta * (sf[sv + vcol] - rv)
                po = Float32(0.0)
                for r in cutlass.range(R, unroll=8):
                    ii = p * R + r
                    s = S[srow + ii * dk + vcol] * sf[sdec + ii] + (sf[sk + ii] * rk) * delta
                    S[srow + ii * dk + vcol] = s
                    po = po + s * (sf[sq + ii] * rq)  # read with the updated state
                sf[sred + p * dk + vcol] = po
            cute.arch.sync_threads()
            o = Float32(0.0)
            vals.fill(0.0)
            if i < dk:
                for pp in cutlass.range_constexpr(KP):
                    o = o + sf[sred + pp * dk + i]
                o = bf16_round(o)  # cast to bf16 before the gated norm (pitfall 4)
                vals[0] = o * o
            block_allreduce(vals, s_red, 1)
            if i < dk:
                y = o * cute.math.rsqrt(vals[0] * (1.0 / dk) + cfg.eps, fastmath=True) * onorm[i] * sigmoid(sf[sgt + i])
                out[_eoff(ctx.s_d1[9], ctx.s_d2[9], b, Int32(0), h * dk + i)] = y.to(BFloat16)
