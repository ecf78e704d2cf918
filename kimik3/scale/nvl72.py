"""Full-size Kimi K3 on a rack: per-GPU bytes, all-to-all exchanges, NVLink time, overlap, tokens/s per user.

Serving K3 spreads it over many GPUs (a GB300 NVL72 rack, or 16 GB200s), and a decode step then costs the bytes
each GPU reads from its own HBM plus the exchanges between GPUs — two all-to-alls per MoE layer (dispatch, combine).
This turns the cost model (:func:`kimik3.perf.cost.decode_cost`, §8), the EP traffic of
:func:`kimik3.scale.expert_parallel.traffic_model` and the datasheet ceilings (``data/hardware.json``) into a
per-step time for a stated :class:`Deployment` (experts sharded over ``ep`` GPUs, the rest tensor-parallel over
``tp``, collectives costed by :class:`CommModel`, a fraction ``overlap`` of communication hidden behind local
work), and sets the published figures (``data/published.json``) against it; nothing here carries a byte count of
its own. These are lower bounds of an idealised system, not predictions of a serving stack. The assumptions in
full: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kimik3.model.config import ModelConfig, get_preset
from kimik3.perf.cost import DecodeCost, decode_cost
from kimik3.perf.hardware import HardwareSpec, get_hardware
from kimik3.scale.expert_parallel import traffic_model

__all__ = [
    "CommModel",
    "DEPLOYMENTS",
    "Deployment",
    "all_to_all_table",
    "claims_vs_scaleout",
    "collectives_per_step",
    "comm_time",
    "experts_per_gpu",
    "gpu_bytes",
    "overlap_step_time",
    "per_gpu_bytes",
    "per_layer_budget",
    "prediction_table",
    "shard_per_layer",
    "step_time",
]

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


# ====================================================================== deployments and links


@dataclass(frozen=True)
class Deployment:
    """A way to lay K3 out on ``gpus`` GPUs of kind ``hardware`` (a ``data/hardware.json`` key): experts over
    ``ep`` GPUs (default all), the rest tensor-parallel in groups of ``tp`` (1 = replicated / data-parallel
    attention). ``act_dtype``: what the all-to-alls and all-reduces carry."""

    name: str
    hardware: str
    gpus: int
    tp: int = 1
    ep: int | None = None
    weight_dtype: str = "bf16"
    expert_dtype: str = "mxfp4"
    kv_dtype: str = "bf16"
    act_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.gpus % self.tp:
            raise ValueError(f"{self.name}: tp={self.tp} must divide gpus={self.gpus}")
        if self.ep is not None and not 1 <= self.ep <= self.gpus:
            raise ValueError(f"{self.name}: ep={self.ep} must lie in 1..gpus={self.gpus}")
        get_hardware(self.hardware)  # unknown keys raise

    @property
    def ep_ranks(self) -> int:
        return self.ep or self.gpus

    @property
    def dp(self) -> int:
        """Data-parallel groups (attention replicas) the batch is split over."""
        return self.gpus // self.tp

    @property
    def spec(self) -> HardwareSpec:
        return get_hardware(self.hardware)

    def rows(self, batch: int) -> list[int]:
        """Sequences per data-parallel group: contiguous blocks, the first ``batch % dp`` groups one more."""
        base, extra = divmod(batch, self.dp)
        return [base + (1 if g < extra else 0) for g in range(self.dp)]


# The deployments the notebook compares. 72 GPUs of a GB300 NVL72 rack; 16 GB200s (the Inferact baseline).
DEPLOYMENTS: dict[str, Deployment] = {
    "gb300-nvl72-ep72-dp": Deployment("GB300 NVL72: EP72, attention replicated (DP)", "gb300", 72, tp=1),
    "gb300-nvl72-ep72-tp8": Deployment("GB300 NVL72: EP72, attention TP8 × DP9", "gb300", 72, tp=8),
    "gb300-nvl72-ep72-tp72": Deployment("GB300 NVL72: EP72, attention TP72", "gb300", 72, tp=72),
    "gb200-16-ep16-dp": Deployment("16×GB200: EP16, attention replicated (DP)", "gb200", 16, tp=1),
    "gb200-16-ep16-tp16": Deployment("16×GB200: EP16, attention TP16", "gb200", 16, tp=16),
}


@dataclass(frozen=True)
class CommModel:
    """Cost of one collective: a fixed latency plus bytes over the link. Defaults are assumptions (no NVL72
    all-to-all latency was measured here): ~10 µs for a small-message all-to-all across an NVLink switch domain
    (launch + two synchronisations), ~5 µs for an all-reduce; ``link_efficiency`` scales the datasheet NVLink
    bandwidth (one direction = half the bidirectional figure)."""

    a2a_latency_s: float = 10e-6
    allreduce_latency_s: float = 5e-6
    link_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.a2a_latency_s < 0 or self.allreduce_latency_s < 0 or not 0 < self.link_efficiency <= 1:
            raise ValueError(f"invalid CommModel {self}")


def _cfg(cfg: ModelConfig | str) -> ModelConfig:
    return get_preset(cfg) if isinstance(cfg, str) else cfg


_COST_CACHE: dict[tuple, DecodeCost] = {}


def _cost(cfg: ModelConfig, batch: int, context_len: int, dep: Deployment) -> DecodeCost:
    """:func:`decode_cost` for ``batch`` sequences under the deployment's storage dtypes (memoised: the notebook
    asks for the same few batch sizes many times)."""
    key = (cfg.name, cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts, batch, context_len,
           dep.weight_dtype, dep.expert_dtype, dep.kv_dtype, dep.act_dtype)
    if key not in _COST_CACHE:
        _COST_CACHE[key] = decode_cost(cfg, batch, context_len, weight_dtype=dep.weight_dtype,
                                       expert_dtype=dep.expert_dtype, kv_dtype=dep.kv_dtype, act_dtype=dep.act_dtype)
    return _COST_CACHE[key]


def _split(c: DecodeCost) -> dict[str, float]:
    """A step's bytes and FLOPs split into what sharding treats differently."""
    bb = c.by_block
    exp = bb["block"] == "experts"
    return {"non_expert_weights": c.weight_bytes - c.routed_expert_bytes, "expert_weights": c.routed_expert_bytes,
            "state_kv": c.state_bytes + c.kv_bytes, "activations": c.activation_bytes,
            "non_expert_flops": float(bb.loc[~exp, "flops"].sum()), "expert_flops": float(bb.loc[exp, "flops"].sum())}


