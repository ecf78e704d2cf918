"""Host execution of the router's top-k and of the megakernel's MoE and misc opcodes: the same ``@cute.jit`` helpers
the GPU code calls, run on CPU tensors over every block / warp / lane of a real launch (see ``host_exec``).

* The fused router's ``topk_kernel`` (``router.py``): per lane the candidates (``topk_candidates``), the lane's
  arg-max (``_local_argmax``), the retirement of the winner (``topk_retire``), grouped routing's group candidates
  and mask (``topk_group_candidates``, ``topk_group_mask``) and the weight (``topk_weight``) run as the kernel calls
  them; the butterfly arg-max across the warp (shuffles: GPU only) is replayed in the driver in
  the shuffle order (offsets 16, 8, 4, 2, 1, every lane comparing with its partner ``lane ^ off`` through the
  kernel's own tie-break ``argmax_take``), the renormalisation's warp sum in ``host_exec.warp_sum``'s order.
* The megakernel's ROUTER, EXPERT_GATE_UP, EXPERT_DOWN (``mk_moe.py``) and EMBED, ATTN_RES_MIX, ARGMAX
  (``mk_misc.py``), instruction by instruction of a real program (``kimik3.megakernel.build_program``): the
  instruction's words, its operands' addresses and dims are what the VM's fetch puts in shared memory (here host
  tensors holding the same words; the addresses point at CPU buffers), and the helpers the opcode calls decide which
  slot / expert / row / token / chunk a warp, lane or thread handles and compute the per-lane partials. The thin
  GPU layer is replayed in the kernel's order: the ROUTER's butterfly arg-max (through ``mk_moe.router_take``) and
  EXPERT_DOWN's warp sum inside the drivers (so that the opcode's own weighted fp32 combine runs on the sums), the
  ROUTER's ballot (built from the lanes' flags; each lane's slot by ``mk_moe.router_slot_of``) and the expert
  opcodes' slot-list prologue (the same ballot over ``mk_moe.slot_take`` flags, ``slot_put`` / ``slot_end`` into a
  poisoned scratch) too, the other warp sums, the CTA reduction and the epilogues in Python; every store
  goes through ``host_exec._Writes`` into NaN-poisoned outputs (element offsets decomposed into ``[b, r, c]`` of the
  operand's buffer, so a store outside the declared box is reported too). The reference is the
  CPU interpreter's implementation of the opcode (``kimik3.megakernel.interpreter``) on the same input buffers.
  A program built with ``expert_format="mxfp4"`` (case key ``expert_format``) runs the kernel compiled with
  ``MKConfig.fp4``: the expert opcodes' tensor-core work items (16 rows x 8 tokens) against the interpreter's
  dequantise-then-dense bodies, on random codes and scales of a realistic range. Every lane's code runs as on the
  GPU (row and group addresses, code / scale / x loads, the decode to bf16x2, the x pair order, the fragment
  registers, the epilogues' (row, token) of each accumulator register); only ``mma.sync`` itself (warp-collective,
  device-only) is replaced: each lane's registers are recorded (``_MmaRecord``) and the mmas evaluated in program
  order by ``mk_mma.mma_reference`` (``_mma_steps``); EXPERT_DOWN's column shuffles are replayed by indexing the
  evaluated fragments.

What the thin layer computes with approximate instructions (SiTU-GLU's ``tanh.approx`` / ``ex2.approx``, the
AttnRes softmax) is evaluated here in exact fp32, as in ``host_exec``. Run in a subprocess when a helper may be
mutated: a device-only instruction reached on the host aborts the process.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from kimik3.kernels.common.trace import host_trace
from kimik3.kernels.fused import router as _router
from kimik3.kernels.verify.host_exec import (
    LANES,
    HostRun,
    _t,
    _Writes,
    case_result,
    cases_main,
    load_case_mutant,
    warp_sum,
)

__all__ = ["run_topk", "topk_spec", "run_case", "main"]

_DRIVERS: dict[tuple[str, Any], Any] = {}
_COMPILED: dict[tuple[Any, ...], Any] = {}


def _launch(drive: Any, args: list[Any], consts: tuple[Any, ...] = ()) -> None:
    """Call a host driver: traced and compiled once per driver, argument shapes and constants (tracing costs far
    more than running), then called on the tensors' current contents. ``consts`` are the trailing Constexprs."""
    sig = (id(drive), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else "i32" for a in args),
           consts)
    wrapped = [_t(a) if isinstance(a, torch.Tensor) else Int32(a) for a in args]
    if sig not in _COMPILED:
        with host_trace():
            _COMPILED[sig] = cute.compile(drive, *wrapped, *consts)
    _COMPILED[sig](*wrapped)


