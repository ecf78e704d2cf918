"""What a config asks of a fast path, as features with one readable value each (docs/architecture.md §13).

Every field of :class:`~kimik3.model.config.ModelConfig` is reviewed here once (:data:`FIELD_ROLES`: the feature
it decides, or why it decides none), and every feature has a probe (:data:`FEATURES`). A field that nobody
reviewed, an ``extra`` key that the loader kept but nobody knows, or a probe that fails is not a feature that is
off: :func:`unreviewed` reports it and every gate refuses it (fail closed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from kimik3.model.config import ModelConfig

__all__ = ["ABSENT", "ROLE_KINDS", "FIELD_ROLES", "FEATURES", "KNOWN_EXTRA", "config_features", "unreviewed"]

ABSENT = "absent"  # the value of a feature whose block the model does not have
ROLE_KINDS = ("shape", "numeric", "identity", "extra keys")

# Every ModelConfig field -> the feature it decides (a key of FEATURES), or one of ROLE_KINDS: "shape" (a width or
# count: the gates' rules check the ones a kernel constrains), "numeric" (a constant every path takes as a
# parameter), "identity" (names and token ids: no path reads them), "extra keys" (checked key by key: KNOWN_EXTRA).
FIELD_ROLES: dict[str, str] = {
    "family": "identity", "name": "identity", "bos_token_id": "identity", "eos_token_id": "identity",
    "pad_token_id": "identity",
    "vocab_size": "shape", "hidden_size": "shape", "num_hidden_layers": "shape", "intermediate_size": "shape",
    "num_attention_heads": "shape", "kv_lora_rank": "shape", "qk_nope_head_dim": "shape", "v_head_dim": "shape",
    "kda_num_heads": "shape", "kda_head_dim": "shape", "kda_conv_size": "shape", "num_experts_per_tok": "shape",
    "moe_intermediate_size": "shape", "max_position_embeddings": "shape",
    "rms_norm_eps": "numeric", "situ_beta": "numeric", "situ_linear_beta": "numeric", "norm_topk_prob": "numeric",
    "routed_scaling_factor": "numeric", "rope_theta": "numeric", "rope_interleave": "numeric",
    "hidden_act": "ffn activation", "first_k_dense_replace": "ffn layers", "moe_layer_freq": "ffn layers",
    "q_lora_rank": "mla query", "qk_rope_head_dim": "mla position", "mla_use_nope": "mla position",
    "rope_scaling": "mla position", "mla_use_output_gate": "mla output gate", "kda_layers": "mixers",
    "kda_gate_lower_bound": "kda gate", "kda_full_rank_gate": "kda gate", "n_routed_experts": "moe",
    "moe_latent_size": "moe", "moe_latent_norm": "moe", "n_shared_experts": "shared experts", "n_group": "routing",
    "topk_group": "routing", "attn_res_block_size": "residual", "tie_word_embeddings": "embeddings",
    "rank_slice": "deployment", "extra": "extra keys",
}

# checkpoint keys the loader keeps in ``cfg.extra`` that no decode path reads (the multi-token-prediction layers
# are skipped at load)
KNOWN_EXTRA: frozenset[str] = frozenset({"num_nextn_predict_layers"})


def _mla(c: ModelConfig, value: Callable[[ModelConfig], str]) -> str:
    return value(c) if c.mla_layers else ABSENT


def _kda_gate(c: ModelConfig) -> str:
    if not c.kda_layers:
        return ABSENT
    rank = "full-rank g_proj" if c.kda_full_rank_gate else "low-rank g_a/g_b"
    form = "lower bound" if c.kda_gate_lower_bound is not None else "softplus"
    return f"{rank}, {form}"


def _moe(c: ModelConfig) -> str:
    if not c.moe_layers:
        return ABSENT
    if c.moe_latent_size is None:
        return "plain MoE"
    return "LatentMoE with latent norm" if c.moe_latent_norm else "LatentMoE without latent norm"


def _ffn_layers(c: ModelConfig) -> str:
    kinds = [k for k in ("dense", "moe") if any(c.ffn(i) == k for i in range(c.num_hidden_layers))]
    return " + ".join({"dense": "dense MLP", "moe": "MoE"}[k] for k in kinds) or ABSENT


def _routing(c: ModelConfig) -> str:
    if not c.moe_layers:
        return ABSENT
    return "grouped top-k" if c.n_group > 1 and c.topk_group < c.n_group else "flat top-k"


# feature -> probe: its value for a config, a short phrase (the refusal and the dossier print it as it is)
FEATURES: dict[str, Callable[[ModelConfig], str]] = {
    "residual": lambda c: "Attention Residuals" if c.attn_res_block_size else "additive residual",
    "mixers": lambda c: " + ".join(k for k, on in (("KDA", c.kda_layers), ("MLA", c.mla_layers)) if on) or ABSENT,
    "mla query": lambda c: _mla(c, lambda c: "q LoRA" if c.q_lora_rank else "direct q_proj"),
    "mla position": lambda c: _mla(c, lambda c: ("RoPE + YaRN" if c.rope_scaling else "RoPE") if c.uses_rope
                                   else "NoPE"),
    "mla output gate": lambda c: _mla(c, lambda c: "gated" if c.mla_use_output_gate else "ungated"),
    "kda gate": _kda_gate,
    "ffn activation": lambda c: {"situ": "SiTU-GLU", "silu": "SwiGLU"}.get(c.hidden_act, f"{c.hidden_act!r}"),
    "ffn layers": _ffn_layers,
    "moe": _moe,
    "shared experts": lambda c: "shared experts" if c.moe_layers and c.n_shared_experts else ABSENT,
    "routing": _routing,
    "embeddings": lambda c: "tied" if c.tie_word_embeddings else "untied",
    "deployment": lambda c: "rank slice" if c.rank_slice else "whole model",
}


def config_features(cfg: ModelConfig) -> dict[str, str]:
    """Every feature's value for ``cfg``; a probe that raises gives ``"unknown (probe failed: ...)"``, which no
    spec lists."""
    out = {}
    for name, probe in FEATURES.items():
        try:
            out[name] = str(probe(cfg))
        except Exception as e:  # a probe that cannot tell refuses rather than reading as "off"
            out[name] = f"unknown (probe failed: {type(e).__name__}: {e})"
    return out


def unreviewed(cfg: ModelConfig) -> list[str]:
    """What in ``cfg`` no gate has reviewed: fields missing from :data:`FIELD_ROLES` (a field added to the config
    later) and ``extra`` keys outside :data:`KNOWN_EXTRA`, each as a reason."""
    out = [f"config field {f.name!r} is not reviewed by the scope gates (kimik3/scope/features.py FIELD_ROLES)"
           for f in fields(cfg) if f.name not in FIELD_ROLES]
    unknown = sorted(set(cfg.extra) - KNOWN_EXTRA)
    if unknown:
        out.append(f"checkpoint config keys {', '.join(map(repr, unknown))} are not reviewed by the scope gates")
    return out
