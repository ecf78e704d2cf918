"""Stage "megakernel" on a real GPU (skipped without one): one persistent launch per decode step.

* vs the fp32 naive reference on the same bf16-rounded weights, teacher-forced (``kimik3.validation``), for tiny
  and k3-shard at batch 1, 8 and 64;
* the watchdog: a program with an unreachable wait ends the launch with the error word set (instruction, counter,
  target) instead of hanging, and the stage refuses further steps until ``reset()``;
* the timing buffer covers every instruction and feeds ``timeline.from_timings``; two launches from the same state
  give bitwise identical logits (no atomics on data: every element is written by one instruction).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kimik3.kernels.toolchain.loader import default_prebuilt_dir, dsl_available  # noqa: E402
from kimik3.kernels.toolchain.targets import megakernel_cases  # noqa: E402

import kimik3  # noqa: E402
import kimik3.megakernel.gpu as G  # noqa: E402  (registers the stage "megakernel")
from kimik3.megakernel import build_program, check_program  # noqa: E402
from kimik3.model.random_init import device_model  # noqa: E402
from kimik3.validation import compare_to_reference  # noqa: E402

# the kernel comes from the DSL compiler or, on a GPU machine without it, from the prebuilt directory: only
# when neither is there is there nothing to run (and the device check counts that skip as a failure)
if not dsl_available() and default_prebuilt_dir() is None:
    pytest.skip("neither the CuTe DSL compiler nor prebuilt kernels ($KIMIK3_PREBUILT or prebuilt/)",
                allow_module_level=True)

pytestmark = pytest.mark.gpu
# exactly the exported variants (a prebuilt kernel has static shapes: the loader refuses any other batch)
CASES = megakernel_cases()
SMALL_BATCH = megakernel_cases("tiny")[0][1]  # the watchdog and timing tests' batch: a tiny variant that exists


def _bf16_model(preset: str, seed: int = 7) -> kimik3.KimiForCausalLM:
    """Built and initialised directly on the GPU (a k3-shard model is ~17 GB in bf16)."""
    return device_model(preset, seed=seed, dtype=torch.bfloat16, device="cuda")


class _Pairs:
    """(bf16 model, fp32 reference with the same bf16-rounded weights), one preset resident at a time."""

    def __init__(self) -> None:
        self.cache: dict[str, tuple] = {}

    def __call__(self, preset: str) -> tuple:
        if preset not in self.cache:
            self.cache.clear()
            torch.cuda.empty_cache()
            low = _bf16_model(preset)
            self.cache[preset] = (low, copy.deepcopy(low).cast_(torch.float32))
        return self.cache[preset]


@pytest.fixture(scope="module")
def pairs():
    p = _Pairs()
    yield p
    p.cache.clear()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _fp32_reference_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("preset,batch", CASES, ids=[f"{p}-b{b}" for p, b in CASES])
def test_matches_naive(pairs, preset: str, batch: int) -> None:
    low, ref = pairs(preset)
    steps = 6 if preset == "tiny" else 3
    r = compare_to_reference(low, "megakernel", batch, prompt_len=10 if preset == "tiny" else 5, steps=steps,
                             seed=batch, reference=ref)
    assert r.passed, r.as_dict()
    assert r.top1_agreement >= 0.9, r.as_dict()


def _state_after_prompt(model: kimik3.KimiForCausalLM, batch: int, max_len: int):
    dec = kimik3.Decoder(model, "naive", batch_size=batch, max_seq_len=max_len)
    ids = torch.randint(0, model.config.vocab_size, (batch, 4), generator=torch.Generator().manual_seed(3))
    dec.prefill(ids.cuda())
    return dec.stage.state, dec.lengths.clone()


def test_watchdog_unreachable_wait_sets_the_flag_and_returns(pairs) -> None:
    low, _ = pairs("tiny")
    batch, max_len = SMALL_BATCH, 16
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    p = build_program(low.config, batch, n_sms, max_seq_len=max_len)
    # plant the stall at the head of a queue, so its CTA is the first to spin (the first CTA to trip is recorded)
    v = next(i for i, x in enumerate(p.instructions) if x.waits and x.qpos == 0)
    c, _ = p.instructions[v].waits[0]
    p.instructions[v] = dataclasses.replace(p.instructions[v], waits=((c, p.counters[c].total + 1),
                                                                      *p.instructions[v].waits[1:]))
    stuck = {x.instr for x in check_program(p) if x.kind == "deadlock"}
    assert v in stuck  # the hazard checker agrees the program cannot finish
    runner = G.MegakernelRunner(low, batch, max_len, check=False, program=p, max_spins=1 << 14, sleep_ns=100)
    state, lens = _state_after_prompt(low, batch, max_len)
    runner.bind_state(state)
    ids = torch.zeros(batch, dtype=torch.long, device="cuda")
    t0 = time.perf_counter()
    with pytest.raises(G.MegakernelError, match="watchdog: instruction #") as err:
        runner.run_step(ids, lens)
    assert time.perf_counter() - t0 < 30, "the watchdog must end the launch"
    e = err.value
    assert e.code == G.ERR_WATCHDOG and e.instruction in stuck and 0 <= e.cta < n_sms
    if e.instruction == v:  # (a CTA stuck behind it could in principle have started spinning first)
        assert (e.counter, e.target) == (c, p.counters[c].total + 1) and e.seen <= p.counters[c].total
    with pytest.raises(RuntimeError, match="unusable"):
        runner.run_step(ids, lens)
    runner.reset_counters()
    assert runner.bufs.error.abs().sum().item() == 0


def test_timings_cover_every_instruction_and_steps_are_deterministic(pairs) -> None:
    low, _ = pairs("tiny")
    batch, max_len = SMALL_BATCH, 32
    runner = G.MegakernelRunner(low, batch, max_len)
    state, lens = _state_after_prompt(low, batch, max_len)
    saved = copy.deepcopy(state)
    ids = torch.arange(batch, device="cuda")
    runner.bind_state(state)
    a = runner.run_step(ids, lens).clone()
    t = runner.timings()
    assert t.shape == (runner.n, 3) and (t[:, 0] > 0).all() and (t[:, 1] >= t[:, 0]).all()
    # %smid is an SM identifier, not an index: PTX promises 0 <= %smid < %nsmid, and %nsmid may exceed the SM count
    # (ids need not be contiguous). One CTA per SM: the launch's distinct ids are at most the SM count.
    sms = t[:, 2].unique()
    assert (sms >= 0).all() and len(sms) <= torch.cuda.get_device_properties(0).multi_processor_count
    tl = runner.timeline()
    assert len(tl) == runner.n and tl["start_ns"].min() == 0
    assert torch.isfinite(a).all()
    runner.bind_state(saved)  # same state again, same counters base (step 1 now: targets move with the step)
    b = runner.run_step(ids, lens)
    assert torch.equal(a, b), "two launches on the same inputs must agree bit for bit"


def test_refuses_what_it_does_not_support(pairs) -> None:
    low, ref = pairs("tiny")
    with pytest.raises(ValueError, match="supports dtypes"):
        kimik3.Decoder(ref, "megakernel", batch_size=1, max_seq_len=16)
    with pytest.raises(ValueError, match="batch sizes"):
        kimik3.Decoder(low, "megakernel", batch_size=65, max_seq_len=16)
