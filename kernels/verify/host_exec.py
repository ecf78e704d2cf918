"""Host execution of the kernels' device code: the same ``@cute.jit`` helpers the GPU kernels call, run on CPU tensors.

The drivers walk every block, warp and lane of a real launch inside one compiled host function, calling the kernels'
own helpers (which rows, batch rows and expert a warp owns; what a lane loads and accumulates), and hand back the
per-lane partials; Python then replays the thin GPU layer (the butterfly ``warp_sum``, epilogues, stores into
NaN-poisoned outputs with every write counted) and compares with the module's ``reference``. Approximate
instructions are evaluated in exact fp32 here. Entry points: ``run_gemv``, ``run_lm_head``, ``run_moe``,
``run_attn_res``, ``run_mk_tile_gemv``, ``run_mk_addr``, the case runner ``run_case`` / ``main`` and the mutant
loaders. Device-only code aborts the process: run these in a subprocess when a helper might be mutated.
Design: docs/architecture.md#appendix-design-notes-by-room (``kernels/verify/host_exec.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.runtime import from_dlpack
from kimik3.kernels.common import device as C
from kimik3.kernels.common.trace import host_trace
from kimik3.kernels.fused import gemv as _gemv
from kimik3.kernels.fused import moe as _moe
from kimik3.kernels.reference import common as ref_common
from kimik3.kernels.reference import gemv as _gemv_ref
from kimik3.kernels.reference import moe as _moe_ref
from kimik3.kernels.toolchain import dsl

__all__ = ["HostRun", "warp_sum", "run_gemv", "run_lm_head", "run_moe", "corner_indices"]

LANES = 32


@dataclass
class HostRun:
    """Outputs of a host execution, with the problems found while storing them (empty when clean)."""

    outputs: dict[str, torch.Tensor]
    problems: list[str] = field(default_factory=list)
    lanes_run: int = 0


def warp_sum(p: torch.Tensor, dim: int) -> torch.Tensor:
    """``common.device.warp_sum`` over the lane axis ``dim``: five ``shfl.sync.bfly`` steps, offsets 16, 8, 4, 2,
    1; each lane adds its partner's value to its own, in fp32, so every lane ends with the same bits. Returns lane
    0's."""
    p = p.movedim(dim, -1)
    if p.shape[-1] != LANES:
        raise ValueError(f"warp_sum: axis {dim} must be the {LANES} lanes, got shape {list(p.shape)}")
    # lane 0's total only depends on lanes l < off at each step, whose partner l ^ off is l + off: the same adds in
    # the same order as the full butterfly, on half the lanes per step
    for off in (16, 8, 4, 2, 1):
        p = p[..., :off] + p[..., off:2 * off]
    return p[..., 0]


def corner_indices(n: int, k: int = 2) -> list[int]:
    """The first and last ``k`` indices of ``range(n)`` (tile corners and edges), deduplicated, ascending."""
    if n <= 0:
        raise ValueError(f"corner_indices: n must be positive, got {n}")
    return sorted({*range(min(k, n)), *range(max(0, n - k), n)})


def _t(x: torch.Tensor | None) -> Any:
    return None if x is None else from_dlpack(x, assumed_align=16)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


class _Writes:
    """Stores into a poisoned output with a per-element write count (written twice / never / out of bounds)."""

    def __init__(self, name: str, out: torch.Tensor, problems: list[str]) -> None:
        self.name, self.out, self.problems = name, out, problems
        self.count = torch.zeros(out.shape, dtype=torch.int32)

    def store(self, idx: tuple[torch.Tensor, ...], values: torch.Tensor, who: str) -> None:
        """Store ``values`` at the index tensors ``idx`` (one per output dimension, same shape as ``values``)."""
        idx = tuple(torch.as_tensor(i, dtype=torch.int64).reshape(-1) for i in idx)
        values = values.reshape(-1)
        inside = torch.ones_like(idx[0], dtype=torch.bool)
        for i, n in zip(idx, self.out.shape):
            inside &= (i >= 0) & (i < n)
        if not inside.all():
            k = int((~inside).nonzero()[0, 0])
            self.problems.append(f"{self.name}: {who} writes {tuple(int(i[k]) for i in idx)} outside "
                                 f"{list(self.out.shape)} ({int((~inside).sum())} stores)")
        idx = tuple(i[inside] for i in idx)
        self.out[idx] = values[inside].to(self.out.dtype)
        self.count.index_put_(idx, torch.ones_like(idx[0], dtype=torch.int32), accumulate=True)

    def check(self, expect: torch.Tensor | None = None) -> None:
        """Every element (or those where ``expect`` is true) written exactly once."""
        mask = torch.ones_like(self.count, dtype=torch.bool) if expect is None else expect
        bad = ((self.count != 1) & mask).nonzero()
        if len(bad):
            first = tuple(bad[0].tolist())
            self.problems.append(f"{self.name}: {len(bad)} element(s) not written exactly once, first {first} "
                                 f"written {int(self.count[first])}x")


# ---------------------------------------------------------------------------------------------- GEMV
_DRIVERS: dict[tuple[str, ModuleType], Any] = {}


