"""What one decode step costs: bytes moved and FLOPs, per layer and block, from the model's own shapes (§8).

Decode reads far more bytes than it does arithmetic per byte, so its speed limit is memory bandwidth; every later
stage is judged against this bound, so it must follow the model: weight byte counts are read from the parameters
of ``kimik3.build_model(cfg, "meta")`` (module names = checkpoint names), never from a hand-written table, and
every other size (state, cache, FLOPs) comes from the same :class:`~kimik3.model.config.ModelConfig`. Counting
rules (§8): a weight is read once per step however many sequences use it; routed experts count only when touched
(``D(B)`` per MoE layer, :func:`expected_distinct_experts`, or exact counts from a routing); KDA state and MLA
cache traffic are per sequence; FLOPs are 2 per multiply-add; activations are each block's input/output vectors.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from kimik3.model.config import ModelConfig, get_preset
from kimik3.model.modeling import KimiForCausalLM, keeps_fp32
from kimik3.model.random_init import build_model

__all__ = [
    "BLOCKS",
    "BYTES_PER_ELEMENT",
    "MLA_FORMS",
    "DecodeCost",
    "attn_res_mixes",
    "batch_size_for_bytes",
    "cache_bytes_per_sequence",
    "decode_cost",
    "expected_distinct_experts",
    "parameter_counts",
    "parameter_table",
]

# Storage cost per element. MXFP4 = 4-bit E2M1 codes + one 8-bit scale per 32 (§5.5); NVFP4 = 4-bit codes + one
# fp8 scale per 16. fp8 ignores block scales (1/16384 of a byte per weight for 128x128 blocks).
BYTES_PER_ELEMENT: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "mxfp4": 4.25 / 8,
    "nvfp4": 4.5 / 8,
}

# Block names in the order they run within a layer; "embed" before layer 0, the last three after the last layer.
BLOCKS = ("embed", "attn_res", "kda", "mla", "router", "moe_latent", "experts", "shared_experts", "dense_mlp",
          "final_norm", "lm_head")
_BLOCK_RANK = {b: i for i, b in enumerate(BLOCKS)}

# How MLA attends over its cache (§4.3, §4.4, §8.1 last paragraph):
#   absorbed - compressed cache (latent + shared key part), queries absorbed into the latent space;
#   naive    - expanded cache: per-head keys and values stored, read every step (nh·(qk+v) values/token);
#   reexpand - compressed cache re-expanded through kv_b_proj every step (the reference code path).
MLA_FORMS = ("absorbed", "naive", "reexpand")

# What ``routing=`` accepts: distinct experts per MoE layer (one int for all, or one per layer), or expert ids.
Routing = int | Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | np.ndarray | None

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SITU_FLOPS_PER_ELEMENT = 10  # tanh, sigmoid and the products of one SiTU/SwiGLU output element, roughly
_RMSNORM_FLOPS_PER_ELEMENT = 4  # square, sum, scale, weight


def _bytes(dtype: str) -> float:
    try:
        return BYTES_PER_ELEMENT[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(BYTES_PER_ELEMENT)}") from None


# ====================================================================== parameter inventory


@dataclass(frozen=True)
class _Param:
    name: str
    layer: int  # -1: before layer 0 (embedding); num_hidden_layers: after the last layer
    block: str
    shape: tuple[int, ...]
    numel: int
    fp32: bool  # stored in fp32 whatever the model dtype (kimik3.model.modeling.keeps_fp32)
    expert: bool  # stacked routed-expert tensor [E, ...]


def _classify(name: str, cfg: ModelConfig) -> tuple[int, str]:
    """(layer, block) of a parameter, by its checkpoint name. Unknown names fail loudly: a silently dropped
    tensor would make every bandwidth bound optimistic."""
    n_layers = cfg.num_hidden_layers
    if name == "model.embed_tokens.weight":
        return -1, "embed"
    if name == "lm_head.weight":
        return n_layers, "lm_head"
    if name == "model.norm.weight":
        return n_layers, "final_norm"
    if name.startswith("model.output_attn_res_"):
        return n_layers, "attn_res"
    m = _LAYER_RE.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if rest.startswith(("self_attn.", "input_layernorm.")):
            return layer, cfg.mixer(layer)
        if rest.startswith(("self_attention_res_", "mlp_res_")):
            return layer, "attn_res"
        if rest.startswith("post_attention_layernorm."):  # the norm feeding the FFN runs with its first block
            return layer, "router" if cfg.ffn(layer) == "moe" else "dense_mlp"
        if rest.startswith("mlp."):
            return layer, "dense_mlp"
        sub = rest.removeprefix("block_sparse_moe.")
        if sub != rest:
            for prefix, block in (("gate.", "router"), ("experts.", "experts"), ("shared_experts.", "shared_experts"),
                                  ("routed_expert_", "moe_latent")):
                if sub.startswith(prefix):
                    return layer, block
    raise ValueError(f"cost model: parameter {name!r} belongs to no known block; extend kimik3.perf.cost._classify")


def _inventory_of(model: KimiForCausalLM) -> tuple[_Param, ...]:
    cfg = model.config
    out = []
    for name, p in model.named_parameters():
        layer, block = _classify(name, cfg)
        out.append(_Param(name, layer, block, tuple(p.shape), p.numel(), keeps_fp32(name), block == "experts"))
    return tuple(out)


def _config_key(cfg: ModelConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True, default=str)


@functools.lru_cache(maxsize=32)
def _inventory_for_key(key: str) -> tuple[_Param, ...]:
    d = json.loads(key)  # the key is the config itself, so equal configs share one meta build
    d["kda_layers"] = tuple(d["kda_layers"])
    d["rank_slice"] = tuple(d["rank_slice"]) if d.get("rank_slice") else None
    return _inventory_of(build_model(ModelConfig(**d), "meta"))


def _resolve(model_or_preset_or_config: KimiForCausalLM | ModelConfig | str) -> tuple[ModelConfig, tuple[_Param, ...]]:
    """Config and parameter inventory. Presets and configs are built once on the meta device and cached."""
    x = model_or_preset_or_config
    if isinstance(x, KimiForCausalLM):
        return x.config, _inventory_of(x)
    if isinstance(x, str):
        x = get_preset(x)
    if not isinstance(x, ModelConfig):
        raise TypeError(f"expected a KimiForCausalLM, a ModelConfig or a preset name, got {type(x).__name__}")
    return x, _inventory_for_key(_config_key(x))


def parameter_table(model_or_preset_or_config: KimiForCausalLM | ModelConfig | str) -> pd.DataFrame:
    """One row per parameter tensor: name, layer, block, shape, numel, fp32, expert. The single source the cost
    model reads its weight sizes from; useful to see exactly what a block contains."""
    _, inv = _resolve(model_or_preset_or_config)
    return pd.DataFrame([p.__dict__ for p in inv])


def parameter_counts(model_or_preset_or_config: KimiForCausalLM | ModelConfig | str) -> dict[str, int]:
    """Parameter totals as quoted in spec §8.2: ``total``, ``embedding``, ``routed_experts`` and
    ``active_per_token`` (every non-expert parameter except the embedding table, including the lm_head, plus
    top-k routed experts in every MoE layer)."""
    cfg, inv = _resolve(model_or_preset_or_config)
    total = sum(p.numel for p in inv)
    embedding = sum(p.numel for p in inv if p.block == "embed")
    experts = sum(p.numel for p in inv if p.expert)
    active_experts = experts * cfg.num_experts_per_tok // cfg.n_routed_experts if cfg.n_routed_experts else 0
    return {"total": total, "embedding": embedding, "routed_experts": experts,
            "active_per_token": total - embedding - experts + active_experts}


# ====================================================================== experts touched


def expected_distinct_experts(num_experts: int, top_k: int, batch_size: int | np.ndarray) -> float | np.ndarray:
    """Expected number of distinct experts one MoE layer reads when ``batch_size`` tokens each pick ``top_k`` of
    ``num_experts`` uniformly at random: D(B) = E·(1 − (1 − k/E)^B) (spec §8).

    Why it matters: expert weights are read once per step per distinct expert, so D(B), not B·k, sets the routed
    expert bytes; D(1) = k, and D(B) → E as the batch grows (every expert read every step)."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"need 0 < top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    b = np.asarray(batch_size, dtype=float)
    if np.any(b < 0):
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    d = num_experts * (1.0 - (1.0 - top_k / num_experts) ** b)
    return float(d) if d.ndim == 0 else d


