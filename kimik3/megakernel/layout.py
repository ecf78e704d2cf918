"""How the megakernel lays out weights and scratch buffers: names, 3-D views and the packed weights.

A tile instruction should read one contiguous block of weight rows and write one contiguous block of outputs that
the next instruction reads as one box; the checkpoint layout does not give that (a KDA head needs rows of five
projections, MLA's ``kv_b_proj`` interleaves key and value halves, §4.4), so a few weights are re-packed once at
load (:func:`pack_weights`: ``packed.L{ℓ}.kda_in``, ``kda_conv``, ``mla_in``, ``mla_wuk``, ``mla_wuv``). Every
other weight is the model's parameter under its checkpoint name, viewed as 3-D (``[n] → [1, 1, n]``, ``[r, c] →
[1, r, c]``, stacked experts ``[E, r, c]``). Routed experts are ``"dense"`` or ``"mxfp4"``
(:data:`EXPERT_FORMATS`; §5.5). The scheduler needs only names and shapes, from a config; the executors pack a
real model. The packed rows: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kimik3.megakernel.instructions import EXPERT_FORMATS, BufferSpec, Instruction, Kind, Program
from kimik3.model.config import ModelConfig
from kimik3.model.modeling import DecodeState, KDAState, KimiForCausalLM, MLACache
from kimik3.scope.gates import mxfp4_width_error, program_feature_errors

__all__ = [
    "EXPERT_FORMATS",
    "check_expert_format",
    "expert_weight_names",
    "model_weights",
    "kda_head_width",
    "kda_in_rows",
    "mla_in_segments",
    "packed_name",
    "state_name",
    "weight_view",
    "pack_weights",
    "missing_weight",
    "localize",
    "carry_held",
    "bind_weight",
    "program_tensors",
    "check_supported",
]


def check_supported(cfg: ModelConfig) -> None:
    """The megakernel program covers what its scope gate lists (:data:`kimik3.scope.gates.PROGRAM`: the Kimi K3
    feature set). Anything else is refused here, every feature by name."""
    problems = program_feature_errors(cfg)
    if problems:
        raise ValueError(f"megakernel program: config {cfg.name or cfg.family!r} uses unsupported features: "
                         + "; ".join(problems))


def check_expert_format(cfg: ModelConfig, expert_format: str) -> None:
    """``expert_format`` names a format of :data:`EXPERT_FORMATS` that ``cfg``'s routed experts can take (MXFP4: the
    latent width and the expert hidden width are multiples of 32, the gate's rule); ``ValueError`` otherwise."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"unknown expert_format {expert_format!r}; known: {', '.join(EXPERT_FORMATS)}")
    why = mxfp4_width_error(cfg, expert_format)
    if why:
        raise ValueError(f"expert_format 'mxfp4' {why}")


def expert_weight_names(layer: int, expert_format: str) -> dict[str, tuple[str, ...]]:
    """The program's buffer names of layer ``layer``'s routed experts per weight (w1, w3, w2): the dense stack, or
    the MXFP4 (codes, scales) pair — the model's own parameter / buffer names."""
    mp = f"model.layers.{layer}.block_sparse_moe.experts."
    if expert_format == "mxfp4":
        return {w: (f"{mp}{w}_packed", f"{mp}{w}_scale") for w in ("w1", "w3", "w2")}
    return {w: (f"{mp}{w}",) for w in ("w1", "w3", "w2")}


def kda_head_width(cfg: ModelConfig) -> int:
    """Columns per head in the packed KDA input projection: q, k, v, output gate (dk each) and β (1)."""
    return 4 * cfg.kda_head_dim + 1


def kda_in_rows(cfg: ModelConfig) -> int:
    return cfg.kda_num_heads * kda_head_width(cfg) + cfg.kda_head_dim