# ====================================================================== bytes per GPU


def experts_per_gpu(n_experts: int, top_k: int, batch: int, ep: int) -> tuple[float, float]:
    """(mean, expected maximum over GPUs) of the distinct experts one GPU reads in one MoE layer, with ``ep`` GPUs
    holding ``n_experts`` between them (``E mod ep`` of them one more) and ``batch`` tokens each choosing
    ``top_k`` uniformly. Each expert is touched with ``p = 1 − (1 − k/E)^B`` (the D(B) rule), treated as
    independent across experts, so a GPU's count is binomial and ``P(max ≤ m) = Π_g F_g(m)``.

    Why the maximum: every MoE layer ends in a combine that waits for the slowest GPU, so at small batch the
    step pays the busiest GPU's expert reads in every layer (at batch 1 on 72 GPUs: about 2 experts, against a
    mean of 0.22)."""
    from math import comb

    if not 1 <= ep <= n_experts:
        raise ValueError(f"ep must lie in 1..{n_experts}, got {ep}")
    p = 1.0 - (1.0 - top_k / n_experts) ** batch
    base, extra = divmod(n_experts, ep)
    sizes = {base + 1: extra, base: ep - extra}
    sizes = {n: c for n, c in sizes.items() if c}

    def cdf(n: int, m: int) -> float:
        return sum(comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(min(m, n) + 1))

    e_max = 0.0
    for m in range(max(sizes)):  # E[max] = Σ_{m ≥ 0} P(max > m)
        e_max += 1.0 - math.prod(cdf(n, m) ** c for n, c in sizes.items())
    return n_experts * p / ep, e_max



