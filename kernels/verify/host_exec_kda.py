"""Host execution of the KDA device code: the fused ``kda`` kernel and the megakernel's KDA_STEP opcode.

The drivers call the kernels' own ``@cute.jit`` per-thread helpers over every CTA and thread of a real launch, one
compiled host function per phase, with shared memory replaced by CPU tensors; between the phases Python does the
barrier's warp and cross-warp sums in the kernel's order. The in-place state is written into NaN-poisoned copies
with guard zones, every store counted, and the outputs are compared with the model's KDA math under the kernel
tolerance. Entry points: ``run_kda``, ``run_mk_kda`` (with ``mk_kda_reference``), ``run_case``, ``main``.
Run these in a subprocess when a helper may be mutated (a device-only instruction aborts the process).
Design: docs/architecture.md#appendix-design-notes-by-room (``kernels/verify/host_exec_kda.py``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from kimik3.kernels.common.trace import host_trace
from kimik3.kernels.fused import kda as _kda
from kimik3.kernels.reference import kda as _kda_ref
from kimik3.kernels.verify.host_exec import LANES, HostRun, _t, cases_main, warp_sum

__all__ = ["run_kda", "run_mk_kda", "mk_kda_reference", "GUARD"]

GUARD = 4096  # elements of NaN guard before and after every host copy of a written buffer
_DRIVERS: dict[tuple[str, ModuleType], Any] = {}


def _guarded(n: int, dtype: torch.dtype, fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole, body): ``n`` elements with GUARD elements of ``fill`` on each side; ``body`` is the view the
    kernel code sees (a store past either end lands in a guard, where it is found)."""
    whole = torch.full((n + 2 * GUARD,), fill, dtype=dtype)
    return whole, whole[GUARD:GUARD + n]


def _count_problems(name: str, count: torch.Tensor, n: int, problems: list[str]) -> None:
    """``count`` has GUARD slots on each side of the ``n`` counted elements: every element stored exactly once,
    nothing stored in the guards."""
    outside = int(count[:GUARD].sum() + count[GUARD + n:].sum())
    if outside:
        problems.append(f"{name}: {outside} store(s) outside the buffer")
    body = count[GUARD:GUARD + n]
    bad = (body != 1).nonzero()
    if len(bad):
        k = int(bad[0, 0])
        problems.append(f"{name}: {len(bad)} element(s) not written exactly once, first flat {k} written "
                        f"{int(body[k])}x")


def _guard_problems(name: str, whole: torch.Tensor, n: int, problems: list[str]) -> None:
    g = torch.cat([whole[:GUARD], whole[GUARD + n:]]).float()
    if not torch.isnan(g).all():
        problems.append(f"{name}: {int((~torch.isnan(g)).sum())} element(s) written outside the buffer")


