"""The rack-scale model (kimik3.scale.nvl72): its sizes come from the config and the cost model, and its predictions
move the way physics says they must (more bandwidth never hurts, overlap lies between max and sum)."""

from __future__ import annotations

import pytest

import kimik3
from kimik3.perf.cost import decode_cost, expected_distinct_experts
from kimik3.scale.expert_parallel import traffic_model
from kimik3.scale.nvl72 import (
    DEPLOYMENTS,
    CommModel,
    Deployment,
    all_to_all_table,
    claims_vs_scaleout,
    collectives_per_step,
    comm_time,
    experts_per_gpu,
    gpu_bytes,
    overlap_step_time,
    per_gpu_bytes,
    per_layer_budget,
    prediction_table,
    shard_per_layer,
    step_time,
)

K3 = "kimi-k3"
T = 8192
TP72 = DEPLOYMENTS["gb300-nvl72-ep72-tp72"]
DP72 = DEPLOYMENTS["gb300-nvl72-ep72-dp"]
TP8 = DEPLOYMENTS["gb300-nvl72-ep72-tp8"]


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_per_gpu_bytes_sum_to_the_total_when_everything_is_sharded(batch):
    total = decode_cost(K3, batch, T, expert_dtype="mxfp4").total_bytes
    per_gpu = gpu_bytes(K3, batch, T, TP72)
    assert len(per_gpu) == 72
    assert per_gpu.sum() == pytest.approx(total, rel=1e-12)
    assert per_gpu_bytes(K3, batch, T, TP72, expert_load="mean")["total"] == pytest.approx(total / 72, rel=1e-12)


def test_replicated_attention_reads_the_dense_weights_once_per_busy_group():
    one = decode_cost(K3, 1, T, expert_dtype="mxfp4")
    eight = decode_cost(K3, 8, T, expert_dtype="mxfp4")
    embed_row = kimik3.get_preset(K3).hidden_size * 2  # the embedding counts as a row gather per sequence
    w0 = one.weight_bytes - one.routed_expert_bytes - embed_row  # non-expert weights every busy group reads
    assert gpu_bytes(K3, 1, T, DP72).sum() == pytest.approx(one.total_bytes, rel=1e-12)
    assert gpu_bytes(K3, 8, T, DP72).sum() == pytest.approx(eight.total_bytes + 7 * w0, rel=1e-9)
    b = per_gpu_bytes(K3, 1, T, DP72)
    assert b["non_expert_weights"] == pytest.approx(w0 + embed_row, rel=1e-12)  # one GPU holds all of it


def test_all_to_all_count_is_two_per_moe_layer():
    cfg = kimik3.get_preset(K3)
    assert len(cfg.moe_layers) == 92
    for dep in DEPLOYMENTS.values():
        n = collectives_per_step(K3, dep)
        assert n["all_to_all"] == 2 * len(cfg.moe_layers) == 184
        assert n["all_reduce"] == (2 * cfg.num_hidden_layers if dep.tp > 1 else 0)
    t = all_to_all_table(K3, [1, 8, 64], TP72)
    assert (t["all_to_all_per_step"] == 184).all()
    assert t["all_to_all_per_step"].iloc[0] == traffic_model(K3, 1, 72)["all_to_all_calls_per_step"]


def test_latent_exchange_is_half_the_hidden_width_for_k3():
    cfg = kimik3.get_preset(K3)
    assert (cfg.expert_in_dim, cfg.hidden_size) == (3584, 7168)
    t = all_to_all_table(K3, [1, 16, 256], TP72)
    assert (t["exchange_bytes"] * 2 == t["exchange_bytes_hidden_width"]).all()
    assert (t["exchange_bytes"] == t["batch"] * 16 * 3584 * 2).all()  # B · k · latent · bf16


def test_tokens_per_second_monotone_in_bandwidth():
    prev = 0.0
    for link in (100e9, 450e9, 900e9, 3600e9):
        r = step_time(K3, 8, T, TP8, link_bandwidth=link)
        assert r["tokens_per_s_per_user"] >= prev
        prev = r["tokens_per_s_per_user"]
    prev = 0.0
    for hbm in (2e12, 4e12, 8e12, 16e12):
        r = step_time(K3, 8, T, TP8, hbm_bandwidth=hbm)
        assert r["tokens_per_s_per_user"] >= prev
        prev = r["tokens_per_s_per_user"]
    slow, fast = (step_time(K3, 1, T, TP72, CommModel(a2a_latency_s=a)) for a in (20e-6, 2e-6))
    assert fast["tokens_per_s_per_user"] > slow["tokens_per_s_per_user"]


