"""The Kimi K3 decode path as one readable PyTorch model (the reference every stage is checked against; §1–§5).

Read top to bottom: numerics helpers, feed-forward (SiTU/SwiGLU MLP, router, LatentMoE, §5), the two token mixers
(KDA linear attention §3, MLA §4), Attention Residuals (§2), the decoder layer and the model (§1.2). One code path
serves three families, selected by config fields rather than subclasses (§6): Kimi K3 (KDA + gated NoPE MLA,
AttnRes, LatentMoE with SiTU-GLU experts); Kimi-Linear (KDA with softplus decay and low-rank output gate + NoPE
MLA, additive residual, plain MoE); DeepSeek-V3 / Kimi K2 (RoPE MLA with YaRN, additive residual, plain MoE with
(grouped) sigmoid routing). Every mixer processes ``T`` new tokens for ``B`` sequences against per-layer state
(:class:`KDAState`, :class:`MLACache`): ``T = 1`` is a decode step, ``T = prompt length`` a full-sequence forward.
Tokens whose ``active`` flag is False (padding) never touch a cache or state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.model.config import ModelConfig, yarn_mscale
from kimik3.model.quant import QuantizedExperts, describe_expert_memory, mxfp4_quantize

__all__ = [
    "KimiForCausalLM",
    "DecodeState",
    "KDAState",
    "MLACache",
    "rms_norm",
    "situ_glu",
    "glu",
    "l2norm",
    "route",
    "router_logits",
    "route_from_logits",
    "attn_res_mix",
    "kda_recurrent_step",
    "kda_short_conv",
    "kda_decay",
    "kda_gated_norm",
    "keeps_fp32",
    "f32",
]

# Parameters the spec keeps in fp32 whatever the model dtype (§3.1, pitfall 7; router bias §5.2).
_FP32_SUFFIXES = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight",
                  "e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    """True for parameters stored and used in fp32 regardless of the model's dtype."""
    return name.endswith(_FP32_SUFFIXES)