def gpu_bytes(cfg: ModelConfig | str, batch: int, context_len: int, dep: Deployment) -> np.ndarray:
    """HBM bytes every GPU reads or writes in one decode step, one entry per GPU (GPU ``g·tp + j`` = member ``j``
    of data-parallel group ``g``; experts spread evenly over the first ``ep`` GPUs). Their sum is the cost
    model's total for the batch, plus one more read of the non-expert weights for every extra busy group."""
    cfg = _cfg(cfg)
    out = np.zeros(dep.gpus)
    for g, r in enumerate(dep.rows(batch)):
        if r:
            s = _split(_cost(cfg, r, context_len, dep))
            out[g * dep.tp:(g + 1) * dep.tp] += (s["non_expert_weights"] + s["state_kv"] + s["activations"]) / dep.tp
    out[:dep.ep_ranks] += _split(_cost(cfg, batch, context_len, dep))["expert_weights"] / dep.ep_ranks
    return out


def per_gpu_bytes(cfg: ModelConfig | str, batch: int, context_len: int, dep: Deployment,
                  expert_load: str = "max") -> dict[str, float]:
    """The busiest GPU's bytes per step, by kind (``non_expert_weights``, ``expert_weights``, ``state_kv``,
    ``activations``, ``total``), its FLOPs, and ``per_token`` = total ÷ batch; also the whole deployment's
    ``all_gpus`` total (:func:`gpu_bytes`) and the single-system cost model's ``model_total``.

    ``expert_load``: "max" (default) charges every MoE layer the expected busiest GPU's expert reads
    (:func:`experts_per_gpu`: layers synchronise on their combine), "mean" the average share ``1/ep``."""
    if expert_load not in ("max", "mean"):
        raise ValueError(f"expert_load must be 'max' or 'mean', got {expert_load!r}")
    cfg = _cfg(cfg)
    r = max(dep.rows(batch))
    own = _split(_cost(cfg, r, context_len, dep))
    full = _cost(cfg, batch, context_len, dep)
    exp = _split(full)
    mean_exp = exp["expert_weights"] / dep.ep_ranks
    busiest_exp = mean_exp
    if cfg.moe_layers and expert_load == "max":
        mean_n, max_n = experts_per_gpu(cfg.n_routed_experts, cfg.num_experts_per_tok, batch, dep.ep_ranks)
        busiest_exp = mean_exp * (max_n / mean_n if mean_n else 1.0)
    d = {"non_expert_weights": own["non_expert_weights"] / dep.tp, "expert_weights": busiest_exp,
         "state_kv": own["state_kv"] / dep.tp, "activations": own["activations"] / dep.tp}
    d["total"] = sum(d.values())
    d["expert_weights_mean"] = mean_exp
    d["flops"] = own["non_expert_flops"] / dep.tp + exp["expert_flops"] / dep.ep_ranks
    d["per_token"] = d["total"] / batch
    d["rows_per_group"] = r
    d["all_gpus"] = float(gpu_bytes(cfg, batch, context_len, dep).sum())
    d["model_total"] = full.total_bytes
    return d


# ====================================================================== communication


def collectives_per_step(cfg: ModelConfig | str, dep: Deployment) -> dict[str, int]:
    """How many collectives one decode step issues: 2 all-to-alls per MoE layer (dispatch, combine), and with
    ``tp > 1`` 2 all-reduces per layer."""
    cfg = _cfg(cfg)
    moe = len(cfg.moe_layers)
    return {"all_to_all": 2 * moe, "all_reduce": 2 * cfg.num_hidden_layers if dep.tp > 1 else 0,
            "moe_layers": moe}


