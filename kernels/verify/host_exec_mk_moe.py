"""Host execution of the megakernel's MoE opcodes: ROUTER (``kernels/megakernel/router.py``), EXPERT_GATE_UP and
EXPERT_DOWN (``kernels/megakernel/moe.py``), dense or MXFP4, one instruction of a real program at a time (the program,
its buffers and the comparison with the CPU interpreter: ``host_exec_mk.py``, ``host_exec_router.py``).

The drivers call the opcodes' own ``@cute.jit`` helpers over every warp and lane and replay the thin GPU layer in the
kernel's order: the ROUTER's butterfly (through ``common.device.argmax_take``) and ballot, the expert opcodes'
slot-list prologue, EXPERT_DOWN's warp sums. MXFP4 programs run every lane's decode and fragment registers as on the
GPU; only ``mma.sync`` is replaced: each lane's registers are recorded (``_MmaRecord``) and the mmas evaluated in
program order by ``megakernel.mma.mma_reference``. SiTU-GLU (approximate ``tanh`` / ``ex2`` on the GPU) is evaluated
in exact fp32. Design: ``docs/architecture.md`` (appendix: design notes by room, ``kernels/verify/``)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from kimik3.kernels.verify.host_exec import LANES, _Writes, warp_sum
from kimik3.kernels.verify.host_exec_mk import _box_mask, _ctx, _Instr, _launch, _MkSetup, _scratch, _store

__all__ = ["exec_router", "exec_expert_gate_up", "exec_expert_down"]

_DRIVERS: dict[tuple[str, Any], Any] = {}


@cute.jit
def _bfly_sum(mP: cute.Tensor, mT: cute.Tensor) -> None:
    """``warp_sum`` replayed over a [32] tensor of lane values: at offsets 16, 8, 4, 2, 1 every lane adds its
    partner's value (read before any lane writes) to its own; every lane ends with the same bits."""
    for off in cutlass.range_constexpr(5):
        for lane in cutlass.range(LANES):
            mT[lane] = mP[lane]
        for lane in cutlass.range(LANES):
            mP[lane] = mT[lane] + mT[lane ^ (16 >> off)]


