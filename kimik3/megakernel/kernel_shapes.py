"""The persistent megakernel's compile-time shapes and variant names, read from a config and batch size (DSL-free:
the kernel registry, the prebuilt manifest and the GPU runner agree through this one definition). Design:
docs/architecture.md (map: the megakernel's host side).
"""

from __future__ import annotations

from typing import Any

from kimik3.kernels.contracts.isa import EXPERT_FORMATS
from kimik3.model.config import ModelConfig, get_preset

__all__ = ["PROG_WORDS", "MAX_INSTR", "MAX_BUFS", "MAX_CTRS", "static_shapes", "variant_name"]

# Static capacities of the kernel's parameters (every tensor parameter has a static shape, so it is a single
# pointer and the kernel can be exported as a prebuilt artefact; the host pads). A program beyond them is
# compiled with larger capacities in-process (never silently truncated).
PROG_WORDS = 1 << 22  # 16 MiB of int32 program (room for tiny at B = 64 on 132 SMs)
MAX_INSTR = 1 << 15  # timing rows
MAX_BUFS = 1 << 12  # buffer-table entries
MAX_CTRS = 1 << 12
# a full-depth rank program (k3-rank: 93 layers, ~65k instructions, ~8.5M words and ~9.9k counter words (one per
# source of a cross-rank counter) at batch 8) needs more
RANK_PROG_WORDS, RANK_MAX_INSTR, RANK_MAX_CTRS = 1 << 24, 1 << 17, 1 << 14
# ERROR_WORDS, CTL_WORDS, ERR_WATCHDOG, ERR_BAD_PROGRAM: the launch's error / control words, defined with the
# program encoding in kernels/contracts/isa.py (the device code reads the same definitions)


def _check_format(expert_format: str) -> None:
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"unknown expert_format {expert_format!r}; known: {', '.join(EXPERT_FORMATS)}")


def static_shapes(cfg: ModelConfig | str, batch: int, prog_words: int = PROG_WORDS, max_instr: int = MAX_INSTR,
                  max_bufs: int = MAX_BUFS, max_ctrs: int = MAX_CTRS, expert_format: str = "dense") -> dict[str, Any]:
    """The megakernel's compile-time shapes for a config and batch size (the fields of ``MKConfig`` but ``arch``,
    which ``compile_for`` sets from its target): widths and
    constants of the model, the batch, the parameter capacities and whether the routed experts are MXFP4
    (``fp4``). JSON-serialisable; the registry's ``megakernel`` family and the prebuilt manifest use it as the
    variant's shapes."""
    _check_format(expert_format)
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    # a rank slice (k3-rank): the kernel of its rank program, which addresses the whole model's widths; its slots
    # hold only the rank's experts
    ranks, held = bool(cfg.rank_slice), cfg.held("experts")
    if ranks:
        prog_words = max(prog_words, RANK_PROG_WORDS)
        max_instr = max(max_instr, RANK_MAX_INSTR)
        max_ctrs = max(max_ctrs, RANK_MAX_CTRS)
    cfg = cfg.whole()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return dict(
        B=int(batch), H=cfg.hidden_size, eps=float(cfg.rms_norm_eps), lora_eps=1e-6, situ=cfg.hidden_act == "situ",
        situ_beta=float(cfg.situ_beta),
        situ_lin=None if cfg.situ_linear_beta is None else float(cfg.situ_linear_beta),
        dk=cfg.kda_head_dim if cfg.kda_layers else 0, nh_kda=cfg.kda_num_heads if cfg.kda_layers else 0,
        conv=cfg.kda_conv_size,
        kda_lb=None if cfg.kda_gate_lower_bound is None else float(cfg.kda_gate_lower_bound),
        nh=cfg.num_attention_heads if cfg.mla_layers else 0, ql=int(cfg.q_lora_rank or 0), kvl=cfg.kv_lora_rank,
        rope=cfg.qk_rope_head_dim, nope=cfg.qk_nope_head_dim, dv=cfg.v_head_dim,
        mla_scale=float(cfg.mla_softmax_scale) if cfg.mla_layers else 1.0,
        E=E, topk=k, dmax=min(held, batch * k) if E else 0, renorm=bool(cfg.norm_topk_prob),
        # (a rank's FFN_OUT reads the latent MOE_COMBINE normed: the kernel's up-projection applies no norm)
        route_scale=float(cfg.routed_scaling_factor), latent_norm=bool(cfg.moe_latent_norm) and not ranks,
        kmax=cfg.attn_res_slots + 1, prog_words=int(prog_words), max_instr=int(max_instr), max_bufs=int(max_bufs),
        max_ctrs=int(max_ctrs), fp4=expert_format == "mxfp4", ranks=ranks)


def variant_name(cfg: ModelConfig | str, batch: int, expert_format: str = "dense") -> str:
    """The registry / prebuilt name of the megakernel for a preset, batch and expert format
    (``megakernel/tiny/b8``, ``megakernel/tiny/b8-mxfp4``)."""
    _check_format(expert_format)
    name = cfg if isinstance(cfg, str) else cfg.name
    return f"megakernel/{name}/b{batch}" + ("" if expert_format == "dense" else f"-{expert_format}")
