"""Every rejected public Decoder call leaves the decoder exactly as it was, on every stage this machine runs.

Before each bad call the test takes a deep snapshot of everything the Decoder and its stage hold (every tensor
cloned, every plain value copied, walking through containers and the package's state objects; the model's weights
are shared and excluded), then compares bit for bit (NaN-aware) after the ``ValueError``. The decoder must also
still continue correctly: its next step equals that of a twin that never saw the bad calls. GPU stages are
covered by the same test in the device check."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kimik3

# the stages that run on a CPU (the GPU stages — graphs, fused, megakernel — run this test in the device check)
CPU_STAGES = ["naive", "absorbed", "compiled", "megakernel-interp"]
# stages whose step compiles on first use (minutes on a CPU): their state is brought to the edge by prefill alone
COMPILES_STEP = {"compiled"}
MAX_LEN = 8
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [11, 12, 13, 14, 15, 16, 0, 0]])
LENGTHS = [7, 5]  # + one step -> [8, 6]: the longer row is at max_seq_len, so a further step refuses
EDGE = [8, 6]  # the same state reached by prefill alone


def snapshot(obj, skip: set[int], path: str = "dec", seen: dict | None = None, out: dict | None = None) -> dict:
    """{path: cloned tensor or plain value} for everything reachable from obj (but the model's parameters)."""
    seen = {} if seen is None else seen
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        if id(obj) not in skip:
            out[path] = obj.detach().clone()
        return out
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        out[path] = obj
        return out
    if id(obj) in seen or isinstance(obj, torch.nn.Module) and id(obj) in skip:
        return out
    seen[id(obj)] = True
    if isinstance(obj, dict):
        for k, v in obj.items():
            snapshot(v, skip, f"{path}[{k!r}]", seen, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            snapshot(v, skip, f"{path}[{i}]", seen, out)
    elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("kimik3"):
        for k, v in vars(obj).items():
            snapshot(v, skip, f"{path}.{k}", seen, out)
    return out


def assert_same(before: dict, after: dict, what: str) -> None:
    assert before.keys() == after.keys(), f"{what}: state entries changed: {before.keys() ^ after.keys()}"
    for k, a in before.items():
        b = after[k]
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {k} changed shape/dtype"
            assert torch.equal(torch.nan_to_num(a, 1.25), torch.nan_to_num(b, 1.25)) and \
                torch.equal(a.isnan(), b.isnan()), f"{what}: {k} changed"
        elif isinstance(a, float) and math.isnan(a):
            assert isinstance(b, float) and math.isnan(b), f"{what}: {k} changed"
        else:
            assert a == b, f"{what}: {k} changed from {a!r} to {b!r}"


BAD_CALLS = {
    "prefill: wrong batch": lambda d: d.prefill(torch.tensor([[1, 2, 3]])),
    "prefill: 1-d ids": lambda d: d.prefill(torch.tensor([1, 2])),
    "prefill: float ids": lambda d: d.prefill(PROMPT.float()),
    "prefill: id past vocab": lambda d: d.prefill(torch.tensor([[1, 2], [3, 10**6]])),
    "prefill: negative id": lambda d: d.prefill(torch.tensor([[1, -2], [3, 4]])),
    "prefill: empty prompt": lambda d: d.prefill(torch.zeros(2, 0, dtype=torch.long)),
    "prefill: lengths shape": lambda d: d.prefill(PROMPT, lengths=[6]),
    "prefill: length 0": lambda d: d.prefill(PROMPT, lengths=[6, 0]),
    "prefill: length past width": lambda d: d.prefill(PROMPT, lengths=[6, 9]),
    "prefill: float lengths": lambda d: d.prefill(PROMPT, lengths=[5.5, 4.0]),
    "prefill: past max_seq_len": lambda d: d.prefill(torch.ones(2, MAX_LEN + 1, dtype=torch.long)),
    "step: wrong batch": lambda d: d.step(torch.tensor([1])),
    "step: 2-d ids": lambda d: d.step(torch.tensor([[1], [2]])),
    "step: id past vocab": lambda d: d.step(torch.tensor([1, 10**6])),
    "step: float ids": lambda d: d.step(torch.tensor([1.0, 2.0])),
    "step: past max_seq_len": lambda d: d.step(torch.tensor([1, 2])),
    "generate: negative count": lambda d: d.generate(PROMPT, -1),
    "generate: bool count": lambda d: d.generate(PROMPT, True),
    "generate: past max_seq_len": lambda d: d.generate(PROMPT, MAX_LEN),
    "generate: bad lengths": lambda d: d.generate(PROMPT, 1, lengths=[6, 9]),
    "generate: id past vocab": lambda d: d.generate(torch.tensor([[1, 10**6], [1, 2]]), 1),
}


def stage_options(name: str) -> dict:
    return {"compiled": {"mode": "default"}}.get(name, {})


@pytest.fixture(scope="module")
def model():
    return kimik3.from_preset("micro", seed=0)


def bring_to_edge(dec: kimik3.Decoder, stage: str) -> torch.Tensor:
    """Prefill (and step) so the longer row sits at max_seq_len; returns the last logits."""
    if stage in COMPILES_STEP:
        return dec.prefill(PROMPT, lengths=EDGE)
    dec.prefill(PROMPT, lengths=LENGTHS)
    return dec.step(torch.tensor([3, 4]))


@pytest.mark.parametrize("stage", CPU_STAGES)
def test_rejected_calls_change_nothing(model, stage):
    try:
        dec = kimik3.Decoder(model, stage, batch_size=2, max_seq_len=MAX_LEN, **stage_options(stage))
    except ValueError as e:
        pytest.skip(f"stage {stage!r} does not run here: {e}")
    skip = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()} | {id(model)}
    first = bring_to_edge(dec, stage)
    assert dec.lengths.tolist() == EDGE
    for what, call in BAD_CALLS.items():
        before = snapshot(dec, skip)
        with pytest.raises(ValueError):
            call(dec)
        assert_same(before, snapshot(dec, skip), f"{stage}: {what}")
    # still the same decoder: starting over gives what it gave before the bad calls
    torch.testing.assert_close(bring_to_edge(dec, stage), first, rtol=0, atol=0)


def test_step_before_prefill_changes_nothing(model):
    dec = kimik3.Decoder(model, "naive", batch_size=2, max_seq_len=MAX_LEN)
    skip = {id(p) for p in model.parameters()} | {id(model)}
    before = snapshot(dec, skip)
    with pytest.raises(ValueError, match="before prefill"):
        dec.step(torch.tensor([1, 2]))
    assert_same(before, snapshot(dec, skip), "step before prefill")
