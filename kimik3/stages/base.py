"""What every optimisation stage implements, and what it declares it supports.

A stage owns the decode state (caches) and turns token ids into fp32 logits. The :class:`kimik3.Decoder`
validates inputs and keeps the per-sequence lengths; stages can assume valid input. A stage refuses anything
outside what it declares (dtype, batch range, device) with a clear error — never a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.model.modeling import KimiForCausalLM

__all__ = ["Stage", "StageSupport"]


@dataclass(frozen=True)
class StageSupport:
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    min_batch: int = 1
    max_batch: int | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    deterministic: bool = True  # bitwise-identical outputs on identical inputs
    archs: tuple[str, ...] | None = None  # CUDA archs ("sm_90a", ...); None = any
    # formats of routed experts held quantized (model.expert_storage) that the stage reads; () = dense only
    kept_experts: tuple[str, ...] = ()

    def check(self, stage: str, model: KimiForCausalLM, batch_size: int) -> None:
        dev = model.device.type
        if dev not in self.devices:
            raise ValueError(f"stage {stage!r} runs on {'/'.join(self.devices)}, not on {dev}")
        if model.dtype not in self.dtypes:
            raise ValueError(f"stage {stage!r} supports dtypes {[str(d) for d in self.dtypes]}, got {model.dtype}")
        storage = getattr(model, "expert_storage", "dense")
        if storage != "dense" and storage not in self.kept_experts:
            raise ValueError(f"stage {stage!r} reads dense routed experts, but this model holds them as {storage} "
                             "(quantized_experts='keep'): call model.dequantize_experts() first "
                             f"({model.expert_memory()}) or load with quantized_experts='dequantize'; the stages "
                             "that read kept MXFP4 experts are 'naive' (one expert dequantised at a time), 'fused' "
                             "(expert_format='mxfp4'), 'megakernel-interp', 'megakernel' and 'megakernel-cpu' "
                             "(experts='mxfp4')")
        hi = self.max_batch if self.max_batch is not None else float("inf")
        if not self.min_batch <= batch_size <= hi:
            raise ValueError(f"stage {stage!r} supports batch sizes {self.min_batch}..{self.max_batch}, "
                             f"got {batch_size}")
        if self.archs is not None and dev == "cuda":
            major, minor = torch.cuda.get_device_capability(model.device)
            arch = f"sm_{major}{minor}a"
            if arch not in self.archs:
                raise ValueError(f"stage {stage!r} is built for {', '.join(self.archs)}; this GPU is {arch}")


class Stage:
    """Base class. Subclasses set ``name`` and ``support`` and implement ``reset``/``prefill``/``step``."""

    name: str = ""
    support = StageSupport()

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int) -> None:
        self.support.check(self.name, model, batch_size)
        self.model, self.batch_size, self.max_seq_len = model, batch_size, max_seq_len

    def reset(self) -> None:
        raise NotImplementedError

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] right-padded, lengths [B] -> fp32 logits [B, V] at each sequence's last prompt token."""
        raise NotImplementedError

    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [B] at absolute ``positions`` [B] (= tokens already cached) -> fp32 logits [B, V]."""
        raise NotImplementedError
