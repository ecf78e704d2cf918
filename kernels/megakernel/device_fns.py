"""Device functions of the persistent megakernel (``kernels/megakernel/vm.py``): addressing, GEMV rows, reductions.

The opcodes re-express the fused kernels' math over *runtime* boxes, so they share the per-lane arithmetic of
``common/device.py`` (re-exported here) and add address arithmetic on raw pointers from the buffer table
(``gflat``, ``gchunks``: flat views, 16-byte chunks; weights via ``ld.global.nc``, activations plain ``ld.global``).
GEMV work items go one per warp: on CUDA cores one weight row per item (:func:`weight_row_dot`, batch passes of
1 to 7 rows, the MLA opcodes' rows), on tensor cores a 16-row tile per item (:func:`weight_tile_mma`, passes of 8
rows, the fragment layout of ``kernels/megakernel/mma.py``); then CTA reductions (:func:`block_allreduce`,
:func:`rstd_rows`) and activations (:func:`silu`, :func:`glu`).
Design: ``docs/architecture.md`` (map; appendix: the megakernel VM); why a separate module, the addressing
conventions the host checks and both GEMV paths: docs/architecture.md#appendix-design-notes-by-room
(``kernels/megakernel/device_fns.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from kimik3.kernels.common.device import bf16_round, exp_fast, sigmoid, warp_argmax, warp_max, warp_sum
from kimik3.kernels.contracts.isa import CTA_THREADS
from kimik3.kernels.contracts.meta import ROW_LOOP_FROM
from kimik3.kernels.megakernel.mma import CHUNK_REGS, MMA_COLS, MMA_ROWS, mma_chunk

__all__ = [
    "NT",
    "NW",
    "UNROLL",
    "VEC",
    "BIG",
    "gflat",
    "gchunks",
    "row_dot",
    "weight_row_dot",
    "weight_tile_mma",
    "chunk_mma",
    "block_allreduce",
    "rstd_rows",
    "silu",
    "glu",
    "bf16_round",
    "exp_fast",
    "sigmoid",
    "warp_sum",
    "warp_max",
    "warp_argmax",
]

NT = CTA_THREADS  # threads per CTA (isa.py: the host checks programs against it)
NW = NT // 32
UNROLL = 4  # default 16-byte weight loads in flight per lane per row_dot step (the GEMV opcodes pass
# mk_addr.GEMV_UNROLL, the MLA opcodes MKConfig.unroll)
RSTD_UNROLL = 8  # 16-byte x loads in flight per lane in the RMSNorm prologue (rstd_rows)
VEC = 8  # bf16 per 16-byte chunk
BIG = 2**31 - 1  # extent of the flat views (offsets are not bounds-checked: the program's boxes are)


# ---------------------------------------------------------------------------------------------- addressing
@cute.jit
def gflat(dtype: cutlass.Constexpr, addr: Int64) -> Any:
    """A flat global-memory view of ``dtype`` elements starting at byte address ``addr`` (natural alignment)."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=max(1, dtype.width // 8))
    return cute.make_tensor(ptr, cute.make_layout(BIG))