def all_to_all_table(cfg: ModelConfig | str, batch_sizes: Iterable[int], dep: Deployment) -> pd.DataFrame:
    """Per batch size: all-to-alls per step and the bytes of one exchange — the whole exchange (all GPUs, from
    :func:`kimik3.scale.expert_parallel.traffic_model`), at the latent width actually sent and at the hidden width a
    plain MoE would send, and what the busiest GPU sends off-GPU."""
    cfg = _cfg(cfg)
    elem = ELEM_BYTES[dep.act_dtype]
    rows = []
    for b in batch_sizes:
        tm = traffic_model(cfg, b, dep.ep_ranks, elem)
        r = max(dep.rows(b))
        per_gpu = r * cfg.num_experts_per_tok * cfg.expert_in_dim * elem / dep.tp
        rows.append({"batch": b, "all_to_all_per_step": tm["all_to_all_calls_per_step"],
                     "latent_width": cfg.expert_in_dim, "hidden_width": cfg.hidden_size,
                     "exchange_bytes": tm["dispatch_bytes_per_layer"],
                     "exchange_bytes_hidden_width": tm["hidden_dispatch_bytes_per_layer"],
                     "busiest_gpu_sends_remote": per_gpu * (dep.ep_ranks - 1) / dep.ep_ranks,
                     "step_bytes_all_gpus": tm["dispatch_plus_combine_bytes_per_step"],
                     "saving_vs_hidden": tm["saving"]})
    return pd.DataFrame(rows)


def _link_bandwidth(spec: HardwareSpec, comm: CommModel, link_bandwidth: float | None) -> float:
    """One direction of one GPU's NVLink, bytes/s."""
    if link_bandwidth is not None:
        return link_bandwidth * comm.link_efficiency
    if not spec.nvlink_bandwidth:
        raise ValueError(f"{spec.name}: no NVLink bandwidth in data/hardware.json")
    return spec.nvlink_bandwidth / 2 * comm.link_efficiency


def comm_time(cfg: ModelConfig | str, batch: int, dep: Deployment, comm: CommModel = CommModel(),
              link_bandwidth: float | None = None) -> dict[str, float]:
    """Seconds of communication per step on the busiest GPU, if the collectives ran one after another."""
    cfg = _cfg(cfg)
    elem = ELEM_BYTES[dep.act_dtype]
    bw = _link_bandwidth(dep.spec, comm, link_bandwidth)
    n = collectives_per_step(cfg, dep)
    r = max(dep.rows(batch))
    a2a_bytes = r * cfg.num_experts_per_tok * cfg.expert_in_dim * elem / dep.tp * (dep.ep_ranks - 1) / dep.ep_ranks
    ar_bytes = 2 * (dep.tp - 1) / dep.tp * r * cfg.hidden_size * elem if dep.tp > 1 else 0.0
    t_a2a = n["all_to_all"] * (comm.a2a_latency_s + a2a_bytes / bw)
    t_ar = n["all_reduce"] * (comm.allreduce_latency_s + ar_bytes / bw)
    return {"all_to_all_s": t_a2a, "all_reduce_s": t_ar, "total_s": t_a2a + t_ar,
            "all_to_all_latency_s": n["all_to_all"] * comm.a2a_latency_s,
            "all_to_all_transfer_s": n["all_to_all"] * a2a_bytes / bw, "a2a_bytes_per_exchange_busiest": a2a_bytes,
            "all_to_all_per_step": n["all_to_all"], "all_reduce_per_step": n["all_reduce"]}


# ====================================================================== time per step