# ====================================================================== numerics


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the spec's "fp32" math: fp32, or fp64 when the whole model runs as an fp64 oracle."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def f32(x: torch.Tensor) -> torch.Tensor:
    """The spec's "compute in fp32" upcast (float64 passes through, see ``acc_dtype``)."""
    return x.to(acc_dtype(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``KimiRMSNorm`` order: normalise in fp32, cast back to the input dtype, then multiply by the weight."""
    x32 = f32(x)
    xhat = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * xhat


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_lin: float | None) -> torch.Tensor:
    """SiTU-GLU (§5.1): [β·tanh(a/β)·σ(a)]·[β_lin·tanh(b/β_lin)] in fp32, cast back to the input dtype."""
    a, b = f32(gate), f32(up)
    g = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    u = b if beta_lin is None else beta_lin * torch.tanh(b / beta_lin)
    return (g * u).to(gate.dtype)


def glu(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of every MLP: SiTU-GLU for K3, SwiGLU (in the activation dtype, as HF does) else."""
    if cfg.hidden_act == "situ":
        return situ_glu(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
    return F.silu(gate) * up


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps), eps inside the root (FLA convention, pitfall 6)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ====================================================================== feed-forward (§5)


class MLP(nn.Module):
    """Dense MLP and shared experts: down(act(gate(x), up(x)))."""

    def __init__(self, cfg: ModelConfig, width: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.cfg, self.gate_proj(x), self.up_proj(x)))


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """The router's linear layer in fp32 (§5.2): input and weight upcast before the product, so the top-k sees
    the scores at full precision. x [N, H] (or a row tile of the weight) -> [N, E]."""
    return F.linear(f32(x), f32(gate_weight).to(f32(x).dtype))


def route_from_logits(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc sigmoid top-k (§5.2) from the router logits [N, E] -> (weights fp32 [N, k], ids int64 [N, k]).

    The correction bias only chooses; the weights come from the unbiased scores. Grouped top-k masks
    the groups outside the best ``topk_group`` with -inf (HF / K3 convention).
    """
    scores = torch.sigmoid(logits)
    choice = scores + bias.to(scores.dtype)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.view(-1, cfg.n_group, E // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // cfg.n_group, dim=1), float("-inf"))
    idx = choice.topk(k, dim=-1).indices
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob and k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc sigmoid router (§5.2). x [N, H] -> (weights fp32 [N, k], expert ids int64 [N, k])."""
    return route_from_logits(router_logits(x, gate_weight), bias, cfg)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.e_score_correction_bias, self.cfg)


class Experts(nn.Module):
    """Routed experts stored stacked: w1 (gate) / w3 (up) [E, I, D], w2 (down) [E, D, I]; D = latent or hidden."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, inner, d = cfg.held("experts"), cfg.moe_intermediate_size, cfg.expert_in_dim
        self.w1 = nn.Parameter(torch.empty(E, inner, d))
        self.w3 = nn.Parameter(torch.empty(E, inner, d))
        self.w2 = nn.Parameter(torch.empty(E, d, inner))


class MoE(nn.Module):
    """Plain MoE (DeepSeek/Kimi-Linear) or LatentMoE (K3, §5.3), with the shared MLP at full width."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        if cfg.moe_latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(cfg.held("latent"), cfg.hidden_size, bias=False)
            self.routed_expert_norm = RMSNorm(cfg.moe_latent_size, cfg.rms_norm_eps) if cfg.moe_latent_norm else None
        self.shared_experts = MLP(cfg, cfg.held("shared")) if cfg.n_shared_experts else None

    def expert(self, e: int, xl: torch.Tensor) -> torch.Tensor:
        """One routed expert's GLU FFN on latent (or hidden) inputs [n, D]. Experts held as MXFP4
        (:class:`kimik3.model.quant.QuantizedExperts`) are dequantised one expert at a time, to the values a
        dequantising load would have stored."""
        ex = self.experts
        if isinstance(ex, QuantizedExperts):
            w1, w3, w2 = (ex.expert(n, e, xl.dtype) for n in ("w1", "w3", "w2"))
        else:
            w1, w3, w2 = ex.w1[e], ex.w3[e], ex.w2[e]
        return F.linear(glu(self.cfg, F.linear(xl, w1), F.linear(xl, w3)), w2)

    def to_latent(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed_expert_down_proj(x) if self.cfg.moe_latent_size is not None else x

    def from_latent(self, acc: torch.Tensor) -> torch.Tensor:
        """acc: the fp32-combined expert sum cast once to the activation dtype."""
        if self.cfg.moe_latent_size is None:
            return acc
        if self.routed_expert_norm is not None:  # latent norm on the COMBINED sum (pitfall 13)
            acc = self.routed_expert_norm(acc)
        return self.routed_expert_up_proj(acc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: normed FFN input [N, H]. The obvious way: a Python loop over the experts actually selected."""
        w, idx = self.gate(x)
        xl = self.to_latent(x)
        acc = torch.zeros(xl.shape, dtype=acc_dtype(x.dtype), device=x.device)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            acc.index_add_(0, rows, f32(self.expert(e, xl[rows])) * w[rows, slot, None])
        out = self.from_latent(acc.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


# ====================================================================== KDA (§3)


@dataclass
class KDAState:
    """Per KDA layer: raw q/k/v projection history [B, 3P, W-1] (act dtype) and S [B, nh, dk, dv] fp32.

    S is kept key-major (rows = key channel), the textbook/``transformers`` layout; the K3 release stores
    the transpose (value-major, pitfall 3) and the loader of a serving cache would have to transpose it.
    """

    conv: torch.Tensor
    S: torch.Tensor


def kda_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta-rule step (§3.2), all fp32. q, k: l2-normalised [B, nh, dk] (q already scaled by dk^-0.5);
    v [B, nh, dv]; g log-decay [B, nh, dk]; beta [B, nh]; S [B, nh, dk, dv]. Returns (o [B, nh, dv], S')."""
    S = S * g.exp()[..., None]  # decay rows (key channels) first
    r = torch.einsum("bhkv,bhk->bhv", S, k)  # what the memory predicts for k
    S = S + k[..., None] * (beta[..., None] * (v - r))[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, q), S  # read with the UPDATED state


def kda_short_conv(window: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The depthwise short conv of q/k/v at the newest position (§3.2): window [.., C, W] oldest first, weight
    [C, W] fp32 -> SiLU of the fp32 sum, cast to ``dtype``. The conv is always followed by SiLU (pitfall 5)."""
    return F.silu((f32(window) * weight).sum(-1)).to(dtype)


def kda_decay(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None
              ) -> torch.Tensor:
    """Per-channel log-decay g [.., nh, dk] in fp32 (§3.2) from the low-rank gate projection f = f_b(f_a(x))
    [.., nh·dk], dt_bias [nh·dk] and A_log [nh] (any head range, as long as the three agree):
    lb·σ(exp(A_log)·(f+dt_bias)) with K3's lower bound ``lb`` (pitfall 1), -exp(A_log)·softplus(f+dt_bias)
    for Kimi-Linear (``lower_bound`` None)."""
    u = (f32(f) + dt_bias).unflatten(-1, (A_log.shape[0], -1))
    lam = A_log.exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(lam * u)
    return -lam * F.softplus(u, threshold=20.0)


def kda_gated_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output norm (§3.2): RMSNorm over the head dim with the fp32 ``weight`` [dk], times σ(gate), all in
    fp32, cast back to o's dtype; o, gate [.., nh, dk]. o arrives already cast to the activation dtype
    (pitfall 4)."""
    o32 = f32(o)
    o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    return (o32 * weight * torch.sigmoid(f32(gate))).to(o.dtype)


class KDA(nn.Module):
    """Kimi Delta Attention: short conv + gated delta rule + gated RMSNorm output (§3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # a rank slice holds its share of the heads (kimik3.model.rank_slice); the whole model all of them
        H, nh, dk, W = cfg.hidden_size, cfg.held("kda_heads"), cfg.kda_head_dim, cfg.kda_conv_size
        P = nh * dk
        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        self.q_conv1d = nn.Module()
        self.k_conv1d = nn.Module()
        self.v_conv1d = nn.Module()
        for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            m.weight = nn.Parameter(torch.empty(P, 1, W, dtype=torch.float32))
        self.f_a_proj = nn.Linear(H, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, P, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(nh, dtype=torch.float32))
        self.b_proj = nn.Linear(H, nh, bias=False)
        if cfg.kda_full_rank_gate:
            self.g_proj = nn.Linear(H, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(H, dk, bias=False)
            self.g_b_proj = nn.Linear(dk, P, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(dk, dtype=torch.float32))
        self.o_proj = nn.Linear(P, H, bias=False)

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> KDAState:
        c = self.cfg
        return KDAState(
            conv=torch.zeros(batch, 3 * c.kda_proj_dim, c.kda_conv_size - 1, device=device, dtype=dtype),
            S=torch.zeros(batch, c.kda_num_heads, c.kda_head_dim, c.kda_head_dim, device=device,
                          dtype=acc_dtype(dtype)),
        )

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [.., nh, dk] in fp32: lb·σ(exp(A_log)·(u+dt_bias)) for K3 (pitfall 1),
        -exp(A_log)·softplus(u+dt_bias) for Kimi-Linear (no lower bound)."""
        c = self.cfg
        return kda_decay(self.f_b_proj(self.f_a_proj(x)), self.dt_bias, self.A_log[: c.kda_num_heads],
                         c.kda_gate_lower_bound)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if self.cfg.kda_full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def conv_weight(self) -> torch.Tensor:
        """[3P, W] fp32: the three depthwise conv kernels concatenated in q, k, v order."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0)[:, 0, :]

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over head dim with fp32 weight, times σ(gate), in fp32; o, gate [.., nh, dk]."""
        return kda_gated_norm(o, gate, self.o_norm.weight, self.cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, state: KDAState, active: torch.Tensor | None = None) -> torch.Tensor:
        c = self.cfg
        B, T, _ = x.shape
        nh, dk = c.kda_num_heads, c.kda_head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)  # [B, T, 3P] raw projections
        g = self.decay(x)  # [B, T, nh, dk]
        beta = torch.sigmoid(f32(self.b_proj(x)))  # [B, T, nh]; a raw 0 still writes with strength 0.5
        wconv = self.conv_weight()
        outs = []
        for t in range(T):
            window = torch.cat([state.conv, mixed[:, t, :, None]], -1)  # [B, 3P, W] oldest first
            z = kda_short_conv(window, wconv, x.dtype)
            q, k, v = f32(z).unflatten(-1, (3, nh, dk)).unbind(1)
            q, k = l2norm(q) * dk**-0.5, l2norm(k)
            o, S = kda_recurrent_step(q, k, v, g[:, t], beta[:, t], state.S)
            keep = None if active is None else active[:, t]
            state.conv = _where_rows(keep, window[..., 1:], state.conv)
            state.S = _where_rows(keep, S, state.S)
            outs.append(o)
        o = torch.stack(outs, 1).to(x.dtype)  # [B, T, nh, dv], cast to bf16 before the gated norm (pitfall 4)
        o = self.gated_norm(o, self.output_gate(x).unflatten(-1, (nh, dk)))
        return self.o_proj(o.flatten(-2))


def _where_rows(keep: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Row-wise select: rows whose ``keep`` flag is False keep their old state (padding never writes)."""
    if keep is None:
        return new.to(old.dtype)
    return torch.where(keep.view(-1, *([1] * (new.dim() - 1))), new.to(old.dtype), old)


# ====================================================================== MLA (§4)


@dataclass
class MLACache:
    """Compressed latent KV cache per MLA layer: normalised latent c [B, S, kv_lora] and shared key part
    k_r [B, S, rope] (post-rotation for RoPE models, raw for K3)."""

    latent: torch.Tensor
    k_r: torch.Tensor


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary dims and the cos/sin factor; YaRN per §4.5.2 (HF's truncating form)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not cfg.rope_scaling:
        return 1.0 / pos_freqs, 1.0
    rs = cfg.rope_scaling
    factor = cfg._yarn_factor()
    ms, mad = rs.get("mscale"), rs.get("mscale_all_dim")
    att = rs.get("attention_factor")
    if att is None:
        att = yarn_mscale(factor, ms) / yarn_mscale(factor, mad) if (ms and mad) else yarn_mscale(factor)
    orig = rs["original_max_position_embeddings"]
    bf, bs = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr(n: float) -> float:
        return dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr(bf), corr(bs)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(att)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate pairs; interleaved pairs (x0,x1),(x2,x3).. come out de-interleaved, consistently for q and k."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class MLA(nn.Module):
    """Multi-head latent attention: gated NoPE for K3, RoPE+YaRN for DeepSeek/K2 (§4)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, nh = cfg.hidden_size, cfg.held("mla_heads")
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # LoRA norms use the class default 1e-6
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(H, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        if cfg.mla_use_output_gate:
            self.g_proj = nn.Linear(H, nh * cfg.v_head_dim, bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, H, bias=False)
        if cfg.uses_rope:
            inv, att = rope_inv_freq(cfg)
            self.register_buffer("inv_freq", inv, persistent=False)
            self.rope_attention_factor = att

    def new_cache(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> MLACache:
        c = self.cfg
        return MLACache(latent=torch.zeros(batch, max_len, c.kv_lora_rank, device=device, dtype=dtype),
                        k_r=torch.zeros(batch, max_len, c.qk_rope_head_dim, device=device, dtype=dtype))

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, nh, nope + rope] (not rotated)."""
        if self.cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        return q.unflatten(-1, (self.cfg.num_attention_heads, self.cfg.qk_head_dim))

    def rope(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate t [B, T, (heads,) rope] at absolute ``positions`` [B, T]; identity for NoPE."""
        if not self.cfg.uses_rope:
            return t
        ang = positions.float()[..., None] * self.inv_freq  # [B, T, rope/2]
        cos = (ang.cos() * self.rope_attention_factor).to(t.dtype)
        sin = (ang.sin() * self.rope_attention_factor).to(t.dtype)
        if t.dim() == 4:
            cos, sin = cos[:, :, None], sin[:, :, None]
        return apply_rope(t, cos, sin, self.cfg.rope_interleave)

    def compress(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a new token adds to the cache: (normalised latent [B,T,L], shared key part [B,T,R])."""
        ckv = self.kv_a_proj_with_mqa(x)
        L = self.cfg.kv_lora_rank
        return self.kv_a_layernorm(ckv[..., :L]), self.rope(ckv[..., L:], positions)

    def write_cache(self, cache: MLACache, latent: torch.Tensor, k_r: torch.Tensor, positions: torch.Tensor,
                    active: torch.Tensor | None) -> None:
        B, T = positions.shape
        rows = torch.arange(B, device=positions.device)[:, None].expand(B, T)
        for buf, new in ((cache.latent, latent), (cache.k_r, k_r)):
            if active is not None:
                new = torch.where(active[..., None], new.to(buf.dtype), buf[rows, positions])
            buf[rows, positions] = new.to(buf.dtype)

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, nh, dv] -> gated (K3) output projection [B, T, H]."""
        o = o.flatten(-2)
        if self.cfg.mla_use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def forward(self, x: torch.Tensor, cache: MLACache, positions: torch.Tensor,
                active: torch.Tensor | None = None) -> torch.Tensor:
        """The unabsorbed form (§4.2): re-expand every cached latent into per-head keys and values."""
        c = self.cfg
        q = self.queries(x)
        q_n, q_r = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
        q_r = self.rope(q_r, positions)
        latent, k_r = self.compress(x, positions)
        self.write_cache(cache, latent, k_r, positions, active)
        kv = self.kv_b_proj(cache.latent).unflatten(-1, (c.num_attention_heads, -1))  # [B, S, nh, nope+v]
        k_n, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        scores = (torch.einsum("bthd,bshd->bhts", q_n, k_n) + torch.einsum("bthr,bsr->bhts", q_r, cache.k_r))
        scores = f32(scores) * c.mla_softmax_scale
        S = cache.latent.shape[1]
        causal = torch.arange(S, device=x.device)[None, None, :] <= positions[:, :, None]  # [B, T, S]
        scores = scores.masked_fill(~causal[:, None], float("-inf"))
        p = torch.softmax(scores, -1).to(v.dtype)  # fp32 softmax (pitfall 19)
        return self.output(x, torch.einsum("bhts,bshd->bthd", p, v))


# ====================================================================== Attention Residuals (§2)


def attn_res_mix(candidates: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float
                 ) -> torch.Tensor:
    """Softmax mixture over depth (§2.2). Scores use ω = norm_w ⊙ proj_w on RMS-normalised candidates;
    the mix is over the RAW candidates, in fp32, cast once."""
    V = f32(torch.stack(candidates, 0))  # [K, ..., H]
    r = torch.rsqrt(V.pow(2).mean(-1) + eps)
    omega = f32(norm_w).to(V.dtype) * f32(proj_w).to(V.dtype).reshape(-1)
    alpha = torch.softmax((V * omega).sum(-1) * r, dim=0)
    return (alpha[..., None] * V).sum(0).to(candidates[-1].dtype)


# ====================================================================== decoder layer and model


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__()
        self.cfg, self.idx = cfg, idx
        self.kind = cfg.mixer(idx)
        self.self_attn = KDA(cfg) if self.kind == "kda" else MLA(cfg)
        if cfg.ffn(idx) == "moe":
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg, cfg.held("dense"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size:
            self.self_attention_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.mlp_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "block_sparse_moe")

    def mixer(self, x: torch.Tensor, state, positions: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "kda":
            return self.self_attn(x, state, active)
        return self.self_attn(x, state, positions, active)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_moe:
            return self.block_sparse_moe(x.flatten(0, -2)).view_as(x)
        return self.mlp(x)

    def forward(self, p: torch.Tensor, R: list[torch.Tensor], state, positions: torch.Tensor,
                active: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.residual(p, R, lambda x: self.mixer(x, state, positions, active), self.ffn)

    def residual(self, p: torch.Tensor, R: list[torch.Tensor], mixer, ffn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The residual wiring around ``mixer(x)`` and ``ffn(x)`` (callables on normed inputs), shared by every
        stage: additive for DeepSeek / Kimi-Linear, Attention Residuals for K3 (§2.3)."""
        cfg = self.cfg
        if not cfg.attn_res_block_size:
            h = p + mixer(self.input_layernorm(p))
            return h + ffn(self.post_attention_layernorm(h)), R
        eps = cfg.rms_norm_eps
        a_in = attn_res_mix(R + [p], self.self_attention_res_norm.weight, self.self_attention_res_proj.weight, eps) \
            if R else p
        if self.idx % cfg.attn_res_block_size == 0:  # block boundary: freeze the partial sum (after the mix)
            R, p = R + [p], None
        a = mixer(self.input_layernorm(a_in))
        p = a if p is None else p + a
        m_in = attn_res_mix(R + [p], self.mlp_res_norm.weight, self.mlp_res_proj.weight, eps)
        return p + ffn(self.post_attention_layernorm(m_in)), R


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)


@dataclass
class DecodeState:
    """Everything carried across decode steps: one KDAState or MLACache per layer (AttnRes carries nothing)."""

    layers: list
    max_len: int

    def nbytes(self) -> int:
        total = 0
        for s in self.layers:
            for t in ((s.conv, s.S) if isinstance(s, KDAState) else (s.latent, s.k_r)):
                total += t.numel() * t.element_size()
        return total


class KimiForCausalLM(nn.Module):
    """The whole text model. ``model(input_ids)`` is the full-sequence forward -> fp32 logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = KimiModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.held("vocab"), bias=False)
        self._tie()
        # inference only: no parameter takes gradients (torch.compile's freezing also needs this to treat the
        # weights as constants)
        self.requires_grad_(False)

    def _tie(self) -> None:
        """tie_word_embeddings: lm_head reads the embedding matrix itself (one parameter, not a copy)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (torch's signature)
        # .to()/.to_empty() give each module its own new Parameter, which would silently untie the pair
        out = super()._apply(fn, recurse)
        self._tie()
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_state(self, batch: int, max_len: int) -> DecodeState:
        if self.config.rank_slice:
            raise ValueError(f"model {self.config.name!r} holds one rank's slice {self.config.rank_slice} of a "
                             "deployment: its step needs its peers' partial sums, so it runs as a rank program "
                             "(kimik3.megakernel.ranks), not through the reference forward")
        dev, dt = self.device, self.dtype
        states = [layer.self_attn.new_state(batch, dev, dt) if layer.kind == "kda"
                  else layer.self_attn.new_cache(batch, max_len, dev, dt) for layer in self.model.layers]
        return DecodeState(states, max_len)

    def hidden(self, input_ids: torch.Tensor, state: DecodeState, positions: torch.Tensor,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``T`` new tokens per sequence through every layer; returns the final-normed hidden [B, T, H]."""
        return self.run_layers(self.model.embed_tokens(input_ids),
                               lambda layer, st: (lambda x: layer.mixer(x, st, positions, active)),
                               lambda layer, st: layer.ffn, state)

    def run_layers(self, p: torch.Tensor, mixer_for, ffn_for, state: DecodeState) -> torch.Tensor:
        """Embedded input -> final-normed hidden. ``mixer_for(layer, layer_state)`` / ``ffn_for(layer, state)``
        return the callables each layer uses, so every stage reuses this wiring with its own blocks."""
        R: list[torch.Tensor] = []
        for layer, st in zip(self.model.layers, state.layers):
            p, R = layer.residual(p, R, mixer_for(layer, st), ffn_for(layer, st))
        m = self.model
        if self.config.attn_res_block_size:  # the model output is itself an AttnRes mix (pitfall 11)
            p = attn_res_mix(R + [p], m.output_attn_res_norm.weight, m.output_attn_res_proj.weight,
                             self.config.rms_norm_eps)
        return m.norm(p)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return f32(self.lm_head(h))

    def forward_tokens(self, input_ids: torch.Tensor, state: DecodeState, positions: torch.Tensor,
                       active: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(self.hidden(input_ids, state, positions, active))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        state = self.new_state(B, T)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return self.forward_tokens(input_ids, state, positions)

    def cast_(self, dtype: torch.dtype) -> KimiForCausalLM:
        """Cast to ``dtype`` in place, keeping the spec's fp32 tensors (A_log, dt_bias, conv, o_norm, router bias)."""
        for name, prm in self.named_parameters():  # (an fp64 model is the validation oracle: all fp64)
            keep = keeps_fp32(name) and dtype != torch.float64
            prm.data = prm.data.to(torch.float32 if keep else dtype)
        return self

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE frequencies) after ``to_empty``."""
        if self.config.uses_rope:
            inv, _ = rope_inv_freq(self.config)
            for layer in self.model.layers:
                if layer.kind == "mla":
                    layer.self_attn.inv_freq = inv.to(self.device)

    def num_parameters(self) -> int:
        """Parameters of the model as defined (routed experts held as MXFP4 count their dense elements)."""
        return sum(p.numel() for p in self.parameters()) + sum(
            m.num_weights() for m in self.modules() if isinstance(m, QuantizedExperts))

    # ------------------------------------------------------------------ routed expert storage
    def _moe_layers(self) -> list[MoE]:
        return [layer.block_sparse_moe for layer in self.model.layers if layer.is_moe]

    @property
    def expert_storage(self) -> str:
        """How the routed experts are held: "dense" (stacked parameters in the model dtype) or "mxfp4"
        (:class:`kimik3.model.quant.QuantizedExperts`, from ``from_pretrained(..., quantized_experts="keep")`` or
        :meth:`quantize_experts`)."""
        kept = {isinstance(m.experts, QuantizedExperts) for m in self._moe_layers()}
        if kept == {True, False}:
            raise ValueError("some MoE layers hold their routed experts as MXFP4 and some dense")
        return "mxfp4" if kept == {True} else "dense"

    def expert_memory(self) -> str:
        """What the routed experts cost in memory in each form (dense in the model dtype, MXFP4)."""
        return describe_expert_memory(self.config, self.dtype)

    @torch.no_grad()
    def dequantize_experts(self) -> KimiForCausalLM:
        """Routed experts held as MXFP4 -> dense parameters in the model dtype, in place (exactly the weights a
        dequantising load gives); the memory this costs is :meth:`expert_memory`'s "dense" figure. No-op when
        they are dense already."""
        for moe in self._moe_layers():
            q = moe.experts
            if not isinstance(q, QuantizedExperts):
                continue
            dense = {n: q.dequantized(n, self.dtype) for n in ("w1", "w3", "w2")}
            with torch.device("meta"):
                ex = Experts(self.config)
            for n, t in dense.items():
                setattr(ex, n, nn.Parameter(t, requires_grad=False))
            moe.experts = ex
        return self

    @torch.no_grad()
    def quantize_experts(self) -> KimiForCausalLM:
        """Dense routed experts -> held as MXFP4 (packed by :func:`kimik3.model.quant.mxfp4_quantize`: exact for weights
        that are MXFP4 values, e.g. dequantised from an MXFP4 checkpoint, a 4-bit quantisation otherwise), in
        place. No-op when they are MXFP4 already."""
        cfg = self.config
        for moe in self._moe_layers():
            ex = moe.experts
            if isinstance(ex, QuantizedExperts):
                continue
            q = QuantizedExperts(cfg.held("experts"), cfg.moe_intermediate_size, cfg.expert_in_dim, self.device)
            for n in ("w1", "w3", "w2"):
                w = getattr(ex, n)
                p, s = q.packed(n)
                for e in range(w.shape[0]):  # one expert at a time: bounded scratch
                    p[e], s[e] = mxfp4_quantize(w[e])
            moe.experts = q
        return self