@cute.jit
def gchunks(addr: Int64) -> Any:
    """bf16 global memory at ``addr`` (16-byte aligned) as ``[chunk, 8]``: ``v[(c, None)]`` is one 128-bit load."""
    ptr = cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout((BIG // VEC, VEC), stride=(VEC, 1)))


# ---------------------------------------------------------------------------------------------- GEMV rows
@cute.jit
def _dot_step(wv: Any, w0: Int32, W_SMEM: cutlass.Constexpr, xv: Any, x0: Int32, xs: Int32,
              X_SMEM: cutlass.Constexpr, gv: Any, c: Int32, acc: cute.Tensor, n: cutlass.Constexpr,
              BT: cutlass.Constexpr, lim: Any = None) -> None:
    """``n`` chunks (c, c+32, ...) of one weight row (times gamma when ``gv`` is given) against BT x rows.

    All ``n`` weight loads are issued before the first FMA (n x 16 bytes in flight per lane). With ``lim`` (the
    tail step) chunk ``c + 32u`` counts only while below ``lim``: a chunk past it is read at ``lim - 1`` (a real
    chunk of the row, so every load stays in bounds and unconditional) and weighted 0. The last, partial step is
    thus one step with every remaining load in flight, not a serial loop of single chunks; and it stays
    straight-line code (loads under per-chunk branches made ptxas spill the whole megakernel).

    Up to 2 batch rows, every x load of the step is unrolled next to the weight loads. From 3 rows on, the
    batch rows are a real loop (``ROW_LOOP_FROM``): ptxas hoists every independent load of an unrolled body to
    its top, and BT rows x n chunks of x (4 registers each) would not fit next to the weights in flight. The
    weights are converted to fp32 once (times gamma) and reused by every row; row ``b`` accumulates into
    ``acc[0]`` and the accumulators rotate by one after each row (BT moves), so register indices stay static."""
    if const_expr(W_SMEM):
        ld_w = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    else:
        ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    if const_expr(X_SMEM):
        ld_x = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    else:  # activations: written by other CTAs during the launch, so never through the .nc path
        ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    ld_g = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    rw = cute.make_rmem_tensor((VEC, n), BFloat16)
    for u in cutlass.range_constexpr(n):
        if const_expr(lim is None):
            cute.copy(ld_w, wv[(w0 + c + 32 * u, None)], rw[None, u])
        else:
            cute.copy(ld_w, wv[(w0 + cutlass.min(c + 32 * u, lim - 1), None)], rw[None, u])
    # the chunk index each u reads (x and gamma follow the weight chunk), and its weight: 1, or 0 past lim
    cc = [c + 32 * u if const_expr(lim is None) else cutlass.min(c + 32 * u, lim - 1) for u in range(n)]
    rg = None
    if const_expr(gv is not None):
        rg = cute.make_rmem_tensor((VEC, n), BFloat16)
        for u in cutlass.range_constexpr(n):
            cute.copy(ld_g, gv[(cc[u], None)], rg[None, u])
    if const_expr(BT < ROW_LOOP_FROM):
        rx = cute.make_rmem_tensor((VEC, BT), BFloat16)
        for u in cutlass.range_constexpr(n):
            for b in cutlass.range_constexpr(BT):
                cute.copy(ld_x, xv[(x0 + b * xs + cc[u], None)], rx[None, b])
            w = _weight_f32(rw, rg, u, c, lim)
            for b in cutlass.range_constexpr(BT):
                x = rx[None, b].load().to(Float32)
                a = acc[b]
                for k in cutlass.range_constexpr(VEC):  # a plain FMA chain: 8 fma.rn.f32, no reduction tree
                    a = a + w[k] * x[k]
                acc[b] = a
    else:
        wf = cute.make_rmem_tensor((VEC, n), Float32)
        for u in cutlass.range_constexpr(n):
            wf[None, u].store(_weight_f32(rw, rg, u, c, lim))
        rx = cute.make_rmem_tensor((VEC, n), BFloat16)
        for b in cutlass.range(BT, unroll=1):
            xb = x0 + b * xs  # row b of the pass
            for u in cutlass.range_constexpr(n):
                cute.copy(ld_x, xv[(xb + cc[u], None)], rx[None, u])
            a = acc[0]
            for u in cutlass.range_constexpr(n):
                x = rx[None, u].load().to(Float32)
                for k in cutlass.range_constexpr(VEC):
                    a = a + wf[k, u] * x[k]
            for r in cutlass.range_constexpr(BT - 1):  # rotate: row b + 1's accumulator comes to acc[0]
                acc[r] = acc[r + 1]
            acc[BT - 1] = a


@cute.jit
def _weight_f32(rw: cute.Tensor, rg: Any, u: cutlass.Constexpr, c: Int32, lim: Any) -> Any:
    """Weight chunk ``u`` of a step in fp32, times its gamma chunk (``rg``), times 0 when past ``lim``."""
    w = rw[None, u].load().to(Float32)
    if const_expr(rg is not None):
        w = w * rg[None, u].load().to(Float32)
    if const_expr(lim is not None):
        w = w * (Float32(1.0) if c + 32 * u < lim else Float32(0.0))
    return w


@cute.jit
def row_dot(wv: Any, w0: Int32, W_SMEM: cutlass.Constexpr, xv: Any, x0: Int32, xs: Int32, X_SMEM: cutlass.Constexpr,
            gv: Any, nch: Int32, acc: cute.Tensor, BT: cutlass.Constexpr, U: cutlass.Constexpr = UNROLL,
            lane: Any = None, wide_tail: cutlass.Constexpr = False) -> None:
    """Per-lane partial dots of one weight row (``nch`` chunks from chunk ``w0`` of ``wv``) with BT x rows
    (row ``b`` starts at chunk ``x0 + b·xs`` of ``xv``), accumulated into ``acc[0:BT]``.

    Full steps of 32 lanes x U chunks run in a real loop. What is left (fewer than 32·U chunks: leftover lane
    rounds and the partial last round) is, with ``wide_tail``, one clamped step of U chunks per lane (every load in
    flight at once: the GEMV opcodes, whose rows end in up to 7 lane rounds at U = 8), else one chunk per lane per
    iteration, the loop bound predicating the lanes past the end (no shuffles inside, so the divergence is
    harmless). The wide tail is the GEMV opcodes' choice: in the MoE / MLA opcodes' register context it made
    ptxas spill at k3-shard batch 1. Two instantiations per call site keep the compile small.

    ``lane`` is the lane's index (the host execution passes it; on the GPU, None reads the lane register)."""
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    steps = nch // (32 * U)
    for it in cutlass.range(steps, unroll=1):
        _dot_step(wv, w0, W_SMEM, xv, x0, xs, X_SMEM, gv, it * (32 * U) + lane, acc, U, BT)
    if const_expr(wide_tail):
        if steps * (32 * U) < nch:
            _dot_step(wv, w0, W_SMEM, xv, x0, xs, X_SMEM, gv, steps * (32 * U) + lane, acc, U, BT, nch)
    else:
        for c in cutlass.range(steps * (32 * U) + lane, nch, 32, unroll=1):
            _dot_step(wv, w0, W_SMEM, xv, x0, xs, X_SMEM, gv, c, acc, 1, BT)


@cute.jit
def weight_row_dot(stage: Any, staged_rows: Int32, wrow0: Int64, j: Int32, nch: Int32, xv: Any, x0: Int32,
                   xs: Int32, X_SMEM: cutlass.Constexpr, gv: Any, acc: cute.Tensor, BT: cutlass.Constexpr,
                   U: cutlass.Constexpr = UNROLL, lane: Any = None, wide_tail: cutlass.Constexpr = False) -> None:
    """``acc[b] = Σ_k W[j, k] (γ_k) x_b[k]`` (per lane, before the warp sum) for row ``j`` of a weight box whose
    row 0 is at byte address ``wrow0``; rows ``< staged_rows`` are read from the shared-memory stage the
    prefetch filled (row ``j`` at chunk ``j·nch``), the others from global memory. The branch is warp-uniform.
    ``wide_tail``: see :func:`row_dot`."""
    acc.fill(0.0)
    if j < staged_rows:
        row_dot(stage, j * nch, True, xv, x0, xs, X_SMEM, gv, nch, acc, BT, U, lane, wide_tail)
    else:
        row_dot(gchunks(wrow0 + Int64(j) * Int64(nch) * 16), Int32(0), False, xv, x0, xs, X_SMEM, gv, nch, acc, BT,
                U, lane, wide_tail)


# ---------------------------------------------------------------------------------------------- GEMV tiles (mma)
@cute.jit
def _mma_step(wa: Any, a0: Int32, wb: Any, b0: Int32, W_SMEM: cutlass.Constexpr, xv: Any, xr: Int32, rows: Int32,
              xs: Int32, gv: Any, s_rstd: Any, c: Int32, acc: cute.Tensor, n: cutlass.Constexpr, lim: Any = None,
              sink: Any = None, kb0: Int32 = 0) -> None:
    """``n`` k blocks (chunks ``c, c + 4, ...``) of a lane's two weight rows (chunk ``a0 + ·`` of ``wa``, ``b0 + ·``
    of ``wb``) against its x row of every pass ``p`` < ``acc``'s second mode (batch row ``xr + 8p``, read at row
    ``rows - 1`` from there on; row ``b`` at chunk ``b·xs + ·`` of ``xv``), through ``mk_mma.mma_chunk`` into
    ``acc[None, p]``. A pass's x offset and rstd are recomputed in every step rather than held across the k loop
    (they would be two more live registers per pass next to its four accumulators).

    All ``2n`` weight loads are issued before the first mma, and serve every pass: the weights are read once per
    step whatever the number of passes. Then pass by pass: its ``n`` x loads, the normalisation, its mmas. With
    ``gv`` (the RMSNorm weight) and ``s_rstd`` (the batch rows' rstd) the x chunk is normalised as it is used, as
    ``kimik3.model.modeling.rms_norm`` does it: ``bf16(γ · bf16(x · rstd))``, each product rounded to bf16, so the
    mma's B operand is the reference's normalised activation bit for bit. With ``lim`` (the tail step) a chunk at or
    past ``lim`` is read at ``lim - 1`` (in bounds, unconditional) and its x registers are zeroed, so it adds
    exactly 0.

    ``sink`` (host execution only): instead of the mma, pass ``p``'s k block ``kb0 + u`` registers (weight rows g,
    g + 8, x row g: 12 words) are written to ``sink[(kb0 + u)·P + p, :]``; the host evaluates the mma
    (``mk_mma.mma_reference``)."""
    P = cute.size(acc, mode=[1])
    if const_expr(W_SMEM):
        ld_w = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    else:
        ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    # activations: written by other CTAs during the launch, so never through the .nc path
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    ld_g = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    cc = [c + 4 * u if const_expr(lim is None) else cutlass.min(c + 4 * u, lim - 1) for u in range(n)]
    rwa = cute.make_rmem_tensor((VEC, n), BFloat16)
    rwb = cute.make_rmem_tensor((VEC, n), BFloat16)
    for u in cutlass.range_constexpr(n):
        cute.copy(ld_w, wa[(a0 + cc[u], None)], rwa[None, u])
        cute.copy(ld_w, wb[(b0 + cc[u], None)], rwb[None, u])
    rg = None
    if const_expr(gv is not None):
        rg = cute.make_rmem_tensor((VEC, n), BFloat16)
        for u in cutlass.range_constexpr(n):
            cute.copy(ld_g, gv[(cc[u], None)], rg[None, u])
    ua = cute.recast_tensor(rwa, Uint32)
    ub = cute.recast_tensor(rwb, Uint32)
    for p in cutlass.range_constexpr(P):
        r = cutlass.min(xr + p * MMA_COLS, rows - 1)
        rx = cute.make_rmem_tensor((VEC, n), BFloat16)
        for u in cutlass.range_constexpr(n):
            cute.copy(ld_x, xv[(r * xs + cc[u], None)], rx[None, u])
        ux = cute.recast_tensor(rx, Uint32)
        rstd = s_rstd[r] if const_expr(gv is not None) else None
        for u in cutlass.range_constexpr(n):
            if const_expr(gv is not None):
                xh = (rx[None, u].load().to(Float32) * rstd).to(BFloat16)
                rx[None, u].store((xh.to(Float32) * rg[None, u].load().to(Float32)).to(BFloat16))
            if const_expr(lim is not None):
                for i in cutlass.range_constexpr(CHUNK_REGS):
                    ux[i, u] = ux[i, u] if c + 4 * u < lim else Uint32(0)
            chunk_mma(acc[None, p], ua[None, u], ub[None, u], ux[None, u], sink, (kb0 + u) * P + p)


@cute.jit
def chunk_mma(acc: cute.Tensor, wg: cute.Tensor, wg8: cute.Tensor, xg: cute.Tensor, sink: Any, kb: Int32) -> None:
    """``mk_mma.mma_chunk`` on a lane's registers, or (``sink``, host execution) the registers as it would take
    them: ``sink[kb, :]`` = weight row g, weight row g + 8, x row g (4 words each)."""
    if const_expr(sink is None):
        mma_chunk(acc, wg, wg8, xg)
    else:
        for i in cutlass.range_constexpr(CHUNK_REGS):
            sink[kb, i] = Int32(wg[i])
            sink[kb, CHUNK_REGS + i] = Int32(wg8[i])
            sink[kb, 2 * CHUNK_REGS + i] = Int32(xg[i])


@cute.jit
def weight_tile_mma(stage: Any, staged_rows: Int32, wrow0: Int64, j0: Int32, n: Int32, nch: Int32, xv: Any,
                    row0: Int32, rows: Int32, xs: Int32, gv: Any, s_rstd: Any, acc: cute.Tensor, U: cutlass.Constexpr,
                    lane: Any = None, sink: Any = None) -> None:
    """One tensor-core GEMV tile over a group of ``P`` batch passes (``acc``'s second mode): ``acc`` (4, P) fp32, column
    ``p`` the lane's C fragments (``mk_mma.acc_row`` / ``acc_col``) of ``W[j0 : j0 + 16] · X_p^T``, for the weight box
    of ``n`` rows whose row 0 is at byte address ``wrow0`` and pass ``p``'s 8 x rows ``row0 + 8p ... row0 + 8p + 7``
    (row ``b`` at chunk ``b·xs`` of ``xv``; a row at or past ``rows``, the batch, is read at row ``rows - 1``: the
    caller never stores it), normalised as loaded when ``gv`` (γ) and ``s_rstd`` (the batch rows' rstd, indexed by row)
    are given.

    Lane (g, q) (``mk_mma`` chunk layout) reads chunk ``4·kb + q`` of weight rows ``j0 + g`` and ``j0 + g + 8`` once
    per 32-element k block ``kb``, and of x row ``g`` of every pass. Rows past the box end are read at row ``n - 1``
    (valid memory, unconditional loads); their accumulators are garbage the caller never stores. The tile comes from
    the shared-memory stage when every row it reads is staged (``< staged_rows``, row ``j`` at chunk ``j·nch``),
    else from global memory (the staged rows are a copy of the same weights, so the one tile straddling the
    stage's end is exact either way; the branch is warp-uniform).

    Steps of ``U`` k blocks (2U weight + P·U x 16-byte loads per lane) run in a real loop; the leftover k blocks (and
    a partial last block when the row is not a multiple of 32 elements) are one clamped step."""
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    acc.fill(0.0)
    g = lane // 4
    q = lane % 4
    ra = cutlass.min(j0 + g, n - 1)
    rb = cutlass.min(j0 + g + MMA_ROWS // 2, n - 1)
    xr = row0 + g
    steps = nch // (4 * U)  # a k block is 4 chunks (one per quad lane)
    if cutlass.min(j0 + (MMA_ROWS - 1), n - 1) < staged_rows:
        for it in cutlass.range(steps, unroll=1):
            _mma_step(stage, ra * nch, stage, rb * nch, True, xv, xr, rows, xs, gv, s_rstd, it * (4 * U) + q, acc,
                      U, None, sink, it * U)
        if steps * (4 * U) < nch:
            _mma_step(stage, ra * nch, stage, rb * nch, True, xv, xr, rows, xs, gv, s_rstd, steps * (4 * U) + q,
                      acc, U, nch, sink, steps * U)
    else:
        wa = gchunks(wrow0 + Int64(ra) * Int64(nch) * 16)
        wb = gchunks(wrow0 + Int64(rb) * Int64(nch) * 16)
        for it in cutlass.range(steps, unroll=1):
            _mma_step(wa, Int32(0), wb, Int32(0), False, xv, xr, rows, xs, gv, s_rstd, it * (4 * U) + q, acc, U,
                      None, sink, it * U)
        if steps * (4 * U) < nch:
            _mma_step(wa, Int32(0), wb, Int32(0), False, xv, xr, rows, xs, gv, s_rstd, steps * (4 * U) + q, acc,
                      U, nch, sink, steps * U)


# ---------------------------------------------------------------------------------------------- reductions
@cute.jit
def block_allreduce(vals: cute.Tensor, s_red: cute.Tensor, n: cutlass.Constexpr) -> None:
    """Sum ``vals[0:n]`` over the whole CTA; every thread gets the totals back in ``vals``.

    One warp-level butterfly per value, one smem slot per (warp, value), a barrier, then every thread re-reduces
    the NW partials in the same fixed order (deterministic); a second barrier lets the caller reuse ``s_red``.
    Every thread of the CTA must call it (it contains ``bar.sync``)."""
    warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
    for i in cutlass.range_constexpr(n):
        s = warp_sum(vals[i])
        if lane == 0:
            s_red[warp * n + i] = s
    cute.arch.sync_threads()
    for i in cutlass.range_constexpr(n):
        t = Float32(0.0)
        for w in cutlass.range_constexpr(NW):
            t = t + s_red[w * n + i]
        vals[i] = t
    cute.arch.sync_threads()


@cute.jit
def rstd_rows(xaddr: Int64, xs: Int32, nrows: Int32, nch: Int32, eps: cutlass.Constexpr, s_rstd: cute.Tensor
              ) -> None:
    """``s_rstd[b] = rsqrt(mean(x_b²) + eps)`` for ``nrows`` bf16 rows of ``nch`` chunks (row ``b`` at chunk
    ``b·xs`` from ``xaddr``), one warp per row; ends with a barrier so every thread can read the result.

    Each lane issues RSTD_UNROLL 16-byte loads before it adds any: the prologue sits between the waits and the
    weight stream, so its L2 round trips are serial time (a 7168-wide row is 28 lane rounds: 4 round trips, not
    28). A chunk past the row's end is read at its last chunk and counted 0 times (straight-line code, as
    ``_dot_step``'s tail).

    The CUDA-core GEMV path applies rstd once per output after the dot product (guide §3.1), so the normalised x
    is never materialised: its result differs from the reference's bf16(γ·bf16(x·rstd)) at bf16-rounding level.
    The tensor-core path (:func:`weight_tile_mma`) normalises each x chunk as it loads it, exactly as the
    reference."""
    warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
    xv = gchunks(xaddr)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    for b in cutlass.range(warp, nrows, NW, unroll=1):
        part = Float32(0.0)
        for c in cutlass.range(lane, nch, 32 * RSTD_UNROLL, unroll=1):
            rx = cute.make_rmem_tensor((VEC, RSTD_UNROLL), BFloat16)
            for u in cutlass.range_constexpr(RSTD_UNROLL):
                cute.copy(ld_x, xv[(b * xs + cutlass.min(c + 32 * u, nch - 1), None)], rx[None, u])
            for u in cutlass.range_constexpr(RSTD_UNROLL):
                x = rx[None, u].load().to(Float32)
                s = Float32(0.0)
                for k in cutlass.range_constexpr(VEC):
                    s = s + x[k] * x[k]
                part = part + (s if c + 32 * u < nch else Float32(0.0))
        tot = warp_sum(part)
        if lane == 0:
            s_rstd[b] = cute.math.rsqrt(tot / Float32(nch * VEC) + eps, fastmath=True)
    cute.arch.sync_threads()


# ---------------------------------------------------------------------------------------------- activations
@cute.jit
def silu(x: Float32) -> Float32:
    return x * sigmoid(x)


@cute.jit
def glu(a: Float32, b: Float32, SITU: cutlass.Constexpr, beta: cutlass.Constexpr, beta_lin: cutlass.Constexpr
        ) -> Float32:
    """The gated activation on bf16-rounded gate ``a`` and up ``b`` (as ``kimik3.model.modeling.glu``): SiTU-GLU
    ``β·tanh(a/β)·σ(a) · β_lin·tanh(b/β_lin)`` in fp32, or SwiGLU ``bf16(silu(a))·b`` (HF rounds silu to the
    activation dtype first). Returns fp32; the caller rounds to bf16 once."""
    out = Float32(0.0)
    if const_expr(SITU):
        g = beta * cute.math.tanh(a * (1.0 / beta), fastmath=True) * sigmoid(a)
        u = b
        if const_expr(beta_lin is not None):
            u = beta_lin * cute.math.tanh(b * (1.0 / beta_lin), fastmath=True)
        out = g * u
    else:
        out = bf16_round(silu(a)) * b
    return out
