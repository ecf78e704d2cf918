"""The decode cost model against spec §8 (full-size K3 and K2 on the meta device) and against arithmetic written out
by hand for one MLA, one KDA and one LatentMoE block of the ``micro`` preset. All CPU, a few seconds."""

from __future__ import annotations

import math

import pytest
import torch

import kimik3
from kimik3.perf.cost import (
    attn_res_mixes,
    batch_size_for_bytes,
    cache_bytes_per_sequence,
    decode_cost,
    expected_distinct_experts,
    parameter_counts,
)

GB = 1e9
SPEC_TOL = 0.02  # acceptance: within 2 % of the spec's rounded §8.2 figures


def close(got: float, want: float, tol: float = SPEC_TOL) -> bool:
    return abs(got / want - 1) <= tol


def kind(cost, block: str, column: str = "weight_bytes") -> float:
    k = cost.by_kind()
    return float(k.loc[block, column]) if block in k.index else 0.0


# ====================================================================== spec §8.2, full size


@pytest.mark.parametrize("expert_dtype, total, experts", [("bf16", 208.40, 97.24), ("mxfp4", 136.99, 25.83)])
def test_k3_weights_read_per_step_match_spec(expert_dtype, total, experts):
    c = decode_cost("kimi-k3", 1, 8192, expert_dtype=expert_dtype)
    assert close(c.weight_bytes / GB, total), c.weight_bytes / GB
    assert close(c.routed_expert_bytes / GB, experts), c.routed_expert_bytes / GB
    # the split "KDA / MLA / MoE-shared+latent+router / dense / head" is the same for both expert dtypes
    moe_rest = sum(kind(c, b) for b in ("router", "moe_latent", "shared_experts"))
    for got, want in [(kind(c, "kda"), 61.26), (kind(c, "mla"), 11.15), (moe_rest, 34.95),
                      (kind(c, "dense_mlp"), 1.45), (kind(c, "lm_head"), 2.35)]:
        assert close(got / GB, want), (got / GB, want)


def test_k3_state_and_kv_traffic_match_spec():
    c = decode_cost("kimi-k3", 1, 8192)
    assert close(c.state_bytes / GB, 0.899)  # 69 KDA layers x 6,512,640 B, read + write
    assert close(kind(c, "kda", "state_bytes_read"), 69 * 6_512_640, 1e-12)
    assert close(kind(c, "mla", "kv_bytes_read") / GB, 0.226)
    c128 = decode_cost("kimi-k3", 1, 131072)
    assert close(kind(c128, "mla", "kv_bytes_read") / GB, 3.624)


@pytest.mark.parametrize("preset, t, want", [("kimi-k3", 0, 2.097e11), ("kimi-k3", 8192, 2.508e11),
                                             ("kimi-k3", 131072, 8.669e11), ("kimi-k2", 0, 6.44e10),
                                             ("kimi-k2", 8192, 1.340e11), ("kimi-k2", 131072, 1.178e12)])
def test_flops_per_token_match_spec(preset, t, want):
    # Note: spec §8.1 counts the MLA kv_b_proj weights twice (once in 2·232,194,048, once as the two absorbed
    # products); they are used once each way here, 0.3 % (K3) / 1.6 % (K2) lower at T -> 0. Within tolerance.
    c = decode_cost(preset, 1, t)
    assert close(c.flops_per_token, want), (c.flops_per_token, want)


@pytest.mark.parametrize("expert_dtype, total, experts", [("bf16", 63.37, 42.28), ("mxfp4", 32.33, 11.23)])
def test_k2_weights_read_per_step_match_spec(expert_dtype, total, experts):
    c = decode_cost("kimi-k2", 1, 8192, expert_dtype=expert_dtype)
    assert close(c.weight_bytes / GB, total), c.weight_bytes / GB
    assert close(c.routed_expert_bytes / GB, experts), c.routed_expert_bytes / GB
    for got, want in [(kind(c, "mla"), 12.34), (kind(c, "router") + kind(c, "shared_experts"), 5.62),
                      (kind(c, "dense_mlp"), 0.79), (kind(c, "lm_head"), 2.35)]:
        assert close(got / GB, want), (got / GB, want)
    assert c.state_bytes == 0
    assert close(kind(c, "mla", "kv_bytes_read") / GB, 0.576)
    assert close(kind(decode_cost("kimi-k2", 1, 131072), "mla", "kv_bytes_read") / GB, 9.211)


