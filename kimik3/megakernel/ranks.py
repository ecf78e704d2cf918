"""One rank of a tensor- × expert-parallel deployment: which slice of the step a rank program builds (§1.2).

:class:`Shard` names the rank and the layout; :meth:`Shard.part` cuts a dimension (heads, experts, hidden channels,
vocabulary rows) into the rank's contiguous share. The layout built is the seeds' one: attention heads
tensor-parallel and routed experts expert-parallel over the same ``world`` ranks, activations replicated, so the
experts need no dispatch and the step's collectives are two all-reduces per layer, the LatentMoE's latent-space
combine and the vocabulary arg-max. Why this layout and not data-parallel attention:
docs/architecture.md#megakernel-across-ranks. The gate refuses a model it cannot cut evenly, naming the dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.kernels.contracts.peers import MAX_WORLD
from kimik3.model.config import ModelConfig
from kimik3.model.rank_slice import part
from kimik3.scope.gates import RANKS
from kimik3.scope.spec import Request

__all__ = ["LAYOUTS", "Shard", "SINGLE", "of_slice"]

LAYOUTS = ("tp-attention+ep-experts",)


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a deployment with attention heads over ``tp`` ranks and routed experts over ``ep`` ranks.
    Built: ``tp == ep`` (the same ranks hold both); ``Shard()`` is the single-GPU program."""

    tp: int = 1
    ep: int = 1
    rank: int = 0
    layout: str = LAYOUTS[0]

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"Shard.{name} must be an int, got {type(v).__name__} {v!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; built: {', '.join(LAYOUTS)} (data-parallel attention "
                             "is modelled, not built: docs/architecture.md#megakernel-across-ranks)")
        if not 1 <= self.tp <= MAX_WORLD or not 1 <= self.ep <= MAX_WORLD:
            raise ValueError(f"tp={self.tp}, ep={self.ep}: each must lie in 1..{MAX_WORLD}")
        if self.tp != self.ep:
            raise ValueError(f"tp={self.tp} != ep={self.ep}: the built layout puts attention heads and experts on "
                             "the same ranks (tp == ep); attention data-parallel groups are not built")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a world of {self.world} ranks")

    @property
    def world(self) -> int:
        return self.tp

    def part(self, total: int, what: str) -> tuple[int, int]:
        """The rank's contiguous share ``[lo, hi)`` of ``total`` (``what`` names it in the refusal)."""
        return part(total, self.world, self.rank, what)

    def slice_of(self, cfg: ModelConfig) -> ModelConfig:
        """The rank's slice of the whole model ``cfg`` (``cfg`` itself for the single-GPU program)."""
        return cfg.replace(rank_slice=(self.world, self.rank)) if self.world > 1 else cfg

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a config whose sharded dimensions do not split evenly (every rank builds the same tiles), and a
        config that is already a rank's slice (a rank program is built from the whole model)."""
        if cfg.rank_slice:
            raise ValueError(f"config {cfg.name!r} is already rank slice {cfg.rank_slice}: build the rank program from "
                             "the whole model with its shard (of_slice(cfg) gives both)")
        if self.world > 1:  # the rank programs' scope gate: features and the even split, every reason at once
            reasons = RANKS.refuse_config(cfg, Request(dtype=torch.float32, device="cpu", batch=1, world=self.world))
            if reasons:
                raise ValueError(f"rank programs over {self.world}: " + "; ".join(reasons))


def of_slice(cfg: ModelConfig) -> tuple[ModelConfig, Shard]:
    """(whole model, shard) of a config: a rank slice's deployment and rank, or the single-GPU program."""
    if not cfg.rank_slice:
        return cfg, SINGLE
    world, rank = cfg.rank_slice
    return cfg.whole(), Shard(world, world, rank)


SINGLE = Shard()