# ---------------------------------------------------------------------------------------------- fused router top-k
def _topk_host(R: ModuleType) -> Any:
    """Every CTA, warp and lane of a ``topk_kernel`` launch: (grouped routing: each group's two best through the
    same rounds, the group mask) the k rounds of lane arg-max, butterfly (replayed in the shuffle order with
    ``R.argmax_take``) and retirement, then each lane's weight before the renormalisation."""
    key = ("topk", R)
    if key in _DRIVERS:
        return _DRIVERS[key]
    token, cand, local, take, retire, weight = (R.topk_token, R.topk_candidates, R._local_argmax, R.argmax_take,
                                                R.topk_retire, R.topk_weight)
    group_cand, group_mask = R.topk_group_candidates, R.topk_group_mask
    wpc = R.TOKENS_PER_CTA

    @cute.jit
    def warp_argmax(mV: cute.Tensor, mIx: cute.Tensor, mBv: cute.Tensor, mBi: cute.Tensor, mTv: cute.Tensor,
                    mTi: cute.Tensor):
        """``_warp_argmax(*_local_argmax(v, ix))`` of every lane: lane l's result in mBv[l], mBi[l]."""
        for lane in cutlass.range(LANES):
            bv, bi = local(mV[lane, None], mIx[lane, None])
            mBv[lane] = bv
            mBi[lane] = bi
        for off in cutlass.range(5):  # shfl.sync.bfly: every lane reads before any writes
            for lane in cutlass.range(LANES):
                mTv[lane] = mBv[lane]
                mTi[lane] = mBi[lane]
            for lane in cutlass.range(LANES):
                o = lane ^ (Int32(16) >> off)
                if take(mTv[o], mTi[o], mTv[lane], mTi[lane]):
                    mBv[lane] = mTv[o]
                    mBi[lane] = mTi[o]

    @cute.jit
    def drive(mS: cute.Tensor, mBias: cute.Tensor, mV: cute.Tensor, mIx: cute.Tensor, mMv: cute.Tensor,
              mG: cute.Tensor, mB1: cute.Tensor, mBv: cute.Tensor, mBi: cute.Tensor, mTv: cute.Tensor,
              mTi: cute.Tensor, mTok: cute.Tensor, mMy: cute.Tensor, mW: cute.Tensor, ncta: Int32,
              TOPK: cutlass.Constexpr, NGROUP: cutlass.Constexpr, TOPK_GROUP: cutlass.Constexpr):
        B, E = cute.size(mS, mode=[0]), cute.size(mS, mode=[1])
        for c in cutlass.range(ncta):
            for warp in cutlass.range(wpc):
                slot = c * wpc + warp
                tok = token(c, warp)
                mTok[slot] = tok
                if tok < B:  # the kernel's warp-uniform guard
                    for lane in cutlass.range(LANES):
                        cand(mS, mBias, tok, lane, mV[slot, lane, None], mIx[slot, lane, None])
                    if const_expr(NGROUP > 1 and TOPK_GROUP < NGROUP):
                        GS = E // NGROUP
                        for g in cutlass.range_constexpr(NGROUP):
                            for lane in cutlass.range(LANES):
                                group_cand(mV[slot, lane, None], mIx[slot, lane, None], g, GS, mMv[lane, None])
                            warp_argmax(mMv, mIx[slot, None, None], mBv, mBi, mTv, mTi)
                            for lane in cutlass.range(LANES):
                                mB1[lane] = mBv[lane]
                                retire(mMv[lane, None], mIx[slot, lane, None], mBi[lane])
                            warp_argmax(mMv, mIx[slot, None, None], mBv, mBi, mTv, mTi)
                            for lane in cutlass.range(LANES):
                                mG[lane, g] = mB1[lane] + mBv[lane]
                        for lane in cutlass.range(LANES):
                            group_mask(mV[slot, lane, None], mIx[slot, lane, None], mG[lane, None], GS, NGROUP,
                                       TOPK_GROUP)
                    for r in cutlass.range(TOPK):  # dynamic loops: the kernel unrolls, the replay need not
                        warp_argmax(mV[slot, None, None], mIx[slot, None, None], mBv, mBi, mTv, mTi)
                        for lane in cutlass.range(LANES):
                            retire(mV[slot, lane, None], mIx[slot, lane, None], mBi[lane])
                            if lane == r:
                                mMy[slot, lane] = mBi[lane]
                    for lane in cutlass.range(LANES):
                        mW[slot, lane] = weight(mS, tok, lane, mMy[slot, lane], TOPK)

    _DRIVERS[key] = drive
    return drive


