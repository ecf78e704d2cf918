"""Host execution of the megakernel's MLA opcodes (``kernels/megakernel/mla.py``): MLA_Q, MLA_KV_APPEND, MLA_PARTIAL and
MLA_REDUCE, one instruction at a time, on CPU tensors.

The drivers call the opcodes' own ``@cute.jit`` helpers over every warp task and lane of an instruction inside
compiled host functions; Python then does what the thin GPU layer does (butterfly warp sums in the shuffle order,
MLA_PARTIAL's online softmax step by step, the bf16 casts and the stores into NaN-poisoned outputs, every store
counted) and compares with the CPU interpreter's MLA opcodes under the kernel tolerance. Entry points:
``run_mla_q``, ``run_mla_kv_append``, ``run_mla_partial``, ``run_mla_reduce``, ``run_case``, ``main``.
Run it in a subprocess when a helper may be mutated (``tests/test_host_exec_mk_mla.py``).
Design: docs/architecture.md#appendix-design-notes-by-room (``kernels/verify/host_exec_mk_mla.py``).
"""

from __future__ import annotations

import math
from types import ModuleType, SimpleNamespace
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from kimik3.kernels.common.trace import host_trace
from kimik3.kernels.contracts.isa import BT_MAX
from kimik3.kernels.reference import common as ref_common
from kimik3.kernels.verify.host_exec import HostRun, _t, _Writes, cases_main, mutated_modules

__all__ = ["run_mla_q", "run_mla_kv_append", "run_mla_partial", "run_mla_reduce", "run_case", "main"]

LANES = 32
VEC = 8
NW = 12  # warps per CTA (device_fns.NW): tasks are dealt to warps round-robin; the order does not change values


def _butterfly(p: torch.Tensor, dim: int, offsets: tuple[int, ...]) -> torch.Tensor:
    """``shfl.sync.bfly`` sums over the lane axis ``dim`` with the given offsets, in order; every lane keeps its own
    result (lanes differing only in the other bits hold different sums)."""
    p = p.movedim(dim, -1)
    if p.shape[-1] != LANES:
        raise ValueError(f"butterfly: axis {dim} must be the {LANES} lanes, got {list(p.shape)}")
    lane = torch.arange(LANES)
    for off in offsets:
        p = p + p[..., lane ^ off]
    return p.movedim(-1, dim)


def _wsum(p: torch.Tensor, dim: int) -> torch.Tensor:
    """``common.device.warp_sum``: the full butterfly (16, 8, 4, 2, 1); lane 0's value."""
    return _butterfly(p, dim, (16, 8, 4, 2, 1)).select(dim, 0)


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _bt(B: int) -> int:
    """``MKConfig.bt``: the largest divisor of B up to BT_MAX."""
    return max(d for d in range(1, min(B, BT_MAX) + 1) if B % d == 0)


def _dims(preset: str) -> dict[str, Any]:
    from kimik3.model.config import get_preset

    c = get_preset(preset)
    return {"cfg": c, "nh": c.num_attention_heads, "ql": int(c.q_lora_rank), "kvl": c.kv_lora_rank,
            "nope": c.qk_nope_head_dim, "rope": c.qk_rope_head_dim, "dv": c.v_head_dim, "eps": 1e-6}


_DRIVERS: dict[tuple[str, ModuleType, ModuleType], Any] = {}


def _modules(mutant: list | None) -> tuple[ModuleType, ModuleType]:
    from kimik3.kernels.megakernel import device_fns
    from kimik3.kernels.megakernel import mla as mk_mla

    m = mutated_modules(mutant, {"megakernel.mla": mk_mla, "megakernel.device_fns": device_fns}, "host_exec_mk_mla")
    return m["megakernel.mla"], m["megakernel.device_fns"]


# ---------------------------------------------------------------------------------------------- shared GEMV rows
def _rows_driver(F: ModuleType) -> Any:
    """Every row j of a weight box (from j0) and lane through ``F.weight_row_dot`` with BT x rows in a host copy
    of the shared-memory scratch (row b at chunk b·xs), as MLA_Q's q_b rows and MLA_REDUCE's W_UV rows."""
    key = ("rows", F, F)
    if key not in _DRIVERS:
        weight_row_dot, gchunks = F.weight_row_dot, F.gchunks

        @cute.jit
        def drive(stage: cute.Tensor, staged: Int32, w_addr: Int64, xs: cute.Tensor, g_addr: Int64, j0: Int32,
                  nrows: Int32, nch: Int32, mPart: cute.Tensor, BT: cutlass.Constexpr, U: cutlass.Constexpr,
                  GAMMA: cutlass.Constexpr):
            gv = None
            if cutlass.const_expr(GAMMA):
                gv = gchunks(g_addr)
            acc = cute.make_rmem_tensor((BT,), Float32)
            for j in cutlass.range(nrows):
                for lane in cutlass.range(LANES):
                    weight_row_dot(stage, staged, w_addr, j0 + j, nch, xs, Int32(0), nch, True, gv, acc, BT, U,
                                   lane)
                    for b in cutlass.range_constexpr(BT):
                        mPart[j, lane, b] = acc[b]

        _DRIVERS[key] = drive
    return _DRIVERS[key]


