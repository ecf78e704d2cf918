"""KDA (Kimi Delta Attention) decode step for one layer (spec §3.2), one CTA per (head, sequence).

Inputs are the projected vectors of the new token (``qkv``, ``u``, ``b``, ``gate``; bf16); the conv history ``conv``
and the fp32 key-major state ``S`` (spec pitfall 3) are updated in place; ``out`` [B, P] bf16 is the gated RMSNorm
of the head outputs (the input of o_proj). A CTA of ``THREADS`` threads runs three phases: conv + gates, one pass
over the state held in registers, gated RMSNorm. State traffic is the cost.
Entry points: ``compile_for`` / ``launch`` (host), ``kda_decode`` (the op). The kernel is only the GPU layer around
the ``kda_*`` per-thread helpers, which ``kernels/verify/host_exec_kda.py`` also runs over every CTA and thread.
Design: ``docs/architecture.md`` §3.2; arguments, phases and thread ownership in full:
docs/architecture.md#appendix-design-notes-by-room (``kernels/fused/kda.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, const_expr
from kimik3.kernels.common import device as C
from kimik3.kernels.common.trace import tracing_for_host
from kimik3.kernels.contracts.meta import ARG_ORDER, KDA_QK_EPS, KDA_THREADS, RMS_EPS, kda_layout
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

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


# ---------------------------------------------------------------------------------------------- per-thread helpers
# What a thread of CTA (h, b) reads, computes and writes, with the block / thread coordinates as plain integers: the
# kernel below calls these with thread_idx() / block_idx(), and kernels/verify/host_exec_kda.py calls the same functions
# over every CTA and thread of a launch on the host. Shared memory arrives as a tensor argument (the host passes
# CPU tensors of the same layout); barriers, warp sums and the index registers stay in the kernel.
def _exp(x: Float32) -> Float32:
    """exp: ``ex2.approx`` on the GPU; exact ``exp2`` when tracing for the host (the approximate instruction aborts
    there). Chosen at trace time, so the device code is the one ``C.exp_fast`` emits."""
    if tracing_for_host():
        return cute.math.exp2(x * C.LOG2E)
    return C.exp_fast(x)


def _sigmoid(x: Float32) -> Float32:
    """σ: ``C.sigmoid`` (``ex2.approx`` + ``rcp.approx``) on the GPU; exact fp32 when tracing for the host."""
    if tracing_for_host():
        return 1.0 / (1.0 + _exp(-x))
    return C.sigmoid(x)


@cute.jit
def _conv_channel(mQKV: cute.Tensor, mConv: cute.Tensor, mConvOut: cute.Tensor, mConvW: cute.Tensor, b: Any,
                  ch: Any, W: cutlass.Constexpr) -> Float32:
    """Depthwise causal conv of one channel over (history, new token), SiLU, bf16-rounded; shifts the history
    (read from ``mConv``, written to ``mConvOut``: the same tensor on the GPU, a poisoned copy on the host)."""
    xnew = mQKV[b, ch].to(Float32)
    # summed oldest first, the current token (weight w[c, W-1]) last: the model's window order (and KDA_STEP's), so
    # the fp32 sum rounds like the reference's and its bf16 rounding rarely lands on the other side
    acc = Float32(0.0)
    hist = cute.make_rmem_tensor((W - 1,), Float32)
    for j in cutlass.range_constexpr(W - 1):
        hist[j] = mConv[b, ch, j].to(Float32)
        acc = acc + mConvW[ch, j] * hist[j]
    acc = acc + mConvW[ch, W - 1] * xnew
    for j in cutlass.range_constexpr(W - 2):
        mConvOut[b, ch, j] = hist[j + 1].to(BFloat16)
    mConvOut[b, ch, W - 2] = mQKV[b, ch]
    return C.bf16_round(acc * _sigmoid(acc))


@cute.jit
def kda_qk_thread(mQKV: cute.Tensor, mU: cute.Tensor, mConvW: cute.Tensor, mDtBias: cute.Tensor,
                  mALog: cute.Tensor, mConv: cute.Tensor, mConvOut: cute.Tensor, b: Any, h: Any, tidx: Any,
                  D: cutlass.Constexpr, W: cutlass.Constexpr, LOWER_BOUND: cutlass.Constexpr
                  ) -> tuple[Float32, Float32, Float32]:
    """Thread ``tidx < D`` of CTA (h, b): q and k of channel h·D + tidx (conv + SiLU, history shifted) and the
    channel's decay α = exp(g)."""
    P = cute.size(mU, mode=[1])
    c = h * D + tidx
    q = _conv_channel(mQKV, mConv, mConvOut, mConvW, b, c, W)
    k = _conv_channel(mQKV, mConv, mConvOut, mConvW, b, P + c, W)
    lam = _exp(mALog[h])
    x = mU[b, c].to(Float32) + mDtBias[c]
    if const_expr(LOWER_BOUND is not None):
        g = LOWER_BOUND * _sigmoid(lam * x)  # K3: lb·σ(exp(A_log)·(u + dt_bias))
    else:
        sp = x if x > 20.0 else cute.math.log1p(_exp(x))  # torch softplus, threshold 20
        g = -lam * sp
    return q, k, _exp(g)


