"""LatentMoE vs transformers' Nemotron-H MoE, piece by piece where the two share semantics.

Expectation source: transformers 5.23 ``NemotronHMoE`` / ``NemotronHTopkRouter`` (latent MoE without a latent
norm, non-gated ReLU² experts). Shared semantics compared: router selection and weights, the latent down/up
projections around the experts, the fp32 weighted combine, adding the shared branch. The expert FFN itself
differs (K3: gated SiTU-GLU; Nemotron-H: up -> relu² -> down), so for the whole-block comparison our expert and
shared functions are swapped for Nemotron-H's — everything else is kimik3's own code.
"""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.validation.metric import TOL, rel_error

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    cfg = kimik3.get_preset("micro").replace(moe_latent_norm=False, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    ncfg = NemotronHConfig(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                           moe_latent_size=cfg.moe_latent_size, n_routed_experts=cfg.n_routed_experts,
                           num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group,
                           topk_group=cfg.topk_group, norm_topk_prob=True, routed_scaling_factor=2.5,
                           moe_shared_expert_intermediate_size=48, mlp_bias=False, mlp_hidden_act="relu2",
                           layers_block_type=["moe"], vocab_size=64, num_attention_heads=4, num_key_value_heads=4,
                           head_dim=16)
    torch.manual_seed(0)
    ref = NemotronHMoE(ncfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
        ref.gate.e_score_correction_bias.normal_(0, 0.05)
    model = kimik3.build_model(cfg)
    kimik3.model.random_init.init_weights(model, seed=0)
    moe = model.model.layers[1].block_sparse_moe
    with torch.no_grad():
        moe.gate.weight.copy_(ref.gate.weight)
        moe.gate.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
        moe.routed_expert_down_proj.weight.copy_(ref.fc1_latent_proj.weight)
        moe.routed_expert_up_proj.weight.copy_(ref.fc2_latent_proj.weight)
    return moe.eval(), ref


def test_router_selection_and_weights(pair):
    moe, ref = pair
    x = torch.randn(17, moe.cfg.hidden_size)
    _, w_ref, i_ref = ref.gate(x)
    w, i = moe.gate(x)
    o_ref, o = i_ref.sort(-1), i.sort(-1)
    assert torch.equal(o.values, o_ref.values)  # same experts chosen (grouped, bias for selection only)
    assert rel_error(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices)) < 1e-7


def test_latent_projections_combine_and_shared_branch(pair):
    moe, ref = pair

    def nemotron_expert(e, xl):  # Nemotron-H's expert: up -> relu^2 -> down
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(xl, ref.experts.up_proj[e])) ** 2,
                                          ref.experts.down_proj[e])

    moe.expert = nemotron_expert
    moe.shared_experts = ref.shared_experts
    try:
        x = torch.randn(9, moe.cfg.hidden_size)
        with torch.no_grad():
            assert moe.to_latent(x).shape[-1] == moe.cfg.moe_latent_size  # experts run in the latent width
            assert rel_error(moe(x), ref(x[None])[0]) <= TOL["fp32_oracle"]
    finally:
        del moe.expert
        del moe.shared_experts
