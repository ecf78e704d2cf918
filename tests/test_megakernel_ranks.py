"""The megakernel across ranks: rank programs with the step's collectives as opcodes, proven and run together.

Expectation sources: stage ``naive`` (the model's own eager code, one process, the whole model) on the same fp32
weights — greedy tokens identical over 32 steps, logits within TOL["fp32_stage"]; the single-GPU program's own
encoding before ranks existed (a SHA-256 fingerprint: a rank of one must not move). Interleavings are random across
ranks and SMs (seeded); scratch buffers and mailboxes are poisoned every step, so a read of data no rank wrote fails.
Mutants of the protocol (a dropped or stale cross-rank wait, a push to the wrong peers or into the wrong slot row,
one all-reduce slot where two are needed, counter tables that differ) must each be refused by
:func:`check_deployment`; the interpreter must also see the dropped wait (a wrong answer) and the wrong peer
(a deadlock). CI matrix: ``micro`` at world 1, 2, 4 (batch 1 and 3), ``tiny`` at world 2 (batch 1 and 8).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import pytest
import torch

import kimik3
import kimik3.megakernel.step as step_module
from kimik3.megakernel.hazards import check_program
from kimik3.megakernel.hazards_ranks import check_deployment
from kimik3.megakernel.instructions import Kind, Op, Operand, Program, decode_program
from kimik3.megakernel.interp_ranks import RanksInterpreter, rank_programs
from kimik3.megakernel.interpreter import DeadlockError
from kimik3.megakernel.ranks import Shard
from kimik3.megakernel.scheduler import build_program
from kimik3.model.config import get_preset
from kimik3.validation.metric import TOL, rel_error

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see tests/conftest.py

STEPS = 32
NUM_SMS = 4

# SHA-256 of encode_program(build_program(preset, batch, sms, policy, max_seq_len=64, expert_format=...)) as built
# before rank programs existed: the single-GPU program must stay word for word what it was
GOLDEN = {
    ("micro", 1, 8, "critical_path", "dense"): "2626797399256b7e62a0ced7b57354e1d1b34f4d09bc4848eebadf737922001c",
    ("micro", 4, 8, "round_robin", "dense"): "ee109bc2c962dc5f8c8bbde875400fb92d61ec4ef78fa871fa7e3931a64925d4",
    ("micro", 8, 16, "critical_path", "mxfp4"): "64b963170b45638a08abc090a0db765026974e6ecfc56f4ca9bf85ba6d44f6e0",
    ("tiny", 1, 8, "critical_path", "dense"): "0173a8dc5c0668fc70a227451a1178af355d81820e4ed4f45112486e63177ac6",
}


@pytest.mark.parametrize("case", list(GOLDEN), ids=["-".join(map(str, c)) for c in GOLDEN])
def test_a_rank_of_one_is_the_single_gpu_program_word_for_word(case) -> None:
    preset, B, S, policy, fmt = case
    p = build_program(preset, B, S, policy, max_seq_len=64, expert_format=fmt)
    assert hashlib.sha256(p.tensor().numpy().tobytes()).hexdigest() == GOLDEN[case]
    assert build_program(preset, B, S, policy, max_seq_len=64, expert_format=fmt, shard=Shard(1, 1, 0)) == p
    assert p.world == 1 and not any(c.sources for c in p.counters) and not any(i.peers != (0, 0)
                                                                               for i in p.instructions)


def test_shard_refuses_what_is_not_built_or_does_not_divide() -> None:
    for kwargs, match in [({"tp": 2, "ep": 4}, "tp == ep"), ({"tp": 2, "ep": 2, "rank": 2}, "outside a world"),
                          ({"tp": 0, "ep": 0}, "1..128"), ({"tp": True, "ep": 1}, "must be an int"),
                          ({"tp": 2, "ep": 2, "layout": "dp-attention"}, "modelled, not built")]:
        with pytest.raises(ValueError, match=match):
            Shard(**kwargs)
    with pytest.raises(ValueError, match="heads = 6 does not split evenly over 4 ranks"):
        build_program("tiny", 1, 4, shard=Shard(4, 4, 0))
    with pytest.raises(ValueError, match="runs world sizes 1..128, got world 0"):
        kimik3.Decoder(kimik3.from_preset("micro", seed=0), "megakernel-interp", batch_size=1, max_seq_len=8,
                       world=0)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("B", [1, 3])
def test_rank_programs_are_proven_alone_and_together(world: int, B: int) -> None:
    ps = rank_programs("micro", B, NUM_SMS, world, max_seq_len=40, act_dtype=torch.float32)
    for r, p in enumerate(ps):
        assert (p.rank, p.world) == (r, world)
        assert decode_program(p.tensor()) == p  # rank, world, peer ranges and counter sources survive encoding
        assert check_program(p) == []
    assert check_deployment(ps) == []
    if world > 1:
        ops = {i.op for i in ps[0].instructions}
        assert {Op.ALLREDUCE_MIX, Op.ARGMAX_ALL} <= ops and Op.ARGMAX not in ops
        # every projection is cut: a rank reads 1/world of the experts' rows and of the vocabulary
        lm = [i for i in ps[0].instructions if i.op == Op.LM_HEAD]
        assert sum(i.args[3] - i.args[2] for i in lm) == get_preset("micro").vocab_size // world


def _run(preset: str, B: int, world: int, seed: int, steps: int) -> None:
    model = kimik3.from_preset(preset, seed=0)
    lengths = [5 - (b % 4) for b in range(B)]
    ids = torch.randint(0, model.config.vocab_size, (B, max(lengths)), generator=torch.Generator().manual_seed(B))
    ref = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=max(lengths) + steps + 1)
    dec = kimik3.Decoder(model, "megakernel-interp", batch_size=B, max_seq_len=max(lengths) + steps + 1,
                         num_sms=NUM_SMS, world=world, seed=seed)
    want, got = ref.prefill(ids, lengths), dec.prefill(ids, lengths)
    for s in range(steps):
        tok = want.argmax(-1)
        want, got = ref.step(tok), dec.step(tok)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{preset} world {world} B={B} step {s}: tokens differ"
        assert rel_error(got, want) <= TOL["fp32_stage"], f"step {s}: e={rel_error(got, want):.2e}"
        for it in dec.stage.ranks.ranks if world > 1 else [dec.stage.interpreter]:
            assert torch.equal(it.tensors["next_token"][:, 0, 0], want.argmax(-1))


@pytest.mark.parametrize("world, B", [(1, 3), (2, 1), (2, 3), (4, 1), (4, 3)])
def test_micro_ranks_match_naive_over_32_steps(world: int, B: int) -> None:
    _run("micro", B, world, seed=world * 10 + B, steps=STEPS)


@pytest.mark.parametrize("B", [1, 8])
def test_tiny_two_ranks_match_naive(B: int) -> None:
    _run("tiny", B, 2, seed=B, steps=STEPS)


def test_interleavings_across_ranks_are_bitwise_alike() -> None:
    """The cross-rank sums run in rank order on every rank: any interleaving gives the same bits."""
    model = kimik3.from_preset("micro", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(5))
    outs = []
    for seed in range(4):
        dec = kimik3.Decoder(model, "megakernel-interp", batch_size=3, max_seq_len=12, num_sms=NUM_SMS, world=2,
                             seed=seed, check=seed == 0)
        dec.prefill(ids, [4, 3, 2])
        outs.append(torch.stack([dec.step(torch.tensor([1, 2, 3])) for _ in range(3)]))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


# ------------------------------------------------------------------------------------------------ mutants


def _programs(world: int = 2, B: int = 2) -> list[Program]:
    return rank_programs("micro", B, NUM_SMS, world, max_seq_len=40, act_dtype=torch.float32)


def _mutate(ps: list[Program], rank: int, i: int, **changes) -> list[Program]:
    out = list(ps)
    ins = list(ps[rank].instructions)
    ins[i] = dataclasses.replace(ins[i], **changes)
    out[rank] = dataclasses.replace(ps[rank], instructions=ins, queues=[list(q) for q in ps[rank].queues])
    return out


def _nth(p: Program, op: Op, n: int) -> int:
    return [i for i, x in enumerate(p.instructions) if x.op == op][n]


def _cross_wait(p: Program, i: int) -> int:
    return next(k for k, (c, _) in enumerate(p.instructions[i].waits) if p.counters[c].sources)


def _kinds(bad) -> set[str]:
    return {v.kind for v in bad}


def test_a_dropped_cross_rank_wait_is_caught() -> None:
    ps = _programs()
    i = _nth(ps[1], Op.ALLREDUCE_MIX, 3)
    k = _cross_wait(ps[1], i)
    waits = tuple(w for j, w in enumerate(ps[1].instructions[i].waits) if j != k)
    bad = check_deployment(_mutate(ps, 1, i, waits=waits))
    assert "raw" in _kinds(bad) and any("mbox.allreduce" in v.message and "rank 0" in v.message for v in bad)


def test_a_stale_epoch_is_caught() -> None:
    """A target one step low is met by the previous step's signals."""
    ps = _programs()
    i = _nth(ps[0], Op.ARGMAX_ALL, 0)
    k = _cross_wait(ps[0], i)
    waits = tuple((c, t - ps[0].counters[c].total) if j == k else (c, t)
                  for j, (c, t) in enumerate(ps[0].instructions[i].waits))
    assert "raw" in _kinds(check_deployment(_mutate(ps, 0, i, waits=waits)))


