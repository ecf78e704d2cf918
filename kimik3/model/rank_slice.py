"""One rank's slice of a model: the dimensions a tensor- × expert-parallel deployment splits, a rank's share.

The layout (docs/architecture.md#megakernel-across-ranks): attention heads tensor-parallel and routed experts
expert-parallel over the same ``world`` ranks. Split: KDA and MLA heads, the routed experts, the LatentMoE's latent
channels feeding its up-projection, the shared experts' and dense MLP's channels, the vocabulary rows of
``lm_head``. Everything else (embedding, norms, AttnRes projections, router, latent down-projection, MLA's
``q_a`` / ``kv_a`` and its latent cache, KDA's decay input) is held whole by every rank. This file is that rule,
read by the config (a preset that is one rank's slice), the modules it builds and the rank program's builder.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["SPLIT", "SplitModel", "split_dims", "part", "check_split", "even_worlds"]

# the split dimensions (ModelConfig.split_dims gives their sizes)
SPLIT = ("kda_heads", "mla_heads", "experts", "latent", "shared", "dense", "vocab")


class SplitModel(Protocol):
    """What the rule reads of a model config (:class:`kimik3.model.config.ModelConfig`)."""

    moe_latent_size: int | None

    @property
    def moe_layers(self) -> tuple[int, ...]: ...

    def split_dims(self) -> dict[str, int]: ...


def split_dims(cfg: SplitModel) -> dict[str, int]:
    """The full size of every dimension the layout splits, for the blocks the config has (0: no such block)."""
    return cfg.split_dims()


_NAMES = {"kda_heads": "kda_num_heads", "mla_heads": "num_attention_heads", "experts": "n_routed_experts",
          "latent": "moe_latent_size", "shared": "shared expert channels", "dense": "intermediate_size",
          "vocab": "vocab_size"}


def part(total: int, world: int, rank: int, what: str) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[lo, hi)`` of ``total`` over ``world`` ranks; an uneven split is refused
    naming the dimension (every rank builds the same tiles)."""
    if total % world:
        raise ValueError(f"{_NAMES.get(what, what)} = {total} does not split evenly over {world} ranks: this model "
                         f"cannot be laid out tp-attention+ep-experts at world {world}")
    n = total // world
    return rank * n, (rank + 1) * n


def check_split(cfg: SplitModel, world: int) -> None:
    """Refuse a world the config's split dimensions do not divide (and a MoE model without a latent space: the
    ranks combine the routed experts in the latent width)."""
    if world == 1:
        return
    for what, total in cfg.split_dims().items():
        if total:
            part(total, world, 0, what)
    if cfg.moe_layers and not cfg.moe_latent_size:
        raise ValueError("a rank program sums the routed experts across ranks in the latent space: the model has "
                         "no moe_latent_size (LatentMoE); a full-width combine is not built")


def even_worlds(cfg: SplitModel, gpus: int) -> list[int]:
    """Every world up to ``gpus`` that the layout divides the config into evenly."""
    out = []
    for w in range(1, gpus + 1):
        try:
            check_split(cfg, w)
        except ValueError:
            continue
        out.append(w)
    return out
