"""The part every megakernel stage that runs a program on a runner shares (stages ``megakernel-cpu`` and
``megakernel``): prefill through the naive path, then the decode state handed to the runner, which updates it in
place step by step. Design: docs/architecture.md (map: how a stage runs a megakernel program).
"""

from __future__ import annotations

import copy
from typing import Any

import pandas as pd
import torch

from kimik3.model.modeling import DecodeState
from kimik3.stages.base import Stage

__all__ = ["ProgramStage"]


class ProgramStage(Stage):
    """A stage whose decode steps run on ``self.runner`` (``bind_state``, ``reset_counters``, ``run_step``,
    ``timings``, ``timeline``) over the state ``self.naive`` (a naive stage) prefilled; subclasses construct both
    and may override :meth:`_run` to pass runner options."""

    runner: Any
    naive: Any

    def _bind(self) -> None:
        self.runner.bind_state(self.naive.state)  # prefill re-allocates the state: new addresses
        self.runner.reset_counters()

    def reset(self) -> None:
        self.naive.reset()
        self._bind()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        logits = self.naive.prefill(input_ids, lengths)  # the reference path
        self._bind()
        return logits

    def snapshot(self) -> DecodeState:
        return copy.deepcopy(self.naive.state)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.runner.run_step(ids, positions)

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._run(ids, positions).clone()

    @property
    def timings(self) -> torch.Tensor:
        """The last step's ``[N, 3]`` timing buffer (start ns, end ns, worker or SM id)."""
        return self.runner.timings()

    def timeline(self) -> pd.DataFrame:
        return self.runner.timeline()
