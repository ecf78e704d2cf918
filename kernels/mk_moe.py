"""The megakernel's MoE opcodes: ROUTER, EXPERT_GATE_UP, EXPERT_DOWN (device code; see ``OPCODE_NOTES`` in
``megakernel.py``).

Each ``op_*`` is a thin GPU-only layer (thread / warp / lane indices, shuffles, the ballot, barriers, the global
stores) around ``@cute.jit`` helpers that take the token, slot, expert, row and lane as plain integers: which
token's candidates a lane holds and the top-k's comparisons (``router_choices``, ``router_lane_best``,
``router_take``, ``router_retire``, ``router_weight``, ``router_record``, ``router_scale``), the compaction of the
chosen experts into slots and the slot weights / use flags (``router_slot_of``, ``router_round_end``,
``router_slot``), the expert opcodes' slot lists built once per instruction (``slot_expert``, ``slot_take``,
``slot_put``, ``slot_end``, ``slot_token``; the ballot compaction reuses ``router_slot_of`` / ``router_round_end``),
the weight rows and the per-lane dots of one weight step against every token of a pass (``gate_up_rows``,
``gate_up_tile``, ``down_row``, ``down_tile``; with MXFP4 experts, ``MKConfig.fp4``, the code and scale rows
``fp4_row`` and the decoding tile ``fp4_tile`` behind them), the weighted fp32 combine (``down_weighted``,
``down_combine``) and the element offsets of every store. ``kernels/host_exec_router.py`` runs
the same helpers on the host over every warp and lane of each instruction of a program and replays the thin layer
in the kernel's order."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, const_expr

from ._common import fp4_place, fp4_scale, fp4_widen, x_pair_order
from ._trace import evict_last, tracing_for_host
from .device_fns import (
    BIG,
    NT,
    NW,
    VEC,
    bf16_round,
    gchunks,
    gflat,
    glu,
    warp_sum,
)
from .isa import (
    W_ARGS,
)
from .mk_addr import FP4_GROUP, FP4_GROUP_BYTES, expert_row_offset, fp4_row_offsets
from .mk_operands import (
    F32_VEC,
    F32_WORDS,
    I32_WORDS,
    _Ctx,
    _eoff,
    _pad32,
)


@cute.jit
def _precise_sigmoid(x: Float32) -> Float32:
    """Full-precision σ for the router: approximate scores could reorder near-ties and pick another expert."""
    return 1.0 / (1.0 + cute.math.exp(-x))


@cute.jit
def router_take(ov: Float32, oi: Int32, v: Float32, i: Int32) -> Any:
    """Whether the partner's candidate (ov, oi) beats the lane's (v, i) in the butterfly: a larger choice score,
    or an equal one with a lower expert id (torch.topk's order on ties)."""
    return (ov > v) | ((ov == v) & (oi < i))


@cute.jit
def _warp_best(v: Float32, i: Int32) -> tuple[Float32, Int32]:
    """Butterfly arg-max over the warp (GPU only: shuffles); the host execution replays the same exchanges."""
    for off in cutlass.range_constexpr(5):
        ov = cute.arch.shuffle_sync_bfly(v, offset=16 >> off)
        oi = cute.arch.shuffle_sync_bfly(i, offset=16 >> off)
        take = router_take(ov, oi, v, i)
        v, i = (ov, oi) if take else (v, i)
    return v, i


@cute.jit
def router_choices(ctx: _Ctx, lg: Any, bias: Any, b: Int32, lane: Int32, ch: cute.Tensor, ix: cute.Tensor) -> None:
    """Token b's candidates of a lane: experts lane, lane + 32, ... with choice scores σ(logit) + bias (-inf past
    E). The logits row of token b starts at element ``_eoff(d1, d2, b, 0, 0)`` of operand 0."""
    E = ctx.cfg.E
    row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0))
    for m in cutlass.range_constexpr(cute.size(ch)):
        e = lane + 32 * m
        ix[m] = e
        ch[m] = -Float32.inf
        if e < E:
            ch[m] = _precise_sigmoid(lg[row + e]) + bias[e]


@cute.jit
def router_lane_best(ch: cute.Tensor, ix: cute.Tensor) -> tuple[Float32, Int32]:
    """The lane's best candidate; its ids ascend, so a strict > keeps the lower id on ties."""
    v, i = ch[0], ix[0]
    for m in cutlass.range_constexpr(1, cute.size(ch)):
        take = ch[m] > v
        v, i = (ch[m], ix[m]) if take else (v, i)
    return v, i


