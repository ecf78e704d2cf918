"""kimik3 vs transformers' own models (the oracles of validation.md): prefill and 16 greedy decode steps.

Expectation source: transformers 5.23 DeepseekV3ForCausalLM / KimiLinearForCausalLM, run here on CPU in fp32,
their checkpoints written by their own save_pretrained. Tolerance: TOL["fp32_oracle"] per step, identical
greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.validation.metric import TOL, rel_error

STEPS = 16


@pytest.mark.parametrize("name", ["dsv3-qlora-norm", "dsv3-qlora-nonorm", "dsv3-noqlora-norm",
                                  "dsv3-noqlora-nonorm", "kimi-linear"])
def test_matches_transformers_prefill_and_greedy_decode(oracle_checkpoint, name):
    path, hf = oracle_checkpoint(name)
    model = kimik3.from_pretrained(path, dtype=torch.float32)
    cfg = model.config
    if name.startswith("dsv3"):  # the DeepSeek-V3 features these oracle configs exist to cover
        assert cfg.n_group > cfg.topk_group > 0 and cfg.first_k_dense_replace > 1 and cfg.rope_scaling
    else:
        assert cfg.kda_layers and cfg.mla_layers
    g = torch.Generator().manual_seed(7)
    B, T = 2, 9
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    dec = kimik3.Decoder(model, stage="naive", batch_size=B, max_seq_len=T + STEPS + 1)
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        ref, cache = out.logits[:, -1], out.past_key_values
        ours = dec.prefill(ids)
        assert rel_error(ours, ref) <= TOL["fp32_oracle"], f"prefill e={rel_error(ours, ref):.2e}"
        full = torch.cat([ids, torch.zeros(B, STEPS, dtype=torch.long)], 1)
        for s in range(STEPS):
            nxt = ref.argmax(-1)
            assert torch.equal(ours.argmax(-1), nxt), f"greedy token differs at step {s}"
            full[:, T + s] = nxt
            out = hf(nxt[:, None], past_key_values=cache, use_cache=True)
            ref, cache = out.logits[:, -1], out.past_key_values
            ours = dec.step(nxt)
            e = rel_error(ours, ref)
            assert e <= TOL["fp32_oracle"], f"decode step {s}: e={e:.2e}"
        # and the full-sequence forward agrees with transformers' full forward on the whole generated sequence
        seq = full[:, : T + STEPS]
        assert rel_error(model(seq), hf(seq).logits) <= TOL["fp32_oracle"]


def test_yarn_frequencies_and_scale_match_transformers(oracle_checkpoint):
    path, hf = oracle_checkpoint("dsv3-qlora-norm")
    model = kimik3.from_pretrained(path)
    attn = next(layer.self_attn for layer in model.model.layers)
    assert torch.allclose(attn.inv_freq, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert attn.rope_attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert model.config.mla_softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