def test_a_push_to_the_wrong_peers_is_caught() -> None:
    ps = _programs()
    i = _nth(ps[1], Op.O_PROJ_RESIDUAL, 2)
    bad = check_deployment(_mutate(ps, 1, i, peers=(1, 2)))  # rank 0 never hears of this tile
    assert {"deadlock", "counter"} <= _kinds(bad)
    assert check_program(_mutate(ps, 1, i, peers=(1, 2))[1]) == []  # alone, the rank cannot see it


def test_a_push_into_the_wrong_slot_row_is_caught() -> None:
    ps = _programs()
    i = _nth(ps[1], Op.O_PROJ_RESIDUAL, 2)
    ops = list(ps[1].instructions[i].operands)
    o = ops[-1]
    ops[-1] = Operand(o.buf, o.mode, (*o.box[:2], o.box[2] - 1, o.box[3] - 1, *o.box[4:]))  # rank 0's row, not its own
    bad = check_deployment(_mutate(ps, 1, i, operands=tuple(ops)))
    assert {"waw", "mailbox"} <= _kinds(bad)


def test_one_allreduce_slot_is_caught(monkeypatch) -> None:
    """With one slot, the next all-reduce's partial may land on a peer still reading the last one."""
    monkeypatch.setattr(step_module, "AR_SLOTS", 1)
    ps = _programs()
    assert all(check_program(p) == [] for p in ps)  # each rank alone is fine
    bad = check_deployment(ps)
    assert "war" in _kinds(bad) and all(v.buffer and "mbox.allreduce" in v.buffer for v in bad if v.kind == "war")


