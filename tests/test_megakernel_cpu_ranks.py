"""The megakernel's ranks as real processes: the native executor, shared-memory mailboxes, gloo for the rendezvous.

Expectation source: stage ``naive`` in rank 0's process on the same fp32 weights, its greedy tokens fed to every
rank (teacher-forced): the ranks' greedy tokens identical over 32 steps, their gathered logits within
TOL["fp32_stage"], every rank's own ARGMAX_ALL token equal to the gathered logits' arg-max; two runs bitwise alike
(the cross-rank sums run in rank order). ThreadSanitizer runs the ranks of W = 2 together in its standalone driver:
clean, and a cross-rank wait dropped from one rank's program is caught (a race report or a wrong token).
CI matrix: ``micro`` at world 2 (batch 3) and 4 (batch 1) — world 1 is tests/test_megakernel_cpu.py — and ``tiny``
at world 2, batch 1 and 8 (32 steps each).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import kimik3
from kimik3.megakernel.cpu import CPUMegakernel
from kimik3.megakernel.cpu_ranks import run_ranks
from kimik3.megakernel.instructions import Op
from kimik3.megakernel.peer_memory import PeerMemory, segment_layout
from kimik3.megakernel.ranks import Shard
from kimik3.megakernel.scheduler import build_program
from kimik3.validation.metric import TOL

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see tests/conftest.py


def _check(results: list[dict], world: int) -> None:
    assert [r["rank"] for r in results] == list(range(world))
    r0 = results[0]
    assert r0["tokens_match"], (r0["tokens"], r0["reference_tokens"])
    assert max(r0["errors"]) <= TOL["fp32_stage"], max(r0["errors"])
    for r in results:
        assert r["next_token_agrees"]  # the rank's own ARGMAX_ALL output = the gathered logits' arg-max
        assert torch.equal(r["tokens"], r0["tokens"])
        assert all(w >= 0 for w in r["timeline"]["peer_wait_ns"])


@pytest.mark.parametrize("world, B", [(2, 3), (4, 1)])  # (world 1: stage megakernel-cpu's own tests)
def test_micro_ranks_match_naive_as_processes(world: int, B: int) -> None:
    _check(run_ranks(world, preset="micro", batch=B, steps=32, seed=0, workers=1, pin=False), world)


@pytest.mark.parametrize("B", [1, 8])
def test_tiny_two_ranks_match_naive_as_processes(B: int) -> None:
    _check(run_ranks(2, preset="tiny", batch=B, steps=32, seed=1, workers=1, pin=False), 2)


def test_two_runs_are_bitwise_alike() -> None:
    a = run_ranks(2, preset="micro", batch=2, steps=3, seed=2, workers=1, pin=False, reference=False)
    b = run_ranks(2, preset="micro", batch=2, steps=3, seed=2, workers=1, pin=False, reference=False)
    assert torch.equal(a[0]["logits"], b[0]["logits"]) and torch.equal(a[1]["logits"], b[1]["logits"])


# ------------------------------------------------------------------------------------------------ in one process


def _ranks(tmp_path, world: int = 2, B: int = 2, programs=None):
    """``world`` executors in this process over one segment (what the TSan driver runs), after a naive prefill."""
    model = kimik3.from_preset("micro", seed=0)
    ids = torch.randint(0, 512, (B, 4), generator=torch.Generator().manual_seed(1))
    nav = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=16)
    nav.prefill(ids, [4] * B)
    runners = []
    for r in range(world):
        prog = programs[r] if programs else build_program(model.config, B, 2, max_seq_len=16, act_dtype=model.dtype,
                                                          shard=Shard(world, world, r))
        pm = PeerMemory(prog, tmp_path / "segment", create=r == 0)
        rn = CPUMegakernel(model, B, 16, program=prog, shard=Shard(world, world, r), peer_memory=pm, pin=False)
        rn.bind_state(copy.deepcopy(nav.stage.state))
        runners.append(rn)
    want = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=16).generate(ids, max_new_tokens=4)
    return runners, want


def test_tsan_runs_two_ranks_clean_and_catches_a_dropped_cross_rank_wait(tmp_path) -> None:
    from kimik3.megakernel.cpu_tsan import dump_case, run_tsan

    runners, want = _ranks(tmp_path)
    steps, B = 3, 2
    toks = want[:, 4 : 4 + steps].T.contiguous()
    pos = (torch.arange(steps)[:, None] + 4).expand(steps, B).contiguous()
    clean = run_tsan([dump_case(rn, tmp_path / f"clean{r}", toks, pos) for r, rn in enumerate(runners)])
    assert clean.clean, clean.stderr[-3000:]
    for _, nxt in clean.per_rank:
        assert torch.equal(nxt, want[:, 5 : 5 + steps].T)
    p = runners[1].program
    i = [k for k, x in enumerate(p.instructions) if x.op == Op.ALLREDUCE_MIX][3]
    ins = list(p.instructions)
    ins[i] = dataclasses.replace(ins[i], waits=tuple(w for w in ins[i].waits if not p.counters[w[0]].sources))
    mutant = dataclasses.replace(p, instructions=ins, queues=[list(q) for q in p.queues])
    res = run_tsan([dump_case(runners[0], tmp_path / "m0", toks, pos),
                    dump_case(runners[1], tmp_path / "m1", toks, pos, program=mutant)])
    wrong = any(nxt is None or not torch.equal(nxt, want[:, 5 : 5 + steps].T) for _, nxt in res.per_rank)
    assert res.races > 0 or wrong, "the dropped cross-rank wait went unnoticed"


def test_refusals(tmp_path) -> None:
    model = kimik3.from_preset("micro", seed=0)
    with pytest.raises(ValueError, match="initialised torch.distributed group of 2"):
        kimik3.Decoder(model, "megakernel-cpu", batch_size=1, max_seq_len=8, world=2)
    single = build_program(model.config, 1, 2, max_seq_len=8, act_dtype=model.dtype)
    with pytest.raises(ValueError, match="no peers"):
        PeerMemory(single, tmp_path / "s", create=True)
    rank1 = build_program(model.config, 1, 2, max_seq_len=8, act_dtype=model.dtype, shard=Shard(2, 2, 1))
    with pytest.raises(ValueError, match="needs the deployment's PeerMemory"):
        CPUMegakernel(model, 1, 8, program=rank1, shard=Shard(2, 2, 1))
    with pytest.raises(ValueError, match="given with shard"):
        CPUMegakernel(model, 1, 8, program=rank1, shard=Shard(2, 2, 0))
    with pytest.raises(ValueError, match="no shared segment"):
        PeerMemory(rank1, tmp_path / "missing", create=False)
    (tmp_path / "taken").write_text("a user's file")
    with pytest.raises(FileExistsError):
        PeerMemory(rank1, tmp_path / "taken", create=True)
    assert (tmp_path / "taken").read_text() == "a user's file"
    words, per_rank, offsets = segment_layout(rank1)
    assert words == sum(max(1, c.sources) for c in rank1.counters) and per_rank % 64 == 0
    assert all(o % 64 == 0 for o in offsets.values())


def test_the_benchmark_command_refuses_bad_arguments(capsys) -> None:
    from kimik3.megakernel.cpu_ranks import main

    with pytest.raises(SystemExit) as e:
        main(["--world", "1"])
    assert e.value.code == 2
    assert main(["--preset", "no-such-preset", "--steps", "2"]) == 2
    assert "no-such-preset" in capsys.readouterr().err