def _stage_for(W: torch.Tensor, r0: int, rows: int) -> tuple[torch.Tensor, int]:
    """The weight stage as the VM leaves it for this instruction: the box's first whole rows that fit one stage
    buffer (row j at chunk j·nch), the rest poisoned."""
    from kimik3.kernels.contracts.isa import STAGE_BYTES

    K = W.shape[1]
    staged = min(rows, STAGE_BYTES // (2 * K))
    stage = torch.full((max(1, rows) * K // VEC, VEC), float("nan"), dtype=torch.bfloat16)
    stage[:staged * K // VEC] = W[r0:r0 + staged].reshape(-1, VEC)
    return stage, staged


def _gemv_rows(F: ModuleType, W: torch.Tensor, r0: int, rows: int, js: list[int], x: torch.Tensor,
               gamma: torch.Tensor | None, U: int) -> torch.Tensor:
    """Warp-summed dots of box rows ``js`` (box rows from ``r0``) with the BT rows of ``x`` (bf16 [BT, K]):
    [len(js), BT]."""
    BT, K = x.shape
    stage, staged = _stage_for(W, r0, rows)
    xs = x.contiguous().reshape(-1, VEC)
    g = gamma if gamma is not None else torch.zeros(K, dtype=torch.bfloat16)
    out = torch.empty(len(js), LANES, BT)
    runs = _runs(js)
    Wc = W.contiguous()
    for a, n in runs:
        part = torch.full((n, LANES, BT), float("nan"))
        with host_trace():
            _rows_driver(F)(_t(stage), staged, Wc.data_ptr() + r0 * K * 2, _t(xs), g.data_ptr(), a, n, K // VEC,
                            _t(part), BT, U, gamma is not None)
        i = js.index(a)
        out[i:i + n] = part
    return _wsum(out, 1)


def _runs(js: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs (start, length) of an ascending index list."""
    out: list[tuple[int, int]] = []
    for j in js:
        if out and out[-1][0] + out[-1][1] == j:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((j, 1))
    return out


def _interp(d: dict[str, Any]) -> Any:
    return SimpleNamespace(cfg=d["cfg"], lora_eps={0: (d["eps"], d["eps"])}, dtype=torch.bfloat16)


def _ins(args: tuple[int, ...], boxes: list[tuple[int, ...]]) -> Any:
    return SimpleNamespace(args=args, layer=0, operands=[SimpleNamespace(box=b) for b in boxes])


def _rng(seed: int) -> ref_common.Rng:
    return ref_common.Rng(seed)


# ---------------------------------------------------------------------------------------------- MLA_Q
def _absorb_driver(M: ModuleType) -> Any:
    key = ("absorb", M, M)
    if key not in _DRIVERS:
        absorb_coords, absorb_lane = M.absorb_coords, M.absorb_lane

        @cute.jit
        def drive(wuk_addr: Int64, nchr: Int32, row0: Int32, qv: cute.Tensor, q0: Int32, tasks: cute.Tensor,
                  mAcc: cute.Tensor, mCoord: cute.Tensor, NOPE: cutlass.Constexpr, CW: cutlass.Constexpr,
                  U: cutlass.Constexpr, BT: cutlass.Constexpr):
            acc = cute.make_rmem_tensor((VEC * BT,), Float32)
            for i in cutlass.range(cute.size(tasks, mode=[0])):
                for lane in cutlass.range(LANES):
                    cb, rg = absorb_coords(tasks[i], lane, CW)
                    mCoord[i, lane, 0] = cb
                    mCoord[i, lane, 1] = rg
                    absorb_lane(wuk_addr, nchr, row0, cb, rg, qv, q0, acc, NOPE, LANES // CW, U, BT)
                    for k in cutlass.range_constexpr(VEC * BT):
                        mAcc[i, lane, k] = acc[k]

        _DRIVERS[key] = drive
    return _DRIVERS[key]


def run_mla_q(preset: str, B: int, h0: int, *, seed: int = 0, tasks: list[int] | None = None,
              qb_rows: list[int] | None = None, mutant: list | None = None) -> tuple[HostRun, torch.Tensor, Any]:
    """One MLA_Q instruction (head h0, batch B) on the host. ``tasks`` restricts the absorption to those warp tasks
    (column blocks) and ``qb_rows`` the q_b rows (the nope rows are always all computed: the absorption needs them);
    the write check then covers what they store. Returns the run (output ``mq``), the reference and a mask of the
    elements covered."""
    M, F = _modules(mutant)
    d = _dims(preset)
    nh, ql, kvl, nope, rope = d["nh"], d["ql"], d["kvl"], d["nope"], d["rope"]
    qk, h1 = nope + rope, h0 + 1
    BT = _bt(B)
    rng = _rng(seed)
    D = ql + kvl + rope + 6  # a packed projection whose row stride is not a multiple of 8 (as tiny's)
    mp = rng.randn(B, 1, D, dtype=torch.bfloat16)
    qn = (1.0 + rng.randn(ql, scale=0.1)).to(torch.bfloat16)
    Wqb = rng.randn(nh * qk, ql, scale=ql**-0.5, dtype=torch.bfloat16)
    Wuk = rng.randn(nh * nope, kvl, scale=nope**-0.5, dtype=torch.bfloat16)
    mq = torch.full((B, nh, kvl + rope), float("nan"), dtype=torch.bfloat16)
    run = HostRun({"mq": mq})
    wr = _Writes("mq", mq, run.problems)
    CW = M.absorb_cw(kvl)
    RG = LANES // CW
    ntask = kvl // VEC // CW
    tasks = list(range(ntask)) if tasks is None else sorted(set(tasks))
    js = list(range(qk)) if qb_rows is None else sorted(set(range(nope)) | set(qb_rows))
    cover = torch.zeros(B, nh, kvl + rope, dtype=torch.bool)
    U = 4 if BT <= 2 else 2  # MKConfig.unroll
    for t in range(B // BT):
        qa = mp[t * BT:(t + 1) * BT, 0, :ql]
        x = qa.float()
        # rstd: one warp per row, lane l sums x² over columns l, l+32, ... in order, then the butterfly
        lp = torch.zeros(BT, LANES)
        for c0 in range(0, ql, LANES):
            w = min(LANES, ql - c0)
            lp[:, :w] = lp[:, :w] + x[:, c0:c0 + w] * x[:, c0:c0 + w]
        rstd = torch.rsqrt(_wsum(lp, 1) * (1.0 / ql) + d["eps"])
        # the in-place smem pass: mk_mla.norm_value per element, bf16 store
        xn = (qn.float() * _bf(x * rstd[:, None])).to(torch.bfloat16)
        for h in range(h0, h1):
            dots = _gemv_rows(F, Wqb, h0 * qk, (h1 - h0) * qk, [(h - h0) * qk + j for j in js], xn, None, U)
            dq = _bf(dots)  # [len(js), BT]
            xs = torch.zeros(BT * (max(ql, kvl, VEC) + max(nope, VEC)), dtype=torch.bfloat16)  # s_xbf image
            for i, j in enumerate(js):
                if j < nope:
                    xs[BT * ql + torch.arange(BT) * nope + j] = dq[i].to(torch.bfloat16)
                else:
                    bb = torch.arange(BT)
                    wr.store((t * BT + bb, torch.full_like(bb, h), torch.full_like(bb, kvl + j - nope)), dq[i],
                             "q_b rope row")
                    cover[t * BT:(t + 1) * BT, h, kvl + j - nope] = True
            acc = torch.full((len(tasks), LANES, VEC * BT), float("nan"))
            coord = torch.full((len(tasks), LANES, 2), -1, dtype=torch.int32)
            with host_trace():
                _absorb_driver(M)(Wuk.data_ptr(), Wuk.shape[1] // VEC, h * nope, _t(xs), BT * ql,
                                  _t(torch.tensor(tasks, dtype=torch.int32)), _t(acc), _t(coord), nope, CW,
                                  M.absorb_unroll(BT), BT)
            run.lanes_run += len(tasks) * LANES
            steps = tuple(16 >> s for s in range(int(math.log2(RG))))
            tot = _butterfly(acc, 1, steps)  # [task, lane, 8·BT]
            cb, rg = coord[..., 0].long(), coord[..., 1].long()
            for bb in range(BT):
                sel = (rg == bb % RG) & (rg >= 0)  # the lanes whose row group stores row bb
                cols = (cb[sel][:, None] * VEC + torch.arange(VEC)).reshape(-1)
                vals = tot[sel][:, bb * VEC:(bb + 1) * VEC].reshape(-1)
                wr.store((torch.full_like(cols, t * BT + bb), torch.full_like(cols, h), cols), vals, "absorption")
            for i in tasks:
                cover[t * BT:(t + 1) * BT, h, i * CW * VEC:(i + 1) * CW * VEC] = True
    wr.check(cover)
    # reference: the CPU interpreter's MLA_Q on the instruction's operand views
    from kimik3.megakernel.interpreter import _mla_q

    ref = torch.zeros(B, h1 - h0, kvl + rope, dtype=torch.bfloat16)
    v = [mp[:, :, :ql], qn.view(1, 1, ql), Wqb[h0 * qk:h1 * qk].view(1, -1, ql),
         Wuk[h0 * nope:h1 * nope].view(1, -1, kvl), ref]
    _mla_q(_interp(d), _ins((h0, h1), []), v)
    full = torch.full((B, nh, kvl + rope), float("nan"))
    full[:, h0:h1] = ref.float()
    return run, full, cover


# ---------------------------------------------------------------------------------------------- MLA_KV_APPEND
def _kv_driver(M: ModuleType) -> Any:
    key = ("kv", M, M)
    if key not in _DRIVERS:
        kv_append_load, norm_value = M.kv_append_load, M.norm_value

        @cute.jit
        def drive(mp: cute.Tensor, kvn: cute.Tensor, rows: cute.Tensor, mR: cute.Tensor, mSq: cute.Tensor,
                  mOut: cute.Tensor, mRope: cute.Tensor, KVL: cutlass.Constexpr, ROPE: cutlass.Constexpr):
            LPL, RPL = -(-KVL // 32), -(-ROPE // 32)
            xv = cute.make_rmem_tensor((LPL,), Float32)
            wv = cute.make_rmem_tensor((LPL,), Float32)
            rv = cute.make_rmem_tensor((RPL,), cutlass.BFloat16)
            for b in cutlass.range(cute.size(rows, mode=[0])):
                for lane in cutlass.range(LANES):
                    mSq[b, lane] = kv_append_load(mp, rows[b], kvn, lane, xv, wv, rv, KVL, ROPE)
                    for m in cutlass.range_constexpr(LPL):
                        mOut[b, lane, m] = norm_value(xv[m], wv[m], mR[b])
                    for m in cutlass.range_constexpr(RPL):
                        mRope[b, lane, m] = rv[m].to(Float32)

        _DRIVERS[key] = drive
    return _DRIVERS[key]


def run_mla_kv_append(preset: str, B: int, *, seed: int = 0, T: int = 64, mutant: list | None = None
                      ) -> tuple[HostRun, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One MLA_KV_APPEND (every sequence of the batch) on the host: the latent RMSNorm and the rope copy stored at
    each sequence's position of caches poisoned elsewhere. Two host calls: the lanes' Σ x² (then the butterfly and
    an exact rsqrt here), then the lanes' values with that rstd."""
    M, _ = _modules(mutant)
    d = _dims(preset)
    ql, kvl, rope = d["ql"], d["kvl"], d["rope"]
    rng = _rng(seed)
    D = ql + kvl + rope + 6
    c0 = ql
    mp = rng.randn(B, 1, D, dtype=torch.bfloat16)
    kvn = (1.0 + rng.randn(kvl, scale=0.1)).to(torch.bfloat16)
    pos = torch.tensor([(7 * b + 3) % T for b in range(B)], dtype=torch.int64).view(B, 1, 1)
    pos[-1] = T - 1  # the last cache row
    lat = torch.full((B, T, kvl), float("nan"), dtype=torch.bfloat16)
    kr = torch.full((B, T, rope), float("nan"), dtype=torch.bfloat16)
    run = HostRun({"latent": lat, "k_r": kr})
    LPL, RPL = -(-kvl // 32), -(-rope // 32)
    rows = torch.tensor([b * D + c0 for b in range(B)], dtype=torch.int64)  # _eoff(d1, d2, b, 0, c0)
    sq = torch.full((B, LANES), float("nan"))
    out = torch.full((B, LANES, LPL), float("nan"))
    ropev = torch.full((B, LANES, RPL), float("nan"))
    mpf = mp.reshape(-1)
    r = torch.zeros(B)
    drive = _kv_driver(M)
    with host_trace():
        drive(_t(mpf), _t(kvn), _t(rows), _t(r), _t(sq), _t(out), _t(ropev), kvl, rope)
    r = torch.rsqrt(_wsum(sq, 1) * (1.0 / kvl) + d["eps"])
    with host_trace():
        drive(_t(mpf), _t(kvn), _t(rows), _t(r), _t(sq), _t(out), _t(ropev), kvl, rope)
    run.lanes_run = B * LANES
    wl, wk = _Writes("latent", lat, run.problems), _Writes("k_r", kr, run.problems)
    lane = torch.arange(LANES)
    for b in range(B):
        p = int(pos[b, 0, 0])
        li = (lane[:, None] + 32 * torch.arange(LPL)).reshape(-1)
        keep = li < kvl
        wl.store((torch.full_like(li[keep], b), torch.full_like(li[keep], p), li[keep]), out[b].reshape(-1)[keep],
                 "latent")
        ri = (lane[:, None] + 32 * torch.arange(RPL)).reshape(-1)
        keep = ri < rope
        wk.store((torch.full_like(ri[keep], b), torch.full_like(ri[keep], p), ri[keep]), ropev[b].reshape(-1)[keep],
                 "k_r")
    at = torch.zeros(B, T, dtype=torch.bool)
    at[torch.arange(B), pos[:, 0, 0]] = True
    wl.check(at[..., None].expand_as(lat))
    wk.check(at[..., None].expand_as(kr))
    from kimik3.megakernel.interpreter import _mla_kv_append

    rl = torch.full_like(lat, float("nan"))
    rk = torch.full_like(kr, float("nan"))
    _mla_kv_append(_interp(d), _ins((), []), [mp[:, :, c0:c0 + kvl + rope], kvn.view(1, 1, kvl), pos, rl, rk])
    return run, {"latent": lat[at].float(), "k_r": kr[at].float()}, {"latent": rl[at].float(), "k_r": rk[at].float()}


# ---------------------------------------------------------------------------------------------- MLA_PARTIAL
def _partial_drivers(M: ModuleType) -> tuple[Any, Any]:
    key = ("partial", M, M)
    if key not in _DRIVERS:
        load_q, load_rows, dots, out_block, col = (M.partial_load_q, M.partial_load_rows, M.partial_dots,
                                                   M.partial_out_block, M.partial_col)
        HB, PU = M.PART_HB, M.PART_PU

        @cute.jit
        def scores(mq_addr: Int64, qrows: cute.Tensor, hs: cute.Tensor, h1: Int32, lat_addr: Int64,
                   kr_addr: Int64, crow: cute.Tensor, krow: cute.Tensor, tend: cute.Tensor, t0: Int32,
                   lanes: cute.Tensor, mSl: cute.Tensor, mSr: cute.Tensor, KVL: cutlass.Constexpr,
                   ROPE: cutlass.Constexpr):
            """Per (batch row i, head pair g, lane, step, hb, u): the lane's partial latent / rope scores."""
            LPC, RPL = -(-(KVL // VEC) // 32), -(-ROPE // 32)
            qf = cute.make_rmem_tensor((VEC, HB, LPC), Float32)
            qr = cute.make_rmem_tensor((RPL, HB), Float32)
            rc = cute.make_rmem_tensor((VEC, PU, LPC), cutlass.BFloat16)
            rr = cute.make_rmem_tensor((RPL, PU), cutlass.BFloat16)
            sl = cute.make_rmem_tensor((HB, PU), Float32)
            sr = cute.make_rmem_tensor((HB, PU), Float32)
            for i in cutlass.range(cute.size(crow, mode=[0])):
                for g in cutlass.range(cute.size(hs, mode=[0])):
                    for li in cutlass.range(cute.size(lanes, mode=[0])):
                        lane = lanes[li]
                        for hb in cutlass.range_constexpr(HB):
                            load_q(mq_addr, qrows[i, g, hb], hs[g] + hb, h1, hb, lane, qf, qr, KVL, ROPE)
                        for tb in cutlass.range(t0, tend[i], PU):
                            nvalid = tend[i] - tb
                            load_rows(lat_addr, crow[i] + Int64(tb - t0) * KVL, kr_addr,
                                      krow[i] + Int64(tb - t0) * ROPE, nvalid, lane, rc, rr, KVL, ROPE, PU)
                            dots(qf, qr, rc, rr, nvalid, lane, sl, sr, KVL, ROPE, HB, PU)
                            st = (tb - t0) // PU
                            for hb in cutlass.range_constexpr(HB):
                                for u in cutlass.range_constexpr(PU):
                                    mSl[i, g, li, st, hb, u] = sl[hb, u]
                                    mSr[i, g, li, st, hb, u] = sr[hb, u]

        @cute.jit
        def outputs(lat_addr: Int64, kr_addr: Int64, crow: cute.Tensor, krow: cute.Tensor, tend: cute.Tensor,
                    t0: Int32, ng: Int32, lanes: cute.Tensor, mP: cute.Tensor, mCorr: cute.Tensor, mO: cute.Tensor,
                    mCol: cute.Tensor, KVL: cutlass.Constexpr, ROPE: cutlass.Constexpr):
            """Per (batch row, head pair, lane): the online-softmax output after the last step, and its columns."""
            LPC, RPL = -(-(KVL // VEC) // 32), -(-ROPE // 32)
            rc = cute.make_rmem_tensor((VEC, PU, LPC), cutlass.BFloat16)
            rr = cute.make_rmem_tensor((RPL, PU), cutlass.BFloat16)
            o = cute.make_rmem_tensor((VEC, HB, LPC), Float32)
            p = cute.make_rmem_tensor((HB, PU), Float32)
            corr = cute.make_rmem_tensor((HB,), Float32)
            for i in cutlass.range(cute.size(crow, mode=[0])):
                for g in cutlass.range(ng):
                    for li in cutlass.range(cute.size(lanes, mode=[0])):
                        lane = lanes[li]
                        o.fill(0.0)
                        for tb in cutlass.range(t0, tend[i], PU):
                            nvalid = tend[i] - tb
                            st = (tb - t0) // PU
                            load_rows(lat_addr, crow[i] + Int64(tb - t0) * KVL, kr_addr,
                                      krow[i] + Int64(tb - t0) * ROPE, nvalid, lane, rc, rr, KVL, ROPE, PU)
                            for hb in cutlass.range_constexpr(HB):
                                corr[hb] = mCorr[i, g, st, hb]
                                for u in cutlass.range_constexpr(PU):
                                    p[hb, u] = mP[i, g, st, hb, u]
                            out_block(o, rc, p, corr, nvalid, lane, KVL, HB, PU)
                        for hb in cutlass.range_constexpr(HB):
                            for m in cutlass.range_constexpr(LPC):
                                mCol[li, m] = col(lane, m)
                                for k in cutlass.range_constexpr(VEC):
                                    mO[i, g, li, hb, m, k] = o[k, hb, m]

        _DRIVERS[key] = (scores, outputs)
    return _DRIVERS[key]


def run_mla_partial(preset: str, B: int, *, split: int = 0, nsplit: int = 2, T: int = 64, b0: int = 0,
                    b1: int | None = None, heads: tuple[int, int] | None = None, lanes: list[int] | None = None,
                    seed: int = 0, mutant: list | None = None
                    ) -> tuple[HostRun, torch.Tensor, torch.Tensor]:
    """One MLA_PARTIAL instruction (context split ``split`` of ``nsplit`` over a T-row cache, batch rows [b0, b1),
    heads ``heads``, default all) on the host. ``lanes`` samples lanes (their stored columns are then the ones
    checked; lane 0 stores the max and sum). Returns the run (output ``part``), the reference and the mask checked."""
    M, _ = _modules(mutant)
    d = _dims(preset)
    nh, kvl, rope = d["nh"], d["kvl"], d["rope"]
    HB, PU = M.PART_HB, M.PART_PU
    b1 = B if b1 is None else b1
    h0, h1 = heads or (0, nh)
    chunk = -(-T // nsplit)
    t0, t1 = split * chunk, min(T, (split + 1) * chunk)
    col0 = split * (kvl + 2)
    rng = _rng(seed)
    mq = rng.randn(B, nh, kvl + rope, dtype=torch.bfloat16)
    lat = rng.randn(B, T, kvl, dtype=torch.bfloat16)
    kr = rng.randn(B, T, rope, dtype=torch.bfloat16)
    # positions: before the split (nothing to attend), inside it (a partial last step), past it (all rows)
    choice = [t0 - 1 if t0 > 0 else t0, t0 + (t1 - t0) // 2, T - 1, t0]
    pos = torch.tensor([max(0, choice[b % len(choice)]) for b in range(B)], dtype=torch.int64).view(B, 1, 1)
    part = torch.full((B, nh, nsplit * (kvl + 2)), float("nan"))
    run = HostRun({"part": part})
    wr = _Writes("part", part, run.problems)
    lanes = list(range(LANES)) if lanes is None else sorted(set(lanes) | {0})
    bs = list(range(b0, b1))
    tend = torch.tensor([min(t1, int(pos[b, 0, 0]) + 1) for b in bs], dtype=torch.int32)
    nst = max(1, -(-(t1 - t0) // PU))
    hs = torch.arange(h0, h1, HB, dtype=torch.int32)
    ng = len(hs)
    qrows = torch.tensor([[[(b * nh + int(h) + hb) * (kvl + rope) for hb in range(HB)] for h in hs] for b in bs],
                         dtype=torch.int64)
    crow = torch.tensor([(b * T + t0) * kvl for b in bs], dtype=torch.int64)
    krow = torch.tensor([(b * T + t0) * rope for b in bs], dtype=torch.int64)
    ln = torch.tensor(lanes, dtype=torch.int32)
    sl = torch.zeros(len(bs), ng, LANES, nst, HB, PU)
    sr = torch.zeros(len(bs), ng, LANES, nst, HB, PU)
    scores, outputs = _partial_drivers(M)
    lanes_all = torch.arange(LANES, dtype=torch.int32)
    # the scores need every lane (the warp sum); sampled lanes only restrict the output pass
    with host_trace():
        scores(mq.data_ptr(), _t(qrows), _t(hs), h1, lat.data_ptr(), kr.data_ptr(), _t(crow), _t(krow), _t(tend), t0,
               _t(lanes_all), _t(sl), _t(sr), kvl, rope)
    s = _bf(_bf(_wsum(sl, 2)) + _bf(_wsum(sr, 2))) * d["cfg"].mla_softmax_scale  # [i, g, step, hb, u]
    steps = torch.arange(nst)[:, None] * PU + torch.arange(PU) + t0  # [step, u]
    valid = steps[None] < tend.long()[:, None, None]  # [i, step, u]
    s = torch.where(valid[:, None, :, None, :], s, torch.tensor(float("-inf")))
    P = torch.zeros_like(s)
    corr = torch.zeros(len(bs), ng, nst, HB)
    mrun = torch.full((len(bs), ng, HB), float("-inf"))
    lrun = torch.zeros(len(bs), ng, HB)
    for st in range(nst):  # the thin layer's online softmax, step by step; rows in order within a step
        live = (t0 + st * PU < tend.long())[:, None, None]  # the loop ran this step
        sb = s[:, :, st]  # [i, g, hb, u]
        mnew = torch.maximum(mrun, sb.amax(-1))
        c = torch.exp(mrun - mnew)
        pu = torch.exp(sb - mnew[..., None])
        lsum = lrun * c
        for u in range(PU):
            lsum = lsum + pu[..., u]
        corr[:, :, st] = torch.where(live, c, corr[:, :, st])
        P[:, :, st] = torch.where(live[..., None], pu, P[:, :, st])
        mrun = torch.where(live, mnew, mrun)
        lrun = torch.where(live, lsum, lrun)
    LPC = -(-(kvl // VEC) // 32)
    o = torch.full((len(bs), ng, len(lanes), HB, LPC, VEC), float("nan"))
    cols = torch.full((len(lanes), LPC), -1, dtype=torch.int32)
    with host_trace():
        outputs(lat.data_ptr(), kr.data_ptr(), _t(crow), _t(krow), _t(tend), t0, ng, _t(ln), _t(P.contiguous()),
                _t(corr), _t(o), _t(cols), kvl, rope)
    run.lanes_run = len(bs) * ng * LANES
    cover = torch.zeros_like(part, dtype=torch.bool)
    for i, b in enumerate(bs):
        for g in range(ng):
            for hb in range(HB):
                h = int(hs[g]) + hb
                if h >= h1:
                    continue
                for li, lane in enumerate(lanes):
                    for m in range(LPC):
                        c = int(cols[li, m])
                        if lane + 32 * m < kvl // VEC:
                            cc = col0 + c + torch.arange(VEC)
                            wr.store((torch.full_like(cc, b), torch.full_like(cc, h), cc), o[i, g, li, hb, m],
                                     "partial o")
                            cover[b, h, col0 + (lane + 32 * m) * VEC:col0 + (lane + 32 * m + 1) * VEC] = True
                wr.store((torch.tensor([b, b]), torch.tensor([h, h]), torch.tensor([col0 + kvl, col0 + kvl + 1])),
                         torch.stack([mrun[i, g, hb], lrun[i, g, hb]]), "partial max/sum")
                cover[b, h, col0 + kvl:col0 + kvl + 2] = True
    wr.check(cover)
    from kimik3.megakernel.interpreter import _mla_partial

    ref = torch.zeros(b1 - b0, h1 - h0, kvl + 2)
    v = [mq[b0:b1, h0:h1], pos[b0:b1], lat[b0:b1, t0:t1], kr[b0:b1, t0:t1], ref]
    _mla_partial(_interp(d), _ins((h0, h1, split, b0), [(), (), (b0, b1, t0, t1, 0, kvl)]), v)
    expect = torch.full_like(part, float("nan"))
    expect[b0:b1, h0:h1, col0:col0 + kvl + 2] = ref
    return run, expect, cover


# ---------------------------------------------------------------------------------------------- MLA_REDUCE
def _merge_driver(M: ModuleType) -> Any:
    key = ("merge", M, M)
    if key not in _DRIVERS:
        merge_max_lane, merge_den_lane, merge_lane = M.merge_max_lane, M.merge_den_lane, M.merge_lane
        SU = M.MERGE_UNROLL

        @cute.jit
        def drive(part: cute.Tensor, prows: cute.Tensor, ns: Int32, mMx: cute.Tensor, mDen: cute.Tensor,
                  mNum: cute.Tensor, PASS: cutlass.Constexpr, KVL: cutlass.Constexpr):
            for i in cutlass.range(cute.size(prows, mode=[0])):
                if cutlass.const_expr(PASS == 0):
                    for lane in cutlass.range(LANES):
                        mMx[i, lane] = merge_max_lane(part, prows[i], ns, lane, KVL)
                else:
                    for lane in cutlass.range(LANES):
                        mDen[i, lane] = merge_den_lane(part, prows[i], ns, lane, mMx[i, 0], KVL)
                    for cp in cutlass.range(KVL // 2):
                        n0, n1 = merge_lane(part, prows[i], ns, 2 * cp, mMx[i, 0], KVL, SU)
                        mNum[i, cp, 0] = n0
                        mNum[i, cp, 1] = n1

        _DRIVERS[key] = drive
    return _DRIVERS[key]


def run_mla_reduce(preset: str, B: int, h0: int, *, nsplit: int = 3, seed: int = 0, d_rows: list[int] | None = None,
                   mutant: list | None = None) -> tuple[HostRun, torch.Tensor, torch.Tensor]:
    """One MLA_REDUCE instruction (head h0, output gate on) on the host: the split merge (lanes over splits for the
    max and the denominator, one thread per latent column pair), o_lat in bf16, the W_UV rows (``d_rows``: a
    sample) and the gate. Returns the run (output ``attn_o``), the reference and the mask checked."""
    M, F = _modules(mutant)
    d = _dims(preset)
    nh, kvl, dv = d["nh"], d["kvl"], d["dv"]
    h1 = h0 + 1
    BT = _bt(B)
    rng = _rng(seed)
    part = torch.zeros(B, nh, nsplit, kvl + 2)
    part[..., :kvl] = rng.randn(B, nh, nsplit, kvl)
    part[..., kvl] = rng.randn(B, nh, nsplit) * 3.0
    part[..., kvl + 1] = 1.0 + rng.randn(B, nh, nsplit).abs() * 5.0
    part[:, :, -1, :kvl] = 0.0  # the last split is empty (past every position)
    part[:, :, -1, kvl] = float("-inf")
    part[:, :, -1, kvl + 1] = 0.0
    part = part.reshape(B, nh, nsplit * (kvl + 2)).contiguous()
    Wuv = rng.randn(nh * dv, kvl, scale=kvl**-0.5, dtype=torch.bfloat16)
    G = nh * dv + 6
    mp = rng.randn(B, 1, G, dtype=torch.bfloat16)
    out = torch.full((B, 1, nh * dv), float("nan"), dtype=torch.bfloat16)
    run = HostRun({"attn_o": out})
    wr = _Writes("attn_o", out, run.problems)
    ds = list(range(dv)) if d_rows is None else sorted(set(d_rows))
    cover = torch.zeros(B, 1, nh * dv, dtype=torch.bool)
    drive = _merge_driver(M)
    U = 4 if BT <= 2 else 2
    for t in range(B // BT):
        for h in range(h0, h1):
            bb = torch.arange(BT)
            prows = ((t * BT + bb) * nh + h) * part.shape[2]
            mx = torch.full((BT, LANES), float("nan"))
            den = torch.full((BT, LANES), float("nan"))
            num = torch.full((BT, kvl // 2, 2), float("nan"))
            pf = part.reshape(-1)
            with host_trace():
                drive(_t(pf), _t(prows), nsplit, _t(mx), _t(den), _t(num), 0, kvl)
            M_ = mx.amax(1, keepdim=True).expand(BT, LANES).contiguous()  # the butterfly fmax: order-free
            with host_trace():
                drive(_t(pf), _t(prows), nsplit, _t(M_), _t(den), _t(num), 1, kvl)
            D = _wsum(den, 1)
            olat = (num.reshape(BT, kvl) * (1.0 / D)[:, None]).to(torch.bfloat16)
            dots = _gemv_rows(F, Wuv, h0 * dv, (h1 - h0) * dv, [(h - h0) * dv + j for j in ds], olat, None, U)
            y = _bf(dots)  # [len(ds), BT]
            g = mp[t * BT:(t + 1) * BT, 0, h * dv + torch.tensor(ds)].float().T  # gate columns g0 + h·dv + d
            y = _bf(y * _bf(torch.sigmoid(g)))
            cols = torch.tensor(ds)[:, None].expand(len(ds), BT) + h * dv
            rows = (t * BT + bb)[None, :].expand(len(ds), BT)
            wr.store((rows, torch.zeros_like(rows), cols), y, "W_UV row")
            cover[t * BT:(t + 1) * BT, 0, h * dv + torch.tensor(ds)] = True
            run.lanes_run += BT * LANES + len(ds) * LANES
    wr.check(cover)
    from kimik3.megakernel.interpreter import _mla_reduce

    ref = torch.zeros(B, 1, (h1 - h0) * dv, dtype=torch.bfloat16)
    v = [part[:, h0:h1].contiguous(), Wuv[h0 * dv:h1 * dv].view(1, -1, kvl), mp[:, :, h0 * dv:h1 * dv], ref]
    _mla_reduce(_interp(d), _ins((h0, h1, 1), []), v)
    expect = torch.full((B, 1, nh * dv), float("nan"))
    expect[:, :, h0 * dv:h1 * dv] = ref.float()
    return run, expect, cover


# ---------------------------------------------------------------------------------------------- cases, CLI
def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One host execution: ``op`` (q, kv_append, partial, reduce), ``preset``, ``batch`` and the runner's keyword
    ``args``; optional ``mutant`` ([module, [[old, new], ...]]). Returns the problems, the relative error against the
    interpreter's reference on the covered elements, the tolerance and ``ok``."""
    import time

    from kimik3.validation.metric import TOL, rel_error

    t0 = time.perf_counter()
    op, preset, B = case["op"], case["preset"], int(case["batch"])
    kw = dict(case.get("args", {}))
    mut = case.get("mutant")
    if op == "q":
        run, ref, cover = run_mla_q(preset, B, kw.pop("h0", 0), mutant=mut, **kw)
        errors = {"mq": rel_error(run.outputs["mq"].float()[cover], ref[cover])}
    elif op == "kv_append":
        run, got, ref = run_mla_kv_append(preset, B, mutant=mut, **kw)
        errors = {k: rel_error(got[k], ref[k]) for k in got}
    elif op == "partial":
        run, ref, cover = run_mla_partial(preset, B, mutant=mut, **kw)
        got = run.outputs["part"]
        fin = cover & torch.isfinite(ref)  # the empty split's max is -inf on both sides
        errors = {"part": rel_error(got[fin], ref[fin])}
        if not torch.equal(torch.isneginf(got[cover]), torch.isneginf(ref[cover])):
            run.problems.append("part: the max of an empty split is not -inf where the reference's is")
    elif op == "reduce":
        run, ref, cover = run_mla_reduce(preset, B, kw.pop("h0", 0), mutant=mut, **kw)
        errors = {"attn_o": rel_error(run.outputs["attn_o"].float()[cover], ref[cover])}
    else:
        raise ValueError(f"host_exec_mk_mla: unknown op {op!r}")
    bound = TOL["kernel_bf16"]
    ok = not run.problems and all(e <= bound for e in errors.values())
    return {"case": case, "problems": run.problems[:5], "errors": errors, "tol": bound, "ok": ok,
            "lanes": run.lanes_run, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec_mk_mla CASES.json``: one JSON line per case on stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec_mk_mla", argv)


if __name__ == "__main__":
    raise SystemExit(main())