@cute.jit
def kda_v_thread(mQKV: cute.Tensor, mConvW: cute.Tensor, mConv: cute.Tensor, mConvOut: cute.Tensor, b: Any,
                 h: Any, tidx: Any, D: cutlass.Constexpr, W: cutlass.Constexpr) -> Float32:
    """Thread ``D <= tidx < 2 D`` of CTA (h, b): v of channel h·D + tidx - D (conv + SiLU, history shifted)."""
    P = cute.size(mConvW, mode=[0]) // 3
    return _conv_channel(mQKV, mConv, mConvOut, mConvW, b, 2 * P + h * D + tidx - D, W)


@cute.jit
def kda_scalars(QQ: Float32, KK: Float32, mB: cute.Tensor, b: Any, h: Any) -> tuple[Float32, Float32, Float32]:
    """From the CTA's Σq², Σk²: 1/‖q‖, 1/‖k‖ (l2norm, eps inside the root) and β = σ(b)."""
    rq = cute.math.rsqrt(QQ + QK_EPS)
    rk = cute.math.rsqrt(KK + QK_EPS)
    return rq, rk, _sigmoid(mB[b, h].to(Float32))


@cute.jit
def kda_state_tile(tidx: Any, JG: cutlass.Constexpr) -> tuple[Any, Any]:
    """(ks, jg) of thread ``tidx``: row split ks (state rows [ks·RS, (ks+1)·RS)), column group jg (columns
    [4 jg, 4 jg + 4))."""
    return tidx // JG, tidx % JG


@cute.jit
def kda_state_row(ks: Any, r: Any, RS: cutlass.Constexpr) -> Any:
    """State row (key channel) of the thread's ``r``-th register row."""
    return ks * RS + r


@cute.jit
def kda_state_partials(mS: cute.Tensor, b: Any, h: Any, ks: Any, jg: Any, sA: cute.Tensor, sK: cute.Tensor,
                       sQ: cute.Tensor, rS: cute.Tensor, racc: cute.Tensor, pacc: cute.Tensor,
                       RS: cutlass.Constexpr) -> None:
    """Load the thread's RS x 4 block of S (RS 16-byte loads in flight), decay its rows, accumulate
    r_j = Σ_i k_i S_ij and p_j = Σ_i q_i S_ij over its rows (k, q not yet normalised)."""
    gS = cute.zipped_divide(mS[b, h, None, None], (1, 4))  # ((1,4), (D, JG)): 16-byte row pieces
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128)
    for r in cutlass.range_constexpr(RS):  # RS loads in flight
        cute.copy(ld, gS[(None, (kda_state_row(ks, r, RS), jg))], rS[None, r])
    racc.fill(0.0)
    pacc.fill(0.0)
    for r in cutlass.range_constexpr(RS):
        i = kda_state_row(ks, r, RS)
        a, ki, qi = sA[i], sK[i], sQ[i]
        for cc in cutlass.range_constexpr(4):
            s = rS[(0, cc), r] * a  # decay rows (key channels) first
            rS[(0, cc), r] = s
            racc[cc] = racc[cc] + ki * s
            pacc[cc] = pacc[cc] + qi * s


