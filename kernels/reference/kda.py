"""PyTorch reference and random inputs of the KDA decode kernel (host code no kernel hash covers); design:
docs/architecture.md (map).
"""

from __future__ import annotations

from typing import Any

import torch
from kimik3.kernels.fused.kda import NORM_EPS, QK_EPS
from kimik3.kernels.reference import common as ref_common


def make_inputs(variant: str = "kda", *, B: int, nh: int, D: int, W: int = 4, device: str = "cpu", seed: int = 0,
                **_: Any) -> dict[str, torch.Tensor]:
    """Random layer inputs and a non-trivial state; ``out`` poisoned with NaN (S and conv are in/out)."""
    rng = ref_common.Rng(seed, device)
    P, bf = nh * D, torch.bfloat16
    return {
        "qkv": rng.randn(B, 3 * P, dtype=bf), "u": rng.randn(B, P, dtype=bf), "b": rng.randn(B, nh, dtype=bf),
        "gate": rng.randn(B, P, dtype=bf), "conv_w": rng.randn(3 * P, W, scale=0.5), "dt_bias": rng.randn(P, scale=0.5),
        "A_log": rng.randn(nh, scale=0.5), "o_norm": 1.0 + rng.randn(D, scale=0.1),
        "conv": rng.randn(B, 3 * P, W - 1, dtype=bf), "S": rng.randn(B, nh, D, D, scale=0.1),
        "out": rng.poisoned((B, P), bf),
    }


def reference(variant: str, t: dict[str, torch.Tensor], *, lower_bound: float | None = -5.0, **_: Any
              ) -> dict[str, torch.Tensor]:
    """Spec §3.2 on the projected inputs, fp32 math, with the model's l2norm and kda_recurrent_step.

    Returns the expected ``out`` plus the updated ``S`` and ``conv`` (the kernel updates them in place). The conv,
    decay gate and gated norm are the model's own functions, so the kernel is checked against the model's math.
    """
    from kimik3.model.modeling import kda_decay, kda_gated_norm, kda_recurrent_step, kda_short_conv, l2norm

    B, nh, D, _ = t["S"].shape
    P = nh * D
    window = torch.cat([t["conv"], t["qkv"][..., None]], -1)  # [B, 3P, W], oldest first
    z = kda_short_conv(window, t["conv_w"], torch.bfloat16)  # conv + SiLU, bf16 result
    q, k, v = z.float().unflatten(-1, (3, nh, D)).unbind(1)
    q, k = l2norm(q, QK_EPS) * D**-0.5, l2norm(k, QK_EPS)
    g = kda_decay(t["u"], t["dt_bias"], t["A_log"][:nh], lower_bound)
    beta = torch.sigmoid(t["b"].float())
    o, S = kda_recurrent_step(q, k, v, g, beta, t["S"].float())
    o = o.to(torch.bfloat16).float()  # cast to bf16 before the gated norm; fp32 in, so the norm's result stays fp32
    o = kda_gated_norm(o, t["gate"].unflatten(-1, (nh, D)), t["o_norm"], NORM_EPS)
    return {"out": o.flatten(-2).reshape(B, P), "S": S, "conv": window[..., 1:]}