# ---------------------------------------------------------------------------------------------- fused kda kernel
def _kda_drivers(K: ModuleType) -> tuple[Any, Any, Any, Any]:
    """The four phases of a ``kda_kernel`` launch (CTA (h, b), THREADS threads), each a loop over every CTA and
    thread calling the helpers of the kernel module ``K`` (bound by closure: the DSL cannot carry a module)."""
    if ("kda", K) in _DRIVERS:
        return _DRIVERS[("kda", K)]
    threads = K.THREADS

    @cute.jit
    def phase1(mQKV: cute.Tensor, mU: cute.Tensor, mConvW: cute.Tensor, mDtBias: cute.Tensor, mALog: cute.Tensor,
               mConv: cute.Tensor, mConvOut: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mA: cute.Tensor,
               mV: cute.Tensor, mPart: cute.Tensor, D: cutlass.Constexpr, W: cutlass.Constexpr,
               LOWER_BOUND: cutlass.Constexpr):
        # conv + gates: thread tidx < D (q, k, α) or D <= tidx < 2D (v); per-thread Σq², Σk², Σq·k partials
        for b in cutlass.range(cute.size(mQ, mode=[0])):
            for h in cutlass.range(cute.size(mQ, mode=[1])):
                for tidx in cutlass.range(threads):
                    if tidx < D:
                        q, k, a = K.kda_qk_thread(mQKV, mU, mConvW, mDtBias, mALog, mConv, mConvOut, b, h, tidx, D,
                                                  W, LOWER_BOUND)
                        mQ[b, h, tidx], mK[b, h, tidx], mA[b, h, tidx] = q, k, a
                        mPart[b, h, tidx, 0], mPart[b, h, tidx, 1], mPart[b, h, tidx, 2] = q * q, k * k, q * k
                    elif tidx < 2 * D:
                        mV[b, h, tidx - D] = K.kda_v_thread(mQKV, mConvW, mConv, mConvOut, b, h, tidx, D, W)

    @cute.jit
    def phase2(mS: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mA: cute.Tensor, mR: cute.Tensor,
               mP: cute.Tensor, D: cutlass.Constexpr):
        # the state pass up to the barrier: load + decay the thread's block, publish its partial r_j, p_j
        JG, KS, RS = K._layout(D)
        rS = cute.make_rmem_tensor(((1, 4), RS), Float32)
        racc = cute.make_rmem_tensor((4,), Float32)
        pacc = cute.make_rmem_tensor((4,), Float32)
        for b in cutlass.range(cute.size(mQ, mode=[0])):
            for h in cutlass.range(cute.size(mQ, mode=[1])):
                for tidx in cutlass.range(threads):
                    ks, jg = K.kda_state_tile(tidx, JG)
                    K.kda_state_partials(mS, b, h, ks, jg, mA[b, h, None], mK[b, h, None], mQ[b, h, None], rS, racc,
                                         pacc, RS)
                    K.kda_state_publish(mR[b, h, None, None], mP[b, h, None, None], ks, jg, racc, pacc)

    @cute.jit
    def phase3(mS: cute.Tensor, mSOut: cute.Tensor, mB: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor,
               mA: cute.Tensor, mV: cute.Tensor, mR: cute.Tensor, mP: cute.Tensor, mRed: cute.Tensor,
               mO: cute.Tensor, mSsq: cute.Tensor, mCount: cute.Tensor, D: cutlass.Constexpr,
               G: cutlass.Constexpr):
        # after the barrier: δ, the update and its stores (the kernel keeps the decayed block in registers across
        # the barrier; here it is loaded and decayed again, from the unchanged input state); warp 0's Σo²
        JG, KS, RS = K._layout(D)
        nh = cute.size(mQ, mode=[1])
        rS = cute.make_rmem_tensor(((1, 4), RS), Float32)
        racc = cute.make_rmem_tensor((4,), Float32)
        pacc = cute.make_rmem_tensor((4,), Float32)
        delta = cute.make_rmem_tensor((4,), Float32)
        for b in cutlass.range(cute.size(mQ, mode=[0])):
            for h in cutlass.range(nh):
                rq, rk, beta = K.kda_scalars(mRed[b, h, 0], mRed[b, h, 1], mB, b, h)
                for tidx in cutlass.range(threads):
                    ks, jg = K.kda_state_tile(tidx, JG)
                    K.kda_state_partials(mS, b, h, ks, jg, mA[b, h, None], mK[b, h, None], mQ[b, h, None], rS, racc,
                                         pacc, RS)
                    K.kda_state_delta(mR[b, h, None, None], mP[b, h, None, None], mV[b, h, None], jg, beta, rk, rq,
                                      mRed[b, h, 2], delta, pacc, KS, D)
                    K.kda_state_update(mSOut, b, h, ks, jg, mK[b, h, None], rS, delta, RS)
                    for r in cutlass.range_constexpr(RS):  # the rows the update stored, at its (row, column group)
                        i = G + ((b * nh + h) * D + K.kda_state_row(ks, r, RS)) * JG + jg
                        mCount[i] = mCount[i] + 1
                    if tidx < LANES:  # warp 0
                        ssq = Float32(0.0)
                        if tidx < JG:
                            ssq = K.kda_out_partial(pacc)
                            for cc in cutlass.range_constexpr(4):
                                mO[b, h, tidx, cc] = pacc[cc]
                        mSsq[b, h, tidx] = ssq

    @cute.jit
    def phase4(mGate: cute.Tensor, mONorm: cute.Tensor, mOut: cute.Tensor, mO: cute.Tensor, mTot: cute.Tensor,
               mCount: cute.Tensor, D: cutlass.Constexpr):
        # the gated RMSNorm stores of warp 0's threads tidx < JG
        JG, KS, RS = K._layout(D)
        pacc = cute.make_rmem_tensor((4,), Float32)
        for b in cutlass.range(cute.size(mO, mode=[0])):
            for h in cutlass.range(cute.size(mO, mode=[1])):
                rms = K.kda_rms(mTot[b, h], D)
                for tidx in cutlass.range(JG):
                    _, jg = K.kda_state_tile(tidx, JG)
                    for cc in cutlass.range_constexpr(4):
                        pacc[cc] = mO[b, h, tidx, cc]
                    K.kda_out_store(mGate, mONorm, mOut, b, h, jg, pacc, rms, D)
                    for cc in cutlass.range_constexpr(4):
                        col = K.kda_out_col(h, jg, cc, D)
                        mCount[b, col] = mCount[b, col] + 1

    _DRIVERS[("kda", K)] = (phase1, phase2, phase3, phase4)
    return _DRIVERS[("kda", K)]


