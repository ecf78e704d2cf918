"""bf16 GEMV for decode, y[B, N] = x[B, K] · W[N, K]^T, and the lm_head GEMV + arg-max.

One warp per output row, ``WARPS`` rows per CTA; each lane issues ``UNROLL`` 16-byte weight loads per step before
its first FMA; fp32 accumulation; batches above 16 rows are tiled on grid x; K a multiple of 8 (predicated tails).
Variants (static flags of one kernel): ``plain``, ``rmsnorm`` (RMSNorm fused per warp), ``residual`` (residual add
in the epilogue), ``f32out`` (fp32 output) and ``lm_head`` (rmsnorm + GEMV + per-CTA arg-max, then a small
reduction kernel). Entry points: ``compile_for`` / ``launch`` (host), ``gemv`` / ``lm_head_argmax`` (the ops);
the lane helpers (``gemv_tile``, ``gemv_lane``) are what ``kernels/verify/host_exec.py`` runs on the host.
Design: guide §2/§3; the load layout, tails, variants and residency:
docs/architecture.md#appendix-design-notes-by-room (``kernels/fused/gemv.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr
from kimik3.kernels.common import device as C
from kimik3.kernels.common.trace import evict_last
from kimik3.kernels.contracts.meta import ARG_ORDER, GEMV_UNROLL, GEMV_WARPS, LM_ROWS_PER_WARP, RMS_EPS, ROW_LOOP_FROM
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

# hash of the source as imported: the build cache and prebuilt manifests key on the code that runs
SOURCE_HASH = kernel_source_hash(__name__.rsplit(".", 1)[-1])
VEC = C.VEC  # bf16 per 16-byte load
WARPS = GEMV_WARPS  # rows per CTA (one warp each); with LM_ROWS_PER_WARP and RMS_EPS defined in meta.py
# 16-byte W loads in flight per lane per loop step (112 bytes; K = 7168 is 28 lane rounds = 4 steps). They stay
# packed until used (one chunk widened at a time), so the unroll costs 4 registers per load.
UNROLL = GEMV_UNROLL  # defined in meta.py (the workshop exercise reads it too)
# CTAs per SM the kernels are compiled for (.minnctapersm: ptxas keeps registers <= 65536 / (128 n)). Without it
# ptxas spilled a few accumulators; with .minnctapersm 1 it hoisted every x load of a step into registers (each
# variant's register count: its build report, the ptxas resource report).
CTAS_PER_SM = 4  # gemv: 4 x 128 threads x 112 bytes = 56 KiB in flight per SM
LM_CTAS_PER_SM = 3  # lm_head at B = 64 keeps 4 x 16 values per batch row (acc, rstd, best value / index): 42 KiB
ARGMAX_THREADS = 128
VARIANTS = ("plain", "rmsnorm", "residual", "f32out", "lm_head")



def resident_ctas(n: int) -> dict[str, int]:
    """Launch options compiling a kernel for ``n`` resident CTAs per SM (``.minnctapersm n``). The shared-memory
    carveout is given explicitly (-1: the driver's default): without it the DSL asks the current device for its
    shared memory per SM, and kernels are compiled on machines without a GPU."""
    return {"min_blocks_per_mp": n, "preferred_smem_carveout": -1}


# ---------------------------------------------------------------------------------------------- device code
@cute.jit
def _load_w(gW: cute.Tensor, c0: Int32, rw: cute.Tensor, n: cutlass.Constexpr):
    """The ``n`` weight loads of a step (chunks c0, c0+32, ...) into ``rw``, back to back; they stay packed (4
    registers per 16 bytes in flight)."""
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    for u in cutlass.range_constexpr(n):
        cute.copy(ld_w, gW[(None, c0 + 32 * u)], rw[None, u])


@cute.jit
def _use_step(rw: cute.Tensor, gG: Any, mX: cute.Tensor, x0: Int32, c0: Int32, acc: cute.Tensor, ssq: Any,
              n: cutlass.Constexpr, BT: cutlass.Constexpr):
    """Accumulate a step's ``n`` loaded weight chunks ``rw`` (chunks c0, c0+32, ...; times gamma if given) against
    BT rows of x; also Σ x² per row into ``ssq`` unless it is None.

    Below ``ROW_LOOP_FROM`` rows every x load of the step is unrolled and one chunk at a time is widened to fp32.
    From there on the rows are a real loop: unrolled, ptxas interleaved the rows' x loads with the weight loads and
    consumed the first weight chunk after two of them were issued (``kernels/verify/sass_audit.py`` reads the
    machine code). The step's weights are widened to fp32 once (times gamma) and reused by every row; row ``b``
    accumulates into ``acc[0]`` (and ``ssq[0]``), and the accumulators rotate by one after each row, so register
    indices stay static."""
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, **evict_last())
    rg = cute.make_rmem_tensor((VEC,), BFloat16)
    if const_expr(BT < ROW_LOOP_FROM):
        rx = cute.make_rmem_tensor((VEC,), BFloat16)
        for u in cutlass.range_constexpr(n):
            w = rw[None, u].load().to(Float32)
            if const_expr(gG is not None):
                cute.copy(ld_x, gG[(None, c0 + 32 * u)], rg)
                w = w * rg.load().to(Float32)
            for b in cutlass.range_constexpr(BT):
                gX = cute.zipped_divide(mX[x0 + b, None], (VEC,))
                cute.copy(ld_x, gX[(None, c0 + 32 * u)], rx)
                x = rx.load().to(Float32)
                acc[b] = (w * x).reduce(cute.ReductionOp.ADD, acc[b], reduction_profile=0)
                if const_expr(ssq is not None):
                    ssq[b] = (x * x).reduce(cute.ReductionOp.ADD, ssq[b], reduction_profile=0)
    else:
        wf = cute.make_rmem_tensor((VEC, n), Float32)
        for u in cutlass.range_constexpr(n):
            w = rw[None, u].load().to(Float32)
            if const_expr(gG is not None):
                cute.copy(ld_x, gG[(None, c0 + 32 * u)], rg)
                w = w * rg.load().to(Float32)
            wf[None, u].store(w)
        rx = cute.make_rmem_tensor((VEC, n), BFloat16)
        for b in cutlass.range(BT, unroll=1):
            gX = cute.zipped_divide(mX[x0 + b, None], (VEC,))
            for u in cutlass.range_constexpr(n):
                cute.copy(ld_x, gX[(None, c0 + 32 * u)], rx[None, u])
            a = acc[0]
            q = Float32(0.0)
            if const_expr(ssq is not None):
                q = ssq[0]
            for u in cutlass.range_constexpr(n):
                x = rx[None, u].load().to(Float32)
                a = (wf[None, u].load() * x).reduce(cute.ReductionOp.ADD, a, reduction_profile=0)
                if const_expr(ssq is not None):
                    q = (x * x).reduce(cute.ReductionOp.ADD, q, reduction_profile=0)
            for r in cutlass.range_constexpr(BT - 1):  # rotate: row b + 1's accumulator comes to acc[0]
                acc[r] = acc[r + 1]
                if const_expr(ssq is not None):
                    ssq[r] = ssq[r + 1]
            acc[BT - 1] = a
            if const_expr(ssq is not None):
                ssq[BT - 1] = q


@cute.jit
def _dot_step(gW: cute.Tensor, gG: Any, mX: cute.Tensor, x0: Int32, c0: Int32, acc: cute.Tensor, ssq: Any,
              n: cutlass.Constexpr, BT: cutlass.Constexpr):
    """One step on its own: its ``n`` weight loads (:func:`_load_w`), then their use (:func:`_use_step`)."""
    rw = cute.make_rmem_tensor((VEC, n), BFloat16)
    _load_w(gW, c0, rw, n)
    _use_step(rw, gG, mX, x0, c0, acc, ssq, n, BT)


@cute.jit
def row_dot(gW: cute.Tensor, gG: Any, mX: cute.Tensor, x0: Int32, lane: Int32, acc: cute.Tensor, ssq: Any,
            NCH: cutlass.Constexpr, BT: cutlass.Constexpr, unroll: cutlass.Constexpr):
    """Per-lane partial dot products of one row (chunks in gW[(None, c)]) with x rows x0..x0+BT-1.

    Full steps of 32 lanes x ``unroll`` chunks run in a real loop; the leftover full lane rounds are one static
    step, and the final partial round (NCH % 32 chunks) is predicated on the lane. Below ``ROW_LOOP_FROM`` rows the
    step loop is software-pipelined: each trip issues the next step's weight loads, then uses the ones the trip
    before issued, so all ``unroll`` are in flight before the first is consumed (issued next to their x loads,
    ptxas consumed the first weight chunk after 2 to 6 of them); from there on the row loop of :func:`_use_step`
    keeps the weight loads ahead by itself.
    """
    rounds = NCH // 32
    steps = rounds // unroll
    if const_expr(BT < ROW_LOOP_FROM and steps > 0):
        rw = cute.make_rmem_tensor((VEC, unroll), BFloat16)
        rn = cute.make_rmem_tensor((VEC, unroll), BFloat16)
        _load_w(gW, lane, rw, unroll)
        for it in cutlass.range(steps - 1, unroll=1):
            c0 = it * (32 * unroll) + lane
            _load_w(gW, c0 + 32 * unroll, rn, unroll)
            _use_step(rw, gG, mX, x0, c0, acc, ssq, unroll, BT)
            rw.store(rn.load())
        _use_step(rw, gG, mX, x0, (steps - 1) * (32 * unroll) + lane, acc, ssq, unroll, BT)
    else:
        for it in cutlass.range(steps, unroll=1):
            _dot_step(gW, gG, mX, x0, it * (32 * unroll) + lane, acc, ssq, unroll, BT)
    if const_expr(rounds % unroll > 0):
        _dot_step(gW, gG, mX, x0, steps * (32 * unroll) + lane, acc, ssq, rounds % unroll, BT)
    if const_expr(NCH % 32 > 0):
        if lane < NCH % 32:
            _dot_step(gW, gG, mX, x0, rounds * 32 + lane, acc, ssq, 1, BT)


@cute.jit
def gemv_tile(bt: Int32, rg: Int32, warp: Int32, BT: cutlass.Constexpr) -> tuple[Int32, Int32]:
    """(W row, first batch row) of warp ``warp`` in CTA (``bt``, ``rg``): one warp per row, WARPS rows per CTA
    on grid y, batch tiles of BT rows on grid x. The row is valid only when it is below N."""
    return rg * WARPS + warp, bt * BT


@cute.jit
def gemv_lane(mW: cute.Tensor, mX: cute.Tensor, mG: Any, row: Int32, x0: Int32, lane: Int32, acc: cute.Tensor,
              ssq: Any, BT: cutlass.Constexpr):
    """Lane ``lane``'s partial dot products of W row ``row`` (times gamma when given) with x rows x0..x0+BT-1
    into ``acc`` (and its partial Σ x² per row into ``ssq`` when gamma is given), before the warp sum."""
    K = cute.size(mW, mode=[1])
    acc.fill(0.0)
    gW = cute.zipped_divide(mW[row, None], (VEC,))
    gG = None
    if const_expr(mG is not None):
        gG = cute.zipped_divide(mG, (VEC,))
    if const_expr(ssq is not None):
        ssq.fill(0.0)
    row_dot(gW, gG, mX, x0, lane, acc, ssq, K // VEC, BT, UNROLL)


@cute.kernel
def gemv_kernel(mW: cute.Tensor, mX: cute.Tensor, mG: Any, mR: Any, mY: cute.Tensor,
                BT: cutlass.Constexpr, ACT: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bt, rg, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    N, K = cute.size(mW, mode=[0]), cute.size(mW, mode=[1])
    row, x0 = gemv_tile(bt, rg, warp, BT)
    if row < N:  # warp-uniform: the shuffles below stay convergent
        acc = cute.make_rmem_tensor((BT,), Float32)
        ssq = None
        if const_expr(mG is not None):
            ssq = cute.make_rmem_tensor((BT,), Float32)
        gemv_lane(mW, mX, mG, row, x0, lane, acc, ssq, BT)
        for b in cutlass.range_constexpr(BT):
            d = C.warp_sum(acc[b])
            if const_expr(mG is not None):
                # one scalar per row: rstd applied once after the dot product (guide §3.1)
                d = d * cute.math.rsqrt(C.warp_sum(ssq[b]) * (1.0 / K) + RMS_EPS, approx=True)
            if const_expr(ACT == "sigmoid"):
                d = C.sigmoid(d)
            if const_expr(mR is not None):
                d = d + mR[x0 + b, row].to(Float32)
            if lane == b % 32:  # spread the stores over the lanes
                mY[x0 + b, row] = d.to(mY.element_type)


@cute.jit
def x_sumsq_lane(mX: cute.Tensor, xr: Int32, lane: Int32) -> Float32:
    """Lane ``lane``'s partial Σ x² of x row ``xr`` (chunks lane, lane+32, ...), before the warp sum."""
    K = cute.size(mX, mode=[1])
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    rx = cute.make_rmem_tensor((VEC,), BFloat16)
    gX = cute.zipped_divide(mX[xr, None], (VEC,))
    part = Float32(0.0)
    for c in cutlass.range(lane, K // VEC, 32, unroll=1):
        cute.copy(ld_x, gX[(None, c)], rx)
        x = rx.load().to(Float32)
        part = part + (x * x).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
    return part


@cute.jit
def lm_head_row0(cta: Int32, warp: Int32) -> Int32:
    """First vocabulary row of warp ``warp`` in CTA ``cta``: it walks LM_ROWS_PER_WARP consecutive rows."""
    return (cta * WARPS + warp) * LM_ROWS_PER_WARP


@cute.kernel
def lm_head_kernel(mW: cute.Tensor, mX: cute.Tensor, mG: Any, mLogits: Any, mPartV: cute.Tensor,
                   mPartI: cute.Tensor, BT: cutlass.Constexpr):
    """Rows [cta*32, cta*32+32): each warp walks LM_ROWS_PER_WARP rows; per-CTA arg-max per batch row."""
    tidx, _, _ = cute.arch.thread_idx()
    bt, cta, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    K = cute.size(mW, mode=[1])
    _, x0 = gemv_tile(bt, cta, warp, BT)
    alloc = cutlass.memory.SmemAllocator()
    sv = C.smem_tensor(alloc, Float32, (WARPS, BT), "lm_head")
    si = C.smem_tensor(alloc, Int32, (WARPS, BT), "lm_head")
    bestv = cute.make_rmem_tensor((BT,), Float32)
    besti = cute.make_rmem_tensor((BT,), Int32)
    bestv.fill(-Float32.inf)
    besti.fill(0)
    acc = cute.make_rmem_tensor((BT,), Float32)
    rstd = cute.make_rmem_tensor((BT,), Float32)
    rstd.fill(1.0)
    if const_expr(mG is not None):
        # the norm of x is the same for every row: one pass over x per warp (L1/L2), before the rows
        for b in cutlass.range_constexpr(BT):
            part = x_sumsq_lane(mX, x0 + b, lane)
            rstd[b] = cute.math.rsqrt(C.warp_sum(part) * (1.0 / K) + RMS_EPS, approx=True)
    row0 = lm_head_row0(cta, warp)
    for r in cutlass.range(LM_ROWS_PER_WARP, unroll=1):
        row = row0 + r
        gemv_lane(mW, mX, mG, row, x0, lane, acc, None, BT)
        for b in cutlass.range_constexpr(BT):
            d = C.warp_sum(acc[b]) * rstd[b]
            if const_expr(mLogits is not None):
                if lane == b % 32:
                    mLogits[x0 + b, row] = d
            take = d > bestv[b]  # rows ascend, so strict > keeps the lowest index on ties
            bestv[b] = d if take else bestv[b]
            besti[b] = row if take else besti[b]
    if lane == 0:
        for b in cutlass.range_constexpr(BT):
            sv[warp, b] = bestv[b]
            si[warp, b] = besti[b]
    cute.arch.sync_threads()
    if tidx < BT:
        v, i = sv[0, tidx], si[0, tidx]
        for w in cutlass.range_constexpr(1, WARPS):  # warps hold ascending rows: strict > on ties
            ov, oi = sv[w, tidx], si[w, tidx]
            v, i = (ov, oi) if ov > v else (v, i)
        mPartV[x0 + tidx, cta] = v
        mPartI[x0 + tidx, cta] = i


@cute.kernel
def argmax_kernel(mPartV: cute.Tensor, mPartI: cute.Tensor, mTok: cute.Tensor):
    """One CTA per batch row: arg-max over the per-CTA partials (ties -> lower vocabulary index)."""
    tidx, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    P = cute.size(mPartV, mode=[1])
    alloc = cutlass.memory.SmemAllocator()
    sv = C.smem_tensor(alloc, Float32, (ARGMAX_THREADS // 32,), "argmax")
    si = C.smem_tensor(alloc, Int32, (ARGMAX_THREADS // 32,), "argmax")
    v, i = -Float32.inf, Int32(2**31 - 1)
    for p in cutlass.range(tidx, P, ARGMAX_THREADS, unroll=1):
        ov, oi = mPartV[b, p], mPartI[b, p]
        take = C.argmax_take(ov, oi, v, i)
        v, i = (ov, oi) if take else (v, i)
    v, i = C.warp_argmax(v, i)
    if lane == 0:
        sv[warp], si[warp] = v, i
    cute.arch.sync_threads()
    if tidx == 0:
        for w in cutlass.range_constexpr(1, ARGMAX_THREADS // 32):
            ov, oi = sv[w], si[w]
            take = C.argmax_take(ov, oi, v, i)
            v, i = (ov, oi) if take else (v, i)
        mTok[b] = i


# ---------------------------------------------------------------------------------------------- host code
@cute.jit
def gemv(mW: cute.Tensor, mX: cute.Tensor, mG: Any, mR: Any, mY: cute.Tensor, stream: Any,
         ACT: cutlass.Constexpr = None):
    N, K = cute.size(mW, mode=[0]), cute.size(mW, mode=[1])
    B = cute.size(mX, mode=[0])
    assert K % VEC == 0, "K must be a multiple of 8 (16-byte chunks)"
    BT = C.batch_tile(B)
    gemv_kernel(mW, mX, mG, mR, mY, BT, ACT).launch(
        grid=[B // BT, C.ceil_div(N, WARPS), 1], block=[WARPS * 32, 1, 1], stream=stream, **resident_ctas(CTAS_PER_SM))


@cute.jit
def lm_head_argmax(mW: cute.Tensor, mX: cute.Tensor, mG: Any, mLogits: Any, mPartV: cute.Tensor,
                   mPartI: cute.Tensor, mTok: cute.Tensor, stream: Any):
    V, K = cute.size(mW, mode=[0]), cute.size(mW, mode=[1])
    B = cute.size(mX, mode=[0])
    rows_per_cta = WARPS * LM_ROWS_PER_WARP
    assert K % VEC == 0 and V % rows_per_cta == 0, "vocab must be a multiple of 32"
    assert cute.size(mPartV, mode=[1]) == V // rows_per_cta
    BT = C.batch_tile(B)
    lm_head_kernel(mW, mX, mG, mLogits, mPartV, mPartI, BT).launch(
        grid=[B // BT, V // rows_per_cta, 1], block=[WARPS * 32, 1, 1], stream=stream, **resident_ctas(LM_CTAS_PER_SM))
    argmax_kernel(mPartV, mPartI, mTok).launch(grid=[B, 1, 1], block=[ARGMAX_THREADS, 1, 1], stream=stream)


def _specs(variant: str, B: int, N: int, K: int) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor argument, in call order (None-able ones omitted)."""
    if variant == "lm_head":
        P = N // (WARPS * LM_ROWS_PER_WARP)
        return {"W": (BFloat16, (N, K)), "x": (BFloat16, (B, K)), "gamma": (BFloat16, (K,)),
                "logits": (Float32, (B, N)), "part_v": (Float32, (B, P)), "part_i": (Int32, (B, P)),
                "token": (Int32, (B,))}
    spec = {"W": (BFloat16, (N, K)), "x": (BFloat16, (B, K))}
    if variant == "rmsnorm":
        spec["gamma"] = (BFloat16, (K,))
    if variant == "residual":
        spec["residual"] = (BFloat16, (B, N))
    spec["y"] = (Float32 if variant == "f32out" else BFloat16, (B, N))
    return spec


OUTPUTS = {"plain": ("y",), "rmsnorm": ("y",), "residual": ("y",), "f32out": ("y",), "lm_head": ("logits", "token")}


_OPTIONAL = {v: () if v == "lm_head" else ("gamma", "residual") for v in VARIANTS}  # None-able per variant


def _call_args(variant: str, t: dict[str, Any]) -> list[Any]:
    return [t.get(k) if k in _OPTIONAL[variant] else t[k] for k in ARG_ORDER[("gemv", variant)]]


def compile_for(arch: str, *, variant: str = "plain", B: int, N: int, K: int, tvm_ffi: bool = False,
                remark_file: str | None = None) -> Any:
    """Compile one GEMV variant for static shapes (fake tensors: no GPU needed)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown gemv variant {variant!r}; expected one of {VARIANTS}")
    fakes = {k: dsl.fake(dt, shp) for k, (dt, shp) in _specs(variant, B, N, K).items()}
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        if variant == "lm_head":
            return cute.compile(lm_head_argmax, *_call_args(variant, fakes), dsl.fake_stream(tvm_ffi), options=opts)
        return cute.compile(gemv, *_call_args(variant, fakes), dsl.fake_stream(tvm_ffi), None, options=opts)


def launch(compiled: Any, variant: str, t: dict[str, torch.Tensor], tvm_ffi: bool = False) -> None:
    """Run a compiled variant on CUDA tensors (the outputs in ``t`` are written in place)."""
    dsl.launch(compiled, _call_args(variant, t), tvm_ffi)
