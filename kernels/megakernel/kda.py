"""The megakernel's KDA opcode: KDA_STEP (device code; what it does: ``op_kda_step``).

``op_kda_step`` is the GPU-only layer (the instruction's operands, the thread index, shared memory, the CTA
reductions and barriers); what a thread reads, computes and writes for one (head, sequence) pair is in the
``@cute.jit`` helpers below, which take the coordinates, buffer dims and addresses as plain integers and the
shared-memory scratch as a tensor argument. ``kernels/verify/host_exec_kda.py`` runs the same helpers over every thread
of every pair of a program's KDA_STEP instructions on the host (CPU tensors in place of shared memory).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from kimik3.kernels.common.trace import tracing_for_host
from kimik3.kernels.contracts.isa import (
    C0,
    W_ARGS,
)
from kimik3.kernels.contracts.meta import KDA_QK_EPS  # l2norm of q and k, eps inside the root (as the model)
from kimik3.kernels.megakernel.device_fns import (
    NW,
    bf16_round,
    block_allreduce,
    gflat,
    sigmoid,
)
from kimik3.kernels.megakernel.operands import (
    F32_RED,
    F32_VEC,
    _bx,
    _Ctx,
    _eoff,
    _kda_groups,
)


def _sigmoid(x: Float32) -> Float32:
    """σ: ``device_fns.sigmoid`` (``ex2.approx`` + ``rcp.approx``) on the GPU; exact fp32 when tracing for the host
    (the approximate instructions abort there). Chosen at trace time: the device code is unchanged."""
    if tracing_for_host():
        return 1.0 / (1.0 + cute.math.exp(-x))
    return sigmoid(x)


# ---------------------------------------------------------------------------------------------- per-thread helpers
@cute.jit
def kda_thread_cols(tidx: Any, dk: cutlass.Constexpr) -> tuple[Any, Any]:
    """(vcol, p) of thread ``tidx``: the state column it owns and its row group (groups ``p < KP`` work)."""
    return tidx % dk, tidx // dk


@cute.jit
def kda_state_row(p: Any, r: Any, R: cutlass.Constexpr) -> Any:
    """The ``r``-th state row (key channel) of row group ``p`` (R rows per group)."""
    return p * R + r


@cute.jit
def kda_state_offset(srow: Int64, ii: Any, vcol: Any, dk: cutlass.Constexpr) -> Int64:
    """Element offset of S[ii, vcol] of the pair whose state starts at ``srow`` (key-major dk x dk)."""
    return srow + ii * dk + vcol


@cute.jit
def kda_hist_offset(d1: Int32, d2: Int32, b: Any, jj: Any, c: Any, W: cutlass.Constexpr) -> Int64:
    """First history element of channel ``c`` of q / k / v (``jj``) of sequence ``b`` in the conv buffer."""
    return _eoff(d1, d2, b, Int32(jj), c * (W - 1))


@cute.jit
def kda_out_offset(d1: Int32, d2: Int32, b: Any, h: Any, i: Any, dk: cutlass.Constexpr) -> Int64:
    """Offset of output channel ``i`` of head ``h`` of sequence ``b``."""
    return _eoff(d1, d2, b, Int32(0), h * dk + i)


@cute.jit
def kda_beta(mp: Any, row: Int64, h: Any, dk: cutlass.Constexpr) -> Float32:
    """β = σ(b) of head ``h`` from the packed projections (q, k, v, gate, b: 4 dk + 1 columns per head)."""
    return _sigmoid(mp[row + h * (4 * dk + 1) + 4 * dk].to(Float32))


@cute.jit
def kda_conv_gate(mp: Any, fa0: Int32, conv: Any, conv_out: Any, cw: Any, fb: Any, dt: Any, alog: Any,
                  row: Int64, d1c: Int32, d2c: Int32, d2w: Int32, d2f: Int32, b: Any, h: Any, hwt: Any, i: Any,
                  sf: Any, sq: Any, sk: Any, sv: Any, sdec: Any, sgt: Any, vals: cute.Tensor, dk: cutlass.Constexpr,
                  W: cutlass.Constexpr, LB: cutlass.Constexpr) -> None:
    """Thread ``i < dk`` of pair (h, b): channel c = h·dk + i of q, k, v through the width-W conv + SiLU (the
    history, read from ``conv``, shifted into ``conv_out``: the same buffer on the GPU), the decay exp(g) from
    f_a·f_b (rounded like the reference's bf16 linear) and the output gate, into the scratch ``sf``; Σq², Σk²
    partials into ``vals``. ``hwt``: head h's index in the head weights (conv, f_b, dt_bias, A_log) — h itself,
    or on a rank, which holds only its heads' weights, h's place among them."""
    hw = 4 * dk + 1
    c = h * dk + i
    cwt = hwt * dk + i  # the channel in the weights
    z = [Float32(0.0), Float32(0.0), Float32(0.0)]
    for jj in cutlass.range_constexpr(3):
        raw = mp[row + h * hw + jj * dk + i].to(Float32)
        hist = kda_hist_offset(d1c, d2c, b, jj, c, W)
        wrow = _eoff(Int32(1), d2w, Int32(0), Int32(jj), cwt * W)
        win = [conv[hist + t].to(Float32) for t in range(W - 1)] + [raw]  # oldest first
        a = Float32(0.0)
        for t in cutlass.range_constexpr(W):
            a = a + win[t] * cw[wrow + t]
        for t in cutlass.range_constexpr(W - 1):  # shift the history (this channel is ours alone)
            conv_out[hist + t] = win[t + 1].to(BFloat16)
        z[jj] = bf16_round(a * _sigmoid(a))
    u = Float32(0.0)
    frow = _eoff(Int32(1), d2f, Int32(0), cwt, Int32(0))
    for jj in cutlass.range(dk, unroll=1):
        u = u + mp[row + fa0 + jj].to(Float32) * fb[frow + jj].to(Float32)
    u = bf16_round(u) + dt[cwt]  # F.linear in bf16 rounds, then fp32 + dt_bias
    lam = cute.math.exp(alog[hwt])
    g = Float32(0.0)
    if const_expr(LB is not None):
        g = LB * _sigmoid(lam * u)
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


@cute.jit
def kda_rnorms(qq: Float32, kk: Float32, dk: cutlass.Constexpr) -> tuple[Float32, Float32]:
    """(rq, rk) from the pair's Σq², Σk²: l2norm (eps inside the root), q also scaled by dk^-½."""
    rq = cute.math.rsqrt(qq + KDA_QK_EPS) * (dk**-0.5)
    rk = cute.math.rsqrt(kk + KDA_QK_EPS)
    return rq, rk


@cute.jit
def kda_pass1(S: Any, srow: Int64, sf: Any, sdec: Any, sk: Any, sred: Any, rk: Float32, p: Any, vcol: Any,
              R: cutlass.Constexpr, dk: cutlass.Constexpr) -> None:
    """Row group ``p``'s part of (Sᵀk)[vcol] over the decayed state, into ``sf[sred + p·dk + vcol]``."""
    part = Float32(0.0)
    for r in cutlass.range(R, unroll=8):
        ii = kda_state_row(p, r, R)
        s = S[kda_state_offset(srow, ii, vcol, dk)] * sf[sdec + ii]  # decay the key rows first
        part = part + s * (sf[sk + ii] * rk)
    sf[sred + p * dk + vcol] = part


@cute.jit
def kda_group_sum(sf: Any, sred: Any, col: Any, KP: cutlass.Constexpr, dk: cutlass.Constexpr) -> Float32:
    """Σ over the KP row groups' partials of column ``col``, in ascending group order."""
    v = Float32(0.0)
    for pp in cutlass.range_constexpr(KP):
        v = v + sf[sred + pp * dk + col]
    return v


@cute.jit
def kda_pass2(S: Any, S_out: Any, srow: Int64, sf: Any, sdec: Any, sk: Any, sq: Any, sv: Any, sred: Any,
              rk: Float32, rq: Float32, beta: Float32, rv: Float32, p: Any, vcol: Any, R: cutlass.Constexpr,
              dk: cutlass.Constexpr) -> None:
    """δ = β (v - Sᵀk) for column ``vcol``; row group ``p``'s rows of the decayed state get + k̂ δ (read from
    ``S``, stored to ``S_out``: the same buffer on the GPU), and its part of (Sᵀq̂)[vcol] with the updated state
    goes to ``sf[sred + p·dk + vcol]``."""
    delta = beta * (sf[sv + vcol] - rv)
    po = Float32(0.0)
    for r in cutlass.range(R, unroll=8):
        ii = kda_state_row(p, r, R)
        s = S[kda_state_offset(srow, ii, vcol, dk)] * sf[sdec + ii] + (sf[sk + ii] * rk) * delta
        S_out[kda_state_offset(srow, ii, vcol, dk)] = s
        po = po + s * (sf[sq + ii] * rq)  # read with the updated state
    sf[sred + p * dk + vcol] = po


@cute.jit
def kda_out_o(sf: Any, sred: Any, i: Any, KP: cutlass.Constexpr, dk: cutlass.Constexpr) -> Float32:
    """Output channel ``i`` of the pair: the row groups' Sᵀq̂ parts summed, cast to bf16 before the gated norm
    (pitfall 4)."""
    return bf16_round(kda_group_sum(sf, sred, i, KP, dk))


@cute.jit
def kda_out_value(o: Float32, ssq: Float32, eps: cutlass.Constexpr, onorm: Any, sf: Any, sgt: Any, i: Any,
                  dk: cutlass.Constexpr) -> Float32:
    """Gated RMSNorm of output channel ``i`` (``o`` already rounded to bf16, ``ssq`` the head's Σo²)."""
    return o * cute.math.rsqrt(ssq * (1.0 / dk) + eps, fastmath=True) * onorm[i] * _sigmoid(sf[sgt + i])


# ---------------------------------------------------------------------------------------------- the opcode
@cute.jit
def op_kda_step(ctx: _Ctx) -> None:
    """KDA_STEP: per (head, sequence) pair, the width-4 short convolution + SiLU of q / k / v (shifting the conv history
    in place), the decay gate and the output gate, ‖q‖ and ‖k‖ by one CTA reduction, then the dk x dk state split
    column-per-thread in row groups: pass 1 reads and decays the state for Sᵀk, pass 2 re-reads it, applies the
    delta-rule update, stores it and accumulates Sᵀq; gated RMSNorm with a second CTA reduction. Known limits: (head,
    sequence) pairs run one after another with ~8 barriers each; the state is read twice (the second time from L1) to
    keep it out of registers; the f_a·f_b dot is a serial dk-long loop per thread."""
    cfg = ctx.cfg
    dk, W = cfg.dk, cfg.conv
    KP = _kda_groups(dk)  # row groups of the state (threads per state column)
    R = dk // KP  # state rows per thread
    h0, h1, b0, b1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    mp = gflat(BFloat16, ctx.s_addr[0])
    fa0 = _bx(ctx, 1, C0)
    wh0 = _bx(ctx, 6, C0)  # the tile's first head in the head weights (A_log's box): h0 on one GPU
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
    vcol, p = kda_thread_cols(ctx.tidx, dk)
    for h in cutlass.range(h0, h1, unroll=1):
        for b in cutlass.range(b0, b1, unroll=1):
            row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0))
            beta = kda_beta(mp, row, h, dk)
            vals.fill(0.0)
            if i < dk:
                kda_conv_gate(mp, fa0, conv, conv, cw, fb, dt, alog, row, ctx.s_d1[2], ctx.s_d2[2], ctx.s_d2[7],
                              ctx.s_d2[4], b, h, h - h0 + wh0, i, sf, sq, sk, sv, sdec, sgt, vals, dk, W, cfg.kda_lb)
            block_allreduce(vals, s_red, 2)
            rq, rk = kda_rnorms(vals[0], vals[1], dk)
            srow = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, h, Int32(0))
            if p < KP:
                kda_pass1(S, srow, sf, sdec, sk, sred, rk, p, vcol, R, dk)
            cute.arch.sync_threads()
            rv = Float32(0.0)
            if p < KP:
                rv = kda_group_sum(sf, sred, vcol, KP, dk)
            cute.arch.sync_threads()
            if p < KP:
                kda_pass2(S, S, srow, sf, sdec, sk, sq, sv, sred, rk, rq, beta, rv, p, vcol, R, dk)
            cute.arch.sync_threads()
            o = Float32(0.0)
            vals.fill(0.0)
            if i < dk:
                o = kda_out_o(sf, sred, i, KP, dk)
                vals[0] = o * o
            block_allreduce(vals, s_red, 1)
            if i < dk:
                y = kda_out_value(o, vals[0], cfg.eps, onorm, sf, sgt, i, dk)
                out[kda_out_offset(ctx.s_d1[9], ctx.s_d2[9], b, h, i, dk)] = y.to(BFloat16)
