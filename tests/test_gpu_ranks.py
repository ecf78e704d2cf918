"""Rank programs on one GPU (``kimik3.megakernel.gpu_ranks``), the parts a CPU can check: the launch plan (every rank
of ``tiny`` over 2 in one launch; a rank's slice alone), what it refuses and why, the kernel it names, a rank's decode
state at the program's shapes, the segment layout at the kernel's 4-byte words, MXFP4 experts drawn without a dense
copy (how k3-rank fits one GPU), the NVL72 prediction from a measured step; the stage refuses a CPU model. The launch
itself is the device check's (phase ``ranks``)."""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.megakernel.gpu_ranks import launch_plan, rank_kernel_name, rank_state
from kimik3.megakernel.instructions import Kind
from kimik3.megakernel.kernel_shapes import static_shapes
from kimik3.megakernel.layout import model_weights, state_views, weight_view
from kimik3.megakernel.peer_memory import segment_layout
from kimik3.model.random_init import build_model, from_preset


def test_loopback_plan_builds_every_rank_for_its_share_of_the_sms():
    pl = launch_plan(kimik3.get_preset("tiny"), 1, 16, 2, 132)
    assert not pl.alone and pl.world == 2 and pl.ctas_per_rank == 66
    assert [p.rank for p in pl.programs] == [0, 1] and all(p.num_sms <= 66 for p in pl.programs)
    assert pl.kernel == "megakernel/tiny-rank/b1" and pl.shapes["ranks"] is True
    # the kernel of the slice preset: the same static shapes, whatever the rank (its FFN_OUT applies no latent norm)
    assert pl.shapes == static_shapes(kimik3.get_preset("tiny-rank"), 1) and pl.shapes["latent_norm"] is False


@pytest.mark.parametrize("world, match", [(1, "2..8"), (9, "2..8"), (True, "2..8"), (4, "kda_num_heads = 6")])
def test_loopback_plan_refuses_a_world_it_cannot_hold(world, match):
    with pytest.raises(ValueError, match=match):
        launch_plan(kimik3.get_preset("tiny"), 1, 16, world, 132)


def test_plan_refuses_what_no_launch_runs():
    tiny = kimik3.get_preset("tiny")
    with pytest.raises(ValueError, match="batch sizes 1..64"):
        launch_plan(tiny, 65, 16, 2, 132)
    with pytest.raises(ValueError, match="cannot hold 2 ranks"):
        launch_plan(tiny, 1, 16, 2, 1)
    with pytest.raises(ValueError, match="unknown policy"):
        launch_plan(tiny, 1, 16, 2, 132, policy="fastest")
    with pytest.raises(ValueError, match="rank 0 of 2: world=4 differs"):
        launch_plan(kimik3.get_preset("tiny-rank"), 1, 16, 4, 132)


def test_a_slice_runs_alone_on_its_held_weights_and_a_whole_shaped_state():
    model = from_preset("tiny-rank", dtype=torch.bfloat16)
    pl = launch_plan(model.config, 2, 16, None, 132)
    (p,) = pl.programs
    assert pl.alone and p.rank == 0 and p.world == 2 and pl.ctas_per_rank == 132
    weights = model_weights(model)
    for spec in p.buffers:  # the program's weights are the slice's own tensors, as held
        if spec.kind == Kind.WEIGHT:
            assert tuple(weight_view(weights[spec.name]).shape) == spec.shape, spec.name
    views = state_views(pl.whole, rank_state(model, 2, 16))
    states = [b for b in p.buffers if b.kind == Kind.STATE]
    assert states and all(tuple(views[b.name].shape) == b.shape for b in states)
    with pytest.raises(ValueError, match="rank program"):
        model.new_state(2, 16)  # the reference path has no step for a slice


def test_the_rank_kernel_is_named_by_its_slice_preset():
    assert rank_kernel_name(kimik3.get_preset("tiny"), 2, 1, "dense") == "megakernel/tiny-rank/b1"
    assert rank_kernel_name(kimik3.get_preset("kimi-k3"), 32, 8, "mxfp4") == "megakernel/k3-rank/b8-mxfp4"
    assert rank_kernel_name(kimik3.get_preset("micro"), 2, 1, "dense") == "megakernel/micro-w2/b1"  # compiled here


def test_the_gpu_segment_reserves_the_kernels_counter_words():
    p = launch_plan(kimik3.get_preset("tiny"), 1, 16, 2, 132).programs[0]
    words8, part8, off8 = segment_layout(p)
    words, part, off = segment_layout(p, word_bytes=4, capacity=1 << 14)
    assert words == words8 and part >= 4 * (1 << 14) and min(off.values()) >= 4 * (1 << 14)
    assert all(v % 64 == 0 for v in off.values()) and set(off) == set(off8)
    with pytest.raises(ValueError, match="counter words > the kernel's 4"):
        segment_layout(p, word_bytes=4, capacity=4)


def test_mxfp4_experts_are_drawn_held_with_the_dense_rules_magnitude():
    model = from_preset("tiny-rank", dtype=torch.bfloat16, experts="mxfp4")
    cfg = model.config
    assert model.expert_storage == "mxfp4"
    q = model.model.layers[1].block_sparse_moe.experts
    assert q.w1_packed.shape[0] == cfg.held("experts")
    w = q.expert("w1", 0, torch.float32)
    target = cfg.moe_latent_size ** -0.5
    assert 0.5 * target < float(w.std()) < 2 * target  # the nearest power of two of the dense rule's std
    dense = sum(t.numel() * t.element_size() for t in build_model("tiny-rank", "meta").parameters())
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert held < 0.6 * dense  # never a bf16 copy of the experts
    with pytest.raises(ValueError, match="experts must be 'dense' or 'mxfp4'"):
        from_preset("tiny", experts="fp8")


def test_the_stage_refuses_ranks_on_a_cpu_model():
    model = kimik3.from_preset("tiny", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA GPU.*not on cpu"):
        kimik3.Decoder(model, "megakernel", batch_size=1, max_seq_len=16, world=2)


def test_measured_prediction_adds_only_the_wire_to_the_measured_step():
    """A rank program's modelled timeline stands in for a measurement: the prediction keeps the measured step as
    its local part (the replay matched to it) and adds the wire's exposed share; the parts say so."""
    from kimik3.megakernel.timeline import simulate
    from kimik3.perfmodel.ranks import measured_extras

    pl = launch_plan(kimik3.get_preset("tiny"), 1, 16, 2, 8, check=False)
    p = pl.programs[0]
    tl = simulate(p)
    ms = float(tl["end_ns"].max()) / 1e6 * 1.3  # the launch costs something the replay does not see
    out = measured_extras(p, tl, 1, ms, (ms * 0.9, ms * 1.1), 1e9, "a test device")["rank"]
    assert out["measured_step_ms"] == ms and out["step_ms"] >= ms
    assert out["step_ms"] - ms <= out["serial_wire_ms"] + 1e-9  # at most the wire's serial time is exposed
    lo, hi = out["step_ms_range"]
    assert lo <= out["step_ms"] <= hi and lo >= ms * 0.9
    assert out["parts"]["local step"].startswith("measured: the rank program alone on a test device")
