"""Stage "fused": one decode step composed of the CuTe DSL kernels in ``kernels/``, replayed as a CUDA graph.

The step itself is a plan (:class:`kimik3.fused.plan.FusedStep`: which kernel runs where, with what is fused into
which and the PyTorch glue left between them); its kernels come from the CuTe DSL JIT when it is installed, else
from verified prebuilt artefacts (:mod:`kimik3.fused.loading`), and run through
:class:`kimik3.fused.runners.KernelRunner`. This module is the stage around them: the static cache length, the
kernel source, graph capture. Nothing silently falls back to PyTorch: on a CPU, for a feature or shape no kernel
supports (e.g. ``micro``'s head dim 16) the stage's scope gate (:data:`kimik3.scope.gates.FUSED`) refuses with a
``ValueError`` giving every reason; without a usable kernel for this GPU's architecture the loader refuses. On a CPU
the composition is checked with each kernel replaced by its PyTorch reference (``tests/test_fused_stage.py``).

Design: docs/architecture.md (map: one decode step, end to end; how to add a stage).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kimik3.fused.loading import _prebuilt_cache_len, load_kernels
from kimik3.fused.plan import FusedStep
from kimik3.fused.runners import KernelRunner
from kimik3.kernels.toolchain.loader import KERNEL_SOURCES, PREBUILT_ENV, default_prebuilt_dir, resolve_source
from kimik3.model.modeling import KimiForCausalLM
from kimik3.scope.gates import FUSED
from kimik3.stages.base import Stage

__all__ = ["FusedStage"]


def _current_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


class FusedStage(Stage):
    """The fused decode step behind the common Decoder API (see the module docstring).

    Options: ``expert_format`` "bf16" | "mxfp4" (routed experts packed once at construction), ``kernels`` "auto" |
    "jit" | "prebuilt", ``prebuilt`` (directory; default ``$KIMIK3_PREBUILT`` or ``<repo>/prebuilt``),
    ``cache_len`` (static MLA cache length; default: the prebuilt kernel's, or max_seq_len rounded up to 256 for
    the JIT), ``graph`` (capture the step as a CUDA graph, default True).
    """

    name = "fused"
    support = FUSED

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, expert_format: str = "bf16",
                 kernels: str = "auto", prebuilt: str | os.PathLike | None = None, cache_len: int | None = None,
                 graph: bool = True) -> None:
        # the gate first (device, dtype, features, kernel shapes): a kernel that cannot exist is a clearer answer
        # than a missing file
        super().__init__(model, batch_size, cache_len or max_seq_len, experts=expert_format)
        if kernels not in KERNEL_SOURCES:
            raise ValueError(f"kernels must be one of {KERNEL_SOURCES}, got {kernels!r}")
        arch = _current_arch(model.device)
        directory = Path(prebuilt) if prebuilt is not None else None
        use_prebuilt = resolve_source(kernels, directory) == "prebuilt"
        if use_prebuilt and directory is None:
            directory = default_prebuilt_dir()
            if directory is None:
                raise ValueError("stage 'fused' found no kernels: the CuTe DSL is not installed here and no prebuilt "
                                 f"directory was given (prebuilt=DIR or ${PREBUILT_ENV}); build one on a machine "
                                 "with the DSL: python scripts/device_check.py --build-prebuilt DIR")
        if cache_len is None and not model.config.mla_layers:
            cache_len = max_seq_len  # no MLA cache to size
        if cache_len is None:
            if use_prebuilt:
                cache_len = _prebuilt_cache_len(directory, model.config, batch_size, arch, max_seq_len)
                if cache_len is None:
                    raise ValueError(f"stage 'fused' found no prebuilt MLA kernel with a cache of >= {max_seq_len} "
                                     f"tokens for {model.config.name or 'this config'} at batch {batch_size} in "
                                     f"{directory}")
            else:
                cache_len = max(256, -(-max_seq_len // 256) * 256)
        if cache_len < max_seq_len:
            raise ValueError(f"cache_len={cache_len} is shorter than max_seq_len={max_seq_len}")
        self.arch, self.kernel_source, self.prebuilt_dir = arch, ("prebuilt" if use_prebuilt else "jit"), directory
        self.fused = FusedStep(model, batch_size, cache_len, expert_format)
        fns = load_kernels(list(self.fused.ops.values()), arch, self.kernel_source, directory)
        self.fused.bind(KernelRunner(fns))
        self.use_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None

    def reset(self) -> None:
        self.fused.reset()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.fused.prefill(input_ids, lengths)

    def _capture(self) -> None:
        """Warm up on a side stream (loads every kernel module, so nothing loads during capture), restore the
        state the warm-up advanced, capture the program once."""
        saved = [t.clone() for t in self.fused.state_tensors()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                self.fused.run()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self.fused.state_tensors(), saved):
            t.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.fused.run()
        for t, s in zip(self.fused.state_tensors(), saved):
            t.copy_(s)

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.use_graph:
            return self.fused.step(ids, positions)
        if self.graph is None:
            self._capture()
        self.fused.set_inputs(ids, positions)
        self.graph.replay()
        return self.fused.logits.clone()