@cute.jit
def router_retire(ch: cute.Tensor, ix: cute.Tensor, i: Int32) -> None:
    for m in cutlass.range_constexpr(cute.size(ch)):
        ch[m] = -Float32.inf if ix[m] == i else ch[m]


@cute.jit
def router_weight(ctx: _Ctx, lg: Any, b: Int32, i: Int32) -> Float32:
    """The weight of expert i for token b: its UNBIASED sigmoid score."""
    return _precise_sigmoid(lg[_eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0)) + i])


@cute.jit
def router_record(ctx: _Ctx, b: Int32, r: Int32, i: Int32, w: Float32) -> None:
    """Lane 0: the r-th choice of token b and its weight into the CTA's scratch, expert i marked used."""
    K, EP = ctx.cfg.topk, _pad32(ctx.cfg.E)
    ctx.s_i32[2 * EP + b * K + r] = i
    ctx.s_f32[F32_VEC + b * K + r] = w
    ctx.s_i32[i] = 1


@cute.jit
def router_scale(ctx: _Ctx, b: Int32, wsum: Float32) -> None:
    """Lane 0: token b's weights renormalised (+1e-20) and times the route scale."""
    cfg = ctx.cfg
    K = cfg.topk
    scale = Float32(cfg.route_scale)
    if const_expr(cfg.renorm and K > 1):
        scale = scale / (wsum + 1e-20)
    for r in cutlass.range_constexpr(K):
        ctx.s_f32[F32_VEC + b * K + r] = ctx.s_f32[F32_VEC + b * K + r] * scale


@cute.jit
def router_slot_of(base: Int32, bal: Any, below: Any) -> Int32:
    """The slot of a used expert in one ballot round of the compaction: ``base`` (the slots earlier rounds took)
    plus the used experts of the lower lanes (``below``: the lane's mask of lower lanes), so used experts get
    consecutive slots in ascending id."""
    return base + cute.arch.popc(bal & below)


@cute.jit
def router_round_end(base: Int32, bal: Any) -> Int32:
    """The slots taken after a ballot round."""
    return base + cute.arch.popc(bal)


