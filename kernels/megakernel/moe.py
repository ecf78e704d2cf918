"""The megakernel's routed-expert opcodes: EXPERT_GATE_UP and EXPERT_DOWN (device code), dense (bf16) or MXFP4.

Each ``op_*`` is a thin GPU-only layer (thread / warp / lane indices, shuffles, the ballot, barriers, the global
stores) around ``@cute.jit`` helpers that take the slot, expert, row, token and lane as plain integers: the slot
lists built once per instruction (``slot_expert``, ``slot_take``, ``slot_put``, ``slot_end``, ``slot_token``; the
ballot compaction is the ROUTER's, ``megakernel/router.py``), the lanes' dots (CUDA cores below batch 8:
``gate_up_tile``, ``down_tile``; tensor cores: ``dense_mma_tile``, ``fp4_mma_tile``), the weighted fp32 combine
(``down_weighted``, ``down_combine``; tensor cores: ``mma_down_add``, ``mma_down_sum``) and the element offsets of every
store. How each opcode works: its ``op_*`` docstring; design: docs/architecture.md#appendix-design-notes-by-room
(kernels/megakernel/moe.py). ``kernels/verify/host_exec_mk_moe.py`` runs the same helpers on the host over every warp
and lane, replays the thin layer in the kernel's order, and records the mma operands for ``mma.mma_reference``."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, const_expr
from kimik3.kernels.common.device import fp4_decode_pair, fp4_group_scales, x_pair_bf16x2
from kimik3.kernels.common.trace import evict_last, tracing_for_host
from kimik3.kernels.contracts import addr as mk_addr
from kimik3.kernels.contracts.addr import FP4_GROUP, FP4_GROUP_BYTES, expert_row_offset, fp4_row_offsets
from kimik3.kernels.contracts.isa import (
    R0,
    W_ARGS,
)
from kimik3.kernels.megakernel.device_fns import (
    BIG,
    NT,
    NW,
    VEC,
    bf16_round,
    chunk_mma,
    gchunks,
    gflat,
    glu,
    warp_sum,
)
from kimik3.kernels.megakernel.mma import (
    CHUNK_REGS,
    MMA_COLS,
    MMA_ROWS,
    acc_col,
    acc_row,
    lane_group,
    lane_quad,
    mma_chunk,
)
from kimik3.kernels.megakernel.operands import (
    F32_WORDS,
    I32_WORDS,
    PART_WORDS,
    _bx,
    _Ctx,
    _eoff,
    _pad32,
)
from kimik3.kernels.megakernel.router import router_round_end, router_slot_of

# Dense experts below batch 8 (CUDA cores): tokens per pass, 4 fp32 accumulators per lane (x 2 for gate and up);
# from batch 8 tensor cores (mk_addr.expert_mma), in pass groups of 8 list positions (mk_addr.expert_group_passes).
GATE_UP_TILE = 4
DOWN_TILE = 4
GATE_UP_LOADS = 4  # 16-byte chunks per lane per step of EACH of w1 and w3: 8 loads (48 KiB per CTA) in flight
DOWN_LOADS = 6  # 16-byte w2 chunks per lane per step: 6 loads (36 KiB per CTA) in flight; a k3 w2 row (384 chunks)
# is then exactly two steps, no clamped chunk
# MXFP4 (MKConfig.fp4): tensor cores (mk_mma), a warp's work item FP4_ROWS weight rows x a pass of up to 8 tokens as
# the mma's columns; per step a lane prefetches GATE_UP_BLOCKS / DOWN_BLOCKS k blocks of code groups and scale bytes
# into L1 (128 bytes per lane: 48 KiB per 12-warp CTA in flight). Its PTX per block: tests/test_mk_moe_fp4_ptx.py.
FP4_ROWS = MMA_ROWS
FP4_BLOCK_GROUPS = 4  # MXFP4 groups per k block: one per lane quad
GATE_UP_BLOCKS = 2
DOWN_BLOCKS = 4
X_CHUNKS_PER_GROUP = FP4_GROUP // VEC  # 16-byte x chunks of one MXFP4 group (one per 8-code word)


def expert_mma(cfg: Any) -> bool:
    """Whether the expert opcodes run on tensor cores (``mk_addr.expert_mma``: MXFP4, or dense from batch 8)."""
    return mk_addr.expert_mma(cfg.B, cfg.fp4)


def gate_up_pass(cfg: Any) -> int:
    """Tokens per pass of EXPERT_GATE_UP for the config's batch and expert format (tensor cores: the mma's 8
    columns)."""
    return min(cfg.B, MMA_COLS if expert_mma(cfg) else GATE_UP_TILE)


def down_pass(cfg: Any) -> int:
    """Tokens per pass of EXPERT_DOWN (as :func:`gate_up_pass`)."""
    return min(cfg.B, MMA_COLS if expert_mma(cfg) else DOWN_TILE)


def mma_passes(cfg: Any, op: str) -> int:
    """Passes of 8 list positions per tensor-core work item of ``op`` ("gate_up", "down"; ``mk_addr``)."""
    return mk_addr.expert_group_passes(cfg.B, op, cfg.fp4)


def mma_groups(n: Any, P: int) -> Any:
    """Pass groups of a tensor-core item loop over a list of n tokens (``mk_addr.expert_groups``)."""
    return mk_addr.expert_groups(n, P)


def mma_pos(grp: Any, p: int, col: Any, P: int) -> Any:
    """List position of column col of pass p of pass group grp (``mk_addr.gemv_group_row`` over list positions)."""
    return mk_addr.gemv_group_row(grp, p, col, P)


def row_tile(cfg: Any) -> int:
    """Weight rows of a warp's work item in both expert opcodes: 1 (CUDA cores), FP4_ROWS (tensor cores); item k of
    warp w starts at row r0 + (w + k·NW)·rows of the instruction's box."""
    return FP4_ROWS if expert_mma(cfg) else 1


