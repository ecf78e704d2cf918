"""The megakernel's ROUTER opcode (device code): each token's sigmoid scores, its top-k experts and their weights,
the chosen experts compacted into slots, and the slots' weights and use flags.

``op_router`` is a thin GPU-only layer (thread / warp / lane indices, shuffles, the ballot, barriers, the global
stores) around ``@cute.jit`` helpers that take the token, lane and slot as plain integers: a lane's candidates and
the top-k's steps (``router_choices``, ``router_lane_best``, ``router_retire``, ``router_weight``, ``router_record``,
``router_scale``; every comparison across lanes is ``common.device.argmax_take``), the compaction over this
program's experts (``router_range``, ``router_mine``, ``router_local``; ``router_slot_of``, ``router_round_end``,
which the expert opcodes' slot lists in ``megakernel/moe.py`` reuse) and the slot outputs (``router_slot``).
``kernels/verify/host_exec_mk_moe.py`` runs the same helpers on the host and replays the thin layer (butterfly,
ballot) in the kernel's order. Design: ``docs/architecture.md`` (map; appendix: the megakernel VM)."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, const_expr
from kimik3.kernels.common.device import argmax_take, warp_argmax  # noqa: F401 (the host replay calls argmax_take)
from kimik3.kernels.contracts.isa import W_ARGS
from kimik3.kernels.megakernel.device_fns import (
    NT,
    NW,
    gflat,
)
from kimik3.kernels.megakernel.operands import (
    F32_VEC,
    _Ctx,
    _eoff,
    _pad32,
)


@cute.jit
def _precise_sigmoid(x: Float32) -> Float32:
    """Full-precision σ for the router: approximate scores could reorder near-ties and pick another expert."""
    return 1.0 / (1.0 + cute.math.exp(-x))


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
def router_range(ctx: _Ctx) -> tuple[Int32, Int32]:
    """The experts the slots take, ``[lo, hi)``: a rank's own (ROUTER args 0, 1), every expert on one GPU (args
    0, 0)."""
    lo, hi = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1]
    whole = hi <= lo
    return (Int32(0) if whole else lo), (Int32(ctx.cfg.E) if whole else hi)


@cute.jit
def router_mine(e: Int32, used: Any, lo: Int32, hi: Int32) -> Any:
    """Whether expert ``e`` takes a slot here: chosen by some token, and one of the experts ``[lo, hi)`` this
    program holds (a slot then stores ``e - lo``, its index among them)."""
    return used & (e >= lo) & (e < hi)


@cute.jit
def router_local(e: Int32, lo: Int32) -> Int64:
    """What a slot stores for expert ``e``: its index among the experts this program holds (``e - lo``)."""
    return Int64(e - lo)


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
    """ROUTER: one warp per token (tokens warp, warp + NW, ...): each lane's candidates (experts lane, lane + 32, ...
    with choice scores σ(logit) + bias, ``router_choices``), then k rounds of the lane's best, the butterfly arg-max
    across the warp (``common.device.warp_argmax``: ties to the lower id) and the winner's retirement; lane 0 records
    each choice with its unbiased weight and renormalises (``router_scale``). Warp 0 then compacts the chosen experts,
    ascending, into slots with one ballot per 32 experts (``router_slot_of``, ``router_round_end``) and sets
    the selection's slots past the last to -1; one thread per (token, slot) writes the slot weight and use flag
    (``router_slot``). Known limits: grouped routing (n_group > 1) is not implemented (refused on the host)."""
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
            v, i = warp_argmax(*router_lane_best(ch, ix))
            router_retire(ch, ix, i)
            w = router_weight(ctx, lg, b, i)
            wsum = wsum + w
            if ctx.lane == 0:
                router_record(ctx, b, r, i, w)
        if ctx.lane == 0:
            router_scale(ctx, b, wsum)
    cute.arch.sync_threads()
    if ctx.warp == 0:  # compact the chosen experts (this program's: router_range), ascending, into slots
        lo, hi = router_range(ctx)
        base = Int32(0)
        for m in cutlass.range_constexpr(EPL):
            e = ctx.lane + 32 * m
            u = s_used[e] != 0  # [E, EP) was zeroed too
            mine = router_mine(e, u, lo, hi)
            bal = cute.arch.vote_ballot_sync(mine)
            slot = router_slot_of(base, bal, cute.arch.lanemask_lt())
            if u:  # another rank's expert: no slot here (router_slot never matches -1)
                s_slot[EP + e] = Int32(-1)
            if mine:
                s_slot[EP + e] = Int32(slot)
                sel[slot] = router_local(e, lo)
            base = router_round_end(base, bal)
        for j in cutlass.range(base + ctx.lane, cfg.dmax, 32, unroll=1):
            sel[j] = Int64(-1)
    cute.arch.sync_threads()
    for idx in cutlass.range(ctx.tidx, B * cfg.dmax, NT, unroll=1):
        w, u, ow, ou = router_slot(ctx, idx // cfg.dmax, idx % cfg.dmax)
        mw[ow] = w
        use[ou] = Uint8(u)
