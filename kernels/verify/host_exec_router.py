"""Host execution of the fused router's top-k, and the cases of the router and the megakernel's MoE / misc opcodes
(the command line): the same ``@cute.jit`` helpers the GPU code calls, run on CPU tensors over every block / warp /
lane of a real launch (see ``host_exec``).

The fused ``topk_kernel``'s per-lane helpers run as the kernel calls them; its butterfly is replayed in the shuffle
order through the kernel's own comparison (``common.device.argmax_take``). The megakernel's ROUTER, expert and misc
opcodes run instruction by instruction of a real program, each compared with the CPU interpreter's body on the same
input buffers (``host_exec_mk.py``, ``host_exec_mk_moe.py``). Approximate instructions are evaluated in exact fp32.
Run in a subprocess when a helper may be mutated: a device-only instruction reached on the host aborts the process.
Design: ``docs/architecture.md`` (appendix: design notes by room, ``kernels/verify/host_exec_router.py``)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, const_expr
from kimik3.kernels.fused import router as _router
from kimik3.kernels.reference import router as _router_ref
from kimik3.kernels.verify.host_exec import (
    KERNELS,
    LANES,
    SHARED_MODULES,
    HostRun,
    _mutant_name,
    _Writes,
    case_result,
    cases_main,
    load_case_mutant,
    load_mutant,
    warp_sum,
)
from kimik3.kernels.verify.host_exec_mk import (
    _corners,
    _Instr,
    _interpret,
    _launch,
    _MkSetup,
    _prepare,
    compare_outputs,
    exec_misc,
)
from kimik3.kernels.verify.host_exec_mk_moe import exec_expert_down, exec_expert_gate_up, exec_router

__all__ = ["run_topk", "topk_spec", "run_case", "main"]

_DRIVERS: dict[tuple[str, Any], Any] = {}


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

    t = _router_ref.make_inputs("router", **shapes, seed=int(case.get("seed", 0)))
    if case.get("gemv", True):
        g = run_gemv("f32out", {"W": t["W"], "x": t["x"], "y": t["scores"]}, module=gemv, act="sigmoid")
    else:  # the top-k alone, from the reference's scores (the scores GEMV at these widths: tests/test_host_exec.py)
        g = HostRun({"y": t["scores"].copy_(_router_ref.reference("router", t, **shapes)["scores"])})
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
        ref = _router_ref.reference("router", t, **shapes)
        if not torch.equal(ids, ref["ids"]):
            run.problems.append("ids: the top-k of the host GEMV's scores differs from the model's router")
        errors["weights"] = rel_error(run.outputs["weights"], ref["weights"])
        errors["scores"] = rel_error(g.outputs["y"], ref["scores"])
    return run, errors, "kernel_state_fp32"


# ---------------------------------------------------------------------------------------------- megakernel opcodes
MK_OPS = ("ROUTER", "EXPERT_GATE_UP", "EXPERT_DOWN", "EMBED", "ATTN_RES_MIX", "ARGMAX")


def _reference(S: _MkSetup, v: int) -> None:
    """The reference of instruction v on the shared buffers (what later instructions read): the interpreter's body;
    a ROUTER in ``ties`` mode by the top-k's specification (:func:`_router_spec`)."""
    ins = S.p.instructions[v]
    if ins.op.name == "ROUTER" and S.ties:
        _router_spec(S, ins, S.views(v))
    else:
        _interpret(S, v)


def _router_spec(S: _MkSetup, ins: Any, v: list[torch.Tensor]) -> None:
    """The interpreter's ROUTER body with the top-k's specification (``topk_spec``: equal choice scores in
    ascending expert id) in place of torch.topk, whose order among equal values is unspecified."""
    c = S.cfg
    idx, w = topk_spec(torch.sigmoid(v[0][:, 0, :]), v[1].reshape(-1), c.num_experts_per_tok,
                       c.routed_scaling_factor, c.norm_topk_prob)
    from kimik3.megakernel.interpreter import write_slots

    write_slots(idx.long(), w, v[2], v[3], v[4])


# the opcodes' host execution: MoE (host_exec_mk_moe), misc (host_exec_mk), and the module of each one's helpers
_EXEC = {"ROUTER": (exec_router, "megakernel.router"), "EXPERT_GATE_UP": (exec_expert_gate_up, "megakernel.moe"),
         "EXPERT_DOWN": (exec_expert_down, "megakernel.moe"),
         **{op: (exec_misc, "megakernel.misc") for op in ("EMBED", "ATTN_RES_MIX", "ARGMAX")}}


def _run_mk_instruction(S: _MkSetup, v: int, mods: dict[str, ModuleType], run: HostRun, errors: dict[str, float]
                        ) -> None:
    """Host-execute instruction v (its opcode's helpers from ``mods``), then the interpreter's body on the same
    inputs (the reference, which also produces what later instructions read); compare the outputs."""
    _prepare(S, v)
    x = _Instr(S, v, run)
    if x.op not in _EXEC:
        raise ValueError(f"host execution of opcode {x.op} is not in this module")
    host, module = _EXEC[x.op]
    expect = host(x, mods[module])  # operand -> elements the opcode must store
    _reference(S, v)
    compare_outputs(S, x, expect, run, errors)


