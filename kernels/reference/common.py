"""Seeded random inputs and the RMSNorm shared by the fused kernels' PyTorch references. Host code that no
kernel's source hash covers: changing a test input invalidates no prebuilt artefact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Rng:
    """Seeded random tensors generated directly on ``device`` (k3-shard inputs are GBs: no CPU detour)."""

    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.g = torch.Generator(device=self.device).manual_seed(seed)

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g, device=self.device) * scale).to(dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device)

    def randint(self, lo: int, hi: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.g, device=self.device).to(dtype)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.g, device=self.device)

    def poisoned(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An output buffer filled with NaN (-1 for integer outputs), so an unwritten element fails."""
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(tuple(shape), fill, dtype=dtype, device=self.device)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (normalise in fp32, cast to x.dtype, then times the weight)."""
    from kimik3.model.modeling import rms_norm

    return rms_norm(x, weight, eps)
