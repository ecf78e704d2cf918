"""The released K3 modeling code is matched (tests/fixtures/k3-release-tiny, written and run by Moonshot's code).

Expectation source: the fixture's expected.safetensors (prompt [2, 6], 10 greedy steps, logits [2, 11, 256]).
Tolerance: TOL["fp32_oracle"] per step, identical greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kimik3
from kimik3.validation.metric import TOL, rel_error

# Inside the repository, so a lone clone runs this test (see the fixture's README for its provenance).
GOLDEN = Path(__file__).resolve().parent / "fixtures" / "k3-release-tiny"


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.exists():
        pytest.fail(f"golden fixture missing at {GOLDEN} (it is part of the repository: restore it from git)")
    return kimik3.from_pretrained(GOLDEN, dtype=torch.float32), load_file(GOLDEN / "expected.safetensors")


def test_config_parsed_from_release_layout(golden):
    model, _ = golden
    cfg = model.config
    assert cfg.family == "kimi_k3" and cfg.attn_res_block_size == 3 and cfg.hidden_act == "situ"
    assert cfg.mla_layers == (3, 6) and cfg.kda_gate_lower_bound == -5.0 and cfg.kda_full_rank_gate
    assert cfg.moe_latent_size == 32 and cfg.moe_latent_norm and cfg.mla_use_output_gate


def test_naive_decoder_reproduces_release_logits(golden):
    model, exp = golden
    prompt, generated, logits = exp["prompt_ids"], exp["generated_ids"], exp["logits"]
    B, T = prompt.shape
    steps = logits.shape[1] - 1
    dec = kimik3.Decoder(model, stage="naive", batch_size=B, max_seq_len=generated.shape[1])
    out = dec.prefill(prompt)
    for s in range(steps + 1):
        e = rel_error(out, logits[:, s])
        assert e <= TOL["fp32_oracle"], f"step {s}: e={e:.2e}"
        assert torch.equal(out.argmax(-1), generated[:, T + s]) if T + s < generated.shape[1] else True
        if s < steps:
            out = dec.step(generated[:, T + s])


def test_generate_reproduces_release_tokens(golden):
    model, exp = golden
    prompt, generated = exp["prompt_ids"], exp["generated_ids"]
    dec = kimik3.Decoder(model, batch_size=2, max_seq_len=generated.shape[1])
    assert torch.equal(dec.generate(prompt, max_new_tokens=generated.shape[1] - prompt.shape[1]), generated)


def test_full_sequence_forward_matches_release(golden):
    model, exp = golden
    full = model(exp["generated_ids"])
    T = exp["prompt_ids"].shape[1]
    for s in range(exp["logits"].shape[1]):
        assert rel_error(full[:, T - 1 + s], exp["logits"][:, s]) <= TOL["fp32_oracle"]
