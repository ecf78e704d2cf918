"""Smoke programs: one opcode family of one layer as a program of its own. Each is a valid program (the hazard
checker accepts it, it keeps only its family's instructions), the CPU megakernel and the interpreter agree on
every box it writes from the same inputs, and a wrong value in one box is named."""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.megakernel.cpu import CPUMegakernel
from kimik3.megakernel.hazards import check_program
from kimik3.megakernel.interpreter import CPUInterpreter
from kimik3.megakernel.smoke import FAMILIES, compare_smoke, smoke_families, smoke_program, smoke_run


@pytest.fixture(scope="module")
def tiny() -> kimik3.KimiForCausalLM:
    return kimik3.from_preset("tiny", dtype=torch.float32)


def test_the_tiny_step_has_every_family() -> None:
    assert smoke_families("tiny") == list(FAMILIES)
    with pytest.raises(ValueError, match="unknown smoke family"):
        smoke_program("tiny", 1, 4, "nope")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_smoke_program_runs_alike_on_the_cpu_megakernel_and_the_interpreter(tiny: kimik3.KimiForCausalLM,
                                                                             family: str) -> None:
    p = smoke_program(tiny.config, 1, 4, family, act_dtype=torch.float32)
    assert p.instructions and {i.op for i in p.instructions} <= set(FAMILIES[family])
    assert len({i.layer for i in p.instructions}) == 1
    assert not check_program(p)
    want = smoke_run(CPUInterpreter(p, tiny), tiny, seed=1)
    cm = CPUMegakernel(tiny, 1, p.max_seq_len, program=p, pin=False, timeout_s=20.0)
    try:
        got = smoke_run(cm, tiny, seed=1)
    finally:
        cm.close()
    assert compare_smoke(got, want, 1e-4) == []
    assert any(w.abs().sum() > 0 for w in want.values())  # the family computed something from its inputs
    k = next(iter(got))
    bad = {**got, k: got[k] + 1.0}
    assert compare_smoke(bad, want, 1e-4)[0].startswith(f"{k}: rel err")
    assert compare_smoke({**got, k: got[k] * float("nan")}, want, 1e-4) == [f"{k}: NaN"]
