"""PyTorch reference and random inputs of the AttnRes mix kernel (host code no kernel hash covers); design:
docs/architecture.md (map).
"""

from __future__ import annotations

from typing import Any

import torch
from kimik3.kernels.fused.attn_res import EPS
from kimik3.kernels.reference import common as ref_common


def make_inputs(variant: str = "mix", *, B: int, H: int, NC: int, device: str = "cpu", seed: int = 0, **_: Any
                ) -> dict[str, torch.Tensor]:
    rng = ref_common.Rng(seed, device)
    # candidates of different magnitudes (block sums grow with depth), ω = norm_w ⊙ proj_w
    scales = torch.linspace(0.5, 4.0, NC, device=rng.device)[:, None, None]
    cand = (scales * rng.randn(NC, B, H)).to(torch.bfloat16)
    norm_w = (1.0 + rng.randn(H, scale=0.1)).to(torch.bfloat16)
    proj_w = rng.randn(1, H, scale=8 * H**-0.5, dtype=torch.bfloat16)
    return {"cand": cand, "norm_w": norm_w, "proj_w": proj_w, "omega": norm_w.float() * proj_w.float().reshape(-1),
            "out": rng.poisoned((B, H), torch.bfloat16)}


def reference(variant: str, t: dict[str, torch.Tensor], **_: Any) -> dict[str, torch.Tensor]:
    """The model's AttnRes mix (kimik3.model.modeling.attn_res_mix) over the stacked candidates, in fp32."""
    from kimik3.model.modeling import attn_res_mix as model_mix

    cands = list(t["cand"].unbind(0))
    return {"out": model_mix(cands, t["norm_w"], t["proj_w"], EPS).float()}