def slot_lists(cfg: Any) -> tuple[int, int, int]:
    """Scratch layout of the slot lists: s_i32[EXP + jj] the expert of slot s0 + jj (-1: none), s_i32[CNT + jj] its
    token count, s_i32[TOK + jj·B + p] its p-th token (ascending); EXPERT_DOWN's weights at s_f32[jj·B + p]."""
    dp = _pad32(cfg.dmax)
    return 0, dp, 2 * dp


@cute.jit
def slot_expert(ctx: _Ctx, j: Int32) -> Int32:
    """The expert in slot j (-1: slot unused; slots are filled from the front), from the selection (operand 1)."""
    sel = gflat(Int64, ctx.s_addr[1])
    return Int32(sel[_eoff(ctx.s_d1[1], ctx.s_d2[1], Int32(0), Int32(0), j)])


@cute.jit
def slot_used(ctx: _Ctx, b: Int32, j: Int32) -> Any:
    """Whether token b routes to slot j (the use flags, operand 2)."""
    use = gflat(Uint8, ctx.s_addr[2])
    return use[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), j)] != Uint8(0)


@cute.jit
def slot_take(ctx: _Ctx, b: Int32, j: Int32, e: Int32) -> Int32:
    """1 when token b (< B) uses slot j and the slot holds an expert (e >= 0), else 0 (flags read for real tokens)."""
    u = Int32(0)
    if b < ctx.cfg.B:
        if e >= 0:
            if slot_used(ctx, b, j):
                u = Int32(1)
    return u


@cute.jit
def slot_put(ctx: _Ctx, jj: Int32, p: Int32, b: Int32, j: Int32, WEIGHTS: cutlass.Constexpr) -> None:
    """Token b is the p-th token of slot j (list jj); with WEIGHTS its router weight (operand 3) goes next to it."""
    _, _, TOK = slot_lists(ctx.cfg)
    B = ctx.cfg.B
    ctx.s_i32[TOK + jj * B + p] = b
    if const_expr(WEIGHTS):
        mw = gflat(Float32, ctx.s_addr[3])
        ctx.s_f32[jj * B + p] = mw[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), j)]


@cute.jit
def slot_end(ctx: _Ctx, jj: Int32, n: Int32, e: Int32) -> None:
    """List jj complete: its expert and token count."""
    EXP, CNT, _ = slot_lists(ctx.cfg)
    ctx.s_i32[EXP + jj] = e
    ctx.s_i32[CNT + jj] = n


@cute.jit
def slot_token(ctx: _Ctx, jj: Int32, p: Int32) -> Int32:
    """The p-th token of list jj."""
    _, _, TOK = slot_lists(ctx.cfg)
    return ctx.s_i32[TOK + jj * ctx.cfg.B + p]


