"""Expert parallelism (EP) for decode on a real ``torch.distributed`` engine (gloo on CPU, NCCL on GPUs).

K3's routed experts are 98% of its parameters (spec §8.2), so a serving stack spreads them over ranks and moves
*activations* to the experts. This is that engine at reference quality: the numerics of
:class:`kimik3.model.modeling.MoE`, checked against a single process. Every rank holds all but the routed experts
plus a block of ``E / world`` of them (:func:`shard_experts`) and owns a block of the batch's rows; per MoE layer
it routes its tokens, ships their latent rows (§5.3) to the experts' ranks with two ``all_to_all_single`` calls and
combines the outputs as the reference does; :class:`CollectiveStats` logs every collective. Usage: every rank runs
``kimik3.Decoder(model, stage="expert-parallel", ...)`` on the same inputs (the import registers the stage);
``torchrun --nproc-per-node 2 -m kimik3.scale.expert_parallel --preset micro``, or :func:`run_local` (N local CPU
processes). Layout and collectives: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kimik3.model.config import ModelConfig, get_preset
from kimik3.model.modeling import KimiForCausalLM, MoE
from kimik3.scale import launch
from kimik3.scale.launch import seeded_prompt
from kimik3.stages import register_stage
from kimik3.stages.base import Stage, StageSupport
from kimik3.validation.metric import TOL, rel_error

__all__ = [
    "CollectiveRecord",
    "CollectiveStats",
    "ExpertParallelMoE",
    "ExpertParallelStage",
    "expert_range",
    "main",
    "owned_rows",
    "run_expert_parallel",
    "run_local",
    "shard_experts",
    "traffic_model",
]

_DEFAULT_TIMEOUT_S = 300.0


# ====================================================================== bookkeeping


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as seen by one rank.

    ``sent``/``received`` count the whole send/receive buffers (the chunk a rank addresses to itself included:
    that is what the formulas ``tokens·k·width·elem`` describe); ``sent_remote``/``received_remote`` only the
    bytes delivered to / from other ranks (for an all_gather: this rank's block once per other rank).
    ``hidden_equiv`` (dispatch/combine only) is what the same rows would cost at the hidden width, i.e. without
    LatentMoE.
    """

    op: str  # "all_to_all" | "all_gather"
    purpose: str  # "routing" | "dispatch" | "combine" | "logits"
    phase: str  # "prefill" | "step" | "forward" (a sharded model called outside the stage)
    layer: int  # decoder layer index; -1 for per-step collectives
    sent: int
    received: int
    sent_remote: int
    received_remote: int
    rows: int = 0  # (token, expert) rows in the send buffer (dispatch) / receive buffer (combine)
    hidden_equiv: int = 0


@dataclass
class CollectiveStats:
    """Every collective one rank issued, plus the counters needed to normalise them per step and per token."""

    rank: int
    world: int
    records: list[CollectiveRecord] = field(default_factory=list)
    steps: int = 0  # decode steps (Stage.step calls)
    prefills: int = 0
    tokens: Counter = field(default_factory=Counter)  # phase -> global tokens pushed through the model
    local_tokens: Counter = field(default_factory=Counter)  # phase -> tokens this rank owned

    def record(self, rec: CollectiveRecord) -> None:
        self.records.append(rec)

    def reset(self) -> None:
        self.records.clear()
        self.steps = self.prefills = 0
        self.tokens.clear()
        self.local_tokens.clear()

    def calls(self, phase: str = "step") -> Counter:
        """Number of calls per ``op`` and per ``op/purpose`` in ``phase``."""
        c: Counter = Counter()
        for r in self.records:
            if r.phase == phase:
                c[r.op] += 1
                c[f"{r.op}/{r.purpose}"] += 1
        return c

    def bytes(self, phase: str = "step") -> dict[str, Counter]:
        """Byte totals in ``phase`` per purpose: sent, received, sent_remote, received_remote, hidden_equiv."""
        out = {k: Counter() for k in ("sent", "received", "sent_remote", "received_remote", "hidden_equiv")}
        for r in self.records:
            if r.phase == phase:
                for k in out:
                    out[k][r.purpose] += getattr(r, k)
        return out

    def summary(self, phase: str = "step") -> dict[str, Any]:
        """Per-step (and per-token) view of ``phase``: what the launcher prints and the tests check."""
        n = self.steps if phase == "step" else max(self.prefills, 1)
        n = max(n, 1)
        calls, b = self.calls(phase), self.bytes(phase)
        tok = self.tokens[phase] / n  # global tokens per step
        ltok = self.local_tokens[phase] / n
        moe_layers = len({r.layer for r in self.records if r.phase == phase and r.purpose == "dispatch"})
        latent, hidden = b["sent"]["dispatch"] / n, b["hidden_equiv"]["dispatch"] / n
        return {
            "rank": self.rank,
            "world": self.world,
            "phase": phase,
            "steps": n,
            "moe_layers": moe_layers,
            "tokens_per_step": tok,
            "local_tokens_per_step": ltok,
            "calls_per_step": {k: v / n for k, v in sorted(calls.items())},
            "bytes_sent_per_step": {k: v / n for k, v in sorted(b["sent"].items())},
            "bytes_received_per_step": {k: v / n for k, v in sorted(b["received"].items())},
            "bytes_sent_remote_per_step": {k: v / n for k, v in sorted(b["sent_remote"].items())},
            "bytes_received_remote_per_step": {k: v / n for k, v in sorted(b["received_remote"].items())},
            "dispatch_bytes_per_step": latent,
            "hidden_dispatch_bytes_per_step": hidden,
            "dispatch_saving": 1.0 - latent / hidden if hidden else 0.0,
            "dispatch_bytes_per_local_token_per_layer": latent / (ltok * moe_layers) if ltok and moe_layers else 0.0,
        }


