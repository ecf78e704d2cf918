"""Checkpoints as the releases ship them: FP8 block-scaled, compressed-tensors INT4 and MXFP4, plain; Kimi-Linear
as transformers writes it; subsets (the k3-shard cut) that read only what they keep.

Expectation sources: compressed-tensors 0.20.1's own packers and decoders (``pack_to_int32``,
``PackedQuantizationCompressor`` / ``MXFP4PackedCompressor.decompress``), bitwise; DeepSeek's FP8 block rule
(``weight_dequant``: stored e4m3 value × the block's ``weight_scale_inv``), written out element by element;
transformers 5.23 ``KimiLinearForCausalLM`` logits. Tolerance: TOL["fp32_oracle"] for logits; weights bitwise.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kimik3
import kimik3.model.checkpoint as ckpt
from kimik3.model import quant
from kimik3.model.checkpoint import load_k3_shard
from kimik3.model.config import ModelConfig, _k3_mla_pattern, get_preset
from kimik3.model.subset import k3_shard_selection, select, slice_model
from kimik3.validation.metric import TOL, rel_error

G = torch.Generator().manual_seed(17)


def _scheme(**weights):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))


# ====================================================================== the decoders, bit for bit


@pytest.mark.parametrize("bits,cols,group", [(4, 96, 32), (4, 72, 24), (8, 40, 8), (4, 64, None)])
def test_int_pack_quantized_matches_compressed_tensors(bits, cols, group):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    R = 24
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (R, cols), generator=G, dtype=torch.int8)
    packed = pack_to_int32(q, bits)
    assert torch.equal(quant.pack_int32(q, bits), packed)  # our writer = the library's writer
    groups = cols // group if group else 1
    scale = (torch.rand(R, groups, generator=G) * 0.02 + 1e-3).to(torch.bfloat16)
    ours = quant.int_group_dequantize(packed, scale, (R, cols), bits, group)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, q.float() * scale.float().repeat_interleave(cols // groups, 1))  # value × scale
    strategy = dict(strategy="group", group_size=group) if group else dict(strategy="channel")
    scheme = _scheme(num_bits=bits, type="int", symmetric=True, **strategy)
    for sdt in (torch.bfloat16, torch.float32):  # the library computes in the scale's dtype
        lib = PackedQuantizationCompressor.decompress(
            {"weight_packed": packed, "weight_scale": scale.to(sdt), "weight_shape": torch.tensor([R, cols])},
            scheme)["weight"]
        assert torch.equal(ours.to(sdt), lib)


def test_int4_asymmetric_zero_points_match_compressed_tensors():
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    R, C, g = 20, 64, 32
    q = torch.randint(-8, 8, (R, C), generator=G, dtype=torch.int8)
    zp = torch.randint(-8, 8, (R, C // g), generator=G, dtype=torch.int8)
    scale = (torch.rand(R, C // g, generator=G) * 0.02 + 1e-3).float()
    parts = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([R, C]),
             "weight_zero_point": pack_to_int32(zp, 4, packed_dim=0)}
    lib = PackedQuantizationCompressor.decompress(
        parts, _scheme(num_bits=4, type="int", symmetric=False, strategy="group", group_size=g))["weight"]
    spec = quant.QuantSpec("pack-quantized", 4, g, symmetric=False)
    assert torch.equal(spec.dequantize("m", parts), lib)


def test_int4_writer_matches_compressed_tensors_compress():
    from compressed_tensors.compressors import PackedQuantizationCompressor

    w = torch.randn(16, 96, generator=G) * 0.05
    ours = quant.int_group_quantize(w, 4, 32)
    lib = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": ours["weight_scale"].float(), "weight_zero_point": None},
        _scheme(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    assert torch.equal(ours["weight_packed"], lib["weight_packed"])
    assert lib["weight_shape"].tolist() == ours["weight_shape"].tolist() == [16, 96]


def test_mxfp4_matches_compressed_tensors():
    from compressed_tensors.compressors import MXFP4PackedCompressor

    packed = torch.randint(0, 256, (12, 48), generator=G, dtype=torch.uint8)
    scale = torch.randint(110, 140, (12, 3), generator=G, dtype=torch.uint8)
    lib = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale},
                                           _scheme(num_bits=4, type="float", symmetric=True, strategy="group",
                                                   group_size=32))["weight"]
    ours = quant.mxfp4_dequantize(packed, scale, torch.float32)
    assert torch.equal(ours.to(lib.dtype), lib)


def test_fp8_block_dequantize_is_the_block_rule_with_partial_edges():
    R, C = 300, 260  # 3 x 3 blocks of 128, the last row and column of blocks partial
    w = (torch.randn(R, C, generator=G) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3, generator=G) + 0.1
    ours = quant.fp8_block_dequantize(w, s)
    ref = torch.empty(R, C)
    for r in range(R):  # the definition, element by element along rows
        ref[r] = w[r].float() * s[r // 128][torch.arange(C) // 128]
    assert torch.equal(ours, ref)
    x = torch.randn(R, C, generator=G)
    q, sinv = quant.fp8_block_quantize(x)  # our writer: each block's max |x| maps to 448, round to nearest e4m3
    blk = sinv[torch.arange(R) // 128][:, torch.arange(C) // 128]
    assert torch.equal(sinv, torch.stack([torch.stack([x[i:i + 128, j:j + 128].abs().max() / 448
                                                       for j in range(0, C, 128)]) for i in range(0, R, 128)]))
    err = (quant.fp8_block_dequantize(q, sinv) - x).abs()
    assert (err <= x.abs() / 16 + blk * 2.0**-10).all()  # 3 mantissa bits: half a step; subnormal step 2^-9
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \[2, 3\], expected \[3, 3\]"):
        quant.fp8_block_dequantize(w, s[:2])


# ====================================================================== formats end to end


def _ds_cfg() -> ModelConfig:
    # widths above 128 and not multiples of it: every FP8 weight has partial edge blocks
    return ModelConfig(family="deepseek_v3", name="ds-fp8", vocab_size=160, hidden_size=160, num_hidden_layers=2,
                       intermediate_size=200, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=136,
                       kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=136, n_shared_experts=1,
                       routed_scaling_factor=2.5, rms_norm_eps=1e-6)


def _reference(model, fmt: str):
    """The unquantized model holding the dequantised weights, computed with the formats' own decoders."""
    from compressed_tensors.compressors import MXFP4PackedCompressor, PackedQuantizationCompressor

    ref = kimik3.from_preset(model.config, seed=0)
    ref.load_state_dict(model.state_dict())
    sch = _scheme(num_bits=4, type="int" if fmt == "int4" else "float", symmetric=True, strategy="group",
                  group_size=32)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            is_expert = ".experts." in name
            for w in p.data if is_expert else [p.data]:
                if fmt == "fp8":
                    parts = quant.export_tensors("fp8", name + ".weight" * is_expert, w, expert=is_expert)
                    if len(parts) == 2:
                        (_, q), (_, s) = parts
                        idx_r, idx_c = torch.arange(w.shape[0]) // 128, torch.arange(w.shape[1]) // 128
                        w.copy_(q.float() * s[idx_r][:, idx_c])
                elif is_expert:
                    parts = dict((k.rsplit(".", 1)[1], v) for k, v in quant.export_tensors(fmt, "x.weight", w, True))
                    if fmt == "int4":
                        parts["weight_scale"] = parts["weight_scale"].float()
                        lib = PackedQuantizationCompressor.decompress(parts, sch)["weight"]
                    else:
                        lib = MXFP4PackedCompressor.decompress(parts, sch)["weight"].float()
                    w.copy_(lib)
    return ref


