"""Stage "absorbed": everything PyTorch alone can give before graphs, compilers or custom kernels.

* MLA with weight absorption (§4.4): attention runs in the kv-LoRA latent space — queries are pulled through
  ``W_UK`` into the latent width, the cache holds only the latent vector (+ the shared key part), and values come
  out through ``W_UV`` after the softmax. No per-step re-expansion of the cache.
* The KDA step as a direct in-place update of a preallocated state.
* MoE computing only the selected experts by indexing the stacked expert weights — no Python loop over experts,
  no ``.item()``, no host synchronisation.
* Preallocated static caches and state, updated in place; a decode step with static shapes and no data-dependent
  control flow, so it can be captured by CUDA graphs (stage "graphs") and compiled (stage "compiled").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimik3.model.modeling import (
    KDA,
    MLA,
    DecodeState,
    KDAState,
    KimiForCausalLM,
    MLACache,
    MoE,
    acc_dtype,
    f32,
    glu,
    kda_recurrent_step,
    l2norm,
)
from kimik3.stages.base import Stage

__all__ = ["AbsorbedStage", "absorbed_mla_step", "kda_step_inplace", "moe_selected_experts", "decode_step"]


def absorbed_mla_step(mla: MLA, x: torch.Tensor, cache: MLACache, positions: torch.Tensor) -> torch.Tensor:
    """One token per sequence. x [B, 1, H]; positions [B] = tokens already cached (the new token's index)."""
    c = mla.cfg
    B = x.shape[0]
    q = mla.queries(x)[:, 0]  # [B, nh, nope + rope]
    q_n, q_r = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    q_r = mla.rope(q_r[:, None], positions[:, None])[:, 0]
    latent, k_r = mla.compress(x, positions[:, None])
    rows = torch.arange(B, device=x.device)
    cache.latent[rows, positions] = latent[:, 0].to(cache.latent.dtype)  # in place: static cache
    cache.k_r[rows, positions] = k_r[:, 0].to(cache.k_r.dtype)
    w = mla.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    w_uk, w_uv = w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]
    q_lat = torch.einsum("bhn,hnl->bhl", q_n, w_uk)  # absorb W_UK into the query: [B, nh, kv_lora]
    scores = torch.einsum("bhl,bsl->bhs", q_lat, cache.latent) + torch.einsum("bhr,bsr->bhs", q_r, cache.k_r)
    scores = f32(scores) * c.mla_softmax_scale  # the ORIGINAL (nope+rope)^-0.5 scale, not 576^-0.5 (pitfall 9)
    S = cache.latent.shape[1]
    visible = torch.arange(S, device=x.device)[None, :] <= positions[:, None]  # each sequence: its own tokens
    p = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1).to(x.dtype)
    o_lat = torch.einsum("bhs,bsl->bhl", p, cache.latent)
    o = torch.einsum("bhl,hvl->bhv", o_lat, w_uv)  # W_UV after the softmax: [B, nh, dv]
    return mla.output(x, o[:, None])


def kda_step_inplace(kda: KDA, x: torch.Tensor, st: KDAState) -> torch.Tensor:
    """One token per sequence through KDA (§3.2), updating the conv history and fp32 state S in place."""
    c = kda.cfg
    nh, dk = c.kda_num_heads, c.kda_head_dim
    mixed = torch.cat([kda.q_proj(x), kda.k_proj(x), kda.v_proj(x)], -1)[:, 0]  # [B, 3P] raw projections
    window = torch.cat([st.conv, mixed[:, :, None]], -1)  # [B, 3P, W]
    z = F.silu((f32(window) * kda.conv_weight()).sum(-1)).to(x.dtype)
    q, k, v = f32(z).unflatten(-1, (3, nh, dk)).unbind(1)
    q, k = l2norm(q) * dk**-0.5, l2norm(k)
    g = kda.decay(x)[:, 0]
    beta = torch.sigmoid(f32(kda.b_proj(x)))[:, 0]
    o, S = kda_recurrent_step(q, k, v, g, beta, st.S)
    st.S.copy_(S)
    st.conv.copy_(window[..., 1:])
    o = kda.gated_norm(o[:, None].to(x.dtype), kda.output_gate(x).unflatten(-1, (nh, dk)))
    return kda.o_proj(o.flatten(-2))


def moe_selected_experts(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """x [N, H] -> [N, H]. Gathers the k selected experts' weights per token: static shapes, no loop, no sync."""
    w, idx = moe.gate(x)  # [N, k]
    xl = moe.to_latent(x)  # [N, D]
    ex = moe.experts
    a = torch.einsum("nd,nkid->nki", xl, ex.w1[idx])
    b = torch.einsum("nd,nkid->nki", xl, ex.w3[idx])
    y = torch.einsum("nki,nkdi->nkd", glu(moe.cfg, a, b), ex.w2[idx])  # [N, k, D]
    acc = (f32(y) * w[..., None]).sum(1).to(x.dtype)  # combine in fp32, cast once
    out = moe.from_latent(acc)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


def decode_step(model: KimiForCausalLM, state: DecodeState, ids: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
    """ids [B], positions [B] -> fp32 logits [B, V]; mutates ``state`` in place only."""

    def mixer_for(layer, st):
        if layer.kind == "kda":
            return lambda x: kda_step_inplace(layer.self_attn, x, st)
        return lambda x: absorbed_mla_step(layer.self_attn, x, st, positions)

    def ffn_for(layer, st):
        if layer.is_moe:
            return lambda x: moe_selected_experts(layer.block_sparse_moe, x.flatten(0, -2)).view_as(x)
        return layer.mlp

    h = model.run_layers(model.model.embed_tokens(ids)[:, None], mixer_for, ffn_for, state)
    return model.logits(h)[:, 0]


def copy_state_(dst: DecodeState, src: DecodeState) -> None:
    """Copy a decode state into preallocated buffers in place (their addresses are what graphs captured)."""
    for d, s in zip(dst.layers, src.layers):
        if isinstance(d, KDAState):
            d.S.copy_(s.S)
            d.conv.copy_(s.conv)
        else:
            d.latent.zero_()
            d.k_r.zero_()
            n = s.latent.shape[1]
            d.latent[:, :n].copy_(s.latent)
            d.k_r[:, :n].copy_(s.k_r)


class AbsorbedStage(Stage):
    name = "absorbed"

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int) -> None:
        super().__init__(model, batch_size, max_seq_len)
        self.state = model.new_state(batch_size, max_seq_len)  # allocated once, updated in place
        self.reset()

    def reset(self) -> None:
        for s in self.state.layers:
            for t in ((s.S, s.conv) if isinstance(s, KDAState) else (s.latent, s.k_r)):
                t.zero_()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The whole prompt as one chunk through the model's own forward (padding masked), then copied into the
        static state; logits gathered at each sequence's last prompt token."""
        B, T = input_ids.shape
        tmp = self.model.new_state(B, T)
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        active = pos < lengths[:, None]
        logits = self.model.forward_tokens(input_ids, tmp, pos, active)
        copy_state_(self.state, tmp)
        return logits[torch.arange(B, device=input_ids.device), lengths - 1].to(acc_dtype(self.model.dtype))

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return decode_step(self.model, self.state, ids, positions)
