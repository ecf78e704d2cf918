"""Routed experts kept as MXFP4 in memory (``from_pretrained(..., quantized_experts="keep")``).

What is proven here, on the CPU: the held bytes are the checkpoint's own, also when they are not what our packer
would write (random codes, larger-than-needed scales); the fused stage's MXFP4 packing of a kept model hands the
kernel those very tensors and, for a checkpoint our packer wrote, the same bytes as packing the dequantised model;
the naive stage on kept experts is bitwise the naive stage on the dequantised model, the other PyTorch stages
refuse with the way out, ``dequantize_experts()`` gives exactly the dequantising load; export of a kept model
writes the held bytes back; the memory figures come from the shapes (hand-checked small case and k3-shard).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kimik3
from kimik3.model import quant
from kimik3.model.checkpoint import from_pretrained, save_pretrained
from kimik3.model.config import get_preset
from kimik3.model.quant import QuantizedExperts, expert_memory, experts_mxfp4

_PREFIX = "language_model.model.layers"
_LEAVES = ("w1", "w3", "w2")


@pytest.fixture(scope="module")
def mx_ckpt(tmp_path_factory):
    """micro exported with MXFP4 routed experts by our packer (K3 release layout, one file)."""
    model = kimik3.from_preset("micro", seed=0)
    return save_pretrained(model, tmp_path_factory.mktemp("mx") / "ckpt", expert_format="mxfp4")


@pytest.fixture(scope="module")
def odd_ckpt(tmp_path_factory, mx_ckpt):
    """The same checkpoint with every expert's codes and scales replaced by random bytes: valid MXFP4 that our
    packer would never write (negative zeros, blocks whose largest code is below 6, scales larger than needed)."""
    out = tmp_path_factory.mktemp("odd") / "ckpt"
    out.mkdir()
    tensors = load_file(str(mx_ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for k, t in tensors.items():
        if k.endswith(".weight_packed"):
            tensors[k] = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8)
        elif k.endswith(".weight_scale"):
            tensors[k] = torch.randint(118, 125, t.shape, generator=g, dtype=torch.uint8)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((mx_ckpt / "config.json").read_text())
    return out


def _kept(model) -> dict[int, QuantizedExperts]:
    return {i: layer.block_sparse_moe.experts for i, layer in enumerate(model.model.layers) if layer.is_moe}


# ====================================================================== memory, from the shapes


def test_expert_memory_from_shapes_hand_checked():
    micro = get_preset("micro")  # 7 MoE layers x 16 experts, w1/w3 [32, 32] and w2 [32, 32]
    assert (micro.n_routed_experts, micro.moe_intermediate_size, micro.expert_in_dim, len(micro.moe_layers)) == (
        16, 32, 32, 7)
    # dense: 7 layers * 16 experts * 3 matrices * 32 * 32 weights, 2 bytes each in bf16, 4 in fp32
    assert expert_memory(micro, torch.bfloat16) == {"dense": 7 * 16 * 3 * 1024 * 2, "mxfp4": 7 * 16 * 3 * 32 * 17}
    assert expert_memory(micro, torch.float32)["dense"] == 1376256
    # MXFP4: one row of 32 columns is 16 code bytes + 1 scale byte
    assert quant.mxfp4_nbytes(3, 64) == 3 * (32 + 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.mxfp4_nbytes(3, 48)
    # k3-shard: 4 layers * 56 experts * 3 matrices of 3072 x 3584
    shard = expert_memory(get_preset("k3-shard"), torch.bfloat16)
    assert shard == {"dense": 4 * 56 * 3 * 3072 * 3584 * 2, "mxfp4": 4 * 56 * 3 * 3072 * (1792 + 112)}
    assert shard == {"dense": 14_797_504_512, "mxfp4": 3_930_587_136}
    # the figures the loader's documentation states are these
    doc = " ".join(from_pretrained.__doc__.split())
    assert (f"for k3-shard: {quant.format_bytes(shard['mxfp4'])} kept, {quant.format_bytes(shard['dense'])} as bf16"
            in doc), doc
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert (f"For `k3-shard` that is {quant.format_bytes(shard['mxfp4'])} instead of "
            f"{quant.format_bytes(shard['dense'])} in bf16") in readme
    assert expert_memory(get_preset("k3-shard").replace(n_routed_experts=0, num_experts_per_tok=0)) == {
        "dense": 0, "mxfp4": 0}
    odd = micro.replace(moe_intermediate_size=40)  # w2's input width 40: no MXFP4 form
    assert expert_memory(odd, torch.float32) == {"dense": 7 * 16 * 3 * 32 * 40 * 4, "mxfp4": None}
    assert "no MXFP4 form" in quant.describe_expert_memory(odd)


def test_kept_model_holds_what_the_figures_say(mx_ckpt):
    kept = from_pretrained(mx_ckpt, quantized_experts="keep")
    held = sum(q.nbytes() for q in _kept(kept).values())
    assert held == expert_memory(kept.config)["mxfp4"]
    dense = from_pretrained(mx_ckpt)
    assert sum(p.numel() * p.element_size() for n, p in dense.named_parameters() if ".experts." in n) == \
        expert_memory(dense.config, dense.dtype)["dense"]
    assert kept.num_parameters() == dense.num_parameters()
    assert "kept as MXFP4" in kept.expert_memory() and "dequantised to float32" in kept.expert_memory()


# ====================================================================== the bytes


def test_keep_holds_the_files_bytes_bitwise(odd_ckpt):
    file = load_file(str(odd_ckpt / "model.safetensors"))
    kept = from_pretrained(odd_ckpt, quantized_experts="keep")
    assert kept.expert_storage == "mxfp4"
    assert not any(".experts." in n for n, _ in kept.named_parameters())
    for i, q in _kept(kept).items():
        for leaf in _LEAVES:
            packed, scale = q.packed(leaf)
            for e in range(q.n_experts):
                key = f"{_PREFIX}.{i}.block_sparse_moe.experts.{e}.{leaf}"
                assert torch.equal(packed[e], file[key + ".weight_packed"]), key
                assert torch.equal(scale[e], file[key + ".weight_scale"]), key
    # and each kept expert dequantises to exactly what a dequantising load stores
    dense = from_pretrained(odd_ckpt)
    for i, q in _kept(kept).items():
        ex = dense.model.layers[i].block_sparse_moe.experts
        for leaf in _LEAVES:
            assert torch.equal(q.dequantized(leaf, dense.dtype), getattr(ex, leaf)), (i, leaf)


def test_fused_packing_hands_over_the_kept_bytes(mx_ckpt, odd_ckpt):
    """The fused stage's MXFP4 packing (the CPU part of it): a kept model's tensors go to the kernel as they are,
    and decode to exactly the weights that packing the dequantised model gives. Packing again need not give the
    file's bytes even for our own export (a block whose largest code is 3 comes back with a scale one lower and
    codes of 6: the same values), and for the random-byte checkpoint it does not (negative zeros come back as +0):
    only keeping hands the kernel the checkpoint itself."""
    repacked_differs = {}
    for ckpt in (mx_ckpt, odd_ckpt):
        kept, dense = from_pretrained(ckpt, quantized_experts="keep"), from_pretrained(ckpt)
        file = load_file(str(ckpt / "model.safetensors"))
        differ = 0
        for i, q in _kept(kept).items():
            ex = dense.model.layers[i].block_sparse_moe.experts
            for leaf in _LEAVES:
                p_k, s_k = experts_mxfp4(q, leaf)
                assert p_k is q.packed(leaf)[0] and s_k is q.packed(leaf)[1]  # no copy, no re-quantisation
                key = f"{_PREFIX}.{i}.block_sparse_moe.experts.0.{leaf}"
                assert torch.equal(p_k[0], file[key + ".weight_packed"]) and torch.equal(s_k[0],
                                                                                       file[key + ".weight_scale"])
                p_d, s_d = experts_mxfp4(ex, leaf)
                assert p_d.shape == p_k.shape and s_d.shape == s_k.shape
                E, R, C = q.shapes[leaf]
                dq = quant.mxfp4_dequantize(p_d.reshape(E * R, -1), s_d.reshape(E * R, -1), torch.float32)
                assert torch.equal(dq.view(E, R, C), q.dequantized(leaf, torch.float32)), (ckpt.parent.name, i, leaf)
                differ += not (torch.equal(p_k, p_d) and torch.equal(s_k, s_d))
        repacked_differs[ckpt.parent.name[:3]] = differ
    assert repacked_differs["odd"] == 3 * len(get_preset("micro").moe_layers), repacked_differs


def test_fused_step_wires_the_kept_bytes(tmp_path):
    """FusedStep (the program, built on the CPU) passes the held tensors themselves to the MXFP4 expert kernel,
    decoding to the weights it packs from the dequantised model; with expert_format='bf16' it refuses."""
    from kimik3.fused.plan import FusedStep

    cfg = get_preset("tiny").replace(name="tiny-kept", num_hidden_layers=2, kda_layers=(0,), vocab_size=256,
                                     n_routed_experts=8, intermediate_size=64)
    path = save_pretrained(kimik3.from_preset(cfg, seed=0, dtype=torch.bfloat16), tmp_path / "ck",
                           expert_format="mxfp4")
    kept = from_pretrained(path, dtype=torch.bfloat16, quantized_experts="keep")
    dense = from_pretrained(path, dtype=torch.bfloat16)
    steps = [FusedStep(m, 1, 256, expert_format="mxfp4") for m in (kept, dense)]
    launches = [{ln.name: ln for ln in s.program if ln.name.endswith(".moe.experts")} for s in steps]
    assert sorted(launches[0]) == [f"L{i}.moe.experts" for i in cfg.moe_layers]
    for i, q in _kept(kept).items():
        a, b = launches[0][f"L{i}.moe.experts"].args, launches[1][f"L{i}.moe.experts"].args
        for leaf, s in (("w1", "s1"), ("w3", "s3"), ("w2", "s2")):
            assert a[leaf] is q.packed(leaf)[0] and a[s] is q.packed(leaf)[1]
            E, R, C = q.shapes[leaf]
            dq = quant.mxfp4_dequantize(b[leaf].reshape(E * R, -1), b[s].reshape(E * R, -1), torch.float32)
            assert torch.equal(dq.view(E, R, C), q.dequantized(leaf, torch.float32)), (i, leaf)
    with pytest.raises(ValueError, match=r"holds them as MXFP4: use expert_format='mxfp4'.*dequantize_experts"):
        FusedStep(kept, 1, 256, expert_format="bf16")


# ====================================================================== the PyTorch stages


def test_naive_on_kept_experts_is_bitwise_the_dequantised_model(mx_ckpt):
    kept, dense = from_pretrained(mx_ckpt, quantized_experts="keep"), from_pretrained(mx_ckpt)
    ids = torch.randint(0, kept.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (kept, dense):
        dec = kimik3.Decoder(m, stage="naive", batch_size=1, max_seq_len=8)
        logits = dec.prefill(ids)
        outs.append((logits, dec.step(logits.argmax(-1))))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("stage", ["absorbed", "compiled"])
def test_other_stages_refuse_kept_experts_with_the_way_out(mx_ckpt, stage):
    kept = from_pretrained(mx_ckpt, quantized_experts="keep")
    with pytest.raises(ValueError, match=rf"stage '{stage}' reads dense routed experts.*dequantize_experts\(\).*"
                                         r"kept as MXFP4.*quantized_experts='dequantize'"):
        kimik3.Decoder(kept, stage=stage, batch_size=1, max_seq_len=8)
    with pytest.raises(ValueError, match=r"held as MXFP4.*dequantize_experts"):
        kept.model.layers[1].block_sparse_moe.experts.w1  # noqa: B018 (the attribute access is the test)


def test_dequantize_on_request_is_the_dequantising_load(mx_ckpt):
    dense = from_pretrained(mx_ckpt)
    back = from_pretrained(mx_ckpt, quantized_experts="keep").dequantize_experts()
    assert back.expert_storage == "dense"
    a, b = dense.state_dict(), back.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    kimik3.Decoder(back, stage="absorbed", batch_size=1, max_seq_len=8)  # accepted now
    # and back again: our packer on the dequantised weights holds the same weights (exact: they are MXFP4 values)
    again = dense.quantize_experts()
    assert again.expert_storage == "mxfp4"
    kept = from_pretrained(mx_ckpt, quantized_experts="keep")
    for (i, q), (_, r) in zip(_kept(kept).items(), _kept(again).items()):
        for leaf in _LEAVES:
            assert torch.equal(q.dequantized(leaf, torch.float32), r.dequantized(leaf, torch.float32)), (i, leaf)


# ====================================================================== export, subsets, refusals


def test_export_of_a_kept_model_writes_the_held_bytes(odd_ckpt, tmp_path):
    kept = from_pretrained(odd_ckpt, quantized_experts="keep")
    out = save_pretrained(kept, tmp_path / "again", expert_format="mxfp4")
    a, b = load_file(str(odd_ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    bf = [load_file(str(save_pretrained(m, tmp_path / n, expert_format="bf16") / "model.safetensors"))
          for n, m in (("kept", kept), ("dense", from_pretrained(odd_ckpt)))]
    assert sorted(bf[0]) == sorted(bf[1]) and all(torch.equal(bf[0][k], bf[1][k]) for k in bf[0])


def test_subset_keeps_the_chosen_experts_bytes(odd_ckpt):
    file = load_file(str(odd_ckpt / "model.safetensors"))
    ids = [9, 2, 14, 5]
    sub = from_pretrained(odd_ckpt, layers=[2, 3], experts=ids, quantized_experts="keep")
    for j, (src, q) in enumerate(zip([2, 3], _kept(sub).values())):
        for pos, e in enumerate(ids):
            key = f"{_PREFIX}.{src}.block_sparse_moe.experts.{e}.w2"
            assert torch.equal(q.packed("w2")[0][pos], file[key + ".weight_packed"]), (j, e)
            assert torch.equal(q.packed("w2")[1][pos], file[key + ".weight_scale"]), (j, e)


def test_keep_refusals(mx_ckpt, tmp_path):
    with pytest.raises(ValueError, match="quantized_experts must be one of"):
        from_pretrained(mx_ckpt, quantized_experts="mxfp4")
    plain = save_pretrained(kimik3.from_preset("micro", seed=0), tmp_path / "plain")
    with pytest.raises(ValueError, match=r"has no quantization_config.*quantized_experts='dequantize'"):
        from_pretrained(plain, quantized_experts="keep")
    int4 = save_pretrained(kimik3.from_preset("micro", seed=0), tmp_path / "int4", expert_format="int4")
    with pytest.raises(ValueError, match=r"quantization method 'pack-quantized'.*no kernel reads FP8 or INT4"):
        from_pretrained(int4, quantized_experts="keep")
    tensors = load_file(str(mx_ckpt / "model.safetensors"))
    bad_key = f"{_PREFIX}.2.block_sparse_moe.experts.3.w3"
    for what, change, msg in [
            ("nan", lambda t: t[bad_key + ".weight_scale"].__setitem__((0, 0), 255), "E8M0 NaN byte 255"),
            ("shape", lambda t: t.__setitem__(bad_key + ".weight_packed", t[bad_key + ".weight_packed"][:, :8].clone()),
             r"weight_packed in model.safetensors has shape \[32, 8\], expected \[32, 16\]"),
            ("plain", lambda t: [t.pop(bad_key + ".weight_packed"), t.pop(bad_key + ".weight_scale"),
                                 t.__setitem__(bad_key + ".weight", torch.zeros(32, 32))],
             r"routed expert stored unquantized")]:
        d = tmp_path / f"bad-{what}"
        d.mkdir()
        t = {k: v.clone() for k, v in tensors.items()}
        change(t)
        save_file(t, str(d / "model.safetensors"))
        (d / "config.json").write_text((mx_ckpt / "config.json").read_text())
        with pytest.raises(ValueError, match=msg) as err:
            from_pretrained(d, quantized_experts="keep")
        assert "layers.2.block_sparse_moe.experts.3.w3" in str(err.value), what
        if what == "nan":  # dequantised on load, the same byte is named, not reported as a non-finite weight
            with pytest.raises(ValueError, match=r"experts.3.w3: weight_scale holds the E8M0 NaN byte 255"):
                from_pretrained(d)