@pytest.mark.parametrize("preset, total, active", [("kimi-k3", 2.7795e12, 104.2e9), ("kimi-k2", 1.026e12, 31.7e9)])
def test_parameter_counts_match_spec(preset, total, active):
    n = parameter_counts(preset)
    assert close(n["total"], total, 0.01) and close(n["active_per_token"], active, 0.01), n
    if preset == "kimi-k3":
        assert close(n["routed_experts"], 2.723e12, 0.01)


@pytest.mark.parametrize("preset, bytes_per_token, flops_per_token", [("kimi-k3", 27_648, 5.01e6),
                                                                      ("kimi-k2", 70_272, 8.50e6)])
def test_context_dependent_parts_match_spec(preset, bytes_per_token, flops_per_token):
    a, b = decode_cost(preset, 1, 1000), decode_cost(preset, 1, 2000)
    assert (b.kv_bytes - a.kv_bytes) / 1000 == pytest.approx(bytes_per_token)
    per_token = (b.by_block["flops_state"].sum() - a.by_block["flops_state"].sum()) / 1000
    assert close(per_token, flops_per_token, 0.005)


def test_cache_per_sequence_and_k3_k2_crossover():
    assert cache_bytes_per_sequence("kimi-k3", 0) == 69 * 6_512_640  # 449 MB fixed KDA state (§3.4)
    assert cache_bytes_per_sequence("kimi-k3", 10) - cache_bytes_per_sequence("kimi-k3", 0) == 10 * 27_648
    assert cache_bytes_per_sequence("kimi-k2", 10) == 10 * 70_272
    crossover = next(t for t in range(0, 20_000, 100)
                     if cache_bytes_per_sequence("kimi-k3", t) < cache_bytes_per_sequence("kimi-k2", t))
    assert 10_000 <= crossover <= 11_000  # "K3's cache is smaller beyond ≈ 10.5 K tokens" (§8.2)


def test_attn_res_mixes_and_candidate_reads_match_spec():
    cfg = kimik3.get_preset("kimi-k3")
    mixes = attn_res_mixes(cfg)
    assert len(mixes) == 186 and sum(c for *_, c in mixes) == 1002  # §2.3
    assert mixes[-1] == (93, "output", 9)
    c = decode_cost(cfg, 3, 16)
    # every candidate read once and every mix written once, per sequence, in bf16
    assert kind(c, "attn_res", "activation_bytes") == 3 * (1002 + 186) * 7168 * 2
    assert kind(c, "attn_res") == pytest.approx(187 * 2 * 7168 * 2, rel=0.01)  # ≈ 5.4 MB of mixing weights


def test_mla_forms_follow_spec_81():
    absorbed = decode_cost("kimi-k3", 1, 1000, mla_form="absorbed")
    naive = decode_cost("kimi-k3", 1, 1000, mla_form="naive")
    reexpand = decode_cost("kimi-k3", 1, 1000, mla_form="reexpand")
    assert kind(naive, "mla", "kv_bytes_read") == 24 * 1000 * 61_440  # expanded cache, 61,440 B/token/layer
    assert kind(reexpand, "mla", "kv_bytes_read") == kind(absorbed, "mla", "kv_bytes_read")
    assert kind(naive, "mla", "flops_state") == 24 * 1000 * 2 * 96 * (192 + 128)
    assert kind(reexpand, "mla", "flops_state") == 24 * 1000 * (2 * 96 * (192 + 128) + 2 * 512 * 24576)
    assert kind(absorbed, "mla", "flops_state") == 24 * 1000 * 2 * 96 * (576 + 512)


