"""Deterministic random weights with sane scales, for presets (tests, notebooks, benchmarks).

Scales are chosen so that every block's output has O(1) RMS and the logits are neither NaN/inf nor
saturated: projections ~ N(0, 1/fan_in), norm weights 1 ± 0.1 (so a missing weight multiply fails a test),
KDA decay parameters in the ranges the FLA initialisation uses, a small non-zero router bias (so the
selection-only bias is exercised).
"""

from __future__ import annotations

import math

import torch

from kimik3.config import ModelConfig, get_preset
from kimik3.model import KimiForCausalLM

__all__ = ["init_weights", "from_preset", "build_model"]


def build_model(cfg: ModelConfig | str, device: str | torch.device = "cpu") -> KimiForCausalLM:
    """An uninitialised model on ``device`` (use ``"meta"`` to count parameters of full-size presets)."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    with torch.device(device):
        return KimiForCausalLM(cfg)


@torch.no_grad()
def init_weights(model: KimiForCausalLM, seed: int = 0) -> KimiForCausalLM:
    """Fill every parameter deterministically from ``seed`` (fp32 on the CPU generator, then cast)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    def uniform(shape, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen) * (hi - lo) + lo

    for name, p in model.named_parameters():
        shape, leaf = p.shape, name.rsplit(".", 2)
        last = name.split(".")[-1]
        parent = leaf[-2] if len(leaf) > 1 else ""
        if last == "A_log":
            v = uniform(shape, 1.0, 16.0).log()
        elif last == "dt_bias":
            dt = uniform(shape, math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            v = dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as FLA initialises it
        elif parent.endswith("_conv1d"):
            v = normal(shape, 0.5)
        elif last == "e_score_correction_bias":
            v = normal(shape, 0.01)
        elif parent.endswith("norm") or parent.endswith("layernorm") or parent == "o_norm":
            v = 1.0 + normal(shape, 0.1)
        elif parent.endswith("_res_proj"):
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif parent == "embed_tokens":
            v = normal(shape, 1.0)
        elif name.endswith(("experts.w1", "experts.w3", "experts.w2")):
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif p.dim() == 2:
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        else:
            raise RuntimeError(f"init_weights: no rule for parameter {name} {tuple(shape)}")
        p.copy_(v.to(p.dtype))
    return model


def from_preset(name: str | ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> KimiForCausalLM:
    """A preset model with deterministic random weights (``dtype`` for the bf16 tensors; fp32 ones stay fp32)."""
    cfg = get_preset(name)
    model = build_model(cfg, "cpu")
    init_weights(model, seed)
    model.cast_(dtype)
    return model.to(device).eval()

