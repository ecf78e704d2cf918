"""Types and ranges of config values, and dtype arguments: refuse what would load and silently compute
something else (a NaN from ``rms_norm_eps <= 0``, a truncated ``2.5``, a string where a number belongs).

:func:`check_hf_fields` runs on the raw ``config.json`` dict before it is parsed (so a wrong type is reported
with its JSON field name instead of a bare ``int()`` error); :func:`check_config_values` runs on every
:class:`~kimik3.model.config.ModelConfig`, however it was built.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kimik3.util.args import MAX_SEED

__all__ = ["resolve_dtype", "check_seed", "check_device", "check_hf_fields", "check_config_values", "FLOAT_DTYPES",
           "MAX_SEED"]

FLOAT_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "f64": torch.float64, "double": torch.float64,
}


def check_seed(seed: Any, what: str = "seed") -> int:
    """A random seed: an int in 0..2**63 - 1 (torch's own errors for others say neither which argument nor why)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{what} must be an integer in 0..{MAX_SEED}, got {seed!r}")
    return seed


def resolve_dtype(dtype: Any, what: str = "dtype") -> torch.dtype:
    """A floating-point ``torch.dtype`` from a dtype or its usual names ("bfloat16", "bf16", "torch.float32", ...).
    Integer, boolean, complex and fp8 dtypes are refused: weights in them would be a different model."""
    if isinstance(dtype, torch.dtype):
        dt = dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key not in FLOAT_DTYPES:
            raise ValueError(f"{what} {dtype!r} is not a known floating-point dtype; use one of "
                             f"{', '.join(sorted(FLOAT_DTYPES))} or a torch.dtype")
        dt = FLOAT_DTYPES[key]
    else:
        raise ValueError(f"{what} must be a torch.dtype or a string such as 'bfloat16', got {type(dtype).__name__}")
    if dt not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{what} {dt} is not supported: weights need float32, bfloat16, float16 or float64")
    return dt


# ---------------------------------------------------------------------- raw config.json fields

# JSON field -> kind. Aliases (num_experts / n_routed_experts ...) are listed under every name the parser reads.
_POS_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "model_max_length",
            "moe_layer_freq", "n_group", "num_expert_group", "topk_group", "linear_conv_kernel_dim")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers")
_NONNEG_INT = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts", "num_local_experts",
               "num_experts_per_tok", "num_experts_per_token", "moe_intermediate_size", "n_shared_experts",
               "num_shared_experts", "first_k_dense_replace", "linear_num_heads", "linear_head_dim",
               "num_nextn_predict_layers")
_OPT_POS_INT = ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size")
_POS_FLOAT = ("rms_norm_eps", "rope_theta", "activation_situ_beta")
_OPT_POS_FLOAT = ("activation_situ_linear_beta",)
_NONNEG_FLOAT = ("routed_scaling_factor",)
_BOOL = ("tie_word_embeddings", "norm_topk_prob", "moe_renormalize", "mla_use_nope", "mla_use_output_gate",
         "latent_moe_use_norm", "rope_interleave")
_LAC_POS_INT = ("short_conv_kernel_size",)
_LAC_NONNEG_INT = ("num_heads", "head_dim")
_ROPE_POS = ("factor", "original_max_position_embeddings")
_ROPE_NUM = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Sanity limits, far above any published model (K3: 93 layers, 896 experts, vocab 163840): a corrupt or hostile
# config asking for more would spend minutes building the module tree or overflow tensor sizes.
MAX_DIM = 2**31 - 1
MAX_LAYERS = 512


def _int_ok(v: Any) -> bool:
    """An integer, or a float with an integral value (JSON writers sometimes emit 4.0); never a bool or 2.5."""
    return _is_num(v) and math.isfinite(v) and float(v) == int(v) and abs(v) <= MAX_DIM


