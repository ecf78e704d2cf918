"""Stage-vs-reference comparisons with the rules of ``docs/validation.md`` (used by tests and the matrix).

* fp32 stage vs fp32 ``naive`` on the same weights: both decode greedily; per step ``e ≤ TOL["fp32_stage"]`` and
  identical greedy tokens.
* bf16 stage vs the fp32 reference on the same bf16-rounded weights: teacher-forced (both fed the reference's
  tokens); per step ``e ≤ TOL["bf16_stage"]``; the top-1 agreement rate is reported.

Prompts are fresh random ids, right-padded to mixed lengths; NaN/inf anywhere fails (``rel_error`` is inf). The
matrix runs the fp64 reference once per (preset, seed, dtype, batch, context) and compares every stage with that
stored run (:class:`ReferenceTrace`, :func:`compare_with_trace`): the same prompt, loop and rules as
:func:`compare_to_reference`, with every decode-state tensor of the stage poisoned before its prefill.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kimik3.decoder import Decoder
from kimik3.model.modeling import DecodeState, KDAState, KimiForCausalLM, MLACache, Router
from kimik3.stages.base import Stage
from kimik3.validation.metric import TOL, poison, rel_error

__all__ = [
    "StageComparison",
    "ReferenceTrace",
    "bf16_pair",
    "compare_to_reference",
    "run_stage",
    "compare_with_trace",
    "mixed_lengths",
    "poison_stage_state",
    "reference_trace",
]


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


# ---------------------------------------------------------------- a stored reference, shared by every stage


@dataclass
class ReferenceTrace:
    """The fp64 ``naive`` reference for one (model, batch, prompt, steps): its own greedy decode, teacher-forcing
    nothing. ``logits[s]`` [B, V] is step ``s`` (0 = prefill); ``tokens[s]`` its argmax (what every stage is fed)."""

    ids: torch.Tensor
    lengths: list[int]
    steps: int
    logits: list[torch.Tensor]
    reference: str
    routes: list[torch.Tensor] | None = None

    @property
    def tokens(self) -> list[torch.Tensor]:
        return [a.argmax(-1) for a in self.logits]

    @property
    def max_seq_len(self) -> int:
        return self.ids.shape[1] + self.steps + 1


@contextlib.contextmanager
def _record_routes(model: KimiForCausalLM) -> Iterator[list[torch.Tensor]]:
    """Record the expert ids every router call of ``model`` returns, in call order."""
    out: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: out.append(o[1].detach().sort(-1).values.cpu()))
             for m in model.modules() if isinstance(m, Router)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def _prompt(vocab: int, batch: int, prompt_len: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Exactly :func:`compare_to_reference`'s prompt for ``seed``: mixed lengths, ids from generator ``seed + 1``."""
    lengths = mixed_lengths(batch, prompt_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g), lengths


@torch.no_grad()
def reference_trace(ref_model: KimiForCausalLM, batch: int, prompt_len: int, steps: int, seed: int,
                    record_routes: bool = False) -> ReferenceTrace:
    """Run stage ``naive`` on ``ref_model`` (the fp64 oracle) greedily, as :func:`compare_to_reference` does."""
    ids, lengths = _prompt(ref_model.config.vocab_size, batch, prompt_len, seed)
    dec = Decoder(ref_model, "naive", batch_size=batch, max_seq_len=prompt_len + steps + 1)
    with _record_routes(ref_model) if record_routes else contextlib.nullcontext() as routes:
        a = dec.prefill(ids.to(ref_model.device), lengths)
        logits = [a]
        for _ in range(steps):
            a = dec.step(a.argmax(-1))
            logits.append(a)
    return ReferenceTrace(ids, lengths, steps, [x.cpu() for x in logits],
                          f"naive {str(ref_model.dtype).replace('torch.', '')}", routes if record_routes else None)


def poison_stage_state(stage: Stage) -> int:
    """NaN-fill every decode-state tensor ``stage`` holds (its ``DecodeState`` attributes, and those of stages it
    wraps). A correct stage (re)writes all state its prefill reads; one that relies on zero-initialised buffers
    it never reset reads NaN and fails. Returns how many tensors were poisoned."""
    seen: set[int] = set()
    n = 0

    def visit(obj: Any, depth: int) -> None:
        nonlocal n
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        if isinstance(obj, DecodeState):
            for s in obj.layers:
                for t in ((s.S, s.conv) if isinstance(s, KDAState) else (s.latent, s.k_r) if isinstance(s, MLACache)
                          else ()):
                    poison(t)
                    n += 1
        elif isinstance(obj, Stage):
            for v in vars(obj).values():
                if isinstance(v, (DecodeState, Stage)):
                    visit(v, depth + 1)

    visit(stage, 0)
    return n


class _Refused(Exception):
    """A stage refused to build (``ValueError`` from its constructor): the cell is not run, with the message."""


@torch.no_grad()
def run_stage(model: KimiForCausalLM, stage: str, trace: ReferenceTrace, stop_on_token_mismatch: bool,
               routes: list[torch.Tensor] | None = None, **stage_options: Any
               ) -> tuple[StageComparison, list[torch.Tensor], int]:
    """The loop of :func:`compare_to_reference` against a stored reference; also returns the stage's logits per
    step and how many state tensors were poisoned before its prefill."""
    bf16 = model.dtype == torch.bfloat16
    B = trace.ids.shape[0]
    try:
        dut = Decoder(model, stage, batch_size=B, max_seq_len=trace.max_seq_len, **stage_options)
    except ValueError as e:
        raise _Refused(str(e)) from e
    poisoned = poison_stage_state(dut.stage)
    res = StageComparison(stage=stage, dtype=str(model.dtype).replace("torch.", ""), batch_size=B,
                          prompt_lengths=list(trace.lengths), steps=trace.steps,
                          mode="teacher-forced" if bf16 else "greedy",
                          tolerance=TOL["bf16_stage"] if bf16 else TOL["fp32_stage"], reference=trace.reference)
    outs: list[torch.Tensor] = []
    with _record_routes(model) if routes is not None else contextlib.nullcontext() as rec:
        b = dut.prefill(trace.ids.to(model.device), trace.lengths)
        agree = []
        for s in range(trace.steps + 1):
            a = trace.logits[s]
            outs.append(b.detach().cpu())
            res.errors.append(rel_error(b, a))
            ref_tok, dut_tok = a.argmax(-1), b.float().argmax(-1).cpu()
            agree.append((ref_tok == dut_tok).float().mean().item())
            if not bf16 and not torch.equal(ref_tok, dut_tok):
                res.tokens_equal = False
                if stop_on_token_mismatch:
                    break
            if s < trace.steps:
                b = dut.step(ref_tok.to(model.device))
    if routes is not None:
        routes.extend(rec)
    res.top1_agreement = sum(agree) / len(agree)
    return res, outs, poisoned


def compare_with_trace(model: KimiForCausalLM, stage: str, trace: ReferenceTrace, **stage_options: Any
                       ) -> StageComparison:
    """:func:`kimik3.validation.compare_to_reference` with the reference run taken from ``trace`` (same prompt,
    same loop, same rules): what lets one fp64 reference run serve every stage."""
    return run_stage(model, stage, trace, True, **stage_options)[0]
