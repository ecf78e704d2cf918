"""Megakernel hazard checker: mutation tests over whole ``micro`` programs, planted deadlocks, and the CPU
interpreter's behaviour on broken programs.

Expectation source: construction. A valid program (built by the scheduler) must have zero violations; every
mutant below breaks a rule by construction, so the checker must report it — *every* mutant, not a sample:

* removing any single wait (the scheduler keeps only waits that nothing else implies, so each one orders some
  conflicting pair that is otherwise unordered);
* turning any read of an activation / state / input into a prefetch (read before the waits: static weights only);
* a wait for an unreachable counter value (deadlock), a queue order that waits on its own future, a wrong
  declared counter total, a write to a weight, an out-of-bounds box.
* in a bf16 program (weights staged in shared memory, the next instruction's stage streamed across the instruction
  boundary): every next-stage descriptor retargeted into an activation or a state, descriptors and stages longer
  than their box, missing, shifted or stale descriptors — and the interpreter, which performs each stage copy when
  the device would issue it, computes a wrong result from an activation streamed early.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kimik3
from kimik3.megakernel.hazards import check_program, format_violations
from kimik3.megakernel.instructions import (
    CHUNK_BYTES,
    NO_STAGE,
    STAGE_BYTES,
    Counter,
    Kind,
    Mode,
    Op,
    Program,
    assign_stages,
    encode_program,
    stage_descriptor,
)
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


# ---------------------------------------------------------------------------------------------------- weight stages
# A bf16 program: its weights qualify for the shared-memory stage, so most instructions stage their leading weight
# rows, and every queue position carries the next instruction's stage descriptor (streamed while it starts, before
# its own waits). The mutants below retarget those descriptors; each must be reported.


def _restage(p: Program, **changes: dict) -> Program:
    """A copy of ``p`` with ``stage`` / ``next_stage`` of some instructions replaced: ``next_stage={i: desc}``."""
    ins = list(p.instructions)
    for field, per in changes.items():
        for i, value in per.items():
            ins[i] = dataclasses.replace(ins[i], **{field: value})
    return Program(p.buffers, ins, [list(q) for q in p.queues], list(p.counters), p.batch, p.max_seq_len,
                   p.num_layers, p.policy)


def _pairs(p: Program):
    """(u, w): consecutive instructions of one queue (u streams w's stage)."""
    return [(u, w) for q in p.queues for u, w in zip(q, q[1:])]


def _first_row(p: Program, o) -> tuple[int, int, int]:
    """A next-stage descriptor for the first row of operand ``o``'s box (whole chunks)."""
    spec = p.buffers[o.buf]
    b0, _, r0, _, c0, c1 = o.box
    _, d1, d2 = spec.shape
    return o.buf, (b0 * d1 + r0) * d2 + c0, max(1, (c1 - c0) * spec.element_size // CHUNK_BYTES)


@pytest.fixture(scope="module", params=POLICIES)
def staged(request):
    return build_program("micro", 1, 4, request.param, max_seq_len=24)


def test_staged_program_carries_valid_descriptors(staged):
    p = staged
    n_staged = sum(ins.stage[0] >= 0 for ins in p.instructions)
    assert n_staged > len(p.instructions) // 2
    for ins in p.instructions:
        if ins.stage[0] >= 0:
            o = ins.operands[ins.stage[0]]
            spec = p.buffers[o.buf]
            assert spec.kind == Kind.WEIGHT and spec.dtype == torch.bfloat16 and o.prefetch
            assert 1 <= ins.stage[1] <= o.box[3] - o.box[2]
            assert ins.stage[2] * CHUNK_BYTES == ins.stage[1] * spec.shape[2] * 2 <= STAGE_BYTES
    for u, w in _pairs(p):
        assert p.instructions[u].next_stage == stage_descriptor(p.instructions[w], p.buffers)
    assert all(p.instructions[q[-1]].next_stage == NO_STAGE for q in p.queues if q)
    assert check_program(p) == []
    assert check_program(encode_program(p)) == []


def test_every_descriptor_retargeted_into_an_activation_or_state_is_reported(staged):
    """Every queue position's next-stage descriptor pointed at a non-weight operand the next instruction reads
    (an early activation / state read through the cross-instruction pipeline): a prefetch violation at the
    issuer; where the issuer itself writes what it streams, also the race, named at the early issue point."""
    p = staged
    hits = {Kind.ACT: 0, Kind.STATE: 0}
    races = 0
    for u, w in _pairs(p):
        for kind in hits:  # the first activation and the first state the next instruction reads
            o = next((o for o in p.instructions[w].operands if p.buffers[o.buf].kind == kind and o.reads), None)
            if o is None:
                continue
            bad = check_program(_restage(p, next_stage={u: _first_row(p, o)}))
            hit = [v for v in bad if v.kind == "prefetch" and v.instr == u]
            assert hit, f"descriptor of #{u} into {p.buffers[o.buf].name} (for #{w}) went unnoticed"
            assert "only static weights may be prefetched across an instruction boundary" in hit[0].message
            hits[kind] += 1
            b0, _, r0, _, c0, c1 = o.box
            row = dataclasses.replace(o, box=(b0, b0 + 1, r0, r0 + 1, c0, c1))  # what the descriptor streams
            if any(x.buf == o.buf and x.writes and x.overlaps(row) for x in p.instructions[u].operands):
                race = [v for v in bad if v.kind == "raw" and v.instr == w and v.other == u]
                assert race and f"streamed into its stage by #{u}" in race[0].message, format_violations(bad)
                races += 1
    assert hits[Kind.ACT] > 100 and hits[Kind.STATE] > 5 and races > 50, (hits, races)


def test_descriptor_rows_beyond_the_box_are_reported(staged):
    """A descriptor one row longer than the next instruction's PREFETCH box, and an own stage with more rows than
    its box: both reported (the rows past the box are nobody's declared read)."""
    p = staged
    n = inside_buffer = 0
    for u, w in _pairs(p):
        x = p.instructions[w]
        j, rows, chunks = x.stage
        if j < 0:
            continue
        o = x.operands[j]
        d2 = p.buffers[o.buf].shape[2]
        box_rows = o.box[3] - o.box[2]
        row_chunks = d2 * 2 // CHUNK_BYTES
        if rows != box_rows or (rows + 1) * row_chunks * CHUNK_BYTES > STAGE_BYTES:
            continue
        buf, elem, _ = p.instructions[u].next_stage
        longer = (buf, elem, chunks + row_chunks)
        bad = check_program(_restage(p, next_stage={u: longer}))
        msgs = [v.message for v in bad if v.kind == "stage" and v.instr == u]
        assert any("outside every PREFETCH operand box" in m or "does not fit the buffer" in m for m in msgs), \
            format_violations(bad)  # (a box ending with its buffer: the extra row lies past the buffer)
        inside_buffer += any("outside every PREFETCH operand box" in m for m in msgs)
        both = check_program(_restage(p, next_stage={u: longer}, stage={w: (j, rows + 1, chunks + row_chunks)}))
        assert any(v.kind == "stage" and v.instr == w and f"{rows + 1} rows of a {box_rows}-row box" in v.message
                   for v in both), format_violations(both)
        n += 1
        if n == 40:  # enough of them: each check is a whole-program check
            break
    assert n == 40 and inside_buffer > 10, (n, inside_buffer)


def test_stale_or_missing_descriptors_are_reported(staged):
    """The next-stage words must be the next instruction's own stage: left empty (it would compute with a stage
    nobody filled), a row short (other bytes than the rows it declares), or stale after a queue change."""
    p = staged
    u, w = next((u, w) for u, w in _pairs(p) if p.instructions[w].stage[1] > 1)
    bad = check_program(_restage(p, next_stage={u: NO_STAGE}))
    assert any(v.kind == "stage" and v.instr == u and "nobody filled" in v.message for v in bad)
    buf, elem, chunks = p.instructions[u].next_stage
    row_chunks = p.buffers[buf].shape[2] * 2 // CHUNK_BYTES
    bad = check_program(_restage(p, next_stage={u: (buf, elem, chunks - row_chunks)}))  # a row short: in the box
    assert [v.kind for v in bad if v.instr == u] == ["stage"] and "other bytes than the rows" in bad[0].message
    # the own stage moved to an activation operand: a non-weight staged before the waits
    k = next(k for k, o in enumerate(p.instructions[w].operands) if p.buffers[o.buf].kind == Kind.ACT and o.reads)
    bad = check_program(_restage(p, stage={w: (k, 1, p.instructions[w].stage[2])}))
    assert any(v.kind == "prefetch" and v.instr == w and "only static weights may be staged" in v.message
               for v in bad), format_violations(bad)
    # a reordered queue keeps descriptors for the old order until the stages are assigned again
    s = p.instructions[u].sm
    q = p.queues[s]
    a = q.index(u)
    queues = [list(x) for x in p.queues]
    queues[s][a], queues[s][a + 1] = w, u
    ins = list(p.instructions)
    ins[u], ins[w] = dataclasses.replace(ins[u], qpos=a + 1), dataclasses.replace(ins[w], qpos=a)
    moved = Program(p.buffers, ins, queues, p.counters, p.batch, p.max_seq_len, p.num_layers, p.policy)
    assert any(v.kind == "stage" for v in check_program(moved))
    assert not [v for v in check_program(assign_stages(moved)) if v.kind in ("stage", "prefetch")]


@pytest.fixture(scope="module")
def model_bf16():
    return kimik3.from_preset("micro", seed=0, dtype=torch.bfloat16)


def _logits(prog: Program, model, seed: int = 0) -> tuple[torch.Tensor, int]:
    it = _run(prog, model, seed)
    return it.tensors["logits"].clone(), it.staged_copies


def test_interpreter_runs_the_stage_pipeline(staged, model_bf16):
    """The staged rows are what the instructions compute with: the same logits as without stages (bitwise), every
    staged instruction's rows copied once, and a descriptor one row short (the next instruction's own stage
    unchanged) changes the result."""
    p = staged
    plain = _restage(p, stage={i: NO_STAGE for i in range(len(p.instructions))},
                     next_stage={i: NO_STAGE for i in range(len(p.instructions))})
    want, none = _logits(plain, model_bf16)
    assert none == 0 and torch.isfinite(want).all()
    for seed in (0, 1):
        got, copies = _logits(p, model_bf16, seed)
        assert torch.equal(got, want)
        assert copies == sum(ins.stage[0] >= 0 for ins in p.instructions)
    u = next(u for u, w in _pairs(p) if p.instructions[w].op == Op.NORM_PROJ and p.instructions[w].stage[1] > 1)
    buf, elem, chunks = p.instructions[u].next_stage
    short = (buf, elem, chunks - p.buffers[buf].shape[2] * 2 // CHUNK_BYTES)  # its last staged row never copied
    got, _ = _logits(_restage(p, next_stage={u: short}), model_bf16)
    assert not torch.equal(got, want)


def test_interpreter_exposes_an_activation_streamed_through_the_stage(staged, model_bf16):
    """Planted: instruction w stages the activation its queue predecessor u writes, and u streams it for w (an early
    activation read through the cross-instruction pipeline). The interpreter copies it as u starts — before u
    wrote it — so w computes with stale or poisoned values; the checker names the same bug."""
    p = staged
    good, _ = _logits(p, model_bf16)
    for u, w in _pairs(p):
        x = p.instructions[w]
        j = next((j for j, o in enumerate(x.operands) if p.buffers[o.buf].kind == Kind.ACT and o.reads
                  and not o.writes and o.box[1] - o.box[0] == 1 and o.box[4] == 0
                  and o.box[5] == p.buffers[o.buf].shape[2] and o.box[3] - o.box[2] == 1
                  and any(y.buf == o.buf and y.writes and y.overlaps(o) for y in p.instructions[u].operands)), None)
        if j is not None:
            break
    else:
        pytest.fail("no instruction reads a one-row activation its queue predecessor writes")
    desc = _first_row(p, x.operands[j])
    bad = _restage(p, next_stage={u: desc}, stage={w: (j, 1, desc[2])})
    found = check_program(bad)
    assert {"prefetch", "raw"} <= {v.kind for v in found if v.instr in (u, w)}, format_violations(found)
    got, _ = _logits(bad, model_bf16)
    assert not torch.equal(got, good)
