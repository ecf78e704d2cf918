"""The megakernel's routed-expert opcodes: EXPERT_GATE_UP and EXPERT_DOWN (device code), dense (bf16) or MXFP4.

Each ``op_*`` is a thin GPU-only layer (thread / warp / lane indices, shuffles, the ballot, barriers, the global
stores) around ``@cute.jit`` helpers that take the slot, expert, row, token and lane as plain integers: the slot
lists built once per instruction (``slot_expert``, ``slot_take``, ``slot_put``, ``slot_end``, ``slot_token``; the
ballot compaction is the ROUTER's, ``megakernel/router.py``), the lanes' dots (dense: ``gate_up_tile``,
``down_tile``; MXFP4 on tensor cores: ``fp4_mma_tile``), the weighted fp32 combine (``down_weighted``,
``down_combine``) and the element offsets of every store. How each opcode works: its ``op_*`` docstring.
``kernels/verify/host_exec_mk_moe.py`` runs the same helpers on the host over every warp and lane and replays the thin
layer in the kernel's order; the one device-only step it cannot run, the mma, it records (the operands
``mma_chunk`` assembles, through its host sink) and evaluates with ``megakernel.mma.mma_reference``."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, const_expr
from kimik3.kernels.common.device import fp4_decode_pair, fp4_group_scales, x_pair_bf16x2
from kimik3.kernels.common.trace import evict_last, tracing_for_host
from kimik3.kernels.contracts.addr import FP4_GROUP, FP4_GROUP_BYTES, expert_row_offset, fp4_row_offsets
from kimik3.kernels.contracts.isa import (
    R0,
    W_ARGS,
)
from kimik3.kernels.megakernel.device_fns import (
    BIG,
    NW,
    VEC,
    bf16_round,
    gchunks,
    gflat,
    glu,
    warp_sum,
)
from kimik3.kernels.megakernel.mma import MMA_COLS, MMA_ROWS, acc_col, acc_row, lane_group, lane_quad, mma_chunk
from kimik3.kernels.megakernel.operands import (
    F32_WORDS,
    I32_WORDS,
    _bx,
    _Ctx,
    _eoff,
    _pad32,
)
from kimik3.kernels.megakernel.router import router_round_end, router_slot_of

# How the expert opcodes stream (the slot-list prologue, the dense passes, the MXFP4 tensor-core items and what a
# lane has in flight): docs/architecture.md#appendix-design-notes-by-room (kernels/megakernel/moe.py).
# Dense tokens per pass: 4 fp32 accumulators per lane (x 2 for gate and up) up to batch 8, 2 above; larger passes
# made ptxas spill under the 168-register cap (each variant's build report records it).
GATE_UP_TILE = 4
DOWN_TILE = 4
WIDE_BATCH_TILE = 2  # both opcodes' pass above batch 8
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


def gate_up_pass(cfg: Any) -> int:
    """Tokens per pass of EXPERT_GATE_UP for the config's batch and expert format (``cfg.fp4``: the mma's 8
    columns)."""
    if cfg.fp4:
        return min(cfg.B, MMA_COLS)
    return min(cfg.B, GATE_UP_TILE if cfg.B <= 8 else WIDE_BATCH_TILE)


def down_pass(cfg: Any) -> int:
    """Tokens per pass of EXPERT_DOWN (as :func:`gate_up_pass`)."""
    if cfg.fp4:
        return min(cfg.B, MMA_COLS)
    return min(cfg.B, DOWN_TILE if cfg.B <= 8 else WIDE_BATCH_TILE)


def row_tile(cfg: Any) -> int:
    """Weight rows of a warp's work item in both expert opcodes: 1 (dense), FP4_ROWS (MXFP4); item k of warp w starts
    at row r0 + (w + k·NW)·rows of the instruction's box."""
    return FP4_ROWS if cfg.fp4 else 1


