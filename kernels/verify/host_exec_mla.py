"""Host execution of the fused MLA decode kernels (``kernels/fused/mla_decode.py``): the same ``@cute.jit`` helpers the
two GPU kernels call, run on CPU tensors over the blocks, warps and lanes of a real launch.

``mla_split_kernel`` runs in two passes per group of blocks (the dot pass, then the warp sum and the online softmax
per lane), ``mla_combine_kernel`` per thread; Python does the stores into NaN-poisoned buffers, every store counted,
with NaN guard rows around the cache and every attended position counted. Checked against
``mla_decode.split_reference`` and ``mla_decode.reference``. Entry points: ``run_mla``, ``run_case``, ``main``.
Device-only code aborts the process: run mutants in a subprocess (``python -m kimik3.kernels.verify.host_exec_mla
CASES.json``, see ``tests/test_host_exec_mla.py``).
Design: docs/architecture.md#appendix-design-notes-by-room (``kernels/verify/host_exec_mla.py``).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32
from kimik3.kernels.common import device as C
from kimik3.kernels.common.trace import host_trace
from kimik3.kernels.fused import mla_decode as _mla
from kimik3.kernels.reference import mla_decode as _mla_ref
from kimik3.kernels.verify.host_exec import (
    LANES,
    HostRun,
    _t,
    _Writes,
    cases_main,
    corner_indices,
    mutated_modules,
    warp_sum,
)

__all__ = ["run_mla", "run_case", "SAMPLED_LANES"]

# lanes the softmax pass runs when lanes are sampled: the first and last two, and the two around the middle
SAMPLED_LANES = (0, 1, 15, 16, 30, 31)
# bytes of per-lane dot partials one group of blocks may hold (the dot pass runs group by group)
_GROUP_BYTES = 32 << 20
_DRIVERS: dict[tuple[str, ModuleType], Any] = {}


def _drivers(M: ModuleType) -> tuple[Any, Any, Any]:
    """The three host drivers over the helpers of kernel module ``M`` (bound by closure: the DSL cannot carry a
    module through a loop): the dot pass, the softmax pass and the combine."""
    if ("mla", M) in _DRIVERS:
        return _DRIVERS[("mla", M)]
    warp_heads, split_range, row, load_q = M.mla_warp_heads, M.mla_split_range, M.mla_row, M.mla_load_q
    load_rows, dot, score, update = M.mla_load_rows, M.mla_dot, M.mla_score, M.mla_online_update
    o_chunk, combine_thread, out_col, TT = M.mla_o_chunk, M.mla_combine_thread, M.mla_out_col, M.TT

    @cute.jit
    def dots(mQ: cute.Tensor, mKV: cute.Tensor, mLens: cute.Tensor, mBlocks: cute.Tensor, nvalid: Int32,
             mHead: cute.Tensor, mRange: cute.Tensor, mPos: cute.Tensor, mPart: cute.Tensor, scale: Float32,
             NSPLIT: cutlass.Constexpr, DL: cutlass.Constexpr, DR: cutlass.Constexpr, HPW: cutlass.Constexpr,
             WARPS: cutlass.Constexpr):
        DLL, DRL = DL // 32, DR // 32
        LV = min(8, DLL)
        STEPS = cute.size(mPos, mode=[1])
        rq = cute.make_rmem_tensor((HPW, DLL + DRL), Float32)
        rkv = cute.make_rmem_tensor((LV, DLL // LV, TT), BFloat16)
        rkr = cute.make_rmem_tensor((DRL, TT), BFloat16)
        for i in cutlass.range(nvalid):
            hg, split, b = mBlocks[i, 0], mBlocks[i, 1], mBlocks[i, 2]
            t0, t1 = split_range(mLens[b], split, NSPLIT)
            mRange[i, 0] = t0
            mRange[i, 1] = t1
            mRange[i, 2] = 0
            for warp in cutlass.range(WARPS):
                h0 = warp_heads(hg, warp, HPW, WARPS)
                mHead[i, warp] = h0
                for lane in cutlass.range(LANES):
                    load_q(mQ, b, h0, lane, rq, scale * C.LOG2E, DL, DR, HPW)
                    for tb in cutlass.range(t0, t1, TT):
                        k = (tb - t0) // TT
                        if (warp == 0) & (lane == 0):
                            mRange[i, 2] = k + 1
                        if k < STEPS:
                            kv, kr = load_rows(mKV, b, tb, t1, lane, rkv, rkr, DL, DR)
                            for hh in cutlass.range_constexpr(HPW):
                                for u in cutlass.range_constexpr(TT):
                                    mPart[i, warp, hh, k, u, lane] = dot(rq, kv, kr, hh, u, DLL, DRL)
                            if (warp == 0) & (lane == 0):
                                for u in cutlass.range_constexpr(TT):
                                    mPos[i, k, u] = row(tb, u, t1)

    @cute.jit
    def softmax(mKV: cute.Tensor, mLens: cute.Tensor, mBlocks: cute.Tensor, nvalid: Int32, mLanes: cute.Tensor,
                mRed: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, mML: cute.Tensor, mChunk: cute.Tensor,
                NSPLIT: cutlass.Constexpr, DL: cutlass.Constexpr, DR: cutlass.Constexpr, HPW: cutlass.Constexpr,
                WARPS: cutlass.Constexpr):
        DLL, DRL = DL // 32, DR // 32
        LV = min(8, DLL)
        rkv = cute.make_rmem_tensor((LV, DLL // LV, TT), BFloat16)
        rkr = cute.make_rmem_tensor((DRL, TT), BFloat16)
        o = cute.make_rmem_tensor((4, DLL // 4, HPW), Float32)
        m = cute.make_rmem_tensor((HPW,), Float32)
        lsum = cute.make_rmem_tensor((HPW,), Float32)
        s = cute.make_rmem_tensor((TT,), Float32)
        for j in cutlass.range(cute.size(mLanes, mode=[0])):
            for c in cutlass.range_constexpr(DLL // 4):
                mChunk[j, c] = o_chunk(mLanes[j], c, DLL)
        for i in cutlass.range(nvalid):
            split, b = mBlocks[i, 1], mBlocks[i, 2]
            t0, t1 = split_range(mLens[b], split, NSPLIT)
            for warp in cutlass.range(WARPS):
                for j in cutlass.range(cute.size(mLanes, mode=[0])):
                    lane = mLanes[j]
                    o.fill(0.0)
                    m.fill(-Float32.inf)
                    lsum.fill(0.0)
                    for tb in cutlass.range(t0, t1, TT):
                        k = (tb - t0) // TT
                        kv, _ = load_rows(mKV, b, tb, t1, lane, rkv, rkr, DL, DR)
                        for hh in cutlass.range_constexpr(HPW):
                            mx = m[hh]
                            for u in cutlass.range_constexpr(TT):
                                mx = score(s, mRed[i, warp, hh, k, u], mx, tb, u, t1)
                            update(m, lsum, o, s, kv, mx, hh, DLL)
                            if j == 0:
                                for u in cutlass.range_constexpr(TT):
                                    mS[i, warp, hh, k, u] = s[u]
                    for hh in cutlass.range_constexpr(HPW):
                        for c in cutlass.range_constexpr(DLL // 4):
                            for q in cutlass.range_constexpr(4):
                                mO[i, warp, hh, j, c, q] = o[q, c, hh]
                        mML[i, warp, hh, j, 0] = m[hh]
                        mML[i, warp, hh, j, 1] = lsum[hh]

    @cute.jit
    def combine(mPartO: cute.Tensor, mPartM: cute.Tensor, mPartL: cute.Tensor, mWork: cute.Tensor,
                mAcc: cute.Tensor, mInv: cute.Tensor, mCol: cute.Tensor):
        acc = cute.make_rmem_tensor((4,), Float32)
        r = cute.make_rmem_tensor((4,), Float32)
        for i in cutlass.range(cute.size(mWork, mode=[0])):
            mInv[i] = combine_thread(mPartO, mPartM, mPartL, mWork[i, 0], mWork[i, 1], mWork[i, 2], acc, r)
            for q in cutlass.range_constexpr(4):
                mAcc[i, q] = acc[q]
                mCol[i, q] = out_col(mWork[i, 2], q)

    _DRIVERS[("mla", M)] = (dots, softmax, combine)
    return _DRIVERS[("mla", M)]


def _check_shapes(nh: int, DL: int, DR: int) -> None:
    """The kernel's own limits (mla_decode.mla_decode asserts them when compiling)."""
    if DL % 128 or DR % 32 or DR <= 0:
        raise ValueError(f"mla: kv_lora_rank {DL} must be a multiple of 128 and the rope dim {DR} a positive "
                         "multiple of 32 (the kernel's lane layout)")
    if nh <= 0:
        raise ValueError(f"mla: {nh} heads")


