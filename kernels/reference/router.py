"""PyTorch reference and random inputs of the router kernel (host code no kernel hash covers); design:
docs/architecture.md (map).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from kimik3.kernels.reference import common as ref_common


def make_inputs(variant: str = "router", *, B: int, E: int, H: int, topk: int, device: str = "cpu", seed: int = 0,
                **_: Any) -> dict[str, torch.Tensor]:
    rng = ref_common.Rng(seed, device)
    return {
        "W": rng.randn(E, H, scale=H**-0.5, dtype=torch.bfloat16),
        "x": rng.randn(B, H, dtype=torch.bfloat16),
        "bias": rng.randn(E, scale=0.05),
        "scores": rng.poisoned((B, E), torch.float32),
        "ids": rng.poisoned((B, topk), torch.int32),
        "weights": rng.poisoned((B, topk), torch.float32),
    }


def reference(variant: str, t: dict[str, torch.Tensor], *, topk: int, n_group: int = 1, topk_group: int = 1,
              scale: float = 1.0, renorm: bool = True, **_: Any) -> dict[str, torch.Tensor]:
    """The model's router (kimik3.model.modeling.route) on the same tensors; ids int32 in descending choice order."""
    from kimik3.model.modeling import route

    E = t["W"].shape[0]
    cfg = types.SimpleNamespace(n_routed_experts=E, num_experts_per_tok=topk, n_group=n_group, topk_group=topk_group,
                                norm_topk_prob=renorm, routed_scaling_factor=scale)
    w, idx = route(t["x"], t["W"], t["bias"], cfg)
    scores = torch.sigmoid(t["x"].float() @ t["W"].float().T)
    return {"weights": w, "ids": idx.to(torch.int32), "scores": scores}