def _gemv_host(G: ModuleType) -> Any:
    """A host driver over every warp and lane of the CTAs listed in mBlocks (bt, rg), calling ``G.gemv_tile`` /
    ``G.gemv_lane`` of the kernel module ``G`` (bound by closure: the DSL cannot carry a module through a loop)."""
    if ("gemv", G) in _DRIVERS:
        return _DRIVERS[("gemv", G)]
    gemv_tile, gemv_lane, warps = G.gemv_tile, G.gemv_lane, G.WARPS

    @cute.jit
    def drive(mW: cute.Tensor, mX: cute.Tensor, mG: Any, mBlocks: cute.Tensor, mCoord: cute.Tensor,
              mPart: cute.Tensor, mSsq: Any, BT: cutlass.Constexpr):
        N = cute.size(mW, mode=[0])
        for i in cutlass.range(cute.size(mBlocks, mode=[0])):
            for warp in cutlass.range(warps):
                row, x0 = gemv_tile(mBlocks[i, 0], mBlocks[i, 1], warp, BT)
                mCoord[i, warp, 0] = row
                mCoord[i, warp, 1] = x0
                if row < N:
                    acc = cute.make_rmem_tensor((BT,), Float32)
                    ssq = None
                    if const_expr(mG is not None):
                        ssq = cute.make_rmem_tensor((BT,), Float32)
                    for lane in cutlass.range(LANES):
                        gemv_lane(mW, mX, mG, row, x0, lane, acc, ssq, BT)
                        for b in cutlass.range_constexpr(BT):
                            mPart[i, warp, lane, b] = acc[b]
                            if const_expr(mG is not None):
                                mSsq[i, warp, lane, b] = ssq[b]

    _DRIVERS[("gemv", G)] = drive
    return drive


def run_gemv(variant: str, t: dict[str, torch.Tensor], *, module: ModuleType = _gemv,
             row_blocks: list[int] | None = None, act: str | None = None) -> HostRun:
    """Execute the GEMV launch of ``variant`` (plain / rmsnorm / residual / f32out) on the host.

    ``row_blocks`` restricts the launch to those grid-y CTAs (every batch tile of each); the write-once check then
    covers only their rows. ``module`` is the kernel module whose helpers run (a mutated copy in the tests)."""
    if variant not in ("plain", "rmsnorm", "residual", "f32out"):
        raise ValueError(f"run_gemv: unsupported variant {variant!r}")
    W, x = t["W"], t["x"]
    N, K = W.shape
    B = x.shape[0]
    BT = C.batch_tile(B)
    gx, gy = B // BT, C.ceil_div(N, module.WARPS)
    rgs = list(range(gy)) if row_blocks is None else sorted(set(row_blocks))
    if any(r < 0 or r >= gy for r in rgs):
        raise ValueError(f"run_gemv: row blocks {rgs} outside the grid's {gy}")
    blocks = torch.tensor([(bt, rg) for rg in rgs for bt in range(gx)], dtype=torch.int32)
    nb, nw = len(blocks), module.WARPS
    gamma = t.get("gamma") if variant == "rmsnorm" else None
    coord = torch.full((nb, nw, 2), -1, dtype=torch.int32)
    part = torch.full((nb, nw, LANES, BT), float("nan"))
    ssq = torch.full((nb, nw, LANES, BT), float("nan")) if gamma is not None else None
    with host_trace():
        _gemv_host(module)(_t(W), _t(x), _t(gamma), _t(blocks), _t(coord), _t(part), _t(ssq), BT)
    y = t["y"]
    y.fill_(float("nan"))  # poisoned: an element no lane stores stays NaN and fails the comparison
    run = HostRun({"y": y})
    wr = _Writes("y", y, run.problems)
    dot = warp_sum(part, 2)  # [nb, nw, BT]
    if gamma is not None:
        dot = dot * torch.rsqrt(warp_sum(ssq, 2) * (1.0 / K) + module.RMS_EPS)
    if act == "sigmoid":
        dot = _sigmoid(dot)
    row = coord[:, :, 0, None].long().expand(nb, nw, BT)
    xb = (coord[:, :, 1, None] + torch.arange(BT)).long()  # batch row of each accumulator
    live = row < N  # the kernel's warp-uniform guard
    run.lanes_run = int(live[:, :, 0].sum()) * LANES
    if variant == "residual":
        ok = live & (xb >= 0) & (xb < B)
        if not ok[live].all():
            run.problems.append(f"residual: batch rows outside {B} read")
        dot = torch.where(ok, dot + t["residual"].float()[xb.clamp(0, B - 1), row.clamp(0, N - 1)], dot)
    wr.store((xb[live], row[live]), dot[live], "gemv")
    rows = torch.zeros(N, dtype=torch.bool)
    for rg in rgs:
        rows[rg * module.WARPS:(rg + 1) * module.WARPS] = True
    wr.check(rows.expand(B, N))
    return run


def _lm_head_host(G: ModuleType) -> Any:
    """lm_head CTAs (bt, cta): Σ x² partials per lane (``G.x_sumsq_lane``), then each warp's rows
    (``G.lm_head_row0`` + r) through ``G.gemv_lane``."""
    if ("lm_head", G) in _DRIVERS:
        return _DRIVERS[("lm_head", G)]
    gemv_tile, gemv_lane, x_sumsq_lane, row0_of = G.gemv_tile, G.gemv_lane, G.x_sumsq_lane, G.lm_head_row0
    warps, rows = G.WARPS, G.LM_ROWS_PER_WARP

    @cute.jit
    def drive(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mBlocks: cute.Tensor, mCoord: cute.Tensor,
              mPart: cute.Tensor, mSsq: cute.Tensor, BT: cutlass.Constexpr):
        for i in cutlass.range(cute.size(mBlocks, mode=[0])):
            for warp in cutlass.range(warps):
                _, x0 = gemv_tile(mBlocks[i, 0], mBlocks[i, 1], warp, BT)
                row0 = row0_of(mBlocks[i, 1], warp)
                mCoord[i, warp, 0] = row0
                mCoord[i, warp, 1] = x0
                acc = cute.make_rmem_tensor((BT,), Float32)
                for lane in cutlass.range(LANES):
                    for b in cutlass.range_constexpr(BT):
                        mSsq[i, warp, lane, b] = x_sumsq_lane(mX, x0 + b, lane)
                    for r in cutlass.range(rows):
                        gemv_lane(mW, mX, mG, row0 + r, x0, lane, acc, None, BT)
                        for b in cutlass.range_constexpr(BT):
                            mPart[i, warp, r, lane, b] = acc[b]

    _DRIVERS[("lm_head", G)] = drive
    return drive