def test_counter_tables_must_agree() -> None:
    ps = _programs()
    counters = list(ps[1].counters)
    counters[0] = dataclasses.replace(counters[0], total=counters[0].total + 1)
    ps[1] = dataclasses.replace(ps[1], counters=counters, queues=[list(q) for q in ps[1].queues])
    assert _kinds(check_deployment(ps)) == {"protocol"}


def _interp(ps: list[Program], seed: int) -> torch.Tensor:
    model = kimik3.from_preset("micro", seed=0)
    B = ps[0].batch
    dec = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=ps[0].max_seq_len)
    dec.prefill(torch.arange(2 * B).view(B, 2), [2] * B)
    run = RanksInterpreter(ps, model)
    run.bind_state([copy.deepcopy(dec.stage.state) for _ in ps])
    return run.run_step(torch.arange(B), torch.full((B,), 2), seed=seed)


def test_the_interpreter_sees_a_dropped_wait_and_a_wrong_peer() -> None:
    ps = _programs()
    good = _interp(ps, 0)
    assert torch.isfinite(good).all()
    i = _nth(ps[1], Op.ALLREDUCE_MIX, 3)
    k = _cross_wait(ps[1], i)
    dropped = _mutate(ps, 1, i, waits=tuple(w for j, w in enumerate(ps[1].instructions[i].waits) if j != k))
    assert any(not torch.equal(_interp(dropped, seed), good) for seed in range(8)), \
        "no interleaving ran the all-reduce before a peer's partial"
    with pytest.raises(DeadlockError, match="deadlock across ranks"):
        _interp(_mutate(ps, 1, _nth(ps[1], Op.O_PROJ_RESIDUAL, 2), peers=(1, 2)), 0)