def _mk_mutants(mutant: list) -> dict[str, ModuleType]:
    """The megakernel MoE modules a case's ``mutant`` replaces: a mutant of ``megakernel.router`` also reaches the
    expert opcodes (their slot lists call its compaction, as on the GPU); a mutated shared module (``common.device``)
    reaches both the ROUTER (its arg-max comparison) and the expert opcodes (the MXFP4 decode)."""
    mname, reps = mutant
    if mname in SHARED_MODULES:  # the router's copy imports the mutated module; so must the experts' copy
        _, router = load_case_mutant(mutant, "megakernel.router")
        moe_reps = [(f"from {KERNELS}.{mname} import", f"from {_mutant_name(mname)} import")]
    elif mname == "megakernel.router":
        router, moe_reps = load_mutant(mname, [tuple(r) for r in reps]), []
    else:
        return {mname: load_mutant(mname, [tuple(r) for r in reps])}
    moe = load_mutant("megakernel.moe", [*moe_reps, (f"from {KERNELS}.megakernel.router import",
                                                     f"from {router.__name__} import")])
    return {"megakernel.router": router, "megakernel.moe": moe}


def _mk_case(case: dict[str, Any], mutated: dict[str, ModuleType]) -> tuple[HostRun, dict[str, float], str]:
    """Every instruction of the opcode ``family`` = ``mk.<OPCODE>`` in a program (``layers``: only those layers),
    with the producers it depends on (the ROUTER before the experts) run first on the host too; ``mutated``: the
    kernel modules replaced by planted-bug copies (:func:`_mk_mutants`)."""
    from kimik3.kernels.megakernel import misc as mk_misc
    from kimik3.kernels.megakernel import moe as mk_moe
    from kimik3.kernels.megakernel import router as mk_router

    op = case["family"].split(".", 1)[1]
    groups = {"moe": ("ROUTER", "EXPERT_GATE_UP", "EXPERT_DOWN"), "misc": ("EMBED", "ATTN_RES_MIX", "ARGMAX")}
    if op not in MK_OPS and op not in groups:
        raise ValueError(f"run_case: unknown megakernel opcode {op!r}; expected one of {MK_OPS} or {list(groups)}")
    mods = {"megakernel.router": mk_router, "megakernel.moe": mk_moe, "megakernel.misc": mk_misc}
    if set(mutated) - set(mods):
        raise ValueError(f"run_case: mutants of {', '.join(mods)} or common.device only, got {sorted(mutated)}")
    mods.update(mutated)
    S = _MkSetup(case["preset"], int(case["batch"]), policy=case.get("policy", "critical_path"),
                 seed=int(case.get("seed", 0)), expert_format=case.get("expert_format", "dense"),
                 tiling=case.get("tiling"), arch=case.get("arch", "sm_90a"), world=int(case.get("world", 1)),
                 rank=int(case.get("rank", 0)))
    S.ties = bool(case.get("ties", False))
    S.crowd = bool(case.get("crowd", False))
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
    "mxfp4"), ``tiling`` (megakernel: ``Tiling`` fields to override), ``world`` / ``rank`` (megakernel: one rank's
    program of a deployment), ``arch`` (megakernel: the compile target whose
    loop widths run, ``MKConfig.arch``; default sm_90a), ``mutant`` ([module, [[old, new], ...]];
    module ``common.device`` for a megakernel family: the expert opcodes run with the mutated shared helpers). Returns
    problems, errors, the tolerance and ``ok``."""
    import time

    from kimik3.kernels.toolchain import registry

    from kimik3.model.config import get_preset

    t0 = time.perf_counter()
    family, preset, B = case["family"], case["preset"], int(case["batch"])
    mname, mod = None, None
    if case.get("mutant") and not family.startswith("mk."):  # a mutated common.device reaches the router's copy
        mname, mod = load_case_mutant(case["mutant"], "fused.router")
    if family in ("router", "router.ties"):
        shapes = registry.FAMILIES["router"].shapes(get_preset(preset), B)
        shapes.update(case.get("shapes", {}))
        if mname not in (None, "fused.router"):
            raise ValueError(f"run_case: router cases take mutants of fused.router or common.device, got {mname!r}")
        run, errors, tol = _router_case(case, shapes, mod)
    elif family.startswith("mk."):
        run, errors, tol = _mk_case(case, _mk_mutants(case["mutant"]) if case.get("mutant") else {})
    else:
        raise ValueError(f"run_case: unknown family {family!r}")
    return case_result(case, run, errors, tol, t0)


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.kernels.verify.host_exec_router CASES.json``: run each case, one JSON line per case on
    stdout."""
    return cases_main(run_case, "kimik3.kernels.verify.host_exec_router", argv)


if __name__ == "__main__":
    raise SystemExit(main())