def fp4_combine_width(cfg: Any) -> int:
    """MXFP4 EXPERT_DOWN: combine accumulators per lane and row: lane (g, q) keeps tokens q, q + 4, ... of its rows
    g and g + 8."""
    return -(-cfg.B // 4)


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
    """1 when token b (< B) uses slot j and the slot holds an expert (e >= 0), else 0; the flag is read only for a
    real token."""
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
    """Dense experts: a lane's partial dots of the gate and up rows with tokens t0 .. t0 + T - 1 of list jj (those
    below n): ``ag[t]``, ``au[t]``. Per step each lane has GATE_UP_LOADS chunks of each row in flight (chunks past
    the row's end are read at its last chunk and count 0: straight-line, in-bounds loads), then dots them with every
    token of the pass (the branch on the token count is warp-uniform). MXFP4: :func:`fp4_mma_tile`."""
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
def fp4_gate_up_out(ctx: _Ctx, s0: Int32, jj: Int32, t0: Int32, n: Int32, rt: Any, lane: Any,
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

    Dense experts (bf16 weights): a warp takes one weight row at a time (the same row of w1 and w3) and each lane dots
    its 16-byte chunks with every token of a pass on CUDA cores (``gate_up_rows``, ``gate_up_tile``); warp sums, lane 0
    applies SiTU-GLU and stores.

    MXFP4 experts (``MKConfig.fp4``): tensor cores, ``mma.sync.m16n8k16`` bf16 x bf16 -> fp32 through
    ``megakernel/mma.py``. A warp's work item is 16 rows of w1 and of w3 x up to 8 tokens of a slot as the mma's columns
    (``fp4_tile_rows``, ``fp4_mma_tile``): per 128-column k block lane (g, q) decodes group q of its rows g and g + 8
    (``fp4_row`` code / scale views; ``common.device.fp4_bf16x2``: integer placement of each E2M1 code as the bf16 E2M1
    · 2^-126 and one bf16x2 multiply by 2^(e - 1) per register, exact, in pair order; scale bytes above 128, which
    quantisation never writes, take a branch with a second multiply) and puts the same 32 x values of its token column g
    in the same order (``common.device.x_pair_bf16x2``: one prmt per register), so a lane's physical k depends on q
    only, as the mma's fragment layout requires; 8 mma.sync per block and weight. The epilogue applies SiTU-GLU per
    (row, token) on the accumulator fragments (lane holds rows ``acc_row``, tokens ``acc_col``; ``fp4_gate_up_out``).
    Known limits: the expert is data-dependent, so the host cannot name its rows: no stage; a slot with more tokens than
    a pass re-reads its rows (L1/L2); dense experts stay on CUDA cores (the 8 FMAs per weight at batch 8 are hidden by
    the stream there); MXFP4 pays its decode, a few PTX instructions per weight and pass (bounded by
    tests/test_mk_moe_fp4_ptx.py), whatever the tokens."""
    if const_expr(ctx.cfg.fp4):
        _op_expert_gate_up_fp4(ctx)
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
def _op_expert_gate_up_fp4(ctx: _Ctx) -> None:
    """MXFP4: work items of 16 rows (the same rows of w1 and w3) x up to 8 tokens per warp; the epilogue applies
    SiTU-GLU to the (gate, up) accumulators of the same (row, token) that the lane holds and stores h."""
    cfg = ctx.cfg
    EXP, CNT, _ = slot_lists(cfg)
    s0, s1, r0, r1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    _build_slot_lists(ctx, s0, s1, False)
    xv = gchunks(ctx.s_addr[0])
    xs, ngr = gate_up_dims(ctx)
    out = gflat(BFloat16, ctx.s_addr[5])
    ag = cute.make_rmem_tensor((4,), Float32)
    au = cute.make_rmem_tensor((4,), Float32)
    lane = ctx.lane
    for jj in cutlass.range(s1 - s0, unroll=1):
        n = ctx.s_i32[CNT + jj]
        if n > 0:
            e = ctx.s_i32[EXP + jj]
            for rt in cutlass.range(r0 + ctx.warp * FP4_ROWS, r1, NW * FP4_ROWS, unroll=1):
                wg, wu = fp4_tile_rows(ctx, 3, 6, e, rt, lane), fp4_tile_rows(ctx, 4, 7, e, rt, lane)
                for t0 in cutlass.range(0, n, MMA_COLS, unroll=1):
                    fp4_mma_tile(ctx, xv, xs, ngr, wg, wu, jj, t0, n, ag, au, GATE_UP_BLOCKS, False, lane)
                    for i in cutlass.range_constexpr(4):
                        off = fp4_gate_up_out(ctx, s0, jj, t0, n, rt, lane, i)
                        if off >= 0:
                            h = glu(bf16_round(ag[i]), bf16_round(au[i]), cfg.situ, cfg.situ_beta, cfg.situ_lin)
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
    """Dense experts: a lane's partial dots of the down row with the hidden rows [b, slot j] (operand 0) of tokens
    t0 .. t0 + T - 1 of slot j's list (those below n): ``a[t]``. DOWN_LOADS w2 chunks per lane in flight per step,
    clamped at the row's end as in :func:`gate_up_tile`. MXFP4: :func:`fp4_mma_tile`."""
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


def fp4_column_src(lane: Any, c: int) -> tuple[Any, int]:
    """Where column c of the accumulator fragments of ``lane``'s rows g (register i) and g + 8 (register i + 2)
    lives: (lane (g, c // 2), i = c % 2), the inverse of ``acc_row`` / ``acc_col``."""
    return lane_group(lane) * 4 + c // 2, c % 2


@cute.jit
def fp4_down_combine(ctx: _Ctx, acc: cute.Tensor, v: Float32, v8: Float32, j: Int32, p: Int32, n: Int32,
                     lane: Any) -> None:
    """MXFP4: one column of a work item's fragments into the lane's combine: ``v`` / ``v8`` are the sums of the
    lane's rows g and g + 8 for list position p of slot j (shuffled from the lane holding them); lane (g, q) keeps
    tokens q, q + 4, ... of its two rows (``acc`` [2, fp4_combine_width]); nothing past the list's end."""
    if p < n:
        b = slot_token(ctx, j, p)
        down_combine(acc[0, None], down_weighted(ctx, v, j, p), b, lane_quad(lane), 4)
        down_combine(acc[1, None], down_weighted(ctx, v8, j, p), b, lane_quad(lane), 4)


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
def fp4_down_out(ctx: _Ctx, rt: Any, lane: Any, h: cutlass.Constexpr, m: cutlass.Constexpr) -> Int64:
    """MXFP4: the element offset of combine accumulator [h, m] of ``lane`` (row rt + g + 8h, token q + 4m), -1 (not
    stored) past the batch or the box's last row."""
    b = lane_quad(lane) + 4 * m
    r = rt + lane_group(lane) + 8 * h
    off = Int64(-1)
    if b < ctx.cfg.B:
        if r < ctx.s_ins[W_ARGS + 3]:
            off = down_out(ctx, b, r)
    return off


@cute.jit
def op_expert_down(ctx: _Ctx) -> None:
    """EXPERT_DOWN: the combined expert output y[b, r] = Σ_slots w_slot · (h_slot · w2ᵀ)[r] of rows [r0, r1) for every
    token, the router weights listed next to the tokens by the prologue (``_build_slot_lists``).

    Dense experts: a warp takes one w2 row at a time and dots it with the hidden rows of each used slot's tokens per
    pass on CUDA cores (``down_row``, ``down_tile``); each warp sum, rounded to bf16 and times the router weight
    (``down_weighted``), is accumulated in fp32 by the lane that keeps the token (``down_combine``); one bf16 store.

    MXFP4 experts: 16-row mma work items as EXPERT_GATE_UP's (``fp4_mma_tile``), spread over every warp
    (``fp4_down_split``): the G warps of a 16-row tile split the used slots, each shuffles every token column to the
    lanes that keep that token (``fp4_column_src``, ``fp4_down_item``) and combines it, router-weighted, in fp32 in its
    registers (``fp4_down_combine``); the members' combines meet in the fp32 scratch after a barrier, summed in member
    order (``fp4_down_part_put``, ``fp4_down_part_sum``), and member 0 stores (``fp4_down_out``). Known limits: no stage
    (data-dependent expert); rows re-read per extra pass of an expert's tokens; MXFP4 at B = 64: the fp32 scratch holds
    the slot lists' weights, so G = 1 (2 warps stream)."""
    if const_expr(ctx.cfg.fp4):
        _op_expert_down_fp4(ctx)
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


def fp4_down_part_base(cfg: Any) -> int:
    """EXPERT_DOWN's cross-warp partials in the fp32 scratch start past the slot lists' router weights
    (s_f32[0, dmax·B), read by every warp until its last item): s_f32[base + ((w·2 + h)·MW + m)·32 + lane] holds
    combine accumulator [h, m] of lane ``lane`` of partial slot w (MW = ``fp4_combine_width``; lane-contiguous, no bank
    conflicts)."""
    return _pad32(cfg.dmax * cfg.B)


def fp4_down_part_words(cfg: Any) -> int:
    """fp32 scratch words of one warp's partials."""
    return 2 * fp4_combine_width(cfg) * 32


@cute.jit
def fp4_down_split(ctx: _Ctx) -> tuple[Int32, Int32]:
    """EXPERT_DOWN's work split over the CTA's warps: (row tiles of the box, warps per tile G). Warp w takes row tile
    w % ntiles (then + NW, ... when the box has more tiles than warps: G = 1) as member m = w // ntiles of its tile's
    G warps (members m >= G idle) and, of every tile it takes, the slots m, m + G, ...; G is capped so that the
    partials of members 1 .. G - 1 of every tile fit the fp32 scratch past ``fp4_down_part_base``."""
    cfg = ctx.cfg
    ntiles = (ctx.s_ins[W_ARGS + 3] - ctx.s_ins[W_ARGS + 2] + FP4_ROWS - 1) // FP4_ROWS
    room = (F32_WORDS - fp4_down_part_base(cfg)) // fp4_down_part_words(cfg)  # warps' partials that fit
    g = cutlass.max(cutlass.min(NW // cutlass.max(ntiles, 1), room // cutlass.max(ntiles, 1) + 1), 1)
    return ntiles, g


@cute.jit
def fp4_down_part_put(ctx: _Ctx, acc: cute.Tensor, slot: Any, lane: Any) -> None:
    """A member's combine accumulators (lane ``lane``) into partial slot ``slot`` (member m >= 1 of tile t: slot
    (m - 1)·ntiles + t, i.e. its warp - ntiles)."""
    MW = fp4_combine_width(ctx.cfg)
    base = fp4_down_part_base(ctx.cfg) + slot * fp4_down_part_words(ctx.cfg) + lane
    for h in cutlass.range_constexpr(2):
        for m in cutlass.range_constexpr(MW):
            ctx.s_f32[base + (h * MW + m) * 32] = acc[h, m]


@cute.jit
def fp4_down_part_sum(ctx: _Ctx, acc: cute.Tensor, w: Any, ntiles: Any, g: Any, lane: Any) -> None:
    """Member 0 (warp w) of a tile adds the partials of members 1, 2, ..., G - 1 (warps w + ntiles, w + 2·ntiles,
    ..., partial slots w, w + ntiles, ...) to its own accumulators, in that order: ((p0 + p1) + p2) + ... (after
    the barrier that follows every member's ``fp4_down_part_put``)."""
    MW = fp4_combine_width(ctx.cfg)
    for k in cutlass.range(1, g, unroll=1):
        base = fp4_down_part_base(ctx.cfg) + (w + (k - 1) * ntiles) * fp4_down_part_words(ctx.cfg) + lane
        for h in cutlass.range_constexpr(2):
            for m in cutlass.range_constexpr(MW):
                acc[h, m] = acc[h, m] + ctx.s_f32[base + (h * MW + m) * 32]


@cute.jit
def fp4_down_item(ctx: _Ctx, acc: cute.Tensor, a: cute.Tensor, j: Any, t0: Any, n: Any, lane: Any,
                  shfl: Any) -> None:
    """EXPERT_DOWN's epilogue of one work item (slot j, list positions t0 ..): each column c's values of the lane's
    rows g, g + 8 fetched with ``shfl(register, source lane)`` from the lane ``fp4_column_src`` names and combined,
    router-weighted (``fp4_down_combine``)."""
    for c in cutlass.range_constexpr(down_pass(ctx.cfg)):
        src, i = fp4_column_src(lane, c)
        fp4_down_combine(ctx, acc, shfl(a, i, src), shfl(a, i + 2, src), j, t0 + c, n, lane)


@cute.jit
def _shfl_device(a: cute.Tensor, i: cutlass.Constexpr, src: Any) -> Float32:
    return cute.arch.shuffle_sync(a[i], src)


@cute.jit
def _op_expert_down_fp4(ctx: _Ctx) -> None:
    """MXFP4: every warp streams (``fp4_down_split``): the warps of a row tile split the used slots (member m: slots
    m, m + G, ...), each work item (16 w2 rows x up to 8 tokens) is shuffled column by column to the lanes that keep
    each token (lane (g, q): tokens q, q + 4, ...) and added, router-weighted, to the warp's fp32 combine
    (``fp4_down_item``); with G > 1 every member's combine goes to the scratch, one barrier, and member 0 adds the
    others' in member order (``fp4_down_part_sum``) and stores. fp32 order per (row, token): per member, its slots
    ascending, passes and columns in order; then members 0 + 1 + 2 ... (not the plain slot order of one warp)."""
    cfg = ctx.cfg
    EXP, CNT, _ = slot_lists(cfg)
    r0 = ctx.s_ins[W_ARGS + 2]
    _build_slot_lists(ctx, Int32(0), Int32(cfg.dmax), True)
    hv = gchunks(ctx.s_addr[0])
    hs, ngr = down_dims(ctx)
    lane, warp = ctx.lane, ctx.warp
    ntiles, g = fp4_down_split(ctx)
    mem = warp // cutlass.max(ntiles, 1)  # (an empty box: no tile, nothing to do)
    a = cute.make_rmem_tensor((4,), Float32)
    acc = cute.make_rmem_tensor((2, fp4_combine_width(cfg)), Float32)
    if mem < g:
        for ti in cutlass.range(warp % cutlass.max(ntiles, 1), ntiles, NW, unroll=1):
            rt = r0 + ti * FP4_ROWS
            acc.fill(0.0)
            for j in cutlass.range(mem, cfg.dmax, g, unroll=1):
                n = ctx.s_i32[CNT + j]
                if n > 0:
                    wv = fp4_tile_rows(ctx, 4, 6, ctx.s_i32[EXP + j], rt, lane)
                    for t0 in cutlass.range(0, n, MMA_COLS, unroll=1):
                        fp4_mma_tile(ctx, hv, hs, ngr, wv, None, j, t0, n, a, None, DOWN_BLOCKS, True, lane)
                        fp4_down_item(ctx, acc, a, j, t0, n, lane, _shfl_device)
            if g > 1:
                if mem > 0:  # member 0 keeps its combine in registers
                    fp4_down_part_put(ctx, acc, warp - ntiles, lane)
            else:
                _fp4_down_store(ctx, acc, rt, lane)
    if g > 1:  # CTA-uniform
        cute.arch.sync_threads()
        if warp < ntiles:
            fp4_down_part_sum(ctx, acc, warp, ntiles, g, lane)
            _fp4_down_store(ctx, acc, r0 + warp * FP4_ROWS, lane)


@cute.jit
def _fp4_down_store(ctx: _Ctx, acc: cute.Tensor, rt: Any, lane: Any) -> None:
    for h in cutlass.range_constexpr(2):
        for m in cutlass.range_constexpr(fp4_combine_width(ctx.cfg)):
            off = fp4_down_out(ctx, rt, lane, h, m)
            if off >= 0:
                down_store(ctx, off, acc[h, m])