def check_hf_fields(raw: Any, prefix: str = "") -> None:
    """Type and range of every numeric/boolean field the parser reads from a (text) config dict; ``prefix``
    names where that dict sits in the file (``"text_config."`` for K3)."""
    def bad(field: str, v: Any, want: str) -> ValueError:
        return ValueError(f"config field {prefix + field!r} must be {want}, got {v!r}")

    for f in _POS_INT + _NONNEG_INT + _OPT_POS_INT:
        v = raw.get(f)
        if v is None:  # the parser treats null as absent (its default), except for the sizes it requires
            if f in _REQUIRED and f in raw:
                raise bad(f, v, "a positive integer")
            continue
        lo = 0 if f in _NONNEG_INT else 1
        if not _int_ok(v) or v < lo:
            raise bad(f, v, f"a {'non-negative' if lo == 0 else 'positive'} integer (at most {MAX_DIM})")
        if f == "num_hidden_layers" and v > MAX_LAYERS:
            raise bad(f, v, f"at most {MAX_LAYERS}")
    for f in _POS_FLOAT + _OPT_POS_FLOAT + _NONNEG_FLOAT:
        v = raw.get(f)
        if v is None:
            continue
        ok = _is_num(v) and math.isfinite(v) and (v >= 0 if f in _NONNEG_FLOAT else v > 0)
        if not ok:
            raise bad(f, v, "a finite number >= 0" if f in _NONNEG_FLOAT else "a finite number > 0")
    for f in _BOOL:
        if f in raw and raw[f] is not None and not isinstance(raw[f], bool):
            raise bad(f, raw[f], "true or false")
    for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = raw.get(f)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise bad(f, v, "a non-negative token id")
    lac = raw.get("linear_attn_config")
    if lac is not None:
        if not isinstance(lac, dict):
            raise bad("linear_attn_config", lac, "an object")
        for f in _LAC_POS_INT + _LAC_NONNEG_INT:
            v = lac.get(f)
            if v is not None and (not _int_ok(v) or v < (1 if f in _LAC_POS_INT else 0)):
                raise bad(f"linear_attn_config.{f}", v, "a positive integer" if f in _LAC_POS_INT
                          else "a non-negative integer")
        for f in ("kda_layers", "full_attn_layers"):
            v = lac.get(f)
            if f in lac and not (isinstance(v, list) and all(_int_ok(i) for i in v)):
                raise bad(f"linear_attn_config.{f}", v, "a list of integers")
        g = lac.get("gate_lower_bound")
        if g is not None and not (_is_num(g) and math.isfinite(g) and g < 0):
            raise bad("linear_attn_config.gate_lower_bound", g, "a finite negative number")
        if "use_full_rank_gate" in lac and not isinstance(lac["use_full_rank_gate"], bool):
            raise bad("linear_attn_config.use_full_rank_gate", lac["use_full_rank_gate"], "true or false")
    lt = raw.get("layer_types")
    if lt is not None and not (isinstance(lt, list) and all(isinstance(t, str) for t in lt)):
        raise bad("layer_types", lt, "a list of strings")
    for rname in ("rope_parameters", "rope_scaling"):
        rp = raw.get(rname)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise bad(rname, rp, "an object")
        for f in _ROPE_POS + _ROPE_NUM:
            v = rp.get(f)
            if v is None:
                continue
            if not (_is_num(v) and math.isfinite(v)) or (f in _ROPE_POS and v <= 0):
                raise bad(f"{rname}.{f}", v, "a finite number > 0" if f in _ROPE_POS else "a finite number")
        if "rope_theta" in rp and not (_is_num(rp["rope_theta"]) and math.isfinite(rp["rope_theta"])
                                       and rp["rope_theta"] > 0):
            raise bad(f"{rname}.rope_theta", rp["rope_theta"], "a finite number > 0")


# ---------------------------------------------------------------------- ModelConfig values

_CFG_POS_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "moe_layer_freq",
                "n_group", "topk_group", "kda_conv_size")
_CFG_NONNEG_INT = ("intermediate_size", "first_k_dense_replace", "num_attention_heads", "kv_lora_rank",
                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
                   "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")
_CFG_OPT_POS_INT = ("q_lora_rank", "moe_latent_size", "attn_res_block_size")
_CFG_BOOL = ("mla_use_nope", "mla_use_output_gate", "rope_interleave", "kda_full_rank_gate", "moe_latent_norm",
             "norm_topk_prob", "tie_word_embeddings")