@pytest.mark.parametrize("fmt,preset", [("mxfp4", "micro"), ("int4", "micro"), ("fp8", "ds"), ("bf16", "ds")])
def test_format_roundtrip_matches_dequantised_model(tmp_path, fmt, preset):
    model = kimik3.from_preset(_ds_cfg() if preset == "ds" else preset, seed=3)
    kimik3.save_pretrained(model, tmp_path / "ck", expert_format=fmt, max_shard_bytes=1 << 20)
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    qc = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
    assert (qc is None) == (fmt == "bf16")
    keys = set()
    for f in (tmp_path / "ck").glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            keys |= {(k, fh.get_slice(k).get_dtype()) for k in fh.keys()}
    if fmt == "fp8":  # DeepSeek's release layout: F8_E4M3 weights with F32 block multipliers beside them
        assert ("model.layers.1.mlp.experts.0.gate_proj.weight", "F8_E4M3") in keys
        assert ("model.layers.0.self_attn.q_b_proj.weight_scale_inv", "F32") in keys
        assert ("model.layers.1.mlp.gate.weight", "F32") in keys  # the router stays unquantized
    if fmt == "int4":  # K2-Thinking's: int32 packed words, bf16 group scales, the logical shape
        k = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
        assert {(k + ".weight_packed", "I32"), (k + ".weight_scale", "BF16"), (k + ".weight_shape", "I64")} <= keys
    back = kimik3.from_pretrained(tmp_path / "ck")
    ref = _reference(model, fmt) if fmt != "bf16" else model
    for (n, a), (_, b) in zip(back.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=G)
    assert rel_error(back(ids), ref(ids)) <= TOL["fp32_oracle"]