@cute.jit
def kda_state_publish(sR: cute.Tensor, sP: cute.Tensor, ks: Any, jg: Any, racc: cute.Tensor, pacc: cute.Tensor
                      ) -> None:
    """The thread's partial r_j, p_j into the [KS, D] reduction buffers (shared memory on the GPU)."""
    for cc in cutlass.range_constexpr(4):
        sR[ks, jg * 4 + cc] = racc[cc]
        sP[ks, jg * 4 + cc] = pacc[cc]


@cute.jit
def kda_state_delta(sR: cute.Tensor, sP: cute.Tensor, sV: cute.Tensor, jg: Any, beta: Float32, rk: Float32,
                    rq: Float32, QK: Float32, delta: cute.Tensor, pacc: cute.Tensor, KS: cutlass.Constexpr,
                    D: cutlass.Constexpr) -> None:
    """For the thread's 4 columns: r_j, p_j summed over the row splits in ascending order, δ_j = β (v_j - r_j)
    (``delta`` holds rk·δ_j: the update uses the normalised k) and the output o_j into ``pacc``."""
    for cc in cutlass.range_constexpr(4):
        j = jg * 4 + cc
        rj, pj = sR[0, j], sP[0, j]
        for s_ in cutlass.range_constexpr(1, KS):
            rj, pj = rj + sR[s_, j], pj + sP[s_, j]
        d = beta * (sV[j] - rj * rk)
        delta[cc] = d * rk
        # o_j = Σ_i q̂_i S''_ij = rq·scale·(p_j + (q·k̂) δ_j), q̂ = q·rq·dk^-0.5
        pacc[cc] = rq * (D**-0.5) * (pj + QK * rk * d)


@cute.jit
def kda_state_update(mS: cute.Tensor, b: Any, h: Any, ks: Any, jg: Any, sK: cute.Tensor, rS: cute.Tensor,
                     delta: cute.Tensor, RS: cutlass.Constexpr) -> None:
    """S += k δᵀ on the thread's block (decayed rows in ``rS``), stored with RS 16-byte stores."""
    gS = cute.zipped_divide(mS[b, h, None, None], (1, 4))
    st = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), Float32, num_bits_per_copy=128)
    for r in cutlass.range_constexpr(RS):
        ki = sK[kda_state_row(ks, r, RS)]
        for cc in cutlass.range_constexpr(4):
            rS[(0, cc), r] = rS[(0, cc), r] + ki * delta[cc]
    for r in cutlass.range_constexpr(RS):
        cute.copy(st, rS[None, r], gS[(None, (kda_state_row(ks, r, RS), jg))])


@cute.jit
def kda_out_partial(pacc: cute.Tensor) -> Float32:
    """Thread ``tidx < JG`` of warp 0: its 4 outputs rounded to bf16 in place (o is cast before the gated norm),
    their Σo²."""
    ssq = Float32(0.0)
    for cc in cutlass.range_constexpr(4):
        pacc[cc] = C.bf16_round(pacc[cc])
        ssq = ssq + pacc[cc] * pacc[cc]
    return ssq


@cute.jit
def kda_out_col(h: Any, jg: Any, cc: Any, D: cutlass.Constexpr) -> Any:
    """Column of ``out`` [B, P] for output cc of column group jg of head h."""
    return h * D + jg * 4 + cc


@cute.jit
def kda_rms(total: Float32, D: cutlass.Constexpr) -> Float32:
    """1 / rms of the head's outputs from their Σo² (``total``)."""
    return cute.math.rsqrt(total * (1.0 / D) + NORM_EPS)


