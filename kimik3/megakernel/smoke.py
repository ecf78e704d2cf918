"""Smoke programs: one opcode family of one layer as a program of its own — its instructions, the waits among
them, their inputs left as the caller fills them — so a bad opcode is named (a hang, a fault, a wrong value) before
the full step runs on a device. Built with the same pipeline as the step (hazards, waits, stages).
docs/architecture.md, appendix "megakernel (host side): instructions, regions, counters"."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch

from kimik3.megakernel.instructions import Op, Program
from kimik3.megakernel.scheduler import _group_structure, assemble, assign_round_robin, hazard_predecessors
from kimik3.megakernel.step import build_step
from kimik3.model.config import ModelConfig

__all__ = ["FAMILIES", "smoke_program", "smoke_families", "written_boxes", "smoke_run", "compare_smoke"]

# the opcodes that run together: an expert opcode needs the router's slots, ARGMAX the head's logits, the MLA
# opcodes each other's partial results
FAMILIES: dict[str, tuple[Op, ...]] = {
    "embed": (Op.EMBED,), "attn_res": (Op.ATTN_RES_MIX,), "norm_proj": (Op.NORM_PROJ,),
    "mlp": (Op.MLP_GATE_UP, Op.FFN_OUT), "kda": (Op.KDA_STEP,), "o_proj": (Op.O_PROJ_RESIDUAL,),
    "mla": (Op.MLA_Q, Op.MLA_KV_APPEND, Op.MLA_PARTIAL, Op.MLA_REDUCE),
    "moe": (Op.ROUTER, Op.EXPERT_GATE_UP, Op.EXPERT_DOWN), "lm_head": (Op.LM_HEAD, Op.ARGMAX)}


def smoke_families(cfg: ModelConfig | str, batch: int = 1, expert_format: str = "dense") -> list[str]:
    """The families whose opcodes the step of ``cfg`` has (a dense model has no ``moe``)."""
    ops = {ins.op for ins in build_step(cfg, batch, 64, None, 1, torch.bfloat16, None, expert_format).instructions}
    return [f for f, fam in FAMILIES.items() if any(op in ops for op in fam)]


def smoke_program(cfg: ModelConfig | str, batch: int, num_sms: int, family: str, max_seq_len: int = 64,
                  expert_format: str = "dense", act_dtype: torch.dtype = torch.bfloat16) -> Program:
    """The instructions of ``family`` in the first layer that has its first opcode, as a program on ``num_sms``
    queues (round robin). Its inputs are whatever the buffers hold when it runs; its outputs are the boxes those
    instructions write."""
    if family not in FAMILIES:
        raise ValueError(f"unknown smoke family {family!r}; known: {', '.join(FAMILIES)}")
    spec = build_step(cfg, batch, max_seq_len, None, num_sms, act_dtype, None, expert_format)
    ops = FAMILIES[family]
    first = next((ins for ins in spec.instructions if ins.op in ops), None)
    if first is None:
        raise ValueError(f"the step of {spec.cfg.name} has no {family} instruction ({', '.join(o.name for o in ops)})")
    keep = [i for i, ins in enumerate(spec.instructions) if ins.op in ops and ins.layer == first.layer]
    sub = replace(spec, instructions=[spec.instructions[i] for i in keep], groups=[spec.groups[i] for i in keep],
                  raw_costs=[spec.raw_costs[i] for i in keep])
    preds = hazard_predecessors(sub.buffers, sub.instructions)
    groups = _group_structure(sub.groups, preds)
    return assemble(sub, assign_round_robin(len(keep), num_sms), preds, groups, "round_robin")


def written_boxes(program: Program) -> list[tuple[str, tuple[slice, slice, slice]]]:
    """(buffer name, box) of every operand the program's instructions write: what a smoke run compares."""
    return [(program.buffers[o.buf].name, o.slices()) for ins in program.instructions for o in ins.operands
            if o.writes]


def _fill(t: torch.Tensor, g: torch.Generator) -> None:
    """Floats random (what a real step would have left there), integers and flags zero (indices and positions a
    random fill would turn into reads out of bounds; the family writes those it reads)."""
    if t.dtype.is_floating_point:
        t.copy_((0.5 * torch.randn(t.shape, generator=g)).to(t.dtype))
    else:
        t.zero_()


def smoke_run(runner: Any, model: Any, seed: int = 0, position: int = 3) -> dict[str, torch.Tensor]:
    """One step of a smoke program on ``runner`` (any of the three executors, built with ``program=`` a smoke
    program, fp32 or bf16): every scratch buffer and the decode state filled from ``seed``, the same on every
    executor; returns each written box as fp32 on the CPU, keyed ``"<buffer>[<box>]"``."""
    from kimik3.megakernel.instructions import Kind

    p = runner.program
    g = torch.Generator().manual_seed(seed)
    state = model.new_state(p.batch, p.max_seq_len)
    for st in state.layers:
        for t in (getattr(st, k) for k in vars(st) if isinstance(getattr(st, k), torch.Tensor)):
            if t.dtype.is_floating_point:
                t.copy_((0.5 * torch.randn(t.shape, generator=g)).to(t.dtype))
    runner.bind_state(state)
    for spec in p.buffers:
        if spec.kind in (Kind.ACT, Kind.OUTPUT) and spec.name in runner.tensors:
            t = runner.tensors[spec.name]
            cpu = torch.empty(t.shape, dtype=t.dtype)
            _fill(cpu, g)
            t.copy_(cpu)
    B = p.batch
    ids = torch.full((B,), 5, dtype=torch.long, device=model.device)
    pos = torch.full((B,), position, dtype=torch.long, device=model.device)
    # the inputs were just written: an executor that poisons its scratch per step must not here
    kwargs = {"poison_scratch": False} if "poison_scratch" in inspect.signature(runner.run_step).parameters else {}
    runner.run_step(ids, pos, **kwargs)
    out = {}
    for name, box in written_boxes(p):  # (bind_state put the state buffers among the runner's tensors)
        out[f"{name}{[(b.start, b.stop) for b in box]}"] = runner.tensors[name][box].float().cpu()
    return out


def compare_smoke(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> list[str]:
    """The written boxes where ``got`` is not finite or differs from ``want`` by more than ``tol`` (relative, the
    package's metric): empty when the smoke run agrees."""
    from kimik3.validation.metric import rel_error

    bad = []
    for k, w in want.items():
        x = got.get(k)
        if x is None:
            bad.append(f"{k}: not written")
        elif torch.isnan(x).any():
            bad.append(f"{k}: NaN")
        elif not torch.equal(torch.isfinite(x), torch.isfinite(w)) or not torch.equal(x[~torch.isfinite(x)],
                                                                                       w[~torch.isfinite(w)]):
            # an empty attention split's running max is -inf by design: the same entries must be, on both sides
            bad.append(f"{k}: infinite where the reference is not")
        elif (f := torch.isfinite(w)).any() and (e := rel_error(x[f], w[f])) > tol:
            bad.append(f"{k}: rel err {e:.3g} > {tol}")
    return bad
