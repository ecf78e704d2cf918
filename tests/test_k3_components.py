"""K3-only parts checked against the spec's formulas (expectation source named in each test).

The model's functions are compared with independent scalar/explicit computations written from
docs/architecture.md, on fresh random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

import kimik3
from kimik3.model.checkpoint import E2M1_VALUES, mxfp4_dequantize, mxfp4_quantize
from kimik3.model.modeling import attn_res_mix, kda_recurrent_step, rms_norm, route, situ_glu
from kimik3.validation.metric import TOL, rel_error

G = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return torch.randn(*shape, generator=G) * scale


def test_situ_glu_formula():
    """Spec §5.1: SiTU(a,b) = [β·tanh(a/β)·σ(a)]·[β_lin·tanh(b/β_lin)], β=4, β_lin=25; unset β_lin -> b."""
    a, b = randn(1000, scale=8), randn(1000, scale=40)
    want = [4 * math.tanh(x / 4) / (1 + math.exp(-x)) * 25 * math.tanh(y / 25) for x, y in zip(a.tolist(), b.tolist())]
    assert rel_error(situ_glu(a, b, 4.0, 25.0), torch.tensor(want)) < 1e-6
    want_nolin = [4 * math.tanh(x / 4) / (1 + math.exp(-x)) * y for x, y in zip(a.tolist(), b.tolist())]
    assert rel_error(situ_glu(a, b, 4.0, None), torch.tensor(want_nolin)) < 1e-6
    # soft cap: the gate branch never exceeds beta, unlike SiLU
    assert situ_glu(torch.tensor([100.0]), torch.tensor([1.0]), 4.0, None).item() <= 4.0


def test_rms_norm_casts_before_weight():
    """Spec §0: normalise in fp32, cast to the input dtype, THEN multiply by the weight (KimiRMSNorm order)."""
    x, w = randn(4, 64).bfloat16(), (1 + randn(64, scale=0.1)).bfloat16()
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-5), want)


def test_attn_res_mix_formula():
    """Spec §2.2: scores on RMS-normalised candidates with ω = n⊙ρ, softmax over depth, mix the RAW candidates."""
    K, H = 5, 32
    cands = [randn(3, H, scale=1 + j) for j in range(K)]
    n, rho = 1 + randn(H, scale=0.2), randn(1, H)
    got = attn_res_mix(cands, n, rho, 1e-5)
    for row in range(3):
        s = []
        for v in cands:
            r = 1 / math.sqrt(sum(x * x for x in v[row].tolist()) / H + 1e-5)
            s.append(sum(x * r * nn * pp for x, nn, pp in zip(v[row].tolist(), n.tolist(), rho[0].tolist())))
        mx = max(s)
        a = [math.exp(x - mx) for x in s]
        a = [x / sum(a) for x in a]
        want = [sum(a[j] * cands[j][row, h].item() for j in range(K)) for h in range(H)]
        assert rel_error(got[row], torch.tensor(want)) < 1e-6


def test_attn_res_slots_follow_block_boundaries():
    """Spec §2.3: slots appended at l % block == 0; embedding is the first slot; the mix of a boundary layer
    precedes the append; the model output is a mix over all slots + the tail partial sum."""
    model = kimik3.from_preset("micro", seed=1)
    cfg = model.config
    seen = []
    orig = kimik3.model.modeling.attn_res_mix

    def spy(c, n, p, eps):
        seen.append(len(c))
        return orig(c, n, p, eps)

    kimik3.model.modeling.attn_res_mix = spy
    try:
        model(torch.randint(0, cfg.vocab_size, (1, 3), generator=G))
    finally:
        kimik3.model.modeling.attn_res_mix = orig
    bs = cfg.attn_res_block_size
    want = []
    for layer in range(cfg.num_hidden_layers):
        if layer >= 1:
            want.append((layer - 1) // bs + 2)  # attention site: floor((l-1)/bs) + 2 candidates
        want.append(layer // bs + 2)  # MLP site: floor(l/bs) + 2
    want.append(cfg.attn_res_slots + 1)  # model output
    assert seen == want


def test_router_bias_selects_but_does_not_weight():
    """Spec §5.2: weights from the unbiased sigmoid scores, bias only for the choice, renorm +1e-20, scale."""
    cfg = kimik3.get_preset("micro")
    x, W = randn(6, cfg.hidden_size), randn(cfg.n_routed_experts, cfg.hidden_size, scale=0.2)
    bias = torch.zeros(cfg.n_routed_experts)
    bias[3] = 10.0  # forces expert 3 into every selection...
    w, idx = route(x, W, bias, cfg)
    assert (idx == 3).any(-1).all()
    s = torch.sigmoid(x @ W.T)
    want = s.gather(1, idx)
    want = want / (want.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    assert rel_error(w, want) < 1e-7  # ...but its weight is its unbiased score, renormalised


def test_kda_lower_bounded_decay_gate():
    """Spec §3.2 / pitfall 1: g = lb·σ(exp(A_log)·(u + dt_bias)) with lb = -5, not a clamped softplus."""
    model = kimik3.from_preset("micro", seed=2)
    kda = model.model.layers[0].self_attn
    x = randn(2, 1, model.config.hidden_size)
    g = kda.decay(x)
    u = (x @ kda.f_a_proj.weight.T @ kda.f_b_proj.weight.T).float() + kda.dt_bias
    u = u.view(2, 1, model.config.kda_num_heads, -1)
    want = -5.0 * torch.sigmoid(kda.A_log.exp()[:, None] * u)
    assert rel_error(g, want) < 1e-6
    assert (g > -5).all() and (g <= 0).all()  # retention exp(g) in (e^-5, 1]


def test_kda_recurrence_matches_matrix_form():
    """Spec §3.3: S_t = (I − β k kᵀ)·Diag(α)·S_{t−1} + β k vᵀ, o = S_tᵀ q (q pre-scaled)."""
    B, nh, dk = 2, 3, 8
    q, k = torch.nn.functional.normalize(randn(B, nh, dk), dim=-1), torch.nn.functional.normalize(randn(B, nh, dk),
                                                                                                   dim=-1)
    v, g, beta, S = randn(B, nh, dk), -torch.rand(B, nh, dk, generator=G) * 5, torch.rand(B, nh, generator=G), \
        randn(B, nh, dk, dk)
    o, S1 = kda_recurrent_step(q, k, v, g, beta, S)
    for b in range(B):
        for h in range(nh):
            kk = k[b, h][:, None]
            want_S = (torch.eye(dk) - beta[b, h] * kk @ kk.T) @ torch.diag(g[b, h].exp()) @ S[b, h] \
                + beta[b, h] * kk @ v[b, h][None, :]
            assert rel_error(S1[b, h], want_S) < TOL["kernel_state_fp32"]
            assert rel_error(o[b, h], want_S.T @ q[b, h]) < 1e-6


def test_gated_nope_mla_scale_and_gate():
    """Spec §4.2 / pitfall 9: scale (nope+rope)^-0.5 even in NoPE mode; output gated by σ(x·W_gᵀ) before o_proj;
    k_r raw (neither normalised nor rotated). Checked against an explicit per-head loop."""
    model = kimik3.from_preset("micro", seed=3)
    cfg = model.config
    mla = model.model.layers[3].self_attn
    assert cfg.mla_softmax_scale == pytest.approx((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
    T = 5
    x = randn(1, T, cfg.hidden_size)
    cache = mla.new_cache(1, T, x.device, x.dtype)
    y = mla(x, cache, torch.arange(T)[None])
    nope, rope, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    cq = rms_norm(x[0] @ mla.q_a_proj.weight.T, mla.q_a_layernorm.weight, 1e-6)
    Q = (cq @ mla.q_b_proj.weight.T).view(T, -1, nope + rope)
    ckv = x[0] @ mla.kv_a_proj_with_mqa.weight.T
    c, k_r = rms_norm(ckv[:, :L], mla.kv_a_layernorm.weight, 1e-6), ckv[:, L:]
    KV = (c @ mla.kv_b_proj.weight.T).view(T, -1, 2 * nope)
    outs = []
    for t in range(T):
        heads = []
        for h in range(cfg.num_attention_heads):
            sc = torch.stack([(Q[t, h, :nope] @ KV[s, h, :nope] + Q[t, h, nope:] @ k_r[s]) for s in range(t + 1)])
            p = torch.softmax(sc * (nope + rope) ** -0.5, 0)
            heads.append((p[:, None] * KV[: t + 1, h, nope:]).sum(0))
        o = torch.cat(heads) * torch.sigmoid(x[0, t] @ mla.g_proj.weight.T)
        outs.append(o @ mla.o_proj.weight.T)
    assert rel_error(y[0], torch.stack(outs)) < 1e-6
    assert torch.equal(cache.k_r[0], k_r)  # cached raw


def test_latent_norm_applies_to_combined_sum():
    """Spec §5.3 / pitfall 13: down-project once, combine experts in fp32 with router weights, latent RMSNorm on
    the SUM, up-project, add the full-width shared MLP of the same normed input."""
    model = kimik3.from_preset("micro", seed=4)
    cfg = model.config
    moe = model.model.layers[1].block_sparse_moe
    x = randn(5, cfg.hidden_size)
    w, idx = moe.gate(x)
    xl = x @ moe.routed_expert_down_proj.weight.T
    acc = torch.zeros(5, cfg.moe_latent_size)
    for n in range(5):
        for j in range(cfg.num_experts_per_tok):
            e = idx[n, j].item()
            h = situ_glu(xl[n] @ moe.experts.w1[e].T, xl[n] @ moe.experts.w3[e].T, 4.0, 25.0)
            acc[n] += (h @ moe.experts.w2[e].T) * w[n, j]
    want = rms_norm(acc, moe.routed_expert_norm.weight, 1e-5) @ moe.routed_expert_up_proj.weight.T
    sh = moe.shared_experts
    want = want + situ_glu(x @ sh.gate_proj.weight.T, x @ sh.up_proj.weight.T, 4.0, 25.0) @ sh.down_proj.weight.T
    assert rel_error(moe(x), want) < 1e-6


def _scalar_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Spec §5.5 read literally, one element at a time."""
    R, half = packed.shape
    out = torch.empty(R, 2 * half)
    for r in range(R):
        for c in range(2 * half):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            mag = [0, 0.5, 1, 1.5, 2, 3, 4, 6][code & 7]
            val = -mag if code & 8 else mag
            out[r, c] = val * 2.0 ** (int(scale[r, c // 32]) - 127)
    return out


def test_mxfp4_unpack_bitwise_and_roundtrip():
    """Spec §5.5: low nibble = even column, E2M1 codes, E8M0 scale per 32 inputs. Dequantisation is bitwise equal
    to the rule; our packer's values survive re-packing."""
    packed = torch.randint(0, 256, (6, 48), generator=G, dtype=torch.uint8)
    scale = torch.randint(100, 140, (6, 3), generator=G, dtype=torch.uint8)
    got = mxfp4_dequantize(packed, scale, torch.float32)
    assert torch.equal(got, _scalar_mxfp4(packed, scale))
    w = randn(8, 64, scale=0.05)
    p, s = mxfp4_quantize(w)
    deq = mxfp4_dequantize(p, s, torch.float32)
    p2, s2 = mxfp4_quantize(deq)  # representable values survive a second quantisation exactly
    assert torch.equal(mxfp4_dequantize(p2, s2, torch.float32), deq)
    assert torch.equal(mxfp4_dequantize(p, s, torch.bfloat16).float(), deq)  # exactly representable in bf16
    assert (deq - w).abs().max() <= w.abs().max() / 6 * 1.0 + 1e-9  # quantisation error within one code step
    assert E2M1_VALUES[8].item() == 0.0


def test_mxfp4_checkpoint_roundtrip(tmp_path):
    """A K3-layout checkpoint with MXFP4-packed experts loads to the dequantised weights exactly (§5.5, §7)."""
    model = kimik3.from_preset("micro", seed=5)
    kimik3.save_pretrained(model, tmp_path, expert_format="mxfp4")
    back = kimik3.from_pretrained(tmp_path)
    src = model.model.layers[1].block_sparse_moe.experts.w1
    dst = back.model.layers[1].block_sparse_moe.experts.w1
    for e in range(src.shape[0]):
        p, s = mxfp4_quantize(src[e].detach())
        assert torch.equal(dst[e], mxfp4_dequantize(p, s, torch.float32))
    # everything that is not a routed expert is unchanged
    sd_a, sd_b = model.state_dict(), back.state_dict()
    for k in sd_a:
        if ".experts." not in k:
            assert torch.equal(sd_a[k], sd_b[k]), k
