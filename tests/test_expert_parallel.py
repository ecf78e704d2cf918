"""Expert-parallel decode on real torch.distributed (gloo, CPU processes) vs the single-process naive decoder.

validation.md: fp32 expert-parallel decode vs single process, ``e ≤ TOL["expert_parallel"]`` per step and
identical greedy tokens. The reference here is computed in the test process with the plain ``naive`` Decoder
(independently of the module's own comparison). Every multi-process run goes through
:func:`kimik3.scale.expert_parallel.run_local` or a ``torchrun`` subprocess, both with hard deadlines, so nothing can
hang.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import kimik3
from kimik3.scale.expert_parallel import (
    ExpertParallelMoE,
    expert_range,
    owned_rows,
    run_local,
    shard_experts,
    traffic_model,
)
from kimik3.validation.metric import TOL, rel_error

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
RUN_TIMEOUT_S = 150  # per multi-process run (spawn + import + decode); the pytest timeout sits above it

pytestmark = pytest.mark.usefixtures("one_thread")  # the single-process reference: see _reference


@functools.cache
def _reference(preset: str | kimik3.ModelConfig, seed: int, prompt: tuple[tuple[int, ...], ...], steps: int,
               lengths: tuple[int, ...] | None = None) -> torch.Tensor:
    """Single-process fp32 greedy decode with stage 'naive': logits [steps + 1, B, V] (prefill's first).

    On one thread (the module's ``one_thread`` fixture): these small per-token matmuls are far slower with two
    contending threads on a 2-core runner."""
    ids = torch.tensor(prompt)
    model = kimik3.from_preset(preset, seed=seed)
    dec = kimik3.Decoder(model, "naive", batch_size=ids.shape[0], max_seq_len=ids.shape[1] + steps + 1)
    out = [dec.prefill(ids, None if lengths is None else list(lengths))]
    for _ in range(steps):
        out.append(dec.step(out[-1].argmax(-1)))
    return torch.stack(out)


def _check_against_single_process(results: list[dict], preset: str | kimik3.ModelConfig, seed: int = 0,
                                  lengths: tuple[int, ...] | None = None) -> None:
    world = len(results)
    r0 = results[0]
    for r in results[1:]:  # the logits all_gather hands every rank the same tensor
        assert torch.equal(r["logits"], r0["logits"]), f"rank {r['rank']} returned different logits than rank 0"
        assert torch.equal(r["prompt"], r0["prompt"])
    ref = _reference(preset, seed, tuple(map(tuple, r0["prompt"].tolist())), STEPS, lengths)
    errors = [rel_error(r0["logits"][i], ref[i]) for i in range(STEPS + 1)]
    assert max(errors) <= TOL["expert_parallel"], f"world {world}: per-step errors {errors}"
    ref_tokens = ref.argmax(-1).T
    assert torch.equal(r0["tokens"], ref_tokens), f"world {world}: greedy tokens differ from the single process"
    assert r0["ok"] and r0["tokens_match"]  # and the module's own rank-0 check agrees


def _check_collectives(results: list[dict], cfg: kimik3.ModelConfig, batch: int) -> None:
    """2 all_to_all per MoE layer per step on every rank, and dispatch bytes = tokens·k·width·elem_size."""
    world, n_moe, k = len(results), len(cfg.moe_layers), cfg.num_experts_per_tok
    width, esize = cfg.expert_in_dim, 4  # fp32 run
    total_sent = total_recv = remote_sent = remote_recv = 0.0
    for r in results:
        s = r["summary_step"]
        lo, hi = owned_rows(batch, r["rank"], world)
        assert r["owned_rows"] == [lo, hi]
        assert s["steps"] == STEPS and s["moe_layers"] == n_moe
        calls = s["calls_per_step"]
        assert calls["all_to_all"] == 2 * n_moe, calls
        assert calls["all_to_all/dispatch"] == calls["all_to_all/combine"] == n_moe, calls
        assert calls["all_gather/routing"] == n_moe and calls["all_gather/logits"] == 1, calls
        assert calls["all_gather"] == n_moe + 1, calls  # nothing else: no split-size or row-count exchanges
        sent, recv = s["bytes_sent_per_step"], s["bytes_received_per_step"]
        assert sent["dispatch"] == (hi - lo) * k * width * esize * n_moe, (r["rank"], sent)
        assert s["hidden_dispatch_bytes_per_step"] == (hi - lo) * k * cfg.hidden_size * esize * n_moe
        assert recv["combine"] == sent["dispatch"]  # every dispatched row comes back once
        assert sent["routing"] == -(-batch // world) * k * 4 * n_moe  # int32 ids, padded block
        total_sent += sent["dispatch"]
        total_recv += recv["dispatch"]
        remote_sent += s["bytes_sent_remote_per_step"]["dispatch"]
        remote_recv += s["bytes_received_remote_per_step"]["dispatch"]
        assert s["bytes_sent_remote_per_step"]["dispatch"] <= sent["dispatch"]
        # the prefill runs token by token: the same two all_to_all per MoE layer per prompt position
        p = r["summary_prefill"]  # every rank runs all positions of the padded prompt, even with no row there
        assert p["calls_per_step"]["all_to_all"] == 2 * n_moe * r["prompt"].shape[1]
    per_step = batch * k * width * esize * n_moe  # tokens·k·latent·elem_size, per MoE layer, all ranks
    assert total_sent == per_step and total_recv == per_step
    assert remote_sent == remote_recv  # what leaves one rank arrives at another
    assert per_step == traffic_model(cfg, batch, world, esize)["dispatch_bytes_per_layer"] * n_moe


def _check_shard_sizes(results: list[dict], cfg: kimik3.ModelConfig) -> None:
    world = len(results)
    per_expert = 3 * cfg.moe_intermediate_size * cfg.expert_in_dim
    dropped = len(cfg.moe_layers) * (cfg.n_routed_experts - cfg.n_routed_experts // world) * per_expert
    for r in results:
        assert r["params_before_shard"] - r["params_after_shard"] == dropped


def _run_and_check(preset: str | kimik3.ModelConfig, world: int, batch: int) -> list[dict]:
    results = run_local(world, timeout_s=RUN_TIMEOUT_S, preset=preset, batch=batch, steps=STEPS, seed=0)
    cfg = kimik3.get_preset(preset)
    _check_against_single_process(results, preset)
    _check_collectives(results, cfg, batch)
    _check_shard_sizes(results, cfg)
    return results


# ---------------------------------------------------------------------------------------------- in-process


def test_expert_and_row_blocks() -> None:
    assert [expert_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [owned_rows(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]
    assert [owned_rows(7, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        expert_range(8, 0, 3)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        expert_range(8, 2, 2)


def test_shard_experts_keeps_only_the_local_block() -> None:
    full = kimik3.from_preset("micro", seed=0)
    model = kimik3.from_preset("micro", seed=0)
    layer = model.config.moe_layers[0]
    old = weakref.ref(model.model.layers[layer].block_sparse_moe.experts.w1)
    before = model.num_parameters()
    assert shard_experts(model, 2, 4) is model
    gc.collect()
    assert old() is None, "the full stacked expert tensor is still alive after sharding"
    for i in model.config.moe_layers:
        moe, ref = model.model.layers[i].block_sparse_moe, full.model.layers[i].block_sparse_moe
        lo, hi = expert_range(model.config.n_routed_experts, 2, 4)  # micro: 16 experts -> rank 2 holds 8..11
        assert isinstance(moe, ExpertParallelMoE) and (moe.first_expert, moe.last_expert) == (lo, hi)
        for name in ("w1", "w3", "w2"):
            assert torch.equal(getattr(moe.experts, name), getattr(ref.experts, name)[lo:hi])
        assert torch.equal(moe.gate.weight, ref.gate.weight)  # replicated parts untouched
    cfg = model.config
    per_expert = 3 * cfg.moe_intermediate_size * cfg.expert_in_dim
    dropped = cfg.n_routed_experts - (hi - lo)
    assert before - model.num_parameters() == len(cfg.moe_layers) * dropped * per_expert
    assert shard_experts(model, 2, 4) is model  # same placement: no-op
    with pytest.raises(ValueError, match="already sharded as rank 2 of 4"):
        shard_experts(model, 1, 4)
    with pytest.raises(ValueError, match="not divisible"):
        shard_experts(kimik3.from_preset("micro"), 0, 3)


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="a process group is already initialised")
def test_stage_refuses_without_a_process_group() -> None:
    import kimik3.scale.expert_parallel  # noqa: F401  (registers the stage)

    with pytest.raises(ValueError, match="initialised torch.distributed process group"):
        kimik3.Decoder(kimik3.from_preset("micro"), stage="expert-parallel")


def test_traffic_model_k3_latent_halves_dispatch() -> None:
    tm = traffic_model("kimi-k3", batch=1, world=16, elem_size=2)
    assert tm["moe_layers"] == 92 and tm["all_to_all_calls_per_step"] == 184
    assert tm["dispatch_bytes_per_layer"] == 16 * 3584 * 2
    assert tm["hidden_dispatch_bytes_per_layer"] == 16 * 7168 * 2
    assert tm["saving"] == 0.5


# ---------------------------------------------------------------------------------------------- multi-process


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_micro_matches_single_process(world: int, batch: int) -> None:
    _run_and_check("micro", world, batch)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_plain_moe_dispatches_hidden_width() -> None:
    """Without LatentMoE the experts read the hidden width, so that is what travels (and there is no saving)."""
    cfg = kimik3.get_preset("micro").replace(name="micro-plain-moe", moe_latent_size=None, moe_latent_norm=False)
    results = _run_and_check(cfg, world=2, batch=3)
    assert all(r["summary_step"]["dispatch_saving"] == 0.0 for r in results)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_ragged_prompts_match_single_process() -> None:
    """Right-padded prompts: owners mask their padding, yet every rank runs all positions in lockstep."""
    lengths = (5, 1, 3)
    results = run_local(2, timeout_s=RUN_TIMEOUT_S, preset="micro", batch=3, steps=STEPS, seed=1, prompt_len=5,
                        lengths=list(lengths))
    _check_against_single_process(results, "micro", seed=1, lengths=lengths)
    _check_collectives(results, kimik3.get_preset("micro"), 3)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_failing_rank_fails_the_run_fast() -> None:
    """micro's experts over 3 ranks (not divisible): every rank refuses, and run_local raises with the reason
    instead of waiting."""
    with pytest.raises(Exception, match="not divisible by world size 3"):
        run_local(3, timeout_s=RUN_TIMEOUT_S, preset="micro", batch=1, steps=1, reference=False)


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_launcher_under_torchrun(tmp_path: Path) -> None:
    """The documented command line, end to end: per-rank stats, rank-0 tokens and error, exit status 0."""
    out = tmp_path / "rank0.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_loopback_port()),
           "-m", "kimik3.scale.expert_parallel", "--preset", "micro", "--batch", "2", "--steps", str(STEPS),
           "--seed", "0",
           "--threads", "1", "--timeout", str(RUN_TIMEOUT_S), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank 0/2]" in proc.stdout and "[rank 1/2]" in proc.stdout and "PASS" in proc.stdout
    res = json.loads(out.read_text())
    assert res["ok"] and res["tokens_match"] and res["max_error"] <= TOL["expert_parallel"]
    assert len(res["tokens"]) == 2 and len(res["tokens"][0]) == STEPS + 1
    ref = _reference("micro", 0, tuple(map(tuple, res["prompt"])), STEPS)
    assert res["tokens"] == ref.argmax(-1).T.tolist()


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_tiny_matches_single_process(world: int, batch: int) -> None:
    results = run_local(world, timeout_s=2 * RUN_TIMEOUT_S, preset="tiny", batch=batch, steps=STEPS, seed=0)
    cfg = kimik3.get_preset("tiny")
    _check_against_single_process(results, "tiny")
    _check_collectives(results, cfg, batch)
    _check_shard_sizes(results, cfg)