def traffic_model(cfg: ModelConfig | str, batch: int, world: int, elem_size: int = 2) -> dict[str, float]:
    """Expected EP traffic per decode step for the whole model (all ranks together), from the config alone.

    Why: the measured stats only exist for models that fit here; this gives the same numbers for K3. Dispatch and
    combine each move ``batch·k`` rows of the expert width (latent for LatentMoE, hidden otherwise) per MoE layer;
    under uniform routing a fraction ``(world−1)/world`` of them leaves its rank.
    """
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    layers = len(cfg.moe_layers)
    k, width, hidden = cfg.num_experts_per_tok, cfg.expert_in_dim, cfg.hidden_size
    per_layer = batch * k * width * elem_size
    per_layer_hidden = batch * k * hidden * elem_size
    remote = (world - 1) / world
    return {
        "moe_layers": layers,
        "dispatch_bytes_per_layer": per_layer,
        "hidden_dispatch_bytes_per_layer": per_layer_hidden,
        "dispatch_plus_combine_bytes_per_step": 2 * layers * per_layer,
        "hidden_dispatch_plus_combine_bytes_per_step": 2 * layers * per_layer_hidden,
        "expected_remote_bytes_per_step": 2 * layers * per_layer * remote,
        "routing_bytes_per_step": layers * batch * k * 4,
        "all_to_all_calls_per_step": 2 * layers,
        "saving": 1.0 - width / hidden,
    }


# ====================================================================== sharding


def expert_range(n_experts: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of the contiguous expert block rank ``rank`` holds; the experts must divide evenly."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank!r}")
    if n_experts % world:
        raise ValueError(f"expert parallelism gives each rank a contiguous block of E/world experts, but "
                         f"n_routed_experts={n_experts} is not divisible by world size {world}; use a world size "
                         f"that divides {n_experts}")
    per = n_experts // world
    return rank * per, (rank + 1) * per


