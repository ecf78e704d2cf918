"""Model configuration: one typed config for Kimi K3, Kimi K2 / DeepSeek-V3 and Kimi-Linear.

Every size used anywhere in the package (the model, the cost model, the kernels, the megakernel
scheduler) is read from a :class:`ModelConfig`. Hugging Face ``config.json`` files are parsed by
:func:`config_from_hf`; the named presets live in :data:`PRESETS`.

Layer indices are 0-based everywhere in this package. Hugging Face's ``linear_attn_config`` lists
are 1-based; the parser converts them (spec §1.1, pitfall 16).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimik3.model.checks import check_config_values, check_hf_fields
from kimik3.model.layer_kinds import ffn_rule, kda_from_layer_types
from kimik3.util.text import escaped_errors

__all__ = [
    "ModelConfig",
    "config_from_hf",
    "load_config",
    "get_preset",
    "PRESETS",
    "PRESET_NAMES",
]

FAMILIES = ("kimi_k3", "kimi_linear", "deepseek_v3", "kimi_k2")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decode path needs to know about a model.

    ``family`` only names where the config came from; every behaviour is selected by the
    feature fields below (``attn_res_block_size``, ``kda_gate_lower_bound``, ``moe_latent_size`` ...),
    so a K3-shaped config with K2's router works without new code.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-5
    # -- feed-forward activation: "silu" (SwiGLU) or "situ" (SiTU-GLU, spec §5.1)
    hidden_act: str = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    intermediate_size: int = 0  # dense MLP width
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # -- MLA
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # YaRN parameters (factor, beta_fast, ...), None = plain RoPE
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    # -- KDA (0-based indices of KDA layers; every other layer is MLA)
    kda_layers: tuple[int, ...] = ()
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = None  # None: softplus form (Kimi-Linear); K3: -5.0
    kda_full_rank_gate: bool = False  # K3: g_proj [P, H]; Kimi-Linear: g_a/g_b rank head_dim
    # -- MoE
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    moe_latent_size: int | None = None  # LatentMoE width (K3: 3584); None: plain MoE
    moe_latent_norm: bool = False
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # -- residual stream: None = additive residual; K3: Attention Residuals with this block size
    attn_res_block_size: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    name: str = ""
    # -- one rank's slice of a tensor- x expert-parallel deployment: (world, rank), None = the whole model.
    # The modules built hold only the rank's share of the split dimensions (kimik3.model.rank_slice).
    rank_slice: tuple[int, int] | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived quantities
    def mixer(self, layer: int) -> str:
        """'kda' or 'mla' for 0-based ``layer``."""
        return "kda" if layer in self._kda_set else "mla"

    def ffn(self, layer: int) -> str:
        """'dense' or 'moe' for 0-based ``layer`` (DeepSeek rule: first_k_dense_replace, moe_layer_freq)."""
        if self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0:
            return "moe"
        return "dense"

    @property
    def _kda_set(self) -> frozenset[int]:
        return frozenset(self.kda_layers)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self._kda_set)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.ffn(i) == "moe")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def expert_in_dim(self) -> int:
        """Width the routed experts read and write: the latent width for LatentMoE, else hidden."""
        return self.moe_latent_size or self.hidden_size

    @property
    def uses_rope(self) -> bool:
        return not self.mla_use_nope and self.qk_rope_head_dim > 0

    @property
    def mla_softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (spec §4.5.3)."""
        scale = self.qk_head_dim**-0.5
        if self.uses_rope and self.rope_scaling:
            mad = self.rope_scaling.get("mscale_all_dim") or 0
            if mad:
                m = yarn_mscale(self._yarn_factor(), mad)
                scale = scale * m * m
        return scale

    def _yarn_factor(self) -> float:
        rs = self.rope_scaling or {}
        f = rs.get("factor")
        if f is None:
            f = self.max_position_embeddings / rs["original_max_position_embeddings"]
        return float(f)

    @property
    def attn_res_slots(self) -> int:
        """Number of completed-block slots at the end of the stack (K3: 8)."""
        if not self.attn_res_block_size:
            return 0
        return len(range(0, self.num_hidden_layers, self.attn_res_block_size))

    @property
    def slice_world(self) -> int:
        """Ranks the deployment this config is one slice of (1: the whole model)."""
        return self.rank_slice[0] if self.rank_slice else 1

    def split_dims(self) -> dict[str, int]:
        """The whole size of every dimension a tensor- × expert-parallel layout splits (the rule:
        :mod:`kimik3.model.rank_slice`), for the blocks this model has (0: no such block)."""
        moe = bool(self.moe_layers)
        dense = any(self.ffn(i) == "dense" for i in range(self.num_hidden_layers))
        return {"kda_heads": self.kda_num_heads if self.kda_layers else 0,
                "mla_heads": self.num_attention_heads if self.mla_layers else 0,
                "experts": self.n_routed_experts if moe else 0,
                "latent": (self.moe_latent_size or 0) if moe else 0,
                "shared": self.moe_intermediate_size * self.n_shared_experts if moe else 0,
                "dense": self.intermediate_size if dense else 0,
                "vocab": self.vocab_size}

    def share(self, what: str) -> tuple[int, int]:
        """``[lo, hi)`` of split dimension ``what`` (a key of :meth:`split_dims`) this config's modules hold: the
        rank's share for a rank slice, else the whole dimension."""
        from kimik3.model.rank_slice import part

        dims = self.split_dims()
        if what not in dims:
            raise ValueError(f"unknown split dimension {what!r}; known: {', '.join(dims)}")
        total = dims[what]
        return part(total, *self.rank_slice, what) if self.rank_slice else (0, total)

    def held(self, what: str) -> int:
        """How much of split dimension ``what`` the modules hold."""
        lo, hi = self.share(what)
        return hi - lo

    def whole(self) -> ModelConfig:
        """The model this config is a slice of (itself when it is whole)."""
        return self.replace(rank_slice=None) if self.rank_slice else self

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra", None)
        d["kda_layers"] = list(self.kda_layers)
        if self.rank_slice is not None:
            d["rank_slice"] = list(self.rank_slice)
        return d

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"inconsistent config{' ' + repr(self.name) if self.name else ''}: {msg}")

        check_config_values(self)  # types and ranges first: the consistency checks below compare numbers
        need(self.family in FAMILIES, f"family must be one of {FAMILIES}, got {self.family!r}")
        for f in ("vocab_size", "hidden_size", "num_hidden_layers"):
            need(getattr(self, f) > 0, f"{f} must be positive, got {getattr(self, f)}")
        need(self.hidden_act in ("silu", "situ"), f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
        need(all(0 <= i < self.num_hidden_layers for i in self.kda_layers),
             f"kda_layers {list(self.kda_layers)} out of range for {self.num_hidden_layers} layers")
        need(len(set(self.kda_layers)) == len(self.kda_layers), "kda_layers has duplicates")
        if self.kda_layers:
            need(self.kda_num_heads > 0 and self.kda_head_dim > 0, "KDA layers need kda_num_heads and kda_head_dim")
            need(self.kda_conv_size >= 1, "kda_conv_size must be >= 1")
        if self.mla_layers:
            need(self.num_attention_heads > 0, "MLA layers need num_attention_heads > 0")
            need(self.kv_lora_rank > 0 and self.qk_nope_head_dim > 0 and self.v_head_dim > 0,
                 "MLA layers need kv_lora_rank, qk_nope_head_dim and v_head_dim > 0")
            if self.uses_rope:
                need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even for RoPE")
        if any(self.ffn(i) == "dense" for i in range(self.num_hidden_layers)):
            need(self.intermediate_size > 0, "dense MLP layers need intermediate_size > 0")
        if self.n_routed_experts:
            need(0 < self.num_experts_per_tok <= self.n_routed_experts,
                 f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts="
                 f"{self.n_routed_experts}")
            need(self.moe_intermediate_size > 0, "MoE layers need moe_intermediate_size > 0")
            need(self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
            need(1 <= self.topk_group <= self.n_group, f"topk_group={self.topk_group} must be in 1..n_group")
            if self.n_group > 1:
                need(self.n_routed_experts // self.n_group >= 2, "grouped routing needs >= 2 experts per group")
                need(self.topk_group * (self.n_routed_experts // self.n_group) >= self.num_experts_per_tok,
                     "topk_group groups hold fewer experts than num_experts_per_tok")
            need(self.moe_layer_freq >= 1, "moe_layer_freq must be >= 1")
        if self.moe_latent_size is not None:
            need(self.moe_latent_size > 0, "moe_latent_size must be positive")
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size > 0, "attn_res_block_size must be positive")
        if self.hidden_act == "situ":
            need(self.situ_beta > 0, "activation_situ_beta must be positive")
        if self.rank_slice is not None:
            from kimik3.model.rank_slice import check_split

            world, rank = self.rank_slice
            need(world >= 1 and 0 <= rank < world, f"rank_slice {self.rank_slice}: need world >= 1 and 0 <= rank < "
                 "world")
            check_split(self, world)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ---------------------------------------------------------------------- Hugging Face config.json


def _get(d: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def config_from_hf(raw: dict, name: str = "") -> ModelConfig:
    """Parse a Hugging Face ``config.json`` dict (model_type deepseek_v3, kimi_k2, kimi_linear or kimi_k3)."""
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    family = model_type
    if model_type == "kimi_k3":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("kimi_k3 config.json has no 'text_config' object")
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise ValueError(f"kimi_k3 text_config.model_type must be 'kimi_linear', got {text.get('model_type')!r}")
        raw = _k3_text(raw, text)
        check_hf_fields(raw, "text_config.")
    elif model_type not in ("kimi_linear", "deepseek_v3", "kimi_k2"):
        raise ValueError(
            f"unknown model_type {model_type!r}: supported are 'kimi_k3', 'kimi_linear', 'deepseek_v3', 'kimi_k2'"
        )
    else:
        check_hf_fields(raw)
    try:
        if family in ("deepseek_v3", "kimi_k2"):
            return _deepseek_family(raw, family, name)
        return _kimi_linear_family(raw, family, name)
    except KeyError as e:
        raise ValueError(f"config.json ({model_type}) is missing required field {e.args[0]!r}") from None


def _k3_text(raw: dict, text: dict) -> dict:
    """K3's text_config, with the top-level ``tie_word_embeddings`` (where transformers' composite configs keep
    it) folded in; the two disagreeing is refused rather than one silently winning."""
    if "tie_word_embeddings" not in raw:
        return text
    top = raw["tie_word_embeddings"]
    if type(top) is not bool:
        raise ValueError(f"field 'tie_word_embeddings' must be true or false, got {top!r}")
    inner = text.get("tie_word_embeddings", top)
    if inner != top:
        raise ValueError(f"config.json says tie_word_embeddings={str(top).lower()} at the top level but "
                         f"{json.dumps(inner)} in text_config: the two must agree")
    return dict(text, tie_word_embeddings=top)


def _ffn_fields(raw: dict) -> dict:
    """first_k_dense_replace / moe_layer_freq, from transformers' per-layer ``mlp_layer_types`` when written."""
    k, f = raw.get("first_k_dense_replace"), raw.get("moe_layer_freq")
    if raw.get("mlp_layer_types") is None:
        return dict(first_k_dense_replace=int(k or 0), moe_layer_freq=int(f or 1))
    experts = int(_get(raw, "n_routed_experts", "num_experts", "num_local_experts", default=0))
    k, f = ffn_rule(raw["mlp_layer_types"], int(raw["num_hidden_layers"]), experts,
                    None if k is None else int(k), None if f is None else int(f))
    return dict(first_k_dense_replace=k, moe_layer_freq=f)


def _moe_fields(raw: dict) -> dict:
    return dict(
        n_routed_experts=int(_get(raw, "n_routed_experts", "num_experts", "num_local_experts", default=0)),
        num_experts_per_tok=int(_get(raw, "num_experts_per_tok", "num_experts_per_token", default=0)),
        moe_intermediate_size=int(_get(raw, "moe_intermediate_size", default=0)),
        n_shared_experts=int(_get(raw, "n_shared_experts", "num_shared_experts", default=0)),
        norm_topk_prob=bool(_get(raw, "norm_topk_prob", "moe_renormalize", default=True)),
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
        n_group=int(_get(raw, "n_group", "num_expert_group", default=1)),
        topk_group=int(_get(raw, "topk_group", default=1)),
        **_ffn_fields(raw),
    )


def _common(raw: dict) -> dict:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "situ"):
        raise ValueError(f"unsupported hidden_act {act!r} (supported: 'silu', 'situ')")
    router = _get(raw, "moe_router_activation_func", "scoring_func", default="sigmoid")
    if router != "sigmoid":
        raise ValueError(f"unsupported router scoring function {router!r} (supported: 'sigmoid')")
    return dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        hidden_act=act,
        situ_beta=float(_get(raw, "activation_situ_beta", default=4.0)),
        situ_linear_beta=raw.get("activation_situ_linear_beta"),
        intermediate_size=int(_get(raw, "intermediate_size", default=0)),
        num_attention_heads=int(_get(raw, "num_attention_heads", default=0)),
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(_get(raw, "kv_lora_rank", default=0)),
        qk_nope_head_dim=int(_get(raw, "qk_nope_head_dim", default=0)),
        qk_rope_head_dim=int(_get(raw, "qk_rope_head_dim", default=0)),
        v_head_dim=int(_get(raw, "v_head_dim", default=0)),
        max_position_embeddings=int(_get(raw, "max_position_embeddings", "model_max_length", default=4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        eos_token_id=raw.get("eos_token_id") if isinstance(raw.get("eos_token_id"), int) else None,
        pad_token_id=raw.get("pad_token_id") if isinstance(raw.get("pad_token_id"), int) else None,
        **_moe_fields(raw),
    )


def _check_heads(raw: dict) -> None:
    kvh = raw.get("num_key_value_heads")
    if kvh is not None and kvh != raw.get("num_attention_heads"):
        raise ValueError(
            f"inconsistent config: num_key_value_heads={kvh} != num_attention_heads={raw.get('num_attention_heads')} "
            "(MLA has no grouped-query heads)"
        )


def _deepseek_family(raw: dict, family: str, name: str) -> ModelConfig:
    _check_heads(raw)
    rp = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(_get(rp, "rope_theta", default=_get(raw, "rope_theta", default=10000.0)))
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in ("default", "yarn"):
        raise ValueError(f"unsupported rope type {rtype!r} (supported: default, yarn)")
    scaling = None
    if rtype == "yarn":
        scaling = {k: rp[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                      "mscale", "mscale_all_dim", "attention_factor", "truncate") if k in rp}
        if "original_max_position_embeddings" not in scaling:
            raise ValueError("yarn rope parameters need 'original_max_position_embeddings'")
    return ModelConfig(
        family=family,
        name=name,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        mla_use_nope=False,
        **_common(raw),
    )


def _kimi_linear_family(raw: dict, family: str, name: str) -> ModelConfig:
    _check_heads(raw)
    n = int(raw["num_hidden_layers"])
    lac = raw.get("linear_attn_config") or {}
    if "kda_layers" in lac or "full_attn_layers" in lac:
        kda1, full1 = list(lac.get("kda_layers", [])), list(lac.get("full_attn_layers", []))
        for lst, what in ((kda1, "kda_layers"), (full1, "full_attn_layers")):
            bad = [i for i in lst if not (1 <= int(i) <= n)]
            if bad:
                raise ValueError(f"inconsistent config: linear_attn_config.{what} entries {bad} outside 1..{n} "
                                 "(these lists are 1-based)")
        if set(kda1) & set(full1):
            raise ValueError(f"inconsistent config: layers {sorted(set(kda1) & set(full1))} are both KDA and MLA")
        if set(kda1) | set(full1) != set(range(1, n + 1)):
            missing = sorted(set(range(1, n + 1)) - set(kda1) - set(full1))
            raise ValueError(f"inconsistent config: layers {missing} (1-based) are neither KDA nor MLA")
        kda = tuple(int(i) - 1 for i in kda1)
        if raw.get("layer_types") is not None:
            kda_from_layer_types(raw["layer_types"], n, kda)
    elif raw.get("layer_types") is not None:
        kda = kda_from_layer_types(raw["layer_types"], n, None)
    else:
        kda = ()
    full_rank = bool(lac.get("use_full_rank_gate", False))
    return ModelConfig(
        family=family,
        name=name,
        mla_use_nope=bool(raw.get("mla_use_nope", True)),
        mla_use_output_gate=bool(raw.get("mla_use_output_gate", False)),
        kda_layers=kda,
        kda_num_heads=int(_get(lac, "num_heads", default=_get(raw, "linear_num_heads", default=0))),
        kda_head_dim=int(_get(lac, "head_dim", default=_get(raw, "linear_head_dim", default=0))),
        kda_conv_size=int(_get(lac, "short_conv_kernel_size", default=_get(raw, "linear_conv_kernel_dim",
                                                                          default=4))),
        kda_gate_lower_bound=lac.get("gate_lower_bound"),
        kda_full_rank_gate=full_rank,
        moe_latent_size=raw.get("routed_expert_hidden_size"),
        moe_latent_norm=bool(raw.get("latent_moe_use_norm", False)),
        attn_res_block_size=raw.get("attn_res_block_size"),
        **_common(raw),
    )


@escaped_errors
def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    from kimik3.model.safetensors_reader import read_json_file  # (the untrusted-file rules: regular file, size, JSON)

    raw = read_json_file(p, "config")
    try:
        return config_from_hf(raw, name=p.parent.name)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None


# ---------------------------------------------------------------------- K3-format config.json writer


def to_hf_dict(cfg: ModelConfig) -> dict:
    """The Hugging Face ``config.json`` for ``cfg`` (the K3 release layout for kimi_k3)."""
    if cfg.rank_slice:
        raise ValueError(f"config {cfg.name!r} is one rank's slice {cfg.rank_slice} of a deployment, not a model a "
                         "checkpoint holds: write the whole model's config (cfg.whole())")
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        first_k_dense_replace=cfg.first_k_dense_replace, moe_layer_freq=cfg.moe_layer_freq,
        moe_intermediate_size=cfg.moe_intermediate_size, routed_scaling_factor=cfg.routed_scaling_factor,
        topk_group=cfg.topk_group, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )
    if cfg.family in ("deepseek_v3", "kimi_k2"):
        d = dict(common, model_type=cfg.family, architectures=["DeepseekV3ForCausalLM"],
                 n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 n_shared_experts=cfg.n_shared_experts, norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group,
                 rope_interleave=cfg.rope_interleave, rope_theta=cfg.rope_theta, scoring_func="sigmoid",
                 topk_method="noaux_tc")
        if cfg.rope_scaling:
            d["rope_scaling"] = dict(cfg.rope_scaling, type="yarn", rope_type="yarn")
        return d
    lac = dict(num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim, short_conv_kernel_size=cfg.kda_conv_size,
               kda_layers=[i + 1 for i in cfg.kda_layers], full_attn_layers=[i + 1 for i in cfg.mla_layers])
    if cfg.kda_gate_lower_bound is not None:
        lac["gate_lower_bound"] = cfg.kda_gate_lower_bound
    if cfg.kda_full_rank_gate:
        lac["use_full_rank_gate"] = True
    text = dict(common, model_type="kimi_linear", num_experts=cfg.n_routed_experts,
                num_experts_per_token=cfg.num_experts_per_tok, num_shared_experts=cfg.n_shared_experts,
                moe_renormalize=cfg.norm_topk_prob, num_expert_group=cfg.n_group, moe_router_activation_func="sigmoid",
                mla_use_nope=cfg.mla_use_nope, mla_use_output_gate=cfg.mla_use_output_gate, linear_attn_config=lac,
                use_grouped_topk=True, topk_method="noaux_tc")
    if cfg.hidden_act == "situ":
        text.update(activation_situ_beta=cfg.situ_beta, activation_situ_linear_beta=cfg.situ_linear_beta)
    if cfg.moe_latent_size is not None:
        text.update(routed_expert_hidden_size=cfg.moe_latent_size, latent_moe_use_norm=cfg.moe_latent_norm)
    if cfg.attn_res_block_size is not None:
        text["attn_res_block_size"] = cfg.attn_res_block_size
    if cfg.family == "kimi_linear":
        return dict(text, architectures=["KimiLinearForCausalLM"])
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
            "tie_word_embeddings": cfg.tie_word_embeddings}


# ---------------------------------------------------------------------- presets


def _k3_mla_pattern(n_layers: int) -> tuple[int, ...]:
    """K3's layer map scaled: MLA at l % 4 == 3, and the last layer MLA too (spec §1.1). Returns KDA layers."""
    mla = {i for i in range(n_layers) if i % 4 == 3} | {n_layers - 1}
    return tuple(i for i in range(n_layers) if i not in mla)


_K3_BASE = dict(
    family="kimi_k3", rms_norm_eps=1e-5, hidden_act="situ", situ_beta=4.0, situ_linear_beta=25.0,
    mla_use_nope=True, mla_use_output_gate=True, kda_conv_size=4, kda_gate_lower_bound=-5.0,
    kda_full_rank_gate=True, moe_latent_norm=True, norm_topk_prob=True, routed_scaling_factor=1.0,
    n_group=1, topk_group=1, moe_layer_freq=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def _kimi_k3() -> ModelConfig:
    return ModelConfig(
        name="kimi-k3", **dict(_K3_BASE, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839),
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, intermediate_size=33792, first_k_dense_replace=1,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=1048576,
        kda_layers=_k3_mla_pattern(93), kda_num_heads=96, kda_head_dim=128,
        n_routed_experts=896, num_experts_per_tok=16, moe_intermediate_size=3072, n_shared_experts=2,
        moe_latent_size=3584, attn_res_block_size=12,
    )


def _k3_small(name: str, hidden: int, layers: int, vocab: int, block: int, heads: int, head_dim: int,
              experts: int, topk: int, latent: int, expert_width: int, dense: int, q_lora: int, kv_lora: int,
              rope: int) -> ModelConfig:
    return ModelConfig(
        name=name, **_K3_BASE,
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=dense,
        first_k_dense_replace=1, num_attention_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
        qk_nope_head_dim=head_dim, qk_rope_head_dim=rope, v_head_dim=head_dim, max_position_embeddings=4096,
        kda_layers=_k3_mla_pattern(layers), kda_num_heads=heads, kda_head_dim=head_dim,
        n_routed_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=expert_width, n_shared_experts=2,
        moe_latent_size=latent, attn_res_block_size=block,
    )


def _micro() -> ModelConfig:
    # 8 layers: KDA x3, MLA, KDA x3, MLA; AttnRes blocks of 4 -> two blocks; < 5M parameters.
    return _k3_small("micro", hidden=64, layers=8, vocab=512, block=4, heads=4, head_dim=16, experts=16, topk=4,
                     latent=32, expert_width=32, dense=128, q_lora=32, kv_lora=32, rope=8)


def _tiny() -> ModelConfig:
    # 12 layers (MLA at 3, 7, 11), AttnRes blocks of 4 -> three blocks; ~80M parameters.
    return _k3_small("tiny", hidden=384, layers=12, vocab=16384, block=4, heads=6, head_dim=64, experts=32, topk=4,
                     latent=192, expert_width=256, dense=1536, q_lora=192, kv_lora=128, rope=32)


def _k3_deep_tiny() -> ModelConfig:
    # K3's full 93-layer pattern and block size 12 at tiny widths (validation.md).
    t = _tiny()
    return t.replace(name="k3-deep-tiny", num_hidden_layers=93, kda_layers=_k3_mla_pattern(93),
                     attn_res_block_size=12)


def _k3_shard() -> ModelConfig:
    # validation.md: true K3 widths, 4 layers (KDA, KDA, KDA, MLA), all LatentMoE with 56 experts, top-16.
    k3 = _kimi_k3()
    return k3.replace(name="k3-shard", num_hidden_layers=4, kda_layers=(0, 1, 2), first_k_dense_replace=0,
                      n_routed_experts=56, attn_res_block_size=12)


# The rack the seeds serve K3 on (a GB300 NVL72) and the slice of it k3-rank is.
RACK_GPUS = 72


def _k3_rank() -> ModelConfig:
    # Rank 0 of full-depth K3 laid out tp-attention+ep-experts over the most ranks of the rack that split every
    # dimension evenly (32: 96 heads, 896 experts); docs/architecture.md#megakernel-across-ranks.
    from kimik3.model.rank_slice import even_worlds

    k3 = _kimi_k3()
    return k3.replace(name="k3-rank", rank_slice=(max(even_worlds(k3, RACK_GPUS)), 0))


def _tiny_rank() -> ModelConfig:
    # Rank 0 of tiny over 2 ranks: the slice whose kernel (MKConfig.ranks) runs every rank of the loopback check,
    # both ranks of a tiny deployment in one launch on one GPU (kimik3.megakernel.gpu_ranks)
    return _tiny().replace(name="tiny-rank", rank_slice=(2, 0))


def _deepseek_v3() -> ModelConfig:
    return ModelConfig(
        family="deepseek_v3", name="deepseek-v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
        rms_norm_eps=1e-6, hidden_act="silu", intermediate_size=18432, first_k_dense_replace=3,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling=dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                          mscale_all_dim=1.0),
        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, bos_token_id=0, eos_token_id=1,
    )


def _kimi_k2() -> ModelConfig:
    return _deepseek_v3().replace(
        family="kimi_k2", name="kimi-k2", vocab_size=163840, num_attention_heads=64, first_k_dense_replace=1,
        n_routed_experts=384, routed_scaling_factor=2.827, n_group=1, topk_group=1, rope_theta=50000.0,
        max_position_embeddings=131072,
        rope_scaling=dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=1, beta_slow=1, mscale=1.0,
                          mscale_all_dim=1.0),
        bos_token_id=163584, eos_token_id=163585,
    )


def _moonlight() -> ModelConfig:
    return ModelConfig(
        family="deepseek_v3", name="moonlight-16b-a3b", vocab_size=163840, hidden_size=2048, num_hidden_layers=27,
        rms_norm_eps=1e-5, hidden_act="silu", intermediate_size=11264, first_k_dense_replace=1,
        num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_theta=50000.0, max_position_embeddings=8192, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.446, n_group=1,
        topk_group=1, bos_token_id=163584, eos_token_id=163585,
    )


def _kimi_linear_48b() -> ModelConfig:
    n = 27
    full = {3, 7, 11, 15, 19, 23, 26}
    return ModelConfig(
        family="kimi_linear", name="kimi-linear-48b-a3b", vocab_size=163840, hidden_size=2304, num_hidden_layers=n,
        rms_norm_eps=1e-5, hidden_act="silu", intermediate_size=9216, first_k_dense_replace=1,
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_nope=True, max_position_embeddings=1048576,
        kda_layers=tuple(i for i in range(n) if i not in full), kda_num_heads=32, kda_head_dim=128, kda_conv_size=4,
        kda_gate_lower_bound=None, kda_full_rank_gate=False, n_routed_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=1024, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.446,
        n_group=1, topk_group=1, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )


PRESETS = {
    "micro": _micro,
    "tiny": _tiny,
    "k3-deep-tiny": _k3_deep_tiny,
    "k3-shard": _k3_shard,
    "k3-rank": _k3_rank,
    "tiny-rank": _tiny_rank,
    "kimi-k3": _kimi_k3,
    "kimi-k2": _kimi_k2,
    "deepseek-v3": _deepseek_v3,
    "kimi-linear-48b-a3b": _kimi_linear_48b,
    "moonlight-16b-a3b": _moonlight,
}
PRESET_NAMES = tuple(PRESETS)


def get_preset(name: str) -> ModelConfig:
    """The named preset's config. Unknown names raise ValueError listing the known ones."""
    if isinstance(name, ModelConfig):
        return name
    if not isinstance(name, str):
        raise ValueError(f"preset must be a preset name or a ModelConfig, got {name!r}; known presets: "
                         f"{', '.join(PRESET_NAMES)}")
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESET_NAMES)}") from None
