"""Per-layer kinds as config.json files state them, reconciled into the config's rules.

transformers writes Kimi-Linear configs with explicit per-layer lists — ``layer_types`` ("linear_attention" /
"full_attention") and ``mlp_layer_types`` ("dense" / "sparse") — and keeps ``first_k_dense_replace`` only when it
was passed explicitly; the releases write ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-based) and
``first_k_dense_replace``. Whatever a file states is used, never a default; fields that disagree are an error.
(No imports from the rest of the package: config.py uses this while it is being imported.)
"""

from __future__ import annotations

__all__ = ["kda_from_layer_types", "ffn_rule"]

_MIXER_TYPES = {"linear_attention": "kda", "full_attention": "mla"}
_FFN_TYPES = {"dense": "dense", "sparse": "moe", "moe": "moe"}


def _kinds(values: object, n: int, field: str, allowed: dict[str, str]) -> list[str]:
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise ValueError(f"inconsistent config: {field} must list one entry per layer ({n}), got {got}")
    bad = sorted({str(v) for v in values if v not in allowed})
    if bad:
        raise ValueError(f"inconsistent config: {field} has unknown entries {bad} (known: {sorted(allowed)})")
    return [allowed[v] for v in values]


def kda_from_layer_types(layer_types: object, n: int, kda: tuple[int, ...] | None) -> tuple[int, ...]:
    """0-based KDA layers from ``layer_types``; ``kda``: what linear_attn_config said (None: it said nothing)."""
    kinds = _kinds(layer_types, n, "layer_types", _MIXER_TYPES)
    got = tuple(i for i, k in enumerate(kinds) if k == "kda")
    if kda is not None and set(got) != set(kda):
        diff = sorted(set(got) ^ set(kda))
        raise ValueError(f"inconsistent config: layer_types and linear_attn_config disagree on the mixer of "
                         f"layer(s) {diff} (0-based)")
    return got


def ffn_rule(mlp_layer_types: object, n: int, n_experts: int, first_k: int | None, freq: int | None
             ) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) reproducing ``mlp_layer_types`` exactly (the rule: MoE iff
    layer >= first_k and layer % freq == 0); ``first_k`` / ``freq``: the file's own fields, None when absent."""
    kinds = _kinds(mlp_layer_types, n, "mlp_layer_types", _FFN_TYPES)
    moe = [k == "moe" for k in kinds]
    if any(moe) and n_experts <= 0:
        raise ValueError("inconsistent config: mlp_layer_types has sparse (MoE) layers but the config has no "
                         "routed experts")

    def pattern(k: int, f: int) -> list[bool]:
        return [n_experts > 0 and i >= k and i % f == 0 for i in range(n)]

    if first_k is not None or freq is not None:
        k, f = first_k or 0, freq or 1
        if pattern(k, f) != moe:
            diff = [i for i in range(n) if pattern(k, f)[i] != moe[i]]
            raise ValueError(f"inconsistent config: mlp_layer_types and first_k_dense_replace={first_k} / "
                             f"moe_layer_freq={freq} disagree on layer(s) {diff} (0-based)")
        return k, f
    k = moe.index(True) if any(moe) else n
    for f in range(1, n + 1):
        if pattern(k, f) == moe:
            return k, f
    raise ValueError(f"mlp_layer_types {list(mlp_layer_types)} cannot be expressed as first_k_dense_replace "
                     "and moe_layer_freq (the only per-layer MoE rule the model supports)")