def owned_rows(batch: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of the batch rows rank ``rank`` owns: contiguous blocks, the first ``batch % world`` ranks one more.

    Contiguous blocks keep every expert's input rows in the reference's token order after the dispatch.
    """
    base, extra = divmod(batch, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


@dataclass
class _EPContext:
    """What all sharded MoE layers of one model share: the group, this rank's place in it, the stats."""

    rank: int
    world: int
    group: Any  # dist.ProcessGroup | None (None: the default group)
    stats: CollectiveStats
    phase: str = "forward"
    batch: int | None = None  # global batch of the current stage call (fixes the routing padding); None: ask


class ExpertParallelMoE(MoE):
    """A :class:`kimik3.model.modeling.MoE` whose routed experts live on ``world`` ranks; this rank keeps ``[lo, hi)``.

    Adopts the original module's replicated parts (router, latent projections and norm, shared experts) as they
    are, so parameter names stay those of the checkpoint; ``experts.w1/w3/w2`` keep only the local block.
    ``forward`` takes the rows this rank owns and must be called by every rank of the group in lockstep (a rank
    that owns no rows passes an empty ``[0, H]`` tensor).
    """

    def __init__(self, moe: MoE, layer: int, ctx: _EPContext) -> None:
        nn.Module.__init__(self)
        self.cfg = moe.cfg
        for name, child in moe.named_children():
            setattr(self, name, child)
        for name in ("routed_expert_norm", "shared_experts"):  # plain None attributes on MoE when absent
            if name in moe.__dict__:
                setattr(self, name, moe.__dict__[name])
        self.layer = layer
        self.ctx = ctx
        self.first_expert, self.last_expert = expert_range(self.cfg.n_routed_experts, ctx.rank, ctx.world)
        ex = self.experts
        for name in ("w1", "w3", "w2"):  # clone the slice so the full stacked tensor can be freed
            full = getattr(ex, name)
            setattr(ex, name, nn.Parameter(full.data[self.first_expert:self.last_expert].clone(),
                                           requires_grad=full.requires_grad))

    @property
    def num_local_experts(self) -> int:
        return self.last_expert - self.first_expert

    # ------------------------------------------------------------------ collectives
    @property
    def _communicates(self) -> bool:
        """Collectives run whenever a process group exists (a one-rank group too: same code path as N ranks);
        a model sharded for one rank without any group exchanges nothing and records nothing."""
        return self.ctx.world > 1 or (dist.is_available() and dist.is_initialized())

    def _check_group(self) -> None:
        if self.ctx.world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"layer {self.layer}: this model is sharded over {self.ctx.world} ranks; its MoE "
                               "layers need an initialised torch.distributed process group")

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if not self._communicates:
            return t[None].clone()
        parts = [torch.empty_like(t) for _ in range(self.ctx.world)]
        dist.all_gather(parts, t.contiguous(), group=self.ctx.group)
        return torch.stack(parts, 0)

    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        if not self._communicates:
            recv.copy_(send)
        else:
            dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=self.ctx.group)
        return recv

    def _log(self, op: str, purpose: str, sent: int, received: int, sent_remote: int, received_remote: int,
             rows: int = 0, hidden_equiv: int = 0) -> None:
        if not self._communicates:
            return  # nothing was exchanged
        self.ctx.stats.record(CollectiveRecord(op, purpose, self.ctx.phase, self.layer, sent, received,
                                               sent_remote, received_remote, rows, hidden_equiv))

    # ------------------------------------------------------------------ the layer
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: normed FFN input of the rows this rank owns, [N, H] (N may be 0). Returns [N, H]."""
        self._check_group()
        cfg, ctx = self.cfg, self.ctx
        N, k, El, W = x.shape[0], cfg.num_experts_per_tok, self.num_local_experts, ctx.world
        w, idx = self.gate(x)  # [N, k] fp32 / int64; the router is replicated, so this is the reference routing
        xl = self.to_latent(x)  # [N, D]: once per token, before any communication (pitfall 13)
        D, esize = xl.shape[-1], xl.element_size()

        # routing decisions of every rank, each block padded with -1 to the largest owned block
        n_max = self._max_rows(N)
        mine = torch.full((n_max, k), -1, dtype=torch.int32, device=x.device)
        mine[:N] = idx.to(torch.int32)
        every = self._all_gather(mine)  # [W, n_max, k]
        blk = mine.numel() * 4
        self._log("all_gather", "routing", blk, blk * W, blk * (W - 1), blk * (W - 1))

        # split sizes, all derived locally: per source s and expert e, how many rows s sends to e
        E = cfg.n_routed_experts
        counts = torch.stack([torch.bincount(every[s][every[s] >= 0].long(), minlength=E) for s in range(W)])
        per_rank = counts.view(W, W, El).sum(-1)  # [source, destination]
        send_splits = per_rank[ctx.rank].tolist()
        recv_splits = per_rank[:, ctx.rank].tolist()

        # dispatch: pairs sorted by expert (hence by destination rank, then local expert), token order kept
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        send = xl[order // k]  # [N·k, D]
        recv = self._all_to_all(send, send_splits, recv_splits)
        row, self_bytes = D * esize, send_splits[ctx.rank] * D * esize  # the chunk a rank addresses to itself
        self._log("all_to_all", "dispatch", send.shape[0] * row, recv.shape[0] * row, send.shape[0] * row - self_bytes,
                  recv.shape[0] * row - self_bytes, rows=send.shape[0],
                  hidden_equiv=send.shape[0] * cfg.hidden_size * esize)

        # the local experts, each on all of its rows at once (sources in rank order = reference token order)
        local = counts[:, self.first_expert:self.last_expert]  # [W, El]
        expert_of_row = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(W), local.reshape(-1))
        y = torch.empty_like(recv)
        for e in expert_of_row.unique().tolist():
            rows = (expert_of_row == e).nonzero(as_tuple=True)[0]
            y[rows] = self.expert(e, recv[rows])

        # combine: outputs go back to their owners in the order they were sent
        back = self._all_to_all(y, recv_splits, send_splits)
        self._log("all_to_all", "combine", y.shape[0] * row, back.shape[0] * row, y.shape[0] * row - self_bytes,
                  back.shape[0] * row - self_bytes, rows=back.shape[0],
                  hidden_equiv=y.shape[0] * cfg.hidden_size * esize)
        y_pairs = torch.empty_like(back)
        y_pairs[order] = back
        y_pairs = y_pairs.view(N, k, D)

        # exactly the reference order: per expert in ascending id, fp32(y)·w accumulated in fp32, cast once
        acc = torch.zeros((N, D), dtype=torch.float32, device=x.device)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            acc.index_add_(0, rows, y_pairs[rows, slot].float() * w[rows, slot, None])
        out = self.from_latent(acc.to(x.dtype))  # latent norm on the combined sum + up-projection, on the owner
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _max_rows(self, n: int) -> int:
        """Largest row count of any rank in this call. Inside the stage it follows from the global batch; a sharded
        model called directly agrees on it with one tiny extra all_gather."""
        if self.ctx.world == 1:
            return n
        if self.ctx.batch is not None:
            return math.ceil(self.ctx.batch / self.ctx.world)
        every = self._all_gather(torch.tensor([n], dtype=torch.int64, device=self.experts.w1.device))
        W = self.ctx.world
        self._log("all_gather", "rows", 8, 8 * W, 8 * (W - 1), 8 * (W - 1))
        return int(every.max())


def shard_experts(model: KimiForCausalLM, rank: int, world: int, group: Any = None) -> KimiForCausalLM:
    """Keep only this rank's contiguous block of ``E / world`` routed experts in every MoE layer, in place.

    Why in place: the point is memory — the non-local expert weights (98% of K3) are released as soon as the
    returned model is the only reference to them. The MoE modules become :class:`ExpertParallelMoE`, which run
    the dispatch/combine collectives over ``group`` (default: the world group) at forward time; nothing else
    changes. Calling it again with the same ``rank``/``world`` is a no-op; different ones are an error.
    """
    if not isinstance(model, KimiForCausalLM):
        raise ValueError(f"shard_experts needs a kimik3 model, got {type(model)}")
    cfg = model.config
    if not cfg.moe_layers:
        raise ValueError(f"model {cfg.name or cfg.family!r} has no MoE layers: nothing to shard")
    expert_range(cfg.n_routed_experts, rank, world)  # validates rank/world/divisibility with a clear message
    existing = _ep_context(model)
    if existing is not None:
        if (existing.rank, existing.world) != (rank, world):
            raise ValueError(f"model is already sharded as rank {existing.rank} of {existing.world}; "
                             f"cannot reshard it as rank {rank} of {world} (the other experts are gone)")
        return model
    ctx = _EPContext(rank=rank, world=world, group=group, stats=CollectiveStats(rank, world))
    for i, layer in enumerate(model.model.layers):
        if layer.is_moe:
            layer.block_sparse_moe = ExpertParallelMoE(layer.block_sparse_moe, i, ctx)
    return model


def _ep_context(model: KimiForCausalLM) -> _EPContext | None:
    for layer in model.model.layers:
        if layer.is_moe and isinstance(layer.block_sparse_moe, ExpertParallelMoE):
            return layer.block_sparse_moe.ctx
    return None


# ====================================================================== the stage


@register_stage
class ExpertParallelStage(Stage):
    """Stage "expert-parallel": the naive per-token path with EP MoE layers, as one rank of a process group.

    Every rank builds the same model and a :class:`kimik3.Decoder` with the same batch size and calls it with
    the same inputs; each rank keeps caches only for the rows it owns (:func:`owned_rows`) and returns the full
    ``[B, vocab]`` logits (one ``all_gather`` per call), so greedy decoding agrees on every rank. The model is
    sharded in place on construction (:func:`shard_experts`) unless it already is. Prefill runs token by token.
    Option ``group``: the process group (default: the world group).
    """

    name = "expert-parallel"
    support = StageSupport(deterministic=True)

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, group: Any = None) -> None:
        super().__init__(model, batch_size, max_seq_len)
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("stage 'expert-parallel' needs an initialised torch.distributed process group "
                             "(torch.distributed.init_process_group, e.g. under torchrun); for one process use "
                             "stage 'naive'")
        backend = str(dist.get_backend(group)).lower()
        dev = model.device.type
        if dev == "cuda" and "nccl" not in backend:
            raise ValueError(f"stage 'expert-parallel': a CUDA model needs the nccl backend, the group uses {backend}")
        if dev == "cpu" and "gloo" not in backend:
            raise ValueError(f"stage 'expert-parallel': a CPU model needs the gloo backend, the group uses {backend}")
        self.rank, self.world, self.group = dist.get_rank(group), dist.get_world_size(group), group
        ctx = _ep_context(model)
        if ctx is not None and ctx.group is not group:
            raise ValueError("stage 'expert-parallel': the model was sharded for a different process group")
        shard_experts(model, self.rank, self.world, group)
        self.ctx = _ep_context(model)
        self.blocks = [owned_rows(batch_size, r, self.world) for r in range(self.world)]
        self.lo, self.hi = self.blocks[self.rank]
        self.n_max = math.ceil(batch_size / self.world)

    @property
    def stats(self) -> CollectiveStats:
        """The collectives this rank issued (shared by every MoE layer of the model)."""
        return self.ctx.stats

    @property
    def local_batch(self) -> int:
        return self.hi - self.lo

    def reset(self) -> None:
        self.state = self.model.new_state(self.local_batch, self.max_seq_len)

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[n_local, V] -> [B, V] on every rank (one all_gather of blocks padded to ceil(B / world) rows)."""
        pad = local.new_zeros((self.n_max, local.shape[-1]))
        pad[: local.shape[0]] = local
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        dist.all_gather(parts, pad, group=self.group)
        nb = pad.numel() * pad.element_size()
        self.stats.record(CollectiveRecord("all_gather", "logits", self.ctx.phase, -1, nb, nb * self.world,
                                           nb * (self.world - 1), nb * (self.world - 1)))
        return torch.cat([parts[r][: hi - lo] for r, (lo, hi) in enumerate(self.blocks)], 0)

    def _enter(self, phase: str) -> None:
        self.ctx.phase, self.ctx.batch = phase, self.batch_size

    def _leave(self) -> None:
        self.ctx.phase, self.ctx.batch = "forward", None

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.reset()
        ids, lens = input_ids[self.lo:self.hi], lengths[self.lo:self.hi]
        n, T = ids.shape[0], input_ids.shape[1]
        out = torch.full((n, self.model.config.vocab_size), float("nan"), device=input_ids.device)
        self._enter("prefill")
        try:
            for t in range(T):  # every rank runs all T positions: the MoE collectives need lockstep
                active = t < lens
                pos = torch.full((n, 1), t, device=input_ids.device, dtype=torch.long)
                logits = self.model.forward_tokens(ids[:, t : t + 1], self.state, pos, active[:, None])
                last = lens == t + 1
                out[last] = logits[last, 0]
            full = self._gather_logits(out)
        finally:
            self._leave()
        st = self.stats
        st.prefills += 1
        st.tokens["prefill"] += int(lengths.sum())
        st.local_tokens["prefill"] += int(lens.sum())
        return full

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._enter("step")
        try:
            local = self.model.forward_tokens(ids[self.lo:self.hi, None], self.state,
                                              positions[self.lo:self.hi, None])[:, 0]
            full = self._gather_logits(local)
        finally:
            self._leave()
        st = self.stats
        st.steps += 1
        st.tokens["step"] += self.batch_size
        st.local_tokens["step"] += self.local_batch
        return full