def run_kda(t: dict[str, torch.Tensor], *, lower_bound: float | None = -5.0, module: ModuleType | None = None
            ) -> HostRun:
    """The whole ``kda_kernel`` launch (grid nh x B) on the host, from ``kda.make_inputs``: returns ``out``, the
    updated ``S`` and ``conv`` (written into poisoned copies; the inputs are left unchanged)."""
    K = _kda if module is None else module
    S_in, conv_in = t["S"], t["conv"]
    B, nh, D, _ = S_in.shape
    W = t["conv_w"].shape[1]
    if K.kda_layout(D) is None:
        raise ValueError(f"run_kda: head dim {D} is not supported by the kernel")
    JG, KS, RS = K._layout(D)
    threads = K.THREADS
    p1, p2, p3, p4 = _kda_drivers(K)
    f32 = torch.float32
    sQ, sK, sA, sV = (torch.full((B, nh, D), float("nan")) for _ in range(4))
    part = torch.zeros(B, nh, threads, 3)  # threads past the q/k channels add 0 (as their registers' 0.0)
    s_whole, S_out = _guarded(S_in.numel(), f32)
    S_out = S_out.view(S_in.shape)
    c_whole, conv_out = _guarded(conv_in.numel(), conv_in.dtype)
    conv_out = conv_out.view(conv_in.shape)
    run = HostRun({}, lanes_run=B * nh * threads)
    with host_trace():
        p1(_t(t["qkv"]), _t(t["u"]), _t(t["conv_w"]), _t(t["dt_bias"]), _t(t["A_log"]), _t(conv_in), _t(conv_out),
           _t(sQ), _t(sK), _t(sA), _t(sV), _t(part), D, W, lower_bound)
    # phase 1's reductions: a butterfly per warp, lane 0's totals to smem, warps < D/32 summed in ascending order
    red = warp_sum(part.view(B, nh, threads // LANES, LANES, 3), 3)  # [B, nh, NW, 3]
    tot = red[:, :, 0]
    for w in range(1, D // LANES):
        tot = tot + red[:, :, w]
    sR, sP = torch.full((B, nh, KS, D), float("nan")), torch.full((B, nh, KS, D), float("nan"))
    o = torch.full((B, nh, JG, 4), float("nan"))
    ssq = torch.full((B, nh, LANES), float("nan"))
    cnt_s = torch.zeros(S_in.numel() // 4 + 2 * GUARD, dtype=torch.int32)  # one count per 16-byte store
    with host_trace():
        p2(_t(S_in), _t(sQ), _t(sK), _t(sA), _t(sR), _t(sP), D)
        p3(_t(S_in), _t(S_out), _t(t["b"]), _t(sQ), _t(sK), _t(sA), _t(sV), _t(sR), _t(sP), _t(tot.contiguous()),
           _t(o), _t(ssq), _t(cnt_s), D, GUARD)
    total = warp_sum(ssq, 2).contiguous()  # warp 0's butterfly of Σo²
    out = t["out"].clone().fill_(float("nan"))
    cnt_o = torch.zeros(out.shape, dtype=torch.int32)
    with host_trace():
        p4(_t(t["gate"]), _t(t["o_norm"]), _t(out), _t(o), _t(total), _t(cnt_o), D)
    _count_problems("S", cnt_s, S_in.numel() // 4, run.problems)
    _guard_problems("S", s_whole, S_in.numel(), run.problems)
    _guard_problems("conv", c_whole, conv_in.numel(), run.problems)
    bad = (cnt_o != 1).nonzero()
    if len(bad):
        run.problems.append(f"out: {len(bad)} element(s) not written exactly once, first {tuple(bad[0].tolist())}")
    run.outputs.update({"out": out, "S": S_out, "conv": conv_out})
    return run


# ---------------------------------------------------------------------------------------------- megakernel KDA_STEP
def _mk_kda_drivers(K: ModuleType) -> tuple[Any, Any, Any]:
    """The phases of ``op_kda_step`` between its CTA reductions, over the (head, sequence) pairs of the listed
    instructions (``mPairs`` [n, 2]: h, b in the opcode's loop order) and every thread of the CTA, calling the
    helpers of ``K`` (``mk_kda`` or a mutated copy). Buffers are flat views at byte addresses, as on the device;
    the per-pair shared-memory scratch is row ``n`` of a host tensor (``sf_addr``), at the device's offsets."""
    if ("mk_kda", K) in _DRIVERS:
        return _DRIVERS[("mk_kda", K)]
    gflat, eoff, nt, f32_words = K.gflat, K._eoff, K.NW * LANES, _f32_words()

    @cute.jit
    def phase1(mp_a: Int64, fa0: Int32, conv_a: Int64, conv_out_a: Int64, cw_a: Int64, fb_a: Int64, dt_a: Int64,
               alog_a: Int64, sf_a: Int64, d1p: Int32, d2p: Int32, d1c: Int32, d2c: Int32, d2w: Int32, d2f: Int32,
               mPairs: cute.Tensor, mBeta: cute.Tensor, mVals: cute.Tensor, mCount: cute.Tensor, base: Int32,
               dk: cutlass.Constexpr, W: cutlass.Constexpr, LB: cutlass.Constexpr, G: cutlass.Constexpr):
        mp, conv, conv_out = gflat(cutlass.BFloat16, mp_a), gflat(cutlass.BFloat16, conv_a), \
            gflat(cutlass.BFloat16, conv_out_a)
        cw, fb = gflat(Float32, cw_a), gflat(cutlass.BFloat16, fb_a)
        dt, alog = gflat(Float32, dt_a), gflat(Float32, alog_a)
        sq, sk, sv, sdec, sgt = base, base + dk, base + 2 * dk, base + 3 * dk, base + 4 * dk
        vals = cute.make_rmem_tensor((2,), Float32)
        for n in cutlass.range(cute.size(mPairs, mode=[0])):
            h, b = mPairs[n, 0], mPairs[n, 1]
            sf = gflat(Float32, sf_a + Int64(n) * (f32_words * 4))
            row = eoff(d1p, d2p, b, Int32(0), Int32(0))
            mBeta[n] = K.kda_beta(mp, row, h, dk)
            for i in cutlass.range(dk):
                vals.fill(0.0)
                K.kda_conv_gate(mp, fa0, conv, conv_out, cw, fb, dt, alog, row, d1c, d2c, d2w, d2f, b, h, h, i, sf,
                                sq, sk, sv, sdec, sgt, vals, dk, W, LB)
                mVals[n, i, 0] = vals[0]
                mVals[n, i, 1] = vals[1]
                for jj in cutlass.range_constexpr(3):  # the history elements the helper shifted
                    hist = K.kda_hist_offset(d1c, d2c, b, jj, h * dk + i, W)
                    for t in cutlass.range_constexpr(W - 1):
                        mCount[G + hist + t] = mCount[G + hist + t] + 1

    @cute.jit
    def phase2(S_a: Int64, S_out_a: Int64, sf_a: Int64, d1s: Int32, d2s: Int32, mPairs: cute.Tensor,
               mBeta: cute.Tensor, mTot: cute.Tensor, mRv: cute.Tensor, mO: cute.Tensor, mVals: cute.Tensor,
               mCount: cute.Tensor, base: Int32, dk: cutlass.Constexpr, KP: cutlass.Constexpr,
               G: cutlass.Constexpr):
        R = dk // KP
        S, S_out = gflat(Float32, S_a), gflat(Float32, S_out_a)
        sq, sk, sv, sdec, sred = base, base + dk, base + 2 * dk, base + 3 * dk, base + 5 * dk
        for n in cutlass.range(cute.size(mPairs, mode=[0])):
            h, b = mPairs[n, 0], mPairs[n, 1]
            sf = gflat(Float32, sf_a + Int64(n) * (f32_words * 4))
            rq, rk = K.kda_rnorms(mTot[n, 0], mTot[n, 1], dk)
            srow = eoff(d1s, d2s, b, h, Int32(0))
            for tidx in cutlass.range(nt):  # pass 1, then the barrier
                vcol, p = K.kda_thread_cols(tidx, dk)
                if p < KP:
                    K.kda_pass1(S, srow, sf, sdec, sk, sred, rk, p, vcol, R, dk)
            for tidx in cutlass.range(nt):  # Sᵀk summed over the groups, then the barrier
                vcol, p = K.kda_thread_cols(tidx, dk)
                if p < KP:
                    mRv[n, tidx] = K.kda_group_sum(sf, sred, vcol, KP, dk)
            for tidx in cutlass.range(nt):  # pass 2 and its stores, then the barrier
                vcol, p = K.kda_thread_cols(tidx, dk)
                if p < KP:
                    K.kda_pass2(S, S_out, srow, sf, sdec, sk, sq, sv, sred, rk, rq, mBeta[n], mRv[n, tidx], p, vcol,
                                R, dk)
                    for r in cutlass.range(R):
                        off = K.kda_state_offset(srow, K.kda_state_row(p, r, R), vcol, dk)
                        mCount[G + off] = mCount[G + off] + 1
            for i in cutlass.range(dk):
                o = K.kda_out_o(sf, sred, i, KP, dk)
                mO[n, i] = o
                mVals[n, i] = o * o

    @cute.jit
    def phase3(out_a: Int64, onorm_a: Int64, sf_a: Int64, d1o: Int32, d2o: Int32, mPairs: cute.Tensor,
               mO: cute.Tensor, mSsq: cute.Tensor, mCount: cute.Tensor, base: Int32, dk: cutlass.Constexpr,
               eps: cutlass.Constexpr, G: cutlass.Constexpr):
        out, onorm = gflat(cutlass.BFloat16, out_a), gflat(Float32, onorm_a)
        sgt = base + 4 * dk
        for n in cutlass.range(cute.size(mPairs, mode=[0])):
            h, b = mPairs[n, 0], mPairs[n, 1]
            sf = gflat(Float32, sf_a + Int64(n) * (f32_words * 4))
            for i in cutlass.range(dk):
                y = K.kda_out_value(mO[n, i], mSsq[n], eps, onorm, sf, sgt, i, dk)
                off = K.kda_out_offset(d1o, d2o, b, h, i, dk)
                out[off] = y.to(cutlass.BFloat16)
                mCount[G + off] = mCount[G + off] + 1

    _DRIVERS[("mk_kda", K)] = (phase1, phase2, phase3)
    return _DRIVERS[("mk_kda", K)]


def _f32_words() -> int:
    from kimik3.kernels.megakernel.operands import F32_WORDS

    return F32_WORDS


def _block_allreduce(vals: torch.Tensor, nw: int) -> torch.Tensor:
    """``device_fns.block_allreduce`` over the thread axis 1 of ``vals`` [n, NT, k]: a butterfly per warp, then
    every thread sums the NW per-warp totals from 0.0 in ascending warp order."""
    red = warp_sum(vals.view(vals.shape[0], nw, LANES, *vals.shape[2:]), 2)
    tot = torch.zeros_like(red[:, 0])
    for w in range(nw):
        tot = tot + red[:, w]
    return tot


def mk_kda_reference(cfg: Any, bufs: dict[str, torch.Tensor], fa0: int) -> dict[str, torch.Tensor]:
    """One KDA layer over the KDA_STEP operand buffers, with the ``kimik3.model.modeling`` functions the interpreter's
    KDA_STEP calls (short conv + SiLU, l2norm, decay gate, delta-rule step, gated norm): out, S, conv."""
    import torch.nn.functional as F

    from kimik3.model.modeling import kda_decay, kda_gated_norm, kda_recurrent_step, kda_short_conv, l2norm

    nh, dk, Wc = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    P, hw = nh * dk, 4 * dk + 1
    mp = bufs["mp"]
    B = mp.shape[0]
    blk = mp[:, 0, : nh * hw].reshape(B, nh, hw)  # per head: q, k, v, output gate, beta (raw projections)
    raw = blk[..., : 3 * dk].reshape(B, nh, 3, dk).transpose(1, 2).reshape(B, 3, P)
    gate, braw = blk[..., 3 * dk: 4 * dk], blk[..., 4 * dk]
    window = torch.cat([bufs["conv"].view(B, 3, P, Wc - 1), raw[..., None]], -1)  # oldest first
    z = kda_short_conv(window, bufs["cw"].reshape(3, P, Wc), torch.bfloat16)
    q, k, v = z.float().view(B, 3, nh, dk).unbind(1)
    q, k = l2norm(q) * dk**-0.5, l2norm(k)
    g = kda_decay(F.linear(mp[:, 0, fa0: fa0 + dk], bufs["fb"].reshape(P, dk)), bufs["dt"].reshape(-1),
                  bufs["alog"].reshape(-1), cfg.kda_gate_lower_bound)
    beta = torch.sigmoid(braw.float())
    o, S = kda_recurrent_step(q, k, v, g, beta, bufs["S"].view(B, nh, dk, dk).float())
    out = kda_gated_norm(o.to(torch.bfloat16), gate, bufs["onorm"].reshape(-1), cfg.rms_norm_eps)
    return {"out": out.reshape(B, 1, P), "S": S.reshape(bufs["S"].shape), "conv": window[..., 1:].reshape(
        bufs["conv"].shape)}


def run_mk_kda(preset: str, batch: int, *, layer: int | None = None, num_sms: int = 132, seed: int = 0,
               pairs: str = "all", module: ModuleType | None = None) -> tuple[HostRun, dict[str, torch.Tensor]]:
    """Every KDA_STEP instruction of one KDA layer (the first by default) of the megakernel program for
    (``preset``, ``batch``, ``num_sms``) executed on the host: random operand buffers of the program's shapes, the
    instructions' (head, sequence) pairs in the opcode's loop order, every thread of the CTA. ``pairs="corners"``
    keeps the first and last two heads and sequences of every instruction (its tile corners and edges).
    Returns the run (out, S, conv written into poisoned copies) and the reference (out, S, conv, and ``own_heads``
    [B, nh]: the (sequence, head) pairs that were executed)."""
    from kimik3.kernels.megakernel import kda as mk_kda
    from kimik3.kernels.verify.host_exec import corner_indices

    from kimik3.megakernel import build_program
    from kimik3.megakernel.instructions import Op
    from kimik3.model.config import get_preset

    K = mk_kda if module is None else module
    cfg = get_preset(preset)
    if not cfg.kda_layers:
        raise ValueError(f"run_mk_kda: preset {preset!r} has no KDA layer")
    layer = cfg.kda_layers[0] if layer is None else layer
    if pairs not in ("all", "corners"):
        raise ValueError(f"run_mk_kda: pairs must be 'all' or 'corners', got {pairs!r}")
    prog = build_program(preset, batch, num_sms, max_seq_len=64)
    ins = [i for i in prog.instructions if i.op == Op.KDA_STEP and i.layer == layer]
    if not ins:
        raise ValueError(f"run_mk_kda: layer {layer} has no KDA_STEP instruction")
    bufs_of = [op.buf for op in ins[0].operands]
    if any([op.buf for op in i.operands] != bufs_of for i in ins) or bufs_of[0] != bufs_of[1]:
        raise ValueError("run_mk_kda: the layer's KDA_STEP instructions do not share their buffers")
    shape = [prog.buffers[j].shape for j in bufs_of]
    dk, Wc, nh = cfg.kda_head_dim, cfg.kda_conv_size, cfg.kda_num_heads
    KP = K._kda_groups(dk)
    nt = K.NW * LANES
    rng = torch.Generator().manual_seed(seed)

    def rnd(j: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape[j], generator=rng) * scale + shift).to(dtype)

    bf = torch.bfloat16
    bufs = {"mp": rnd(0, bf), "conv": rnd(2, bf), "S": rnd(3, torch.float32, 0.1), "fb": rnd(4, bf, dk**-0.5),
            "dt": rnd(5, torch.float32, 0.5), "alog": rnd(6, torch.float32, 0.5), "cw": rnd(7, torch.float32, 0.5),
            "onorm": rnd(8, torch.float32, 0.1, 1.0)}
    n_out = int(torch.Size(shape[9]).numel())
    c_whole, conv_out = _guarded(bufs["conv"].numel(), bf)
    s_whole, S_out = _guarded(bufs["S"].numel(), torch.float32)
    o_whole, out = _guarded(n_out, bf)
    pair_list = []
    for i in ins:  # the opcode's loops: heads outer, sequences inner
        h0, h1, b0, b1 = i.args
        hs, bs = range(h0, h1), range(b0, b1)
        if pairs == "corners":
            hs = [h0 + x for x in corner_indices(h1 - h0)]
            bs = [b0 + x for x in corner_indices(b1 - b0)]
        pair_list += [(h, b) for h in hs for b in bs]
    mPairs = torch.tensor(pair_list, dtype=torch.int32)
    n = len(pair_list)
    fw = _f32_words()
    sf = torch.full((n, fw), float("nan"))  # shared memory is not zeroed
    base = K.F32_VEC
    d = [(int(s[1]), int(s[2])) for s in shape]
    fa0 = int(ins[0].operands[1].box[4])
    cnt_c = torch.zeros(bufs["conv"].numel() + 2 * GUARD, dtype=torch.int32)
    cnt_s = torch.zeros(bufs["S"].numel() + 2 * GUARD, dtype=torch.int32)
    cnt_o = torch.zeros(n_out + 2 * GUARD, dtype=torch.int32)
    beta = torch.full((n,), float("nan"))
    vals = torch.zeros(n, nt, 2)
    p1, p2, p3 = _mk_kda_drivers(K)
    lb = None if cfg.kda_gate_lower_bound is None else float(cfg.kda_gate_lower_bound)
    with host_trace():
        p1(bufs["mp"].data_ptr(), fa0, bufs["conv"].data_ptr(), conv_out.data_ptr(), bufs["cw"].data_ptr(),
           bufs["fb"].data_ptr(), bufs["dt"].data_ptr(), bufs["alog"].data_ptr(), sf.data_ptr(), d[0][0], d[0][1],
           d[2][0], d[2][1], d[7][1], d[4][1], _t(mPairs), _t(beta), _t(vals), _t(cnt_c), base, dk, Wc, lb, GUARD)
    tot = _block_allreduce(vals, K.NW).contiguous()  # Σq², Σk² of each pair
    rv = torch.full((n, nt), float("nan"))
    o = torch.full((n, dk), float("nan"))
    vals2 = torch.zeros(n, nt)
    with host_trace():
        p2(bufs["S"].data_ptr(), S_out.data_ptr(), sf.data_ptr(), d[3][0], d[3][1], _t(mPairs), _t(beta), _t(tot),
           _t(rv), _t(o), _t(vals2), _t(cnt_s), base, dk, KP, GUARD)
    ssq = _block_allreduce(vals2[..., None], K.NW)[:, 0].contiguous()  # Σo² of each pair
    with host_trace():
        p3(out.data_ptr(), bufs["onorm"].data_ptr(), sf.data_ptr(), d[9][0], d[9][1], _t(mPairs), _t(o), _t(ssq),
           _t(cnt_o), base, dk, float(cfg.rms_norm_eps), GUARD)
    run = HostRun({"out": out.view(shape[9]), "S": S_out.view(bufs["S"].shape),
                   "conv": conv_out.view(bufs["conv"].shape)}, lanes_run=n * nt)
    # which elements the pairs own: their sequences' rows of their heads (all of them unless sampled)
    own_s = torch.zeros(bufs["S"].shape[:2], dtype=torch.bool)
    own_s[mPairs[:, 1].long(), mPairs[:, 0].long()] = True
    own_o = torch.zeros(shape[9][0], nh, dtype=torch.bool)
    own_o[mPairs[:, 1].long(), mPairs[:, 0].long()] = True
    for name, cnt, whole, numel, own in (
            ("S", cnt_s, s_whole, bufs["S"].numel(), own_s[..., None].expand(*own_s.shape, dk * dk)),
            ("conv", cnt_c, c_whole, bufs["conv"].numel(),
             own_o[:, None, :, None].expand(-1, 3, nh, dk * (Wc - 1))),
            ("out", cnt_o, o_whole, n_out, own_o[:, None, :, None].expand(-1, 1, nh, dk))):
        body = cnt[GUARD:GUARD + numel]
        outside = int(cnt.sum() - body.sum())
        if outside:
            run.problems.append(f"{name}: {outside} store(s) outside the buffer")
        own = own.reshape(-1)
        if own.numel() != numel:
            raise ValueError(f"run_mk_kda: {name} buffer of {numel} elements is not the layer's {own.numel()}")
        bad = ((body != 1) & own) | ((body != 0) & ~own)
        if bad.any():
            k = int(bad.nonzero()[0, 0])
            run.problems.append(f"{name}: {int(bad.sum())} element(s) not written as owned (once by their pair), "
                                f"first flat {k} written {int(body[k])}x")
        _guard_problems(name, whole, numel, run.problems)
    ref = mk_kda_reference(cfg, bufs, fa0)
    return run, {**ref, "own_heads": own_o}


# ---------------------------------------------------------------------------------------------- cases, CLI
def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One host execution: ``family`` ``kda`` (the fused kernel) or ``mk_kda`` (the megakernel's KDA_STEP over one
    layer of the program), ``preset``, ``batch``; optional ``pairs`` (mk_kda: ``"corners"``), ``seed`` and
    ``mutant`` ([module, [[old, new], ...]]). Returns the problems, the relative errors (out, S; conv must be
    bit-exact: it is a copy), the tolerances, and ``ok``."""
    import time

    from kimik3.kernels.toolchain import registry
    from kimik3.kernels.verify.host_exec import mutated_modules

    from kimik3.model.config import get_preset
    from kimik3.validation.metric import TOL, rel_error

    t0 = time.perf_counter()
    family, preset, B = case["family"], case["preset"], int(case["batch"])
    own = {"kda": "fused.kda", "mk_kda": "megakernel.kda"}.get(family, "")  # the module the family executes
    mod = mutated_modules(case.get("mutant"), {own: None}, "host_exec_kda")[own]  # None: the original
    if family == "kda":
        shapes = registry.FAMILIES["kda"].shapes(get_preset(preset), B)
        t = _kda_ref.make_inputs(**shapes, seed=int(case.get("seed", 0)))
        run = run_kda(t, lower_bound=shapes["lower_bound"], module=mod)
        ref = _kda_ref.reference("kda", t, lower_bound=shapes["lower_bound"])
        keep: Any = slice(None)
    elif family == "mk_kda":
        run, ref = run_mk_kda(preset, B, pairs=case.get("pairs", "all"), seed=int(case.get("seed", 0)), module=mod)
        keep = ref["own_heads"]  # [B, nh]: the sampled (sequence, head) pairs
    else:
        raise ValueError(f"run_case: unknown family {family!r}")
    errors: dict[str, float] = {}
    for name in ("out", "S"):
        a, b = run.outputs[name].float(), ref[name].float()
        if family == "mk_kda":  # [B, (1|nh), ...] -> the owned pairs' elements
            a, b = a.reshape(*keep.shape, -1)[keep], b.reshape(*keep.shape, -1)[keep]
        errors[name] = rel_error(a, b)
    conv, conv_ref = run.outputs["conv"], ref["conv"]
    if family == "mk_kda":  # [B, 3, nh·dk·(W-1)] -> the owned pairs' q / k / v histories
        conv = conv.reshape(B, 3, *keep.shape[1:], -1).transpose(1, 2)[keep]
        conv_ref = conv_ref.reshape(B, 3, *keep.shape[1:], -1).transpose(1, 2)[keep]
    if not torch.equal(conv, conv_ref):  # a copy of bf16 values: bit-exact
        run.problems.append("conv: the shifted history differs from the reference")
    tol = {"out": TOL["kernel_bf16"], "S": TOL["kernel_state_fp32"]}
    ok = not run.problems and all(errors[k] <= tol[k] for k in errors)
    return {"case": case, "problems": run.problems, "errors": errors, "tol": tol, "ok": ok, "lanes": run.lanes_run,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec_kda CASES.json``: run each case, one JSON line per case on stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec_kda", argv)


if __name__ == "__main__":
    raise SystemExit(main())
