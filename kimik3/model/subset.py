"""Subsets of a checkpoint: chosen layers and experts of a full model, read without the rest.

``kimik3.from_pretrained(path, layers=..., experts=...)`` builds a smaller model of the same family from the kept
layers (renumbered 0, 1, ... in their original order, the rest of the config unchanged) and, in every kept MoE
layer, the kept routed experts (renumbered in the order given); the router's gate rows and correction bias are
sliced, so its top-k is taken among the kept experts (§5.2). That defines the ``k3-shard`` preset
(docs/validation.md); :func:`k3_shard_selection` finds its layers and experts in a K3-layout checkpoint, and
``preset="k3-shard"`` makes a contradicting subset an error. Only the kept tensors are read (safetensors are
memory-mapped), shard by shard. The k3-shard rule: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from kimik3.model.config import ModelConfig, get_preset

__all__ = ["Selection", "select", "k3_shard_selection", "slice_model"]

_LAYER_KEY = re.compile(r"^((?:language_model\.)?model\.layers\.)(\d+)\.(.*)$")
_EXPERT_REST = re.compile(r"^((?:block_sparse_moe|mlp)\.experts\.)(\d+)(\..*)$")
_ROUTER_REST = re.compile(r"^(?:block_sparse_moe|mlp)\.gate\.(?:weight|e_score_correction_bias)$")


@dataclass(frozen=True)
class Selection:
    """Kept layers (original indices, ascending), kept experts per kept MoE layer (original ids, in the order
    they become experts 0, 1, ...) and the config of the model they make."""

    layers: tuple[int, ...]
    experts: dict[int, tuple[int, ...]]
    source: ModelConfig
    config: ModelConfig

    def map_key(self, key: str) -> tuple[str, torch.Tensor | None] | None:
        """Checkpoint key of the full model -> (the key in the subset's numbering, rows to keep or None), or None
        when the subset does not keep the tensor."""
        m = _LAYER_KEY.match(key)
        if not m:
            return key, None
        prefix, layer, rest = m.group(1), int(m.group(2)), m.group(3)
        if layer not in self._new_layer:
            return None
        new = f"{prefix}{self._new_layer[layer]}."
        kept = self.experts.get(layer)
        em = _EXPERT_REST.match(rest)
        if em and kept is not None:
            e = int(em.group(2))
            pos = self._new_expert[layer].get(e)
            return None if pos is None else (f"{new}{em.group(1)}{pos}{em.group(3)}", None)
        if kept is not None and _ROUTER_REST.match(rest):  # router rows of the kept experts, in their order
            return new + rest, torch.tensor(kept, dtype=torch.long)
        return new + rest, None

    @cached_property  # (map_key runs once per tensor of a checkpoint: half a million for K3)
    def _new_layer(self) -> dict[int, int]:
        return {L: j for j, L in enumerate(self.layers)}

    @cached_property
    def _new_expert(self) -> dict[int, dict[int, int]]:
        return {L: {e: j for j, e in enumerate(ids)} for L, ids in self.experts.items()}


def _ids(what: str, ids: Iterable[int], n: int) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{what} must be a sequence of integers, got {ids!r}")
    out = tuple(itertools.islice(ids, n + 1))  # more than n distinct ids in 0..n-1 cannot be: read no further
    if len(out) > n:
        raise ValueError(f"{what} holds more than the {n} ids there are (0..{n - 1})")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise ValueError(f"{what} must be integers, got {list(out)[:16]!r}")
    if not out:
        raise ValueError(f"{what} is empty")
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise ValueError(f"{what} {bad[:8]}{' ...' if len(bad) > 8 else ''} out of range 0..{n - 1}")
    if len(set(out)) != len(out):
        seen: set[int] = set()
        dup = sorted({i for i in out if i in seen or seen.add(i)})
        raise ValueError(f"{what} has duplicates: {dup[:8]}")
    return out


def select(cfg: ModelConfig, layers: Iterable[int] | None = None,
           experts: Iterable[int] | Mapping[int, Iterable[int]] | None = None, preset: str | None = None
           ) -> Selection:
    """The subset of ``cfg`` keeping ``layers`` (all when None) and ``experts`` (the same ids for every kept MoE
    layer, a mapping original layer -> ids, or all when None). ``preset`` ("k3-shard") checks the result against
    that preset's structure. Anything not representable or contradicting is a ``ValueError``."""
    kept = tuple(sorted(_ids("layers", range(cfg.num_hidden_layers) if layers is None else layers,
                             cfg.num_hidden_layers)))
    kinds = [cfg.ffn(L) for L in kept]
    n_dense = next((i for i, k in enumerate(kinds) if k == "moe"), len(kinds))
    if "dense" in kinds[n_dense:]:
        pairs = list(zip(kept, kinds))
        raise ValueError(f"layers {list(kept)}: a dense layer after a MoE layer ({pairs})"
                         " is not expressible as a model config (dense layers must come first)")
    moe = [L for L, k in zip(kept, kinds) if k == "moe"]
    chosen: dict[int, tuple[int, ...]] = {}
    E = cfg.n_routed_experts
    if isinstance(experts, Mapping):
        extra = sorted(set(experts) - set(moe))
        missing = sorted(set(moe) - set(experts))
        if extra or missing:
            raise ValueError(f"experts mapping must name exactly the kept MoE layers {moe}: "
                             f"{'extra ' + str(extra) if extra else ''}{' ' if extra and missing else ''}"
                             f"{'missing ' + str(missing) if missing else ''}")
        chosen = {L: _ids(f"experts of layer {L}", experts[L], E) for L in moe}
    elif moe:
        ids = _ids("experts", range(E) if experts is None else experts, E)
        chosen = {L: ids for L in moe}
    elif experts is not None:
        raise ValueError(f"experts were given but none of layers {list(kept)} is a MoE layer")
    counts = {len(v) for v in chosen.values()}
    if len(counts) > 1:
        raise ValueError(f"every kept MoE layer must keep the same number of experts, got "
                         f"{ {L: len(v) for L, v in chosen.items()} }")
    n = counts.pop() if counts else E
    changes: dict = dict(num_hidden_layers=len(kept), kda_layers=tuple(j for j, L in enumerate(kept)
                                                                       if cfg.mixer(L) == "kda"),
                         first_k_dense_replace=n_dense, moe_layer_freq=1,
                         name=f"{cfg.name or cfg.family}[subset]", extra={})
    if moe:
        if n < cfg.num_experts_per_tok:
            raise ValueError(f"keeping {n} experts per layer is fewer than the router's top-k "
                             f"({cfg.num_experts_per_tok})")
        if cfg.n_group > 1 and n != E:
            raise ValueError(f"grouped routing (n_group={cfg.n_group}) is not defined on a subset of experts")
        changes["n_routed_experts"] = n
    elif cfg.n_routed_experts:
        changes.update(n_routed_experts=0, num_experts_per_tok=0)
    sel = Selection(kept, chosen, cfg, cfg.replace(**changes))
    if preset is not None:
        _check_preset(sel, preset)
    return sel


def _check_preset(sel: Selection, preset: str) -> None:
    if preset != "k3-shard":
        raise ValueError(f"subset preset must be 'k3-shard', got {preset!r}")
    p, c = get_preset(preset), sel.config
    want_kinds = [p.mixer(i) for i in range(p.num_hidden_layers)]
    got_kinds = [c.mixer(i) for i in range(c.num_hidden_layers)]
    problems = []
    if c.num_hidden_layers != p.num_hidden_layers:
        problems.append(f"{c.num_hidden_layers} layers, not {p.num_hidden_layers}")
    elif got_kinds != want_kinds:
        problems.append(f"layer kinds {got_kinds}, not {want_kinds}")
    if any(b - a != 1 for a, b in zip(sel.layers, sel.layers[1:])):
        problems.append(f"layers {list(sel.layers)} are not consecutive")
    if len(sel.experts) != len(sel.layers):
        problems.append(f"layers {[L for L in sel.layers if L not in sel.experts]} are not MoE layers")
    n = p.n_routed_experts
    ranges = {ids for ids in sel.experts.values()}
    if len(ranges) != 1 or (r := next(iter(ranges)))[0] % n or r != tuple(range(r[0], r[0] + n)):
        problems.append(f"experts must be r*{n} .. r*{n}+{n - 1} of one rank r in every layer")
    if c.num_experts_per_tok != p.num_experts_per_tok:
        problems.append(f"top-{c.num_experts_per_tok} routing, not top-{p.num_experts_per_tok}")
    for f in ("attn_res_block_size", "hidden_act", "mla_use_nope", "mla_use_output_gate", "kda_full_rank_gate"):
        if (getattr(c, f) is None) != (getattr(p, f) is None) or (isinstance(getattr(p, f), bool)
                                                                   and getattr(c, f) != getattr(p, f)):
            problems.append(f"{f}={getattr(c, f)!r} where the preset has {getattr(p, f)!r}")
    if c.moe_latent_size is None:
        problems.append("no LatentMoE (the preset's experts work at the latent width)")
    if problems:
        raise ValueError(f"subset layers {list(sel.layers)} contradicts the k3-shard preset: " + "; ".join(problems))


def k3_shard_selection(cfg: ModelConfig, rank: int, first_layer: int | None = None
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layers, experts) of the k3-shard cut for expert-parallel ``rank``: the four consecutive MoE layers starting
    at ``first_layer`` (default: the first run whose kinds are KDA, KDA, KDA, MLA) and experts r·56 … r·56+55."""
    p = get_preset("k3-shard")
    n, want = p.n_routed_experts, [p.mixer(i) for i in range(p.num_hidden_layers)]
    ranks = cfg.n_routed_experts // n if cfg.n_routed_experts % n == 0 else 0
    if not ranks:
        raise ValueError(f"{cfg.n_routed_experts} routed experts do not split into ranks of {n}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise ValueError(f"rank must be an int in 0..{ranks - 1}, got {rank!r}")
    L = p.num_hidden_layers

    def fits(s: int) -> bool:
        return 0 <= s and s + L <= cfg.num_hidden_layers and all(
            cfg.ffn(s + i) == "moe" and cfg.mixer(s + i) == want[i] for i in range(L))

    if first_layer is None:
        first_layer = next((s for s in range(cfg.num_hidden_layers) if fits(s)), None)
        if first_layer is None:
            raise ValueError(f"no {L} consecutive MoE layers with kinds {want} in this config")
    elif not fits(first_layer):
        got = [(cfg.mixer(s), cfg.ffn(s)) for s in range(first_layer, min(first_layer + L, cfg.num_hidden_layers))]
        raise ValueError(f"layers from {first_layer} are {got}, not {L} MoE layers with kinds {want}")
    return tuple(range(first_layer, first_layer + L)), tuple(range(rank * n, rank * n + n))


def slice_model(model: torch.nn.Module, sel: Selection) -> torch.nn.Module:
    """The subset cut from an already loaded model (the reference a subset load must equal)."""
    from kimik3.model.random_init import build_model

    sub = build_model(sel.config, "meta").to_empty(device=model.device)
    sub.reset_buffers()
    src = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in sub.named_parameters():
            m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
            if not m:
                p.data = src[name].data.clone()
                continue
            L = sel.layers[int(m.group(1))]
            t = src[f"model.layers.{L}.{m.group(2)}"].data
            ids = sel.experts.get(L)
            if ids is not None and (".experts." in name or ".gate." in name):
                t = t[torch.tensor(ids, dtype=torch.long)]
            p.data = t.clone()
    return sub.eval()
