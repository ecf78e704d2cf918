"""One rank's slice of a model (``ModelConfig.rank_slice``, preset ``k3-rank``): derived from the whole model and the
deployment, modules that hold only the share, the cost model's bytes against an independent reading of the layout,
and the performance model's rank and rack figures."""

from __future__ import annotations

import re

import pytest
import torch

from kimik3.megakernel import build_program
from kimik3.megakernel.ranks import Shard, of_slice
from kimik3.model.config import RACK_GPUS, get_preset, to_hf_dict
from kimik3.model.random_init import build_model, from_preset
from kimik3.model.rank_slice import SPLIT, even_worlds
from kimik3.perf.cost import decode_cost, parameter_table

# The layout, read independently of kimik3.model.rank_slice: which checkpoint tensors a rank holds a 1/world share
# of (docs/architecture.md#megakernel-across-ranks); every other tensor is held whole.
_SPLIT = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|q_conv1d|k_conv1d|v_conv1d|f_b_proj|b_proj|g_proj|o_proj|"
                    r"dt_bias|A_log|q_b_proj|kv_b_proj)\.?|block_sparse_moe\.(experts|shared_experts|"
                    r"routed_expert_up_proj)\.|\.mlp\.|^lm_head\.")


def test_k3_rank_is_kimi_k3_cut_for_the_rack():
    k3, rank = get_preset("kimi-k3"), get_preset("k3-rank")
    assert rank.whole() == k3.replace(name="k3-rank")
    worlds = even_worlds(k3, RACK_GPUS)
    assert rank.rank_slice == (max(worlds), 0) == (32, 0)  # 96 heads and 896 experts: no even split in 33..72
    assert rank.held("experts") == 28 and rank.held("kda_heads") == rank.held("mla_heads") == 3
    assert rank.held("vocab") == 163840 // 32 and rank.held("latent") == 3584 // 32
    assert tuple(rank.split_dims()) == SPLIT  # the rule's names are the config's dimensions


CASES = [("tiny", 2), ("micro", 2), ("micro", 4)]  # tiny's 6 heads do not split over 4


@pytest.mark.parametrize("preset, world", CASES)
def test_modules_hold_the_rank_share(preset, world):
    tiny = get_preset(preset)
    for rank in (0, world - 1):
        cfg = tiny.replace(rank_slice=(world, rank))
        m = build_model(cfg, "meta")
        kda = m.model.layers[0].self_attn
        mla = m.model.layers[3].self_attn
        moe = m.model.layers[1].block_sparse_moe
        heads = tiny.kda_num_heads // world
        assert kda.q_proj.weight.shape == (heads * tiny.kda_head_dim, tiny.hidden_size)
        assert kda.o_proj.weight.shape == (tiny.hidden_size, heads * tiny.kda_head_dim)
        assert kda.f_a_proj.weight.shape == (tiny.kda_head_dim, tiny.hidden_size)  # the decay input is whole
        assert mla.q_b_proj.weight.shape[0] == tiny.num_attention_heads // world * tiny.qk_head_dim
        assert mla.kv_a_proj_with_mqa.weight.shape[0] == tiny.kv_lora_rank + tiny.qk_rope_head_dim
        assert moe.experts.w1.shape[0] == tiny.n_routed_experts // world
        assert moe.gate.weight.shape[0] == tiny.n_routed_experts  # every rank routes every token
        assert moe.routed_expert_down_proj.weight.shape[0] == tiny.moe_latent_size
        assert moe.routed_expert_up_proj.weight.shape[1] == tiny.moe_latent_size // world
        assert m.lm_head.weight.shape[0] == tiny.vocab_size // world
        assert m.model.embed_tokens.weight.shape[0] == tiny.vocab_size


def test_a_slice_is_built_on_a_device_and_refuses_the_reference_forward():
    cfg = get_preset("tiny").replace(rank_slice=(2, 1))
    m = from_preset(cfg, dtype=torch.bfloat16)
    assert m.lm_head.weight.shape[0] == cfg.vocab_size // 2 and torch.isfinite(m.lm_head.weight.float()).all()
    with pytest.raises(ValueError, match="rank program"):
        m.new_state(1, 8)
    with pytest.raises(ValueError, match="rank program"):
        m(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="whole model"):
        to_hf_dict(cfg)
    whole, shard = of_slice(cfg)
    assert whole.rank_slice is None and shard == Shard(2, 2, 1)
    with pytest.raises(ValueError, match="already rank slice"):
        build_program(cfg, 1, 8, shard=Shard(2, 2, 1))


@pytest.mark.parametrize("bad, match", [((3, 0), "n_routed_experts = 32 does not split evenly over 3"),
                                        ((2, 2), "0 <= rank < world"), ((0, 0), "world >= 1"),
                                        (("2", 0), "rank_slice"), ((2,), "rank_slice"), ([2, 0], "rank_slice")])
def test_bad_slices_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        get_preset("tiny").replace(rank_slice=bad)


def _by_layout(whole: str, world: int, batch: int) -> tuple[float, float]:
    """(weight bytes, state + cache bytes) of one rank's step read from the whole model's cost and the layout:
    split tensors and split-head state by 1/world, the routed experts' expected reads by 1/world, the rest whole."""
    d = decode_cost(whole, batch, 4096, expert_dtype="mxfp4")
    t = parameter_table(whole)
    share = {n: (1 / world if _SPLIT.search(n) else 1.0) for n in t.name}
    bb = d.by_block
    weights = float(bb.loc[bb.block == "experts", "weight_bytes"].sum()) / world + float(
        bb.loc[bb.block == "embed", "weight_bytes"].sum())
    for _, p in t[(t.block != "experts") & (t.block != "embed")].iterrows():
        weights += p.numel * (4.0 if p.fp32 else 2.0) * share[p["name"]]
    kda = bb.block == "kda"
    state = float(bb.loc[kda, ["state_bytes_read", "state_bytes_written"]].sum().sum()) / world + float(
        bb[["kv_bytes_read", "kv_bytes_written"]].sum().sum())  # the MLA latent cache: whole on every rank
    return weights, state


