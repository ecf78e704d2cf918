"""transformers' in-memory (internal) tensor layouts, mapped back to the release layouts the loader reads (§7).

transformers 5 keeps some weights fused or renamed in memory and converts them back on ``save_pretrained``; a
state dict saved as it is in memory — or a file a newer version writes that way — uses the internal names:

* routed experts stacked per layer: ``mlp.experts.gate_up_proj`` [E, 2I, D] (gate rows first, then up) and
  ``mlp.experts.down_proj`` [E, D, I] (DeepSeek-V3 and Kimi-Linear);
* Kimi-Linear's KDA: ``self_attn.conv1d.weight`` = q, k, v conv kernels concatenated on dim 0, and the decay
  gate's tensors under ``self_attn.forget_gate.``; the MoE (and the dense MLP) under ``mlp.``.

:func:`to_release` splits such a tensor into the release-layout tensors it holds; everything else passes through.
"""

from __future__ import annotations

import re

import torch

__all__ = ["is_fused", "to_release"]

_FUSED_EXPERTS = re.compile(r"^(.*\.(?:mlp|block_sparse_moe)\.experts)\.(gate_up_proj|down_proj)$")
_FUSED_CONV = re.compile(r"^(.*\.self_attn)\.conv1d\.weight$")
_FORGET_GATE = re.compile(r"^(.*\.self_attn)\.forget_gate\.(.+)$")


def is_fused(key: str) -> bool:
    """Whether ``key`` holds several release-layout tensors (its parts are known only once it is read)."""
    return bool(_FUSED_EXPERTS.match(key) or _FUSED_CONV.match(key))


def to_release(key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) in transformers' internal layout -> the release-layout (key, tensor) pairs it holds."""
    m = _FORGET_GATE.match(key)
    if m:
        return [(f"{m.group(1)}.{m.group(2)}", t)]
    m = _FUSED_CONV.match(key)
    if m:
        if t.dim() == 0 or t.shape[0] % 3:
            raise ValueError(f"tensor {key!r} has shape {list(t.shape)}; expected the q, k, v conv kernels "
                             "concatenated on dim 0")
        return [(f"{m.group(1)}.{n}_conv1d.weight", part) for n, part in zip("qkv", t.chunk(3, 0))]
    m = _FUSED_EXPERTS.match(key)
    if m:
        prefix, kind = m.groups()
        if t.dim() != 3:
            raise ValueError(f"tensor {key!r} has shape {list(t.shape)}; expected [experts, rows, columns]")
        if kind == "down_proj":
            return [(f"{prefix}.{e}.w2.weight", t[e]) for e in range(t.shape[0])]
        if t.shape[1] % 2:
            raise ValueError(f"tensor {key!r} has shape {list(t.shape)}; expected gate and up rows stacked on dim 1")
        inner = t.shape[1] // 2
        return [pair for e in range(t.shape[0])
                for pair in ((f"{prefix}.{e}.w1.weight", t[e, :inner]), (f"{prefix}.{e}.w3.weight", t[e, inner:]))]
    return [(key, t)]