def run_lm_head(t: dict[str, torch.Tensor], *, module: ModuleType = _gemv) -> HostRun:
    """The whole lm_head launch on the host: logits, the per-CTA arg-max (strict > over ascending rows, then over
    warps) and the final arg-max over the partials (ties to the lower index), as the two kernels do."""
    W, x, g = t["W"], t["x"], t["gamma"]
    V, K = W.shape
    B = x.shape[0]
    BT = C.batch_tile(B)
    R = module.LM_ROWS_PER_WARP
    P = V // (module.WARPS * R)
    blocks = torch.tensor([(bt, c) for c in range(P) for bt in range(B // BT)], dtype=torch.int32)
    nb, nw = len(blocks), module.WARPS
    coord = torch.full((nb, nw, 2), -1, dtype=torch.int32)
    part = torch.full((nb, nw, R, LANES, BT), float("nan"))
    ssq = torch.full((nb, nw, LANES, BT), float("nan"))
    with host_trace():
        _lm_head_host(module)(_t(W), _t(x), _t(g), _t(blocks), _t(coord), _t(part), _t(ssq), BT)
    logits, tok = t["logits"].fill_(float("nan")), t["token"].fill_(-1)
    run = HostRun({"logits": logits, "token": tok})
    wr = _Writes("logits", logits, run.problems)
    rstd = torch.rsqrt(warp_sum(ssq, 2) * (1.0 / K) + module.RMS_EPS)  # [nb, nw, BT]
    d = warp_sum(part, 3) * rstd[:, :, None, :]  # [nb, nw, R, BT]
    row0 = coord[:, :, 0].long()  # [nb, nw]
    x0 = coord[:, :, 1].long()
    rows = (row0[:, :, None, None] + torch.arange(R)[:, None]).expand(nb, nw, R, BT)
    xb = (x0[:, :, None, None] + torch.arange(BT)).expand(nb, nw, R, BT)
    run.lanes_run = nb * nw * LANES
    wr.store((xb, rows), d, "lm_head")
    wr.check()
    # per-CTA arg-max: each warp keeps the first row of its maximum (strict > over ascending rows), then the CTA
    # takes warp 0's and replaces it only on a strictly larger value (torch.max returns the first maximum)
    wv, wi = d.max(dim=2)  # [nb, nw, BT]
    wrow = torch.gather(rows, 2, wi[:, :, None, :]).squeeze(2)
    cv, ci = wv.max(dim=1)  # [nb, BT]
    crow = torch.gather(wrow, 1, ci[:, None, :]).squeeze(1)
    pv = torch.full((B, P), float("nan"))
    pi = torch.full((B, P), -1, dtype=torch.int64)
    cta = blocks[:, 1, None].long().expand(nb, BT)
    pb = x0[:, 0, None] + torch.arange(BT)
    pv[pb, cta], pi[pb, cta] = cv, crow
    # the arg-max kernel: the largest value, ties to the lower vocabulary index
    best = pv.max(dim=1, keepdim=True).values
    tok.copy_(torch.where(pv == best, pi, torch.iinfo(torch.int64).max).min(dim=1).values.to(tok.dtype))
    return run


# ---------------------------------------------------------------------------------------------- MoE experts
def _moe_host(G: ModuleType) -> Any:
    """A host driver over every CTA (rg, slot a), warp, token tile and lane of an ``expert_gemv_kernel`` launch,
    calling ``G.expert_row`` / ``G.expert_lane``; per-lane partials and the tile's pairs come back."""
    if ("moe", G) in _DRIVERS:
        return _DRIVERS[("moe", G)]
    expert_row, expert_slot, weight_rows = G.expert_row, G.expert_slot, G.expert_weight_rows
    expert_lane, warps = G.expert_lane, G.WARPS

    @cute.jit
    def drive(mWA: cute.Tensor, mWB: Any, mSA: Any, mSB: Any, mX: cute.Tensor, mSorted: cute.Tensor,
              mActE: cute.Tensor, mActStart: cute.Tensor, mActCount: cute.Tensor, mNAct: cute.Tensor,
              mCoord: cute.Tensor, mPartA: cute.Tensor, mPartB: Any, mPair: cute.Tensor, gy: Int32,
              K: cutlass.Constexpr, XDIV: cutlass.Constexpr, BT: cutlass.Constexpr):
        R = cute.size(mWA, mode=[1])
        for a in cutlass.range(cute.size(mActE, mode=[0])):
            for rg in cutlass.range(gy):
                for warp in cutlass.range(warps):
                    row = expert_row(rg, warp)
                    mCoord[a, rg, warp] = row
                    if (a < mNAct[0]) & (row < R):
                        e, start, cnt = expert_slot(mActE, mActStart, mActCount, a)
                        gA, gB, gSA, gSB = weight_rows(mWA, mWB, mSA, mSB, e, row)
                        accA = cute.make_rmem_tensor((BT,), Float32)
                        accB = cute.make_rmem_tensor((BT,), Float32)
                        pair = cute.make_rmem_tensor((BT,), Int32)
                        for t0 in cutlass.range(0, cnt, BT):
                            for lane in cutlass.range(LANES):
                                expert_lane(gA, gB, gSA, gSB, mX, mSorted, start, cnt, t0, lane, accA, accB, pair,
                                            K, XDIV, BT)
                                for t in cutlass.range_constexpr(BT):
                                    mPartA[a, rg, warp, t0 // BT, lane, t] = accA[t]
                                    if const_expr(mWB is not None):
                                        mPartB[a, rg, warp, t0 // BT, lane, t] = accB[t]
                            for t in cutlass.range_constexpr(BT):
                                mPair[a, rg, warp, t0 // BT, t] = pair[t]

    _DRIVERS[("moe", G)] = drive
    return drive


def _combine_host(G: ModuleType) -> Any:
    if ("combine", G) in _DRIVERS:
        return _DRIVERS[("combine", G)]
    combine_chunk, vec = G.combine_chunk, G.VEC

    @cute.jit
    def drive(mY: cute.Tensor, mWts: cute.Tensor, mOut: cute.Tensor):
        for b in cutlass.range(cute.size(mOut, mode=[0])):  # one CTA per token; threads own 8-column chunks
            for c in cutlass.range(cute.size(mOut, mode=[1]) // vec):
                combine_chunk(mY, mWts, mOut, b, c)

    _DRIVERS[("combine", G)] = drive
    return drive


def moe_align(ids: torch.Tensor, n_slots: int) -> dict[str, torch.Tensor]:
    """What ``moe_align_kernel`` produces, from its specification: the B·k pairs stably sorted by expert, the active
    experts ascending with start / count, their number. Slots past the number of active experts are -1."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    experts, counts = torch.unique(flat, return_counts=True)
    n = len(experts)
    if n > n_slots:
        raise ValueError(f"moe_align: {n} active experts exceed the {n_slots} slots")
    act_e = torch.full((n_slots,), -1, dtype=torch.int32)
    act_start, act_count = act_e.clone(), act_e.clone()
    act_e[:n], act_count[:n] = experts.int(), counts.int()
    act_start[:n] = (torch.cumsum(counts, 0) - counts).int()
    return {"sorted": order.int(), "act_e": act_e, "act_start": act_start, "act_count": act_count,
            "n_act": torch.tensor([n], dtype=torch.int32)}


def _situ(a: torch.Tensor, b: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """``moe.situ`` in exact fp32 math (the kernel uses tanh.approx / ex2.approx / rcp.approx)."""
    return beta * torch.tanh(a / beta) * _sigmoid(a) * (beta_lin * torch.tanh(b / beta_lin))


def _expert_gemv(G: ModuleType, run: HostRun, name: str, WA: torch.Tensor, WB: torch.Tensor | None,
                 SA: torch.Tensor | None, SB: torch.Tensor | None, X: torch.Tensor, out: torch.Tensor,
                 al: dict[str, torch.Tensor], K: int, XDIV: int, BT: int, topk: int) -> None:
    """One ``expert_gemv_kernel`` launch on the host, its epilogue and stores (``out`` poisoned first)."""
    A, R = len(al["act_e"]), WA.shape[1]
    gy = C.ceil_div(R, G.WARPS)
    tiles = max(1, C.ceil_div(int(al["act_count"].max().clamp(min=0)), BT))
    coord = torch.full((A, gy, G.WARPS), -1, dtype=torch.int32)
    pa = torch.full((A, gy, G.WARPS, tiles, LANES, BT), float("nan"))
    pb = pa.clone() if WB is not None else None
    pair = torch.full((A, gy, G.WARPS, tiles, BT), -1, dtype=torch.int32)
    with host_trace():
        _moe_host(G)(_t(WA), _t(WB), _t(SA), _t(SB), _t(X), _t(al["sorted"]), _t(al["act_e"]), _t(al["act_start"]),
                     _t(al["act_count"]), _t(al["n_act"]), _t(coord), _t(pa), _t(pb), _t(pair), gy, K, XDIV, BT)
    out.fill_(float("nan"))
    wr = _Writes(name, out, run.problems)
    ya = warp_sum(pa, 4)
    if WB is not None:
        ya = _situ(ya.bfloat16().float(), warp_sum(pb, 4).bfloat16().float(), G.SITU_BETA, G.SITU_BETA_LIN)
    ya = ya.bfloat16()
    n_act = int(al["n_act"][0])
    live = ((torch.arange(A) < n_act)[:, None, None] & (coord >= 0) & (coord < R))  # [A, gy, w]
    cnt = al["act_count"].long().clamp(min=0)[:, None, None, None, None]
    tok = (torch.arange(tiles)[:, None] * BT + torch.arange(BT))  # [tiles, BT]
    store = live[..., None, None] & (tok < cnt)  # [A, gy, w, tiles, BT]
    run.lanes_run += int(live.sum()) * LANES
    rows = coord[..., None, None].long().expand_as(store)
    wr.store((pair.long()[store], rows[store]), ya[store], name)
    wr.check()


def run_moe(variant: str, t: dict[str, torch.Tensor], *, module: ModuleType = _moe) -> HostRun:
    """The routed-expert op on the host: align (from its specification), gate/up with SiTU-GLU, down, combine;
    the two expert GEMV launches and the combine run the kernel module's helpers."""
    if variant not in module.VARIANTS:
        raise ValueError(f"run_moe: unknown variant {variant!r}")
    x, ids, wts = t["x"], t["ids"], t["weights"]
    B, topk = ids.shape
    E, I, L = t["w1"].shape[0], t["w1"].shape[1], x.shape[1]  # noqa: E741 - spec notation
    BT = module.token_tile(B, topk, E)
    al = moe_align(ids, min(E, B * topk))
    fp4 = variant == "mxfp4"
    run = HostRun({})
    h = t["h"]
    _expert_gemv(module, run, "h", t["w1"], t["w3"], t.get("s1") if fp4 else None, t.get("s3") if fp4 else None,
                 x, h, al, L, topk, BT, topk)
    y = t["y"]
    _expert_gemv(module, run, "y", t["w2"], None, t.get("s2") if fp4 else None, None, h, y, al, I, 1,
                 module.down_tile(BT, fp4), topk)
    out = t["out"].fill_(float("nan"))
    with host_trace():
        _combine_host(module)(_t(y), _t(wts), _t(out))
    if torch.isnan(out).any():
        run.problems.append(f"out: {int(torch.isnan(out).sum())} element(s) never written")
    run.outputs.update({"h": h, "y": y, "out": out})
    return run


# ---------------------------------------------------------------------------------------------- AttnRes mix
def _attn_res_host(A: ModuleType) -> Any:
    """Two passes over every CTA (token b) and thread of an ``attn_res_kernel`` launch: ``A.attn_res_partials``
    (partials out), then, with the softmax weights computed on the host, the partials' loads again (the kernel
    keeps them in registers across its barrier) and ``A.attn_res_store``."""
    if ("attn_res", A) in _DRIVERS:
        return _DRIVERS[("attn_res", A)]
    partials, store, rv_shape = A.attn_res_partials, A.attn_res_store, A.rv_shape

    @cute.jit
    def drive(mCand: cute.Tensor, mOmega: cute.Tensor, mOut: cute.Tensor, mPart: cute.Tensor, mAlpha: cute.Tensor,
              NT: cutlass.Constexpr, STORE: cutlass.Constexpr):
        NC, H = cute.size(mCand, mode=[0]), cute.size(mCand, mode=[2])
        part = cute.make_rmem_tensor((2 * NC,), Float32)
        alpha = cute.make_rmem_tensor((NC,), Float32)
        rv = cute.make_rmem_tensor(rv_shape(NC, H, NT), cutlass.BFloat16)
        for b in cutlass.range(cute.size(mCand, mode=[1])):
            for tidx in cutlass.range(NT):
                partials(mCand, mOmega, b, tidx, rv, part, NT)
                if const_expr(STORE):
                    for j in cutlass.range_constexpr(NC):
                        alpha[j] = mAlpha[b, j]
                    store(mCand, mOut, b, tidx, rv, alpha, NT)
                else:
                    for i in cutlass.range_constexpr(2 * NC):
                        mPart[b, tidx, i] = part[i]

    _DRIVERS[("attn_res", A)] = drive
    return drive


def run_attn_res(t: dict[str, torch.Tensor], *, module: ModuleType | None = None) -> HostRun:
    """The AttnRes mix on the host: per-thread partials, the CTA reduction in the kernel's order (butterfly per
    warp, per-warp totals re-reduced by a butterfly over lanes < NW), the softmax in exact fp32, the mix."""
    from kimik3.kernels.fused import attn_res

    A = attn_res if module is None else module
    cand, omega = t["cand"], t["omega"]
    NC, B, H = cand.shape
    NT = A.threads_for(H, NC)
    part = torch.full((B, NT, 2 * NC), float("nan"))
    alpha = torch.full((B, NC), float("nan"))
    out = t["out"].fill_(float("nan"))
    with host_trace():
        _attn_res_host(A)(_t(cand), _t(omega), _t(out), _t(part), _t(alpha), NT, False)
    nw = NT // LANES
    red = warp_sum(part.view(B, nw, LANES, 2 * NC), 2)  # [B, NW, 2NC]: lane 0 of each warp -> smem
    lanes = torch.zeros(B, LANES, 2 * NC)
    lanes[:, :nw] = red  # lanes < NW read the per-warp totals, the others 0
    tot = warp_sum(lanes, 1)  # [B, 2NC]
    score = tot[:, 1::2] * torch.rsqrt(tot[:, 0::2] * (1.0 / H) + A.EPS)
    alpha.copy_(torch.softmax(score, dim=-1))
    with host_trace():
        _attn_res_host(A)(_t(cand), _t(omega), _t(out), _t(part), _t(alpha), NT, True)
    run = HostRun({"out": out}, lanes_run=B * NT)
    if torch.isnan(out).any():
        run.problems.append(f"out: {int(torch.isnan(out).sum())} element(s) never written")
    return run


# ---------------------------------------------------------------------------------------------- megakernel tile GEMV
def _mk_gemv_host(F: ModuleType) -> Any:
    """Every row of a weight box, batch tile and lane through ``F.weight_row_dot`` (device_fns), the one tile-GEMV
    helper of the megakernel's GEMV opcodes: the first ``staged`` rows from the stage the prefetch fills (row j at
    chunk j·nch), the others from global memory at ``w_addr``, x rows at chunk ``t·BT·xs`` of ``x_addr``."""
    if ("mk_gemv", F) in _DRIVERS:
        return _DRIVERS[("mk_gemv", F)]
    from kimik3.kernels.contracts.addr import gemv_item

    weight_row_dot, gchunks = F.weight_row_dot, F.gchunks

    @cute.jit
    def drive(stage: cute.Tensor, staged: Int32, w_addr: cutlass.Int64, x_addr: cutlass.Int64,
              g_addr: cutlass.Int64, nrows: Int32, nch: Int32, xs: Int32, NBT: cutlass.Constexpr,
              mPart: cute.Tensor, BT: cutlass.Constexpr, U: cutlass.Constexpr, GAMMA: cutlass.Constexpr):
        xv = gchunks(x_addr)
        gv = None
        if const_expr(GAMMA):
            gv = gchunks(g_addr)
        acc = cute.make_rmem_tensor((BT,), Float32)
        for k in cutlass.range(nrows * NBT):  # the GEMV opcodes' work items: (row, pass) from mk_addr.gemv_item
            j, t = gemv_item(k, nrows, NBT)
            for lane in cutlass.range(LANES):
                weight_row_dot(stage, staged, w_addr, j, nch, xv, t * BT * xs, xs, False, gv, acc, BT, U, lane,
                               True)  # the GEMV opcodes' wide tail
                for b in cutlass.range_constexpr(BT):
                    mPart[j, t, lane, b] = acc[b]

    _DRIVERS[("mk_gemv", F)] = drive
    return drive


def run_mk_tile_gemv(*, B: int, N: int, K: int, staged: int, gamma: bool, seed: int = 0, arch: str = "sm_90a",
                     module: ModuleType | None = None) -> tuple[HostRun, torch.Tensor]:
    """The megakernel's tile GEMV ``y[b, j] = Σ_k W[j, k] (γ_k) x[b, k]`` for a weight box of N rows with the first
    ``staged`` rows in the prefetch stage, batch tiles and unroll as the GEMV opcodes compiled for ``arch`` walk them
    (``mk_addr.gemv_batch_tile``, ``mk_addr.gemv_unroll``). Returns the run (output ``y``, fp32) and the fp32
    reference."""
    from kimik3.kernels.contracts import addr as mk_addr
    from kimik3.kernels.megakernel import device_fns

    F = device_fns if module is None else module
    if K % F.VEC or not 0 <= staged <= N:
        raise ValueError(f"run_mk_tile_gemv: K={K} must be a multiple of {F.VEC} and 0 <= staged={staged} <= N={N}")
    if arch not in dsl.SUPPORTED_ARCHS:
        raise ValueError(f"run_mk_tile_gemv: unsupported arch {arch!r}; expected one of {dsl.SUPPORTED_ARCHS}")
    rng = ref_common.Rng(seed)
    W = rng.randn(N, K, scale=K**-0.5, dtype=torch.bfloat16)
    x = rng.randn(B, K, dtype=torch.bfloat16)
    g = (1.0 + rng.randn(K, scale=0.1)).to(torch.bfloat16)
    nch = K // F.VEC
    # the stage as the prefetch leaves it: row j of the box at chunk j·nch, 16-byte chunks [chunk, 8]; room for
    # every row, the unfilled part poisoned (a row read from the stage that the prefetch did not fill is NaN)
    stage = torch.full((N * nch, F.VEC), float("nan"), dtype=torch.bfloat16)
    stage[:staged * nch] = W[:staged].reshape(-1, F.VEC)
    BT = mk_addr.gemv_batch_tile(B)
    U = mk_addr.gemv_unroll(arch, BT)  # as the GEMV opcodes (kernels/megakernel/gemv.py)
    part = torch.full((N, B // BT, LANES, BT), float("nan"))
    with host_trace():
        _mk_gemv_host(F)(_t(stage), staged, W.data_ptr(), x.data_ptr(), g.data_ptr(), N, nch, nch, B // BT,
                         _t(part), BT, U, gamma)
    y = torch.full((B, N), float("nan"))
    run = HostRun({"y": y}, lanes_run=N * (B // BT) * LANES)
    wr = _Writes("y", y, run.problems)
    rows = torch.arange(N)[:, None, None].expand(N, B // BT, BT)
    xb = (torch.arange(B // BT)[:, None] * BT + torch.arange(BT)).expand(N, B // BT, BT)
    wr.store((xb, rows), warp_sum(part, 2), "tile gemv")
    wr.check()
    ref = (x.float() * (g.float() if gamma else 1.0)) @ W.float().T
    return run, ref


# ---------------------------------------------------------------------------------------------- megakernel addresses
def run_mk_addr(rows: torch.Tensor, *, module: ModuleType | None = None) -> torch.Tensor:
    """The megakernel's shared address functions (``mk_addr.elem_offset``, ``tile_rows``, ``expert_row_offset``)
    executed as traced DSL integers on the host, with the device's types (Int32 words, ``wide=Int64``): ``rows``
    is ``[n, 6]`` int32 (d1, d2, b, r, c, r1) per operand of a program; returns ``[n, 3]`` int64 (the element
    offset of [b, r, c], the tile rows of [r, r1), the offset of row r of expert b). ``addr_replay.replay`` evaluates
    the same functions on Python ints; the two must agree (64-bit offsets past 2^31 included)."""
    from kimik3.kernels.contracts import addr as mk_addr

    H = module or mk_addr
    key = ("mk_addr", H)
    if key not in _DRIVERS:
        elem_offset, tile_rows, expert_row_offset = H.elem_offset, H.tile_rows, H.expert_row_offset

        @cute.jit
        def drive(mIn: cute.Tensor, mOut: cute.Tensor):
            for i in cutlass.range(cute.size(mIn, mode=[0])):
                d1, d2, b, r, c, r1 = mIn[i, 0], mIn[i, 1], mIn[i, 2], mIn[i, 3], mIn[i, 4], mIn[i, 5]
                mOut[i, 0] = elem_offset(d1, d2, b, r, c, Int64)
                mOut[i, 1] = Int64(tile_rows(r, r1))
                mOut[i, 2] = expert_row_offset(d1, d2, b, r, Int64)

        _DRIVERS[key] = drive
    if rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[1] != 6:
        raise ValueError(f"run_mk_addr: rows must be [n, 6] int32, got {rows.dtype} {list(rows.shape)}")
    rows = rows.contiguous()
    out = torch.full((rows.shape[0], 3), -1, dtype=torch.int64)
    with host_trace():
        _DRIVERS[key](_t(rows), _t(out))
    return out


# ---------------------------------------------------------------------------------------------- cases, mutants, CLI
KERNELS = __package__.rsplit(".", 1)[0]  # kimik3.kernels (also under -m): kernel modules named by their path in it


def _kernel_source(name: str, caller: str) -> str:
    """The source text of kernel module ``name`` (its dotted path under ``kernels/``, e.g. ``"fused.gemv"``,
    ``"megakernel.moe"``; ``caller`` names the function in the error)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(f"{KERNELS}.{name}") if "." in name else None
    if spec is None or spec.origin is None:
        raise ValueError(f"{caller}: no kernel module {name!r} (a dotted path under kernels/, e.g. 'fused.gemv')")
    return Path(spec.origin).read_text()


def _mutant_name(name: str) -> str:
    """The module name of kernel module ``name``'s mutated copy: ``_mutant_<leaf>`` in the original's package, so
    that an absolute import of it resolves as the original's does (``from kimik3.kernels.common import
    _mutant_device``)."""
    pkg, leaf = name.rsplit(".", 1)
    return f"{KERNELS}.{pkg}._mutant_{leaf}"


def mutated_modules(mutant: list | None, modules: dict[str, ModuleType], owner: str) -> dict[str, ModuleType]:
    """The kernel modules a host run uses, by name; with ``mutant`` = [name, [[old, new], ...]] the one it names
    replaced by its mutated copy (:func:`load_mutant`). A mutant of any other module is refused."""
    out = dict(modules)
    if mutant:
        name, reps = mutant
        if name not in out:
            raise ValueError(f"{owner}: mutants of {' or '.join(out)} only, got {name!r}")
        out[name] = load_mutant(name, [tuple(r) for r in reps])
    return out


def load_mutant(name: str, replacements: list[tuple[str, str]]) -> ModuleType:
    """A copy of kernel module ``name`` (``"fused.gemv"``, ``"megakernel.device_fns"``, ...) with each (old, new)
    replacement applied exactly once: a planted bug.

    The mutated source is written to a file and imported from there (the DSL reads a function's source to trace
    it, so an in-memory copy would trace the original) as ``_mutant_<leaf>`` of the original's package; its
    absolute imports resolve as the original's."""
    import importlib.util
    import re
    import sys
    import tempfile
    from pathlib import Path

    src = _kernel_source(name, "load_mutant")
    for old, new in replacements:
        if src.count(old) != 1:
            raise ValueError(f"load_mutant: {old!r} occurs {src.count(old)} times in {name}, expected once")
        src = src.replace(old, new)
    # the source hash names the module's own files (a fused op: kernel_source_hash(__name__.rsplit(...)), the VM:
    # kernel_source_hash("megakernel")); the copy is never built, so any string does
    src = re.sub(r'kernel_source_hash\((?:__name__\.rsplit\("\.", 1\)\[-1\]|"\w+")\)', '"mutant"', src)
    mname = _mutant_name(name)
    path = Path(tempfile.mkdtemp(prefix="kimik3-mutant-")) / f"{mname.rsplit('.', 1)[1]}.py"
    path.write_text(src)
    mspec = importlib.util.spec_from_file_location(mname, path)
    assert mspec is not None and mspec.loader is not None
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[mname] = mod
    mspec.loader.exec_module(mod)
    return mod


# a module whose helpers several kernel modules import: a planted bug in it reaches the device code through them
SHARED_MODULES = ("common.device",)


def load_case_mutant(mutant: list, user: str) -> tuple[str, ModuleType]:
    """A case's ``mutant`` ([module, [[old, new], ...]]) loaded: (kernel module name, mutated module). A mutated
    shared module (``SHARED_MODULES``, e.g. ``common.device``'s MXFP4 decode) comes back as a copy of ``user``, the
    kernel module the case runs, that imports the mutated copy in place of the original, so the device code it traces
    calls the mutated helpers."""
    mname, reps = mutant
    mod = load_mutant(mname, [tuple(r) for r in reps])
    if mname not in SHARED_MODULES:
        return mname, mod
    pkg, leaf = mname.rsplit(".", 1)
    src = _kernel_source(user, "load_case_mutant")
    # the two import forms of the kernel modules: `from kimik3.kernels.common import device as C`,
    # `from kimik3.kernels.common.device import a, b`
    forms = [(f"from {KERNELS}.{pkg} import {leaf} as", f"from {KERNELS}.{pkg} import _mutant_{leaf} as"),
             (f"from {KERNELS}.{mname} import", f"from {mod.__name__} import")]
    imports = [f for f in forms if src.count(f[0]) == 1]
    if not imports:
        raise ValueError(f"load_case_mutant: {user} does not import {mname} once (as {forms[0][0]!r} or "
                         f"{forms[1][0]!r}), so a mutant of {mname} would not reach its device code")
    return user, load_mutant(user, imports)


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One host execution: ``family`` (gemv.<variant> or moe.<variant>), ``preset``, ``batch``; optional
    ``shapes`` overrides (e.g. fewer experts at k3-shard widths), ``row_blocks`` (GEMV: sampled grid-y CTAs,
    ``"corners"`` for the first and last two) and ``mutant`` ([module, [[old, new], ...]]; module ``common.device``:
    the case's kernel module runs with the mutated shared helpers, ``load_case_mutant``). Returns the problems,
    the relative errors against the reference, the tolerance, and ``ok``."""
    import time

    from kimik3.kernels.toolchain import registry

    from kimik3.model.config import get_preset
    from kimik3.validation.metric import TOL, rel_error

    t0 = time.perf_counter()
    if case["family"] == "megakernel.tile_gemv":
        own = {"megakernel.device_fns": None}  # the tile GEMV's module (None: the original)
        mod = mutated_modules(case.get("mutant"), own, "run_case")["megakernel.device_fns"]
        run, ref = run_mk_tile_gemv(**case["shapes"], module=mod)
        err = rel_error(run.outputs["y"], ref)
        bound = TOL["kernel_state_fp32"]  # fp32 out of bf16 operands: only the summation order differs
        return {"case": case, "problems": run.problems, "errors": {"y": err}, "tol": bound,
                "ok": not run.problems and err <= bound, "lanes": run.lanes_run,
                "seconds": round(time.perf_counter() - t0, 2)}
    family, preset, B = case["family"], case["preset"], int(case["batch"])
    kind, variant = family.split(".", 1) if "." in family else (family, family)
    shapes = registry.FAMILIES[family].shapes(get_preset(preset), B)
    shapes.update(case.get("shapes", {}))
    mods: dict[str, Any] = {"fused.gemv": _gemv, "fused.moe": _moe, "fused.attn_res": None}
    if case.get("mutant"):  # a mutated common.device reaches the case's kernel module through its import
        user = {"moe": "fused.moe", "attn_res": "fused.attn_res"}.get(kind, "fused.gemv")
        mname, mod = load_case_mutant(case["mutant"], user)
        if mname not in mods:
            raise ValueError(f"run_case: mutants of {', '.join(mods)} or common.device only, got {mname!r}")
        mods[mname] = mod
    errors: dict[str, float] = {}
    if kind == "gemv":
        t = _gemv_ref.make_inputs(variant, **shapes, seed=int(case.get("seed", 0)))
        if variant == "lm_head":
            run = run_lm_head(t, module=mods["fused.gemv"])
            ref = _gemv_ref.reference(variant, t)
            errors["logits"] = rel_error(run.outputs["logits"], ref["logits"])
            tok, lg = run.outputs["token"].long(), run.outputs["logits"]
            if not torch.equal(tok, lg.argmax(-1)):  # exact: the kernels' arg-max of the logits they wrote
                run.problems.append("token: not the arg-max of its own logits")
            else:  # against the reference, a different token only within a near-tie (as the GPU check)
                gap = ref["logits"].max(-1).values - ref["logits"].gather(1, tok[:, None])[:, 0]
                if not (gap <= 1e-2 * ref["logits"].abs().max(-1).values).all():
                    run.problems.append("token: differs from the reference's beyond a near-tie")
        else:
            rb = case.get("row_blocks")
            if rb == "corners":
                rb = corner_indices(C.ceil_div(shapes["N"], _gemv.WARPS))
            run = run_gemv(variant, t, module=mods["fused.gemv"], row_blocks=rb)
            ref = _gemv_ref.reference(variant, t)
            rows = run.outputs["y"].isnan().all(0) if rb is not None else None
            keep = slice(None) if rows is None else ~rows
            errors["y"] = rel_error(run.outputs["y"][:, keep].float(), ref["y"][:, keep])
        tol = "kernel_bf16" if variant != "f32out" else "kernel_state_fp32"  # fp32 output
    elif kind == "router":  # the scores GEMV (router launches gemv.gemv_kernel, sigmoid epilogue, fp32 out)
        from kimik3.kernels.reference import router as router_ref

        t = router_ref.make_inputs(variant, **shapes, seed=int(case.get("seed", 0)))
        run = run_gemv("f32out", {"W": t["W"], "x": t["x"], "y": t["scores"]}, module=mods["fused.gemv"], act="sigmoid")
        ref = router_ref.reference(variant, t, **shapes)
        errors["scores"] = rel_error(run.outputs["y"], ref["scores"])
        tol = "kernel_state_fp32"  # fp32 output: only the summation order differs
    elif kind == "attn_res":
        from kimik3.kernels.reference import attn_res as attn_res_ref

        t = attn_res_ref.make_inputs(variant, **shapes, seed=int(case.get("seed", 0)))
        run = run_attn_res(t, module=mods["fused.attn_res"])
        errors["out"] = rel_error(run.outputs["out"].float(), attn_res_ref.reference(variant, t)["out"])
        tol = "kernel_bf16"
    elif kind == "moe":
        t = _moe_ref.make_inputs(variant, **shapes, seed=int(case.get("seed", 0)))
        run = run_moe(variant, t, module=mods["fused.moe"])
        ref = _moe_ref.reference(variant, t)
        errors["out"] = rel_error(run.outputs["out"].float(), ref["out"])
        tol = "kernel_bf16"
    else:
        raise ValueError(f"run_case: unknown family {family!r}")
    return case_result(case, run, errors, tol, t0)


def case_result(case: dict[str, Any], run: HostRun, errors: dict[str, float], tol: str | float,
                t0: float) -> dict[str, Any]:
    """The JSON line of one host-execution case: problems, errors against the reference, the tolerance (a
    ``validation.metric.TOL`` key or a number) and ``ok`` when nothing was reported and every error is within it."""
    import time

    from kimik3.validation.metric import TOL

    bound = TOL[tol] if isinstance(tol, str) else tol
    ok = not run.problems and all(e <= bound for e in errors.values())
    return {"case": case, "problems": run.problems, "errors": errors, "tol": bound, "ok": ok,
            "lanes": run.lanes_run, "seconds": round(time.perf_counter() - t0, 2)}


def cases_main(run: Any, module: str, argv: list[str] | None = None) -> int:
    """``python -m <module> CASES.json``: ``run`` each case of the JSON list, one JSON line per case on stdout (the
    command line every host-execution module shares; the tests run it in a subprocess)."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(f"usage: python -m {module} CASES.json")
    with open(args[0]) as f:
        cases = json.load(f)
    for case in cases:
        print(json.dumps(run(case)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec CASES.json``: run each case, one JSON line per case on stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec", argv)


if __name__ == "__main__":
    raise SystemExit(main())
