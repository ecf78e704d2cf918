"""Stages "graphs" and "compiled": the absorbed step, captured or compiled (docs/architecture.md, map).

* ``graphs`` captures the absorbed decode step once as a CUDA graph and replays it: one graph launch per token
  instead of hundreds of kernel launches. GPU only — on a CPU it refuses with a clear error.
* ``compiled`` is ``torch.compile`` of the absorbed step (on a GPU in "reduce-overhead" mode, with CUDA graphs),
  the strongest PyTorch-only peer and the baseline of every benchmark table. ``freeze=True`` compiles one step per
  Decoder with the weights as constants (Inductor "freezing"), the recommended CPU inference recipe and, with
  ``mode="max-autotune-no-cudagraphs"``, what the benchmark uses on a CPU; it costs minutes of compilation and the
  weights must not change afterwards (a frozen Decoder keeps the old values).

Both keep the absorbed stage's static state; prefill runs eagerly and copies into it in place.
"""

from __future__ import annotations

import functools

import torch

from kimik3.model.modeling import KimiForCausalLM
from kimik3.stages.absorbed import AbsorbedStage, decode_step
from kimik3.stages.base import StageSupport

__all__ = ["GraphsStage", "CompiledStage", "COMPILE_MODES"]


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


_COMPILED: dict[tuple, object] = {}


def _inductor_options(mode: str, extra: dict | None) -> dict:
    from torch._inductor import list_mode_options  # torch.compile takes a mode or options, not both

    return {**list_mode_options(mode), **(extra or {})}


def compiled_decode_step(mode: str, dynamic: bool, inductor_options: dict | None = None):
    """One compiled ``decode_step`` per setting, shared by every Decoder: the model and state are arguments, so a
    new Decoder with the same shapes reuses the compiled code instead of compiling again."""
    key = (mode, dynamic, tuple(sorted((inductor_options or {}).items())))
    if key not in _COMPILED:
        if inductor_options:
            _COMPILED[key] = torch.compile(decode_step, dynamic=dynamic,
                                           options=_inductor_options(mode, inductor_options))
        else:
            _COMPILED[key] = torch.compile(decode_step, mode=mode, dynamic=dynamic)
    return _COMPILED[key]


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class CompiledStage(AbsorbedStage):
    """``mode``: a torch.compile mode (default: "reduce-overhead" on a GPU, "default" on a CPU); ``freeze``: weights
    as compile-time constants (see the module docstring); ``inductor_options``: extra Inductor settings, e.g.
    ``{"cpp_wrapper": True}`` (a C++ instead of a Python wrapper around the generated kernels: less per-step
    overhead on a CPU, longer compilation)."""

    name = "compiled"

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, mode: str | None = None,
                 freeze: bool = False, inductor_options: dict | None = None) -> None:
        super().__init__(model, batch_size, max_seq_len)
        if mode is None:
            mode = "reduce-overhead" if model.device.type == "cuda" else "default"
        if mode not in COMPILE_MODES:
            raise ValueError(f"stage 'compiled': unknown torch.compile mode {mode!r}; choose from {COMPILE_MODES}")
        import torch._inductor.config as inductor_config

        unknown = [k for k in (inductor_options or {}) if not hasattr(inductor_config, k.split(".")[0])]
        if unknown:
            raise ValueError(f"stage 'compiled': unknown Inductor options {unknown}")
        self.mode, self.freeze, self.inductor_options = mode, bool(freeze), dict(inductor_options or {})
        self._inductor_config = inductor_config
        if self.freeze:
            # the model is a constant of this compilation, not an argument: Inductor can then pre-pack its
            # weights; one compilation per Decoder (a shared one would bake in another model's weights).
            # A closure, not functools.partial: Dynamo then sees the model as a constant.
            self._step = torch.compile(lambda state, ids, pos: decode_step(model, state, ids, pos),
                                       options={**_inductor_options(mode, self.inductor_options), "freezing": True})
        else:
            # CPU: symbolic batch size, so one compilation serves every batch size > 1 (compiling is the slow part
            # on a CPU); GPU: static shapes, as CUDA graphs need them anyway.
            self._step = functools.partial(
                compiled_decode_step(mode, model.device.type != "cuda", self.inductor_options or None), model)

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.freeze:
            # Dynamo reads the global flag while tracing (to mark parameters static); options= only reaches
            # Inductor — so the flag is set around every call (tracing happens on the first, or on a recompile)
            with self._inductor_config.patch(freezing=True):
                out = self._step(self.state, ids, positions)
        else:
            out = self._step(self.state, ids, positions)
        return out.clone() if self.model.device.type == "cuda" else out
