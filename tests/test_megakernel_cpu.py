"""The native CPU megakernel executor (stage ``megakernel-cpu``): one worker thread per queue, atomic counters.

Expectation sources:

* stage ``naive`` (the model's own eager code): fp32 greedy tokens identical over 32 steps and e ≤
  TOL["fp32_stage"] per step at batch 1, 4, 33 (ragged prompts; scratch poisoned before every step); bf16
  teacher-forced within TOL["bf16_stage"] of the fp32 reference;
* the Python encoding (kimik3/megakernel/instructions.py): the generated C++ header and the executor's reading
  of a program header equal the Python definition and decoder;
* construction: a wait for a value no one signals must trip the watchdog with a per-worker dump; a program with
  any single wait removed (the hazard checker's mutants) must give a ThreadSanitizer report or a wrong result,
  while the unmutated program runs TSan-clean (standalone driver, the executor's own source). CI runs a sample of
  the mutants; all of them run under ``slow``.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re

import pytest
import torch

import kimik3
from kimik3.megakernel import cpu
from kimik3.megakernel.instructions import Kind, Op, Program, decode_program, encode_program
from kimik3.validation import bf16_pair, compare_to_reference
from kimik3.validation.metric import TOL, rel_error

STEPS = 32

try:
    cpu.find_compiler()
    HAVE_CXX = True
except ValueError:
    HAVE_CXX = False
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler on this machine (the stage refuses, tested)")


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def micro():
    return kimik3.from_preset("micro", seed=11)


# ---------------------------------------------------------------------------------------------------- encoding


def test_generated_header_is_the_python_encoding():
    h = cpu.encoding_header()
    defs = dict(re.findall(r"#define (\w+) (-?\d+)", h))
    for op in Op:
        assert int(defs[f"OP_{op.name}"]) == int(op)
    for kind in Kind:
        assert int(defs[f"KIND_{kind.name}"]) == int(kind)
    from kimik3.megakernel import instructions as enc

    for name in ("MAGIC", "INSTR_WORDS", "W_OP", "W_ARGS", "W_SIGNAL", "W_AMOUNT", "W_NWAITS", "W_WAITS", "W_NOPS",
                 "W_OPS", "OPERAND_WORDS", "BUFFER_WORDS", "COUNTER_WORDS", "MAX_OPERANDS"):
        assert int(defs[name]) == int(getattr(enc, name)), name


@needs_cxx
def test_executor_reads_the_header_as_the_python_decoder():
    from kimik3.megakernel.scheduler import build_program

    p = build_program("micro", 5, 3, "round_robin", max_seq_len=24, act_dtype=torch.float32)
    t = encode_program(p)
    got = cpu.header_as_read(t)
    q = decode_program(t)
    assert (got["n"], got["s"], got["c"], got["nb"], got["batch"], got["total"]) == \
        (len(q.instructions), q.num_sms, len(q.counters), len(q.buffers), q.batch, t.numel())
    assert got["q"] == max(len(x) for x in q.queues)
    # the section offsets the executor uses land on the rows the decoder reads
    ins = t[got["off_ins"]:got["off_q"]].view(got["n"], -1)
    assert ins.shape[1] == cpu.enc.INSTR_WORDS
    assert [int(r[cpu.enc.W_OP]) for r in ins] == [int(i.op) for i in q.instructions]
    bt = t[got["off_buf"]:got["off_ctr"]].view(got["nb"], -1)
    assert [tuple(int(x) for x in r[2:5]) for r in bt] == [b.shape for b in q.buffers]


# ---------------------------------------------------------------------------------------------------- vs naive


@needs_cxx
@pytest.mark.parametrize("batch,workers", [(1, 2), (4, 3), (33, 4)])
def test_fp32_greedy_tokens_match_naive(micro, batch, workers):
    r = compare_to_reference(micro, "megakernel-cpu", batch, prompt_len=12, steps=STEPS, seed=batch,
                             num_sms=workers, poison=True)
    assert r.tokens_equal, f"greedy tokens diverged: {r.as_dict()}"
    assert r.passed, f"max e={r.max_error:.2e} > {r.tolerance}"


@needs_cxx
@pytest.mark.parametrize("batch", [1, 8])
def test_bf16_teacher_forced_within_tolerance(micro, batch):
    low, ref = bf16_pair(micro)
    r = compare_to_reference(low, "megakernel-cpu", batch, prompt_len=12, steps=STEPS, seed=100 + batch,
                             reference=ref, num_sms=2, poison=True)
    assert r.passed, f"max e={r.max_error:.2e} > {r.tolerance} (top-1 agreement {r.top1_agreement:.2%})"


@needs_cxx
def test_round_robin_program_and_the_programs_own_argmax(micro):
    ids = torch.randint(0, micro.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(3))
    want = kimik3.Decoder(micro, "naive", batch_size=3, max_seq_len=24).generate(ids, max_new_tokens=8,
                                                                               lengths=[6, 2, 4])
    dec = kimik3.Decoder(micro, "megakernel-cpu", batch_size=3, max_seq_len=24, num_sms=3, policy="round_robin")
    got = dec.generate(ids, max_new_tokens=8, lengths=[6, 2, 4])
    assert torch.equal(got, want)
    runner = dec.stage.runner
    assert torch.equal(runner.tensors["next_token"][:, 0, 0], runner.tensors["logits"][:, 0, :].argmax(-1))
    # counters are monotonic across steps: after s steps every counter holds s * total
    assert runner.counters() == [runner.steps_done * c.total for c in runner.program.counters]


# ---------------------------------------------------------------------------------------------------- timeline


@needs_cxx
def test_timings_in_the_gpu_format_and_a_measured_timeline(micro):
    from kimik3.megakernel.timeline import summary

    dec = kimik3.Decoder(micro, "megakernel-cpu", batch_size=2, max_seq_len=16, num_sms=3)
    dec.prefill(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    dec.step(torch.tensor([1, 2]))
    t = dec.stage.timings
    p = dec.stage.program
    assert t.shape == (len(p.instructions), 3) and t.dtype == torch.int64
    assert bool((t[:, 1] >= t[:, 0]).all()) and bool((t[:, 0] > 0).all())
    assert [int(w) for w in t[:, 2]] == [ins.sm for ins in p.instructions]  # each ran on its queue's worker
    for q in p.queues:  # program order on each worker
        starts = t[q, 0]
        assert bool((starts[1:] >= t[q[:-1], 1]).all())
    tl = dec.stage.timeline()
    assert len(tl) == len(p.instructions) and (tl["start_ns"] >= tl["arrive_ns"]).all()
    s = summary(tl, 3)
    assert "(idle)" in s.index and s["busy_us"].sum() > 0


# ---------------------------------------------------------------------------------------------------- failures


@needs_cxx
def test_watchdog_turns_a_hang_into_an_error_with_a_dump(micro):
    from kimik3.megakernel.scheduler import build_program

    p = build_program(micro.config, 2, 3, "critical_path", max_seq_len=16, act_dtype=torch.float32)
    i = next(i for i, x in enumerate(p.instructions) if x.waits and x.layer == 2)
    c, _ = p.instructions[i].waits[0]
    ins = list(p.instructions)
    ins[i] = dataclasses.replace(ins[i], waits=((c, p.counters[c].total + 1),) + ins[i].waits[1:])
    bad = Program(p.buffers, ins, p.queues, p.counters, p.batch, p.max_seq_len, p.num_layers, p.policy)
    runner = cpu.CPUMegakernel(micro, 2, 16, program=bad, check=False, timeout_s=0.3)
    naive = kimik3.Decoder(micro, "naive", batch_size=2, max_seq_len=16)
    naive.prefill(torch.tensor([[5, 6], [7, 8]]))
    runner.bind_state(naive.stage.state)
    with pytest.raises(cpu.MegakernelCPUError, match="watchdog") as e:
        runner.run_step(torch.tensor([1, 2]), torch.tensor([2, 2]))
    stuck = [d for d in e.value.dump if d["state"] == "gave up"]
    assert any(d["instruction"] == i and d["counter"] == c and d["seen"] < d["target"] for d in stuck), e.value.dump
    assert f"#{i} " in str(e.value) and len(e.value.dump) == 3
    with pytest.raises(RuntimeError, match="unusable"):
        runner.run_step(torch.tensor([1, 2]), torch.tensor([2, 2]))
    runner.close()


def test_refusals(micro, monkeypatch):
    with pytest.raises(ValueError, match="batch sizes"):
        kimik3.Decoder(micro, "megakernel-cpu", batch_size=65, max_seq_len=8)
    with pytest.raises(ValueError, match="dtypes"):
        kimik3.Decoder(kimik3.from_preset("micro", seed=0).double(), "megakernel-cpu", batch_size=1, max_seq_len=8)
    with pytest.raises(ValueError, match="unknown policy"):
        kimik3.Decoder(micro, "megakernel-cpu", batch_size=1, max_seq_len=8, policy="fastest")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        cpu.find_compiler()


# ---------------------------------------------------------------------------------------------------- TSan

TSAN_CI_MUTANTS = 4


@pytest.fixture(scope="module")
def tsan_case(tmp_path_factory):
    """A micro program on 4 workers after a ragged prefill, 3 decode steps, and its clean TSan run. The prompt
    lengths put some sequences' new tokens in the second MLA context split (rows 12..23) and some in the first, so
    every split's reads really do conflict with some append (the program declares appends over all rows)."""
    from kimik3.megakernel.cpu_tsan import dump_case, run_tsan

    model = kimik3.from_preset("micro", seed=0)
    B, steps = 3, 3
    lengths = [13, 4, 11]
    ids = torch.randint(0, model.config.vocab_size, (B, max(lengths)), generator=torch.Generator().manual_seed(1))
    dec = kimik3.Decoder(model, "megakernel-cpu", batch_size=B, max_seq_len=24, num_sms=4, poison=True)
    dec.prefill(ids, lengths)
    state = dec.stage.snapshot()
    toks = torch.randint(0, model.config.vocab_size, (steps, B), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor(lengths) + torch.arange(steps)[:, None]
    d = dump_case(dec.stage.runner, tmp_path_factory.mktemp("tsan") / "clean", toks, pos)
    native = torch.stack([dec.step(toks[s]) for s in range(steps)])
    clean = run_tsan(d)
    return dict(dec=dec, state=state, toks=toks, pos=pos, native=native, clean=clean,
                root=tmp_path_factory.mktemp("mutants"))


def _mutant_verdict(case, i: int, k: int) -> str:
    from kimik3.megakernel.cpu_tsan import dump_case, run_tsan

    dec = case["dec"]
    runner = dec.stage.runner
    p = runner.program
    ins = list(p.instructions)
    ins[i] = dataclasses.replace(ins[i], waits=ins[i].waits[:k] + ins[i].waits[k + 1:])
    mutant = Program(p.buffers, ins, [list(q) for q in p.queues], list(p.counters), p.batch, p.max_seq_len,
                     p.num_layers, p.policy)
    dec.stage.naive.state = copy.deepcopy(case["state"])
    runner.bind_state(dec.stage.naive.state)
    d = dump_case(runner, case["root"] / f"m{i}_{k}", case["toks"], case["pos"], program=mutant)
    res = run_tsan(d)
    wrong = res.logits is None or res.logits.shape != case["clean"].logits.shape or \
        not torch.equal(res.logits, case["clean"].logits)
    return ("race " if res.races else "") + ("wrong" if wrong else "")


@needs_cxx
def test_tsan_runs_the_micro_program_clean(tsan_case):
    clean = tsan_case["clean"]
    assert clean.clean, clean.stderr[-3000:]
    assert clean.logits.shape[0] == 3
    # the TSan build (no -march=native: the portable loops, no FMA contraction) agrees with the native library
    assert rel_error(clean.logits, tsan_case["native"]) <= TOL["fp32_stage"]
    assert torch.equal(clean.next_tokens, tsan_case["native"].argmax(-1))


def _all_waits(case) -> list[tuple[int, int]]:
    p = case["dec"].stage.program
    return [(i, k) for i, ins in enumerate(p.instructions) for k in range(len(ins.waits))]


@needs_cxx
def test_removing_a_wait_is_caught_sample(tsan_case):
    waits = _all_waits(tsan_case)
    for i, k in random.Random(0).sample(waits, TSAN_CI_MUTANTS):
        assert _mutant_verdict(tsan_case, i, k), f"removing wait {k} of #{i} went unnoticed"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~300 TSan runs of a few seconds each
@needs_cxx
def test_removing_any_wait_is_caught(tsan_case):
    missed = [(i, k) for i, k in _all_waits(tsan_case) if not _mutant_verdict(tsan_case, i, k)]
    assert not missed, f"{len(missed)} mutants went unnoticed: {missed[:10]}"


# ---------------------------------------------------------------------------------------------------- MXFP4


@needs_cxx
def test_mxfp4_experts_match_naive_on_mxfp4_weights():
    """Routed experts streamed as MXFP4. Expectation: naive on the same model with its experts round-tripped
    through MXFP4 (what loading an MXFP4 checkpoint gives); the executor packs them again, exactly. The stage's
    dense expert buffers are NaN-filled afterwards: the result stays finite only if the packed form is what runs."""
    from kimik3.model.quant import mxfp4_dequantize, mxfp4_quantize

    model = kimik3.from_preset("micro", seed=5)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
                E, R, C = w.shape
                packed, scale = mxfp4_quantize(w.data)
                w.copy_(mxfp4_dequantize(packed.reshape(E * R, C // 2), scale.reshape(E * R, C // 32),
                                         torch.float32).view(E, R, C))
    twin = copy.deepcopy(model)
    B, lengths = 4, [9, 5, 7, 3]
    ids = torch.randint(0, model.config.vocab_size, (B, 9), generator=torch.Generator().manual_seed(4))
    ref = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=9 + STEPS + 1)
    dut = kimik3.Decoder(twin, "megakernel-cpu", batch_size=B, max_seq_len=9 + STEPS + 1, num_sms=2,
                         experts="mxfp4", poison=True)
    a = ref.prefill(ids, lengths)
    dut.prefill(ids, lengths)  # through the naive path: the dense experts are still needed here
    n = 0
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
                p.fill_(float("nan"))
                n += 1
    assert n and len(dut.stage.runner._mx) == n
    for s in range(STEPS):
        tok = a.argmax(-1)
        a, b = ref.step(tok), dut.step(tok)
        assert rel_error(b, a) <= TOL["fp32_stage"], f"step {s}"
        assert torch.equal(b.argmax(-1), a.argmax(-1)), f"step {s}: greedy tokens differ"