# ====================================================================== a run, the launcher, local spawning


@torch.no_grad()
def _greedy(dec: Any, prompt: torch.Tensor, steps: int, lengths: list[int] | None = None) -> torch.Tensor:
    """Prefill, then ``steps`` greedy decode steps: fp32 logits [steps + 1, B, V] (prefill's first)."""
    out = [dec.prefill(prompt, lengths)]
    for _ in range(steps):
        out.append(dec.step(out[-1].argmax(-1)))
    return torch.stack(out, 0).float()


def run_expert_parallel(preset: str | ModelConfig = "micro", batch: int = 1, steps: int = 16, seed: int = 0,
                        prompt_len: int = 4, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        group: Any = None, reference: bool = True, lengths: list[int] | None = None
                        ) -> dict[str, Any]:
    """One EP greedy run on this rank (process group already initialised), optionally against one process.

    Every rank builds the same weights with :func:`kimik3.from_preset`; with ``reference`` rank 0 first decodes
    with the single-process ``naive`` stage on those weights (before sharding frees the other experts) and the
    result carries the per-step errors and whether the greedy tokens agree. ``lengths`` right-pads the prompt
    (rows shorter than ``prompt_len``). Returns plain data (logits, tokens, the stats summaries) that
    :func:`run_local` ships back to the parent.
    """
    from kimik3 import Decoder, from_preset  # late: kimik3/__init__ can then import this module without a cycle

    rank = dist.get_rank(group)
    model = from_preset(preset, seed=seed, dtype=dtype, device=device)
    prompt = seeded_prompt(model.config.vocab_size, batch, prompt_len, seed).to(device)
    max_len = prompt_len + steps + 1
    ref = None
    t0 = time.perf_counter()
    if reference and rank == 0:
        ref = _greedy(Decoder(model, "naive", batch_size=batch, max_seq_len=max_len), prompt, steps, lengths)
    t_ref = time.perf_counter() - t0
    params_before = sum(p.numel() for p in model.parameters())
    dec = Decoder(model, "expert-parallel", batch_size=batch, max_seq_len=max_len, group=group)
    params_after = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    logits = _greedy(dec, prompt, steps, lengths)
    t_ep = time.perf_counter() - t0
    result: dict[str, Any] = {
        "rank": rank, "world": dec.stage.world, "preset": model.config.name, "batch": batch, "steps": steps,
        "seed": seed, "owned_rows": [dec.stage.lo, dec.stage.hi], "prompt": prompt.cpu(), "logits": logits.cpu(),
        "tokens": logits.argmax(-1).T.cpu(),  # [B, steps + 1]
        "params_before_shard": params_before, "params_after_shard": params_after,
        "summary_step": dec.stage.stats.summary("step"), "summary_prefill": dec.stage.stats.summary("prefill"),
        "seconds_ep": t_ep, "seconds_reference": t_ref,
    }
    if ref is not None:
        errors = [rel_error(logits[i], ref[i]) for i in range(steps + 1)]
        ref_tokens = ref.argmax(-1).T.cpu()
        result.update(errors=errors, max_error=max(errors), reference_tokens=ref_tokens,
                      tokens_match=bool(torch.equal(result["tokens"], ref_tokens)),
                      ok=bool(max(errors) <= TOL["expert_parallel"] and torch.equal(result["tokens"], ref_tokens)))
    return result


