"""Routed experts of a LatentMoE layer for decode (spec §5.3, §5.5): grouped GEMV over the selected experts only.

One ``@cute.jit`` op (``moe_experts``) launches four kernels: ``moe_align_kernel`` groups the (token, slot) pairs by
expert, deterministically; ``expert_gemv_kernel`` runs gate/up with SiTU-GLU, then down, over the active experts,
streaming an expert's weights once per token tile; ``moe_combine_kernel`` sums the weighted outputs in fp32 and
casts once. Weights are bf16 or MXFP4 (codes expanded in registers; no sm_100a-only conversion, so it runs on
Hopper). ``head_gemv`` reuses the expert GEMV as MLA's per-head GEMV (spec §4.4) with a fixed routing.
Entry points: ``compile_for`` / ``launch`` and ``compile_heads_for`` / ``launch_heads`` (host).
Design: ``docs/architecture.md`` §5.3, §5.5; the four kernels, the loads in flight and the MXFP4 expansion:
docs/architecture.md#appendix-design-notes-by-room (``kernels/fused/moe.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Uint8, Uint32, const_expr
from kimik3.kernels.common import device as C
from kimik3.kernels.common.trace import evict_last
from kimik3.kernels.contracts.meta import ARG_ORDER, HEADS_ORDER, MOE_ORDER, ROW_LOOP_FROM, SITU_BETA, SITU_BETA_LIN
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

# hash of the source as imported: the build cache and prebuilt manifests key on the code that runs
SOURCE_HASH = kernel_source_hash(__name__.rsplit(".", 1)[-1])
VEC = C.VEC
WARPS = 4
BATCH_TILE_CAP = 8  # tokens per pass over an expert's rows: x row addresses + 2 x BT accumulators
# 16-byte weight loads per lane per step, per matrix. The loads of a step are all issued before the first FMA and
# stay packed in registers (4 per load); only one chunk (bf16) or one 8-code word (MXFP4) is widened to fp32 at a
# time, so more loads in flight cost 4 registers each, not 16-32.
UNROLL_BF16 = 4  # down: one matrix
UNROLL_BF16_GLU = 2  # gate/up: 2 x 2 loads in flight (L = 3584: 14 lane rounds, 7 whole steps, no peeled step)
# MXFP4: 32-column groups (16-byte code loads) per lane per step and matrix. At K3 widths a lane owns 3 full groups
# of a row (L = 3584: 112 groups, I = 3072: 96), so 4 puts the lane's whole row in flight in one step.
UNROLL_FP4 = 4  # down
UNROLL_FP4_GLU = 4  # gate/up: 2 x 4 (2 x 3 at K3 widths, then the 16 lanes of the partial round: 2 x 1)
# MXFP4 down projection: tokens per pass at most 4. Its code words stay in registers across the passes (loaded once
# per row), so a smaller tile re-reads no weights; a pass of 8 tokens needed so many more registers that fewer CTAs
# fit per SM, with fewer bytes in flight per SM (the register counts: each variant's build report).
DOWN_TILE_FP4 = 4
# No .minnctapersm on the expert GEMVs: compiled for 3 / 4 / 6 CTAs per SM, ptxas filled the registers up to the
# cap and spilled; its own choice is spill-free (each variant's build report records it).
COMBINE_THREADS = 128
VARIANTS = ("bf16", "mxfp4")
OUTPUTS = {"bf16": ("out",), "mxfp4": ("out",)}
def token_tile(B: int, topk: int, E: int) -> int:
    """Tokens per pass over an expert's rows: the expected tokens per active expert, B·k / min(E, B·k),
    rounded up to a power of two and capped at BATCH_TILE_CAP. Past the expert's count the tile
    recomputes (and discards) a clamped token, so a tile much larger than the typical count wastes
    FMAs and registers (B = 8, k = 16, E = 56: ~2.3 tokens per expert -> tile 4)."""
    per_expert = -(-B * topk // min(E, B * topk))
    return min(BATCH_TILE_CAP, 1 << (per_expert - 1).bit_length(), B)



def down_tile(bt: int, fp4: bool) -> int:
    """Tokens per pass of the down projection: the gate/up tile ``bt``, capped at DOWN_TILE_FP4 for MXFP4."""
    return min(bt, DOWN_TILE_FP4) if fp4 else bt


# ---------------------------------------------------------------------------------------------- device code
@cute.kernel
def moe_align_kernel(mIds: cute.Tensor, mSorted: cute.Tensor, mActE: cute.Tensor, mActStart: cute.Tensor,
                     mActCount: cute.Tensor, mNAct: cute.Tensor, E: cutlass.Constexpr):
    lane, _, _ = cute.arch.thread_idx()
    B, K = cute.size(mIds, mode=[0]), cute.size(mIds, mode=[1])
    P = B * K
    A = cute.size(mActE, mode=[0])
    alloc = cutlass.memory.SmemAllocator()
    sCnt = C.smem_tensor(alloc, Int32, (E,), "moe_align")
    sStart = C.smem_tensor(alloc, Int32, (E,), "moe_align")
    sPos = C.smem_tensor(alloc, Int32, (P,), "moe_align")
    for e in cutlass.range(lane, E, 32, unroll=1):
        sCnt[e] = 0
    cute.arch.sync_warp()
    lt = cute.arch.lanemask_lt()
    for c0 in cutlass.range(0, P, 32, unroll=1):
        p = c0 + lane
        e = -1 - lane  # distinct sentinels: idle lanes match nobody
        if p < P:
            e = mIds[p // K, p % K]
        grp = cute.arch.match_sync(cute.arch.FULL_MASK, e)  # lanes routed to the same expert
        rank = cute.arch.popc(grp & lt)
        base = Int32(0)
        if p < P:
            base = sCnt[e]
        cute.arch.sync_warp()  # every lane has read its counter before the group leader bumps it
        if p < P:
            sPos[p] = base + Int32(rank)
            if rank == 0:
                sCnt[e] = base + Int32(cute.arch.popc(grp))
        cute.arch.sync_warp()
    carry_n, carry_a = Int32(0), Int32(0)
    for c0 in cutlass.range(0, E, 32, unroll=1):  # exclusive scans of counts and of "active"
        e = c0 + lane
        n = Int32(0)
        if e < E:
            n = sCnt[e]
        act = Int32(1) if n > 0 else Int32(0)
        sn, sa = n, act
        for off in cutlass.range_constexpr(5):
            on = cute.arch.shuffle_sync_up(sn, offset=1 << off)
            oa = cute.arch.shuffle_sync_up(sa, offset=1 << off)
            sn = sn + on if lane >= (1 << off) else sn
            sa = sa + oa if lane >= (1 << off) else sa
        start = carry_n + sn - n
        slot = carry_a + sa - act
        if e < E:
            sStart[e] = start
        if n > 0:
            mActE[slot], mActStart[slot], mActCount[slot] = e, start, n
        carry_n = carry_n + cute.arch.shuffle_sync(sn, 31)
        carry_a = carry_a + cute.arch.shuffle_sync(sa, 31)
    for a in cutlass.range(carry_a + lane, A, 32, unroll=1):  # unused slots: well-defined values
        mActE[a], mActStart[a], mActCount[a] = -1, 0, 0
    if lane == 0:
        mNAct[0] = carry_a
    cute.arch.sync_warp()
    for c0 in cutlass.range(0, P, 32, unroll=1):
        p = c0 + lane
        if p < P:
            mSorted[sStart[mIds[p // K, p % K]] + sPos[p]] = p


@cute.jit
def _bf16_load(gA: cute.Tensor, gB: Any, cz: Int32, ra: cute.Tensor, rb: cute.Tensor, n: cutlass.Constexpr):
    """The ``n`` weight loads per matrix of a step (chunks cz, cz+32, ...) into ``ra`` (and ``rb``), back to back,
    kept packed (4 registers per 16 bytes), so the loads in flight cost no more registers than their bytes."""
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    for u in cutlass.range_constexpr(n):
        cute.copy(ld_w, gA[(None, cz + 32 * u)], ra[None, u])
        if const_expr(gB is not None):
            cute.copy(ld_w, gB[(None, cz + 32 * u)], rb[None, u])


@cute.jit
def _bf16_step(gA: cute.Tensor, gB: Any, mX: cute.Tensor, xrow: cute.Tensor, c0: Int32, accA: cute.Tensor,
               accB: cute.Tensor, z: Uint32, n: cutlass.Constexpr, BT: cutlass.Constexpr):
    """n chunks (c0, c0+32, ...) of the row(s) on their own: the weight loads (:func:`_bf16_load`), then their use
    (:func:`_bf16_use`)."""
    ra = cute.make_rmem_tensor((VEC, n), BFloat16)
    rb = cute.make_rmem_tensor((VEC, n), BFloat16)
    _bf16_load(gA, gB, c0 + Int32(z), ra, rb, n)  # the same chunks, but not invariant in the token-tile loop
    _bf16_use(ra, rb, gB is not None, mX, xrow, c0, accA, accB, n, BT)


@cute.jit
def _bf16_use(ra: cute.Tensor, rb: cute.Tensor, GLU: cutlass.Constexpr, mX: cute.Tensor, xrow: cute.Tensor,
              c0: Int32, accA: cute.Tensor, accB: cute.Tensor, n: cutlass.Constexpr, BT: cutlass.Constexpr):
    """Apply a step's loaded weight chunks ``ra`` (and ``rb`` with ``GLU``) to the BT rows of x.

    Below ``ROW_LOOP_FROM`` tokens one chunk at a time is widened to fp32 and applied to the BT rows, every x load
    unrolled. From there on the tokens are a real loop (as ``gemv._use_step``: unrolled, ptxas interleaved the
    tokens' x loads with the weight loads and consumed the first weight chunk after one or two of them were
    issued, ``kernels/verify/sass_audit.py``): the step's weights are widened once and token ``t`` accumulates into
    ``accA[0]`` / ``accB[0]``, the accumulators rotating by one after each token."""
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, **evict_last())
    if const_expr(BT < ROW_LOOP_FROM):
        rx = cute.make_rmem_tensor((VEC,), BFloat16)
        for u in cutlass.range_constexpr(n):
            wa = ra[None, u].load().to(Float32)
            wb = wa
            if const_expr(GLU):
                wb = rb[None, u].load().to(Float32)
            for t in cutlass.range_constexpr(BT):
                gX = cute.zipped_divide(mX[xrow[t], None], (VEC,))
                cute.copy(ld_x, gX[(None, c0 + 32 * u)], rx)
                x = rx.load().to(Float32)
                accA[t] = (wa * x).reduce(cute.ReductionOp.ADD, accA[t], reduction_profile=0)
                if const_expr(GLU):
                    accB[t] = (wb * x).reduce(cute.ReductionOp.ADD, accB[t], reduction_profile=0)
    else:
        fa = cute.make_rmem_tensor((VEC, n), Float32)
        fb = cute.make_rmem_tensor((VEC, n), Float32)
        for u in cutlass.range_constexpr(n):
            fa[None, u].store(ra[None, u].load().to(Float32))
            if const_expr(GLU):
                fb[None, u].store(rb[None, u].load().to(Float32))
        rx = cute.make_rmem_tensor((VEC, n), BFloat16)
        for _ in cutlass.range(BT, unroll=1):
            row = xrow[0]
            gX = cute.zipped_divide(mX[row, None], (VEC,))
            for u in cutlass.range_constexpr(n):
                cute.copy(ld_x, gX[(None, c0 + 32 * u)], rx[None, u])
            a = accA[0]
            b = accB[0]
            for u in cutlass.range_constexpr(n):
                x = rx[None, u].load().to(Float32)
                a = (fa[None, u].load() * x).reduce(cute.ReductionOp.ADD, a, reduction_profile=0)
                if const_expr(GLU):
                    b = (fb[None, u].load() * x).reduce(cute.ReductionOp.ADD, b, reduction_profile=0)
            for r in cutlass.range_constexpr(BT - 1):  # rotate: token t + 1's accumulators and row come to [0]
                accA[r] = accA[r + 1]
                accB[r] = accB[r + 1]
                xrow[r] = xrow[r + 1]
            accA[BT - 1] = a
            accB[BT - 1] = b
            xrow[BT - 1] = row


@cute.jit
def _fp4_step(gPA: cute.Tensor, gPB: Any, gSA: cute.Tensor, gSB: Any, mX: cute.Tensor, xrow: cute.Tensor,
              c0: Int32, accA: cute.Tensor, accB: cute.Tensor, z: Uint32, n: cutlass.Constexpr,
              BT: cutlass.Constexpr):
    """n 32-column groups (c0, c0+32, ...): all code and scale loads first (codes stay packed: 4 registers per
    16 bytes in flight), then one 8-code word at a time is expanded with its group scale folded in (8 fp32 per
    matrix live) and applied to the BT rows of x, each x chunk (16 bytes) read once per word and token."""
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128, invariant=True)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, **evict_last())
    GLU = gPB is not None
    rpa = cute.make_rmem_tensor((4, n), Uint32)
    rpb = cute.make_rmem_tensor((4, n), Uint32)
    for u in cutlass.range_constexpr(n):
        cute.copy(ld_w, gPA[(None, c0 + 32 * u)], rpa[None, u])
        if const_expr(GLU):
            cute.copy(ld_w, gPB[(None, c0 + 32 * u)], rpb[None, u])
    sa = cute.make_rmem_tensor((n,), Uint8)
    sb = cute.make_rmem_tensor((n,), Uint8)
    for u in cutlass.range_constexpr(n):
        sa[u] = gSA[c0 + 32 * u]
        if const_expr(GLU):
            sb[u] = gSB[c0 + 32 * u]
    rx = cute.make_rmem_tensor((VEC,), BFloat16)
    for u in cutlass.range_constexpr(n):
        fa = C.fp4_scale(sa[u])
        fb = fa
        if const_expr(GLU):
            fb = C.fp4_scale(sb[u])
        for j in cutlass.range_constexpr(4):
            wa = C.fp4_expand(rpa[j, u] + z, fa)
            wb = wa
            if const_expr(GLU):
                wb = C.fp4_expand(rpb[j, u] + z, fb)
            for t in cutlass.range_constexpr(BT):
                gX = cute.zipped_divide(mX[xrow[t], None], (VEC,))
                cute.copy(ld_x, gX[(None, (c0 + 32 * u) * 4 + j)], rx)
                x = C.x_pair_order(rx, j)
                accA[t] = (wa * x).reduce(cute.ReductionOp.ADD, accA[t], reduction_profile=0)
                if const_expr(GLU):
                    accB[t] = (wb * x).reduce(cute.ReductionOp.ADD, accB[t], reduction_profile=0)


@cute.jit
def _walk_row(gA: cute.Tensor, gB: Any, gSA: Any, gSB: Any, mX: cute.Tensor, xrow: cute.Tensor, lane: Int32,
              accA: cute.Tensor, accB: cute.Tensor, z: Uint32, NCH: cutlass.Constexpr, BT: cutlass.Constexpr,
              FP4: cutlass.Constexpr):
    """Traverse one weight row as NCH chunks (lane owns l, l+32, ...): full unrolled steps, a static
    remainder step, then the predicated partial lane round (as gemv.row_dot). The bf16 steps below
    ``ROW_LOOP_FROM`` tokens are software-pipelined as ``gemv.row_dot``'s: each trip issues the next step's weight
    loads before it uses the current ones, so every load of a step is in flight before the first is consumed."""
    unroll = (UNROLL_FP4_GLU if gB is not None else UNROLL_FP4) if FP4 else (
        UNROLL_BF16_GLU if gB is not None else UNROLL_BF16)
    rounds = NCH // 32
    steps = rounds // unroll
    if const_expr(not FP4 and BT < ROW_LOOP_FROM and steps > 0):
        ra = cute.make_rmem_tensor((VEC, unroll), BFloat16)
        rb = cute.make_rmem_tensor((VEC, unroll), BFloat16)
        na = cute.make_rmem_tensor((VEC, unroll), BFloat16)
        nb = cute.make_rmem_tensor((VEC, unroll), BFloat16)
        _bf16_load(gA, gB, lane + Int32(z), ra, rb, unroll)
        for it in cutlass.range(steps - 1, unroll=1):
            c0 = it * (32 * unroll) + lane
            _bf16_load(gA, gB, c0 + 32 * unroll + Int32(z), na, nb, unroll)
            _bf16_use(ra, rb, gB is not None, mX, xrow, c0, accA, accB, unroll, BT)
            ra.store(na.load())
            if const_expr(gB is not None):
                rb.store(nb.load())
        _bf16_use(ra, rb, gB is not None, mX, xrow, (steps - 1) * (32 * unroll) + lane, accA, accB, unroll, BT)
    else:
        for it in cutlass.range(steps, unroll=1):
            if const_expr(FP4):
                _fp4_step(gA, gB, gSA, gSB, mX, xrow, it * (32 * unroll) + lane, accA, accB, z, unroll, BT)
            else:
                _bf16_step(gA, gB, mX, xrow, it * (32 * unroll) + lane, accA, accB, z, unroll, BT)
    if const_expr(rounds % unroll > 0):
        c0 = steps * (32 * unroll) + lane
        if const_expr(FP4):
            _fp4_step(gA, gB, gSA, gSB, mX, xrow, c0, accA, accB, z, rounds % unroll, BT)
        else:
            _bf16_step(gA, gB, mX, xrow, c0, accA, accB, z, rounds % unroll, BT)
    if const_expr(NCH % 32 > 0):
        if lane < NCH % 32:
            if const_expr(FP4):
                _fp4_step(gA, gB, gSA, gSB, mX, xrow, rounds * 32 + lane, accA, accB, z, 1, BT)
            else:
                _bf16_step(gA, gB, mX, xrow, rounds * 32 + lane, accA, accB, z, 1, BT)


@cute.jit
def situ(a: Float32, b: Float32) -> Float32:
    """SiTU-GLU (§5.1): [β tanh(a/β) σ(a)] · [β_lin tanh(b/β_lin)], fp32."""
    g = SITU_BETA * cute.math.tanh(a * (1.0 / SITU_BETA), approx=True) * C.sigmoid(a)
    return g * (SITU_BETA_LIN * cute.math.tanh(b * (1.0 / SITU_BETA_LIN), approx=True))


@cute.jit
def expert_row(rg: Int32, warp: Int32) -> Int32:
    """The weight row warp ``warp`` of CTA (``rg``, slot) owns (one warp per row, WARPS rows per CTA)."""
    return rg * WARPS + warp


@cute.jit
def expert_slot(mActE: cute.Tensor, mActStart: cute.Tensor, mActCount: cute.Tensor, a: Int32
                ) -> tuple[Int32, Int32, Int32]:
    """(expert id, first sorted pair, pair count) of active-expert slot ``a`` (the CTA's grid y)."""
    return mActE[a], mActStart[a], mActCount[a]


@cute.jit
def expert_weight_rows(mWA: cute.Tensor, mWB: Any, mSA: Any, mSB: Any, e: Int32, row: Int32) -> tuple[Any, ...]:
    """Row ``row`` of expert ``e``'s weights as the chunk views the lanes walk: (A, B, A scales, B scales), B and
    the scales None when absent. bf16: 8-weight chunks; MXFP4: 16-byte chunks of four uint32 code words (one
    32-column scale group each) and the group's scale byte."""
    FP4 = mSA is not None
    GLU = mWB is not None
    gB, gSA, gSB = None, None, None
    if const_expr(FP4):
        gA = cute.zipped_divide(cute.recast_tensor(mWA[e, row, None], Uint32), (4,))
        if const_expr(GLU):
            gB = cute.zipped_divide(cute.recast_tensor(mWB[e, row, None], Uint32), (4,))
        gSA = mSA[e, row, None]
        if const_expr(GLU):
            gSB = mSB[e, row, None]
    else:
        gA = cute.zipped_divide(mWA[e, row, None], (VEC,))
        if const_expr(GLU):
            gB = cute.zipped_divide(mWB[e, row, None], (VEC,))
    return gA, gB, gSA, gSB


@cute.jit
def expert_lane(gA: cute.Tensor, gB: Any, gSA: Any, gSB: Any, mX: cute.Tensor, mSorted: cute.Tensor, start: Int32,
                cnt: Int32, t0: Int32, lane: Int32, accA: cute.Tensor, accB: cute.Tensor, pair: cute.Tensor,
                K: cutlass.Constexpr, XDIV: cutlass.Constexpr, BT: cutlass.Constexpr):
    """Lane ``lane``'s partial dots of one expert weight row (``expert_weight_rows``) with the x rows of the
    expert's pairs t0..t0+BT-1 (``mSorted[start:start+cnt]``) into ``accA`` / ``accB``; ``pair`` gets the pairs
    (past the count the last pair is repeated: its result is computed and not stored)."""
    FP4 = gSA is not None
    xrow = cute.make_rmem_tensor((BT,), Int32)
    for t in cutlass.range_constexpr(BT):  # clamp past the end: reload a valid row, skip its store
        pair[t] = mSorted[start + cutlass.min(t0 + t, cnt - 1)]
        xrow[t] = pair[t] // XDIV
    accA.fill(0.0)
    accB.fill(0.0)
    # z = 0 (a pair index is below 2^31), from a value loaded per tile, so the compiler cannot treat what depends on
    # it as invariant in the caller's token-tile loop: bf16 chunks are loaded and widened per tile, MXFP4 codes are
    # loaded once per row (whole-row code words fit in a few registers) but expanded per tile. Hoisting a static
    # step's widened weights (8 fp32 per 16-byte load) out of the tile loop ran out of registers.
    z = Uint32(pair[0]) >> 31
    _walk_row(gA, gB, gSA, gSB, mX, xrow, lane, accA, accB, z, K // 32 if FP4 else K // VEC, BT, FP4)


@cute.kernel
def expert_gemv_kernel(mWA: cute.Tensor, mWB: Any, mSA: Any, mSB: Any, mX: cute.Tensor, mOut: cute.Tensor,
                       mSorted: cute.Tensor, mActE: cute.Tensor, mActStart: cute.Tensor, mActCount: cute.Tensor,
                       mNAct: cute.Tensor, K: cutlass.Constexpr, XDIV: cutlass.Constexpr, BT: cutlass.Constexpr):
    """Rows of the selected experts' weights x the rows of mX routed to them.

    mWA/mWB: [E, R, K] bf16, or [E, R, K/2] uint8 codes with mSA/mSB [E, R, K/32] scales (MXFP4).
    mX row of pair p is p // XDIV (tokens for gate/up, pairs for down); out row is the pair p.
    """
    tidx, _, _ = cute.arch.thread_idx()
    rg, a, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    R = cute.size(mWA, mode=[1])
    GLU = mWB is not None
    row = expert_row(rg, warp)
    if (a < mNAct[0]) & (row < R):  # warp-uniform
        e, start, cnt = expert_slot(mActE, mActStart, mActCount, a)
        gA, gB, gSA, gSB = expert_weight_rows(mWA, mWB, mSA, mSB, e, row)
        accA = cute.make_rmem_tensor((BT,), Float32)
        accB = cute.make_rmem_tensor((BT,), Float32)
        pair = cute.make_rmem_tensor((BT,), Int32)
        for t0 in cutlass.range(0, cnt, BT, unroll=1):
            expert_lane(gA, gB, gSA, gSB, mX, mSorted, start, cnt, t0, lane, accA, accB, pair, K, XDIV, BT)
            for t in cutlass.range_constexpr(BT):
                ya = C.warp_sum(accA[t])
                if const_expr(GLU):
                    # experts run in the activation dtype: the projections are bf16 before SiTU
                    ya = situ(C.bf16_round(ya), C.bf16_round(C.warp_sum(accB[t])))
                if t0 + t < cnt:
                    if lane == t % 32:
                        mOut[pair[t], row] = ya.to(BFloat16)


@cute.jit
def combine_chunk(mY: cute.Tensor, mWts: cute.Tensor, mOut: cute.Tensor, b: Int32, c: Int32):
    """out[b, 8c:8c+8] = bf16(Σ_j w[b, j] · fp32(y[b·k + j, 8c:8c+8])): fp32 sum over the slots in order, one cast."""
    K = cute.size(mWts, mode=[1])
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    st = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), BFloat16, num_bits_per_copy=128)
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    o = cute.make_rmem_tensor((VEC,), BFloat16)
    gOut = cute.zipped_divide(mOut[b, None], (VEC,))
    acc = cute.make_rmem_tensor((VEC,), Float32)
    acc.fill(0.0)
    for j in cutlass.range_constexpr(K):
        cute.copy(ld, cute.zipped_divide(mY[b * K + j, None], (VEC,))[(None, c)], r)
        acc.store(acc.load() + r.load().to(Float32) * mWts[b, j])
    o.store(acc.load().to(BFloat16))
    cute.copy(st, o, gOut[(None, c)])