def run_mla(t: dict[str, torch.Tensor], *, nsplit: int, module: ModuleType = _mla, blocks: str = "all",
            lanes: str = "all") -> tuple[HostRun, dict[str, torch.Tensor], dict[str, int]]:
    """Execute the MLA decode launch (split kernel, then combine) on the host for the inputs ``t`` (as
    ``mla_decode.make_inputs`` builds them: q, kv, lens, scale and the output buffers).

    ``blocks="corners"`` runs only the split-kernel CTAs whose head group, split and sequence are each among the
    first or last two of the grid (the combine then covers the (sequence, head) pairs with all their splits run);
    ``lanes="sampled"`` runs every lane in the dot pass (the warp sums need them) and ``SAMPLED_LANES`` in the
    softmax pass. Returns the run (outputs part_o / part_m / part_l / o, poisoned first; problems), the boolean
    masks of the elements that must have been written (what the comparison looks at) and counts of the split
    shapes the blocks run had (``empty``: no position; ``tail``: a last step with masked rows; ``steps``)."""
    if blocks not in ("all", "corners") or lanes not in ("all", "sampled"):
        raise ValueError(f"run_mla: blocks must be 'all' or 'corners', lanes 'all' or 'sampled' "
                         f"(got {blocks!r}, {lanes!r})")
    q, kv, lens = t["q"], t["kv"], t["lens"]
    B, nh, DQ = q.shape
    DL = t["o"].shape[-1]
    DR, S = DQ - DL, kv.shape[1]
    _check_shapes(nh, DL, DR)
    if nsplit < 1 or t["part_m"].shape != (B, nh, nsplit):
        raise ValueError(f"run_mla: nsplit {nsplit} does not match part_m {list(t['part_m'].shape)}")
    if int(lens.min()) < 1 or int(lens.max()) > S:
        raise ValueError(f"run_mla: lens must lie in [1, {S}], got {lens.tolist()}")
    TT, HPW, WARPS = module.TT, *module.head_layout(nh)
    DLL = DL // LANES
    n_hg = nh // (HPW * WARPS)
    sel = (lambda n: corner_indices(n)) if blocks == "corners" else (lambda n: list(range(n)))
    blist = [(hg, sp, b) for b in sel(B) for hg in sel(n_hg) for sp in sel(nsplit)]
    lane_list = list(SAMPLED_LANES) if lanes == "sampled" else list(range(LANES))
    # sized for the longest split the kernel's rule gives (a full cache), plus one step: a longer walk is reported
    steps = C.ceil_div(C.ceil_div(C.ceil_div(S, nsplit), TT) * TT, TT) + 1
    per_block = WARPS * HPW * steps * TT * LANES * 4
    G = max(1, min(len(blist), _GROUP_BYTES // per_block))
    # guard rows of NaN around every sequence's cache rows: a read past them ends in poison, not foreign memory
    kvg = torch.full((B, S + 2 * TT, DQ), float("nan"), dtype=kv.dtype)
    kvg[:, TT:TT + S] = kv
    mkv = kvg[:, TT:TT + S]
    lanes_t = torch.tensor(lane_list, dtype=torch.int32)
    dots, softmax, combine = _drivers(module)
    NL = len(lane_list)

    po, pm, pl = t["part_o"].fill_(float("nan")), t["part_m"].fill_(float("nan")), t["part_l"].fill_(float("nan"))
    run = HostRun({"part_o": po, "part_m": pm, "part_l": pl})
    w_o, w_m, w_l = (_Writes(n, x, run.problems) for n, x in (("part_o", po), ("part_m", pm), ("part_l", pl)))
    attended = torch.zeros(B, n_hg, S, dtype=torch.int32)
    outside: list[str] = []  # loads of cache positions outside their sequence
    chunk_idx = torch.full((NL, DLL // 4), -1, dtype=torch.int32)
    stats = {"blocks": len(blist), "empty": 0, "tail": 0, "steps": 0}
    for g0 in range(0, len(blist), G):
        grp = blist[g0:g0 + G]
        nv = len(grp)
        blk = torch.zeros(G, 3, dtype=torch.int32)
        blk[:nv] = torch.tensor(grp, dtype=torch.int32)
        head = torch.full((G, WARPS), -1, dtype=torch.int32)
        rng = torch.full((G, 3), -1, dtype=torch.int32)
        pos = torch.full((G, steps, TT), -1, dtype=torch.int32)
        part = torch.full((G, WARPS, HPW, steps, TT, LANES), float("nan"))
        with host_trace():
            dots(_t(q), _t(mkv), _t(lens), _t(blk), nv, _t(head), _t(rng), _t(pos), _t(part), t["scale"],
                 nsplit, DL, DR, HPW, WARPS)
        nsteps = rng[:nv, 2]
        width = rng[:nv, 1] - rng[:nv, 0]
        stats["empty"] += int((width <= 0).sum())
        stats["tail"] += int(((width > 0) & (width % TT != 0)).sum())
        stats["steps"] += int(nsteps.sum())
        if int(nsteps.max()) > steps:
            run.problems.append(f"a split walks {int(nsteps.max())} steps of {TT} rows, more than the "
                                f"{steps - 1} the longest split can need")
            return run, {}, stats
        red = warp_sum(part, 5)  # [G, W, HPW, steps, TT]: lane 0's butterfly total
        sm = torch.full((G, WARPS, HPW, steps, TT), float("nan"))
        out = torch.full((G, WARPS, HPW, NL, DLL // 4, 4), float("nan"))
        ml = torch.full((G, WARPS, HPW, NL, 2), float("nan"))
        with host_trace():
            softmax(_t(mkv), _t(lens), _t(blk), nv, _t(lanes_t), _t(red), _t(sm), _t(out), _t(ml), _t(chunk_idx),
                    nsplit, DL, DR, HPW, WARPS)
        run.lanes_run += nv * WARPS * LANES
        # positions: every row loaded inside its sequence; the live ones counted per (sequence, head group)
        for gi, (hg, sp, b) in enumerate(grp):
            k = int(nsteps[gi])
            p = pos[gi, :k].reshape(-1).long()
            n = int(lens[b])
            bad = (p < 0) | (p >= n)
            outside += [f"split {sp} of sequence {b} (length {n}) loads cache position {int(x)}" for x in p[bad]]
            live = sm[gi, 0, 0, :k].reshape(-1) > -math.inf
            attended[b, hg].index_put_((p[live & ~bad],), torch.ones(int((live & ~bad).sum()), dtype=torch.int32),
                                       accumulate=True)
        # stores, as the kernel's: each lane its o pieces, lane 0 the (m, l) of each head
        b_i, sp_i = blk[:nv, 2].long(), blk[:nv, 1].long()
        h = (head[:nv, :, None].long() + torch.arange(HPW))  # [nv, W, HPW]
        shp = (nv, WARPS, HPW, NL, DLL // 4, 4)
        col = (chunk_idx.long()[:, :, None] * 4 + torch.arange(4)).expand(shp)
        w_o.store((b_i[:, None, None, None, None, None].expand(shp), h[:, :, :, None, None, None].expand(shp),
                   sp_i[:, None, None, None, None, None].expand(shp), col), out[:nv], "split kernel")
        if 0 in lane_list:
            j0 = lane_list.index(0)
            idx = (b_i[:, None, None].expand_as(h), h, sp_i[:, None, None].expand_as(h))
            w_m.store(idx, ml[:nv, :, :, j0, 0], "split kernel")
            w_l.store(idx, ml[:nv, :, :, j0, 1], "split kernel")
    if outside:
        run.problems.append(f"{len(outside)} load(s) of a cache position outside its sequence, first: {outside[0]}")

    # what must have been written: every head of the blocks run; the o dims of the lanes run (lane l owns
    # [l·DL/32, (l+1)·DL/32)); every position of each sequence attended once per head group when all its splits ran
    exp_ml = torch.zeros(B, nh, nsplit, dtype=torch.bool)
    for hg, sp, b in blist:
        exp_ml[b, hg * HPW * WARPS:(hg + 1) * HPW * WARPS, sp] = True
    dims = torch.zeros(DL, dtype=torch.bool)
    for ln in lane_list:
        dims[ln * DLL:(ln + 1) * DLL] = True
    exp_o = exp_ml[..., None] & dims
    w_o.check(exp_o)
    w_m.check(exp_ml)
    w_l.check(exp_ml)
    bset = set(blist)
    full_seq = {(b, hg) for hg, _, b in blist if all((hg, s, b) in bset for s in range(nsplit))}
    never, twice = [], []
    for b, hg in sorted({(b, hg) for hg, _, b in blist}):
        n = int(lens[b])
        a = attended[b, hg, :n]
        where = f"sequence {b} (length {n}), head group {hg}"
        if (a > 1).any():
            twice.append(f"{where}: {int((a > 1).sum())} position(s), first {int((a > 1).nonzero()[0, 0])}")
        if (b, hg) in full_seq and (a == 0).any():
            never.append(f"{where}: {int((a == 0).sum())} position(s), first {int((a == 0).nonzero()[0, 0])}")
    if twice:
        run.problems.append(f"cache positions attended more than once in {len(twice)} place(s): {twice[0]}")
    if never:
        run.problems.append(f"cache positions never attended (over all splits) in {len(never)} place(s): {never[0]}")

    # the combine: every (sequence, head) whose splits all ran, the threads whose o pieces were all written
    o = t["o"].fill_(float("nan"))
    run.outputs["o"] = o
    pairs = [(b, hh) for b, hg in sorted(full_seq) for hh in range(hg * HPW * WARPS, (hg + 1) * HPW * WARPS)]
    threads = [c for c in range(DL // 4) if bool(dims[4 * c:4 * c + 4].all())]
    exp_out = torch.zeros(B, nh, DL, dtype=torch.bool)
    if pairs and threads:
        work = torch.tensor([(b, hh, c) for b, hh in pairs for c in threads], dtype=torch.int32)
        acc = torch.full((len(work), 4), float("nan"))
        inv = torch.full((len(work),), float("nan"))
        ocol = torch.full((len(work), 4), -1, dtype=torch.int32)
        with host_trace():
            combine(_t(po), _t(pm), _t(pl), _t(work), _t(acc), _t(inv), _t(ocol))
        w_out = _Writes("o", o, run.problems)
        wl = work.long()
        col = ocol.long()
        w_out.store((wl[:, 0, None].expand_as(col), wl[:, 1, None].expand_as(col), col),
                    (acc * inv[:, None]).to(torch.bfloat16), "combine kernel")
        for b, hh in pairs:
            exp_out[b, hh] = dims
        w_out.check(exp_out)
    return run, {"part_o": exp_o, "part_m": exp_ml, "part_l": exp_ml, "o": exp_out}, stats


def _compare(run: HostRun, want: dict[str, torch.Tensor], t: dict[str, torch.Tensor], nsplit: int,
             module: ModuleType) -> dict[str, float]:
    """Relative errors of the written elements against the module's references (-inf partial maxima of empty
    splits must match exactly)."""
    from kimik3.validation.metric import rel_error

    errors: dict[str, float] = {}
    if not want:
        return {"part_m": float("inf")}
    # the references of the sequences the run covered (they are independent per sequence)
    bs = [b for b in range(t["q"].shape[0]) if bool(want["part_m"][b].any())]
    sub = {k: t[k][bs] for k in ("q", "kv", "lens", "o")} | {"scale": t["scale"]}
    ref = module.split_reference(sub, nsplit)
    ref["o"] = module.reference("mla", sub)["o"]
    for name, mask in want.items():
        if not mask.any():
            continue
        got, exp = run.outputs[name][bs].float()[mask[bs]], ref[name][mask[bs]]
        if name == "part_m":
            empty = exp == -math.inf
            if not torch.equal(got[empty], exp[empty]):
                errors[name + "(empty)"] = float("inf")
            got, exp = got[~empty], exp[~empty]
        if name in ("part_o", "part_l"):  # an empty split's partials are exact zeros
            errors[name] = rel_error(got, exp) if exp.abs().sum() > 0 else float(got.abs().sum() != 0) * math.inf
        else:
            errors[name] = rel_error(got, exp)
    return errors


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One host execution: ``preset`` and ``batch`` (the registry's shapes of the ``mla`` family), optional
    ``shapes`` overrides (B, nh, DL, DR, S, nsplit), ``lens`` (the sequence lengths; else make_inputs' ragged
    ones), ``blocks`` / ``lanes`` (see run_mla), ``seed`` and ``mutant`` ([module, [[old, new], ...]]). Returns
    the problems, the relative errors of the partials (fp32 tolerance) and of o (bf16 tolerance), ``ok``."""
    import time

    from kimik3.kernels.toolchain import registry

    from kimik3.model.config import get_preset
    from kimik3.validation.metric import TOL

    t0 = time.perf_counter()
    shapes = registry.FAMILIES["mla"].shapes(get_preset(case["preset"]), int(case["batch"]))
    shapes.update(case.get("shapes", {}))
    _check_shapes(shapes["nh"], shapes["DL"], shapes["DR"])
    nsplit = shapes.pop("nsplit", None) or _mla.default_splits(shapes["B"], shapes["nh"], shapes["S"])
    mod = mutated_modules(case.get("mutant"), {"fused.mla_decode": _mla}, "host_exec_mla")["fused.mla_decode"]
    scale = registry.FAMILIES["mla"].runtime(get_preset(case["preset"]))["scale"]
    t = _mla_ref.make_inputs(**shapes, nsplit=nsplit, scale=scale, seed=int(case.get("seed", 0)))
    if case.get("lens") is not None:
        lens = torch.tensor(case["lens"], dtype=torch.int32)
        if lens.shape != (shapes["B"],):
            raise ValueError(f"run_case: {len(case['lens'])} lengths for batch {shapes['B']}")
        t["lens"] = lens
    run, want, stats = run_mla(t, nsplit=nsplit, module=mod, blocks=case.get("blocks", "all"),
                        lanes=case.get("lanes", "all"))
    errors = _compare(run, want, t, nsplit, _mla_ref)
    tols = {k: TOL["kernel_bf16"] if k == "o" else TOL["kernel_state_fp32"] for k in errors}
    ok = not run.problems and all(e <= tols[k] for k, e in errors.items()) and bool(want) and bool(want["o"].any())
    return {"case": case, "problems": run.problems, "errors": errors, "tol": tols, "ok": ok,
            "lanes": run.lanes_run, "nsplit": nsplit, "splits": stats, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec_mla CASES.json``: run each case, one JSON line per case on stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec_mla", argv)


if __name__ == "__main__":
    raise SystemExit(main())
