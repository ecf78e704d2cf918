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
``gate_up_tile``, ``down_row``, ``down_tile``), the weighted fp32 combine (``down_weighted``, ``down_combine``) and
the element offsets of every store. ``kernels/host_exec_router.py`` runs
the same helpers on the host over every warp and lane of each instruction of a program and replays the thin layer
in the kernel's order."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr

from ._trace import evict_last
from .device_fns import (
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
from .mk_addr import expert_row_offset
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


def gate_up_pass(B: int) -> int:
    """Tokens per pass of EXPERT_GATE_UP at batch B."""
    return min(B, GATE_UP_TILE if B <= 8 else WIDE_BATCH_TILE)


def down_pass(B: int) -> int:
    """Tokens per pass of EXPERT_DOWN at batch B."""
    return min(B, DOWN_TILE if B <= 8 else WIDE_BATCH_TILE)


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
def gate_up_rows(ctx: _Ctx, e: Int32, r: Int32) -> tuple[Any, Any]:
    """Row r of expert e's gate (w1, operand 3) and up (w3, operand 4) projections, as 16-byte chunks."""
    wg = gchunks(ctx.s_addr[3] + expert_row_offset(ctx.s_d1[3], ctx.s_d2[3], e, r, Int64) * 2)
    wu = gchunks(ctx.s_addr[4] + expert_row_offset(ctx.s_d1[4], ctx.s_d2[4], e, r, Int64) * 2)
    return wg, wu


@cute.jit
def gate_up_dims(ctx: _Ctx) -> tuple[Int32, Int32]:
    """(chunks from one token's input row to the next (operand 0), chunks per weight row (operand 3))."""
    return ctx.s_d1[0] * ctx.s_d2[0] // VEC, ctx.s_d2[3] // VEC


@cute.jit
def gate_up_tile(ctx: _Ctx, xv: Any, xs: Int32, nch: Int32, wg: Any, wu: Any, jj: Int32, t0: Int32, n: Int32,
                 ag: cute.Tensor, au: cute.Tensor, lane: Any = None) -> None:
    """A lane's partial dots of the gate and up rows with tokens t0 .. t0 + T - 1 of list jj (those below n):
    ``ag[t]``, ``au[t]``. Per step each lane has GATE_UP_LOADS chunks of each row in flight (chunks past the row's
    end are read at its last chunk and count 0: straight-line, in-bounds loads), then dots them with every token
    of the pass (the branch on the token count is warp-uniform)."""
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
                xo = slot_token(ctx, jj, t0 + t) * xs
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
    T = gate_up_pass(cfg.B)
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
    """Row r of expert e's down projection (w2, operand 4), as 16-byte chunks."""
    return gchunks(ctx.s_addr[4] + expert_row_offset(ctx.s_d1[4], ctx.s_d2[4], e, r, Int64) * 2)


@cute.jit
def down_dims(ctx: _Ctx) -> tuple[Int32, Int32]:
    """(chunks per (token, slot) row of the expert hidden buffer (operand 0), chunks per w2 row (operand 4))."""
    return ctx.s_d2[0] // VEC, ctx.s_d2[4] // VEC


@cute.jit
def down_tile(ctx: _Ctx, hv: Any, hs: Int32, nch: Int32, wv: Any, j: Int32, t0: Int32, n: Int32, a: cute.Tensor,
              lane: Any = None) -> None:
    """A lane's partial dots of the down row with the hidden rows [b, slot j] (operand 0) of tokens t0 ..
    t0 + T - 1 of slot j's list (those below n): ``a[t]``. DOWN_LOADS w2 chunks per lane in flight per step,
    clamped at the row's end as in :func:`gate_up_tile`."""
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
                b = slot_token(ctx, j, t0 + t)
                ho = (b * ctx.s_d1[0] + j) * hs
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
    T = down_pass(cfg.B)
    EXP, CNT, _ = slot_lists(cfg)
    APL = -(-cfg.B // 32)
    r0, r1 = ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    _build_slot_lists(ctx, Int32(0), Int32(cfg.dmax), True)
    hv = gchunks(ctx.s_addr[0])
    hs, nch = down_dims(ctx)
    out = gflat(BFloat16, ctx.s_addr[5])
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
                out[down_out(ctx, b, r)] = acc[m].to(BFloat16)