def _mk_router_host(M: ModuleType) -> Any:
    """Every warp's tokens (b = warp, warp + NW, ...) and lane of a ROUTER instruction: candidates, the k rounds of
    lane best / butterfly (``M.argmax_take``, shuffle order) / retirement, the weights and lane 0's records."""
    key = ("mk_router", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NW = M.NW

    @cute.jit
    def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mCh: cute.Tensor, mIx: cute.Tensor, mBv: cute.Tensor, mBi: cute.Tensor,
              mTv: cute.Tensor, mTi: cute.Tensor, mWsum: cute.Tensor, cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        lg = M.gflat(Float32, mAddr[0])
        bias = M.gflat(Float32, mAddr[1])
        for warp in cutlass.range(NW):
            for b in cutlass.range(warp, cfg.B, NW):
                for lane in cutlass.range(LANES):
                    M.router_choices(ctx, lg, bias, b, lane, mCh[lane, None], mIx[lane, None])
                    mWsum[lane] = Float32(0.0)
                for r in cutlass.range(cfg.topk):
                    for lane in cutlass.range(LANES):
                        v, i = M.router_lane_best(mCh[lane, None], mIx[lane, None])
                        mBv[lane] = v
                        mBi[lane] = i
                    for off in cutlass.range(5):
                        for lane in cutlass.range(LANES):
                            mTv[lane] = mBv[lane]
                            mTi[lane] = mBi[lane]
                        for lane in cutlass.range(LANES):
                            o = lane ^ (Int32(16) >> off)
                            if M.argmax_take(mTv[o], mTi[o], mTv[lane], mTi[lane]):
                                mBv[lane] = mTv[o]
                                mBi[lane] = mTi[o]
                    for lane in cutlass.range(LANES):
                        M.router_retire(mCh[lane, None], mIx[lane, None], mBi[lane])
                        w = M.router_weight(ctx, lg, b, mBi[lane])
                        mWsum[lane] = mWsum[lane] + w
                        if lane == 0:
                            M.router_record(ctx, b, r, mBi[lane], w)
                M.router_scale(ctx, b, mWsum[0])

    _DRIVERS[key] = drive
    return drive


def _mk_router_compact_host(M: ModuleType) -> Any:
    """Warp 0's compaction of the used experts into slots: per round of 32 experts the ballot (``vote.ballot``:
    GPU only, built here from the lanes' flags), each lane's slot (``M.router_slot_of`` with the lane's mask of lower
    lanes) and the round's end (``M.router_round_end``); the used lanes' slots into the scratch as the opcode
    does, and per expert the slot it stores at (mRec, -1: unused) and what (mId: ``M.router_local``); mBase[0]: the
    slots taken."""
    key = ("mk_router_compact", M)
    if key in _DRIVERS:
        return _DRIVERS[key]

    @cute.jit
    def drive(mI32: cute.Tensor, mRec: cute.Tensor, mId: cute.Tensor, mBase: cute.Tensor, lo: Int32, hi: Int32,
              EP: cutlass.Constexpr, EPL: cutlass.Constexpr):
        base = Int32(0)
        for m in cutlass.range_constexpr(EPL):
            bal = cutlass.Uint32(0)
            for lane in cutlass.range(LANES):
                if M.router_mine(lane + 32 * m, mI32[lane + 32 * m] != 0, lo, hi):
                    bal = bal | (cutlass.Uint32(1) << cutlass.Uint32(lane))
            for lane in cutlass.range(LANES):
                e = lane + 32 * m
                below = (cutlass.Uint32(1) << cutlass.Uint32(lane)) - cutlass.Uint32(1)
                slot = M.router_slot_of(base, bal, below)
                mine = M.router_mine(e, mI32[e] != 0, lo, hi)
                if mI32[e] != 0:
                    mI32[EP + e] = Int32(-1)
                if mine:
                    mI32[EP + e] = Int32(slot)
                    mRec[e] = slot
                    mId[e] = M.router_local(e, lo)
            base = M.router_round_end(base, bal)
        mBase[0] = base

    _DRIVERS[key] = drive
    return drive


def _mk_router_slots_host(M: ModuleType) -> Any:
    """Every thread's (token, slot) pairs idx = tidx, tidx + NT, ... of the ROUTER's last phase."""
    key = ("mk_router_slots", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NT = M.NT

    @cute.jit
    def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mW: cute.Tensor, mRec: cute.Tensor, cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        for tidx in cutlass.range(NT):
            for idx in cutlass.range(tidx, cfg.B * cfg.dmax, NT):
                w, u, ow, ou = M.router_slot(ctx, idx // cfg.dmax, idx % cfg.dmax)
                mW[idx] = w
                mRec[idx, 0] = Int64(u)
                mRec[idx, 1] = ow
                mRec[idx, 2] = ou

    _DRIVERS[key] = drive
    return drive


def _lists_host(M: ModuleType) -> Any:
    """The expert opcodes' prologue (``M._build_slot_lists``): per slot j of [s0, s1) (one warp each on the GPU;
    every list is its own warp's, so their order does not matter) the expert, per round of 32 tokens the ballot of
    the lanes' ``M.slot_take`` flags (``vote.ballot``: GPU only, built here), each used lane's list position
    (``M.router_slot_of`` with its mask of lower lanes) and ``M.slot_put``, the round's end, then ``M.slot_end``."""
    key = ("mk_lists", M)
    if key in _DRIVERS:
        return _DRIVERS[key]

    @cute.jit
    def lists(ctx: Any, s0: Int32, s1: Int32, WEIGHTS: cutlass.Constexpr):
        APL = -(-ctx.cfg.B // 32)
        for j in cutlass.range(s0, s1):
            e = M.slot_expert(ctx, j)
            base = Int32(0)
            for m in cutlass.range_constexpr(APL):
                bal = cutlass.Uint32(0)
                for lane in cutlass.range(LANES):
                    if M.slot_take(ctx, lane + 32 * m, j, e) != 0:
                        bal = bal | (cutlass.Uint32(1) << cutlass.Uint32(lane))
                for lane in cutlass.range(LANES):
                    below = (cutlass.Uint32(1) << cutlass.Uint32(lane)) - cutlass.Uint32(1)
                    if M.slot_take(ctx, lane + 32 * m, j, e) != 0:
                        M.slot_put(ctx, j - s0, M.router_slot_of(base, bal, below), lane + 32 * m, j, WEIGHTS)
                base = M.router_round_end(base, bal)
            M.slot_end(ctx, j - s0, base, e)

    _DRIVERS[key] = lists
    return lists


def _mk_gate_up_host(M: ModuleType) -> Any:
    """The prologue's slot lists, then every slot j of the instruction's [s0, s1), warp, row r = r0 + warp,
    r0 + warp + NW, ..., pass of ``M.gate_up_pass`` tokens and lane of an EXPERT_GATE_UP: the lane's gate / up
    partials of every token of the pass and the output offsets (records [j - s0, warp, it, list position])."""
    key = ("mk_gate_up", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NW, W_ARGS = M.NW, M.W_ARGS
    lists = _lists_host(M)

    @cute.jit
    def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mE: cute.Tensor, mPart: cute.Tensor, mOff: cute.Tensor, cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        T = M.gate_up_pass(cfg)
        EXP, CNT, _ = M.slot_lists(cfg)
        s0, s1, r0, r1 = mIns[W_ARGS], mIns[W_ARGS + 1], mIns[W_ARGS + 2], mIns[W_ARGS + 3]
        its = cute.size(mOff, mode=[2])
        lists(ctx, s0, s1, False)
        xv = M.gchunks(mAddr[0])
        xs, nch = M.gate_up_dims(ctx)
        ag = cute.make_rmem_tensor((T,), Float32)
        au = cute.make_rmem_tensor((T,), Float32)
        for jj in cutlass.range(s1 - s0):
            mE[jj] = mI32[EXP + jj]
            n = mI32[CNT + jj]
            if n > 0:
                e = mI32[EXP + jj]
                for warp in cutlass.range(NW):
                    it = Int32(0)
                    for r in cutlass.range(r0 + warp, r1, NW):
                        if it < its:
                            wg, wu = M.gate_up_rows(ctx, e, r)
                            for t0 in cutlass.range(0, n, T):
                                for lane in cutlass.range(LANES):
                                    M.gate_up_tile(ctx, xv, xs, nch, wg, wu, jj, t0, n, ag, au, lane)
                                    for t in cutlass.range_constexpr(T):
                                        if t0 + t < n:
                                            mPart[jj, warp, it, t0 + t, lane, 0] = ag[t]
                                            mPart[jj, warp, it, t0 + t, lane, 1] = au[t]
                                for t in cutlass.range_constexpr(T):
                                    if t0 + t < n:
                                        mOff[jj, warp, it, t0 + t] = M.gate_up_out(ctx, M.slot_token(ctx, jj, t0 + t),
                                                                                   s0 + jj, r)
                        it = it + 1

    _DRIVERS[key] = drive
    return drive


def _mk_down_host(M: ModuleType) -> Any:
    """The prologue's slot lists (tokens and router weights of every slot), then every warp, row r = r0 + warp, r0 +
    warp + NW, ..., used slot, pass of ``M.down_pass`` tokens and lane of a dense EXPERT_DOWN: the lane partials,
    per token their warp sum (replayed in the shuffle order), the weighted output and each lane's fp32 combine; the
    lanes' accumulators and output offsets per (warp, row iteration, b) come back."""
    key = ("mk_down", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NW, W_ARGS = M.NW, M.W_ARGS
    lists = _lists_host(M)

    @cute.jit
    def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mP: cute.Tensor, mT: cute.Tensor, mPT: cute.Tensor, mAcc: cute.Tensor,
              mOut: cute.Tensor, mOff: cute.Tensor, cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        T = M.down_pass(cfg)
        EXP, CNT, _ = M.slot_lists(cfg)
        APL = -(-cfg.B // 32)
        r0, r1 = mIns[W_ARGS + 2], mIns[W_ARGS + 3]
        its = cute.size(mOff, mode=[1])
        lists(ctx, Int32(0), Int32(cfg.dmax), True)
        hv = M.gchunks(mAddr[0])
        hs, nch = M.down_dims(ctx)
        a = cute.make_rmem_tensor((T,), Float32)
        for warp in cutlass.range(NW):
            it = Int32(0)
            for r in cutlass.range(r0 + warp, r1, NW):
                if it < its:
                    mAcc.fill(0.0)
                    for j in cutlass.range(cfg.dmax):
                        n = mI32[CNT + j]
                        if n > 0:
                            wv = M.down_row(ctx, mI32[EXP + j], r)
                            for t0 in cutlass.range(0, n, T):
                                for lane in cutlass.range(LANES):
                                    M.down_tile(ctx, hv, hs, nch, wv, j, t0, n, a, lane)
                                    for t in cutlass.range_constexpr(T):
                                        mPT[lane, t] = a[t]
                                for t in cutlass.range_constexpr(T):
                                    if t0 + t < n:
                                        for lane in cutlass.range(LANES):
                                            mP[lane] = mPT[lane, t]
                                        _bfly_sum(mP, mT)
                                        for lane in cutlass.range(LANES):
                                            M.down_combine(mAcc[lane, None], M.down_weighted(ctx, mP[lane], j, t0 + t),
                                                           M.slot_token(ctx, j, t0 + t), lane)
                    for lane in cutlass.range(LANES):
                        for m in cutlass.range_constexpr(APL):
                            b = lane + 32 * m
                            if b < cfg.B:
                                mOut[warp, it, b] = mAcc[lane, m]
                                mOff[warp, it, b] = M.down_out(ctx, b, r)
                it = it + 1

    _DRIVERS[key] = drive
    return drive


class _MmaRecord:
    """The host's stand-in for ``moe.fp4_mma_tile``'s tensor-core step (an ``mma.sync`` aborts a host run): each
    call runs ``mk_mma.mma_chunk`` with a sink, which writes the operands it assembles for its two mmas (a0..a3, b0,
    b1 as int32 bits) to row ``step`` of ``view`` [steps, 2, 6] instead of issuing them; :func:`_mma_steps` then
    evaluates the mmas."""

    def __init__(self, view: Any) -> None:
        self.view = view

    def __call__(self, acc: Any, wg: Any, wg8: Any, xg: Any, step: Any) -> None:
        from kimik3.kernels.megakernel import mma as mk_mma

        mk_mma.mma_chunk(acc, wg, wg8, xg, self.view[step, None, None])


def _mma_steps(rec: torch.Tensor, nb: int) -> list[torch.Tensor]:
    """Evaluate the recorded tensor-core steps of work items: ``rec`` [..., 32 lanes, steps, 2, 6] from
    :class:`_MmaRecord` (per step ``mma_chunk``'s two mmas, each (a0..a3, b0, b1)); step s feeds accumulator s % nb.
    Each mma runs through ``mk_mma.mma_reference`` on the lanes' registers in program order. Returns the nb
    accumulators [..., 32, 4] (C layout)."""
    from kimik3.kernels.megakernel import mma as mk_mma

    lead = rec.shape[:-4]
    accs = [torch.zeros(*lead, LANES, 4) for _ in range(nb)]
    r = rec.to(torch.int64) & 0xFFFFFFFF
    for s in range(rec.shape[-3]):
        for h in range(2):
            accs[s % nb] = mk_mma.mma_reference(r[..., s, h, 0:4], r[..., s, h, 4:6], accs[s % nb])
    return accs


def _poison(*shape: int) -> torch.Tensor:
    """An int32 register record whose every word is a bf16 NaN pair until the lane code writes it."""
    return torch.full(shape, 0x7FC07FC0, dtype=torch.int32)


def _dense_steps(M: ModuleType, cfg: Any, cols: int, op: str) -> int:
    """Recorded rows of one dense tensor-core work item over a weight of ``cols`` columns: per pass, every 32-column
    k block (a partial last one too)."""
    return -(-cols // (M.VEC * 4)) * M.mma_passes(cfg, op)


def _dense_mmas(rec: torch.Tensor, P: int) -> torch.Tensor:
    """Evaluate dense work items from their register sinks (``rec`` [..., 32 lanes, k blocks x P, 12, 1], row kb·P + p:
    pass p's block kb) with ``host_exec_mk_gemv.mma_tiles``: the fragments [..., P, 32, 4]."""
    from kimik3.kernels.verify.host_exec_mk_gemv import mma_tiles

    r = (rec[..., 0].to(torch.int64) & 0xFFFFFFFF)
    r = r.reshape(*r.shape[:-2], r.shape[-2] // P, P, r.shape[-1])  # [..., lanes, kb, P, 12]
    return mma_tiles(r.movedim(-2, -4))  # [..., P, lanes, kb, 12] -> [..., P, lanes, 4]


def _fp4_steps(ngr: int, nb: int) -> int:
    """Recorded steps of one MXFP4 work item: 4 words per k block of 4 groups, per weight."""
    return -(-ngr // 4) * 4 * nb


def _rec_tile(M: ModuleType, ctx: Any, j: cutlass.Constexpr, js: cutlass.Constexpr, e: Any, rt: Any, xv: Any,
              xs: Any, nk: Any, jj: Any, t0: Any, n: Any, acc: Any, lane: Any, rec: Any, DOWN: cutlass.Constexpr
              ) -> None:
    """One lane's share of one weight's tensor-core work item, its mma operands recorded into ``rec``: MXFP4
    (``M.fp4_tile_rows``, ``M.fp4_mma_tile`` with :class:`_MmaRecord`; ``rec`` [steps, 2, 6]; only EXPERT_DOWN's, as
    EXPERT_GATE_UP's steps both weights at once) or dense (``M.dense_mma_tile`` with its register sink; ``rec`` [k
    blocks x passes, 12, 1])."""
    if cutlass.const_expr(ctx.cfg.fp4):
        M.fp4_mma_tile(ctx, xv, xs, nk, M.fp4_tile_rows(ctx, j, js, e, rt, lane), None, jj, t0, n, acc[None, 0], None,
                       M.DOWN_BLOCKS, DOWN, lane, _MmaRecord(rec))
    else:
        M.dense_mma_tile(ctx, j, e, rt, xv, xs, nk, M.down_x if cutlass.const_expr(DOWN) else M.gate_up_x, jj, t0, n,
                         acc, M.mk_addr.EXPERT_MMA_BLOCKS, lane, rec[None, None, 0])


def _mk_gate_up_mma_host(M: ModuleType) -> Any:
    """Tensor-core EXPERT_GATE_UP (dense from batch 8, or MXFP4): the prologue's slot lists, then every slot j of [s0,
    s1), warp, row tile rt = r0 + 16·(warp + k·NW), group of passes of 8 list positions and lane: w1's and w3's work
    items (:func:`_rec_tile`; MXFP4 records both weights' steps interleaved in mRec, dense w1 in mRec and w3 in mRecU,
    [j - s0, warp, tile, group, lane, ...]), and each accumulator register's output offset (``M.mma_gate_up_out``, mOff
    [..., group, pass, lane, 4]; -1: not stored)."""
    key = ("mk_gate_up_mma", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NW, W_ARGS, R = M.NW, M.W_ARGS, M.FP4_ROWS
    lists = _lists_host(M)

    @cute.jit
    def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mE: cute.Tensor, mRec: cute.Tensor, mRecU: cute.Tensor, mOff: cute.Tensor,
              cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        EXP, CNT, _ = M.slot_lists(cfg)
        P = M.mma_passes(cfg, "gate_up")
        s0, s1, r0, r1 = mIns[W_ARGS], mIns[W_ARGS + 1], mIns[W_ARGS + 2], mIns[W_ARGS + 3]
        its = cute.size(mOff, mode=[2])
        lists(ctx, s0, s1, False)
        xv = M.gchunks(mAddr[0])
        xs, nk = M.gate_up_dims(ctx)
        ag = cute.make_rmem_tensor((4, P), Float32)
        au = cute.make_rmem_tensor((4, P), Float32)
        for jj in cutlass.range(s1 - s0):
            mE[jj] = mI32[EXP + jj]
            n = mI32[CNT + jj]
            if n > 0:
                e = mI32[EXP + jj]
                for warp in cutlass.range(NW):
                    it = Int32(0)
                    for rt in cutlass.range(r0 + warp * R, r1, NW * R):
                        if it < its:
                            for grp in cutlass.range(M.mma_groups(n, P)):
                                t0 = M.mma_pos(grp, 0, 0, P)
                                for lane in cutlass.range(LANES):
                                    rec = mRec[jj, warp, it, grp, lane, None, None, None]
                                    if cutlass.const_expr(cfg.fp4):
                                        M.fp4_mma_tile(ctx, xv, xs, nk, M.fp4_tile_rows(ctx, 3, 6, e, rt, lane),
                                                       M.fp4_tile_rows(ctx, 4, 7, e, rt, lane), jj, t0, n,
                                                       ag[None, 0], au[None, 0], M.GATE_UP_BLOCKS, False, lane,
                                                       _MmaRecord(rec))
                                    else:
                                        _rec_tile(M, ctx, 3, 6, e, rt, xv, xs, nk, jj, t0, n, ag, lane, rec, False)
                                        _rec_tile(M, ctx, 4, 7, e, rt, xv, xs, nk, jj, t0, n, au, lane,
                                                  mRecU[jj, warp, it, grp, lane, None, None, None], False)
                                    for p in cutlass.range_constexpr(P):
                                        for i in cutlass.range_constexpr(4):
                                            mOff[jj, warp, it, grp, p, lane, i] = M.mma_gate_up_out(
                                                ctx, s0, jj, M.mma_pos(grp, p, 0, P), n, rt, lane, i)
                        it = it + 1

    _DRIVERS[key] = drive
    return drive


def _mk_down_mma_host(M: ModuleType) -> Any:
    """Tensor-core EXPERT_DOWN (dense from batch 8, or MXFP4), in two drivers around the Python side's mmas.
    ``tiles``: the prologue's slot lists (tokens and router weights), then every row tile rt = r0 + 16·t of the box,
    used slot, group of passes of 8 list positions and lane: the work item (:func:`_rec_tile`, mRec [tile, slot, group,
    lane, ...]; an item's product does not depend on which warp computes it). ``combine``: from the evaluated fragments
    mFr [tile, slot, group, pass, lane, 4], the opcode's distribution and epilogue in the kernel's order:
    ``M.mma_down_split``, every warp's tiles and member slots, each accumulator register added to the warp's region of
    the stage scratch (``M.mma_down_add``, mPart; within a slot no two lanes share a (row, token), so the lane order
    is immaterial), then, after every warp (the barrier), each element summed over its tile's members in member order
    (``M.mma_down_sum``); the values and their offsets (``M.mma_down_out``) into mOut / mOff [tile, 16·B]."""
    key = ("mk_down_mma", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NW, W_ARGS, R = M.NW, M.W_ARGS, M.FP4_ROWS
    lists = _lists_host(M)

    @cute.jit
    def tiles(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mRec: cute.Tensor, cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        EXP, CNT, _ = M.slot_lists(cfg)
        P = M.mma_passes(cfg, "down")
        r0, r1 = mIns[W_ARGS + 2], mIns[W_ARGS + 3]
        lists(ctx, Int32(0), Int32(cfg.dmax), True)
        hv = M.gchunks(mAddr[0])
        hs, nk = M.down_dims(ctx)
        a = cute.make_rmem_tensor((4, P), Float32)
        for t in cutlass.range((r1 - r0 + R - 1) // R):
            for j in cutlass.range(cfg.dmax):
                n = mI32[CNT + j]
                if n > 0:
                    for grp in cutlass.range(M.mma_groups(n, P)):
                        for lane in cutlass.range(LANES):
                            _rec_tile(M, ctx, 4, 6, mI32[EXP + j], r0 + t * R, hv, hs, nk, j,
                                      M.mma_pos(grp, 0, 0, P), n, a, lane,
                                      mRec[t, j, grp, lane, None, None, None], True)

    @cute.jit
    def combine(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
                mF32: cute.Tensor, mPart: cute.Tensor, mFr: cute.Tensor, mOut: cute.Tensor, mOff: cute.Tensor,
                cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32, mPart)
        _, CNT, _ = M.slot_lists(cfg)
        P = M.mma_passes(cfg, "down")
        W = M.mma_down_part_words(cfg)
        r0 = mIns[W_ARGS + 2]
        ntiles, g = M.mma_down_split(ctx)
        for warp in cutlass.range(NW):
            mem = warp // cutlass.max(ntiles, 1)
            if mem < g:
                for t in cutlass.range(warp % cutlass.max(ntiles, 1), ntiles, NW):
                    for k in cutlass.range(W):
                        mPart[warp * W + k] = Float32(0.0)
                    for j in cutlass.range(mem, cfg.dmax, g):
                        n = mI32[CNT + j]
                        if n > 0:
                            for grp in cutlass.range(M.mma_groups(n, P)):
                                for p in cutlass.range_constexpr(P):
                                    for lane in cutlass.range(LANES):
                                        for i in cutlass.range_constexpr(4):
                                            M.mma_down_add(ctx, warp, mFr[t, j, grp, p, lane, i], j,
                                                           M.mma_pos(grp, p, M.acc_col(lane, i), P), n,
                                                           lane, i)
                    if g == 1:
                        for k in cutlass.range(W):
                            mOut[t, k] = mPart[warp * W + k]
                            mOff[t, k] = M.mma_down_out(ctx, r0 + t * R, k // cfg.B, k % cfg.B)
        if g > 1:  # after the barrier
            for t in cutlass.range(ntiles):
                for k in cutlass.range(W):
                    mOut[t, k] = M.mma_down_sum(ctx, t, k, ntiles, g)
                    mOff[t, k] = M.mma_down_out(ctx, r0 + t * R, k // cfg.B, k % cfg.B)

    _DRIVERS[key] = (tiles, combine)
    return tiles, combine


# ---------------------------------------------------------------------------------------------- one instruction
def exec_router(x: _Instr, M: ModuleType) -> dict[int, torch.Tensor]:
    """Host-execute ROUTER instruction ``x`` with the helpers of ``M`` (``megakernel.router`` or a mutated copy):
    every warp's tokens and lanes, warp 0's compaction, every thread's (token, slot) pairs; the selection, slot
    weights and use flags stored into ``x``'s poisoned outputs. Returns the elements each output must hold."""
    from kimik3.kernels.megakernel import operands as mk_operands

    words, shapes, boxes, cfg, B, out, run = x.words, x.shapes, x.boxes, x.cfg, x.B, x.out, x.run
    E = cfg.E
    EP, EPL = -(-E // 32) * 32, -(-E // 32)
    # the CTA's scratch (shared memory on the GPU): whatever a previous instruction left, here poison
    s_i32 = torch.full((mk_operands.I32_WORDS,), -77777, dtype=torch.int32)
    s_i32[:EP] = 0  # the opcode zeroes the used flags first
    s_f32 = torch.full((mk_operands.F32_WORDS,), float("nan"))
    ch, ix = torch.full((LANES, EPL), float("nan")), torch.full((LANES, EPL), -1, dtype=torch.int32)
    z = [torch.zeros(LANES) for _ in range(2)]
    zi = [torch.zeros(LANES, dtype=torch.int32) for _ in range(2)]
    _launch(_mk_router_host(M), [*words, s_i32, s_f32, ch, ix, z[0], zi[0], z[1], zi[1], torch.zeros(LANES)],
            (cfg,))
    # warp 0's compaction: this program's used experts (ROUTER args: a rank's own), ascending, into slots; each
    # stores its index among them at its slot
    lo, hi = (x.ins.args[0], x.ins.args[1]) if x.ins.args[1] > x.ins.args[0] else (0, E)
    crec = torch.full((EPL * LANES,), -1, dtype=torch.int32)
    cid = torch.full((EPL * LANES,), -1, dtype=torch.int64)
    cbase = torch.full((1,), -1, dtype=torch.int32)
    _launch(_mk_router_compact_host(M), [s_i32, crec, cid, cbase, lo, hi], (EP, EPL))
    sel, wsel = out(2)
    wsel = _Writes(wsel.name, sel.view(-1), run.problems)
    used = (crec >= 0).nonzero()[:, 0]
    wsel.store((crec[used].long(),), cid[used], "compaction")
    base = int(cbase[0])
    tail = [j for lane in range(LANES) for j in range(base + lane, cfg.dmax, 32)]
    if tail:
        wsel.store((torch.tensor(tail),), torch.full((len(tail),), -1), "compaction tail")
    wsel.check()
    n = B * cfg.dmax
    w = torch.full((n,), float("nan"))
    rec = torch.full((n, 3), -1, dtype=torch.int64)
    _launch(_mk_router_slots_host(M), [*words, s_i32, s_f32, w, rec], (cfg,))
    mw, wmw = out(3)
    use, wuse = out(4)
    _store(wmw, shapes[3], boxes[3], rec[:, 1], w, "slot weights")
    _store(wuse, shapes[4], boxes[4], rec[:, 2], rec[:, 0], "slot use")
    expect = {2: _box_mask(shapes[2], boxes[2]), 3: _box_mask(shapes[3], boxes[3]),
              4: _box_mask(shapes[4], boxes[4])}
    wmw.check(expect[3])
    wuse.check(expect[4])
    run.lanes_run += B * LANES
    return expect


def exec_expert_gate_up(x: _Instr, M: ModuleType) -> dict[int, torch.Tensor]:
    """Host-execute EXPERT_GATE_UP instruction ``x`` with the helpers of ``M`` (``megakernel.moe`` or a mutated
    copy): dense (the lanes' partials, warp sums and SiTU-GLU here) or MXFP4 (the recorded mma steps evaluated here).
    Returns the elements the hidden output must hold."""
    S, v, ins, words, shapes, boxes, cfg, B, out, run = (x.S, x.v, x.ins, x.words, x.shapes, x.boxes, x.cfg,
                                                         x.B, x.out, x.run)
    if M.expert_mma(cfg):
        smax, its = S.extent(ins.op)
        P = M.mma_passes(cfg, "gate_up")
        lead = (smax, M.NW, its, -(-B // (M.MMA_COLS * P)), LANES)
        e_rec = torch.full((smax,), -9, dtype=torch.int32)
        if cfg.fp4:
            # registers never recorded stay a bf16 NaN pair: a step the lane code skipped poisons the product
            rec = _poison(*lead, _fp4_steps(int(words[3][3]) // M.FP4_GROUP_BYTES, 2), 2, 6)
            recu = _poison(*[1] * 8)
        else:
            rec, recu = (_poison(*lead, _dense_steps(M, cfg, int(words[3][3]), "gate_up"), 12, 1) for _ in range(2))
        off = torch.full((*lead[:4], P, LANES, 4), -1, dtype=torch.int64)
        _launch(_mk_gate_up_mma_host(M), [*words, *_scratch(), e_rec, rec, recu, off], (cfg,))
        # the tensor-core steps (an mma.sync aborts a host run)
        if cfg.fp4:
            ga, ua = (t.unsqueeze(-3) for t in _mma_steps(rec, 2))
        else:
            ga, ua = _dense_mmas(rec, P), _dense_mmas(recu, P)
        h, wh = out(5)
        live = off >= 0
        from kimik3.model.modeling import glu

        # the epilogue: each accumulator register's (row, token), bf16 rounding, SiTU-GLU (approximate tanh / exp on
        # the GPU, exact here), one bf16 cast
        vals = glu(S.cfg, ga[live].to(torch.bfloat16), ua[live].to(torch.bfloat16))
        _store(wh, shapes[5], boxes[5], off[live], vals, "gate/up")
        expect = {5: _gate_up_expect(S, v, shapes[5])}
        wh.check(expect[5])
        run.lanes_run += int(live.any(-1).any(-1).sum()) * LANES
    else:
        s0, s1 = ins.args[:2]
        smax, its = S.extent(ins.op)  # fixed record shapes over the program: one compile per opcode
        e_rec = torch.full((smax,), -9, dtype=torch.int32)
        part = torch.full((smax, M.NW, its, B, LANES, 2), float("nan"))
        off = torch.full((smax, M.NW, its, B), -1, dtype=torch.int64)
        _launch(_mk_gate_up_host(M), [*words, *_scratch(), e_rec, part, off], (cfg,))
        h, wh = out(5)
        live = off >= 0
        from kimik3.model.modeling import glu

        # the thin layer: warp sums (shuffle order), bf16 rounding, SiTU-GLU (approximate tanh / exp on the GPU,
        # exact here), one bf16 cast
        ga = warp_sum(part[..., 0], 4)[live].to(torch.bfloat16)
        ua = warp_sum(part[..., 1], 4)[live].to(torch.bfloat16)
        vals = glu(S.cfg, ga, ua)
        _store(wh, shapes[5], boxes[5], off[live], vals, "gate/up")
        expect = {5: _gate_up_expect(S, v, shapes[5])}
        wh.check(expect[5])
        run.lanes_run += int(live.sum()) * LANES
    return expect


def exec_expert_down(x: _Instr, M: ModuleType) -> dict[int, torch.Tensor]:
    """Host-execute EXPERT_DOWN instruction ``x`` with the helpers of ``M`` (``megakernel.moe`` or a mutated copy):
    dense (partials, the warp sums replayed, the opcode's own fp32 combine) or MXFP4 (recorded mma steps, then the
    opcode's distribution and cross-warp sum). Returns the elements the combined output must hold."""
    S, ins, words, shapes, boxes, cfg, B, out, run = (x.S, x.ins, x.words, x.shapes, x.boxes, x.cfg, x.B, x.out,
                                                      x.run)
    if M.expert_mma(cfg):
        from kimik3.kernels.megakernel.operands import PART_WORDS

        _, its = S.extent(ins.op)
        P = M.mma_passes(cfg, "down")
        nt = its * M.NW
        lead = (nt, cfg.dmax, -(-B // (M.MMA_COLS * P)), LANES)
        if cfg.fp4:
            rec = _poison(*lead, _fp4_steps(int(words[3][4]) // M.FP4_GROUP_BYTES, 1), 2, 6)
        else:
            rec = _poison(*lead, _dense_steps(M, cfg, int(words[3][4]), "down"), 12, 1)
        tiles, combine = _mk_down_mma_host(M)
        scratch = _scratch()
        _launch(tiles, [*words, *scratch, rec], (cfg,))
        # the tensor-core steps (an mma.sync aborts a host run)
        fr = _mma_steps(rec, 1)[0].unsqueeze(-3) if cfg.fp4 else _dense_mmas(rec, P)
        W = M.mma_down_part_words(cfg)
        res = torch.full((nt, W), float("nan"))
        off = torch.full((nt, W), -1, dtype=torch.int64)
        _launch(combine, [*words, *scratch, torch.full((PART_WORDS,), float("nan")), fr, res, off], (cfg,))
        y, wy = out(5)
        live = off >= 0
        _store(wy, shapes[5], boxes[5], off[live], res[live], "down")
        expect = {5: _box_mask(shapes[5], boxes[5])}
        wy.check(expect[5])
        run.lanes_run += int(live.any(-1).sum()) * LANES
    else:
        _, its = S.extent(ins.op)
        APL = -(-B // 32)
        acc = torch.zeros((LANES, APL))
        res = torch.full((M.NW, its, B), float("nan"))
        off = torch.full((M.NW, its, B), -1, dtype=torch.int64)
        pt = torch.full((LANES, M.down_pass(cfg)), float("nan"))
        _launch(_mk_down_host(M), [*words, *_scratch(), torch.zeros(LANES), torch.zeros(LANES), pt, acc, res, off],
                (cfg,))
        y, wy = out(5)
        live = off >= 0
        _store(wy, shapes[5], boxes[5], off[live], res[live], "down")
        expect = {5: _box_mask(shapes[5], boxes[5])}
        wy.check(expect[5])
        run.lanes_run += int(live.sum()) * LANES
    return expect


def _gate_up_expect(S: _MkSetup, v: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The hidden elements EXPERT_GATE_UP instruction v must store: rows [r0, r1) of the slots holding an expert, for
    the tokens that use them."""
    s0, s1, r0, r1 = S.p.instructions[v].args
    sel = S.views(v)[1]
    use = S.views(v)[2][:, 0, :].bool()  # [B, s1 - s0]
    m = torch.zeros(shape, dtype=torch.bool)
    for jj in range(s1 - s0):
        if int(sel.reshape(-1)[jj]) >= 0:
            m[:, s0 + jj, r0:r1] |= use[:, jj, None].expand(-1, r1 - r0)
    return m