# ====================================================================== bad quantized data


@pytest.fixture(scope="module")
def int4_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("int4") / "ck"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=1), path, expert_format="int4")
    return path


def _edit(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        sd = load_file(dst / "model.safetensors")
        tensors(sd)
        save_file(sd, dst / "model.safetensors")
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


E = "language_model.model.layers.2.block_sparse_moe.experts.5.w2"


@pytest.mark.parametrize("what,tensors,config,msg", [
    ("scale shape", lambda sd: sd.__setitem__(E + ".weight_scale", sd[E + ".weight_scale"].repeat(1, 2)), None,
     r"weight_scale has shape \[32, 2\], expected \[32, 1\]"),
    ("packed length",
     lambda sd: sd.__setitem__(E + ".weight_packed", sd[E + ".weight_packed"][:, :-1].contiguous()), None,
     "weight_packed has 3 int32 words per row; 32 4-bit values need 4"),
    ("missing weight_shape", lambda sd: sd.pop(E + ".weight_shape"), None, "but not its weight_shape"),
    ("weight_shape", lambda sd: sd.__setitem__(E + ".weight_shape", torch.tensor([32, 40])), None,
     "weight_packed has 4 int32 words per row; 40 4-bit values need 5"),
    ("unknown format", None, lambda raw: raw["text_config"]["quantization_config"].update(format="nvfp4-x"),
     "unknown format 'nvfp4-x'"),
    ("no config", None, lambda raw: raw["text_config"].pop("quantization_config"), "no quantization_config"),
    ("ignored", None, lambda raw: raw["text_config"]["quantization_config"]["ignore"].append("re:.*experts.*"),
     "ignore list"),
    ("not a target", None, lambda raw: raw["text_config"]["quantization_config"]["config_groups"]["group_0"].update(
        targets=["re:.*self_attn.*"]), "matches none of its targets"),
    ("format mismatch", None,
     lambda raw: raw["text_config"].update(quantization_config=quant.export_quantization_config("mxfp4")),
     "MXFP4 tensors must be uint8"),
])
def test_bad_quantized_data_is_an_error_naming_the_tensor(int4_ckpt, tmp_path, what, tensors, config, msg):
    bad = _edit(int4_ckpt, tmp_path / "bad", tensors, config)
    with pytest.raises(ValueError, match=msg) as err:
        kimik3.from_pretrained(bad)
    if what != "unknown format":
        assert "experts.5" in str(err.value) or "experts." in str(err.value), str(err.value)
    if what in ("scale shape", "packed length", "missing weight_shape", "weight_shape"):
        assert E in str(err.value)


def test_quantization_config_forms():
    fp8 = quant.parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    assert fp8.method == "fp8" and fp8.block == (128, 128)
    k2t = {"quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": ["lm_head"],
           "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
               "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group"}}}}
    spec = quant.parse_quantization_config(k2t)
    assert (spec.method, spec.num_bits, spec.group_size, spec.symmetric) == ("pack-quantized", 4, 32, True)
    assert spec.ignored("lm_head") and not spec.ignored("model.layers.1.mlp.experts.3.gate_proj")
    short = quant.parse_quantization_config({"format": "mxfp4-pack-quantized", "group_size": 32})
    assert short.method == "mxfp4-pack-quantized"
    for bad, msg in [({"quant_method": "awq"}, "unknown quant_method 'awq'"),
                     ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
                     ({"format": "mxfp4-pack-quantized", "group_size": 16}, "groups of 32"),
                     (dict(k2t, config_groups={"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
                           format="pack-quantized"), "positive group_size")]:
        with pytest.raises(ValueError, match=msg):
            quant.parse_quantization_config(bad)


def test_fp8_bad_scale_names_the_tensor(tmp_path):
    src = tmp_path / "ck"
    kimik3.save_pretrained(kimik3.from_preset(_ds_cfg(), seed=1), src, expert_format="fp8")
    k = "model.layers.0.self_attn.kv_b_proj"
    bad = _edit(src, tmp_path / "bad", lambda sd: sd.__setitem__(k + ".weight_scale_inv", torch.ones(2, 2)))
    with pytest.raises(ValueError, match=re.escape(k) + r": weight_scale_inv has shape \[2, 2\], expected \[1, 1\]"):
        kimik3.from_pretrained(bad)
    bad2 = _edit(src, tmp_path / "bad2", lambda sd: sd.pop(k + ".weight_scale_inv"))
    with pytest.raises(ValueError, match=r"has weight but not its weight_scale_inv \(" + re.escape(k)):
        kimik3.from_pretrained(bad2)


# ====================================================================== Kimi-Linear as transformers writes it


def test_kimi_linear_dense_first_layer_saved_by_transformers(tmp_path):
    """transformers' default Kimi-Linear (dense first layer, first_k_dense_replace not passed) writes
    mlp_layer_types and no first_k_dense_replace, and the dense layer under block_sparse_moe."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    hf_cfg = KimiLinearConfig(
        vocab_size=160, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                          "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]})
    torch.manual_seed(11)
    hf = KimiLinearForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "kl")
    raw = json.loads((tmp_path / "kl" / "config.json").read_text())
    assert "first_k_dense_replace" not in raw and raw["mlp_layer_types"][0] == "dense"
    model = kimik3.from_pretrained(tmp_path / "kl")
    assert model.config.ffn(0) == "dense" and model.config.ffn(1) == "moe"
    ids = torch.randint(3, 160, (2, 9), generator=G)
    with torch.no_grad():
        assert rel_error(model(ids), hf(ids).logits) <= TOL["fp32_oracle"]
    # the release names the dense layer `mlp.`: the same weights under that name load to the same model
    rel = _edit(tmp_path / "kl", tmp_path / "release", lambda sd: [
        sd.__setitem__(k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."), sd.pop(k))
        for k in list(sd) if k.startswith("model.layers.0.block_sparse_moe.")])
    again = kimik3.from_pretrained(rel)
    for (n, a), (_, b) in zip(again.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), n


def _kl_raw(**kw) -> dict:
    raw = kimik3.model.config.to_hf_dict(get_preset("micro").replace(family="kimi_linear"))
    raw.update(kw)
    return raw


@pytest.mark.parametrize("fields,msg", [
    (dict(mlp_layer_types=["dense"] * 2 + ["sparse"] * 6), r"disagree on layer\(s\) \[1\]"),
    (dict(mlp_layer_types=["dense"] + ["sparse"] * 6), "one entry per layer"),
    (dict(mlp_layer_types=["dense"] + ["moe-ish"] * 7), "unknown entries"),
    (dict(layer_types=["linear_attention"] * 8), r"layer_types and linear_attn_config disagree .* \[3, 7\]"),
])
def test_contradicting_layer_kinds_are_errors(fields, msg):
    with pytest.raises(ValueError, match=msg):
        kimik3.config_from_hf(_kl_raw(**fields))


def test_layer_kinds_come_from_the_lists_when_they_are_all_the_file_says():
    raw = _kl_raw(mlp_layer_types=["dense", "dense"] + ["sparse"] * 6)
    raw.pop("first_k_dense_replace")
    raw.pop("moe_layer_freq")
    raw["layer_types"] = ["linear_attention" if i in (0, 1, 2, 4) else "full_attention" for i in range(8)]
    raw.pop("linear_attn_config")
    raw.update(linear_num_heads=4, linear_head_dim=16)
    cfg = kimik3.config_from_hf(raw)
    assert [cfg.ffn(i) for i in range(3)] == ["dense", "dense", "moe"] and cfg.kda_layers == (0, 1, 2, 4)
    raw["mlp_layer_types"] = ["dense", "dense"] + ["sparse", "dense"] * 3  # first_k 2, every second layer
    assert [kimik3.config_from_hf(raw).ffn(i) for i in range(8)] == ["dense"] * 2 + ["moe", "dense"] * 3
    raw["mlp_layer_types"] = ["sparse", "dense"] + ["sparse"] * 6
    with pytest.raises(ValueError, match="cannot be expressed"):
        kimik3.config_from_hf(raw)


# ====================================================================== subsets: the k3-shard cut


def _many_cfg() -> ModelConfig:
    # K3's layer pattern and features over 12 layers (dense first), 2 expert-parallel ranks of 56, top-16
    return get_preset("micro").replace(name="many", num_hidden_layers=12, kda_layers=_k3_mla_pattern(12),
                                       n_routed_experts=112, num_experts_per_tok=16, attn_res_block_size=12,
                                       moe_intermediate_size=32, moe_latent_size=32, hidden_size=32,
                                       intermediate_size=32, vocab_size=96)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    path = tmp_path_factory.mktemp("many") / "ck"
    model = kimik3.from_preset(_many_cfg(), seed=4)
    with torch.no_grad():  # make the router bias matter for the choice among the kept experts
        for layer in model.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.gate.e_score_correction_bias.normal_(0, 0.05, generator=G)
    kimik3.save_pretrained(model, path, expert_format="mxfp4", max_shard_bytes=192 << 10)
    return path


class _ReadCounter:
    """Wraps safetensors' safe_open to count every tensor the loader fetches (and its bytes)."""

    def __init__(self, monkeypatch):
        self.read: dict[str, int] = {}
        real = ckpt.safe_open
        counter = self

        class Handle:
            def __init__(self, f, *a, **k):
                self.h = real(f, *a, **k)

            def __enter__(self):
                self.inner = self.h.__enter__()
                return self

            def __exit__(self, *exc):
                return self.h.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, k):
                t = self.inner.get_tensor(k)
                assert k not in counter.read, f"{k} read twice"
                counter.read[k] = t.numel() * t.element_size()
                return t

        monkeypatch.setattr(ckpt, "safe_open", Handle)