@pytest.mark.parametrize("t_local,t_comm", [(1.0, 0.3), (0.2, 2.0), (1.0, 1.0), (0.0, 0.5)])
def test_overlap_bounds(t_local, t_comm):
    prev = float("inf")
    for o in (0.0, 0.25, 0.5, 1.0):
        t = overlap_step_time(t_local, t_comm, o)
        assert max(t_local, t_comm) - 1e-15 <= t <= t_local + t_comm + 1e-15
        assert t <= prev
        prev = t
    assert overlap_step_time(t_local, t_comm, 0.0) == t_local + t_comm
    assert overlap_step_time(t_local, t_comm, 1.0) == max(t_local, t_comm)
    with pytest.raises(ValueError):
        overlap_step_time(t_local, t_comm, 1.5)


def test_step_time_overlap_and_batch():
    serial, hidden = (step_time(K3, 1, T, TP72, overlap=o) for o in (0.0, 1.0))
    assert serial["t_step_ms"] == pytest.approx(serial["t_local_ms"] + serial["t_comm_ms"])
    assert hidden["t_step_ms"] == pytest.approx(max(hidden["t_local_ms"], hidden["t_comm_ms"]))
    df = prediction_table(K3, [1, 8, 64, 256], [TP8], overlaps=(0.0,))
    assert df["tokens_per_s_per_user"].is_monotonic_decreasing  # more sequences: more bytes per step
    assert df["tokens_per_s_aggregate"].is_monotonic_increasing
    assert (df["bound"] == "memory").all()


def test_expert_load_on_the_busiest_gpu():
    for ep, b in [(72, 1), (72, 8), (16, 1), (16, 64), (1, 4)]:
        mean, mx = experts_per_gpu(896, 16, b, ep)
        assert mean * ep == pytest.approx(expected_distinct_experts(896, 16, b))
        assert mean - 1e-12 <= mx <= -(-896 // ep)
    mean, mx = experts_per_gpu(896, 16, 3, 1)
    assert mx == pytest.approx(mean)  # one GPU: the busiest is the only one
    assert 1.5 < experts_per_gpu(896, 16, 1, 72)[1] < 2.5  # batch 1 on 72 GPUs: about two experts on the busiest
    busy, even = (per_gpu_bytes(K3, 1, T, TP72, expert_load=x)["expert_weights"] for x in ("max", "mean"))
    assert busy > 5 * even


def test_comm_time_parts():
    c = comm_time(K3, 1, TP72, CommModel(a2a_latency_s=10e-6, allreduce_latency_s=5e-6))
    assert c["all_to_all_latency_s"] == pytest.approx(184 * 10e-6)
    assert c["all_reduce_per_step"] == 186 and c["all_reduce_s"] >= 186 * 5e-6
    assert comm_time(K3, 1, DP72)["all_reduce_s"] == 0.0


def test_deployment_validation():
    with pytest.raises(ValueError, match="must divide"):
        Deployment("bad", "gb300", 72, tp=7)
    with pytest.raises(ValueError):
        Deployment("bad", "no-such-gpu", 8)
    assert DP72.dp == 72 and TP8.dp == 9 and TP72.dp == 1
    assert sum(TP8.rows(33)) == 33 and max(TP8.rows(33)) == 4


def test_claims_and_per_layer():
    c = claims_vs_scaleout()
    assert {"vllm-gb300-batch1", "semianalysis-gb300-per-user", "inferact-gb200-batch1"} <= set(c["claim"])
    row = c[(c["claim"] == "vllm-gb300-batch1") & (c["deployment"] == DP72.name)].iloc[0]
    assert row["memory_over_claim"] > 1  # replicated attention cannot reach 840 tok/s at batch 1
    assert row["claimed_ms_per_step"] == pytest.approx(1e3 / 840)
    assert per_layer_budget(840) == pytest.approx(1 / 840 / 93)
    s = shard_per_layer()
    assert (s["ms_per_layer"] > 0).all() and s["source"].str.contains("bound").all()
