"""The CPU megakernel interpreter reproduces the naive stage under random interleavings of the SM queues.

Expectation source: stage ``naive`` (the model's own eager code) on the same fp32 weights, teacher-forced on
naive's own greedy tokens; tolerance TOL["fp32_stage"] per step, identical greedy tokens (both the argmax of the
returned logits and the program's own ARGMAX output). Scratch buffers and logits are poisoned (NaN) by the
interpreter before every step, so anything the program fails to write fails the comparison.

Interleavings: decode step ``i`` of a run with seed ``s`` runs under its own random interleaving (seed
``s·1000003 + i``); only the program's declared waits constrain it. The program is deterministic (every element
is produced by one instruction, in a fixed order), so every interleaving must give *bitwise* the same logits.

CI matrix (``micro``; batch 1, 4, 33 with ragged prompts; both policies; 20 interleaving seeds per case):
seed 0 decodes all 32 steps and is compared with naive; seeds 1–19 each replay 4 of those steps — steps 0–1 from
the post-prefill state and steps 24–25 from seed 0's state at step 24 (by then the second MLA context split is
live) — and must equal seed 0 bit for bit (each replayed step is a further random interleaving).
The full matrix — every seed decoding all 32 steps against naive, ``micro`` and ``tiny`` — runs under ``slow``.
A bf16 case (both policies) runs the weight-stage pipeline, which fp32 programs never use (the stage holds bf16):
within TOL["bf16_stage"] of fp32 naive, bitwise equal across interleavings.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kimik3
import kimik3.megakernel.interp_ranks  # noqa: F401  (registers stage "megakernel-interp")
from kimik3.megakernel.scheduler import POLICIES
from kimik3.validation.metric import TOL, rel_error

STEPS = 32
SEEDS = 20
CI_REPLAY = ((0, 2), (24, 2))  # (first step, steps) windows each CI seed replays
NUM_SMS = 4
BATCHES = (1, 4, 33)


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see tests/conftest.py


def _lengths(B: int) -> list[int]:
    return [5 - (b % 4) for b in range(B)]  # ragged prompts: every sequence decodes at its own positions


@functools.lru_cache(maxsize=8)
def reference(preset: str, B: int):
    """Model, prompt, naive's greedy tokens fed at each step, and naive's logits after each step."""
    model = kimik3.from_preset(preset, seed=0)
    lengths = _lengths(B)
    g = torch.Generator().manual_seed(100 + B)
    ids = torch.randint(0, model.config.vocab_size, (B, max(lengths)), generator=g)
    dec = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=max(lengths) + STEPS + 1)
    logits = dec.prefill(ids, lengths)
    fed, out = [], []
    for _ in range(STEPS):
        fed.append(logits.argmax(-1))
        logits = dec.step(fed[-1])
        out.append(logits)
    return model, ids, lengths, fed, out


def run_case(preset: str, B: int, policy: str, seeds: int, replay: tuple[tuple[int, int], ...]) -> None:
    """Seed 0 decodes STEPS steps against naive; seeds 1.. replay the (start, count) windows of ``replay``
    from seed 0's state at ``start`` and must reproduce seed 0 bitwise (and naive within tolerance)."""
    model, ids, lengths, fed, ref = reference(preset, B)
    dec = kimik3.Decoder(model, "megakernel-interp", batch_size=B, max_seq_len=max(lengths) + STEPS + 1,
                         policy=policy, num_sms=NUM_SMS, seed=0)
    dec.prefill(ids, lengths)
    stage = dec.stage
    starts = {start for start, _ in replay}
    snapshots, first = {}, []
    for s in range(STEPS):
        if s in starts:
            snapshots[s] = stage.snapshot()
        logits = dec.step(fed[s])
        e = rel_error(logits, ref[s])
        assert e <= TOL["fp32_stage"], f"{preset} B={B} {policy} step {s}: e={e:.2e}"
        want = ref[s].argmax(-1)
        assert torch.equal(logits.argmax(-1), want), f"step {s}: greedy tokens differ"
        assert torch.equal(stage.interpreter.tensors["next_token"][:, 0, 0], want), f"step {s}: ARGMAX output"
        first.append(logits)
    pos0 = torch.tensor(lengths)
    for seed in range(1, seeds):
        for start, count in replay:
            stage.restore(snapshots[start], seed=seed * 1000 + start)
            for s in range(start, start + count):
                logits = stage.step(fed[s], pos0 + s)
                assert torch.equal(logits, first[s]), f"{preset} B={B} {policy} seed {seed} step {s}: not " \
                                                      "bitwise equal to seed 0"
                assert rel_error(logits, ref[s]) <= TOL["fp32_stage"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("B", BATCHES)
def test_micro_matches_naive_under_interleavings(B, policy):
    run_case("micro", B, policy, SEEDS, CI_REPLAY)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("preset", ["micro", "tiny"])
def test_full_matrix_matches_naive(preset, B, policy):
    run_case(preset, B, policy, SEEDS, ((0, STEPS),))


def test_decoder_generate_matches_naive():
    model = kimik3.from_preset("micro", seed=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(7))
    want = kimik3.Decoder(model, "naive", batch_size=2, max_seq_len=20).generate(ids, max_new_tokens=10,
                                                                                 lengths=[6, 3])
    got = kimik3.Decoder(model, "megakernel-interp", batch_size=2, max_seq_len=20, num_sms=3,
                         policy="round_robin").generate(ids, max_new_tokens=10, lengths=[6, 3])
    assert torch.equal(got, want)


def test_stage_refuses_what_it_does_not_support():
    model = kimik3.from_preset("micro", seed=0)
    with pytest.raises(ValueError, match="batch sizes"):
        kimik3.Decoder(model, "megakernel-interp", batch_size=65, max_seq_len=8)
    with pytest.raises(ValueError, match="unknown policy"):
        kimik3.Decoder(model, "megakernel-interp", batch_size=1, max_seq_len=8, policy="fastest")


def test_interpreter_keeps_state_in_the_shared_decode_state():
    """The program updates the model's own DecodeState in place (KDA S and conv, MLA cache), so prefill through
    naive and decode through the program continue one another."""
    model, ids, lengths, fed, ref = reference("micro", 4)
    dec = kimik3.Decoder(model, "megakernel-interp", batch_size=4, max_seq_len=max(lengths) + STEPS + 1,
                         num_sms=NUM_SMS)
    dec.prefill(ids, lengths)
    st = dec.stage.naive.state
    before = [(s.S.clone() if hasattr(s, "S") else s.latent.clone()) for s in st.layers]
    dec.step(fed[0])
    after = [(s.S if hasattr(s, "S") else s.latent) for s in dec.stage.naive.state.layers]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    steps = dec.stage.interpreter.steps_done
    assert all(c == steps * ctr.total for c, ctr in zip(dec.stage.interpreter.counters, dec.stage.program.counters))


@pytest.mark.parametrize("policy", POLICIES)
def test_bf16_program_with_the_weight_stage_matches_naive(policy):
    """bf16: the weights qualify for the shared-memory stage, so every step runs the cross-instruction stage
    pipeline (each stage copy performed when the device would issue it). Teacher-forced on fp32 naive's greedy
    tokens, every step within TOL["bf16_stage"] of fp32 naive, and other interleavings bitwise equal."""
    B, steps, lengths = 4, 4, [5, 4, 3, 5]
    model = kimik3.from_preset("micro", seed=0, dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (B, 5), generator=torch.Generator().manual_seed(3))
    ref = kimik3.Decoder(kimik3.from_preset("micro", seed=0), "naive", batch_size=B, max_seq_len=16)
    dec = kimik3.Decoder(model, "megakernel-interp", batch_size=B, max_seq_len=16, policy=policy, num_sms=NUM_SMS)
    want = ref.prefill(ids, lengths)
    dec.prefill(ids, lengths)
    stage = dec.stage
    start = stage.snapshot()
    staged = sum(ins.stage[0] >= 0 for ins in stage.program.instructions)
    assert staged > len(stage.program.instructions) // 2
    fed, first = [], []
    for s in range(steps):
        fed.append(want.argmax(-1))
        want = ref.step(fed[-1])
        got = dec.step(fed[-1])
        assert stage.interpreter.staged_copies == staged
        assert rel_error(got, want) <= TOL["bf16_stage"], f"step {s}: e={rel_error(got, want):.2e}"
        first.append(got)
    for seed in (1, 2):
        stage.restore(start, seed=seed)
        for s in range(steps):
            assert torch.equal(stage.step(fed[s], torch.tensor(lengths) + s), first[s]), f"seed {seed} step {s}"