def run_topk(scores: torch.Tensor, bias: torch.Tensor, *, topk: int, n_group: int = 1, topk_group: int = 1,
             scale: float = 1.0, renorm: bool = True, module: ModuleType | None = None) -> HostRun:
    """The ``topk_kernel`` launch on the host from fp32 sigmoid scores [B, E] and the choice bias [E]: outputs
    ``ids`` int32 [B, k] (descending choice order) and ``weights`` fp32 [B, k]."""
    R = _router if module is None else module
    B, E = scores.shape
    if not 1 <= topk <= min(E, LANES):
        raise ValueError(f"run_topk: topk={topk} must be in 1..min(E={E}, 32)")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"run_topk: n_group={n_group} must divide E={E}, topk_group={topk_group} in 1..n_group")
    J = -(-E // LANES)
    wpc = R.TOKENS_PER_CTA
    ncta = -(-B // wpc)
    ns = ncta * wpc
    v = torch.full((ns, LANES, J), float("nan"))
    ix = torch.full((ns, LANES, J), -1, dtype=torch.int32)
    mv = torch.full((LANES, J), float("nan"))
    gs = torch.full((LANES, n_group), float("nan"))
    b1, bv, tv = torch.zeros(LANES), torch.zeros(LANES), torch.zeros(LANES)
    bi, ti = torch.zeros(LANES, dtype=torch.int32), torch.zeros(LANES, dtype=torch.int32)
    tok = torch.full((ns,), -1, dtype=torch.int32)
    my = torch.zeros((ns, LANES), dtype=torch.int32)  # the kernel's my_id = Int32(0) on every lane
    w = torch.full((ns, LANES), float("nan"))
    s, b = scores.float().contiguous(), bias.float().contiguous()
    _launch(_topk_host(R), [s, b, v, ix, mv, gs, b1, bv, bi, tv, ti, tok, my, w, ncta], (topk, n_group, topk_group))
    ids = torch.full((B, topk), -1, dtype=torch.int32)
    wts = torch.full((B, topk), float("nan"))
    run = HostRun({"ids": ids, "weights": wts})
    live = (tok >= 0) & (tok < B)
    run.lanes_run = int(live.sum()) * LANES
    if renorm and topk > 1:
        w = w / (warp_sum(w, 1)[:, None] + 1e-20)
    w = w * scale
    lanes = torch.arange(topk)
    rows = tok[live].long()[:, None].expand(-1, topk)
    _Writes("ids", ids, run.problems).store((rows, lanes.expand_as(rows)), my[live][:, :topk], "topk")
    wr = _Writes("weights", wts, run.problems)
    wr.store((rows, lanes.expand_as(rows)), w[live][:, :topk], "topk")
    wr.check()
    return run


def topk_spec(scores: torch.Tensor, bias: torch.Tensor, topk: int, scale: float = 1.0, renorm: bool = True,
              n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k's specification: the k largest choice scores (s + bias), equal ones in ascending expert id
    (a stable sort), weights from the unbiased scores, renormalised (+1e-20) and scaled. (ids int32, weights).
    Grouped routing (n_group > topk_group): only the experts of the ``topk_group`` groups with the largest sum of
    their two best choice scores (equal sums: the lower group id) compete."""
    choice = scores.float() + bias.float()
    if n_group > 1 and topk_group < n_group:
        B, E = choice.shape
        g = choice.view(B, n_group, E // n_group).sort(dim=-1, descending=True).values[..., :2].sum(-1)
        keep = torch.sort(g, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        mask = torch.zeros(B, n_group, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = scores.float().gather(1, idx)
    if renorm and topk > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx.to(torch.int32), w * scale


def _router_case(case: dict[str, Any], shapes: dict[str, Any], mod: ModuleType | None
                 ) -> tuple[HostRun, dict[str, float], str]:
    """The fused router: scores from the host-executed GEMV (sigmoid epilogue), then the host-executed top-k.
    ``router.ties``: scores on a coarse grid (many equal choice scores) and no bias, so the tie-break decides."""
    from kimik3.kernels.fused import gemv
    from kimik3.kernels.verify.host_exec import run_gemv

    from kimik3.validation.metric import rel_error

    t = _router.make_inputs("router", **shapes, seed=int(case.get("seed", 0)))
    if case.get("gemv", True):
        g = run_gemv("f32out", {"W": t["W"], "x": t["x"], "y": t["scores"]}, module=gemv, act="sigmoid")
    else:  # the top-k alone, from the reference's scores (the scores GEMV at these widths: tests/test_host_exec.py)
        g = HostRun({"y": t["scores"].copy_(_router.reference("router", t, **shapes)["scores"])})
    kw = {k: shapes[k] for k in ("topk", "n_group", "topk_group", "scale", "renorm") if k in shapes}
    if case["family"] == "router.ties":
        scores, bias = torch.round(t["scores"] * 8) / 8, torch.zeros_like(t["bias"])
    else:
        scores, bias = t["scores"], t["bias"]
    run = run_topk(scores, bias, **kw, module=mod)
    run.problems += g.problems
    ids, wts = topk_spec(scores, bias, shapes["topk"], shapes.get("scale", 1.0), shapes.get("renorm", True),
                         shapes.get("n_group", 1), shapes.get("topk_group", 1))
    errors = {}
    if not torch.equal(run.outputs["ids"], ids):
        bad = (run.outputs["ids"] != ids).any(1).nonzero()[:, 0]
        run.problems.append(f"ids: {len(bad)} token(s) differ from the stable top-k of the same scores, first "
                            f"token {int(bad[0])}: {run.outputs['ids'][bad[0]].tolist()} vs {ids[bad[0]].tolist()}")
    errors["weights_spec"] = rel_error(run.outputs["weights"], wts)
    if case["family"] == "router":  # against the model's router on x, W (its own fp32 logits)
        ref = _router.reference("router", t, **shapes)
        if not torch.equal(ids, ref["ids"]):
            run.problems.append("ids: the top-k of the host GEMV's scores differs from the model's router")
        errors["weights"] = rel_error(run.outputs["weights"], ref["weights"])
        errors["scores"] = rel_error(g.outputs["y"], ref["scores"])
    return run, errors, "kernel_state_fp32"


# ---------------------------------------------------------------------------------------------- megakernel opcodes
MK_OPS = ("ROUTER", "EXPERT_GATE_UP", "EXPERT_DOWN", "EMBED", "ATTN_RES_MIX", "ARGMAX")


@cute.jit
def _bfly_sum(mP: cute.Tensor, mT: cute.Tensor) -> None:
    """``warp_sum`` replayed over a [32] tensor of lane values: at offsets 16, 8, 4, 2, 1 every lane adds its
    partner's value (read before any lane writes) to its own; every lane ends with the same bits."""
    for off in cutlass.range_constexpr(5):
        for lane in cutlass.range(LANES):
            mT[lane] = mP[lane]
        for lane in cutlass.range(LANES):
            mP[lane] = mT[lane] + mT[lane ^ (16 >> off)]


def _ctx(M: ModuleType, cfg: Any, mIns: Any, mAddr: Any, mD1: Any, mD2: Any, mI32: Any = None, mF32: Any = None
         ) -> Any:
    """The opcode's context as the VM's fetch leaves it (instruction words, operand addresses and dims), with host
    tensors in place of shared memory; no thread indices: the drivers pass lanes and threads explicitly."""
    return M._Ctx(cfg=cfg, s_ins=mIns, s_addr=mAddr, s_d1=mD1, s_d2=mD2, s_i32=mI32, s_f32=mF32)


def _mk_router_host(M: ModuleType) -> Any:
    """Every warp's tokens (b = warp, warp + NW, ...) and lane of a ROUTER instruction: candidates, the k rounds of
    lane best / butterfly (``M.router_take``, shuffle order) / retirement, the weights and lane 0's records."""
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
                            if M.router_take(mTv[o], mTi[o], mTv[lane], mTi[lane]):
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
    does, and per expert the slot it stores its id at (mRec, -1: unused); mBase[0]: the slots taken."""
    key = ("mk_router_compact", M)
    if key in _DRIVERS:
        return _DRIVERS[key]

    @cute.jit
    def drive(mI32: cute.Tensor, mRec: cute.Tensor, mBase: cute.Tensor, EP: cutlass.Constexpr,
              EPL: cutlass.Constexpr):
        base = Int32(0)
        for m in cutlass.range_constexpr(EPL):
            bal = cutlass.Uint32(0)
            for lane in cutlass.range(LANES):
                if mI32[lane + 32 * m] != 0:
                    bal = bal | (cutlass.Uint32(1) << cutlass.Uint32(lane))
            for lane in cutlass.range(LANES):
                e = lane + 32 * m
                below = (cutlass.Uint32(1) << cutlass.Uint32(lane)) - cutlass.Uint32(1)
                slot = M.router_slot_of(base, bal, below)
                if mI32[e] != 0:
                    mI32[EP + e] = slot
                    mRec[e] = slot
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
    """The host's stand-in for ``mk_moe.fp4_mma_tile``'s tensor-core step (an ``mma.sync`` aborts a host run): each
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


def _fp4_steps(ngr: int, nb: int) -> int:
    """Recorded steps of one MXFP4 work item: 4 words per k block of 4 groups, per weight."""
    return -(-ngr // 4) * 4 * nb


def _mk_gate_up_fp4_host(M: ModuleType) -> Any:
    """MXFP4 EXPERT_GATE_UP: the prologue's slot lists, then every slot j of [s0, s1), warp, row tile rt = r0 +
    16·(warp + k·NW), pass of 8 list positions and lane: ``M.fp4_tile_rows`` and ``M.fp4_mma_tile`` with the mma step
    recorded (mRec [j - s0, warp, tile, pass, lane, step, 2, 6]), and each accumulator register's output offset
    (``M.fp4_gate_up_out``, mOff [..., lane, 4]; -1: not stored)."""
    key = ("mk_gate_up_fp4", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NW, W_ARGS, R, C = M.NW, M.W_ARGS, M.FP4_ROWS, M.MMA_COLS
    lists = _lists_host(M)

    @cute.jit
    def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mE: cute.Tensor, mRec: cute.Tensor, mOff: cute.Tensor, cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        EXP, CNT, _ = M.slot_lists(cfg)
        s0, s1, r0, r1 = mIns[W_ARGS], mIns[W_ARGS + 1], mIns[W_ARGS + 2], mIns[W_ARGS + 3]
        its = cute.size(mOff, mode=[2])
        lists(ctx, s0, s1, False)
        xv = M.gchunks(mAddr[0])
        xs, ngr = M.gate_up_dims(ctx)
        ag = cute.make_rmem_tensor((4,), Float32)
        au = cute.make_rmem_tensor((4,), Float32)
        for jj in cutlass.range(s1 - s0):
            mE[jj] = mI32[EXP + jj]
            n = mI32[CNT + jj]
            if n > 0:
                e = mI32[EXP + jj]
                for warp in cutlass.range(NW):
                    it = Int32(0)
                    for rt in cutlass.range(r0 + warp * R, r1, NW * R):
                        if it < its:
                            for t0 in cutlass.range(0, n, C):
                                k = t0 // C
                                for lane in cutlass.range(LANES):
                                    wg = M.fp4_tile_rows(ctx, 3, 6, e, rt, lane)
                                    wu = M.fp4_tile_rows(ctx, 4, 7, e, rt, lane)
                                    rec = _MmaRecord(mRec[jj, warp, it, k, lane, None, None, None])
                                    M.fp4_mma_tile(ctx, xv, xs, ngr, wg, wu, jj, t0, n, ag, au, M.GATE_UP_BLOCKS,
                                                   False, lane, rec)
                                    for i in cutlass.range_constexpr(4):
                                        mOff[jj, warp, it, k, lane, i] = M.fp4_gate_up_out(ctx, s0, jj, t0, n, rt,
                                                                                           lane, i)
                        it = it + 1

    _DRIVERS[key] = drive
    return drive


def _mk_down_fp4_host(M: ModuleType) -> Any:
    """MXFP4 EXPERT_DOWN, in two drivers around the Python side's mmas. ``tiles``: the prologue's slot lists (tokens
    and router weights), then every row tile rt = r0 + 16·t of the box, used slot, pass of 8 list positions and lane:
    ``M.fp4_tile_rows`` and ``M.fp4_mma_tile`` with the mma step recorded (mRec [tile, slot, pass, lane, step, 2, 6]; an
    item's product does not depend on which warp computes it). ``combine``: from the evaluated fragments mFr [tile,
    slot, pass, lane, 4], the opcode's distribution and epilogue in the kernel's order: ``M.fp4_down_split``, every
    warp's tiles and member slots with ``M.fp4_down_item`` (its column shuffles replayed by indexing the source
    lane's fragment), each member >= 1's combine into the scratch (``M.fp4_down_part_put``), then, after every warp
    (the barrier), member 0 of each tile adding them in member order (``M.fp4_down_part_sum``); each lane's final
    accumulators and their offsets (``M.fp4_down_out``) into mOut / mOff [tile, lane, 2, m]."""
    key = ("mk_down_fp4", M)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NW, W_ARGS, R, C = M.NW, M.W_ARGS, M.FP4_ROWS, M.MMA_COLS
    lists = _lists_host(M)

    @cute.jit
    def tiles(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
              mF32: cute.Tensor, mRec: cute.Tensor, cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        EXP, CNT, _ = M.slot_lists(cfg)
        r0, r1 = mIns[W_ARGS + 2], mIns[W_ARGS + 3]
        lists(ctx, Int32(0), Int32(cfg.dmax), True)
        hv = M.gchunks(mAddr[0])
        hs, ngr = M.down_dims(ctx)
        a = cute.make_rmem_tensor((4,), Float32)
        for t in cutlass.range((r1 - r0 + R - 1) // R):
            for j in cutlass.range(cfg.dmax):
                n = mI32[CNT + j]
                if n > 0:
                    for t0 in cutlass.range(0, n, C):
                        for lane in cutlass.range(LANES):
                            wv = M.fp4_tile_rows(ctx, 4, 6, mI32[EXP + j], r0 + t * R, lane)
                            M.fp4_mma_tile(ctx, hv, hs, ngr, wv, None, j, t0, n, a, None, M.DOWN_BLOCKS, True, lane,
                                           _MmaRecord(mRec[t, j, t0 // C, lane, None, None, None]))

    @cute.jit
    def combine(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mI32: cute.Tensor,
                mF32: cute.Tensor, mFr: cute.Tensor, mAcc: cute.Tensor, mOut: cute.Tensor, mOff: cute.Tensor,
                cfg: cutlass.Constexpr):
        ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2, mI32, mF32)
        _, CNT, _ = M.slot_lists(cfg)
        r0 = mIns[W_ARGS + 2]
        MW = M.fp4_combine_width(cfg)
        ntiles, g = M.fp4_down_split(ctx)
        for warp in cutlass.range(NW):
            mem = warp // cutlass.max(ntiles, 1)
            if mem < g:
                for t in cutlass.range(warp % cutlass.max(ntiles, 1), ntiles, NW):
                    for lane in cutlass.range(LANES):
                        mAcc[warp, lane, None, None].fill(0.0)
                    for j in cutlass.range(mem, cfg.dmax, g):
                        n = mI32[CNT + j]
                        if n > 0:
                            for t0 in cutlass.range(0, n, C):
                                for lane in cutlass.range(LANES):
                                    M.fp4_down_item(ctx, mAcc[warp, lane, None, None], mFr[t, j, t0 // C, None, None],
                                                    j, t0, n, lane, _shfl_host)
                    for lane in cutlass.range(LANES):
                        if g > 1:
                            if mem > 0:
                                M.fp4_down_part_put(ctx, mAcc[warp, lane, None, None], warp - ntiles, lane)
                        else:
                            for h in cutlass.range_constexpr(2):
                                for m in cutlass.range_constexpr(MW):
                                    mOut[t, lane, h, m] = mAcc[warp, lane, h, m]
                                    mOff[t, lane, h, m] = M.fp4_down_out(ctx, r0 + t * R, lane, h, m)
        if g > 1:  # after the barrier
            for warp in cutlass.range(NW):
                if warp < ntiles:
                    for lane in cutlass.range(LANES):
                        M.fp4_down_part_sum(ctx, mAcc[warp, lane, None, None], warp, ntiles, g, lane)
                        for h in cutlass.range_constexpr(2):
                            for m in cutlass.range_constexpr(MW):
                                mOut[warp, lane, h, m] = mAcc[warp, lane, h, m]
                                mOff[warp, lane, h, m] = M.fp4_down_out(ctx, r0 + warp * R, lane, h, m)

    _DRIVERS[key] = (tiles, combine)
    return tiles, combine


@cute.jit
def _shfl_host(a: cute.Tensor, i: cutlass.Constexpr, src: Any) -> Float32:
    """``shfl.sync.idx`` of register i from lane ``src``, replayed on the host: ``a`` is every lane's fragment
    [32, 4]."""
    return a[src, i]


def _mk_misc_host(X: ModuleType, which: str) -> Any:
    """EMBED: every token of the box, its table-row and output offsets. ARGMAX: every thread tidx < B, the offsets
    of its pick. ATTN_RES_MIX: phase 0 every thread's partial sums; phase 1 every thread's chunks of the mix."""
    key = ("mk_misc", which, X)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NT, VEC, W_ARGS, B0, B1 = X.NT, X.VEC, X.W_ARGS, X.B0, X.B1

    if which == "embed":
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mRec: cute.Tensor,
                  cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            for b in cutlass.range(X._bx(ctx, 0, B0), X._bx(ctx, 0, B1)):
                so, do = X.embed_row(ctx, b)
                mRec[b, 0] = so
                mRec[b, 1] = do
    elif which == "argmax":
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mRec: cute.Tensor,
                  cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            for tidx in cutlass.range(NT):
                if tidx < cfg.B:
                    src, dst = X.argmax_pick(ctx, tidx)
                    mRec[tidx, 0] = src
                    mRec[tidx, 1] = dst
    else:
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mVals: cute.Tensor,
                  mOut: cute.Tensor, mOff: cute.Tensor, PHASE: cutlass.Constexpr, cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            K = mIns[W_ARGS + 1]
            nch = mD2[0] // VEC
            vals = cute.make_rmem_tensor((2 * cfg.kmax,), Float32)
            ro = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            for b in cutlass.range(X._bx(ctx, 0, B0), X._bx(ctx, 0, B1)):
                sv = X.mix_row(ctx, b)
                mOff[b] = X.mix_out(ctx, b)
                for tidx in cutlass.range(NT):
                    if const_expr(PHASE == 0):
                        X.mix_partials(ctx, sv, K, nch, tidx, vals)
                        for i in cutlass.range_constexpr(2 * cfg.kmax):
                            mVals[b, tidx, i] = vals[i]
                    else:
                        for i in cutlass.range_constexpr(cfg.kmax):  # the softmax weights (the thin layer's)
                            vals[i] = mVals[b, 0, i]
                        for c in cutlass.range(tidx, nch, NT):
                            X.mix_chunk(ctx, sv, K, nch, vals, Float32(1.0), c, ro)
                            for v in cutlass.range_constexpr(VEC):
                                mOut[b, c, v] = ro[v]

    _DRIVERS[key] = drive
    return drive


_PROGRAMS: dict[tuple[Any, ...], Any] = {}


class _MkSetup:
    """A megakernel program and CPU buffers for the opcodes under test: instruction words as the device reads
    them, every referenced buffer allocated at its declared shape (weights untouched until needed: the experts'
    rows are filled per instruction, so k3-shard expert tensors cost only the rows an instruction reads), inputs
    random, and the interpreter's opcode bodies run in program order so each instruction reads what its
    producers wrote."""

    def __init__(self, preset: str, batch: int, *, policy: str = "critical_path", sms: int | None = None,
                 seed: int = 0, expert_format: str = "dense", tiling: dict[str, int] | None = None,
                 arch: str = "sm_90a") -> None:
        from kimik3.kernels.contracts import isa
        from kimik3.kernels.megakernel.vm import config_from_shapes

        from kimik3.megakernel import build_program, encode_program
        from kimik3.megakernel.gpu import static_shapes
        from kimik3.model.config import get_preset

        self.cfg = get_preset(preset)
        sms = sms or (132 if preset == "k3-shard" else 8)
        key = (preset, batch, sms, policy, expert_format, tuple(sorted((tiling or {}).items())))
        if key not in _PROGRAMS:  # cases of one process share the (slow to build at k3-shard) program
            tiles = None
            if tiling:  # some tile sizes other than the automatic ones (e.g. odd EXPERT_DOWN row tiles)
                import dataclasses

                from kimik3.megakernel.step import Tiling

                tiles = dataclasses.replace(Tiling.auto(self.cfg, batch, sms), **tiling)
            prog = build_program(preset, batch, sms, policy=policy, tiling=tiles, expert_format=expert_format)
            _PROGRAMS[key] = (prog, encode_program(prog))
        self.p, self.enc = _PROGRAMS[key]
        # arch: the compile target whose loop widths the opcodes take (MKConfig.arch)
        self.mk = config_from_shapes(**static_shapes(self.cfg, batch, expert_format=expert_format), arch=arch)
        self.B = batch
        self.isa = isa
        self.g = torch.Generator().manual_seed(seed)
        self.bufs: dict[int, torch.Tensor] = {}
        self.ties = False

    # -- instruction words as the fetch leaves them
    def words(self, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        A = self.isa
        e = self.enc
        off_ins, off_buf = int(e[A.H_OFF_INS]), int(e[A.H_OFF_BUF])
        ins = e[off_ins + v * A.INSTR_WORDS: off_ins + (v + 1) * A.INSTR_WORDS].clone()
        addr = torch.zeros(A.MAX_OPERANDS, dtype=torch.int64)
        d1 = torch.zeros(A.MAX_OPERANDS, dtype=torch.int32)
        d2 = torch.zeros(A.MAX_OPERANDS, dtype=torch.int32)
        for j, o in enumerate(self.p.instructions[v].operands):
            addr[j] = self.buf(o.buf).data_ptr()
            d1[j] = e[off_buf + o.buf * A.BUFFER_WORDS + A.BW_D1]
            d2[j] = e[off_buf + o.buf * A.BUFFER_WORDS + A.BW_D2]
        return ins, addr, d1, d2

    def buf(self, k: int) -> torch.Tensor:
        if k not in self.bufs:
            spec = self.p.buffers[k]
            n = spec.shape[0] * spec.shape[1] * spec.shape[2]
            if spec.kind.name == "WEIGHT" and n > 1 << 22:  # expert / embedding tables: zero until rows are filled
                t = torch.zeros(spec.shape, dtype=spec.dtype)
            else:
                t = self._rand(spec.name, spec.shape, spec.dtype)
            self.bufs[k] = t
        return self.bufs[k]

    def _rand(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        g = self.g
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) < 0.5
        if dtype == torch.int64:
            hi = self.cfg.vocab_size if name == "ids" else max(2, shape[-1])
            return torch.randint(0, hi, shape, generator=g)
        if dtype == torch.bfloat16:
            return (torch.randn(shape, generator=g) * shape[-1] ** -0.25).to(dtype)
        if dtype == torch.uint8:  # MXFP4 experts: any code byte; E8M0 scales around the dense weights' magnitude
            if name.endswith("_scale"):
                e0 = _scale_exponent(shape[-1] * 32)
                return torch.randint(e0 - 1, e0 + 2, shape, generator=g, dtype=torch.uint8)
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        scale = 0.05 if "bias" in name else 1.0
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) * scale

    def fill_rows(self, k: int, first: list[int], r0: int, r1: int) -> None:
        """Random rows [r0, r1) of slices ``first`` of a lazily allocated weight (once; the rest stays zero, so a
        read of a row nobody filled gives a wrong value)."""
        t = self.buf(k)
        if t.numel() <= 1 << 22:
            return
        for e in first:
            if not t[e, r0:r1].any():
                if t.dtype == torch.uint8:  # MXFP4 codes / scales
                    t[e, r0:r1] = self._rand(self.p.buffers[k].name, (r1 - r0, t.shape[2]), t.dtype)
                else:
                    t[e, r0:r1] = (torch.randn(r1 - r0, t.shape[2], generator=self.g) * t.shape[2] ** -0.5).to(
                        t.dtype)

    def extent(self, op: Any) -> tuple[int, int]:
        """(most slots, most work items of a warp) over the program's instructions of ``op`` (items of
        ``mk_moe.row_tile`` rows)."""
        from kimik3.kernels.megakernel.device_fns import NW
        from kimik3.kernels.megakernel.moe import row_tile

        per = NW * row_tile(self.mk)
        ins = [i for i in self.p.instructions if i.op == op]
        return (max(max(i.args[1] - i.args[0], 1) for i in ins),
                max(-(-(i.args[3] - i.args[2]) // per) for i in ins))

    def views(self, v: int) -> list[torch.Tensor]:
        return [self.buf(o.buf)[o.slices()] for o in self.p.instructions[v].operands]


def _scale_exponent(fan_in: int) -> int:
    """The E8M0 byte whose scale makes MXFP4 weights (|E2M1| ~ 2 on average) ~ fan_in^-0.5, as the dense ones."""
    return 127 - round(math.log2(2.0 * fan_in**0.5))


def _decompose(off: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d1, d2 = shape[1], shape[2]
    off = off.long()
    return off // (d1 * d2), (off // d2) % d1, off % d2


def _box_mask(shape: tuple[int, ...], box: tuple[int, ...]) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.bool)
    b0, b1, r0, r1, c0, c1 = box
    m[b0:b1, r0:r1, c0:c1] = True
    return m


def _store(wr: _Writes, shape: tuple[int, ...], box: tuple[int, ...], off: torch.Tensor, values: torch.Tensor,
           who: str) -> None:
    """Store at flat element offsets of a [d0, d1, d2] buffer; offsets outside the declared box are reported."""
    b, r, c = _decompose(off, shape)
    inside = (off >= 0) & (off < shape[0] * shape[1] * shape[2])
    b0, b1, r0, r1, c0, c1 = box
    inbox = inside & (b >= b0) & (b < b1) & (r >= r0) & (r < r1) & (c >= c0) & (c < c1)
    if not inbox.all():
        k = int((~inbox).nonzero()[0, 0])
        wr.problems.append(f"{wr.name}: {who} stores element {int(off.reshape(-1)[k])} = [{int(b.reshape(-1)[k])}, "
                           f"{int(r.reshape(-1)[k])}, {int(c.reshape(-1)[k])}] outside the declared box {box}")
    wr.store((b, r, c), values, who)


def _prepare(S: _MkSetup, v: int) -> None:
    """Inputs of instruction v that the random setup does not make meaningful: the rows of lazily allocated
    weights it reads; in ``ties`` mode the router logits on a coarse grid with no bias (equal choice scores: the
    tie-break decides); the arg-max's per-tile maxima on a coarse grid (equal maxima: the first must win)."""
    ins = S.p.instructions[v]
    op = ins.op.name
    if op == "ROUTER" and S.ties:
        lg, bias = S.buf(ins.operands[0].buf), S.buf(ins.operands[1].buf)
        lg.copy_(torch.round(lg * 2) / 2)
        bias.zero_()
    elif op in ("EXPERT_GATE_UP", "EXPERT_DOWN"):
        sel = S.views(v)[1].reshape(-1)
        experts = [int(e) for e in sel if int(e) >= 0]
        weights = (3, 4) if op == "EXPERT_GATE_UP" else (4,)
        if S.p.expert_format == "mxfp4":  # the codes and their scales
            weights = tuple(j for pair in S.isa.MXFP4_OPERANDS[ins.op] for j in pair)
        for j in weights:
            S.fill_rows(ins.operands[j].buf, experts, ins.args[2], ins.args[3])
    elif op == "EMBED":
        tb = S.buf(ins.operands[1].buf)
        if tb.numel() > 1 << 22:  # a lazily allocated table: fill the rows the ids name
            for t in S.views(v)[0][:, 0, 0].tolist():
                if not tb[0, t].any():
                    tb[0, t] = (torch.randn(tb.shape[2], generator=S.g) * 0.1).to(tb.dtype)
    elif op == "ARGMAX":
        bv = S.buf(ins.operands[0].buf)
        bv.copy_(torch.round(bv * 2) / 2)


def _reference(S: _MkSetup, v: int) -> None:
    """The interpreter's body of instruction v on the shared buffers (what later instructions read)."""
    import types

    from kimik3.megakernel.interpreter import _OPS

    ins = S.p.instructions[v]
    if ins.op.name == "ROUTER" and S.ties:
        _router_spec(S, ins, S.views(v))
    else:
        _OPS[ins.op](types.SimpleNamespace(cfg=S.cfg, dtype=torch.bfloat16, program=S.p), ins, S.views(v))


def _run_mk_instruction(S: _MkSetup, v: int, mods: dict[str, ModuleType], run: HostRun, errors: dict[str, float]
                        ) -> None:
    """Host-execute instruction v (its opcode's helpers from ``mods``), then the interpreter's body on the same
    inputs (the reference, which also produces what later instructions read); compare the outputs."""
    from kimik3.kernels.megakernel import operands as mk_operands

    from kimik3.validation.metric import rel_error

    _prepare(S, v)
    ins = S.p.instructions[v]
    op = ins.op.name
    M, X = mods["mk_moe"], mods["mk_misc"]
    words = list(S.words(v))
    shapes = [tuple(S.p.buffers[o.buf].shape) for o in ins.operands]
    boxes = [tuple(o.box) for o in ins.operands]
    cfg, B = S.mk, S.B
    outs: dict[int, torch.Tensor] = {}  # operand -> host-executed output buffer (poisoned)
    expect: dict[int, torch.Tensor] = {}  # operand -> elements the opcode must store
    tag = f"#{v} {op} L{ins.layer}"

    def out(j: int) -> tuple[torch.Tensor, _Writes]:
        spec = S.p.buffers[ins.operands[j].buf]
        t = torch.full(spec.shape, -7 if not spec.dtype.is_floating_point else float("nan"),
                       dtype=torch.int64 if spec.dtype == torch.bool else spec.dtype)
        outs[j] = t
        return t, _Writes(f"{tag} {spec.name}", t, run.problems)

    if op == "ROUTER":
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
        # warp 0's compaction: the used experts, ascending, into slots; each used lane stores its id at its slot
        crec = torch.full((EPL * LANES,), -1, dtype=torch.int32)
        cbase = torch.full((1,), -1, dtype=torch.int32)
        _launch(_mk_router_compact_host(M), [s_i32, crec, cbase], (EP, EPL))
        sel, wsel = out(2)
        wsel = _Writes(wsel.name, sel.view(-1), run.problems)
        used = (crec >= 0).nonzero()[:, 0]
        wsel.store((crec[used].long(),), used, "compaction")
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
    elif op == "EXPERT_GATE_UP" and cfg.fp4:
        smax, its = S.extent(ins.op)
        npass = -(-B // M.MMA_COLS)
        ngr = int(words[3][3]) // M.FP4_GROUP_BYTES
        e_rec = torch.full((smax,), -9, dtype=torch.int32)
        # registers never recorded stay a bf16 NaN pair: a step the lane code skipped poisons the product
        rec = torch.full((smax, M.NW, its, npass, LANES, _fp4_steps(ngr, 2), 2, 6), 0x7FC07FC0, dtype=torch.int32)
        off = torch.full((smax, M.NW, its, npass, LANES, 4), -1, dtype=torch.int64)
        _launch(_mk_gate_up_fp4_host(M), [*words, *_scratch(), e_rec, rec, off], (cfg,))
        ga, ua = _mma_steps(rec, 2)  # the tensor-core steps (an mma.sync aborts a host run)
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
    elif op == "EXPERT_GATE_UP":
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
    elif op == "EXPERT_DOWN" and cfg.fp4:
        _, its = S.extent(ins.op)
        nt, npass, MW = its * M.NW, -(-B // M.MMA_COLS), M.fp4_combine_width(cfg)
        ngr = int(words[3][4]) // M.FP4_GROUP_BYTES
        rec = torch.full((nt, cfg.dmax, npass, LANES, _fp4_steps(ngr, 1), 2, 6), 0x7FC07FC0, dtype=torch.int32)
        tiles, combine = _mk_down_fp4_host(M)
        scratch = _scratch()
        _launch(tiles, [*words, *scratch, rec], (cfg,))
        (fr,) = _mma_steps(rec, 1)  # the tensor-core steps (an mma.sync aborts a host run)
        res = torch.full((nt, LANES, 2, MW), float("nan"))
        off = torch.full((nt, LANES, 2, MW), -1, dtype=torch.int64)
        _launch(combine, [*words, *scratch, fr, torch.full((M.NW, LANES, 2, MW), float("nan")), res, off], (cfg,))
        y, wy = out(5)
        live = off >= 0
        _store(wy, shapes[5], boxes[5], off[live], res[live], "down")
        expect = {5: _box_mask(shapes[5], boxes[5])}
        wy.check(expect[5])
        run.lanes_run += int(live.any(-1).any(-1).sum())
    elif op == "EXPERT_DOWN":
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
    elif op == "EMBED":
        rec = torch.full((B, 2), -1, dtype=torch.int64)
        _launch(_mk_misc_host(X, "embed"), [*words, rec], (cfg,))
        emb, we = out(2)
        table = S.buf(ins.operands[1].buf).view(-1)
        b0, b1 = boxes[0][0], boxes[0][1]
        nch = shapes[1][2] // X.VEC
        for b in range(b0, b1):  # thread tidx copies chunks tidx, tidx + NT, ...
            for tidx in range(min(X.NT, nch)):
                cs = torch.arange(tidx, nch, X.NT)
                el = (cs[:, None] * X.VEC + torch.arange(X.VEC)).reshape(-1)
                _store(we, shapes[2], boxes[2], rec[b, 1] + el, table[rec[b, 0] + el], "embed")
        expect = {2: _box_mask(shapes[2], boxes[2])}
        we.check(expect[2])
        run.lanes_run += (b1 - b0) * X.NT
    elif op == "ARGMAX":
        rec = torch.full((X.NT, 2), -1, dtype=torch.int64)
        _launch(_mk_misc_host(X, "argmax"), [*words, rec], (cfg,))
        nxt, wn = out(2)
        bi = S.buf(ins.operands[1].buf).view(-1)
        live = rec[:, 1] >= 0
        _store(wn, shapes[2], boxes[2], rec[live, 1], bi[rec[live, 0]], "argmax")
        expect = {2: _box_mask(shapes[2], boxes[2])}
        wn.check(expect[2])
        run.lanes_run += B
    elif op == "ATTN_RES_MIX":
        K = ins.args[1]
        KM, NT, VEC = cfg.kmax, X.NT, X.VEC
        b0, b1 = boxes[0][0], boxes[0][1]
        H = shapes[0][2]
        vals = torch.full((B, NT, 2 * KM), float("nan"))
        mix = torch.full((B, H // VEC, VEC), float("nan"), dtype=torch.bfloat16)
        moff = torch.full((B,), -1, dtype=torch.int64)
        _launch(_mk_misc_host(X, "mix"), [*words, vals, mix, moff], (0, cfg))
        nw = NT // LANES
        tot = warp_sum(vals[b0:b1].view(b1 - b0, nw, LANES, 2 * KM), 2)  # block_allreduce: per warp, then
        red = torch.zeros(b1 - b0, 2 * KM)  # the NW partials re-added in warp order from 0
        for w in range(nw):
            red = red + tot[:, w]
        score = red[:, KM:] * torch.rsqrt(red[:, :KM] * (1.0 / cfg.H) + cfg.eps)
        score[:, K:] = float("-inf")
        alpha = torch.zeros(B, NT, 2 * KM)
        alpha[b0:b1, 0, :KM] = torch.softmax(score, dim=-1)
        _launch(_mk_misc_host(X, "mix"), [*words, alpha, mix, moff], (1, cfg))
        o, wo = out(3)
        el = torch.arange(H)
        for b in range(b0, b1):
            _store(wo, shapes[3], boxes[3], moff[b] + el, mix[b].reshape(-1), "mix")
        expect = {3: _box_mask(shapes[3], boxes[3])}
        wo.check(expect[3])
        run.lanes_run += (b1 - b0) * NT
    else:
        raise ValueError(f"host execution of opcode {op} is not in this module")
    _reference(S, v)
    for j, t in outs.items():
        ref = S.buf(ins.operands[j].buf)
        m = expect[j]
        got, want = t[m], ref[m]
        name = f"{op}.{S.p.buffers[ins.operands[j].buf].name}"
        if want.dtype.is_floating_point:
            e = rel_error(got.float(), want.float())
            errors[name] = max(errors.get(name, 0.0), e)
        elif not torch.equal(got.long(), want.long()):
            k = int((got.long() != want.long()).nonzero()[0, 0])
            run.problems.append(f"{tag} {name}: {int((got.long() != want.long()).sum())} element(s) differ from "
                                f"the interpreter, first {int(got[k])} vs {int(want[k])}")


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


def _scratch() -> tuple[torch.Tensor, torch.Tensor]:
    """The CTA's int32 / fp32 scratch (shared memory on the GPU) as a previous instruction may leave it: poison."""
    from kimik3.kernels.megakernel import operands as mk_operands

    return (torch.full((mk_operands.I32_WORDS,), -77777, dtype=torch.int32),
            torch.full((mk_operands.F32_WORDS,), float("nan")))


def _corners(S: _MkSetup, picked: list[int]) -> list[int]:
    """The tile corners of each layer's MoE instructions: EXPERT_GATE_UP at the first and last slot x the first and
    last row tile, EXPERT_DOWN at the first and last row tile; every other opcode's instructions all."""
    out = []
    by: dict[tuple[int, str], list[int]] = {}
    for v in picked:
        by.setdefault((S.p.instructions[v].layer, S.p.instructions[v].op.name), []).append(v)
    for (_, op), vs in by.items():
        args = [S.p.instructions[v].args for v in vs]
        if op == "EXPERT_GATE_UP":
            js, rs = {a[0] for a in args}, {a[2] for a in args}
            keep = [v for v, a in zip(vs, args) if a[0] in (min(js), max(js)) and a[2] in (min(rs), max(rs))]
        elif op == "EXPERT_DOWN":
            rs = {a[2] for a in args}
            keep = [v for v, a in zip(vs, args) if a[2] in (min(rs), max(rs))]
        else:
            keep = vs
        out += keep
    return sorted(out)


def _router_spec(S: _MkSetup, ins: Any, v: list[torch.Tensor]) -> None:
    """The interpreter's ROUTER body with the top-k's specification (``topk_spec``: equal choice scores in
    ascending expert id) in place of torch.topk, whose order among equal values is unspecified."""
    c = S.cfg
    idx, w = topk_spec(torch.sigmoid(v[0][:, 0, :]), v[1].reshape(-1), c.num_experts_per_tok,
                       c.routed_scaling_factor, c.norm_topk_prob)
    from kimik3.megakernel.interpreter import write_slots

    write_slots(idx.long(), w, v[2], v[3], v[4])


def _mk_case(case: dict[str, Any], mname: str | None, mod: ModuleType | None) -> tuple[HostRun, dict[str, float], str]:
    """Every instruction of the opcode ``family`` = ``mk.<OPCODE>`` in a program (``layers``: only those layers),
    with the producers it depends on (the ROUTER before the experts) run first on the host too."""
    from kimik3.kernels.megakernel import misc as mk_misc
    from kimik3.kernels.megakernel import moe as mk_moe

    op = case["family"].split(".", 1)[1]
    groups = {"moe": ("ROUTER", "EXPERT_GATE_UP", "EXPERT_DOWN"), "misc": ("EMBED", "ATTN_RES_MIX", "ARGMAX")}
    if op not in MK_OPS and op not in groups:
        raise ValueError(f"run_case: unknown megakernel opcode {op!r}; expected one of {MK_OPS} or {list(groups)}")
    mods = {"mk_moe": mk_moe, "mk_misc": mk_misc}
    if mname is not None:
        mods[mname] = mod
    S = _MkSetup(case["preset"], int(case["batch"]), policy=case.get("policy", "critical_path"),
                 seed=int(case.get("seed", 0)), expert_format=case.get("expert_format", "dense"),
                 tiling=case.get("tiling"), arch=case.get("arch", "sm_90a"))
    S.ties = bool(case.get("ties", False))
    chain = {"ROUTER": ("ROUTER",), "EXPERT_GATE_UP": ("ROUTER", "EXPERT_GATE_UP"),
             "EXPERT_DOWN": groups["moe"], **groups}.get(op, (op,))
    want = groups.get(op, (op,))
    layers = case.get("layers")
    if layers == "first_moe":  # one layer: the first with routed experts
        layers = [next(i.layer for i in S.p.instructions if i.op.name == "ROUTER")]
    picked = [v for v, ins in enumerate(S.p.instructions)
              if ins.op.name in chain and (layers is None or ins.layer in layers)]
    if case.get("sample") == "corners":
        picked = _corners(S, picked)
    run = HostRun({})
    errors: dict[str, float] = {}
    n: dict[str, int] = {}
    for v in picked:
        ins = S.p.instructions[v]
        if ins.op.name in want:
            _run_mk_instruction(S, v, mods, run, errors)
            n[ins.op.name] = n.get(ins.op.name, 0) + 1
        else:  # a producer of what the opcode under test reads: the reference only
            _prepare(S, v)
            _reference(S, v)
    missing = [o for o in want if o not in n]
    if missing:
        run.problems.append(f"no {missing} instruction in the program")
    # bf16 outputs (hidden rows, combine, mix) at the kernel's bf16 tolerance; the rest are exact copies / ids or
    # fp32 router weights: their errors carry the fp32 bound
    tols = {"EXPERT_GATE_UP": 1e-2, "EXPERT_DOWN": 1e-2, "ATTN_RES_MIX": 1e-2}
    bad = [f"{k}: {e:.3g}" for k, e in errors.items() if e > tols.get(k.split(".")[0], 1e-5)]
    if bad:
        run.problems.append(f"errors above the tolerance: {bad}")
    return run, errors, "kernel_bf16"


# ---------------------------------------------------------------------------------------------- cases, CLI
def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One host execution: ``family`` (router, router.ties, mk.<OPCODE>, mk.moe, mk.misc), ``preset``, ``batch``;
    optional ``shapes`` overrides, ``gemv`` (router: False takes the reference's scores), ``ties``, ``layers``
    (megakernel: a list or ``"first_moe"``), ``sample`` (``"corners"``), ``expert_format`` (megakernel: "dense" or
    "mxfp4"), ``tiling`` (megakernel: ``Tiling`` fields to override), ``arch`` (megakernel: the compile target whose
    loop widths run, ``MKConfig.arch``; default sm_90a), ``mutant`` ([module, [[old, new], ...]];
    module ``_common`` for a megakernel family: the MoE opcodes run with the mutated shared helpers). Returns
    problems, errors, the tolerance and ``ok``."""
    import time

    from kimik3.kernels.toolchain import registry

    from kimik3.model.config import get_preset

    t0 = time.perf_counter()
    family, preset, B = case["family"], case["preset"], int(case["batch"])
    mname, mod = None, None
    if case.get("mutant"):
        # a mutated _common (the MXFP4 decode) reaches the megakernel through the expert opcodes' module
        mname, mod = load_case_mutant(case["mutant"], "mk_moe" if family.startswith("mk.") else "router")
    if family in ("router", "router.ties"):
        shapes = registry.FAMILIES["router"].shapes(get_preset(preset), B)
        shapes.update(case.get("shapes", {}))
        run, errors, tol = _router_case(case, shapes, mod if mname == "router" else None)
    elif family.startswith("mk."):
        run, errors, tol = _mk_case(case, mname, mod)
    else:
        raise ValueError(f"run_case: unknown family {family!r}")
    return case_result(case, run, errors, tol, t0)


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec_router CASES.json``: run each case, one JSON line per case on stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec_router", argv)


if __name__ == "__main__":
    raise SystemExit(main())