@cute.jit
def router_slot(ctx: _Ctx, b: Int32, j: Int32) -> tuple[Float32, Int32, Int64, Int64]:
    """Slot j of token b: the summed weight of its choices compacted into slot j, whether any is, and the element
    offsets of (b, 0, j) in the weights (operand 3) and use flags (operand 4)."""
    K, EP = ctx.cfg.topk, _pad32(ctx.cfg.E)
    w = Float32(0.0)
    u = Int32(0)
    for r in cutlass.range_constexpr(K):
        hit = ctx.s_i32[EP + ctx.s_i32[2 * EP + b * K + r]] == j
        w = w + (ctx.s_f32[F32_VEC + b * K + r] if hit else Float32(0.0))
        u = Int32(1) if hit else u
    return (w, u, _eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), j),
            _eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), j))


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
    s_used, s_slot = ctx.s_i32, ctx.s_i32  # [0, EP) used, [EP, 2EP) slot, [2EP, ..) choices; s_f32: weights
    for e in cutlass.range(ctx.tidx, EP, NT, unroll=1):
        s_used[e] = 0
    cute.arch.sync_threads()
    ch = cute.make_rmem_tensor((EPL,), Float32)
    ix = cute.make_rmem_tensor((EPL,), Int32)
    for b in cutlass.range(ctx.warp, B, NW, unroll=1):
        router_choices(ctx, lg, bias, b, ctx.lane, ch, ix)
        wsum = Float32(0.0)
        for r in cutlass.range_constexpr(K):
            v, i = _warp_best(*router_lane_best(ch, ix))
            router_retire(ch, ix, i)
            w = router_weight(ctx, lg, b, i)
            wsum = wsum + w
            if ctx.lane == 0:
                router_record(ctx, b, r, i, w)
        if ctx.lane == 0:
            router_scale(ctx, b, wsum)
    cute.arch.sync_threads()
    if ctx.warp == 0:  # compact the chosen experts, ascending, into slots
        base = Int32(0)
        for m in cutlass.range_constexpr(EPL):
            e = ctx.lane + 32 * m
            u = s_used[e] != 0  # [E, EP) was zeroed too
            bal = cute.arch.vote_ballot_sync(u)
            slot = router_slot_of(base, bal, cute.arch.lanemask_lt())
            if u:
                s_slot[EP + e] = slot
                sel[slot] = Int64(e)
            base = router_round_end(base, bal)
        for j in cutlass.range(base + ctx.lane, cfg.dmax, 32, unroll=1):
            sel[j] = Int64(-1)
    cute.arch.sync_threads()
    for idx in cutlass.range(ctx.tidx, B * cfg.dmax, NT, unroll=1):
        w, u, ow, ou = router_slot(ctx, idx // cfg.dmax, idx % cfg.dmax)
        mw[ow] = w
        use[ou] = Uint8(u)


# The expert opcodes stream: a prologue reads every slot's expert id and use flags ONCE per instruction into the
# CTA's scratch (the slot's tokens as a list, EXPERT_DOWN also their router weights), one barrier, then each warp
# walks its weight rows; each weight chunk a lane loads is dotted with every token of the slot's list,
# GATE_UP_TILE / DOWN_TILE tokens per pass (a weight row is read once per instruction while its slot has no more
# tokens than that; more: once per pass, the later passes from L1 / L2).
# Tokens per pass: 4 fp32 accumulators per lane (x 2 for gate and up) up to batch 8, 2 above. Larger passes made
# ptxas spill under the 168-register cap: 2 x 8 at tiny batch 8, 8 (EXPERT_DOWN) at k3-shard batch 8, 4 at k3-shard
# batch 64 (where the batch-64 tiles of the other opcodes already hold the kernel at the cap).
GATE_UP_TILE = 4
DOWN_TILE = 4
WIDE_BATCH_TILE = 2  # both opcodes' pass above batch 8
GATE_UP_LOADS = 4  # 16-byte chunks per lane per step of EACH of w1 and w3: 8 loads (48 KiB per CTA) in flight
DOWN_LOADS = 6  # 16-byte w2 chunks per lane per step: 6 loads (36 KiB per CTA) in flight; a k3 w2 row (384 chunks)
# is then exactly two steps, no clamped chunk
# MXFP4 (MKConfig.fp4): one 16-byte load is one 32-column group of codes. EXPERT_GATE_UP keeps GATE_UP_LOADS groups of
# each of w1 and w3 in flight per lane (prefetched into L1 at the start of a step; a k3 row, 112 groups: one step). A
# k3 w2 row is only 96 groups (3 per lane), so an EXPERT_DOWN warp takes DOWN_ROWS_FP4 rows at once, DOWN_LOADS /
# DOWN_ROWS_FP4 groups of each (6 loads, 36 KiB per CTA, one step, none clamped), the two rows sharing every x load
# like the gate and up rows do.
DOWN_ROWS_FP4 = 2
X_CHUNKS_PER_GROUP = FP4_GROUP // VEC  # 16-byte x chunks of one MXFP4 group (one per 8-code word)


# sm_100a's ptxas spills the MXFP4 tiles at 4 tokens per pass (batch 8: micro, tiny, k3-shard); 2 there
FP4_TILE_BY_ARCH = {"sm_100a": 2}


def _fp4_cap(T: int, cfg: Any) -> int:
    return min(T, FP4_TILE_BY_ARCH.get(cfg.arch, T)) if cfg.fp4 else T


def gate_up_pass(cfg: Any) -> int:
    """Tokens per pass of EXPERT_GATE_UP for the config's batch, expert format (``cfg.fp4``) and compile target
    (``cfg.arch``)."""
    return _fp4_cap(min(cfg.B, GATE_UP_TILE if cfg.B <= 8 else WIDE_BATCH_TILE), cfg)


def down_pass(cfg: Any) -> int:
    """Tokens per pass of EXPERT_DOWN (as :func:`gate_up_pass`)."""
    return _fp4_cap(min(cfg.B, DOWN_TILE if cfg.B <= 8 else WIDE_BATCH_TILE), cfg)


def down_rows(cfg: Any) -> int:
    """w2 rows an EXPERT_DOWN warp takes at once: 1 (dense), DOWN_ROWS_FP4 (MXFP4); row task k of warp w starts at
    r0 + (w + k·NW)·rows."""
    return DOWN_ROWS_FP4 if cfg.fp4 else 1


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
    """Row r of expert e's gate (w1, operand 3) and up (w3, operand 4) projections, as 16-byte chunks; MXFP4: as
    :func:`fp4_row` views (scales: operands 6, 7)."""
    if const_expr(ctx.cfg.fp4):
        wg, wu = fp4_row(ctx, 3, 6, e, r), fp4_row(ctx, 4, 7, e, r)
    else:
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
def _fp4_token(ld_x: Any, xv: Any, c: Int32, rx: cute.Tensor, pka: cute.Tensor, pkb: cute.Tensor, fa: Float32,
               fb: Float32, aa: cute.Tensor, ab: cute.Tensor, t: cutlass.Constexpr) -> None:
    """One token's share of one group: its 4 x chunks from chunk c (loads in flight together), each word of rows A and
    B widened to fp32 (``fp4_widen``) and dotted with its chunk in pair order, one fp32 FMA chain per row over the
    group's 32 columns; then the group partials times the group scales, one FMA into ``aa[t]`` / ``ab[t]``."""
    for j in cutlass.range_constexpr(X_CHUNKS_PER_GROUP):
        cute.copy(ld_x, xv[(c + j, None)], rx[None, j])
    pa, pb = Float32(0.0), Float32(0.0)
    for j in cutlass.range_constexpr(X_CHUNKS_PER_GROUP):
        x = x_pair_order(rx[None, j], j)
        wa = fp4_widen(pka[None, j].load())
        wb = fp4_widen(pkb[None, j].load())
        for k in cutlass.range_constexpr(VEC):
            pa = pa + wa[k] * x[k]
            pb = pb + wb[k] * x[k]
    aa[t] = aa[t] + pa * fa
    ab[t] = ab[t] + pb * fb


@cute.jit
def fp4_tile(ctx: _Ctx, xv: Any, xs: Int32, ngr: Int32, wa: Any, wb: Any, jj: Int32, t0: Int32, n: Int32,
             aa: cute.Tensor, ab: cute.Tensor, U: cutlass.Constexpr, DOWN: cutlass.Constexpr, lane: Any = None
             ) -> None:
    """MXFP4: a lane's partial dots of two weight rows A and B (:func:`fp4_row` views of ``ngr`` groups: the gate
    and up rows of EXPERT_GATE_UP, two w2 rows of EXPERT_DOWN) with the x rows of tokens t0 .. t0 + T - 1 of list jj
    (those below n; ``DOWN``: the hidden rows [b, slot jj], else the input rows): ``aa[t]``, ``ab[t]``.

    Per step each lane prefetches U groups of each row into L1 (``prefetch.global.L1`` of the 16-byte code loads and
    the scale bytes: all of the step's weight bytes in flight at once, no register held while they land), then works
    group by group: its codes (one 16-byte load per row, an L1 hit, kept packed until used) and scale bytes; groups
    past the row's end are read at its last group and get scale 0 (straight-line, in-bounds loads, as the dense tiles
    clamp). The group's 8-code words of both rows are placed as fp16 bits once (``fp4_place``: integer ops, 4
    registers per word), and each token of the pass reads the group's 4 x chunks (16-byte loads, from L1), widens the
    words to fp32 and dots them in pair order into one group partial per row, which the group's E8M0 scale
    (``fp4_scale``, a power of two that also folds the placement's 2^-14 back) multiplies once: one FMA into the
    token's accumulator. Every (group, token) is its own block under the warp-uniform branch on the token count,
    token 0's too: a block that every later token's block follows would let the compiler widen the group's words
    once for all tokens (64 fp32 registers live) and spill.

    Scaling the partial instead of each weight: a power of two commutes with fp32 rounding, so the group partial is
    exactly scale x (the same 32-term FMA chain over scaled weights), and the one FMA rounds acc + partial · scale
    once; it is not the association of a chain running through the accumulator (per-weight scaling folded into one
    FMA chain from acc), so results differ from that in the last bits. Unscaled terms are E2M1 · 2^-14 · x: they
    leave the normal fp32 range only for |x| < 2^-111."""
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    T = cute.size(aa)
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128, invariant=True)
    ld_s = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=8, invariant=True)
    if const_expr(DOWN):  # as the dense tiles: the latent input is kept in L1, the hidden rows are not
        ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    else:
        ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, **evict_last())
    ca, sa = wa
    cb, sb = wb
    aa.fill(0.0)
    ab.fill(0.0)
    nt = n - t0
    rc = cute.make_rmem_tensor((4, 2), Uint32)  # the group's codes of rows A, B
    rs = cute.make_rmem_tensor((1, 2), Uint8)  # and their scale bytes
    pka = cute.make_rmem_tensor((4, X_CHUNKS_PER_GROUP), Uint32)  # the group's words placed as fp16 bits
    pkb = cute.make_rmem_tensor((4, X_CHUNKS_PER_GROUP), Uint32)
    rx = cute.make_rmem_tensor((VEC, X_CHUNKS_PER_GROUP), BFloat16)
    for it in cutlass.range((ngr + 32 * U - 1) // (32 * U), unroll=1):
        g = it * (32 * U) + lane
        if const_expr(not tracing_for_host()):  # (a cache hint: no effect on any value, nothing on the host)
            for up in cutlass.range_constexpr(U):
                gp = cutlass.min(g + 32 * up, ngr - 1)
                for view in (ca, cb, sa, sb):
                    cute.arch.prefetch(view[(gp, None)].iterator.llvm_ptr, cache_level="L1")
        for u in cutlass.range(U, unroll=1):  # a loop: one group's registers live at a time
            gi = cutlass.min(g + 32 * u, ngr - 1)
            cute.copy(ld_w, ca[(gi, None)], rc[None, 0])
            cute.copy(ld_w, cb[(gi, None)], rc[None, 1])
            cute.copy(ld_s, sa[(gi, None)], rs[None, 0])
            cute.copy(ld_s, sb[(gi, None)], rs[None, 1])
            c = gi * X_CHUNKS_PER_GROUP  # the group's first x chunk
            # a group past the row's end gets scale 0: all-zero bits, without a branch (keeps the step straight-line)
            keep = ~((ngr - 1 - (g + 32 * u)) >> 31)  # -1 while g + 32u < ngr, else 0
            fa = (fp4_scale(rs[0, 0]).bitcast(Int32) & keep).bitcast(Float32)
            fb = (fp4_scale(rs[0, 1]).bitcast(Int32) & keep).bitcast(Float32)
            for j in cutlass.range_constexpr(X_CHUNKS_PER_GROUP):
                pka[None, j].store(fp4_place(rc[j, 0]))
                pkb[None, j].store(fp4_place(rc[j, 1]))
            for t in cutlass.range_constexpr(T):
                if t < nt:  # the token's x row from the list in smem (no register held across the groups)
                    xr = down_x(ctx, jj, t0 + t, xs) if const_expr(DOWN) else gate_up_x(ctx, jj, t0 + t, xs)
                    _fp4_token(ld_x, xv, xr + c, rx, pka, pkb, fa, fb, aa, ab, t)


@cute.jit
def gate_up_tile(ctx: _Ctx, xv: Any, xs: Int32, nch: Int32, wg: Any, wu: Any, jj: Int32, t0: Int32, n: Int32,
                 ag: cute.Tensor, au: cute.Tensor, lane: Any = None) -> None:
    """A lane's partial dots of the gate and up rows with tokens t0 .. t0 + T - 1 of list jj (those below n):
    ``ag[t]``, ``au[t]``. Per step each lane has GATE_UP_LOADS chunks of each row in flight (chunks past the row's
    end are read at its last chunk and count 0: straight-line, in-bounds loads), then dots them with every token
    of the pass (the branch on the token count is warp-uniform). MXFP4: :func:`fp4_tile` (GATE_UP_LOADS groups of
    each row per step)."""
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    if const_expr(ctx.cfg.fp4):
        fp4_tile(ctx, xv, xs, nch, wg, wu, jj, t0, n, ag, au, GATE_UP_LOADS, False, lane)
    else:
        _gate_up_tile_dense(ctx, xv, xs, nch, wg, wu, jj, t0, n, ag, au, lane)


@cute.jit
def _gate_up_tile_dense(ctx: _Ctx, xv: Any, xs: Int32, nch: Int32, wg: Any, wu: Any, jj: Int32, t0: Int32, n: Int32,
                        ag: cute.Tensor, au: cute.Tensor, lane: Any) -> None:
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
def op_expert_gate_up(ctx: _Ctx) -> None:
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
def down_row(ctx: _Ctx, e: Int32, r: Int32) -> Any:
    """Row r of expert e's down projection (w2, operand 4), as 16-byte chunks. MXFP4: the rows r and r + 1 of the
    warp's task (r + 1 clamped to the box's last row, whose second copy is then not stored) as :func:`fp4_row`
    views (scales: operand 6)."""
    if const_expr(ctx.cfg.fp4):
        wv = (fp4_row(ctx, 4, 6, e, r), fp4_row(ctx, 4, 6, e, cutlass.min(r + 1, ctx.s_ins[W_ARGS + 3] - 1)))
    else:
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
              lane: Any = None, a2: Any = None) -> None:
    """A lane's partial dots of the down row with the hidden rows [b, slot j] (operand 0) of tokens t0 ..
    t0 + T - 1 of slot j's list (those below n): ``a[t]``. DOWN_LOADS w2 chunks per lane in flight per step,
    clamped at the row's end as in :func:`gate_up_tile`. MXFP4: the task's two rows (``down_row``) into ``a`` and
    ``a2`` by :func:`fp4_tile`, DOWN_LOADS / DOWN_ROWS_FP4 groups of each per step."""
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    if const_expr(ctx.cfg.fp4):
        fp4_tile(ctx, hv, hs, nch, wv[0], wv[1], j, t0, n, a, a2, DOWN_LOADS // DOWN_ROWS_FP4, True, lane)
    else:
        _down_tile_dense(ctx, hv, hs, nch, wv, j, t0, n, a, lane)


@cute.jit
def _down_tile_dense(ctx: _Ctx, hv: Any, hs: Int32, nch: Int32, wv: Any, j: Int32, t0: Int32, n: Int32,
                     a: cute.Tensor, lane: Any) -> None:
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
    """The expert's output for the p-th token of slot j (its warp-summed dot, rounded to bf16 as the reference's
    activation dtype) times its router weight (operand 3, kept next to the token by the prologue), in fp32."""
    return bf16_round(dot) * ctx.s_f32[j * ctx.cfg.B + p]


@cute.jit
def down_combine(acc: cute.Tensor, y: Float32, b: Int32, lane: Int32) -> None:
    """The fp32 combine: lane l keeps tokens l, l + 32, ...; token b's weighted output goes to its lane."""
    for m in cutlass.range_constexpr(cute.size(acc)):
        acc[m] = acc[m] + (y if lane + 32 * m == b else Float32(0.0))


@cute.jit
def down_out(ctx: _Ctx, b: Int32, r: Int32) -> Int64:
    """Element offset of the combined output [b, 0, r] (operand 5)."""
    return _eoff(ctx.s_d1[5], ctx.s_d2[5], b, Int32(0), r)


@cute.jit
def op_expert_down(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    T = down_pass(cfg)
    EXP, CNT, _ = slot_lists(cfg)
    APL = -(-cfg.B // 32)
    RW = down_rows(cfg)
    r0, r1 = ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    _build_slot_lists(ctx, Int32(0), Int32(cfg.dmax), True)
    hv = gchunks(ctx.s_addr[0])
    hs, nch = down_dims(ctx)
    out = gflat(BFloat16, ctx.s_addr[5])
    a = cute.make_rmem_tensor((T,), Float32)
    acc = cute.make_rmem_tensor((APL,), Float32)
    a2, acc2 = None, None  # MXFP4: the task's second row r + 1
    if const_expr(RW > 1):
        a2 = cute.make_rmem_tensor((T,), Float32)
        acc2 = cute.make_rmem_tensor((APL,), Float32)
    for r in cutlass.range(r0 + ctx.warp * RW, r1, NW * RW, unroll=1):
        acc.fill(0.0)
        if const_expr(RW > 1):
            acc2.fill(0.0)
        for j in cutlass.range(cfg.dmax, unroll=1):
            n = ctx.s_i32[CNT + j]
            if n > 0:
                wv = down_row(ctx, ctx.s_i32[EXP + j], r)
                for t0 in cutlass.range(0, n, T, unroll=1):
                    down_tile(ctx, hv, hs, nch, wv, j, t0, n, a, None, a2)
                    for t in cutlass.range_constexpr(T):
                        if t0 + t < n:
                            y = down_weighted(ctx, warp_sum(a[t]), j, t0 + t)
                            down_combine(acc, y, slot_token(ctx, j, t0 + t), ctx.lane)
                            if const_expr(RW > 1):
                                y2 = down_weighted(ctx, warp_sum(a2[t]), j, t0 + t)
                                down_combine(acc2, y2, slot_token(ctx, j, t0 + t), ctx.lane)
        for m in cutlass.range_constexpr(APL):
            b = ctx.lane + 32 * m
            if b < cfg.B:
                out[down_out(ctx, b, r)] = acc[m].to(BFloat16)
                if const_expr(RW > 1):
                    if r + 1 < r1:
                        out[down_out(ctx, b, r + 1)] = acc2[m].to(BFloat16)