@cute.kernel
def moe_combine_kernel(mY: cute.Tensor, mWts: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    L = cute.size(mOut, mode=[1])
    for c in cutlass.range(tidx, L // VEC, COMBINE_THREADS, unroll=1):
        combine_chunk(mY, mWts, mOut, b, c)


@cute.jit
def moe_experts(mX: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW1: cute.Tensor, mW3: cute.Tensor,
                mW2: cute.Tensor, mS1: Any, mS3: Any, mS2: Any, mH: cute.Tensor, mY: cute.Tensor,
                mSorted: cute.Tensor, mActE: cute.Tensor, mActStart: cute.Tensor, mActCount: cute.Tensor,
                mNAct: cute.Tensor, mOut: cute.Tensor, stream: Any, E: cutlass.Constexpr, L: cutlass.Constexpr,
                I: cutlass.Constexpr):  # noqa: E741 - spec notation
    B, TOPK = cute.size(mIds, mode=[0]), cute.size(mIds, mode=[1])
    A = cute.size(mActE, mode=[0])
    FP4 = mS1 is not None
    assert L % (32 if FP4 else VEC) == 0 and I % (32 if FP4 else VEC) == 0
    BT = token_tile(B, TOPK, E)
    moe_align_kernel(mIds, mSorted, mActE, mActStart, mActCount, mNAct, E).launch(
        grid=[1, 1, 1], block=[32, 1, 1], stream=stream)
    expert_gemv_kernel(mW1, mW3, mS1, mS3, mX, mH, mSorted, mActE, mActStart, mActCount, mNAct, L, TOPK, BT).launch(
        grid=[C.ceil_div(I, WARPS), A, 1], block=[WARPS * 32, 1, 1], stream=stream)
    BT2 = down_tile(BT, FP4)
    expert_gemv_kernel(mW2, None, mS2, None, mH, mY, mSorted, mActE, mActStart, mActCount, mNAct, I, 1, BT2).launch(
        grid=[C.ceil_div(L, WARPS), A, 1], block=[WARPS * 32, 1, 1], stream=stream)
    moe_combine_kernel(mY, mWts, mOut).launch(grid=[B, 1, 1], block=[COMBINE_THREADS, 1, 1], stream=stream)


# ---------------------------------------------------------------------------------------------- host code
def _specs(variant: str, B: int, E: int, L: int, I: int, topk: int) -> dict[str, tuple[Any, tuple[int, ...]]]:  # noqa: E741
    P, A = B * topk, min(E, B * topk)
    spec: dict[str, tuple[Any, tuple[int, ...]]] = {
        "x": (BFloat16, (B, L)), "ids": (Int32, (B, topk)), "weights": (Float32, (B, topk))}
    if variant == "mxfp4":
        spec.update({"w1": (Uint8, (E, I, L // 2)), "w3": (Uint8, (E, I, L // 2)), "w2": (Uint8, (E, L, I // 2)),
                     "s1": (Uint8, (E, I, L // 32)), "s3": (Uint8, (E, I, L // 32)), "s2": (Uint8, (E, L, I // 32))})
    else:
        spec.update({"w1": (BFloat16, (E, I, L)), "w3": (BFloat16, (E, I, L)), "w2": (BFloat16, (E, L, I))})
    spec.update({"h": (BFloat16, (P, I)), "y": (BFloat16, (P, L)), "sorted": (Int32, (P,)), "act_e": (Int32, (A,)),
                 "act_start": (Int32, (A,)), "act_count": (Int32, (A,)), "n_act": (Int32, (1,)),
                 "out": (BFloat16, (B, L))})
    return spec


_ORDER = MOE_ORDER  # = ARG_ORDER[("moe", variant)] for both variants (meta.py)


def compile_for(arch: str, *, variant: str = "bf16", B: int, E: int, L: int, I: int, topk: int,  # noqa: E741
                tvm_ffi: bool = False, remark_file: str | None = None) -> Any:
    if variant not in VARIANTS:
        raise ValueError(f"unknown moe variant {variant!r}; expected one of {VARIANTS}")
    spec = _specs(variant, B, E, L, I, topk)
    args = [dsl.fake(*spec[k]) if k in spec else None for k in _ORDER]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(moe_experts, *args, dsl.fake_stream(tvm_ffi), E, L, I, options=opts)


def launch(compiled: Any, variant: str, t: dict[str, torch.Tensor], tvm_ffi: bool = False) -> None:
    dsl.launch(compiled, [t.get(k) for k in ARG_ORDER[("moe", variant)]], tvm_ffi)


# ---------------------------------------------------------------------------------------------- per-head GEMV
# Weight absorption in MLA (spec §4.4) needs y[b, h] = W[h] · x[b, h] for every head h: a GEMV whose weight
# differs per head (q_lat = W_UK^T q_nope, o = W_UV o_lat). That is the expert GEMV above with a fixed routing
# (head h = expert h, the pair (b, h) = row b·NH + h routed to it), so no new device code is needed: this op
# launches expert_gemv_kernel (no GLU, bf16) with constant routing tables from :func:`head_routing`.
HEADS_OUTPUTS = ("out",)


@cute.jit
def head_gemv(mW: cute.Tensor, mX: cute.Tensor, mOut: cute.Tensor, mSorted: cute.Tensor, mActE: cute.Tensor,
              mActStart: cute.Tensor, mActCount: cute.Tensor, mNAct: cute.Tensor, stream: Any,
              BT: cutlass.Constexpr):
    NH, R, K = cute.size(mW, mode=[0]), cute.size(mW, mode=[1]), cute.size(mW, mode=[2])
    assert K % VEC == 0 and cute.size(mX, mode=[1]) == K and cute.size(mOut, mode=[1]) == R
    expert_gemv_kernel(mW, None, None, None, mX, mOut, mSorted, mActE, mActStart, mActCount, mNAct, K, 1, BT).launch(
        grid=[C.ceil_div(R, WARPS), NH, 1], block=[WARPS * 32, 1, 1], stream=stream)


def heads_tile(B: int) -> int:
    """Tokens per pass over a head's rows: every head sees all B tokens (token_tile with k = E = NH)."""
    return min(BATCH_TILE_CAP, 1 << (B - 1).bit_length(), B)


def _heads_specs(B: int, NH: int, R: int, K: int) -> dict[str, tuple[Any, tuple[int, ...]]]:
    return {"W": (BFloat16, (NH, R, K)), "x": (BFloat16, (B * NH, K)), "out": (BFloat16, (B * NH, R)),
            "sorted": (Int32, (B * NH,)), "act_e": (Int32, (NH,)), "act_start": (Int32, (NH,)),
            "act_count": (Int32, (NH,)), "n_act": (Int32, (1,))}




def compile_heads_for(arch: str, *, B: int, NH: int, R: int, K: int, tvm_ffi: bool = False,
                      remark_file: str | None = None) -> Any:
    """Compile the per-head GEMV for static shapes: W [NH, R, K], x [B·NH, K] -> out [B·NH, R] (bf16)."""
    spec = _heads_specs(B, NH, R, K)
    args = [dsl.fake(*spec[k]) for k in HEADS_ORDER]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(head_gemv, *args, dsl.fake_stream(tvm_ffi), heads_tile(B), options=opts)


def launch_heads(compiled: Any, t: dict[str, torch.Tensor], tvm_ffi: bool = False) -> None:
    dsl.launch(compiled, [t[k] for k in HEADS_ORDER], tvm_ffi)