def test_batch_size_for_bytes_finds_the_threshold():
    b = batch_size_for_bytes("kimi-k3", 1.5e12, 8192, expert_dtype="mxfp4")
    assert decode_cost("kimi-k3", b - 1, 8192, expert_dtype="mxfp4").total_bytes < 1.5e12
    assert decode_cost("kimi-k3", b, 8192, expert_dtype="mxfp4").total_bytes >= 1.5e12
    assert batch_size_for_bytes("micro", 1e15, 8, max_batch=64) is None
    assert batch_size_for_bytes("micro", 1.0, 8) == 1


def test_k3_shard_matches_validation_preset():
    c = decode_cost("k3-shard", 1, 4096)
    assert c.resident_weight_bytes / GB == pytest.approx(24, rel=0.05)  # validation.md: weights ≈ 24 GB
    assert c.total_bytes / GB == pytest.approx(11, rel=0.05)  # one step at batch 1 reads ≈ 11 GB


# ====================================================================== one source of truth


def test_weights_come_from_the_model_parameters():
    model = kimik3.build_model("tiny", "meta")
    from_model, from_preset = decode_cost(model, 2, 64), decode_cost("tiny", 2, 64)
    assert from_model.by_block.equals(from_preset.by_block)
    assert from_preset.by_block["params"].sum() == sum(p.numel() for p in model.parameters())
    assert from_preset.resident_weight_bytes == sum(
        p.numel() * (4 if kimik3.model.modeling.keeps_fp32(n) else 2) for n, p in model.named_parameters())
    wider = decode_cost(kimik3.get_preset("tiny").replace(moe_intermediate_size=512), 2, 64)
    assert kind(wider, "experts") > kind(from_preset, "experts")


def test_dtypes_and_validation():
    bf16, fp8 = decode_cost("tiny", 1, 8), decode_cost("tiny", 1, 8, expert_dtype="fp8")
    assert kind(fp8, "experts") == kind(bf16, "experts") / 2
    with pytest.raises(ValueError, match="unknown dtype"):
        decode_cost("tiny", 1, 8, expert_dtype="int3")
    with pytest.raises(ValueError, match="mla_form"):
        decode_cost("tiny", 1, 8, mla_form="fast")
    with pytest.raises(ValueError, match="batch_size"):
        decode_cost("tiny", 0, 8)
    with pytest.raises(ValueError, match="2 sequences"):
        decode_cost("tiny", 3, [4, 5])
    ragged, flat = decode_cost("tiny", 2, [0, 200]), decode_cost("tiny", 2, 100)
    assert ragged.kv_bytes == flat.kv_bytes and ragged.state_bytes == flat.state_bytes


def test_summary_totals_agree():
    c = decode_cost("micro", 4, 32)
    s = c.summary()
    assert s.loc["total", "total_GB"] == pytest.approx(c.total_bytes / GB)
    assert s.loc["total", "GFLOP"] == pytest.approx(c.total_flops / GB)
    assert c.arithmetic_intensity == pytest.approx(c.total_flops / c.total_bytes)
    assert c.lower_bound_seconds(1e12, 1e15) == max(c.total_bytes / 1e12, c.total_flops / 1e15)


# ====================================================================== by hand, micro preset
# micro: H=64, KDA 4 heads x 16 (P=64, conv W=4), MLA 4 heads, q_lora 32, kv_lora 32, nope 16, rope 8, v 16,
# 16 experts top-4, latent 32, expert width 32, 2 shared (width 64); layer 1 = KDA + LatentMoE, layer 3 = MLA.
B, LENS = 2, [5, 9]


def row(cost, layer: int, block: str):
    df = cost.by_block
    return df[(df["layer"] == layer) & (df["block"] == block)].iloc[0]