def _fmt_bytes(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.0f} B" for k, v in d.items())


def _report(res: dict[str, Any]) -> str:
    s = res["summary_step"]
    lines = [
        f"[rank {res['rank']}/{res['world']}] rows {res['owned_rows']}, params {res['params_before_shard']:,} -> "
        f"{res['params_after_shard']:,} after shard_experts; {s['steps']} steps in {res['seconds_ep']:.2f} s",
        f"[rank {res['rank']}/{res['world']}] calls/step {dict(s['calls_per_step'])}",
        f"[rank {res['rank']}/{res['world']}] sent/step {_fmt_bytes(s['bytes_sent_per_step'])}; "
        f"received/step {_fmt_bytes(s['bytes_received_per_step'])}",
        f"[rank {res['rank']}/{res['world']}] remote sent/step {_fmt_bytes(s['bytes_sent_remote_per_step'])}",
        f"[rank {res['rank']}/{res['world']}] dispatch {s['dispatch_bytes_per_step']:,.0f} B/step latent vs "
        f"{s['hidden_dispatch_bytes_per_step']:,.0f} B/step at hidden width (saving {s['dispatch_saving']:.1%})",
    ]
    return "\n".join(lines)


def _init_from_env(backend: str, timeout_s: float) -> bool:
    """Join the torchrun group from the environment, or make a one-rank group (no network) without torchrun.
    Returns True when this call created the group (and so should destroy it)."""
    if dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.scale.expert_parallel`` / ``torchrun --nproc-per-node N -m kimik3.scale.expert_parallel``:
    EP greedy decode, per-rank collective stats, and on rank 0 the tokens and the error vs a single-process decode.
    Exit status 1 on rank 0 when the check fails."""
    ap = argparse.ArgumentParser(prog="python -m kimik3.scale.expert_parallel", description=main.__doc__)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads per rank (0: leave as is)")
    ap.add_argument("--timeout", type=float, default=_DEFAULT_TIMEOUT_S, help="collective timeout, seconds")
    ap.add_argument("--no-reference", action="store_true", help="skip the single-process comparison")
    ap.add_argument("--json", default=None, help="rank 0 writes its result (without logits) here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    created = _init_from_env("nccl" if args.device == "cuda" else "gloo", args.timeout)
    try:
        res = run_expert_parallel(args.preset, args.batch, args.steps, args.seed, args.prompt_len,
                                  getattr(torch, args.dtype), args.device if args.device == "cpu" else
                                  f"cuda:{torch.cuda.current_device()}", reference=not args.no_reference)
        rank, world = res["rank"], res["world"]
        for r in range(world):  # print rank by rank so the per-rank blocks do not interleave
            if r == rank:
                print(_report(res), flush=True)
            dist.barrier()
        status = 0
        if rank == 0:
            tm = traffic_model(args.preset, args.batch, world, 2 if args.dtype == "bfloat16" else 4)
            print(f"model: dispatch+combine {tm['dispatch_plus_combine_bytes_per_step']:,.0f} B/step (all ranks; "
                  f"hidden width: {tm['hidden_dispatch_plus_combine_bytes_per_step']:,.0f} B), "
                  f"{tm['all_to_all_calls_per_step']} all_to_all per step", flush=True)
            print("greedy tokens (per row, prefill's first):")
            for b, row in enumerate(res["tokens"].tolist()):
                print(f"  row {b}: {row}")
            if "errors" in res:
                print("per-step error: " + " ".join(f"{e:.1e}" for e in res["errors"]))
                print(f"max error {res['max_error']:.3e} (tolerance {TOL['expert_parallel']:.0e}); "
                      f"tokens match single process: {res['tokens_match']}; {'PASS' if res['ok'] else 'FAIL'}")
                status = 0 if res["ok"] else 1
            if args.json:
                keep = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in res.items() if k != "logits"}
                Path(args.json).write_text(json.dumps(keep, indent=1))
        # every rank waits for rank 0's report before any tears gloo down: a rank that left early while rank 0
        # still ran was aborted at exit ("terminate called without an active exception")
        dist.barrier()
        return status
    finally:
        if created:
            dist.destroy_process_group()


def run_local(world: int, timeout_s: float = _DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[dict[str, Any]]:
    """Run :func:`run_expert_parallel` on ``world`` freshly spawned local CPU processes; one result per rank
    (:func:`kimik3.scale.launch.run_local`: file-store rendezvous, loopback gloo, a hard deadline of ``timeout_s``
    after which the processes are killed and TimeoutError raised)."""
    return launch.run_local(world, "kimik3.scale.expert_parallel:run_expert_parallel", timeout_s, prefix="kimik3-ep-",
                            **kwargs)


if __name__ == "__main__":
    # Run main() from the importable module, not from this __main__ copy: the stage registry and the isinstance
    # checks must all see one ExpertParallelMoE / ExpertParallelStage class.
    import importlib

    sys.exit(importlib.import_module("kimik3.scale.expert_parallel").main())
