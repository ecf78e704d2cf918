"""The megakernel's MoE opcodes: ROUTER, EXPERT_GATE_UP, EXPERT_DOWN (device code; see ``OPCODE_NOTES`` in
``megakernel.py``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr

from .device_fns import (
    NT,
    NW,
    VEC,
    bf16_round,
    gchunks,
    gflat,
    glu,
    row_dot,
    warp_argmax,
    warp_sum,
)
from .isa import (
    W_ARGS,
)
from .mk_addr import expert_row_offset
from .mk_operands import (
    F32_VEC,
    _Ctx,
    _eoff,
    _pad32,
)


@cute.jit
def _precise_sigmoid(x: Float32) -> Float32:
    """Full-precision σ for the router: approximate scores could reorder near-ties and pick another expert."""
    return 1.0 / (1.0 + cute.math.exp(-x))


@cute.jit
def op_router(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    E, K, B = cfg.E, cfg.topk, cfg.B
    EPL = -(-E // 32)
    EP = _pad32(E)
    lg = gflat(Float32, ctx.s_addr[0])
    bias = gflat(Float32, ctx.s_addr[1])
    sel = gflat(Int64, ctx.s_addr[2])
    mw = gflat(Float32, ctx.s_addr[3])
    use = gflat(Uint8, ctx.s_addr[4])
    s_used, s_slot, s_sel = ctx.s_i32, ctx.s_i32, ctx.s_i32  # [0, EP) used, [EP, 2EP) slot, [2EP, ..) choices
    s_w = ctx.s_f32  # [F32_VEC, F32_VEC + B*K): weights
    for e in cutlass.range(ctx.tidx, EP, NT, unroll=1):
        s_used[e] = 0
    cute.arch.sync_threads()
    ch = cute.make_rmem_tensor((EPL,), Float32)
    ix = cute.make_rmem_tensor((EPL,), Int32)
    for b in cutlass.range(ctx.warp, B, NW, unroll=1):
        row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0))
        for m in cutlass.range_constexpr(EPL):
            e = ctx.lane + 32 * m
            ix[m] = e
            ch[m] = -Float32.inf
            if e < E:
                ch[m] = _precise_sigmoid(lg[row + e]) + bias[e]
        wsum = Float32(0.0)
        for r in cutlass.range_constexpr(K):
            v, i = ch[0], ix[0]
            for m in cutlass.range_constexpr(1, EPL):  # ascending ids: strict > keeps the lower id on ties
                take = ch[m] > v
                v, i = (ch[m], ix[m]) if take else (v, i)
            v, i = warp_argmax(v, i)
            for m in cutlass.range_constexpr(EPL):
                ch[m] = -Float32.inf if ix[m] == i else ch[m]
            w = _precise_sigmoid(lg[row + i])  # the weight comes from the unbiased score
            wsum = wsum + w
            if ctx.lane == 0:
                s_sel[2 * EP + b * K + r] = i
                s_w[F32_VEC + b * K + r] = w
                s_used[i] = 1
        if ctx.lane == 0:
            scale = Float32(cfg.route_scale)
            if const_expr(cfg.renorm and K > 1):
                scale = scale / (wsum + 1e-20)
            for r in cutlass.range_constexpr(K):
                s_w[F32_VEC + b * K + r] = s_w[F32_VEC + b * K + r] * scale
    cute.arch.sync_threads()
    if ctx.warp == 0:  # compact the chosen experts, ascending, into slots
        base = Int32(0)
        for m in cutlass.range_constexpr(EPL):
            e = ctx.lane + 32 * m
            u = s_used[e] != 0  # [E, EP) was zeroed too
            bal = cute.arch.vote_ballot_sync(u)
            slot = base + cute.arch.popc(bal & cute.arch.lanemask_lt())
            if u:
                s_slot[EP + e] = slot
                sel[slot] = Int64(e)
            base = base + cute.arch.popc(bal)
        for j in cutlass.range(base + ctx.lane, cfg.dmax, 32, unroll=1):
            sel[j] = Int64(-1)
    cute.arch.sync_threads()
    for idx in cutlass.range(ctx.tidx, B * cfg.dmax, NT, unroll=1):
        b, j = idx // cfg.dmax, idx % cfg.dmax
        w = Float32(0.0)
        u = Int32(0)
        for r in cutlass.range_constexpr(K):
            hit = s_slot[EP + s_sel[2 * EP + b * K + r]] == j
            w = w + (s_w[F32_VEC + b * K + r] if hit else Float32(0.0))
            u = Int32(1) if hit else u
        mw[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), j)] = w
        use[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), j)] = Uint8(u)


@cute.jit
def op_expert_gate_up(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    s0, s1, r0, r1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    xv = gchunks(ctx.s_addr[0])
    xs = ctx.s_d1[0] * ctx.s_d2[0] // VEC
    nch = ctx.s_d2[3] // VEC
    sel = gflat(Int64, ctx.s_addr[1])
    use = gflat(Uint8, ctx.s_addr[2])
    out = gflat(BFloat16, ctx.s_addr[5])
    ag = cute.make_rmem_tensor((1,), Float32)
    au = cute.make_rmem_tensor((1,), Float32)
    for j in cutlass.range(s0, s1, unroll=1):
        e = Int32(sel[_eoff(ctx.s_d1[1], ctx.s_d2[1], Int32(0), Int32(0), j)])
        if e >= 0:
            for r in cutlass.range(r0 + ctx.warp, r1, NW, unroll=1):
                wg = gchunks(ctx.s_addr[3] + expert_row_offset(ctx.s_d1[3], ctx.s_d2[3], e, r, Int64) * 2)
                wu = gchunks(ctx.s_addr[4] + expert_row_offset(ctx.s_d1[4], ctx.s_d2[4], e, r, Int64) * 2)
                for b in cutlass.range(cfg.B, unroll=1):
                    if use[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), j)] != Uint8(0):
                        ag.fill(0.0)
                        au.fill(0.0)
                        row_dot(wg, Int32(0), False, xv, b * xs, xs, False, None, nch, ag, 1)
                        row_dot(wu, Int32(0), False, xv, b * xs, xs, False, None, nch, au, 1)
                        h = glu(bf16_round(warp_sum(ag[0])), bf16_round(warp_sum(au[0])), cfg.situ, cfg.situ_beta,
                                cfg.situ_lin)
                        if ctx.lane == 0:
                            out[_eoff(ctx.s_d1[5], ctx.s_d2[5], b, j, r)] = h.to(BFloat16)


@cute.jit
def op_expert_down(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    APL = -(-cfg.B // 32)
    r0, r1 = ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    hv = gchunks(ctx.s_addr[0])
    hs = ctx.s_d2[0] // VEC  # chunks per (token, slot) row of the expert hidden buffer
    nch = ctx.s_d2[4] // VEC
    sel = gflat(Int64, ctx.s_addr[1])
    use = gflat(Uint8, ctx.s_addr[2])
    mw = gflat(Float32, ctx.s_addr[3])
    out = gflat(BFloat16, ctx.s_addr[5])
    a1 = cute.make_rmem_tensor((1,), Float32)
    acc = cute.make_rmem_tensor((APL,), Float32)
    for r in cutlass.range(r0 + ctx.warp, r1, NW, unroll=1):
        acc.fill(0.0)
        for j in cutlass.range(cfg.dmax, unroll=1):
            e = Int32(sel[_eoff(ctx.s_d1[1], ctx.s_d2[1], Int32(0), Int32(0), j)])
            if e >= 0:
                wv = gchunks(ctx.s_addr[4] + expert_row_offset(ctx.s_d1[4], ctx.s_d2[4], e, r, Int64) * 2)
                for b in cutlass.range(cfg.B, unroll=1):
                    if use[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), j)] != Uint8(0):
                        a1.fill(0.0)
                        row_dot(wv, Int32(0), False, hv, (b * ctx.s_d1[0] + j) * hs, hs, False, None, nch, a1, 1)
                        y = bf16_round(warp_sum(a1[0])) * mw[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), j)]
                        for m in cutlass.range_constexpr(APL):
                            acc[m] = acc[m] + (y if ctx.lane + 32 * m == b else Float32(0.0))
        for m in cutlass.range_constexpr(APL):
            b = ctx.lane + 32 * m
            if b < cfg.B:
                out[_eoff(ctx.s_d1[5], ctx.s_d2[5], b, Int32(0), r)] = acc[m].to(BFloat16)
