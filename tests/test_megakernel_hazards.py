"""Megakernel hazard checker: mutation tests over whole ``micro`` programs, planted deadlocks, and the CPU
interpreter's behaviour on broken programs.

Expectation source: construction. A valid program (built by the scheduler) must have zero violations; every
mutant below breaks a rule by construction, so the checker must report it — *every* mutant, not a sample:

* removing any single wait (the scheduler keeps only waits that nothing else implies, so each one orders some
  conflicting pair that is otherwise unordered);
* turning any read of an activation / state / input into a prefetch (read before the waits: static weights only);
* a wait for an unreachable counter value (deadlock), a queue order that waits on its own future, a wrong
  declared counter total, a write to a weight, an out-of-bounds box.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kimik3
from kimik3.megakernel.hazards import check_program, format_violations
from kimik3.megakernel.instructions import Counter, Kind, Mode, Op, Program, encode_program
from kimik3.megakernel.interpreter import CPUInterpreter, DeadlockError
from kimik3.megakernel.scheduler import POLICIES, build_program

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see tests/conftest.py


def _with(p: Program, i: int, **changes) -> Program:
    """A copy of ``p`` with instruction ``i`` changed."""
    ins = list(p.instructions)
    ins[i] = dataclasses.replace(ins[i], **changes)
    return Program(p.buffers, ins, [list(q) for q in p.queues], list(p.counters), p.batch, p.max_seq_len,
                   p.num_layers, p.policy)


@pytest.fixture(scope="module", params=POLICIES)
def program(request):
    return build_program("micro", 3, 4, request.param, max_seq_len=24, act_dtype=torch.float32)


def test_valid_program_has_no_violations(program):
    assert check_program(program) == []
    assert check_program(encode_program(program)) == []  # the int32 form checks the same


def test_removing_any_wait_is_reported(program):
    n = 0
    for i, ins in enumerate(program.instructions):
        for k in range(len(ins.waits)):
            bad = check_program(_with(program, i, waits=ins.waits[:k] + ins.waits[k + 1 :]))
            n += 1
            races = [v for v in bad if v.kind in ("raw", "war", "waw") and v.instr == i]
            assert races, f"removing wait {k} of #{i} {ins.label()} went unnoticed"
            assert f"#{i} " in races[0].message and "happen before" in races[0].message
    assert n > 100  # the whole program, every wait


def test_any_activation_read_turned_into_prefetch_is_reported(program):
    n = 0
    for i, ins in enumerate(program.instructions):
        for k, o in enumerate(ins.operands):
            if not o.reads or program.buffers[o.buf].kind == Kind.WEIGHT:
                continue
            ops = list(ins.operands)
            ops[k] = dataclasses.replace(o, mode=o.mode | Mode.PREFETCH)
            bad = check_program(_with(program, i, operands=tuple(ops)))
            n += 1
            hit = [v for v in bad if v.kind == "prefetch" and v.instr == i]
            assert hit, f"prefetch of {program.buffers[o.buf].name} by #{i} {ins.label()} went unnoticed"
            assert "only static weights" in hit[0].message
    assert n > 300


def test_planted_deadlock_is_reported(program):
    i = next(i for i, x in enumerate(program.instructions) if x.waits and x.layer == 2)
    ins = program.instructions[i]
    c, _ = ins.waits[0]
    total = program.counters[c].total
    bad = check_program(_with(program, i, waits=((c, total + 1),) + ins.waits[1:]))
    dead = [v for v in bad if v.kind == "deadlock"]
    assert any(v.instr == i for v in dead), format_violations(bad)
    assert any(f"only {total} is ever signalled" in v.message for v in dead)
    # the SMs stuck behind it are reported too, each with what it is waiting for
    assert {v.message.split(" is stuck")[0] for v in dead} <= {f"deadlock: SM {s}" for s in range(program.num_sms)}


def test_waiting_on_own_future_is_a_deadlock(program):
    """Swap two instructions on one SM so that the first waits on a group whose member is queued behind it."""
    p = program
    for s, q in enumerate(p.queues):
        for a in range(len(q) - 1):
            u, v = q[a], q[a + 1]
            if p.instructions[u].signal >= 0 and any(c == p.instructions[u].signal for c, _ in
                                                     p.instructions[v].waits):
                queues = [list(x) for x in p.queues]
                queues[s][a], queues[s][a + 1] = v, u
                ins = list(p.instructions)
                ins[u] = dataclasses.replace(ins[u], qpos=a + 1)
                ins[v] = dataclasses.replace(ins[v], qpos=a)
                bad = check_program(Program(p.buffers, ins, queues, p.counters, p.batch, p.max_seq_len,
                                            p.num_layers, p.policy))
                assert any(x.kind == "deadlock" and x.instr == v for x in bad), format_violations(bad)
                return
    pytest.skip("no producer directly followed by its consumer on one SM")


def test_other_rule_breaks_are_reported(program):
    p = program
    # a declared counter total that differs from what is signalled breaks the step*total targets of step 2
    counters = list(p.counters)
    counters[0] = Counter(counters[0].name, counters[0].total + 1)
    q = Program(p.buffers, p.instructions, p.queues, counters, p.batch, p.max_seq_len, p.num_layers, p.policy)
    assert any(v.kind == "counter" for v in check_program(q))
    # writing a weight
    i = next(i for i, x in enumerate(p.instructions) if x.op == Op.NORM_PROJ)
    ops = list(p.instructions[i].operands)
    ops[2] = dataclasses.replace(ops[2], mode=Mode.WRITE)
    assert any(v.kind == "static-write" for v in check_program(_with(p, i, operands=tuple(ops))))
    # a box outside the buffer
    ops = list(p.instructions[i].operands)
    b0, b1, r0, r1, c0, c1 = ops[3].box
    ops[3] = dataclasses.replace(ops[3], box=(b0, b1 + 1, r0, r1, c0, c1))
    assert any(v.kind == "bounds" for v in check_program(_with(p, i, operands=tuple(ops))))


# ---------------------------------------------------------------------------------------------------- interpreter


@pytest.fixture(scope="module")
def model():
    return kimik3.from_preset("micro", seed=0)


def _run(prog: Program, model, seed: int = 0) -> CPUInterpreter:
    it = CPUInterpreter(encode_program(prog), model)
    it.bind_state(model.new_state(prog.batch, prog.max_seq_len))
    ids = torch.arange(prog.batch, dtype=torch.long)
    it.run_step(ids, torch.zeros(prog.batch, dtype=torch.long), seed=seed)
    return it


def test_interpreter_deadlock_raises_with_per_sm_dump(program, model):
    i = next(i for i, x in enumerate(program.instructions) if x.waits and x.layer == 2)
    ins = program.instructions[i]
    c, _ = ins.waits[0]
    bad = _with(program, i, waits=((c, program.counters[c].total + 1),) + ins.waits[1:])
    with pytest.raises(DeadlockError) as e:
        _run(bad, model)
    msg = str(e.value)
    assert "deadlock in step 0" in msg
    for s in range(program.num_sms):
        assert f"SM {s}:" in msg
    assert f"#{i} {ins.label()}" in msg and "(BLOCKED)" in msg and "counters:" in msg
    assert len(e.value.dump) == program.num_sms
    blocked = [d for d in e.value.dump if d["instruction"] == i]
    assert blocked and any(not w["satisfied"] for w in blocked[0]["waits"])


def test_interpreter_reads_poison_through_a_broken_prefetch(program, model):
    """An activation read turned into a prefetch is read when the SM reaches the instruction, before its waits:
    at the head of a queue that is before anything ran in this step, so it sees the NaN poison."""
    assert torch.isfinite(_run(program, model).tensors["logits"]).all()
    heads = [q[0] for q in program.queues if q]
    i = next(v for v in heads if any(program.buffers[o.buf].kind == Kind.ACT and o.reads
                                     for o in program.instructions[v].operands))
    ins = program.instructions[i]
    ops = tuple(dataclasses.replace(o, mode=o.mode | Mode.PREFETCH)
                if program.buffers[o.buf].kind == Kind.ACT and o.reads else o for o in ins.operands)
    it = _run(_with(program, i, operands=ops), model)
    assert torch.isnan(it.tensors["logits"]).any()


def test_interpreter_exposes_a_missing_wait_under_some_interleaving(program, model):
    """Remove the wait of a queue-head instruction on the embedding: under random interleavings some seed runs it
    before the EMBED tiles and reads poison. (The checker flags the same program without running it.)"""
    embed = {x.signal for x in program.instructions if x.op == Op.EMBED}
    heads = [q[0] for q in program.queues if q]
    cands = [v for v in heads if any(c in embed for c, _ in program.instructions[v].waits)]
    if not cands:
        pytest.skip("no queue head waits on the embedding")
    i = cands[0]
    ins = program.instructions[i]
    bad = _with(program, i, waits=tuple(w for w in ins.waits if w[0] not in embed))
    assert check_program(bad)
    results = [torch.isfinite(_run(bad, model, seed).tensors["logits"]).all().item() for seed in range(20)]
    assert not all(results), "20 interleavings never ran the consumer before its producer"
