"""Host execution of the megakernel's tensor-core GEMV path (``kernels/megakernel/gemv.py`` from batch 8): NORM_PROJ,
MLP_GATE_UP, O_PROJ_RESIDUAL, FFN_OUT and LM_HEAD, one instruction at a time, on CPU tensors.

The driver runs the lane-level helper ``device_fns.weight_tile_mma`` over every (tile, pass group) work item and lane of
an instruction in a compiled host function; in place of the ``mma.sync`` (which aborts on the host) its ``sink`` writes
the registers out and ``mk_mma.mma_reference`` evaluates them. Python then replays the opcodes' epilogues per
accumulator register into NaN-poisoned outputs, every store counted, and compares with the CPU interpreter's opcode
reference. Entry points: ``run_gemv_op``, ``tile_registers`` / ``mma_tiles``, ``stage_for``, ``run_case``, ``main``.
Run it in a subprocess when a helper may be mutated (``tests/test_host_exec_mk_gemv.py``).
Design: docs/architecture.md#appendix-design-notes-by-room (``kernels/verify/host_exec_mk_gemv.py``).
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from kimik3.kernels.common.trace import host_trace
from kimik3.kernels.megakernel import mma as M
from kimik3.kernels.verify.host_exec import HostRun, _t, _Writes, cases_main, mutated_modules

__all__ = ["tile_registers", "mma_tiles", "run_gemv_op", "run_case", "main"]

LANES = 32
VEC = 8
ARCH = "sm_90a"  # the compile target whose k blocks per step (mk_addr.gemv_mma_unroll) the host runs use
REGS = 3 * M.CHUNK_REGS  # per k block and lane: weight row g, weight row g + 8, x row g

_DRIVERS: dict[tuple[str, Any], Any] = {}


def _modules(mutant: list | None) -> tuple[ModuleType, ModuleType]:
    """(device_fns, mk_addr), or a mutated copy of one of them."""
    from kimik3.kernels.contracts import addr as mk_addr
    from kimik3.kernels.megakernel import device_fns

    m = mutated_modules(mutant, {"megakernel.device_fns": device_fns, "contracts.addr": mk_addr}, "host_exec_mk_gemv")
    return m["megakernel.device_fns"], m["contracts.addr"]


def _tile_driver(F: ModuleType) -> Any:
    """Every listed (tile, pass) item and lane through ``F.weight_tile_mma`` with a register sink."""
    key = ("tile", F)
    if key not in _DRIVERS:
        weight_tile_mma, gchunks = F.weight_tile_mma, F.gchunks

        @cute.jit
        def drive(stage: cute.Tensor, staged: Int32, w_addr: Int64, xv: cute.Tensor, xs: Int32, g_addr: Int64,
                  mRstd: cute.Tensor, mItems: cute.Tensor, n: Int32, nch: Int32, rows: Int32, mSink: cute.Tensor,
                  U: cutlass.Constexpr, P: cutlass.Constexpr, GAMMA: cutlass.Constexpr):
            gv = None
            rstd = None
            if cutlass.const_expr(GAMMA):
                gv = gchunks(g_addr)
                rstd = mRstd
            acc = cute.make_rmem_tensor((4, P), Float32)
            for i in cutlass.range(cute.size(mItems, mode=[0])):
                j0, row0 = mItems[i, 0], mItems[i, 1]
                for lane in cutlass.range(LANES):
                    weight_tile_mma(stage, staged, w_addr, j0, n, nch, xv, row0, rows, xs, gv, rstd, acc, U, lane,
                                    mSink[(i, lane, None, None)])

        _DRIVERS[key] = drive
    return _DRIVERS[key]


def stage_for(W: torch.Tensor, staged: int) -> torch.Tensor:
    """The weight stage as the VM leaves it: the box's first ``staged`` rows (row j at chunk j·nch), the rest NaN."""
    n, K = W.shape
    stage = torch.full((max(1, n) * K // VEC, VEC), float("nan"), dtype=torch.bfloat16)
    stage[:staged * K // VEC] = W[:staged].reshape(-1, VEC)
    return stage


def tile_registers(F: ModuleType, W: torch.Tensor, staged: int, x: torch.Tensor, items: list[tuple[int, int]],
                   gamma: torch.Tensor | None, rstd: torch.Tensor | None, U: int, P: int = 1) -> torch.Tensor:
    """The registers lane-level device code hands to ``mma_chunk``: [items, P passes, 32 lanes, k blocks, 12] int64
    bits (k blocks the device steps through: whole steps of U), for the weight box ``W`` [n, K] (its first
    ``staged`` rows staged), x ``[B, K]`` bf16 and the work items (first tile row, first batch row of the item's
    group of ``P`` passes); ``gamma`` [K] and ``rstd`` [B] for a normalised x."""
    n, K = W.shape
    nch = K // VEC
    nkb = -(-nch // (4 * U)) * U  # k blocks the steps run (the clamped tail step runs U, some past the row)
    stage = stage_for(W, staged)
    Wc = W.contiguous()
    xv = x.contiguous().reshape(-1, VEC)
    g = gamma.contiguous() if gamma is not None else torch.zeros(K, dtype=torch.bfloat16)
    mi = torch.tensor(items, dtype=torch.int32).reshape(-1, 2)
    B = x.shape[0]
    r = rstd.float().contiguous() if rstd is not None else torch.zeros(B)
    sink = torch.zeros(len(items), LANES, nkb * P, REGS, dtype=torch.int32)
    with host_trace():
        _tile_driver(F)(_t(stage), staged, Wc.data_ptr(), _t(xv), nch, g.data_ptr(), _t(r), _t(mi), n, nch, B,
                        _t(sink), U, P, gamma is not None)
    regs = (sink.to(torch.int64) & 0xFFFFFFFF).reshape(len(items), LANES, nkb, P, REGS)
    return regs.permute(0, 3, 1, 2, 4)


def mma_tiles(regs: torch.Tensor) -> torch.Tensor:
    """``mma_chunk`` over every k block in order, from the registers of :func:`tile_registers`: [..., 32, 4] fp32
    accumulators (C fragments), chained in fp32 as on the device."""
    C4 = M.CHUNK_REGS
    wg, wg8, xg = regs[..., :C4], regs[..., C4:2 * C4], regs[..., 2 * C4:]
    acc = torch.zeros(*regs.shape[:-3], LANES, 4)
    for kb in range(regs.shape[-2]):
        for h in range(2):  # mma_chunk: registers 0, 1 then 2, 3 of each chunk
            a = torch.stack([wg[..., kb, 2 * h], wg8[..., kb, 2 * h], wg[..., kb, 2 * h + 1],
                             wg8[..., kb, 2 * h + 1]], -1)
            b = torch.stack([xg[..., kb, 2 * h], xg[..., kb, 2 * h + 1]], -1)
            acc = M.mma_reference(a, b, acc)
    return acc


# ---------------------------------------------------------------------------------------------- opcodes
OPS = ("norm_proj", "mlp_gate_up", "o_proj_residual", "ffn_out", "lm_head")


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``device_fns.rstd_rows`` in exact fp32 (the device's rsqrt is ``rsqrt.approx``)."""
    x32 = x.float()
    return torch.rsqrt(x32.pow(2).mean(-1) + eps)


class _Tiles:
    """The work items of one instruction as the device deals them: (tile, pass group) pairs in item order, the warp
    of each, the passes per group, and per item, pass and lane the (row, batch row) of every accumulator register
    (an item accumulating ``sources`` weights at once: its groups are ``mk_addr.gemv_groups(B, sources)``)."""

    def __init__(self, A: ModuleType, n: int, B: int, nw: int, sources: int = 1) -> None:
        if not A.gemv_mma(B):
            raise ValueError(f"host_exec_mk_gemv: batch {B} runs on CUDA cores, not the mma path (batch >= "
                             f"{A.GEMV_MMA_FROM})")
        self.tr = A.gemv_tile_rows(B)
        self.P = A.gemv_group_passes(B, sources)
        nt, ng = A.gemv_tiles(n, self.tr), A.gemv_groups(B, sources)
        pairs = [A.gemv_item(k, nt, ng) for k in range(nt * ng)]
        self.items = [(int(jt) * self.tr, int(A.gemv_group_row(t, 0, 0, self.P))) for jt, t in pairs]
        self.warp = [k % nw for k in range(len(pairs))]  # warp w takes items w, w + nw, ... (nw: device_fns.NW)
        lane = torch.arange(LANES)[:, None]
        i = torch.arange(4)[None, :]
        r, c = M.acc_row(lane, i), M.acc_col(lane, i)  # [32, 4]
        j0 = torch.tensor([a for a, _ in self.items])[:, None, None, None]
        groups = torch.tensor([int(t) for _, t in pairs])[:, None, None, None]
        p = torch.arange(self.P)[None, :, None, None]
        self.row = (j0 + r).expand(-1, self.P, -1, -1)  # [items, P, 32, 4]
        self.col = A.gemv_group_row(groups, p, c, self.P)
        self.valid = (self.row < n) & (self.col < B)


def _gemv(F: ModuleType, T: _Tiles, W: torch.Tensor, staged: int, x: torch.Tensor, gamma: torch.Tensor | None,
          rstd: torch.Tensor | None, U: int) -> torch.Tensor:
    return mma_tiles(tile_registers(F, W, staged, x, T.items, gamma, rstd, U, T.P))


def run_gemv_op(op: str, *, preset: str = "tiny", B: int = 8, K: int = 256, n: int = 37, K2: int | None = None,
                staged: int = 0, seed: int = 0, U: int | None = None, fp32: bool = False, accumulate: bool = True,
                flags: int = 7, r0: int = 0, ties: bool = False, mutant: list | None = None
                ) -> tuple[HostRun, dict[str, torch.Tensor]]:
    """One instruction of GEMV opcode ``op`` (:data:`OPS`) over a weight box of ``n`` rows x ``K`` (FFN_OUT's mlp
    source: ``K2``), its first ``staged`` rows in the stage, batch ``B``, on fresh random inputs (``ties``, LM_HEAD:
    a dominant row repeated in the same lane, across groups of a tile and in another tile, so the arg-max is a tie
    the lowest id must win). ``U``: k blocks per step for every source; None: what the device runs for each
    (``mk_addr.gemv_mma_unroll`` for :data:`ARCH` and the item's passes, one block fewer for an x normalised as
    loaded). Returns the run
    (outputs poisoned with NaN, every store counted) and the interpreter's reference outputs."""
    from kimik3.kernels.contracts.isa import FFN_LATENT_NORM, FFN_MLP, FFN_ROUTED

    from kimik3.megakernel import interpreter as I
    from kimik3.model.config import get_preset
    from kimik3.model.modeling import glu

    if op not in OPS:
        raise ValueError(f"host_exec_mk_gemv: unknown op {op!r}, expected one of {OPS}")
    if K % VEC or (K2 or VEC) % VEC or n < 1 or not 0 <= staged <= n:
        raise ValueError(f"host_exec_mk_gemv: K {K} / K2 {K2} must be multiples of 8, 0 <= staged {staged} <= n {n}")
    F, A = _modules(mutant)
    cfg = get_preset(preset)
    eps = cfg.rms_norm_eps
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    T = _Tiles(A, n, B, F.NW, 2 if op in ("mlp_gate_up", "ffn_out") else 1)

    def u(normed: bool) -> int:
        return U if U is not None else A.gemv_mma_unroll(ARCH, normed, T.P)

    it = SimpleNamespace(cfg=cfg, dtype=torch.bfloat16)
    run = HostRun({})
    ref: dict[str, torch.Tensor] = {}
    R, Cb, V = T.row, T.col, T.valid

    def out(name: str, like: torch.Tensor) -> _Writes:
        t = torch.full_like(like, float("nan"))
        run.outputs[name] = t
        return _Writes(name, t, run.problems)

    x = rnd(B, K)
    gamma = (torch.rand(K, generator=g) + 0.5).bfloat16()
    W = rnd(n, K, scale=K ** -0.5)
    if op == "norm_proj":
        y = torch.zeros(B, 1, n, dtype=torch.float32 if fp32 else torch.bfloat16)
        I._norm_proj(it, SimpleNamespace(args=(int(fp32),)), [x[:, None], gamma[None, None], W[None], y])
        ref["y"] = y[:, 0]
        acc = _gemv(F, T, W, staged, x, gamma, _rstd(x, eps), u(True))
        wr = out("y", y[:, 0])
        wr.store((Cb[V], R[V]), acc[V], "NORM_PROJ")
    elif op == "mlp_gate_up":
        Wu = rnd(n, K, scale=K ** -0.5)
        h = torch.zeros(B, 1, n, dtype=torch.bfloat16)
        I._mlp_gate_up(it, SimpleNamespace(args=()), [x[:, None], gamma[None, None], W[None], Wu[None], h])
        ref["h"] = h[:, 0]
        r = _rstd(x, eps)
        ag = _gemv(F, T, W, staged, x, gamma, r, u(True))
        au = _gemv(F, T, Wu, 0, x, gamma, r, u(True))
        wr = out("h", h[:, 0])
        wr.store((Cb[V], R[V]), glu(cfg, _bf(ag[V]), _bf(au[V])), "MLP_GATE_UP")
    elif op == "o_proj_residual":
        res = rnd(B, 1, n)
        y = res.clone()
        I._o_proj_residual(it, SimpleNamespace(args=(int(accumulate),)), [x[:, None], W[None], y])
        ref["y"] = y[:, 0]
        acc = _gemv(F, T, W, staged, x, None, None, u(False))
        wr = out("y", y[:, 0])
        v = _bf(acc[V])
        if accumulate:
            v = res[:, 0].float()[Cb[V], R[V]] + v
        wr.store((Cb[V], R[V]), v, "O_PROJ_RESIDUAL")
    elif op == "ffn_out":
        K2 = K2 or K
        routed, mlp, ln = bool(flags & FFN_ROUTED), bool(flags & FFN_MLP), bool(flags & FFN_LATENT_NORM)
        if not (routed or mlp) or (ln and not routed):
            raise ValueError(f"host_exec_mk_gemv: FFN_OUT flags {flags} need a source (latent norm: routed)")
        hid = rnd(B, K2)
        Wd = rnd(n, K2, scale=K2 ** -0.5)
        res = rnd(B, 1, n)
        y = res.clone()
        v_ins: list[torch.Tensor] = []
        if routed:
            v_ins += [x[:, None]] + ([gamma[None, None]] if ln else []) + [W[None]]
        if mlp:
            v_ins += [hid[:, None], Wd[None]]
        I._ffn_out(it, SimpleNamespace(args=(flags,)), v_ins + [y])
        ref["y"] = y[:, 0]
        o = torch.zeros(V.shape)
        if routed:
            o = _bf(_gemv(F, T, W, staged, x, gamma if ln else None, _rstd(x, eps) if ln else None, u(ln)))
        if mlp:
            o = _bf(o + _bf(_gemv(F, T, Wd, 0 if routed else staged, hid, None, None, u(False))))
        wr = out("y", y[:, 0])
        wr.store((Cb[V], R[V]), res[:, 0].float()[Cb[V], R[V]] + o[V], "FFN_OUT")
    else:  # lm_head
        if ties:
            # rows g, g + 8 of one lane, another group of the tile, and warp 0's next tile
            dup = [j for j in (3, 5, 11, T.tr * F.NW + 3) if j < n]
            W[dup] = W[3] * 4
        logits = torch.zeros(B, 1, n)
        bv = torch.zeros(B, 1, 1)
        bi = torch.zeros(B, 1, 1, dtype=torch.int64)
        I._lm_head(it, SimpleNamespace(args=(0, 0, r0)), [x[:, None], gamma[None, None], W[None], logits, bv, bi])
        ref.update(logits=logits[:, 0], best_v=bv[:, 0, 0], best_i=bi[:, 0, 0])
        d = _bf(_gemv(F, T, W, staged, x, gamma, _rstd(x, eps), u(True)))
        wr = out("logits", logits[:, 0])
        wr.store((Cb[V], R[V]), d[V], "LM_HEAD")
        wr.check()
        # per (warp, batch row): each item's tile winner (the lane-local rows then the butterfly over the 8
        # groups: the maximum, ties to the lowest row) replaces the running best only when strictly greater
        best = {}
        for k, w in enumerate(T.warp):
            dk, rk, ck, vk = d[k], R[k], Cb[k], V[k]
            for b in ck[vk].unique().tolist():
                sel = vk & (ck == b)
                vals, rows = dk[sel], rk[sel]
                top = vals.max()
                j = int(rows[vals == top].min())
                cur = best.get((w, b), (-float("inf"), 2**31 - 1))
                if top > cur[0]:
                    best[(w, b)] = (float(top), j)
        got_v = torch.full((B,), float("nan"))
        got_i = torch.full((B,), -1, dtype=torch.int64)
        for b in range(B):  # the CTA's merge over the warps, in warp order (ties to the lower id)
            v, i = -float("inf"), 2**31 - 1
            for w in range(F.NW):
                ov, oi = best.get((w, b), (-float("inf"), 2**31 - 1))
                if ov > v or (ov == v and oi < i):
                    v, i = ov, oi
            got_v[b], got_i[b] = v, r0 + i
        run.outputs.update(best_v=got_v, best_i=got_i)
        return run, ref
    wr.check()
    return run, ref


# ---------------------------------------------------------------------------------------------- cases, CLI
def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One host execution: ``op`` (:data:`OPS`) and the keyword ``args`` of :func:`run_gemv_op`; optional
    ``mutant`` ([module, [[old, new], ...]]). Returns the problems, the relative error against the interpreter's
    reference, the tolerance and ``ok`` (LM_HEAD: also the arg-max ids equal)."""
    import time

    from kimik3.validation.metric import TOL, rel_error

    t0 = time.perf_counter()
    run, ref = run_gemv_op(case["op"], mutant=case.get("mutant"), **case.get("args", {}))
    errors = {k: rel_error(run.outputs[k].float(), ref[k].float()) for k in ref if k != "best_i"}
    problems = list(run.problems)
    if "best_i" in ref and not torch.equal(run.outputs["best_i"], ref["best_i"]):
        problems.append(f"best_i {run.outputs['best_i'].tolist()} != reference {ref['best_i'].tolist()}")
    bound = TOL["kernel_bf16"]
    ok = not problems and all(e <= bound for e in errors.values())
    return {"case": case, "problems": problems[:5], "errors": errors, "tol": bound, "ok": ok,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec_mk_gemv CASES.json``: one JSON line per case on stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec_mk_gemv", argv)


if __name__ == "__main__":
    raise SystemExit(main())
