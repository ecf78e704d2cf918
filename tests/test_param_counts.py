"""Full-size presets instantiate on the meta device; parameter counts agree with spec §8.2 within 1%.

Active parameters per token exclude the embedding table and include the lm_head: all non-expert parameters plus
top-k experts in every MoE layer.
"""

from __future__ import annotations

import pytest

import kimik3

SPEC_82 = {  # spec §8.2 [derived]
    "kimi-k3": (2.7795e12, 104.2e9),
    "kimi-k2": (1.026e12, 31.7e9),
}


def counts(name: str) -> tuple[int, int]:
    model = kimik3.build_model(name, "meta")
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = experts // max(1, cfg.n_routed_experts * len(cfg.moe_layers))
    active = total - experts - model.model.embed_tokens.weight.numel() \
        + len(cfg.moe_layers) * cfg.num_experts_per_tok * per_expert
    return total, active


@pytest.mark.parametrize("name", sorted(SPEC_82))
def test_total_and_active_parameters_match_spec(name):
    total, active = counts(name)
    want_total, want_active = SPEC_82[name]
    assert abs(total / want_total - 1) < 0.01, f"{name}: {total / 1e9:.1f}B total vs {want_total / 1e9:.1f}B"
    assert abs(active / want_active - 1) < 0.01, f"{name}: {active / 1e9:.2f}B active vs {want_active / 1e9:.2f}B"


@pytest.mark.parametrize("name", kimik3.PRESET_NAMES)
def test_every_preset_instantiates_on_meta(name):
    model = kimik3.build_model(name, "meta")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_small_presets_sizes():
    assert counts("micro")[0] < 5e6
    assert 50e6 <= counts("tiny")[0] <= 100e6
    cfg = kimik3.get_preset("k3-shard")  # validation.md: true K3 widths, 4 layers, 56 experts, top-16
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (7168, 4, 56, 16)
    assert cfg.kda_layers == (0, 1, 2) and cfg.mla_layers == (3,) and cfg.first_k_dense_replace == 0
    assert 23e9 < counts("k3-shard")[0] * 2 < 25e9  # ≈ 24 GB of weights in bf16
