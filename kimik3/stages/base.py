"""What every optimisation stage implements, and what it declares it supports.

A stage owns the decode state (caches) and turns token ids into fp32 logits. The :class:`kimik3.Decoder`
validates inputs and keeps the per-sequence lengths; stages can assume valid input. A stage refuses anything
outside what its scope gate declares (dtype, batch range, device; for a fast path, the config's features too:
docs/architecture.md §13) with every reason in one error — never a silent fallback.
"""

from __future__ import annotations

from typing import Any

import torch

from kimik3.model.modeling import KimiForCausalLM
from kimik3.scope.spec import ScopeSpec

__all__ = ["Stage", "StageSupport"]


# What a stage supports is its scope gate (kimik3/scope/spec.py): the reference stages declare dtypes, devices and
# batch widths and run every feature the model implements; the fast paths' gates list features too
# (kimik3/scope/gates.py). The stages have always called it StageSupport.
StageSupport = ScopeSpec


class Stage:
    """Base class. Subclasses set ``name`` and ``support`` and implement ``reset``/``prefill``/``step``."""

    name: str = ""
    support = StageSupport()

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, **request: Any) -> None:
        """Builds only through the stage's gate: ``request`` adds what the stage's options ask of it (``experts``,
        ``world``, ``sms``) to the model's dtype, device and expert storage."""
        self.support.check(self.name, model, batch_size, max_seq_len, **request)
        self.model, self.batch_size, self.max_seq_len = model, batch_size, max_seq_len

    def reset(self) -> None:
        raise NotImplementedError

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] right-padded, lengths [B] -> fp32 logits [B, V] at each sequence's last prompt token."""
        raise NotImplementedError

    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [B] at absolute ``positions`` [B] (= tokens already cached) -> fp32 logits [B, V]."""
        raise NotImplementedError
