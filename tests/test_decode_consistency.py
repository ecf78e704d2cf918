"""Step-by-step decode equals the full-sequence forward (fp32), including right-padded batches.

Expectation source: the model's own full-sequence forward ``model(ids)`` (one chunk of T tokens through every
layer) vs the Decoder's token-by-token prefill and decode through per-layer caches. Tolerance TOL["fp32_stage"].
"""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.validation.metric import TOL, rel_error

CPU_PRESETS = ["micro", pytest.param("tiny", marks=pytest.mark.slow),
               pytest.param("k3-deep-tiny", marks=pytest.mark.slow)]


def check_padded_batch(model, lengths: list[int], new: int, seed: int = 0) -> None:
    """Each row: prompt of its own length, then `new` greedy tokens; compare every step with model(row)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    dec = kimik3.Decoder(model, batch_size=B, max_seq_len=T + new)
    out = dec.generate(ids, max_new_tokens=new, lengths=lengths)
    logits = [dec.prefill(ids, lengths)]
    for s in range(new - 1):
        logits.append(dec.step(out[torch.arange(B), torch.tensor(lengths) + s]))
    for b, n in enumerate(lengths):
        row = out[b : b + 1, : n + new]
        full = model(row)[0]  # one sequence, no padding at all
        for s in range(new):
            e = rel_error(logits[s][b], full[n - 1 + s])
            assert e <= TOL["fp32_stage"], f"row {b} (len {n}) step {s}: e={e:.2e}"
            assert int(full[n - 1 + s].argmax()) == int(out[b, n + s])
        assert (out[b, n + new :] == (cfg.pad_token_id or 0)).all()


@pytest.mark.parametrize("preset", CPU_PRESETS)
def test_decode_equals_full_forward_padded(preset):
    # k3-deep-tiny runs in fp64: 92 MoE layers of random weights make expert choice so sensitive to rounding
    # (a 1e-6 relative nudge of the embeddings moves its fp32 logits by O(1) through flipped top-k near-ties)
    # that fp32 decode and full forward, which round differently, can pick different experts.
    dtype = torch.float64 if preset == "k3-deep-tiny" else torch.float32
    model = kimik3.from_preset(preset, seed=3, dtype=dtype)
    check_padded_batch(model, [7, 3, 5] if preset == "micro" else [6, 2], new=6 if preset == "micro" else 3)


def test_unpadded_prefill_equals_forward_last_position():
    model = kimik3.from_preset("micro", seed=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    dec = kimik3.Decoder(model, batch_size=2, max_seq_len=16)
    assert rel_error(dec.prefill(ids), model(ids)[:, -1]) <= TOL["fp32_stage"]


def test_rope_family_padded_decode(tmp_path):
    """The same for a DeepSeek-style (RoPE + YaRN, additive residual, grouped routing) config: positions are
    per-sequence, so a right-padded row must rotate its keys at its own positions."""
    cfg = kimik3.get_preset("micro").replace(
        family="deepseek_v3", name="micro-ds", kda_layers=(), attn_res_block_size=None, hidden_act="silu",
        mla_use_nope=False, mla_use_output_gate=False, moe_latent_size=None, moe_latent_norm=False, n_group=4,
        topk_group=2, first_k_dense_replace=2, rope_scaling=dict(factor=4.0, original_max_position_embeddings=16,
                                                                  beta_fast=32, beta_slow=1, mscale=1.0,
                                                                  mscale_all_dim=1.0))
    model = kimik3.from_preset(cfg, seed=5)
    check_padded_batch(model, [6, 2, 4], new=4)


def test_failed_call_loses_nothing():
    """A rejected step leaves the decoder exactly where it was."""
    model = kimik3.from_preset("micro", seed=6)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    a = kimik3.Decoder(model, batch_size=2, max_seq_len=16)
    b = kimik3.Decoder(model, batch_size=2, max_seq_len=16)
    a.prefill(ids)
    b.prefill(ids)
    with pytest.raises(ValueError):
        a.step(torch.tensor([1, 10**6]))
    nxt = torch.tensor([3, 4])
    assert torch.equal(a.step(nxt), b.step(nxt))


def test_greedy_decode_is_deterministic():
    model = kimik3.from_preset("micro", seed=7)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    runs = [kimik3.Decoder(model, batch_size=2, max_seq_len=32).generate(ids, 8) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_logits_are_sane_for_presets():
    for name in ("micro", "tiny"):
        model = kimik3.from_preset(name, seed=0)
        logits = model(torch.randint(0, model.config.vocab_size, (1, 4)))
        assert torch.isfinite(logits).all()
        p = torch.softmax(logits[0, -1], -1)
        assert 0.5 < logits.std() < 20 and p.max() < 0.9, f"{name}: logits saturated or degenerate"