def overlap_step_time(t_local: float, t_comm: float, overlap: float) -> float:
    """Step time when a fraction ``overlap`` of the communication hides behind local work:
    ``t_local + t_comm − overlap · min(t_local, t_comm)``; between ``max`` (overlap 1) and the sum (overlap 0)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must lie in [0, 1], got {overlap}")
    if t_local < 0 or t_comm < 0:
        raise ValueError("times must be >= 0")
    return t_local + t_comm - overlap * min(t_local, t_comm)


def step_time(cfg: ModelConfig | str, batch: int, context_len: int, dep: Deployment, comm: CommModel = CommModel(),
              overlap: float = 0.0, hbm_bandwidth: float | None = None, link_bandwidth: float | None = None,
              hbm_efficiency: float = 1.0, expert_load: str = "max") -> dict[str, Any]:
    """One decode step of ``batch`` sequences on ``dep``: local bound (busiest GPU's bytes over HBM bandwidth, or
    its FLOPs over the bf16 tensor peak, whichever is larger), communication, overlap, and the resulting
    tokens/s per user (one token per sequence per step) and aggregate. ``hbm_bandwidth`` / ``link_bandwidth``
    (bytes/s, one direction for the link) override the datasheet; ``expert_load`` as in :func:`per_gpu_bytes`."""
    cfg = _cfg(cfg)
    spec = dep.spec
    b = per_gpu_bytes(cfg, batch, context_len, dep, expert_load)
    hbm = (hbm_bandwidth or spec.hbm_bandwidth) * hbm_efficiency
    t_mem = b["total"] / hbm
    t_flop = b["flops"] / spec.compute_ceiling("bf16")[0]
    t_local = max(t_mem, t_flop)
    c = comm_time(cfg, batch, dep, comm, link_bandwidth)
    t = overlap_step_time(t_local, c["total_s"], overlap)
    return {"deployment": dep.name, "hardware": dep.hardware, "gpus": dep.gpus, "tp": dep.tp, "ep": dep.ep_ranks,
            "batch": batch, "context_len": context_len, "overlap": overlap,
            "a2a_latency_us": comm.a2a_latency_s * 1e6, "gpu_GB_per_step": b["total"] / 1e9,
            "gpu_GB_per_token": b["per_token"] / 1e9, "t_memory_ms": t_mem * 1e3, "t_compute_ms": t_flop * 1e3,
            "t_local_ms": t_local * 1e3, "t_comm_ms": c["total_s"] * 1e3, "t_all_to_all_ms": c["all_to_all_s"] * 1e3,
            "t_all_reduce_ms": c["all_reduce_s"] * 1e3, "t_step_ms": t * 1e3,
            "tokens_per_s_per_user": 1.0 / t, "tokens_per_s_aggregate": batch / t, "expert_load": expert_load,
            "bound": "memory" if t_mem >= t_flop else "compute",
            "comm_share": c["total_s"] / (t_local + c["total_s"]) if t_local + c["total_s"] else 0.0}


def prediction_table(cfg: ModelConfig | str = "kimi-k3", batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
                     deployments: Sequence[Deployment] | None = None, comm: CommModel = CommModel(),
                     overlaps: Sequence[float] = (0.0, 0.5, 1.0), context_len: int = 8192,
                     expert_load: str = "max") -> pd.DataFrame:
    """:func:`step_time` over deployments × overlaps × batch sizes: the predictions table."""
    deployments = list(deployments) if deployments is not None else list(DEPLOYMENTS.values())
    rows = [step_time(cfg, b, context_len, d, comm, o, expert_load=expert_load)
            for d in deployments for o in overlaps for b in batch_sizes]
    return pd.DataFrame(rows)


# ====================================================================== what the published numbers imply


def claims_vs_scaleout(cfg: ModelConfig | str = "kimi-k3", comm: CommModel = CommModel(), context_len: int = 8192,
                       deployments: Sequence[Deployment] | None = None) -> pd.DataFrame:
    """Every per-user tokens/s figure in ``data/published.json`` on hardware this module models, next to each
    matching deployment: the step time the claim implies; the busiest GPU's memory-bound time at that batch
    (claims without a batch are read at batch 1, the most favourable) and ``memory_over_claim`` (> 1: that
    deployment cannot reach the claim even with free communication); the predicted step without and with full
    overlap and the best predicted tokens/s per user; and the latency per collective the claim leaves room for —
    ``collective_budget_us_serial`` if every collective runs after the local work, ``..._overlapped`` if all of
    it hides behind the local work (only the transfers count against the step besides) — to set against the
    assumed ``CommModel`` latencies."""
    from kimik3.perf.recorded import _speed_claims, load_published

    cfg = _cfg(cfg)
    deployments = list(deployments) if deployments is not None else list(DEPLOYMENTS.values())
    rows, seen = [], set()
    for c in _speed_claims(load_published()):
        hw, devs = c["hardware"], c["devices"]
        devs = None if devs is None or (isinstance(devs, float) and math.isnan(devs)) else int(devs)
        key = (hw, c["batch_size"], c["per_user"])
        cands = [d for d in deployments if d.hardware == hw and (devs is None or d.gpus == devs)]
        if not cands or key in seen:  # other hardware, or a sweep point repeating a claim of its own
            continue
        seen.add(key)
        b = c["batch_size"]
        assumed = b is None or (isinstance(b, float) and math.isnan(b))
        b = 1 if assumed else int(b)
        t_claim = 1.0 / c["per_user"]
        for d in cands:
            serial = step_time(cfg, b, context_len, d, comm, 0.0)
            full = step_time(cfg, b, context_len, d, comm, 1.0)
            cm = comm_time(cfg, b, d, comm)
            n = cm["all_to_all_per_step"] + cm["all_reduce_per_step"]
            transfer = cm["total_s"] - cm["all_to_all_latency_s"] - cm["all_reduce_per_step"] * comm.allreduce_latency_s
            t_local = serial["t_local_ms"] / 1e3
            rows.append({"claim": c["id"], "system": c["system"], "verified": c["verified"], "batch": b,
                         "batch_assumed": assumed, "claimed_tok_s_user": c["per_user"],
                         "claimed_ms_per_step": t_claim * 1e3, "deployment": d.name,
                         "memory_bound_ms": serial["t_memory_ms"], "memory_over_claim": serial["t_memory_ms"] /
                         (t_claim * 1e3), "comm_serial_ms": serial["t_comm_ms"],
                         "predicted_ms_no_overlap": serial["t_step_ms"], "predicted_ms_full_overlap": full["t_step_ms"],
                         "best_predicted_tok_s_user": full["tokens_per_s_per_user"],
                         "claim_over_best": c["per_user"] / full["tokens_per_s_per_user"], "collectives_per_step": n,
                         "collective_budget_us_serial": (t_claim - t_local - transfer) / n * 1e6,
                         "collective_budget_us_overlapped": ((t_claim - transfer) / n * 1e6) if t_local <= t_claim
                         else float("nan")})
    return pd.DataFrame(rows)


def per_layer_budget(tokens_per_s_per_user: float, cfg: ModelConfig | str = "kimi-k3") -> float:
    """Seconds per decoder layer a per-user speed allows (the step split evenly over the layers)."""
    return 1.0 / tokens_per_s_per_user / _cfg(cfg).num_hidden_layers


def shard_per_layer(recorded: pd.DataFrame | None = None, hardware: Sequence[str] = ("h200", "gb200", "gb300"),
                    context_len: int = 8192) -> pd.DataFrame:
    """What one GPU doing one full K3 layer costs, per layer: ``k3-shard`` (K3 widths, 3 KDA + 1 MLA layer, 16 of
    56 experts per token = one full layer's expert reads at batch 1) measured on a GPU when
    ``data/measurements`` holds such records (stage, batch, seconds ÷ 4 layers), else its cost-model bound on
    each chip (labelled ``bound``). The ``implied_full_model_tok_s`` column scales a layer to K3's 93: what a
    single GPU per layer-set (pipeline- or one-GPU-per-step style) would give, for comparison with the claims."""
    shard = get_preset("k3-shard")
    layers = shard.num_hidden_layers
    k3_layers = get_preset("kimi-k3").num_hidden_layers
    rows = []
    if recorded is not None and not recorded.empty:
        rec = recorded[(recorded["preset"] == "k3-shard") & (recorded["block"] == "step")]
        for r in rec.to_dict("records"):
            per_layer = float(r["seconds"]) / layers
            rows.append({"source": r.get("label", "recorded"), "device": r.get("device"), "stage": r.get("stage"),
                         "batch": r.get("batch_size"), "ms_per_layer": per_layer * 1e3,
                         "implied_full_model_tok_s": 1.0 / (per_layer * k3_layers)})
    for hw in hardware:
        spec = get_hardware(hw)
        c = decode_cost(shard, 1, context_len, expert_dtype="bf16")
        per_layer = c.total_bytes / spec.hbm_bandwidth / layers
        rows.append({"source": "bound (cost model, no measurement)", "device": spec.name, "stage": "any",
                     "batch": 1, "ms_per_layer": per_layer * 1e3,
                     "implied_full_model_tok_s": 1.0 / (per_layer * k3_layers)})
    return pd.DataFrame(rows)