def test_k3_shard_subset_reads_only_what_it_keeps_and_matches_the_sliced_model(many, monkeypatch):
    cfg = kimik3.load_config(many)
    shards = sorted(many.glob("model-*.safetensors"))
    assert len(shards) >= 8
    layers, experts = k3_shard_selection(cfg, rank=1)
    assert layers == (4, 5, 6, 7) and experts == tuple(range(56, 112))
    counter = _ReadCounter(monkeypatch)
    sub = load_k3_shard(many, rank=1, progress=False)
    # what the subset needs, decided here from the key names alone
    sizes = {}
    for f in shards:
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                sizes[k] = math.prod(sl.get_shape()) * {"U8": 1, "F32": 4, "BF16": 2}[sl.get_dtype()]

    def needed(k: str) -> bool:
        m = re.match(r"language_model\.model\.layers\.(\d+)\.(?:block_sparse_moe\.experts\.(\d+)\.)?", k)
        return not m or (int(m.group(1)) in layers and (m.group(2) is None or int(m.group(2)) in experts))

    want = {k for k in sizes if needed(k)}
    assert set(counter.read) == want
    assert sum(counter.read.values()) == sum(sizes[k] for k in want) < sum(sizes.values()) / 3
    monkeypatch.undo()
    full = kimik3.from_pretrained(many, progress=False)
    ref = slice_model(full, select(cfg, layers, experts))
    for (n, a), (_, b) in zip(sub.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n
    gate = sub.model.layers[0].block_sparse_moe.gate
    assert torch.equal(gate.weight, full.model.layers[4].block_sparse_moe.gate.weight[56:])
    assert sub.config.n_routed_experts == 56 and sub.config.num_experts_per_tok == 16
    assert [sub.config.mixer(i) for i in range(4)] == ["kda", "kda", "kda", "mla"]
    ids = torch.randint(3, 96, (2, 6), generator=G)
    assert rel_error(sub(ids), ref(ids)) <= TOL["fp32_oracle"]
    assert torch.equal(sub(ids), ref(ids))


def test_subset_per_layer_experts_and_dense_first_layer(many):
    cfg = kimik3.load_config(many)
    ids_of = {1: [3, 60, 7, 100] * 4, 2: list(range(16))}
    ids_of[1] = [3, 60, 7, 100, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    sub = kimik3.from_pretrained(many, layers=[0, 1, 2], experts=ids_of, progress=False)
    ref = slice_model(kimik3.from_pretrained(many, progress=False), select(cfg, [0, 1, 2], ids_of))
    assert sub.config.ffn(0) == "dense" and sub.config.n_routed_experts == 16
    for (n, a), (_, b) in zip(sub.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("layers,experts,msg", [
    ((3, 4, 5, 6), range(0, 56), "layer kinds"),
    ((4, 5, 6, 7), range(1, 57), "experts must be r"),
    ((4, 5, 6, 8), range(0, 56), "not consecutive"),
    ((0, 1, 2, 3), range(0, 56), "not MoE layers"),
])
def test_subset_contradicting_the_preset_is_an_error(layers, experts, msg):
    with pytest.raises(ValueError, match=msg):
        select(_many_cfg(), layers, experts, preset="k3-shard")


@pytest.mark.parametrize("layers,experts,msg", [
    ((1, 12), None, r"layers \[12\] out of range"),
    ((1, 1), None, "duplicates"),
    ((1, 2), range(8), "fewer than the router's top-k"),
    ((1, 2), {1: range(16)}, r"missing \[2\]"),
    ((1, 2), {1: range(16), 2: range(17)}, "same number of experts"),
])
def test_bad_subsets_are_errors(layers, experts, msg):
    with pytest.raises(ValueError, match=msg):
        select(_many_cfg(), layers, experts)


def test_k3_shard_cut_from_the_release_config_is_the_preset():
    k3 = get_preset("kimi-k3")
    layers, experts = k3_shard_selection(k3, rank=15)
    assert layers == (4, 5, 6, 7) and experts == tuple(range(840, 896))
    got = select(k3, layers, experts, preset="k3-shard").config.to_dict()
    want = get_preset("k3-shard").to_dict()
    assert {k: v for k, v in got.items() if k != "name"} == {k: v for k, v in want.items() if k != "name"}
    with pytest.raises(ValueError, match="rank must be"):
        k3_shard_selection(k3, rank=16)


@pytest.mark.slow
def test_subset_peak_memory_on_a_2gb_checkpoint(tmp_path):
    """A k3-shard cut of a ~2 GB K3-layout checkpoint: peak host memory grows by about the kept weights, not the
    checkpoint (measured in a fresh process)."""
    import subprocess
    import sys

    cfg = get_preset("micro").replace(name="big", num_hidden_layers=8, kda_layers=_k3_mla_pattern(8),
                                      n_routed_experts=112, num_experts_per_tok=16, attn_res_block_size=12,
                                      hidden_size=256, moe_latent_size=512, moe_intermediate_size=768,
                                      intermediate_size=256, vocab_size=256)
    model = kimik3.from_preset(cfg, seed=0, dtype=torch.bfloat16)
    kimik3.save_pretrained(model, tmp_path / "big", max_shard_bytes=256 << 20)
    del model
    total = sum(f.stat().st_size for f in (tmp_path / "big").glob("*.safetensors"))
    assert total > 1.8e9
    # VmHWM: this process's own high-water RSS (ru_maxrss would carry the forking parent's over exec)
    code = (
        "import sys, torch, kimik3\n"
        "from kimik3.model.checkpoint import load_k3_shard\n"
        "def hwm():\n"
        "    line = next(x for x in open('/proc/self/status') if x.startswith('VmHWM:'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "base = hwm()\n"
        "m = load_k3_shard(sys.argv[1], rank=1, dtype=torch.bfloat16, progress=False)\n"
        "kept = sum(p.numel() * p.element_size() for p in m.parameters())\n"
        "print(base, hwm(), kept)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big")], capture_output=True, text=True,
                         check=True, timeout=600)
    base, peak, kept = map(int, out.stdout.split()[-3:])
    print(f"checkpoint {total / 1e9:.2f} GB, kept {kept / 1e9:.2f} GB, peak RSS growth {(peak - base) / 1e9:.2f} GB")
    assert peak - base >= kept  # the measurement sees the model it built
    assert peak - base < 2 * kept + 200e6, (base, peak, kept, total)
    assert peak - base < total / 2


def test_cli_export_writes_each_format(tmp_path):
    from kimik3.__main__ import main

    for fmt in ("int4", "fp8"):
        assert main(["export", "--preset", "micro", "--out", str(tmp_path / fmt), "--expert-format", fmt,
                     "--dtype", "float32"]) == 0
        back = kimik3.from_pretrained(tmp_path / fmt)
        ref = _reference(kimik3.from_preset("micro", seed=0), fmt)
        for (n, a), (_, b) in zip(back.named_parameters(), ref.named_parameters()):
            assert torch.equal(a, b), n


@pytest.mark.parametrize("name", ["dsv3-qlora-norm", "kimi-linear"])
def test_transformers_internal_layout_loads(oracle_checkpoint, tmp_path, name):
    """The state dict as transformers holds it in memory (fused gate_up_proj / down_proj experts, Kimi-Linear's
    stacked conv1d and forget_gate names, `mlp.` for every FFN) loads to the same model as the saved release layout."""
    path, hf = oracle_checkpoint(name)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    if name == "kimi-linear":
        assert any(k.endswith("self_attn.conv1d.weight") for k in sd) and any(".forget_gate." in k for k in sd)
    (tmp_path / "internal").mkdir()
    shutil.copy(path / "config.json", tmp_path / "internal" / "config.json")
    save_file(sd, tmp_path / "internal" / "model.safetensors")
    a = kimik3.from_pretrained(tmp_path / "internal")
    b = kimik3.from_pretrained(path)
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), n
    ids = torch.randint(3, 160, (2, 5), generator=G)
    with torch.no_grad():
        assert rel_error(a(ids), hf(ids).logits) <= TOL["fp32_oracle"]