def test_hand_kda_block():  # spec §3.1 shapes, §3.4 state, §3.2 recurrence
    r = row(decode_cost("micro", B, LENS), 1, "kda")
    H, P, dk, nh, W = 64, 4 * 16, 16, 4, 4
    bf16 = 3 * P * H + dk * H + P * dk + nh * H + P * H + H * P  # q k v, f_a, f_b, b, g, o
    fp32 = 3 * P * W + P + nh + dk  # q/k/v conv, dt_bias, A_log, o_norm
    assert bf16 == 22_784 and fp32 == 852
    assert r.weight_bytes == 2 * bf16 + 4 * fp32 + 2 * H  # + input_layernorm = 49,104
    assert r.flops_weights == B * 2 * (bf16 + 3 * P * W)  # every projection and the depthwise conv, 2 per MAC
    per_seq = nh * dk * dk * 4 + 3 * P * (W - 1) * 2  # fp32 S + bf16 conv history = 5,248
    assert r.state_bytes_read == r.state_bytes_written == B * per_seq
    assert r.flops_state == B * (7 * nh * dk * dk + 2 * nh * dk)  # decay, predict, update, read


def test_hand_mla_block():  # spec §4.1 shapes, §4.3 cache, §4.4 absorbed attention
    H, nh, q_lora, lat, rope, nope, v = 64, 4, 32, 32, 8, 16, 16
    bf16 = (q_lora * H + nh * (nope + rope) * q_lora + (lat + rope) * H + nh * (nope + v) * lat
            + nh * v * H + H * nh * v)  # q_a, q_b, kv_a, kv_b, g, o
    assert bf16 == 19_968
    sum_t = sum(LENS)
    expand = 2 * lat * nh * (nope + v)  # one cached latent through kv_b_proj
    for form, entry, per_ctx in [("absorbed", (lat + rope) * 2, 2 * nh * ((lat + rope) + lat)),
                                 ("naive", nh * (nope + rope + v) * 2, 2 * nh * (nope + rope + v)),
                                 ("reexpand", (lat + rope) * 2, 2 * nh * (nope + rope + v) + expand)]:
        r = row(decode_cost("micro", B, LENS, mla_form=form), 3, "mla")
        assert r.weight_bytes == 2 * bf16 + 2 * (q_lora + lat + H)  # + q_a / kv_a / input norms = 40,192
        assert r.flops_weights == B * 2 * bf16  # kv_b used once: as W_UK and W_UV when absorbed
        assert r.kv_bytes_read == sum_t * entry and r.kv_bytes_written == B * entry
        assert r.flops_state == sum_t * per_ctx


def test_hand_latent_moe_block():  # spec §5.2 router, §5.3 LatentMoE, §5.5 MXFP4, §8 D(B)
    H, E, k, lat, inner, shared = 64, 16, 4, 32, 32, 64
    c = decode_cost("micro", B, LENS)
    assert row(c, 1, "router").weight_bytes == 2 * E * H + 4 * E + 2 * H  # gate bf16, bias fp32, post-attn norm
    assert row(c, 1, "moe_latent").weight_bytes == 2 * (lat * H + H * lat + lat)  # down, up, latent norm
    assert row(c, 1, "shared_experts").weight_bytes == 2 * 3 * shared * H
    per_expert = 3 * inner * lat  # w1, w3 [I, L] and w2 [L, I]
    d_uniform = E * (1 - (1 - k / E) ** B)  # = 7.0 at B = 2
    assert d_uniform == 7.0
    r = row(c, 1, "experts")
    assert r.experts_touched == 7.0 and r.weight_bytes == 7.0 * per_expert * 2
    assert r.flops_weights == B * k * 2 * per_expert  # every (token, expert) pair, overlapping or not
    assert row(c, 1, "router").flops_weights == B * 2 * E * H
    assert row(c, 1, "moe_latent").flops_weights == B * 2 * 2 * lat * H
    assert row(c, 1, "shared_experts").flops_weights == B * 2 * 3 * shared * H
    # exact routing: tokens pick {0..3} and {2..5} -> 6 distinct experts; MXFP4 = 4.25 bits per weight
    exact = decode_cost("micro", B, LENS, routing=torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5]]), expert_dtype="mxfp4")
    assert row(exact, 1, "experts").weight_bytes == 6 * per_expert * 4.25 / 8  # 9,792 B