def _distinct_per_layer(cfg: ModelConfig, batch: int, routing: Routing) -> list[float]:
    """Distinct experts per MoE layer: expected under uniform routing, or exact for a given routing. A rank slice
    counts the experts it holds: the given ids in its share, else its share of the expected or given counts."""
    moe, E, k = cfg.moe_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
    if not moe:
        return []
    lo, hi = cfg.share("experts")
    frac = (hi - lo) / E
    if routing is None:
        return [expected_distinct_experts(E, k, batch) * frac] * len(moe)
    if isinstance(routing, (int, np.integer)) and not isinstance(routing, bool):
        counts = [int(routing)] * len(moe)
    elif isinstance(routing, (torch.Tensor, np.ndarray)) or (
            isinstance(routing, Sequence) and routing and isinstance(routing[0], Sequence)):
        ids = torch.as_tensor(np.asarray(routing) if not isinstance(routing, torch.Tensor) else routing)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"routing must hold integer expert ids, got dtype {ids.dtype}")
        if ids.dim() == 1:  # one distinct-expert count per MoE layer
            return _distinct_per_layer(cfg, batch, [int(c) for c in ids.tolist()])
        if ids.dim() == 2:
            ids = ids.unsqueeze(0).expand(len(moe), *ids.shape)
        if ids.dim() != 3 or ids.shape[0] != len(moe):
            raise ValueError(f"routing ids must be [B, k] or [{len(moe)} MoE layers, B, k], got {tuple(ids.shape)}")
        if ids.shape[1] != batch or ids.shape[2] != k:
            raise ValueError(f"routing ids have shape [.., {ids.shape[1]}, {ids.shape[2]}]; expected "
                             f"[.., batch_size={batch}, top_k={k}]")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
            raise ValueError(f"routing ids must lie in 0..{E - 1}, got {int(ids.min())}..{int(ids.max())}")
        held = [torch.unique(layer_ids) for layer_ids in ids]
        return [float(((u >= lo) & (u < hi)).sum()) for u in held]
    elif isinstance(routing, Sequence):
        counts = [int(c) for c in routing]
        if len(counts) != len(moe):
            raise ValueError(f"per-layer expert counts: need {len(moe)} (one per MoE layer), got {len(counts)}")
    else:
        raise TypeError(f"routing must be None, an int, per-layer counts or an int tensor of ids, got "
                        f"{type(routing).__name__}")
    for c in counts:
        if not 0 <= c <= E or c > batch * k:
            raise ValueError(f"distinct experts per layer must lie in 0..min(E={E}, B·k={batch * k}), got {c}")
    return [float(c) * frac for c in counts]


