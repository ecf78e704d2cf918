"""Stages "graphs" and "compiled": the absorbed step, captured or compiled.

* ``graphs`` captures the absorbed decode step once as a CUDA graph and replays it: one launch of a whole graph
  per token instead of hundreds of kernel launches. GPU only — on a CPU it refuses with a clear error.
* ``compiled`` is ``torch.compile`` of the absorbed step (on a GPU in "reduce-overhead" mode, which also uses
  CUDA graphs). It is the strongest PyTorch-only peer and stays in every benchmark table as the baseline to beat.

Both keep the absorbed stage's static state; prefill runs eagerly and copies into it in place.
"""

from __future__ import annotations

import torch

from kimik3.model import KimiForCausalLM
from kimik3.stages.absorbed import AbsorbedStage, decode_step
from kimik3.stages.base import StageSupport

__all__ = ["GraphsStage", "CompiledStage"]


class GraphsStage(AbsorbedStage):
    name = "graphs"
    support = StageSupport(dtypes=(torch.float32, torch.bfloat16, torch.float16), devices=("cuda",))

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"stage 'graphs' captures CUDA graphs and needs the model on a CUDA device "
                             f"(it is on {model.device.type}); use stage 'compiled' or 'absorbed' on a CPU")
        super().__init__(model, batch_size, max_seq_len)
        dev = model.device
        self.ids = torch.zeros(batch_size, dtype=torch.long, device=dev)  # static inputs the graph reads
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _capture(self) -> None:
        # warm up on a side stream (lazy inits, cuBLAS workspaces), then capture; the state is restored after,
        # because warm-up and capture both run the step and mutate it
        saved = [t.clone() for s in self.state.layers for t in vars(s).values()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                decode_step(self.model, self.state, self.ids, self.positions)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = decode_step(self.model, self.state, self.ids, self.positions)
        it = iter(saved)
        for s in self.state.layers:
            for t in vars(s).values():
                t.copy_(next(it))

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self._capture()
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits.clone()


_COMPILED: dict[tuple[str, bool], object] = {}


def compiled_decode_step(mode: str, dynamic: bool):
    """One compiled ``decode_step`` per mode, shared by every Decoder: the model and state are arguments, so a
    new Decoder with the same shapes reuses the compiled code instead of compiling again."""
    if (mode, dynamic) not in _COMPILED:
        _COMPILED[mode, dynamic] = torch.compile(decode_step, mode=mode, dynamic=dynamic)
    return _COMPILED[mode, dynamic]


class CompiledStage(AbsorbedStage):
    name = "compiled"

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, mode: str | None = None) -> None:
        super().__init__(model, batch_size, max_seq_len)
        if mode is None:
            mode = "reduce-overhead" if model.device.type == "cuda" else "default"
        self.mode = mode
        # CPU: symbolic batch size, so one compilation serves every batch size > 1 (compiling is the slow part
        # on a CPU); GPU: static shapes, as CUDA graphs need them anyway.
        self._step = compiled_decode_step(mode, dynamic=model.device.type != "cuda")

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self._step(self.model, self.state, ids, positions)
        return out.clone() if self.model.device.type == "cuda" else out