def mla_in_segments(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Column ranges of the packed MLA input projection output."""
    ql, kv = cfg.q_lora_rank or 0, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    g = cfg.num_attention_heads * cfg.v_head_dim if cfg.mla_use_output_gate else 0
    return {"q_a": (0, ql), "kv_a": (ql, ql + kv), "g": (ql + kv, ql + kv + g)}


def packed_name(layer: int, what: str) -> str:
    return f"packed.L{layer}.{what}"


def state_name(layer: int, what: str) -> str:
    return f"state.L{layer}.{what}"


def state_views(cfg: ModelConfig, state: DecodeState) -> dict[str, torch.Tensor]:
    """The program's state buffers as views of a decode state's tensors (so the program updates it in place),
    by :func:`state_name`. The tensors must be contiguous (callers decide whether to copy or to refuse)."""
    views: dict[str, torch.Tensor] = {}
    for i, st in enumerate(state.layers):
        if isinstance(st, KDAState):
            B = st.conv.shape[0]
            views[state_name(i, "conv")] = st.conv.view(B, 3, cfg.kda_proj_dim * (cfg.kda_conv_size - 1))
            views[state_name(i, "S")] = st.S.view(B, cfg.kda_num_heads, -1)
        elif isinstance(st, MLACache):
            views[state_name(i, "latent")] = st.latent
            views[state_name(i, "k_r")] = st.k_r
    return views


def weight_view(t: torch.Tensor) -> torch.Tensor:
    """The 3-D view a weight is declared with."""
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() == 3:
        return t
    raise ValueError(f"no 3-D view for a {t.dim()}-D weight")


@torch.no_grad()
def pack_weights(model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """The packed weights of :mod:`layout` (copies, made once at load time)."""
    cfg = model.config
    check_supported(cfg)
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        if layer.kind == "kda":
            nh, dk = cfg.held("kda_heads"), cfg.kda_head_dim  # (a rank's slice holds its heads only)
            per_head = [w.weight.view(nh, dk, -1) for w in (a.q_proj, a.k_proj, a.v_proj, a.g_proj)]
            per_head.append(a.b_proj.weight.view(nh, 1, -1))
            heads = torch.cat(per_head, 1).reshape(nh * kda_head_width(cfg), -1)
            out[packed_name(i, "kda_in")] = torch.cat([heads, a.f_a_proj.weight], 0).contiguous()
            out[packed_name(i, "kda_conv")] = a.conv_weight().reshape(3, -1).contiguous()
        else:
            parts = [a.q_a_proj.weight, a.kv_a_proj_with_mqa.weight]
            if cfg.mla_use_output_gate:
                parts.append(a.g_proj.weight)
            out[packed_name(i, "mla_in")] = torch.cat(parts, 0).contiguous()
            kvb = a.kv_b_proj.weight.view(cfg.held("mla_heads"), cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            out[packed_name(i, "mla_wuk")] = kvb[:, : cfg.qk_nope_head_dim].reshape(-1, kvb.shape[-1]).contiguous()
            out[packed_name(i, "mla_wuv")] = kvb[:, cfg.qk_nope_head_dim :].reshape(-1, kvb.shape[-1]).contiguous()
    return out


@torch.no_grad()
def model_weights(model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """Every tensor a program's WEIGHT buffer may name: the model's parameters, its buffers (the uint8 codes and
    scales of routed experts held as MXFP4) and the packed copies of :func:`pack_weights`."""
    weights = {n: t.detach() for n, t in model.named_buffers()}
    weights.update((n, t.detach()) for n, t in model.named_parameters())
    weights.update(pack_weights(model))
    return weights


def missing_weight(name: str, model: KimiForCausalLM) -> ValueError:
    """The error for a WEIGHT buffer the model lacks; names the expert-format mismatch when that is the cause."""
    storage = model.expert_storage
    if ".experts.w" in name and (name.endswith(("_packed", "_scale")) != (storage == "mxfp4")):
        fmt = "mxfp4" if storage == "dense" else "dense"
        return ValueError(f"program needs weight {name!r}: it carries the routed experts as {fmt}, but the model "
                          f"holds them {storage} (build the program with expert_format=model.expert_storage, or "
                          "convert the model: model.quantize_experts() / model.dequantize_experts())")
    return ValueError(f"program needs weight {name!r}, which the model does not have")


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def localize(buffers: list[BufferSpec], instructions: list[Instruction]
             ) -> tuple[list[BufferSpec], list[Instruction]]:
    """A rank program's weights as the rank holds them. Per weight and axis, the ranges its instructions read are
    the rank's share (heads, experts, channels, vocabulary rows; whole segments such as MLA's ``q_a`` rows stay);
    the buffer is declared as their concatenation, in order, and every box is moved onto it. So a rank's slice
    of a model (``ModelConfig.rank_slice``) binds as it is, a column-split weight has rows of its own width, and
    a whole model's weight is cut once (:func:`bind_weight`). The order is the modules' own: a slice holds its
    share of each segment in the segments' order (checked against the slice's modules in the tests)."""
    reads: dict[int, tuple[list, list, list]] = {}
    for ins in instructions:
        for o in ins.operands:
            if buffers[o.buf].kind == Kind.WEIGHT:
                axes = reads.setdefault(o.buf, ([], [], []))
                for a in range(3):
                    if o.box[2 * a + 1] <= o.box[2 * a]:
                        raise ValueError(f"{ins.label()}: an empty box on weight {buffers[o.buf].name}")
                    axes[a].append((o.box[2 * a], o.box[2 * a + 1]))
    out = list(buffers)
    moves: dict[int, list[list[tuple[int, int, int]]]] = {}  # buffer -> per axis (lo, hi, local lo) of each span
    for k, axes in reads.items():
        spec = buffers[k]
        spans = [tuple(_merge(iv)) for iv in axes]
        spans = [() if s == ((0, spec.shape[a]),) else s for a, s in enumerate(spans)]
        if not any(spans):
            continue
        shape, axis_moves = [], []
        for a, sp in enumerate(spans):
            local, at = [], 0
            for lo, hi in sp:
                local.append((lo, hi, at))
                at += hi - lo
            shape.append(at if sp else spec.shape[a])
            axis_moves.append(local)
        out[k] = replace(spec, shape=tuple(shape), whole=spec.shape, spans=tuple(spans))
        moves[k] = axis_moves
    if not moves:
        return out, list(instructions)

    def move(o):
        if o.buf not in moves:
            return o
        box = list(o.box)
        for a, local in enumerate(moves[o.buf]):
            for lo, hi, at in local:
                if lo <= box[2 * a] and box[2 * a + 1] <= hi:
                    box[2 * a], box[2 * a + 1] = box[2 * a] - lo + at, box[2 * a + 1] - lo + at
                    break
        return replace(o, box=tuple(box))

    return out, [replace(ins, operands=tuple(move(o) for o in ins.operands)) for ins in instructions]


def carry_held(decoded: Program, program: Program) -> Program:
    """``decoded`` (a program read back from its int32 encoding, which keeps each buffer's shape only) with the
    whole shapes and spans of ``program``'s rank shares: what :func:`bind_weight` cuts a whole model by."""
    if [(b.name, b.shape) for b in decoded.buffers] != [(b.name, b.shape) for b in program.buffers]:
        raise ValueError("the decoded program's buffers are not the program's")
    return replace(decoded, buffers=[replace(d, whole=o.whole, spans=o.spans)
                                     for d, o in zip(decoded.buffers, program.buffers)])


def bind_weight(spec: BufferSpec, t: torch.Tensor) -> torch.Tensor:
    """The tensor a program's weight buffer binds to, from the model's tensor ``t`` (its 3-D view): ``t`` itself
    when the shapes agree (one GPU's program, or a rank's slice of the model holding the share), else — a rank
    program over the whole model — the rank's share cut from it once (a copy, contiguous)."""
    if tuple(t.shape) == spec.shape:
        return t
    if spec.whole is None or tuple(t.shape) != spec.whole:
        held = f" (the rank's share of {list(spec.whole)})" if spec.whole else ""
        raise ValueError(f"buffer {spec.name}: program declares {list(spec.shape)}{held}, the model holds "
                         f"{list(t.shape)}")
    for a, sp in enumerate(spec.spans):
        if sp:
            t = torch.cat([t.narrow(a, lo, hi - lo) for lo, hi in sp], a)
    return t.contiguous()


@torch.no_grad()
def program_tensors(buffers, model: KimiForCausalLM, device: torch.device | str | None = None
                    ) -> dict[str, torch.Tensor]:
    """The tensors a runner binds to a program's buffers (``Program.buffers``): weights as 3-D views of the model's
    parameters, buffers (MXFP4 experts) or the packed copies, activations and scratch zeroed on ``device``. State
    buffers are left out: they belong to a ``DecodeState`` and are bound per call (:func:`state_views`)."""
    weights = model_weights(model)
    out: dict[str, torch.Tensor] = {}
    for spec in buffers:
        if spec.kind == Kind.WEIGHT:
            if spec.name not in weights:
                raise missing_weight(spec.name, model)
            out[spec.name] = bind_weight(spec, weight_view(weights[spec.name])).contiguous()
        elif spec.kind != Kind.STATE:
            out[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    return out