@cute.jit
def _build_slot_lists(ctx: _Ctx, s0: Int32, s1: Int32, WEIGHTS: cutlass.Constexpr) -> None:
    """One warp per slot of [s0, s1): its expert id, the use flags of every token (one 1-byte load per lane per
    32 tokens, all independent), compacted with ballots into the ascending token list; then one barrier."""
    cfg = ctx.cfg
    EXP, CNT, TOK = slot_lists(cfg)
    assert TOK + cfg.dmax * cfg.B <= I32_WORDS and cfg.dmax * cfg.B <= F32_WORDS, (
        f"expert slot lists: {cfg.dmax} slots x batch {cfg.B} need {TOK + cfg.dmax * cfg.B} int32 scratch words, "
        f"the CTA has {I32_WORDS}")
    APL = -(-cfg.B // 32)
    for j in cutlass.range(s0 + ctx.warp, s1, NW, unroll=1):
        e = slot_expert(ctx, j)
        base = Int32(0)
        for m in cutlass.range_constexpr(APL):
            b = ctx.lane + 32 * m
            u = slot_take(ctx, b, j, e)
            bal = cute.arch.vote_ballot_sync(u != 0)
            p = router_slot_of(base, bal, cute.arch.lanemask_lt())
            if u != 0:
                slot_put(ctx, j - s0, p, b, j, WEIGHTS)
            base = router_round_end(base, bal)
        if ctx.lane == 0:
            slot_end(ctx, j - s0, base, e)
    cute.arch.sync_threads()


@cute.jit
def _dot8(w: Any, x: Any, ok: Any) -> Float32:
    """One chunk's 8-term dot (fp32 FMA chain), 0 when ``ok`` is false (a clamped chunk past the row's end)."""
    wf = w.load().to(Float32)
    s = wf[0] * x[0]
    for k in cutlass.range_constexpr(1, VEC):
        s = s + wf[k] * x[k]
    return s if ok else Float32(0.0)


@cute.jit
def fp4_row(ctx: _Ctx, jc: cutlass.Constexpr, js: cutlass.Constexpr, e: Int32, r: Any) -> tuple[Any, Any]:
    """Row r of expert e of an MXFP4 weight (codes operand jc, scales operand js): its 16-byte code groups as
    ``[group, 4]`` uint32 (``v[(g, None)]``: one load of 32 codes, word j = columns 8j .. 8j + 7) and its scale bytes
    as ``[group, 1]``."""
    co, so = fp4_row_offsets(ctx.s_d1[jc], ctx.s_d2[jc], ctx.s_d1[js], ctx.s_d2[js], e, r, Int64)
    codes = cute.make_tensor(cute.make_ptr(Uint32, ctx.s_addr[jc] + co, cute.AddressSpace.gmem, assumed_align=16),
                             cute.make_layout((BIG // FP4_GROUP_BYTES, 4), stride=(4, 1)))
    scales = cute.make_tensor(cute.make_ptr(Uint8, ctx.s_addr[js] + so, cute.AddressSpace.gmem, assumed_align=1),
                              cute.make_layout((BIG, 1), stride=(1, 1)))
    return codes, scales


@cute.jit
def gate_up_rows(ctx: _Ctx, e: Int32, r: Int32) -> tuple[Any, Any]:
    """Row r of expert e's gate (w1, operand 3) and up (w3, operand 4) projections, as 16-byte chunks (dense
    experts; MXFP4: :func:`fp4_tile_rows` of operands 3, 6 and 4, 7)."""
    wg = gchunks(ctx.s_addr[3] + expert_row_offset(ctx.s_d1[3], ctx.s_d2[3], e, r, Int64) * 2)
    wu = gchunks(ctx.s_addr[4] + expert_row_offset(ctx.s_d1[4], ctx.s_d2[4], e, r, Int64) * 2)
    return wg, wu


@cute.jit
def gate_up_dims(ctx: _Ctx) -> tuple[Int32, Int32]:
    """(chunks from one token's input row to the next (operand 0), chunks per weight row (operand 3); MXFP4: code
    groups per row)."""
    per = FP4_GROUP_BYTES if const_expr(ctx.cfg.fp4) else VEC
    return ctx.s_d1[0] * ctx.s_d2[0] // VEC, ctx.s_d2[3] // per


@cute.jit
def gate_up_x(ctx: _Ctx, jj: Int32, p: Int32, xs: Int32) -> Int32:
    """Chunk offset of the input row (operand 0) of the p-th token of list jj."""
    return slot_token(ctx, jj, p) * xs


@cute.jit
def fp4_tile_rows(ctx: _Ctx, jc: cutlass.Constexpr, js: cutlass.Constexpr, e: Int32, rt: Any, lane: Any
                  ) -> tuple[Any, Any]:
    """The lane's two rows of the 16-row work item from row ``rt`` of expert e's MXFP4 weight (codes operand jc,
    scales js): rows rt + g and rt + g + 8 as :func:`fp4_row` views. A row past the box's end (``W_ARGS + 3``)
    reads the box's last row instead (in-bounds, straight-line); its results are not stored."""
    r1 = ctx.s_ins[W_ARGS + 3]
    g = lane_group(lane)
    return (fp4_row(ctx, jc, js, e, cutlass.min(rt + g, r1 - 1)),
            fp4_row(ctx, jc, js, e, cutlass.min(rt + g + 8, r1 - 1)))


@cute.jit
def _mma_device(acc: cute.Tensor, wg: cute.Tensor, wg8: cute.Tensor, xg: cute.Tensor, step: Any) -> None:
    """The tensor-core step of :func:`fp4_mma_tile` on the GPU (the host execution records the registers instead)."""
    mma_chunk(acc, wg, wg8, xg)


@cute.jit
def _fp4_block(ld_w: Any, ld_s: Any, w: Any, gi: Any, keep: Any, xr: list, acc: cute.Tensor, mma: Any, step0: Any,
               NB: cutlass.Constexpr) -> None:
    """One k block of one weight for one lane: group gi of its rows g and g + 8 (one 16-byte code load and one scale
    byte each, L1 hits after the step's prefetch), each of the group's 4 code words decoded to bf16x2 registers
    (``fp4_group_scales`` once, ``fp4_decode_pair`` per word: exact E2M1 · 2^(e - 127), pair order; a scale byte
    above 128 in either row, never written by quantisation, takes the branch that multiplies by ``fp4_scale_hi``) and
    stepped with the x registers ``xr[j]`` of the same 32 columns in the same order (``mma_chunk``: two mma.sync).
    ``keep`` (uint32 all ones / 0) zeroes the scales of a group past the row's end (read at the last group)."""
    (cg, sg), (c8, s8) = w
    rc = cute.make_rmem_tensor((X_CHUNKS_PER_GROUP, 2), Uint32)
    rs = cute.make_rmem_tensor((1, 2), Uint8)
    cute.copy(ld_w, cg[(gi, None)], rc[None, 0])
    cute.copy(ld_w, c8[(gi, None)], rc[None, 1])
    cute.copy(ld_s, sg[(gi, None)], rs[None, 0])
    cute.copy(ld_s, s8[(gi, None)], rs[None, 1])
    scales = fp4_group_scales(rs[0, 0], rs[0, 1], keep)
    for j in cutlass.range_constexpr(X_CHUNKS_PER_GROUP):
        wg, wg8 = fp4_decode_pair(rc[j, 0], rc[j, 1], rs[0, 0], rs[0, 1], scales)
        mma(acc, wg, wg8, xr[j], step0 + j * NB)


@cute.jit
def fp4_mma_tile(ctx: _Ctx, xv: Any, xs: Int32, ngr: Int32, wa: Any, wb: Any, jj: Int32, t0: Int32, n: Int32,
                 acc_a: cute.Tensor, acc_b: Any, U: cutlass.Constexpr, DOWN: cutlass.Constexpr, lane: Any,
                 mma: Any = None) -> None:
    """MXFP4 on tensor cores: one lane's share of a 16-row x 8-token work item. ``wa`` (and ``wb``, or None) are the
    lane's rows g, g + 8 (:func:`fp4_tile_rows`) of a weight of ``ngr`` groups; the 8 mma columns are the list
    positions t0 .. t0 + 7 of list jj (``DOWN``: the hidden rows [b, slot jj], else the input rows). The accumulator
    fragments ``acc_a`` (``acc_b``) end holding rows ``acc_row(lane, i)``, positions t0 + ``acc_col(lane, i)``.

    K layout: per k block of FP4_BLOCK_GROUPS groups (128 columns) lane (g, q) takes group q, so the physical k of
    every register depends on q only, as ``mma.sync`` needs (A rows g and g + 8 and B column g share it). Column g is
    the token at position t0 + g, clamped to the list's last (n - 1): an absent column reads a real x row, and only
    reaches accumulator column g, which is not stored. Groups past the row's end (the last block of a row whose
    group count is not a multiple of 4) are read at the last group with scale 0. Per step the lane prefetches U
    blocks' code groups and scale bytes into L1 (no registers held while they land), then works block by block.

    ``mma``: the step ``mma(acc, wg, wg8, xg, step)`` (default: ``mma_chunk`` on the GPU; the host execution passes a
    recorder and evaluates ``mk_mma.mma_reference`` itself); ``step`` = (block·4 + word)·NB + weight (NB = 2 with
    ``wb``)."""
    if const_expr(mma is None):
        mma = _mma_device
    NB = 1 if const_expr(wb is None) else 2
    q = lane_quad(lane)
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128, invariant=True)
    ld_s = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=8, invariant=True)
    if const_expr(DOWN):  # as the dense tiles: the latent input is kept in L1, the hidden rows are not
        ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    else:
        ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, **evict_last())
    p = cutlass.min(t0 + lane_group(lane), n - 1)
    xr0 = down_x(ctx, jj, p, xs) if const_expr(DOWN) else gate_up_x(ctx, jj, p, xs)
    acc_a.fill(0.0)
    if const_expr(wb is not None):
        acc_b.fill(0.0)
    rx = cute.make_rmem_tensor((VEC, X_CHUNKS_PER_GROUP), BFloat16)
    nblk = (ngr + FP4_BLOCK_GROUPS - 1) // FP4_BLOCK_GROUPS
    for it in cutlass.range((nblk + U - 1) // U, unroll=1):
        if const_expr(not tracing_for_host()):  # (a cache hint: no effect on any value, nothing on the host)
            for up in cutlass.range_constexpr(U):
                gp = cutlass.min((it * U + up) * FP4_BLOCK_GROUPS + q, ngr - 1)
                views = (*wa[0], *wa[1]) if const_expr(wb is None) else (*wa[0], *wa[1], *wb[0], *wb[1])
                for view in views:
                    cute.arch.prefetch(view[(gp, None)].iterator.llvm_ptr, cache_level="L1")
        for u in cutlass.range(U, unroll=1):  # a loop: one block's registers live at a time
            kb = it * U + u
            if kb < nblk:  # warp-uniform
                gq = kb * FP4_BLOCK_GROUPS + q
                gi = cutlass.min(gq, ngr - 1)
                keep = Uint32(~((ngr - 1 - gq) >> 31))  # all ones while the group is in the row, else 0
                for j in cutlass.range_constexpr(X_CHUNKS_PER_GROUP):
                    cute.copy(ld_x, xv[(xr0 + gi * X_CHUNKS_PER_GROUP + j, None)], rx[None, j])
                xr = []
                for j in cutlass.range_constexpr(X_CHUNKS_PER_GROUP):
                    xr.append(x_pair_bf16x2(rx[None, j], j))
                step0 = kb * (FP4_BLOCK_GROUPS * NB)
                _fp4_block(ld_w, ld_s, wa, gi, keep, xr, acc_a, mma, step0, NB)
                if const_expr(wb is not None):
                    _fp4_block(ld_w, ld_s, wb, gi, keep, xr, acc_b, mma, step0 + 1, NB)


@cute.jit
def gate_up_tile(ctx: _Ctx, xv: Any, xs: Int32, nch: Int32, wg: Any, wu: Any, jj: Int32, t0: Int32, n: Int32,
                 ag: cute.Tensor, au: cute.Tensor, lane: Any = None) -> None:
    """CUDA cores: a lane's partial dots of the gate and up rows with tokens t0 .. t0 + T - 1 of list jj (those below
    n): ``ag[t]``, ``au[t]``; GATE_UP_LOADS chunks of each row in flight per step (past the row's end: its last, 0)."""
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    T, U = cute.size(ag), GATE_UP_LOADS
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, **evict_last())
    ag.fill(0.0)
    au.fill(0.0)
    nt = n - t0
    rg = cute.make_rmem_tensor((VEC, U), BFloat16)
    ru = cute.make_rmem_tensor((VEC, U), BFloat16)
    rx = cute.make_rmem_tensor((VEC, U), BFloat16)
    for it in cutlass.range((nch + 32 * U - 1) // (32 * U), unroll=1):
        c = it * (32 * U) + lane
        for u in cutlass.range_constexpr(U):
            cute.copy(ld_w, wg[(cutlass.min(c + 32 * u, nch - 1), None)], rg[None, u])
            cute.copy(ld_w, wu[(cutlass.min(c + 32 * u, nch - 1), None)], ru[None, u])
        for t in cutlass.range_constexpr(T):
            if t < nt:  # the token's row from the list in smem (registers go to the loads in flight)
                xo = gate_up_x(ctx, jj, t0 + t, xs)
                for u in cutlass.range_constexpr(U):
                    cute.copy(ld_x, xv[(xo + cutlass.min(c + 32 * u, nch - 1), None)], rx[None, u])
                g, h = ag[t], au[t]
                for u in cutlass.range_constexpr(U):
                    x = rx[None, u].load().to(Float32)
                    g = g + _dot8(rg[None, u], x, c + 32 * u < nch)
                    h = h + _dot8(ru[None, u], x, c + 32 * u < nch)
                ag[t] = g
                au[t] = h


@cute.jit
def gate_up_out(ctx: _Ctx, b: Int32, j: Int32, r: Int32) -> Int64:
    """Element offset of the hidden activation [b, slot j, row r] (operand 5)."""
    return _eoff(ctx.s_d1[5], ctx.s_d2[5], b, j, r)


@cute.jit
def mma_gate_up_out(ctx: _Ctx, s0: Int32, jj: Int32, t0: Int32, n: Int32, rt: Any, lane: Any,
                    i: cutlass.Constexpr) -> Int64:
    """MXFP4: the element offset of the hidden activation held by accumulator register i of ``lane`` after the work
    item (rows from rt, list positions from t0): row rt + ``acc_row``, the token at position t0 + ``acc_col``;
    -1 (not stored) past the list's end or the box's last row."""
    r = rt + acc_row(lane, i)
    p = t0 + acc_col(lane, i)
    off = Int64(-1)
    if p < n:
        if r < ctx.s_ins[W_ARGS + 3]:
            off = gate_up_out(ctx, slot_token(ctx, jj, p), s0 + jj, r)
    return off


@cute.jit
def op_expert_gate_up(ctx: _Ctx) -> None:
    """EXPERT_GATE_UP: the hidden activations h = SiTU-GLU(x·w1ᵀ, x·w3ᵀ) of rows [r0, r1) of slots [s0, s1) for the
    tokens routed to each slot; a prologue lists every slot's expert and tokens once per instruction
    (``_build_slot_lists``).

    Dense experts below batch 8: CUDA cores, one weight row (of w1 and of w3) per warp, each lane dotting its chunks
    with every token of a pass (``gate_up_rows``, ``gate_up_tile``); warp sums, lane 0 applies SiTU-GLU and stores.
    Otherwise tensor cores (``mma.sync.m16n8k16``, ``megakernel/mma.py``): 16 rows of w1 and of w3 x the slot's list
    positions as the mma's columns, in pass groups for dense experts (``dense_mma_tile``), one pass for MXFP4
    (``fp4_tile_rows``, ``fp4_mma_tile``: the codes decoded exactly to bf16, the x values in the same pair order); the
    epilogue applies SiTU-GLU per (row, token) on the fragments (``mma_gate_up_out``); how each path streams:
    docs/architecture.md#appendix-design-notes-by-room (kernels/megakernel/moe.py). Known limits: no stage (the
    expert is data); a slot with more tokens than a group re-reads its rows; MXFP4 pays its decode per pass (bounded
    by tests/test_mk_moe_fp4_ptx.py)."""
    if const_expr(expert_mma(ctx.cfg)):
        _op_expert_gate_up_mma(ctx)
    else:
        _op_expert_gate_up_dense(ctx)


@cute.jit
def _op_expert_gate_up_dense(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    T = gate_up_pass(cfg)
    EXP, CNT, _ = slot_lists(cfg)
    s0, s1, r0, r1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    _build_slot_lists(ctx, s0, s1, False)
    xv = gchunks(ctx.s_addr[0])
    xs, nch = gate_up_dims(ctx)
    out = gflat(BFloat16, ctx.s_addr[5])
    ag = cute.make_rmem_tensor((T,), Float32)
    au = cute.make_rmem_tensor((T,), Float32)
    for jj in cutlass.range(s1 - s0, unroll=1):
        n = ctx.s_i32[CNT + jj]
        if n > 0:
            e = ctx.s_i32[EXP + jj]
            for r in cutlass.range(r0 + ctx.warp, r1, NW, unroll=1):
                wg, wu = gate_up_rows(ctx, e, r)
                for t0 in cutlass.range(0, n, T, unroll=1):
                    gate_up_tile(ctx, xv, xs, nch, wg, wu, jj, t0, n, ag, au)
                    for t in cutlass.range_constexpr(T):
                        if t0 + t < n:
                            h = glu(bf16_round(warp_sum(ag[t])), bf16_round(warp_sum(au[t])), cfg.situ,
                                    cfg.situ_beta, cfg.situ_lin)
                            if ctx.lane == 0:
                                out[gate_up_out(ctx, slot_token(ctx, jj, t0 + t), s0 + jj, r)] = h.to(BFloat16)


@cute.jit
def expert_base(ctx: _Ctx, j: cutlass.Constexpr, e: Int32) -> Int64:
    """Byte address of row 0 of expert e of the dense expert weight operand j."""
    return ctx.s_addr[j] + expert_row_offset(ctx.s_d1[j], ctx.s_d2[j], e, Int32(0), Int64) * 2


@cute.jit
def dense_mma_tile(ctx: _Ctx, j: cutlass.Constexpr, e: Int32, rt: Any, xv: Any, xs: Int32, nch: Int32, xrow: Any,
                   jj: Int32, t0: Any, n: Int32, acc: cute.Tensor, U: cutlass.Constexpr, lane: Any,
                   sink: Any = None) -> None:
    """Dense experts on tensor cores: ``acc`` (4, P) the C fragments of rows rt .. rt + 15 of expert e's weight operand
    j (rows past the box's end read at its last, never stored) x pass p's columns, the positions ``t0 + 8p + col`` of
    list jj (x row at chunk ``xrow(ctx, jj, position, xs)``; a position at or past n read at n - 1, never stored).
    Lane (g, q) takes chunk ``4·kb + q`` of its rows and its column's x row per k block kb; as ``fp4_mma_tile`` a step
    prefetches U blocks into L1, then runs them one at a time (one block's registers live), two mma.sync per pass and
    block (``device_fns.chunk_mma``; ``sink``, host execution: pass p's block kb at ``sink[kb·P + p, :]``). A chunk
    past the row's end is read at its last chunk with its x zeroed."""
    P = cute.size(acc, mode=[1])
    r1 = ctx.s_ins[W_ARGS + 3]
    g, q = lane_group(lane), lane_quad(lane)
    base = expert_base(ctx, j, e)
    wa = gchunks(base + Int64(cutlass.min(rt + g, r1 - 1)) * Int64(nch) * 16)
    wb = gchunks(base + Int64(cutlass.min(rt + g + MMA_ROWS // 2, r1 - 1)) * Int64(nch) * 16)
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    acc.fill(0.0)
    nkb = (nch + 3) // 4
    for it in cutlass.range((nkb + U - 1) // U, unroll=1):
        if const_expr(not tracing_for_host()):  # (a cache hint: no effect on any value, nothing on the host)
            for up in cutlass.range_constexpr(U):
                cp = cutlass.min((it * U + up) * 4 + q, nch - 1)
                cute.arch.prefetch(wa[(cp, None)].iterator.llvm_ptr, cache_level="L1")
                cute.arch.prefetch(wb[(cp, None)].iterator.llvm_ptr, cache_level="L1")
        for u in cutlass.range(U, unroll=1):
            kb = it * U + u
            if kb < nkb:  # warp-uniform
                c = kb * 4 + q
                cc = cutlass.min(c, nch - 1)
                rw = cute.make_rmem_tensor((VEC, 2), BFloat16)
                cute.copy(ld_w, wa[(cc, None)], rw[None, 0])
                cute.copy(ld_w, wb[(cc, None)], rw[None, 1])
                uw = cute.recast_tensor(rw, Uint32)
                for p in cutlass.range_constexpr(P):
                    rx = cute.make_rmem_tensor((VEC,), BFloat16)
                    cute.copy(ld_x, xv[(xrow(ctx, jj, cutlass.min(t0 + g + p * MMA_COLS, n - 1), xs) + cc, None)], rx)
                    ux = cute.recast_tensor(rx, Uint32)
                    for i in cutlass.range_constexpr(CHUNK_REGS):
                        ux[i] = ux[i] if c < nch else Uint32(0)
                    chunk_mma(acc[None, p], uw[None, 0], uw[None, 1], ux, sink, kb * P + p)


@cute.jit
def _op_expert_gate_up_mma(ctx: _Ctx) -> None:
    """Tensor cores: work items of 16 rows (the same rows of w1 and w3) x a group of passes of the slot's list
    positions per warp; the epilogue applies SiTU-GLU to the (gate, up) accumulators of the same (row, token) that the
    lane holds and stores h."""
    cfg = ctx.cfg
    EXP, CNT, _ = slot_lists(cfg)
    P = mma_passes(cfg, "gate_up")
    s0, s1, r0, r1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    _build_slot_lists(ctx, s0, s1, False)
    xv = gchunks(ctx.s_addr[0])
    xs, nk = gate_up_dims(ctx)
    out = gflat(BFloat16, ctx.s_addr[5])
    ag = cute.make_rmem_tensor((4, P), Float32)
    au = cute.make_rmem_tensor((4, P), Float32)
    lane = ctx.lane
    for jj in cutlass.range(s1 - s0, unroll=1):
        n = ctx.s_i32[CNT + jj]
        if n > 0:
            e = ctx.s_i32[EXP + jj]
            for rt in cutlass.range(r0 + ctx.warp * FP4_ROWS, r1, NW * FP4_ROWS, unroll=1):
                if const_expr(cfg.fp4):
                    wg, wu = fp4_tile_rows(ctx, 3, 6, e, rt, lane), fp4_tile_rows(ctx, 4, 7, e, rt, lane)
                for grp in cutlass.range(mma_groups(n, P), unroll=1):
                    t0 = mma_pos(grp, 0, 0, P)
                    if const_expr(cfg.fp4):
                        fp4_mma_tile(ctx, xv, xs, nk, wg, wu, jj, t0, n, ag[None, 0], au[None, 0], GATE_UP_BLOCKS,
                                     False, lane)
                    else:
                        U = mk_addr.EXPERT_MMA_BLOCKS
                        dense_mma_tile(ctx, 3, e, rt, xv, xs, nk, gate_up_x, jj, t0, n, ag, U, lane)
                        dense_mma_tile(ctx, 4, e, rt, xv, xs, nk, gate_up_x, jj, t0, n, au, U, lane)
                    for p in cutlass.range_constexpr(P):
                        for i in cutlass.range_constexpr(4):
                            off = mma_gate_up_out(ctx, s0, jj, mma_pos(grp, p, 0, P), n, rt, lane, i)
                            if off >= 0:
                                h = glu(bf16_round(ag[i, p]), bf16_round(au[i, p]), cfg.situ, cfg.situ_beta,
                                        cfg.situ_lin)
                                out[off] = h.to(BFloat16)


@cute.jit
def down_row(ctx: _Ctx, e: Int32, r: Int32) -> Any:
    """Row r of expert e's down projection (w2, operand 4), as 16-byte chunks (dense experts; MXFP4:
    :func:`fp4_tile_rows` of operands 4 and 6)."""
    wv = gchunks(ctx.s_addr[4] + expert_row_offset(ctx.s_d1[4], ctx.s_d2[4], e, r, Int64) * 2)
    return wv


@cute.jit
def down_dims(ctx: _Ctx) -> tuple[Int32, Int32]:
    """(chunks per (token, slot) row of the expert hidden buffer (operand 0), chunks per w2 row (operand 4); MXFP4:
    code groups per row)."""
    per = FP4_GROUP_BYTES if const_expr(ctx.cfg.fp4) else VEC
    return ctx.s_d2[0] // VEC, ctx.s_d2[4] // per


@cute.jit
def down_x(ctx: _Ctx, j: Int32, p: Int32, hs: Int32) -> Int32:
    """Chunk offset of the hidden row [b, slot j] (operand 0) of the p-th token b of slot j's list."""
    b = slot_token(ctx, j, p)
    return (b * ctx.s_d1[0] + j) * hs


@cute.jit
def down_tile(ctx: _Ctx, hv: Any, hs: Int32, nch: Int32, wv: Any, j: Int32, t0: Int32, n: Int32, a: cute.Tensor,
              lane: Any = None) -> None:
    """CUDA cores: a lane's partial dots of the down row with the hidden rows [b, slot j] (operand 0) of tokens t0 ..
    t0 + T - 1 of slot j's list (those below n): ``a[t]``; DOWN_LOADS w2 chunks in flight, clamped as gate_up_tile."""
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    T, U = cute.size(a), DOWN_LOADS
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    a.fill(0.0)
    nt = n - t0
    rw = cute.make_rmem_tensor((VEC, U), BFloat16)
    rx = cute.make_rmem_tensor((VEC, U), BFloat16)
    for it in cutlass.range((nch + 32 * U - 1) // (32 * U), unroll=1):
        c = it * (32 * U) + lane
        for u in cutlass.range_constexpr(U):
            cute.copy(ld_w, wv[(cutlass.min(c + 32 * u, nch - 1), None)], rw[None, u])
        for t in cutlass.range_constexpr(T):
            if t < nt:
                ho = down_x(ctx, j, t0 + t, hs)
                for u in cutlass.range_constexpr(U):
                    cute.copy(ld_x, hv[(ho + cutlass.min(c + 32 * u, nch - 1), None)], rx[None, u])
                s = a[t]
                for u in cutlass.range_constexpr(U):
                    s = s + _dot8(rw[None, u], rx[None, u].load().to(Float32), c + 32 * u < nch)
                a[t] = s


@cute.jit
def down_weighted(ctx: _Ctx, dot: Float32, j: Int32, p: Int32) -> Float32:
    """The expert's output for the p-th token of slot j (its summed dot, rounded to bf16 as the reference's
    activation dtype) times its router weight (operand 3, kept next to the token by the prologue), in fp32."""
    return bf16_round(dot) * ctx.s_f32[j * ctx.cfg.B + p]


@cute.jit
def down_combine(acc: cute.Tensor, y: Float32, b: Int32, first: Any, STRIDE: cutlass.Constexpr = 32) -> None:
    """The fp32 combine: acc[m] keeps token first + STRIDE·m (dense: lane l keeps tokens l, l + 32, ...); token b's
    weighted output goes to its owner."""
    for m in cutlass.range_constexpr(cute.size(acc)):
        acc[m] = acc[m] + (y if first + STRIDE * m == b else Float32(0.0))


@cute.jit
def down_out(ctx: _Ctx, b: Int32, r: Int32) -> Int64:
    """Element offset of the combined output [b, 0, r] (operand 5); on a rank of several, [b, rank, r] of the latent
    sum's mailbox (its box's row)."""
    row = Int32(0)
    if const_expr(ctx.cfg.ranks):
        row = _bx(ctx, 5, R0)
    return _eoff(ctx.s_d1[5], ctx.s_d2[5], b, row, r)


@cute.jit
def down_store(ctx: _Ctx, off: Int64, v: Float32) -> None:
    """One combined output element: bf16 into the latent sum, or on a rank of several the fp32 partial the ranks
    sum in FFN_OUT (kernels/contracts/peers.py: the latent-space combine)."""
    if const_expr(ctx.cfg.ranks):
        gflat(Float32, ctx.s_addr[5])[off] = v
    else:
        gflat(BFloat16, ctx.s_addr[5])[off] = v.to(BFloat16)


@cute.jit
def mma_down_out(ctx: _Ctx, rt: Any, r: Any, b: Any) -> Int64:
    """Tensor cores: the element offset of the combined output of row rt + r (of a 16-row tile) and token b, -1 (not
    stored) past the box's last row."""
    off = Int64(-1)
    if rt + r < ctx.s_ins[W_ARGS + 3]:
        off = down_out(ctx, b, rt + r)
    return off


@cute.jit
def op_expert_down(ctx: _Ctx) -> None:
    """EXPERT_DOWN: the combined expert output y[b, r] = Σ_slots w_slot · (h_slot · w2ᵀ)[r] of rows [r0, r1) for every
    token, the router weights listed next to the tokens by the prologue (``_build_slot_lists``).

    Dense experts below batch 8: CUDA cores, one w2 row per warp dotted with the hidden rows of each used slot's tokens
    per pass (``down_row``, ``down_tile``); each warp sum, bf16-rounded and router-weighted (``down_weighted``), is
    accumulated in fp32 by the lane that keeps the token (``down_combine``); one bf16 store.

    Tensor cores otherwise: 16-row work items as EXPERT_GATE_UP's (dense: ``dense_mma_tile`` in pass groups; MXFP4:
    ``fp4_mma_tile``), spread over every warp (``mma_down_split``): the G warps of a 16-row tile split the used slots,
    each adding every accumulator register, router-weighted, to its own fp32 region of the instruction's stage buffer
    (``ctx.s_part``, ``mma_down_add``: no shuffles, no combine registers); after a barrier the members' regions are
    summed in member order (``mma_down_sum``) and stored (``mma_down_out``). Known limits: no stage (data-dependent
    expert; its stage buffer is the combine's); rows re-read per extra group of an expert's tokens."""
    if const_expr(expert_mma(ctx.cfg)):
        _op_expert_down_mma(ctx)
    else:
        _op_expert_down_dense(ctx)


@cute.jit
def _op_expert_down_dense(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    T = down_pass(cfg)
    EXP, CNT, _ = slot_lists(cfg)
    APL = -(-cfg.B // 32)
    r0, r1 = ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    _build_slot_lists(ctx, Int32(0), Int32(cfg.dmax), True)
    hv = gchunks(ctx.s_addr[0])
    hs, nch = down_dims(ctx)
    a = cute.make_rmem_tensor((T,), Float32)
    acc = cute.make_rmem_tensor((APL,), Float32)
    for r in cutlass.range(r0 + ctx.warp, r1, NW, unroll=1):
        acc.fill(0.0)
        for j in cutlass.range(cfg.dmax, unroll=1):
            n = ctx.s_i32[CNT + j]
            if n > 0:
                wv = down_row(ctx, ctx.s_i32[EXP + j], r)
                for t0 in cutlass.range(0, n, T, unroll=1):
                    down_tile(ctx, hv, hs, nch, wv, j, t0, n, a)
                    for t in cutlass.range_constexpr(T):
                        if t0 + t < n:
                            y = down_weighted(ctx, warp_sum(a[t]), j, t0 + t)
                            down_combine(acc, y, slot_token(ctx, j, t0 + t), ctx.lane)
        for m in cutlass.range_constexpr(APL):
            b = ctx.lane + 32 * m
            if b < cfg.B:
                down_store(ctx, down_out(ctx, b, r), acc[m])


def mma_down_part_words(cfg: Any) -> int:
    """Tensor-core EXPERT_DOWN combines in the instruction's own stage buffer as fp32 ``ctx.s_part`` (the host never
    stages an EXPERT_DOWN: ``isa.STAGE_SCRATCH_OPS``): warp w's region is s_part[w·W + r·B + b] for row r of its
    16-row tile and token b. Returns W = 16·B (12 warps' regions: 48 KiB at B = 64)."""
    assert NW * MMA_ROWS * cfg.B <= PART_WORDS, f"EXPERT_DOWN's combine regions need {NW * MMA_ROWS * cfg.B} words"
    return MMA_ROWS * cfg.B


@cute.jit
def mma_down_split(ctx: _Ctx) -> tuple[Int32, Int32]:
    """EXPERT_DOWN's work split over the CTA's warps: (row tiles of the box, warps per tile G). Warp w takes row tile
    w % ntiles (then + NW, ... when the box has more tiles than warps: G = 1) as member m = w // ntiles of its tile's
    G = NW // ntiles warps (members m >= G idle) and, of every tile it takes, the slots m, m + G, ..."""
    ntiles = (ctx.s_ins[W_ARGS + 3] - ctx.s_ins[W_ARGS + 2] + FP4_ROWS - 1) // FP4_ROWS
    return ntiles, cutlass.max(NW // cutlass.max(ntiles, 1), 1)


@cute.jit
def mma_down_add(ctx: _Ctx, w: Any, v: Float32, j: Any, p: Any, n: Any, lane: Any, i: cutlass.Constexpr) -> None:
    """Accumulator register i (value ``v``) of ``lane``, its column at list position p of slot j, rounded to bf16 and
    router-weighted (``down_weighted``), added in fp32 to warp w's region at (row ``acc_row(lane, i)``, the token);
    nothing past the list's end. A list holds a token once, so within a slot no two lanes share a (row, token)."""
    part = ctx.s_part  # (a name of its own: the branch writes through it, not through ctx)
    if p < n:
        k = w * mma_down_part_words(ctx.cfg) + acc_row(lane, i) * ctx.cfg.B + slot_token(ctx, j, p)
        part[k] = part[k] + down_weighted(ctx, v, j, p)


@cute.jit
def mma_down_sum(ctx: _Ctx, t: Any, k: Any, ntiles: Any, g: Any) -> Float32:
    """Element k (row k // B, token k % B) of row tile t summed over its G members' regions in member order ((m0 + m1)
    + m2) + ...; member m of tile t is warp t + m·ntiles."""
    W = mma_down_part_words(ctx.cfg)
    v = ctx.s_part[t * W + k]
    for m in cutlass.range(1, g, unroll=1):
        v = v + ctx.s_part[(t + m * ntiles) * W + k]
    return v


@cute.jit
def mma_down_zero(ctx: _Ctx, w: Any, lane: Any) -> None:
    """Warp w's region zeroed, lane ``lane`` taking every 32nd word."""
    W = mma_down_part_words(ctx.cfg)
    part = ctx.s_part  # (a name of its own: the loop writes through it, not through ctx)
    for k in cutlass.range(lane, W, 32, unroll=1):
        part[w * W + k] = Float32(0.0)


@cute.jit
def mma_down_store(ctx: _Ctx, rt: Any, w: Any, tiles: Any, th: Any, STRIDE: cutlass.Constexpr, ntiles: Any,
                   g: Any) -> None:
    """Stores from the regions: elements th, th + STRIDE, ... of ``tiles`` tiles from tile ``w`` (rows from rt + 16·t
    for the t-th), each the sum of its tile's G members' regions (``mma_down_sum``; G = 1: the warp's own)."""
    W = mma_down_part_words(ctx.cfg)
    for k in cutlass.range(th, tiles * W, STRIDE, unroll=1):
        t = k // W
        off = mma_down_out(ctx, rt + t * FP4_ROWS, (k % W) // ctx.cfg.B, k % ctx.cfg.B)
        if off >= 0:
            down_store(ctx, off, mma_down_sum(ctx, w + t, k % W, ntiles, g))


@cute.jit
def _op_expert_down_mma(ctx: _Ctx) -> None:
    """Tensor cores: every warp streams (``mma_down_split``): the warps of a row tile split the used slots (member m:
    slots m, m + G, ...), each work item (16 w2 rows x a group of list positions) is added, per accumulator register
    and router-weighted, to the warp's fp32 region in shared memory (``mma_down_add``); with G > 1 one barrier, then
    every thread sums the members' regions of some (row, token) elements in member order (``mma_down_sum``) and stores
    them. fp32 order per (row, token): per member, its slots ascending; then members 0 + 1 + 2 ... (not the plain slot
    order of one warp)."""
    cfg = ctx.cfg
    EXP, CNT, _ = slot_lists(cfg)
    P = mma_passes(cfg, "down")
    r0 = ctx.s_ins[W_ARGS + 2]
    _build_slot_lists(ctx, Int32(0), Int32(cfg.dmax), True)
    hv = gchunks(ctx.s_addr[0])
    hs, nk = down_dims(ctx)
    lane, warp = ctx.lane, ctx.warp
    ntiles, g = mma_down_split(ctx)
    mem = warp // cutlass.max(ntiles, 1)  # (an empty box: no tile, nothing to do)
    a = cute.make_rmem_tensor((4, P), Float32)
    if mem < g:
        for ti in cutlass.range(warp % cutlass.max(ntiles, 1), ntiles, NW, unroll=1):
            rt = r0 + ti * FP4_ROWS
            mma_down_zero(ctx, warp, lane)
            cute.arch.sync_warp()
            for j in cutlass.range(mem, cfg.dmax, g, unroll=1):
                n = ctx.s_i32[CNT + j]
                if n > 0:
                    e = ctx.s_i32[EXP + j]
                    if const_expr(cfg.fp4):
                        wv = fp4_tile_rows(ctx, 4, 6, e, rt, lane)
                    for grp in cutlass.range(mma_groups(n, P), unroll=1):
                        t0 = mma_pos(grp, 0, 0, P)
                        if const_expr(cfg.fp4):
                            fp4_mma_tile(ctx, hv, hs, nk, wv, None, j, t0, n, a[None, 0], None, DOWN_BLOCKS, True,
                                         lane)
                        else:
                            dense_mma_tile(ctx, 4, e, rt, hv, hs, nk, down_x, j, t0, n, a, mk_addr.EXPERT_MMA_BLOCKS,
                                           lane)
                        for p in cutlass.range_constexpr(P):
                            for i in cutlass.range_constexpr(4):
                                mma_down_add(ctx, warp, a[i, p], j, mma_pos(grp, p, acc_col(lane, i), P), n, lane, i)
                    cute.arch.sync_warp()  # the next slot's adds may hit this one's (row, token) from another lane
            if g == 1:  # the warp's tile is whole: store it
                mma_down_store(ctx, rt, warp, Int32(1), lane, 32, Int32(1), Int32(1))
                cute.arch.sync_warp()  # before the next tile's zeroing
    if g > 1:  # CTA-uniform
        cute.arch.sync_threads()
        mma_down_store(ctx, r0, Int32(0), ntiles, ctx.tidx, NT, ntiles, g)
