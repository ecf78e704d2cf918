"""Checkpoints written by a transformers version newer than the pinned one load and reproduce its logits.

The suite runs with the pinned transformers, which cannot write what a newer version writes; the committed
fixtures under ``tests/fixtures/hf-<version>-*`` were written by ``tests/fixtures/make_hf_fixtures.py`` with the
newer version (see each folder's README.md and provenance.json). Nothing here imports transformers: the oracle is
the stored logits. The loader refuses a tensor it does not place and a parameter the file lacks, so a load that
succeeds has read every stored tensor. Tolerance: TOL["fp32_oracle"] on the prefill logits of every position.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kimik3
from kimik3.validation.metric import TOL, rel_error

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LAYOUT_FIXTURES = sorted(p.name for p in FIXTURES.glob("hf-*-*") if (p / "expected.safetensors").is_file())


def test_fixtures_are_present():
    """A missing fixture folder must fail here rather than shrink the parametrised test below to nothing."""
    assert {"hf-5.24-kimi-linear", "hf-5.24-dsv3"} <= set(LAYOUT_FIXTURES)


@pytest.mark.parametrize("name", LAYOUT_FIXTURES)
def test_newer_transformers_checkpoint_reproduces_its_logits(name):
    path = FIXTURES / name
    prov = json.loads((path / "provenance.json").read_text())
    raw = json.loads((path / "config.json").read_text())
    # the folder name, the provenance and what transformers stamped into config.json all agree on the version
    assert raw["transformers_version"] == prov["transformers"]
    assert name.startswith("hf-" + ".".join(prov["transformers"].split(".")[:2]) + "-")
    exp = load_file(str(path / "expected.safetensors"))
    ids, want = exp["prompt_ids"], exp["logits"]
    model = kimik3.from_pretrained(path, progress=False)
    cfg = model.config
    with torch.no_grad():
        got = model(ids)
    assert got.shape == want.shape
    assert rel_error(got, want) <= TOL["fp32_oracle"]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # what makes these fixtures worth having: the file's stated layer kinds were read, not defaulted
    if "mlp_layer_types" in raw:
        assert [cfg.ffn(i) for i in range(cfg.num_hidden_layers)] == [
            {"dense": "dense", "sparse": "moe"}[t] for t in raw["mlp_layer_types"]]
    if raw["model_type"] == "kimi_linear":
        # transformers' default dense first layer is stated by mlp_layer_types alone (the case that once failed)
        assert "first_k_dense_replace" not in raw and cfg.ffn(0) == "dense" and cfg.ffn(1) == "moe"
    if "layer_types" in raw:
        assert set(cfg.kda_layers) == {i for i, t in enumerate(raw["layer_types"]) if t == "linear_attention"}


def test_the_router_bias_matters_in_the_fixtures():
    """The fixtures' non-zero correction bias changes the routing: with it zeroed the logits move far outside the
    tolerance, so the match above depends on the bias being read and used for selection."""
    for name in ("hf-5.24-kimi-linear", "hf-5.24-dsv3"):
        path = FIXTURES / name
        exp = load_file(str(path / "expected.safetensors"))
        model = kimik3.from_pretrained(path, progress=False)
        biases = [(n, b) for n, b in list(model.named_parameters()) + list(model.named_buffers())
                  if n.endswith("e_score_correction_bias")]
        assert biases, name
        with torch.no_grad():
            for _, b in biases:
                b.zero_()
            assert rel_error(model(exp["prompt_ids"]), exp["logits"]) > 10 * TOL["fp32_oracle"], name
