"""KDA (Kimi Delta Attention) decode step for one layer (spec §3.2), one CTA per (head, sequence).

Inputs are the already-projected vectors of the new token (the projections are GEMVs):
``qkv`` [B, 3P] raw q̃ ‖ k̃ ‖ ṽ (bf16), ``u`` [B, P] decay-gate pre-activation (f_b output, bf16),
``b`` [B, nh] raw β projection (bf16), ``gate`` [B, P] output gate (g_proj output, bf16).
State, updated in place: ``conv`` [B, 3P, W-1] raw-projection history (bf16, oldest first) and
``S`` [B, nh, dk, dv] fp32, key-major (rows = key channel; the package's layout, spec pitfall 3).
Parameters: ``conv_w`` [3P, W] fp32, ``dt_bias`` [P] fp32, ``A_log`` [nh] fp32, ``o_norm`` [dk] fp32.
Output ``out`` [B, P] bf16 = gated RMSNorm of the head outputs (input of o_proj).

CTA of 256 threads (8 warps), in three phases:

1. conv + gates: thread t < dk owns q and k channel t (and its decay α_t = exp(g_t)), thread
   dk <= t < 2 dk owns v channel t - dk. Short conv (width W, fp32 weights) + SiLU, rounded to bf16
   like the reference; the history is shifted in place. Partial Σq², Σk², Σq·k are reduced per warp
   and through shared memory (one barrier): the l2 norms are applied as scalars later.
2. state pass: thread (ks, jg) holds rows [ks·RS, (ks+1)·RS) x columns [4 jg, 4 jg + 4) of S in
   registers, loaded as RS 16-byte ``ld.global.v4.f32`` issued back to back (coalesced: a warp reads
   whole 512-byte rows). Decay the rows, accumulate r_j = Σ_i k_i S_ij and p_j = Σ_i q_i S_ij,
   reduce over ks through shared memory (second barrier), δ_j = β (v_j - r_j), S += k δ^T, store.
   The read with the updated state needs no second pass: o_j = p_j + (q·k) δ_j (q, k normalised).
3. gated RMSNorm (warp 0; it owns all dv outputs): o rounded to bf16, rms over dv, · w · σ(gate).

State traffic is the cost (dk·dv·4 bytes read + written per head); everything else is small.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, const_expr

from . import _common as C
from ._source import kernel_source_hash
from .meta import ARG_ORDER, KDA_QK_EPS, KDA_THREADS, RMS_EPS, kda_layout

# hash of the source as imported: the build cache and prebuilt manifests key on the code that runs
SOURCE_HASH = kernel_source_hash(__name__.rsplit(".", 1)[-1])
THREADS = KDA_THREADS  # the thread count, eps values and layout rule are defined in meta.py (the host plans with them)
VARIANTS = ("kda",)
OUTPUTS = {"kda": ("out", "S", "conv")}
QK_EPS = KDA_QK_EPS
NORM_EPS = RMS_EPS


def _layout(D: int) -> tuple[int, int, int]:
    """(JG, KS, RS): column groups of 4, row splits, rows per thread, for head dim D."""
    layout = kda_layout(D)
    assert layout is not None, f"unsupported head dim {D}"
    return layout


@cute.jit
def _conv_channel(mQKV: cute.Tensor, mConv: cute.Tensor, mConvW: cute.Tensor, b: Any, ch: Any,
                  W: cutlass.Constexpr) -> Float32:
    """Depthwise causal conv of one channel over (history, new token), SiLU, bf16-rounded; shifts history."""
    xnew = mQKV[b, ch].to(Float32)
    acc = mConvW[ch, W - 1] * xnew  # w[c, W-1] multiplies the current token
    hist = cute.make_rmem_tensor((W - 1,), Float32)
    for j in cutlass.range_constexpr(W - 1):
        hist[j] = mConv[b, ch, j].to(Float32)
        acc = acc + mConvW[ch, j] * hist[j]
    for j in cutlass.range_constexpr(W - 2):
        mConv[b, ch, j] = hist[j + 1].to(BFloat16)
    mConv[b, ch, W - 2] = mQKV[b, ch]
    return C.bf16_round(acc * C.sigmoid(acc))


@cute.kernel
def kda_kernel(mQKV: cute.Tensor, mU: cute.Tensor, mB: cute.Tensor, mGate: cute.Tensor, mConvW: cute.Tensor,
               mDtBias: cute.Tensor, mALog: cute.Tensor, mONorm: cute.Tensor, mConv: cute.Tensor,
               mS: cute.Tensor, mOut: cute.Tensor, D: cutlass.Constexpr, W: cutlass.Constexpr,
               LOWER_BOUND: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    h, b, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    P = cute.size(mU, mode=[1])
    JG, KS, RS = _layout(D)
    NW = THREADS // 32
    alloc = cutlass.memory.SmemAllocator()
    sQ = C.smem_tensor(alloc, Float32, (D,), "kda")
    sK = C.smem_tensor(alloc, Float32, (D,), "kda")
    sA = C.smem_tensor(alloc, Float32, (D,), "kda")
    sV = C.smem_tensor(alloc, Float32, (D,), "kda")
    sRed = C.smem_tensor(alloc, Float32, (NW, 3), "kda")
    sR = C.smem_tensor(alloc, Float32, (KS, D), "kda")
    sP = C.smem_tensor(alloc, Float32, (KS, D), "kda")

    # ---- phase 1: short conv, decay gate, partial norms
    qq, kk, qk = Float32(0.0), Float32(0.0), Float32(0.0)
    if tidx < D:
        c = h * D + tidx
        q = _conv_channel(mQKV, mConv, mConvW, b, c, W)
        k = _conv_channel(mQKV, mConv, mConvW, b, P + c, W)
        sQ[tidx], sK[tidx] = q, k
        qq, kk, qk = q * q, k * k, q * k
        lam = C.exp_fast(mALog[h])
        x = mU[b, c].to(Float32) + mDtBias[c]
        if const_expr(LOWER_BOUND is not None):
            g = LOWER_BOUND * C.sigmoid(lam * x)  # K3: lb·σ(exp(A_log)·(u + dt_bias))
        else:
            sp = x if x > 20.0 else cute.math.log1p(C.exp_fast(x))  # torch softplus, threshold 20
            g = -lam * sp
        sA[tidx] = C.exp_fast(g)
    elif tidx < 2 * D:
        sV[tidx - D] = _conv_channel(mQKV, mConv, mConvW, b, 2 * P + h * D + tidx - D, W)
    qq, kk, qk = C.warp_sum(qq), C.warp_sum(kk), C.warp_sum(qk)
    if lane == 0:
        sRed[warp, 0], sRed[warp, 1], sRed[warp, 2] = qq, kk, qk
    cute.arch.sync_threads()
    QQ, KK, QK = sRed[0, 0], sRed[0, 1], sRed[0, 2]
    for w in cutlass.range_constexpr(1, D // 32):  # only warps < D/32 hold q/k channels
        QQ, KK, QK = QQ + sRed[w, 0], KK + sRed[w, 1], QK + sRed[w, 2]
    rq = cute.math.rsqrt(QQ + QK_EPS)  # l2norm: eps inside the root
    rk = cute.math.rsqrt(KK + QK_EPS)
    beta = C.sigmoid(mB[b, h].to(Float32))

    # ---- phase 2: one pass over this thread's RS x 4 block of S
    jg, ks = tidx % JG, tidx // JG
    gS = cute.zipped_divide(mS[b, h, None, None], (1, 4))  # ((1,4), (D, JG)): 16-byte row pieces
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128)
    st = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), Float32, num_bits_per_copy=128)
    rS = cute.make_rmem_tensor(((1, 4), RS), Float32)
    for r in cutlass.range_constexpr(RS):  # RS loads in flight
        cute.copy(ld, gS[(None, (ks * RS + r, jg))], rS[None, r])
    racc = cute.make_rmem_tensor((4,), Float32)
    pacc = cute.make_rmem_tensor((4,), Float32)
    racc.fill(0.0)
    pacc.fill(0.0)
    for r in cutlass.range_constexpr(RS):
        i = ks * RS + r
        a, ki, qi = sA[i], sK[i], sQ[i]
        for cc in cutlass.range_constexpr(4):
            s = rS[(0, cc), r] * a  # decay rows (key channels) first
            rS[(0, cc), r] = s
            racc[cc] = racc[cc] + ki * s
            pacc[cc] = pacc[cc] + qi * s
    for cc in cutlass.range_constexpr(4):
        sR[ks, jg * 4 + cc] = racc[cc]
        sP[ks, jg * 4 + cc] = pacc[cc]
    cute.arch.sync_threads()
    delta = cute.make_rmem_tensor((4,), Float32)  # holds rk·δ_j: the update uses the normalised k
    for cc in cutlass.range_constexpr(4):
        j = jg * 4 + cc
        rj, pj = sR[0, j], sP[0, j]
        for s_ in cutlass.range_constexpr(1, KS):
            rj, pj = rj + sR[s_, j], pj + sP[s_, j]
        d = beta * (sV[j] - rj * rk)
        delta[cc] = d * rk
        # o_j = Σ_i q̂_i S''_ij = rq·scale·(p_j + (q·k̂) δ_j), q̂ = q·rq·dk^-0.5
        pacc[cc] = rq * (D**-0.5) * (pj + QK * rk * d)
    for r in cutlass.range_constexpr(RS):
        ki = sK[ks * RS + r]
        for cc in cutlass.range_constexpr(4):
            rS[(0, cc), r] = rS[(0, cc), r] + ki * delta[cc]
    for r in cutlass.range_constexpr(RS):
        cute.copy(st, rS[None, r], gS[(None, (ks * RS + r, jg))])

    # ---- phase 3: gated RMSNorm over dv (warp 0 holds every output column)
    if warp == 0:
        ssq = Float32(0.0)
        if tidx < JG:
            for cc in cutlass.range_constexpr(4):
                pacc[cc] = C.bf16_round(pacc[cc])  # o is cast to bf16 before the gated norm
                ssq = ssq + pacc[cc] * pacc[cc]
        rms = cute.math.rsqrt(C.warp_sum(ssq) * (1.0 / D) + NORM_EPS)
        if tidx < JG:
            for cc in cutlass.range_constexpr(4):
                j = jg * 4 + cc
                gate = mGate[b, h * D + j].to(Float32)
                mOut[b, h * D + j] = (pacc[cc] * rms * mONorm[j] * C.sigmoid(gate)).to(BFloat16)


@cute.jit
def kda_decode(mQKV: cute.Tensor, mU: cute.Tensor, mB: cute.Tensor, mGate: cute.Tensor, mConvW: cute.Tensor,
               mDtBias: cute.Tensor, mALog: cute.Tensor, mONorm: cute.Tensor, mConv: cute.Tensor, mS: cute.Tensor,
               mOut: cute.Tensor, stream: Any, LOWER_BOUND: cutlass.Constexpr):
    B, nh, D = cute.size(mS, mode=[0]), cute.size(mS, mode=[1]), cute.size(mS, mode=[2])
    W = cute.size(mConvW, mode=[1])
    assert cute.size(mS, mode=[3]) == D and W >= 2
    kda_kernel(mQKV, mU, mB, mGate, mConvW, mDtBias, mALog, mONorm, mConv, mS, mOut, D, W, LOWER_BOUND).launch(
        grid=[nh, B, 1], block=[THREADS, 1, 1], stream=stream)


def _specs(B: int, nh: int, D: int, W: int) -> dict[str, tuple[Any, tuple[int, ...]]]:
    P = nh * D
    return {"qkv": (BFloat16, (B, 3 * P)), "u": (BFloat16, (B, P)), "b": (BFloat16, (B, nh)),
            "gate": (BFloat16, (B, P)), "conv_w": (Float32, (3 * P, W)), "dt_bias": (Float32, (P,)),
            "A_log": (Float32, (nh,)), "o_norm": (Float32, (D,)), "conv": (BFloat16, (B, 3 * P, W - 1)),
            "S": (Float32, (B, nh, D, D)), "out": (BFloat16, (B, P))}


def compile_for(arch: str, *, variant: str = "kda", B: int, nh: int, D: int, W: int = 4,
                lower_bound: float | None = -5.0, tvm_ffi: bool = False, remark_file: str | None = None) -> Any:
    _layout(D)
    f = [C.fake(dt, shp) for dt, shp in _specs(B, nh, D, W).values()]
    opts = C.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with C.arch_scope(arch):
        return cute.compile(kda_decode, *f, C.fake_stream(tvm_ffi),
                            None if lower_bound is None else float(lower_bound), options=opts)


def make_inputs(variant: str = "kda", *, B: int, nh: int, D: int, W: int = 4, device: str = "cpu", seed: int = 0,
                **_: Any) -> dict[str, torch.Tensor]:
    """Random layer inputs and a non-trivial state; ``out`` poisoned with NaN (S and conv are in/out)."""
    rng = C.Rng(seed, device)
    P, bf = nh * D, torch.bfloat16
    return {
        "qkv": rng.randn(B, 3 * P, dtype=bf), "u": rng.randn(B, P, dtype=bf), "b": rng.randn(B, nh, dtype=bf),
        "gate": rng.randn(B, P, dtype=bf), "conv_w": rng.randn(3 * P, W, scale=0.5), "dt_bias": rng.randn(P, scale=0.5),
        "A_log": rng.randn(nh, scale=0.5), "o_norm": 1.0 + rng.randn(D, scale=0.1),
        "conv": rng.randn(B, 3 * P, W - 1, dtype=bf), "S": rng.randn(B, nh, D, D, scale=0.1),
        "out": rng.poisoned((B, P), bf),
    }


def reference(variant: str, t: dict[str, torch.Tensor], *, lower_bound: float | None = -5.0, **_: Any
              ) -> dict[str, torch.Tensor]:
    """Spec §3.2 on the projected inputs, fp32 math, with the model's l2norm and kda_recurrent_step.

    Returns the expected ``out`` plus the updated ``S`` and ``conv`` (the kernel updates them in place). The conv,
    decay gate and gated norm are the model's own functions, so the kernel is checked against the model's math.
    """
    from kimik3.model import kda_decay, kda_gated_norm, kda_recurrent_step, kda_short_conv, l2norm

    B, nh, D, _ = t["S"].shape
    P = nh * D
    window = torch.cat([t["conv"], t["qkv"][..., None]], -1)  # [B, 3P, W], oldest first
    z = kda_short_conv(window, t["conv_w"], torch.bfloat16)  # conv + SiLU, bf16 result
    q, k, v = z.float().unflatten(-1, (3, nh, D)).unbind(1)
    q, k = l2norm(q, QK_EPS) * D**-0.5, l2norm(k, QK_EPS)
    g = kda_decay(t["u"], t["dt_bias"], t["A_log"][:nh], lower_bound)
    beta = torch.sigmoid(t["b"].float())
    o, S = kda_recurrent_step(q, k, v, g, beta, t["S"].float())
    o = o.to(torch.bfloat16).float()  # cast to bf16 before the gated norm; fp32 in, so the norm's result stays fp32
    o = kda_gated_norm(o, t["gate"].unflatten(-1, (nh, D)), t["o_norm"], NORM_EPS)
    return {"out": o.flatten(-2).reshape(B, P), "S": S, "conv": window[..., 1:]}


def launch(compiled: Any, variant: str, t: dict[str, torch.Tensor], tvm_ffi: bool = False) -> None:
    C.launch(compiled, [t[k] for k in ARG_ORDER[("kda", variant)]], tvm_ffi)
