"""Host execution of the megakernel's cross-rank device code (``kernels/megakernel/collective.py``) on one rank's
program of a deployment (``build_program(..., shard=Shard(W, W, rank))``), instruction by instruction against the
CPU interpreter's bodies on the same buffers (``host_exec_mk``): ALLREDUCE_MIX (every thread's chunks of the
rank-order sum into the block's partial sum, then the AttnRes mix through ``host_exec_mk.exec_mix``), ARGMAX_ALL
(``misc.argmax_pick`` over every rank's tiles), MOE_COMBINE (every thread's chunks of the rank-order latent sum,
then the norm pass), the VM's CTA-to-rank map of a launch of several ranks, and every PUSH operand's copy
(``push_geometry`` / ``push_span`` over every work item: each byte of the box exactly once, none outside it,
16-byte units only where aligned). The other opcodes run the interpreter's body (they produce what these read).
Cases: micro / tiny, W = 2 and 4 (``tests/test_host_exec_mk_ranks.py``). Design:
docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from kimik3.kernels.verify.host_exec import HostRun, case_result, cases_main, load_mutant
from kimik3.kernels.verify.host_exec_mk import (
    _box_mask,
    _ctx,
    _Instr,
    _interpret,
    _launch,
    _MkSetup,
    _prepare,
    _store,
    compare_outputs,
    exec_misc,
    exec_mix,
)

__all__ = ["exec_allreduce_mix", "exec_moe_combine", "check_pushes", "check_local_ranks", "run_case", "main"]

_DRIVERS: dict[tuple[str, Any], Any] = {}
MODULES = ("megakernel.collective", "megakernel.misc", "megakernel.vm")


def _host(C: ModuleType, which: str) -> Any:
    """ALLREDUCE_MIX: every thread's chunks of every batch row, their entry offsets and bf16 sums. PUSH: operand j's
    copy geometry, then the byte offset of every work item."""
    key = (which, C)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NT, VEC, B0, B1 = C.NT, C.VEC, C.B0, C.B1
    if which == "allreduce":
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mOff: cute.Tensor,
                  mVal: cute.Tensor, cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            nch = mD2[2] // VEC
            ro = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            for b in cutlass.range(C._bx(ctx, 2, B0), C._bx(ctx, 2, B1)):
                for tidx in cutlass.range(NT):
                    for c in cutlass.range(tidx, nch, NT):
                        mOff[b, c] = C.allreduce_chunk(ctx, b, c, ro)
                        for v in cutlass.range_constexpr(VEC):
                            mVal[b, c, v] = ro[v]
    elif which == "combine":
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mOff: cute.Tensor,
                  mVal: cute.Tensor, mSq: cute.Tensor, cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            jo = Int32(1) + (Int32(1) if ctx.s_ins[C.W_ARGS] != 0 else Int32(0))
            nch = (C._bx(ctx, 0, C.C1) - C._bx(ctx, 0, C.C0)) // VEC
            ro = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            for b in cutlass.range(C._bx(ctx, jo, B0), C._bx(ctx, jo, B1)):
                for tidx in cutlass.range(NT):
                    part = cutlass.Float32(0.0)
                    for c in cutlass.range(tidx, nch, NT):
                        part = part + C.combine_chunk(ctx, b, c, ro)
                        mOff[b, c] = C.combine_out(ctx, b, c, jo)
                        for v in cutlass.range_constexpr(VEC):
                            mVal[b, c, v] = ro[v]
                    mSq[b, tidx] = part
    elif which == "combine_norm":
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mTot: cute.Tensor,
                  mVal: cute.Tensor, b0: Int32, b1: Int32, cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            n = C._bx(ctx, 0, C.C1) - C._bx(ctx, 0, C.C0)
            ro = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            for b in cutlass.range(b0, b1):
                rstd = C.combine_rstd(ctx, mTot[b], n)
                for c in cutlass.range(n // VEC):
                    for v in cutlass.range_constexpr(VEC):
                        ro[v] = mVal[b, c, v]
                    C.combine_norm_chunk(ctx, c, rstd, ro)
                    for v in cutlass.range_constexpr(VEC):
                        mVal[b, c, v] = ro[v]
    else:
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mGeo: cute.Tensor,
                  mSpan: cute.Tensor, j: Int32, esz: Int32, cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            unit, per, rows = C.push_geometry(ctx, j, esz)
            mGeo[0], mGeo[1], mGeo[2] = unit, per, rows
            for k in cutlass.range(rows * per):
                mSpan[k] = C.push_span(ctx, j, esz, unit, per, k)
    _DRIVERS[key] = drive
    return drive


def exec_allreduce_mix(x: _Instr, C: ModuleType, M: ModuleType) -> dict[int, torch.Tensor]:
    """Host-execute ALLREDUCE_MIX instruction ``x`` with the helpers of ``C`` (``megakernel.collective``) and ``M``
    (``megakernel.misc``): the entry's chunks stored (write-once, inside the box), then — the entry as the device
    leaves it, the stream restored after — the mix."""
    S, ins, words, shapes, boxes, cfg, B = x.S, x.ins, x.words, x.shapes, x.boxes, x.cfg, x.B
    VEC, H = C.VEC, shapes[2][2]
    off = torch.full((B, H // VEC), -1, dtype=torch.int64)
    val = torch.full((B, H // VEC, VEC), float("nan"), dtype=torch.bfloat16)
    _launch(_host(C, "allreduce"), [*words, off, val], (cfg,))
    ent, we = x.out(2)
    b0, b1 = boxes[2][0], boxes[2][1]
    el = (off[b0:b1, :, None] + torch.arange(VEC)).reshape(-1)
    _store(we, shapes[2], boxes[2], el, val[b0:b1].reshape(-1), "allreduce")
    expect = {2: _box_mask(shapes[2], boxes[2])}
    we.check(expect[2])
    stream = S.buf(ins.operands[2].buf)
    saved = stream.clone()
    try:
        stream.view(-1)[el] = val[b0:b1].reshape(-1)  # what the mix reads on the GPU: the sum just stored
        expect.update(exec_mix(x, M, C.ALLREDUCE_MIX_OPS))
    finally:
        stream.copy_(saved)  # the reference runs on the instruction's inputs
    return expect


def exec_moe_combine(x: _Instr, C: ModuleType) -> dict[int, torch.Tensor]:
    """Host-execute MOE_COMBINE instruction ``x`` with the helpers of ``C`` (``megakernel.collective``): every
    thread's chunks of the rank-order sum (their offsets, bf16 values and squares), the squares summed per row (the
    CTA reduction's stand-in), then — with the latent norm — every chunk normalised; the final values stored
    (write-once, inside the box)."""
    ins, words, shapes, boxes, cfg, B = x.ins, x.words, x.shapes, x.boxes, x.cfg, x.B
    VEC, jo = C.VEC, 2 if ins.args[0] else 1
    n = boxes[0][5] - boxes[0][4]
    off = torch.full((B, n // VEC), -1, dtype=torch.int64)
    val = torch.full((B, n // VEC, VEC), float("nan"), dtype=torch.bfloat16)
    sq = torch.zeros((B, C.NT), dtype=torch.float32)
    _launch(_host(C, "combine"), [*words, off, val, sq], (cfg,))
    b0, b1 = boxes[jo][0], boxes[jo][1]
    if ins.args[0]:
        _launch(_host(C, "combine_norm"), [*words, sq.sum(1), val, b0, b1], (cfg,))
    _, we = x.out(jo)
    el = (off[b0:b1, :, None] + torch.arange(VEC)).reshape(-1)
    _store(we, shapes[jo], boxes[jo], el, val[b0:b1].reshape(-1), "combine")
    expect = {jo: _box_mask(shapes[jo], boxes[jo])}
    we.check(expect[jo])
    return expect


def _local_driver(V: ModuleType) -> Any:
    key = ("local", V)
    if key not in _DRIVERS:
        @cute.jit
        def drive(mCtl: cute.Tensor, mOut: cute.Tensor, grid: Int32):
            for b in cutlass.range(grid):
                n, lr, lb = V._local_rank(mCtl, b, grid)
                mOut[b, 0], mOut[b, 1], mOut[b, 2] = n, lr, lb
        _DRIVERS[key] = drive
    return _DRIVERS[key]


def check_local_ranks(V: ModuleType, run: HostRun, grids: tuple[int, ...] = (132, 66, 8)) -> int:
    """The VM's CTA-to-rank map of a launch running several ranks (``megakernel.vm._local_rank``, ``isa.CTL_LOCAL``)
    over every CTA of each grid and every local-rank count around the table's: L ranks of ``grid / L`` CTAs each
    where L is 2..MAX_LOCAL and divides the grid, else the launch's own tensors as one rank. Returns the CTAs
    checked."""
    from kimik3.kernels.contracts.isa import CTL_LOCAL, CTL_WORDS, MAX_LOCAL

    n = 0
    for grid in grids:
        for nloc in (0, 1, 2, 3, 4, 5, MAX_LOCAL, MAX_LOCAL + 1):
            ctl = torch.zeros(CTL_WORDS, dtype=torch.int32)
            ctl[CTL_LOCAL] = nloc
            out = torch.full((grid, 3), -1, dtype=torch.int32)
            _launch(_local_driver(V), [ctl, out, grid])
            split = 2 <= nloc <= MAX_LOCAL and grid % nloc == 0
            per = grid // nloc if split else grid
            want = torch.tensor([[nloc if split else 1, b // per, b % per] for b in range(grid)], dtype=torch.int32)
            if not torch.equal(out, want):
                b = int((out != want).any(1).nonzero()[0, 0])
                run.problems.append(f"local ranks: grid {grid}, L = {nloc}: CTA {b} runs {out[b].tolist()} (local "
                                    f"ranks, rank, CTA), want {want[b].tolist()}")
            n += grid
    return n


def check_pushes(S: _MkSetup, v: int, C: ModuleType, run: HostRun) -> int:
    """Every PUSH operand of instruction ``v``: the bytes its work items copy are its box's, each exactly once, in
    units its rows' alignment allows. Returns the PUSH operands checked."""
    from kimik3.kernels.contracts.isa import CODE_BYTES, DTYPE_CODES, Mode

    ins = S.p.instructions[v]
    words = list(S.words(v))
    n = 0
    for j, o in enumerate(ins.operands):
        if not o.mode & Mode.PUSH:
            continue
        spec = S.p.buffers[o.buf]
        esz = CODE_BYTES[DTYPE_CODES[str(spec.dtype).removeprefix("torch.")]]
        b0, b1, r0, r1, c0, c1 = o.box
        d1, d2 = spec.shape[1], spec.shape[2]
        nbytes = (b1 - b0) * (r1 - r0) * (c1 - c0) * esz
        geo = torch.full((3,), -1, dtype=torch.int32)
        span = torch.full((nbytes,), -1, dtype=torch.int64)
        _launch(_host(C, "push"), [*words, geo, span, j, esz], (S.mk,))
        unit, per, rows = (int(g) for g in geo)
        tag = f"#{v} {ins.op.name} L{ins.layer} {spec.name}"
        if unit <= 0 or rows * per * unit != nbytes:
            run.problems.append(f"{tag}: push geometry (unit {unit}, {per} per row, {rows} rows) does not cover the "
                                f"box's {nbytes} bytes")
            continue
        got = (span[:rows * per, None] + torch.arange(unit)).reshape(-1)
        rows_b = torch.tensor([((b * d1 + r) * d2 + c0) * esz for b in range(b0, b1) for r in range(r0, r1)])
        want = (rows_b[:, None] + torch.arange((c1 - c0) * esz)).reshape(-1)
        if not torch.equal(torch.sort(got).values, torch.sort(want).values):
            twice = int(got.numel() - torch.unique(got).numel())
            outside = int((~torch.isin(got, want)).sum())
            run.problems.append(f"{tag}: the push copies {twice} byte(s) twice and {outside} outside the box")
        if bool((span[:rows * per] % unit != 0).any()):
            run.problems.append(f"{tag}: a {unit}-byte push unit starts off its alignment")
        run.lanes_run += rows * per
        n += 1
    return n