@pytest.mark.parametrize("batch", [1, 8])
def test_cost_model_bytes_divide_k3_as_the_layout_says(batch):
    d = decode_cost("k3-rank", batch, 4096, expert_dtype="mxfp4")
    weights, state = _by_layout("kimi-k3", 32, batch)
    assert d.weight_bytes == pytest.approx(weights, rel=0.01)
    assert d.state_bytes + d.kv_bytes == pytest.approx(state, rel=0.01)
    # per token: the weights the rank streams once for the whole batch, its state for each sequence
    assert (d.weight_bytes + d.state_bytes + d.kv_bytes) / batch == pytest.approx((weights + state) / batch, rel=0.01)


@pytest.mark.parametrize("preset, world", CASES)
def test_the_rank_program_reads_what_the_slice_costs(preset, world):
    """The rank program's own boxes (step.py's shape-based counts, before calibration) against the cost model of the
    slice (its modules' parameters): two derivations of the rank's weight bytes. The boxes count a norm vector
    once per tile that reads it, the cost model once: the boxes may only be above, by those re-reads."""
    p = build_program(preset, 1, 16, shard=Shard(world, world, world - 1))
    shape = p.costs.attrs["shape_totals"]["weight_bytes"]
    sliced = decode_cost(get_preset(preset).replace(rank_slice=(world, world - 1)), 1, 4096)
    assert sliced.weight_bytes <= shape <= 1.03 * sliced.weight_bytes
    assert p.costs["weight_bytes"].sum() == pytest.approx(sliced.weight_bytes, rel=1e-9)  # calibrated to it


def test_predict_scores_a_rank_with_the_wire_and_the_rack():
    from kimik3.perfmodel import predict

    cfg = get_preset("tiny").replace(rank_slice=(2, 1))
    r = predict(cfg, "megakernel", 2)
    k = r["rank"]
    assert (k["world"], k["rank"]) == (2, 1)
    assert k["collectives"] == 2 * cfg.num_hidden_layers + len(cfg.moe_layers) + 1
    assert k["wire_bytes_out"] > 0 and k["serial_wire_ms"] > 0
    lo, hi = k["step_ms_range"]
    assert r["predicted_ms"] <= k["step_ms"] and lo <= k["step_ms"] <= hi
    assert 0 <= k["exposed_wire_ms"] <= k["serial_wire_ms"] + 1e-9
    t_lo, t_hi = k["tokens_per_s_per_sequence_range"]
    assert t_lo <= k["tokens_per_s_per_sequence"] <= t_hi <= k["bound_tokens_per_s_per_sequence"]  # a real ceiling
    assert k["tokens_per_s_rack"] == pytest.approx(2 * (RACK_GPUS // 2) * 1e3 / k["step_ms"], rel=1e-3)
    assert set(k["parts"]) == {"local step", "wire", "bound", "rack"}


@pytest.mark.slow  # ~40 s: notebook 07 runs the same k3-rank prediction in CI; the rank lines are checked here
def test_predict_command_prints_the_rank_and_the_rack_for_k3_rank(capsys):
    from kimik3.perfmodel.cli import main

    assert main(["--preset", "k3-rank", "--stage", "megakernel", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "k3-rank megakernel batch 1 experts mxfp4" in out  # bf16 experts would not fit one H200
    assert "rank 0 of 32: step with the wire" in out and "279 collectives" in out
    assert re.search(r"rack \(2 replicas of 32 ranks on 72 GPUs\): \d+ tokens/s per sequence \(\d+–\d+\)", out)
    assert re.search(r"bandwidth bound \d+ tokens/s per sequence", out)


@pytest.mark.parametrize("batch", ["1,0", "1,,8", "x"])
def test_predict_command_refuses_malformed_batches(batch):
    from kimik3.perfmodel.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--stage", "megakernel", "--batch", batch])
    assert e.value.code == 2


def test_predict_command_refuses_a_batch_past_the_model(capsys):
    from kimik3.perfmodel.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--stage", "megakernel", "--batch", "1,5000"])
    assert e.value.code == 2 and "--batch: must be in 1..4096 (decode rows per step), got 5000" in \
        capsys.readouterr().err


def test_export_refuses_a_rank_slice_before_touching_the_output(tmp_path, capsys):
    from kimik3.__main__ import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's file")
    assert main(["export", "--preset", "k3-rank", "--out", str(out)]) == 2
    assert "one rank's slice" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "a user's file" and len(list(out.iterdir())) == 1


@pytest.mark.parametrize("preset, world, rank", [("micro", 2, 1), ("micro", 4, 3), ("tiny", 2, 1)])
def test_a_rank_program_fits_the_ranks_kernel_only(preset, world, rank):
    from kimik3.megakernel.gpu import check_device_contract
    from kimik3.megakernel.kernel_shapes import static_shapes

    cfg = get_preset(preset)
    for fmt in ("dense", "mxfp4"):
        p = build_program(cfg, 2, 8, shard=Shard(world, world, rank), expert_format=fmt)
        single = check_device_contract(p, cfg, 2, static_shapes(cfg, 2, expert_format=fmt))
        assert any("built for one GPU's program" in m for m in single)
        assert check_device_contract(p, cfg, 2, static_shapes(cfg.replace(rank_slice=(world, rank)), 2,
                                                              expert_format=fmt)) == []
    assert check_device_contract(build_program(cfg, 2, 8), cfg, 2) == []  # one GPU's program still runs
