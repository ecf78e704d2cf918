"""Bad input gets a clear error that names the file, tensor or field — and loses nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kimik3


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-ckpt")
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), path)
    return path


@pytest.fixture
def ckpt(micro_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(micro_ckpt, dst)
    return dst


def rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda t: t.pop("language_model.model.layers.3.self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*layers\.3\.self_attn\.kv_b_proj\.weight"):
        kimik3.from_pretrained(ckpt)


def test_missing_expert(ckpt):
    rewrite(ckpt, lambda t: t.pop("language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.2\.block_sparse_moe\.experts\.w3\[5\]"):
        kimik3.from_pretrained(ckpt)


def test_unexpected_tensor(ckpt):
    rewrite(ckpt, lambda t: t.__setitem__("language_model.model.layers.0.self_attn.bogus.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'language_model\.model\.layers\.0\.self_attn\.bogus"):
        kimik3.from_pretrained(ckpt)


def test_expert_index_out_of_range(ckpt):
    rewrite(ckpt, lambda t: t.__setitem__("language_model.model.layers.1.block_sparse_moe.experts.99.w1.weight",
                                          torch.zeros(32, 32)))
    with pytest.raises(ValueError, match=r"unexpected tensor .*experts\.99\.w1"):
        kimik3.from_pretrained(ckpt)


def test_misshaped_tensor(ckpt):
    key = "language_model.model.layers.0.self_attn.q_proj.weight"
    rewrite(ckpt, lambda t: t.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(ValueError, match=r"q_proj\.weight' in model\.safetensors has shape \[3, 3\], expected"):
        kimik3.from_pretrained(ckpt)


def test_wrong_dtype(ckpt):
    key = "language_model.model.norm.weight"
    rewrite(ckpt, lambda t: t.__setitem__(key, torch.ones(64, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"norm\.weight' in model\.safetensors has dtype torch\.int32"):
        kimik3.from_pretrained(ckpt)


def test_non_finite_weights(ckpt):
    key = "language_model.model.norm.weight"
    rewrite(ckpt, lambda t: t[key].__setitem__(0, float("nan")))
    with pytest.raises(ValueError, match=r"norm\.weight.*non-finite"):
        kimik3.from_pretrained(ckpt)


def test_truncated_shard(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors"):
        kimik3.from_pretrained(ckpt)


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown model_type 'llama'"):
        kimik3.from_pretrained(ckpt)


@pytest.mark.parametrize("field,value,msg", [
    ("num_experts_per_token", 99, r"num_experts_per_tok=99 must be in 1\.\.n_routed_experts=16"),
    ("num_key_value_heads", 2, r"num_key_value_heads=2 != num_attention_heads=4"),
    ("hidden_act", "gelu", r"unsupported hidden_act 'gelu'"),
])
def test_inconsistent_config(ckpt, field, value, msg):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"][field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=msg):
        kimik3.from_pretrained(ckpt)


def test_layer_lists_inconsistent(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["linear_attn_config"]["full_attn_layers"] = [4]  # layer 8 is now neither KDA nor MLA
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers \[8\] \(1-based\) are neither KDA nor MLA"):
        kimik3.from_pretrained(ckpt)


def test_missing_config_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["text_config"]["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing required field 'hidden_size'"):
        kimik3.from_pretrained(ckpt)


def test_pickle_checkpoints_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(kimik3.model.config.to_hf_dict(kimik3.get_preset("micro"))))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files .*pytorch_model\.bin: pickle-based formats"):
        kimik3.from_pretrained(tmp_path)


def test_index_names_missing_shard(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match=r"lists 1 shard\(s\) that do not exist: 'model-00002-of-00002"):
        kimik3.from_pretrained(ckpt)


def test_mxfp4_half_missing(tmp_path):
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), tmp_path, expert_format="mxfp4")
    rewrite(tmp_path, lambda t: t.pop("language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"))
    with pytest.raises(ValueError, match=r"expert 0 of .*experts\.w2: has weight_packed but not its weight_scale"):
        kimik3.from_pretrained(tmp_path)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    model = kimik3.from_preset("micro", seed=0)
    kimik3.save_pretrained(model, tmp_path, max_shard_bytes=200_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    back = kimik3.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 4))
    assert torch.equal(back(ids), model(ids))


def test_unknown_preset_and_stage():
    with pytest.raises(ValueError, match=r"unknown preset 'giant'; known presets: micro, tiny"):
        kimik3.from_preset("giant")
    with pytest.raises(ValueError, match=r"unknown stage 'turbo'; known stages: naive, absorbed, graphs, compiled, "
                                         r"fused"):
        kimik3.Decoder(kimik3.from_preset("micro"), stage="turbo")


@pytest.fixture(scope="module")
def dec():
    return kimik3.Decoder(kimik3.from_preset("micro", seed=0), batch_size=2, max_seq_len=8)


def test_decoder_errors(dec):
    V = dec.vocab_size
    dec.reset()
    with pytest.raises(ValueError, match=r"step\(\) called before prefill"):
        dec.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=rf"token id {V} outside the vocabulary \[0, {V}\)"):
        dec.prefill(torch.tensor([[1, V], [2, 3]]))
    with pytest.raises(ValueError, match=r"token id -1 outside the vocabulary"):
        dec.prefill(torch.tensor([[1, -1], [2, 3]]))
    with pytest.raises(ValueError, match=r"batch size 3, but this Decoder was built for batch_size=2"):
        dec.prefill(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must have 2 dimension"):
        dec.prefill(torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"prompt of 9 tokens exceeds max_seq_len=8"):
        dec.prefill(torch.ones(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be an integer tensor"):
        dec.prefill(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"lengths must be in 1\.\.4"):
        dec.prefill(torch.ones(2, 4, dtype=torch.long), lengths=[5, 1])
    dec.prefill(torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token id 9999 outside"):
        dec.step(torch.tensor([1, 9999]))
    dec.step(torch.tensor([1, 2]))  # now 8 tokens: the cache is full
    with pytest.raises(ValueError, match=r"sequence would grow to 9 tokens, past the cache \(max_seq_len=8\)"):
        dec.step(torch.tensor([1, 2]))


def test_padding_ids_are_ignored_not_validated(dec):
    """Positions past a sequence's length are padding: any value is accepted and never reaches a state."""
    a = dec.prefill(torch.tensor([[5, 6, 7], [8, -100, 12345]]), lengths=[3, 1])
    b = dec.prefill(torch.tensor([[5, 6, 7], [8, 0, 0]]), lengths=[3, 1])
    assert torch.equal(a, b)