def _ranks_case(case: dict[str, Any], mods: dict[str, ModuleType]) -> tuple[HostRun, dict[str, float], str]:
    S = _MkSetup(case["preset"], int(case["batch"]), seed=int(case.get("seed", 0)), world=int(case["world"]),
                 rank=int(case["rank"]))
    S.ties = bool(case.get("ties", False))
    C, M = mods["megakernel.collective"], mods["megakernel.misc"]
    run = HostRun({})
    errors: dict[str, float] = {}
    seen = {"ALLREDUCE_MIX": 0, "ARGMAX_ALL": 0, "MOE_COMBINE": 0, "PUSH": 0}
    # the collectives on the buffers as the instructions before leave them: random inputs (the mailbox rows of
    # this rank's peers are never written here), then what each collective's reference stored
    for v, ins in enumerate(S.p.instructions):
        seen["PUSH"] += check_pushes(S, v, C, run)
        if ins.op.name in ("ALLREDUCE_MIX", "ARGMAX_ALL", "MOE_COMBINE"):
            _prepare(S, v)
            x = _Instr(S, v, run)
            expect = exec_allreduce_mix(x, C, M) if ins.op.name == "ALLREDUCE_MIX" else \
                exec_moe_combine(x, C) if ins.op.name == "MOE_COMBINE" else exec_misc(x, M)
            _interpret(S, v)
            compare_outputs(S, x, expect, run, errors)
            seen[ins.op.name] += 1
    missing = [k for k, n in seen.items() if not n]
    if missing:
        run.problems.append(f"no {missing} in the program")
    if case.get("local_ranks"):
        run.lanes_run += check_local_ranks(mods["megakernel.vm"], run)
    bad = [f"{k}: {e:.3g}" for k, e in errors.items() if e > 1e-2]
    if bad:
        run.problems.append(f"errors above the tolerance: {bad}")
    return run, errors, "kernel_bf16"


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One rank program's host execution: ``preset``, ``batch``, ``world``, ``rank``; optional ``seed``, ``ties``
    (the arg-max bests on a coarse grid), ``local_ranks`` (the VM's CTA-to-rank map too), ``mutant`` ([module of
    :data:`MODULES`, [[old, new], ...]]). Returns problems, errors, the tolerance and ``ok``."""
    from kimik3.kernels.megakernel import collective, misc, vm

    t0 = time.perf_counter()
    mods = {"megakernel.collective": collective, "megakernel.misc": misc, "megakernel.vm": vm}
    if case.get("mutant"):
        name, reps = case["mutant"]
        if name not in MODULES:
            raise ValueError(f"run_case: mutants of {', '.join(MODULES)} only, got {name!r}")
        mods[name] = load_mutant(name, [tuple(r) for r in reps])
        if name == "megakernel.misc":  # the collective module's mix is the mutated one too
            mods["megakernel.collective"] = load_mutant("megakernel.collective", [(
                "from kimik3.kernels.megakernel.misc import", f"from {mods[name].__name__} import")])
    run, errors, tol = _ranks_case(case, mods)
    return case_result(case, run, errors, tol, t0)


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec_mk_ranks CASES.json``: one JSON line per case on stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec_mk_ranks", argv)


if __name__ == "__main__":
    raise SystemExit(main())