# ====================================================================== AttnRes mixes


def attn_res_mixes(cfg: ModelConfig) -> list[tuple[int, str, int]]:
    """Every AttnRes mix of one token's step as (layer, site, candidates) (spec §2.3): the attention site of
    layer ℓ ≥ 1 mixes the slots frozen at boundaries < ℓ plus the partial sum; the MLP site also sees the slot
    frozen at ℓ itself; the model output mixes all slots plus the final partial sum (site "output", layer = L).
    Empty for additive-residual models."""
    bs, L = cfg.attn_res_block_size, cfg.num_hidden_layers
    if not bs:
        return []
    mixes = []
    for layer in range(L):
        slots_before = -(-layer // bs)  # boundaries b = 0, bs, 2bs, ... with b < layer
        if slots_before:
            mixes.append((layer, "attention", slots_before + 1))
        mixes.append((layer, "mlp", layer // bs + 1 + 1))  # boundaries b <= layer, plus the partial sum
    mixes.append((L, "output", cfg.attn_res_slots + 1))
    return mixes


# ====================================================================== caches


def _kda_state_bytes(cfg: ModelConfig, state_dtype: str, act_dtype: str) -> tuple[int, int]:
    """Per sequence per KDA layer: (recurrent S, conv history) bytes (§3.4)."""
    nh = cfg.held("kda_heads")  # a rank slice keeps its heads' state (the MLA latent cache is held whole)
    s = nh * cfg.kda_head_dim * cfg.kda_head_dim * _bytes(state_dtype)
    conv = 3 * nh * cfg.kda_head_dim * (cfg.kda_conv_size - 1) * _bytes(act_dtype)
    return int(s), int(conv)


def _mla_entry_bytes(cfg: ModelConfig, kv_dtype: str, mla_form: str) -> float:
    """Cache bytes per token per MLA layer: latent + shared key part (§4.3), or expanded per-head K and V."""
    if mla_form == "naive":
        return cfg.held("mla_heads") * (cfg.qk_head_dim + cfg.v_head_dim) * _bytes(kv_dtype)
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * _bytes(kv_dtype)


def cache_bytes_per_sequence(model_or_preset_or_config: KimiForCausalLM | ModelConfig | str, context_len: int,
                             kv_dtype: str = "bf16", state_dtype: str = "fp32", act_dtype: str = "bf16",
                             mla_form: str = "absorbed") -> int:
    """Decode-state memory one sequence holds after ``context_len`` tokens: the fixed KDA state (recurrent S +
    conv history per KDA layer) plus the MLA cache growing per token. Why: it decides how many sequences fit
    next to the weights, and whether a hybrid (K3) or pure-MLA (K2) cache is smaller at a given context."""
    cfg, _ = _resolve(model_or_preset_or_config)
    _check_form(mla_form)
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    s, conv = _kda_state_bytes(cfg, state_dtype, act_dtype) if cfg.kda_layers else (0, 0)
    entry = _mla_entry_bytes(cfg, kv_dtype, mla_form) if cfg.mla_layers else 0
    return int(len(cfg.kda_layers) * (s + conv) + len(cfg.mla_layers) * context_len * entry)


def _check_form(mla_form: str) -> None:
    if mla_form not in MLA_FORMS:
        raise ValueError(f"mla_form must be one of {MLA_FORMS}, got {mla_form!r}")


# ====================================================================== the cost of one step

_COLUMNS = ["layer", "block", "weight_bytes", "state_bytes_read", "state_bytes_written", "kv_bytes_read",
            "kv_bytes_written", "activation_bytes", "flops", "flops_weights", "flops_state", "flops_elementwise",
            "params", "experts_touched"]
_BYTE_COLUMNS = ["weight_bytes", "state_bytes_read", "state_bytes_written", "kv_bytes_read", "kv_bytes_written",
                 "activation_bytes"]


@dataclass(frozen=True, eq=False)
class DecodeCost:
    """Bytes and FLOPs of one decode step (``batch_size`` sequences, one new token each), per (layer, block).

    ``by_block`` columns: ``layer`` (-1 = embedding, ``num_hidden_layers`` = after the last layer), ``block``,
    ``weight_bytes`` (read once per step), ``state_bytes_read/written`` (KDA S + conv history),
    ``kv_bytes_read/written`` (MLA cache), ``activation_bytes`` (block input/output vectors), ``flops`` =
    ``flops_weights`` (2 × multiply-adds against weights, incl. conv and the absorbed W_UK/W_UV) +
    ``flops_state`` (KDA recurrence, attention over the cache) + ``flops_elementwise`` (norms, activations,
    softmax, gates: approximate, < 0.1 % of the total), ``params`` (stored parameters, every expert) and
    ``experts_touched`` (distinct experts read, on "experts" rows).
    """

    config: ModelConfig
    batch_size: int
    context_lens: tuple[int, ...]
    weight_dtype: str
    expert_dtype: str
    kv_dtype: str
    state_dtype: str
    act_dtype: str
    mla_form: str
    by_block: pd.DataFrame

    # -- totals
    @property
    def weight_bytes(self) -> float:
        return float(self.by_block["weight_bytes"].sum())

    @property
    def routed_expert_bytes(self) -> float:
        return float(self.by_block.loc[self.by_block["block"] == "experts", "weight_bytes"].sum())

    @property
    def state_bytes(self) -> float:
        """KDA recurrent state + conv history traffic, read + written."""
        return float(self.by_block[["state_bytes_read", "state_bytes_written"]].to_numpy().sum())

    @property
    def kv_bytes(self) -> float:
        """MLA cache traffic, read + written."""
        return float(self.by_block[["kv_bytes_read", "kv_bytes_written"]].to_numpy().sum())

    @property
    def activation_bytes(self) -> float:
        return float(self.by_block["activation_bytes"].sum())

    @property
    def total_bytes(self) -> float:
        """Every byte the step moves to or from memory (weights + state + cache + activations)."""
        return float(self.by_block[_BYTE_COLUMNS].to_numpy().sum())

    @property
    def total_flops(self) -> float:
        return float(self.by_block["flops"].sum())

    @property
    def bytes_per_token(self) -> float:
        return self.total_bytes / self.batch_size

    @property
    def flops_per_token(self) -> float:
        return self.total_flops / self.batch_size

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved: compare with a chip's ridge point (peak FLOP/s ÷ bandwidth) to see which bound
        applies; decode at small batch sits far below every ridge point."""
        return self.total_flops / self.total_bytes

    @property
    def resident_weight_bytes(self) -> float:
        """Bytes the weights occupy in memory (every expert), at the chosen storage dtypes."""
        return float(self.by_block.attrs["resident_weight_bytes"])

    @property
    def cache_bytes(self) -> float:
        """Decode state held by the whole batch at this context (KDA state + MLA cache)."""
        return float(sum(cache_bytes_per_sequence(self.config, t, self.kv_dtype, self.state_dtype, self.act_dtype,
                                                  self.mla_form) for t in self.context_lens))

    def lower_bound_seconds(self, bandwidth_bytes_per_s: float, peak_flops_per_s: float) -> float:
        """Roofline lower bound for the step: max(bytes / bandwidth, FLOPs / peak)."""
        return max(self.total_bytes / bandwidth_bytes_per_s, self.total_flops / peak_flops_per_s)

    def by_kind(self) -> pd.DataFrame:
        """``by_block`` summed over layers, one row per block kind, in execution order."""
        num = [c for c in _COLUMNS if c not in ("layer", "block")]
        g = self.by_block.groupby("block", sort=False)[num].sum()
        g["layers"] = self.by_block.groupby("block", sort=False)["layer"].nunique()
        g = g.loc[sorted(g.index, key=_BLOCK_RANK.__getitem__)]
        g["total_bytes"] = g[_BYTE_COLUMNS].sum(axis=1)
        return g

    def summary(self) -> pd.DataFrame:
        """Per block kind: GB of weights / state / cache, GFLOP, share of the step's bytes and arithmetic
        intensity, plus a ``total`` row. The table to read first."""
        k = self.by_kind()
        s = pd.DataFrame({
            "layers": k["layers"],
            "weights_GB": k["weight_bytes"] / 1e9,
            "state_GB": (k["state_bytes_read"] + k["state_bytes_written"]) / 1e9,
            "kv_GB": (k["kv_bytes_read"] + k["kv_bytes_written"]) / 1e9,
            "activations_GB": k["activation_bytes"] / 1e9,
            "total_GB": k["total_bytes"] / 1e9,
            "GFLOP": k["flops"] / 1e9,
        })
        s.loc["total"] = s.sum()
        s.loc["total", "layers"] = self.config.num_hidden_layers
        s["bytes_share"] = s["total_GB"] / s.loc["total", "total_GB"]
        s["flop_per_byte"] = s["GFLOP"] / s["total_GB"].where(s["total_GB"] > 0)
        return s

    def totals(self) -> dict[str, float]:
        """The headline numbers as a flat dict (handy for tables and tests)."""
        return {"weight_bytes": self.weight_bytes, "routed_expert_bytes": self.routed_expert_bytes,
                "state_bytes": self.state_bytes, "kv_bytes": self.kv_bytes,
                "activation_bytes": self.activation_bytes, "total_bytes": self.total_bytes,
                "total_flops": self.total_flops, "bytes_per_token": self.bytes_per_token,
                "flops_per_token": self.flops_per_token, "arithmetic_intensity": self.arithmetic_intensity}

    def __repr__(self) -> str:
        ctx = self.context_lens[0] if len(set(self.context_lens)) == 1 else f"{min(self.context_lens)}.." \
            f"{max(self.context_lens)}"
        return (f"DecodeCost({self.config.name or self.config.family}, B={self.batch_size}, T={ctx}, "
                f"experts={self.expert_dtype}: {self.total_bytes / 1e9:.2f} GB "
                f"(weights {self.weight_bytes / 1e9:.2f}), {self.total_flops / 1e9:.1f} GFLOP, "
                f"{self.arithmetic_intensity:.2f} FLOP/B)")


def _context_lens(context_len: int | Sequence[int], batch: int) -> tuple[int, ...]:
    if isinstance(context_len, (int, np.integer)) and not isinstance(context_len, bool):
        lens = (int(context_len),) * batch
    else:
        lens = tuple(int(t) for t in context_len)
        if len(lens) != batch:
            raise ValueError(f"context_len lists {len(lens)} sequences but batch_size is {batch}")
    if any(t < 0 for t in lens):
        raise ValueError(f"context lengths must be >= 0 (tokens cached incl. the new one), got {lens}")
    return lens


def decode_cost(model_or_preset_or_config: KimiForCausalLM | ModelConfig | str, batch_size: int = 1,
                context_len: int | Sequence[int] = 4096, weight_dtype: str = "bf16", expert_dtype: str = "bf16",
                kv_dtype: str = "bf16", routing: Routing = None, *, state_dtype: str = "fp32", act_dtype: str = "bf16",
                mla_form: str = "absorbed") -> DecodeCost:
    """Bytes and FLOPs of one decode step, per (layer, block).

    Args:
        model_or_preset_or_config: a model (its parameter shapes are used), a ModelConfig or a preset name
            (built once on the meta device and cached).
        batch_size: sequences in the step, one new token each.
        context_len: tokens cached per sequence *including* the new one (``T_b``, §0); one int for all or a
            list with one entry per sequence. 0 is the T → 0 limit (no cache read).
        weight_dtype / expert_dtype: storage of dense weights / routed experts ("bf16", "fp8", "mxfp4", ...);
            parameters the spec keeps in fp32 (``keeps_fp32``) always count 4 bytes.
        kv_dtype: MLA cache storage. state_dtype: KDA recurrent state (fp32 in the reference, §3.4).
        act_dtype: activations and KDA conv history.
        routing: None (uniform routing: D(B) expected distinct experts per layer), an int (that many distinct
            experts in every MoE layer), one count per MoE layer (a list or 1-D tensor), or integer expert ids
            ``[B, k]`` (same for every MoE layer) or ``[MoE layers, B, k]`` (exact distinct counts).
        mla_form: "absorbed" (compressed cache, §4.4), "naive" (expanded per-head cache) or "reexpand"
            (compressed cache re-expanded every step); see ``MLA_FORMS``.
    """
    cfg, inv = _resolve(model_or_preset_or_config)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_form(mla_form)
    for d in (weight_dtype, expert_dtype, kv_dtype, state_dtype, act_dtype):
        _bytes(d)
    B = batch_size
    lens = _context_lens(context_len, B)
    sum_t = sum(lens)
    w_b, e_b, a_b = _bytes(weight_dtype), _bytes(expert_dtype), _bytes(act_dtype)
    H, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    held_experts = cfg.held("experts") or E
    distinct = dict(zip(cfg.moe_layers, _distinct_per_layer(cfg, B, routing)))

    # group the inventory by (layer, block)
    groups: dict[tuple[int, str], list[_Param]] = {}
    for p in inv:
        groups.setdefault((p.layer, p.block), []).append(p)
    resident = sum(p.numel * (4.0 if p.fp32 else e_b if p.expert else w_b) for p in inv)

    mixes_per_layer: dict[int, list[int]] = {}
    for layer, _, cands in attn_res_mixes(cfg):
        mixes_per_layer.setdefault(layer, []).append(cands)

    kda_s, kda_conv = _kda_state_bytes(cfg, state_dtype, act_dtype) if cfg.kda_layers else (0, 0)
    mla_entry = _mla_entry_bytes(cfg, kv_dtype, mla_form) if cfg.mla_layers else 0.0

    rows = []
    for (layer, block), params in groups.items():
        dense = [p for p in params if not p.expert]
        numel = sum(p.numel for p in params)
        r = dict(layer=layer, block=block, weight_bytes=0.0, state_bytes_read=0.0, state_bytes_written=0.0,
                 kv_bytes_read=0.0, kv_bytes_written=0.0, activation_bytes=0.0, flops_weights=0.0,
                 flops_state=0.0, flops_elementwise=0.0, params=numel, experts_touched=0.0)
        # weights read once per step; matrix and conv weights cost one multiply-add per element per token
        r["weight_bytes"] = sum(p.numel * (4.0 if p.fp32 else w_b) for p in dense)
        matrix_numel = sum(p.numel for p in dense if len(p.shape) >= 2)
        r["flops_weights"] = 2.0 * matrix_numel * B

        if block == "embed":  # a row gather, not a matmul
            r["weight_bytes"] = B * H * w_b
            r["flops_weights"] = 0.0
            r["activation_bytes"] = B * H * a_b
        elif block == "attn_res":
            cands = mixes_per_layer.get(layer, [])
            r["flops_weights"] = 0.0  # the [1, H] projections enter the per-candidate score below
            r["flops_elementwise"] = B * sum(6.0 * H * c + 5.0 * c for c in cands)  # sumsq, score, mix
            r["activation_bytes"] = B * sum((c + 1) * H * a_b for c in cands)
        elif block == "kda":
            nh, dk = cfg.held("kda_heads"), cfg.kda_head_dim
            P = nh * dk
            r["state_bytes_read"] = r["state_bytes_written"] = B * (kda_s + kda_conv)
            # gated delta rule per head: decay dk·dv, predict 2·dk·dv, rank-1 update 2·dk·dv, read 2·dk·dv (§3.2)
            r["flops_state"] = B * (7.0 * nh * dk * dk + 2.0 * nh * dk)
            # input norm, SiLU on the conv outputs, q/k l2norm, decay gate, beta, gated output norm
            r["flops_elementwise"] = B * (_RMSNORM_FLOPS_PER_ELEMENT * H + 12.0 * P + 6.0 * P + 5.0 * P
                                          + 4.0 * nh + 7.0 * P)
            r["activation_bytes"] = B * 2 * H * a_b
        elif block == "mla":
            nh, lat, rope = cfg.held("mla_heads"), cfg.kv_lora_rank, cfg.qk_rope_head_dim
            nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
            r["kv_bytes_read"] = sum_t * mla_entry
            r["kv_bytes_written"] = B * mla_entry
            if mla_form == "absorbed":  # MQA over [c; k_r] of width lat+rope, values c of width lat (§4.4)
                per_ctx = 2.0 * nh * ((lat + rope) + lat)
            else:  # per-head keys (nope+rope) and values (v)
                per_ctx = 2.0 * nh * ((nope + rope) + v)
                if mla_form == "reexpand":  # every cached latent through kv_b_proj again
                    per_ctx += 2.0 * lat * nh * (nope + v)
            r["flops_state"] = per_ctx * sum_t
            norms = H + (cfg.q_lora_rank or 0) + lat
            gate = 5.0 * nh * v if cfg.mla_use_output_gate else 0.0
            r["flops_elementwise"] = B * (_RMSNORM_FLOPS_PER_ELEMENT * norms + gate) + 5.0 * nh * sum_t  # softmax
            r["activation_bytes"] = B * 2 * H * a_b
        elif block == "router":
            r["flops_elementwise"] = B * (_RMSNORM_FLOPS_PER_ELEMENT * H + 6.0 * E + 3.0 * k)
            r["activation_bytes"] = B * (H * a_b + k * 8)  # fp32 weight + int32 id per choice
        elif block == "moe_latent":
            lat = cfg.moe_latent_size or 0
            r["flops_elementwise"] = B * (_RMSNORM_FLOPS_PER_ELEMENT * lat if cfg.moe_latent_norm else 0.0)
            r["activation_bytes"] = B * 2 * (H + lat) * a_b
        elif block == "experts":
            per_expert = sum(p.numel for p in params) / held_experts
            d = distinct[layer]
            r["experts_touched"] = d
            r["weight_bytes"] += d * per_expert * e_b
            # B·k (token, expert) pairs however they overlap; a rank slice expects its share of them
            pairs = B * k * held_experts / E
            r["flops_weights"] = 2.0 * per_expert * pairs
            D = cfg.expert_in_dim
            r["flops_elementwise"] = pairs * (_SITU_FLOPS_PER_ELEMENT * cfg.moe_intermediate_size + 2.0 * D)
            r["activation_bytes"] = pairs * 2 * D * a_b
        elif block == "shared_experts":
            r["flops_elementwise"] = B * (_SITU_FLOPS_PER_ELEMENT * cfg.held("shared") + H)
            r["activation_bytes"] = B * 2 * H * a_b
        elif block == "dense_mlp":
            r["flops_elementwise"] = B * (_SITU_FLOPS_PER_ELEMENT * cfg.held("dense")
                                          + _RMSNORM_FLOPS_PER_ELEMENT * H)
            r["activation_bytes"] = B * 2 * H * a_b
        elif block == "final_norm":
            r["flops_elementwise"] = B * _RMSNORM_FLOPS_PER_ELEMENT * H
            r["activation_bytes"] = B * 2 * H * a_b
        elif block == "lm_head":
            r["activation_bytes"] = B * (H * a_b + cfg.held("vocab") * 4)  # fp32 logits out
        rows.append(r)

    df = pd.DataFrame(rows)
    df["flops"] = df["flops_weights"] + df["flops_state"] + df["flops_elementwise"]
    df["_rank"] = df["block"].map(_BLOCK_RANK)
    df = df.sort_values(["layer", "_rank"], kind="stable").drop(columns="_rank").reset_index(drop=True)
    df = df[_COLUMNS]
    df.attrs["resident_weight_bytes"] = resident
    return DecodeCost(config=cfg, batch_size=B, context_lens=lens, weight_dtype=weight_dtype,
                      expert_dtype=expert_dtype, kv_dtype=kv_dtype, state_dtype=state_dtype, act_dtype=act_dtype,
                      mla_form=mla_form, by_block=df)


def batch_size_for_bytes(model_or_preset_or_config: KimiForCausalLM | ModelConfig | str, target_bytes: float,
                         context_len: int = 4096, max_batch: int = 1 << 16, **cost_kwargs) -> int | None:
    """Smallest batch size whose decode step moves at least ``target_bytes`` (weights + state + cache +
    activations), or None if even ``max_batch`` does not. Why: a claim like "1.5 TB of HBM traffic per forward
    pass" only holds at some batch size; this finds which. Bytes grow monotonically with the batch, so bisect."""
    def total(b: int) -> float:
        return decode_cost(model_or_preset_or_config, b, context_len, **cost_kwargs).total_bytes

    if total(1) >= target_bytes:
        return 1
    if total(max_batch) < target_bytes:
        return None
    lo, hi = 1, max_batch  # total(lo) < target <= total(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if total(mid) >= target_bytes else (mid, hi)
    return hi