# ====================================================================== distinct experts


def test_expected_distinct_experts_properties():
    for E, k in [(896, 16), (384, 8), (8, 2)]:
        assert expected_distinct_experts(E, k, 1) == pytest.approx(k)
        d = [expected_distinct_experts(E, k, b) for b in range(1, 2000, 7)]
        assert all(x <= y for x, y in zip(d, d[1:])) and all(x <= E for x in d)  # saturates at E in floating point
        assert all(x < y for x, y in zip(d[:5], d[1:6]))
        assert expected_distinct_experts(E, k, 100_000) == pytest.approx(E)
    with pytest.raises(ValueError):
        expected_distinct_experts(8, 9, 1)


@pytest.mark.parametrize("E, k, table", [
    (896, 16, [16, 31.7, 62.3, 120.3, 224.4, 392.6, 613.2, 806.7, 887.1]),
    (384, 8, [8, 15.8, 31.0, 59.5, 109.8, 188.2, 284.2, 358.1, 382.2])])
def test_expected_distinct_experts_spec_table(E, k, table):  # spec §8 table
    for b, want in zip([1, 2, 4, 8, 16, 32, 64, 128, 256], table):
        assert round(expected_distinct_experts(E, k, b), 1) == pytest.approx(want, abs=0.051)


@pytest.mark.parametrize("B, trials", [(8, 600), (64, 150)])
def test_expected_distinct_experts_monte_carlo(B, trials):
    E, k = 896, 16
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(trials, B, E, generator=g).topk(k, dim=-1).indices  # uniform k-subsets per token
    counts = torch.zeros(trials, E, dtype=torch.bool).scatter_(1, ids.flatten(1), True).sum(1).double()
    sem = counts.std().item() / math.sqrt(trials)
    assert abs(counts.mean().item() - expected_distinct_experts(E, k, B)) < 4 * sem + 0.5


def test_routing_inputs():
    cfg = kimik3.get_preset("micro")
    n_moe = len(cfg.moe_layers)
    ids = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4], [0, 2, 3, 4]])  # 5 distinct experts
    a = decode_cost(cfg, 3, 8, routing=ids)
    b = decode_cost(cfg, 3, 8, routing=[5] * n_moe)
    c = decode_cost(cfg, 3, 8, routing=5)

    def experts(cost):
        return cost.by_block.loc[cost.by_block["block"] == "experts", "experts_touched"].tolist()

    assert experts(a) == experts(b) == experts(c) == [5.0] * n_moe
    assert experts(decode_cost(cfg, 3, 8, routing=torch.full((n_moe,), 5))) == [5.0] * n_moe
    same = torch.tensor([[0, 1, 2, 3]] * 3)  # every token the same 4 experts
    per_layer = torch.stack([ids] * (n_moe - 1) + [same])
    assert experts(decode_cost(cfg, 3, 8, routing=per_layer)) == [5.0] * (n_moe - 1) + [4.0]
    with pytest.raises(ValueError, match="batch_size"):
        decode_cost(cfg, 2, 8, routing=ids)
    with pytest.raises(ValueError, match="0..15"):
        decode_cost(cfg, 3, 8, routing=ids + 12)
    with pytest.raises(ValueError, match="integer"):
        decode_cost(cfg, 3, 8, routing=ids.float())
    with pytest.raises(ValueError, match="one per MoE layer"):
        decode_cost(cfg, 3, 8, routing=[4, 4])
    with pytest.raises(ValueError, match="min"):
        decode_cost(cfg, 1, 8, routing=5)  # one token cannot touch more than k experts