@cute.jit
def kda_out_store(mGate: cute.Tensor, mONorm: cute.Tensor, mOut: cute.Tensor, b: Any, h: Any, jg: Any,
                  pacc: cute.Tensor, rms: Float32, D: cutlass.Constexpr) -> None:
    """Gated RMSNorm of the thread's 4 outputs (``rms`` from :func:`kda_rms`) and their bf16 stores."""
    for cc in cutlass.range_constexpr(4):
        j = jg * 4 + cc
        gate = mGate[b, kda_out_col(h, jg, cc, D)].to(Float32)
        mOut[b, kda_out_col(h, jg, cc, D)] = (pacc[cc] * rms * mONorm[j] * _sigmoid(gate)).to(BFloat16)


# ---------------------------------------------------------------------------------------------- the kernel
@cute.kernel
def kda_kernel(mQKV: cute.Tensor, mU: cute.Tensor, mB: cute.Tensor, mGate: cute.Tensor, mConvW: cute.Tensor,
               mDtBias: cute.Tensor, mALog: cute.Tensor, mONorm: cute.Tensor, mConv: cute.Tensor,
               mS: cute.Tensor, mOut: cute.Tensor, D: cutlass.Constexpr, W: cutlass.Constexpr,
               LOWER_BOUND: cutlass.Constexpr):
    # the GPU-only layer: indices, shared memory, warp sums and barriers; everything else is a helper above
    tidx, _, _ = cute.arch.thread_idx()
    h, b, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
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
        q, k, a = kda_qk_thread(mQKV, mU, mConvW, mDtBias, mALog, mConv, mConv, b, h, tidx, D, W, LOWER_BOUND)
        sQ[tidx], sK[tidx], sA[tidx] = q, k, a
        qq, kk, qk = q * q, k * k, q * k
    elif tidx < 2 * D:
        sV[tidx - D] = kda_v_thread(mQKV, mConvW, mConv, mConv, b, h, tidx, D, W)
    qq, kk, qk = C.warp_sum(qq), C.warp_sum(kk), C.warp_sum(qk)
    if lane == 0:
        sRed[warp, 0], sRed[warp, 1], sRed[warp, 2] = qq, kk, qk
    cute.arch.sync_threads()
    QQ, KK, QK = sRed[0, 0], sRed[0, 1], sRed[0, 2]
    for w in cutlass.range_constexpr(1, D // 32):  # only warps < D/32 hold q/k channels
        QQ, KK, QK = QQ + sRed[w, 0], KK + sRed[w, 1], QK + sRed[w, 2]
    rq, rk, beta = kda_scalars(QQ, KK, mB, b, h)

    # ---- phase 2: one pass over this thread's RS x 4 block of S
    ks, jg = kda_state_tile(tidx, JG)
    rS = cute.make_rmem_tensor(((1, 4), RS), Float32)
    racc = cute.make_rmem_tensor((4,), Float32)
    pacc = cute.make_rmem_tensor((4,), Float32)
    kda_state_partials(mS, b, h, ks, jg, sA, sK, sQ, rS, racc, pacc, RS)
    kda_state_publish(sR, sP, ks, jg, racc, pacc)
    cute.arch.sync_threads()
    delta = cute.make_rmem_tensor((4,), Float32)
    kda_state_delta(sR, sP, sV, jg, beta, rk, rq, QK, delta, pacc, KS, D)
    kda_state_update(mS, b, h, ks, jg, sK, rS, delta, RS)  # the host passes a poisoned copy as mS here

    # ---- phase 3: gated RMSNorm over dv (warp 0 holds every output column)
    if warp == 0:
        ssq = Float32(0.0)
        if tidx < JG:
            ssq = kda_out_partial(pacc)
        rms = kda_rms(C.warp_sum(ssq), D)
        if tidx < JG:
            kda_out_store(mGate, mONorm, mOut, b, h, jg, pacc, rms, D)


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
    f = [dsl.fake(dt, shp) for dt, shp in _specs(B, nh, D, W).values()]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(kda_decode, *f, dsl.fake_stream(tvm_ffi),
                            None if lower_bound is None else float(lower_bound), options=opts)


def launch(compiled: Any, variant: str, t: dict[str, torch.Tensor], tvm_ffi: bool = False) -> None:
    dsl.launch(compiled, [t[k] for k in ARG_ORDER[("kda", variant)]], tvm_ffi)