def check_config_values(cfg: Any) -> None:
    """Types and ranges of a ModelConfig's fields; ``ValueError`` naming the field (and the config's name)."""
    where = f"config {cfg.name!r}" if cfg.name else "config"

    def need(cond: bool, field: str, want: str) -> None:
        if not cond:
            raise ValueError(f"{where}: {field} must be {want}, got {getattr(cfg, field)!r}")

    def is_int(v: Any, lo: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_DIM

    for f in _CFG_POS_INT:
        need(is_int(getattr(cfg, f), 1), f, f"a positive integer (at most {MAX_DIM})")
    for f in _CFG_NONNEG_INT:
        need(is_int(getattr(cfg, f), 0), f, f"a non-negative integer (at most {MAX_DIM})")
    for f in _CFG_OPT_POS_INT:
        v = getattr(cfg, f)
        need(v is None or is_int(v, 1), f, f"None or a positive integer (at most {MAX_DIM})")
    need(cfg.num_hidden_layers <= MAX_LAYERS, "num_hidden_layers", f"at most {MAX_LAYERS}")
    for f in _CFG_BOOL:
        need(isinstance(getattr(cfg, f), bool), f, "a bool")
    for f in ("rms_norm_eps", "rope_theta", "situ_beta"):
        v = getattr(cfg, f)
        need(_is_num(v) and math.isfinite(v) and v > 0, f, "a finite number > 0")
    v = cfg.routed_scaling_factor
    need(_is_num(v) and math.isfinite(v) and v >= 0, "routed_scaling_factor", "a finite number >= 0")
    v = cfg.situ_linear_beta
    need(v is None or (_is_num(v) and math.isfinite(v) and v > 0), "situ_linear_beta", "None or a finite number > 0")
    v = cfg.kda_gate_lower_bound
    need(v is None or (_is_num(v) and math.isfinite(v) and v < 0), "kda_gate_lower_bound",
         "None or a finite negative number")
    need(isinstance(cfg.kda_layers, tuple) and all(isinstance(i, int) and not isinstance(i, bool)
                                                   for i in cfg.kda_layers), "kda_layers", "a tuple of ints")
    for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, f)
        need(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < cfg.vocab_size), f,
             f"None or a token id in the vocabulary [0, {cfg.vocab_size})")
    need(cfg.rope_scaling is None or isinstance(cfg.rope_scaling, dict), "rope_scaling", "None or a dict")
    v = cfg.rank_slice
    need(v is None or (isinstance(v, tuple) and len(v) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                   for i in v)), "rank_slice",
         "None or a tuple (world, rank) of ints")


# ---------------------------------------------------------------------- memory


def device_memory(device: Any) -> tuple[int, str] | None:
    """(bytes that can be allocated on ``device``, what that figure is) or None when it cannot be told."""
    import os

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(dev)
        return free, "free GPU memory"
    if dev.type != "cpu":
        return None
    try:  # Linux: what can be allocated now without swapping (free memory plus reclaimable caches)
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available memory"
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"
    return None


def check_device(device: Any, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` this machine has: a name torch does not know, or a CUDA device without
    one, is a ``ValueError`` saying so (torch's own errors are an assertion or an unhelpful ``RuntimeError``)."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{what} must be a device name such as 'cpu' or 'cuda' (or a torch.device), got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{what} {device!r} is not a device torch knows (e.g. 'cpu', 'cuda', 'cuda:1', 'meta')") \
            from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what} {device!r}: no CUDA device is available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{what} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"{what} {device!r}: only 'cpu', 'cuda' and 'meta' devices are supported")
    return dev


def require_memory(nbytes: int, device: Any, what: str, hint: str = "") -> None:
    """Refuse, with the figure, an allocation the device cannot hold — instead of a raw allocator error or (on
    Linux, where allocation is lazy) the process being killed halfway through filling it."""
    have = device_memory(device)
    if have is not None and nbytes > have[0]:
        raise ValueError(f"{what} needs {nbytes / 2**30:.1f} GiB, more than the {have[0] / 2**30:.1f} GiB of "
                         f"{have[1]} on {device}" + (f"; {hint}" if hint else ""))
