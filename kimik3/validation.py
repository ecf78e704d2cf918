"""Stage-vs-reference comparisons with the rules of ``shared/spec/validation.md`` (used by tests and ``validate``).

* fp32 stage vs fp32 ``naive`` on the same weights: both decode greedily; per step ``e ≤ TOL["fp32_stage"]`` and
  identical greedy tokens.
* bf16 stage vs the fp32 reference on the same bf16-rounded weights: teacher-forced (both fed the reference's
  tokens); per step ``e ≤ TOL["bf16_stage"]``; the top-1 agreement rate is reported.

Prompts are fresh random ids, right-padded to mixed lengths; NaN/inf anywhere fails (``rel_error`` is inf).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch

from kimik3.decoder import Decoder
from kimik3.model import KimiForCausalLM
from kimik3.tolerances import TOL, rel_error

__all__ = ["StageComparison", "compare_to_reference", "mixed_lengths", "bf16_pair"]


@dataclass
class StageComparison:
    stage: str
    dtype: str
    batch_size: int
    prompt_lengths: list[int]
    steps: int
    mode: str  # "greedy" (fp32) or "teacher-forced" (bf16)
    tolerance: float
    errors: list[float] = field(default_factory=list)
    tokens_equal: bool = True
    top1_agreement: float = 1.0
    reference: str = "naive fp32"

    @property
    def max_error(self) -> float:
        return max(self.errors) if self.errors else float("inf")

    @property
    def passed(self) -> bool:
        ok = self.max_error <= self.tolerance
        return ok and (self.tokens_equal if self.mode == "greedy" else True)

    def as_dict(self) -> dict:
        return {**asdict(self), "max_error": self.max_error, "passed": self.passed}


def mixed_lengths(batch_size: int, max_len: int, seed: int = 0) -> list[int]:
    """Right-padded prompt lengths in [max_len // 2, max_len], the first row always full length."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, max_len // 2), max_len + 1, (batch_size,), generator=g).tolist()
    lens[0] = max_len
    return lens


def bf16_pair(model: KimiForCausalLM) -> tuple[KimiForCausalLM, KimiForCausalLM]:
    """(bf16 model, fp32 reference holding exactly the bf16-rounded weights)."""
    low = copy.deepcopy(model).cast_(torch.bfloat16)
    ref = copy.deepcopy(low).cast_(torch.float32)
    return low, ref


@torch.no_grad()
def compare_to_reference(model: KimiForCausalLM, stage: str, batch_size: int, prompt_len: int, steps: int,
                         seed: int = 0, reference: KimiForCausalLM | None = None, lengths: list[int] | None = None,
                         **stage_options) -> StageComparison:
    """Run ``stage`` on ``model`` and ``naive`` on ``reference`` (default: ``model`` itself) side by side."""
    ref_model = reference if reference is not None else model
    bf16 = model.dtype == torch.bfloat16
    lengths = lengths or mixed_lengths(batch_size, prompt_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), generator=g)
    max_len = prompt_len + steps + 1
    ref = Decoder(ref_model, "naive", batch_size=batch_size, max_seq_len=max_len)
    dut = Decoder(model, stage, batch_size=batch_size, max_seq_len=max_len, **stage_options)
    res = StageComparison(stage=stage, dtype=str(model.dtype).replace("torch.", ""), batch_size=batch_size,
                          prompt_lengths=list(lengths), steps=steps, mode="teacher-forced" if bf16 else "greedy",
                          tolerance=TOL["bf16_stage"] if bf16 else TOL["fp32_stage"],
                          reference=f"naive {str(ref_model.dtype).replace('torch.', '')}")
    a = ref.prefill(ids.to(ref_model.device), lengths)
    b = dut.prefill(ids.to(model.device), lengths)
    agree = []
    for s in range(steps + 1):
        res.errors.append(rel_error(b, a))
        ref_tok, dut_tok = a.argmax(-1), b.float().argmax(-1).to(a.device)
        agree.append((ref_tok == dut_tok).float().mean().item())
        if not bf16 and not torch.equal(ref_tok, dut_tok):
            res.tokens_equal = False
            break
        if s < steps:
            a = ref.step(ref_tok)
            b = dut.step(ref_tok.to(model.device))  # greedy tokens are equal so far; in bf16: teacher forcing
    res.top1_agreement = sum(agree) / len(agree)
    return res