def test_mailboxes_are_symmetric_and_sized_by_the_protocol() -> None:
    ps = _programs(world=4, B=3)
    H = get_preset("micro").hidden_size
    for p in ps:
        mb = {b.name: b.shape for b in p.buffers if b.kind == Kind.MAILBOX}
        assert mb["mbox.allreduce"] == (3, step_module.AR_SLOTS * 4, H)
        assert mb == {b.name: b.shape for b in ps[0].buffers if b.kind == Kind.MAILBOX}


# ------------------------------------------------------------------------------------------------ the wire


def test_the_wire_is_read_off_the_program() -> None:
    """Bytes per collective from the pushed boxes: a hidden vector per sequence in the activation dtype for an
    all-reduce, the latent width in fp32 for the expert sum, to each of the world − 1 peers."""
    from kimik3.scale.wire import collective_table, rank_step

    cfg = get_preset("micro")
    B, W = 3, 4
    p = build_program("micro", B, NUM_SMS, max_seq_len=40, shard=Shard(W, W, 1))
    t = collective_table(p).set_index("collective")
    assert t.loc["L0.o_proj", "bytes_per_peer"] == B * cfg.hidden_size * 2  # bf16
    assert t.loc["L1.expert_down", "bytes_per_peer"] == B * cfg.moe_latent_size * 4  # fp32
    assert (t["bytes_out"] == t["bytes_per_peer"] * (W - 1)).all()
    moe = sum(cfg.ffn(i) == "moe" for i in range(cfg.num_hidden_layers))
    assert len(t) == 2 * cfg.num_hidden_layers + moe + 1  # all-reduces, latent sums, the arg-max
    m = rank_step(p, "gb300")
    assert m["step_ms"] >= m["local_ms"] > 0 and 0 <= m["exposed_wire_ms"] <= m["serial_wire_ms"] + 1e-9
    assert 0.0 <= m["hidden_share"] <= 1.0
    slow = rank_step(p, "gb300", link_bandwidth=1e6)  # a slow link: more wire, more of it exposed
    assert slow["serial_wire_ms"] > m["serial_wire_ms"] and slow["step_ms"] > m["step_ms"]


def test_simulate_delays_cross_rank_signals_only() -> None:
    from kimik3.megakernel.timeline import makespan_ns, simulate

    p = build_program("micro", 1, NUM_SMS, max_seq_len=40, shard=Shard(2, 2, 0))
    base = makespan_ns(simulate(p))
    delay = [1e6 if c.sources else 0.0 for c in p.counters]
    assert makespan_ns(simulate(p, peer_delay_ns=delay)) >= base + 1e6  # at least the last collective's delay
    with pytest.raises(ValueError, match="one non-negative delay per counter"):
        simulate(p, peer_delay_ns=[0.0])
