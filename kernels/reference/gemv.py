"""PyTorch reference and random inputs of the GEMV kernel (host code no kernel hash covers); design:
docs/architecture.md (map).
"""

from __future__ import annotations

from typing import Any

import torch
from kimik3.kernels.contracts.meta import RMS_EPS
from kimik3.kernels.fused.gemv import OUTPUTS, _specs
from kimik3.kernels.reference import common as ref_common
from kimik3.kernels.toolchain import dsl


def make_inputs(variant: str, *, B: int, N: int, K: int, device: str = "cpu", seed: int = 0, **_: Any
                ) -> dict[str, torch.Tensor]:
    """Random inputs on ``device``; outputs (and scratch) preallocated and poisoned with NaN / -1."""
    rng = ref_common.Rng(seed, device)
    t: dict[str, torch.Tensor] = {}
    for name, (dt, shp) in _specs(variant, B, N, K).items():
        td = dsl.torch_dtype(dt)
        if name in OUTPUTS[variant] or name.startswith("part"):
            t[name] = rng.poisoned(shp, td)
        elif name == "gamma":
            t[name] = (1.0 + rng.randn(*shp, scale=0.1)).to(td)
        else:
            t[name] = rng.randn(*shp, scale=K**-0.5 if name == "W" else 1.0, dtype=td)
    return t


def reference(variant: str, t: dict[str, torch.Tensor], **_: Any) -> dict[str, torch.Tensor]:
    """Plain fp32 math. rmsnorm: the model's order (bf16(x·rstd) then ·gamma in bf16), then the GEMV."""
    x, W = t["x"].float(), t["W"].float()
    if variant in ("rmsnorm", "lm_head"):
        x = ref_common.ref_rms_norm(t["x"], t["gamma"], RMS_EPS).float()
    y = x @ W.T
    if variant == "residual":
        y = y + t["residual"].float()
    if variant == "lm_head":
        return {"logits": y, "token": torch.argmax(y, dim=-1).to(torch.int32)}
    return {"y": y}
