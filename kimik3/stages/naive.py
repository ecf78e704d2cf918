"""Stage "naive": the model's own eager code, the obvious way.

Prefill runs token by token through the same per-token path as decode (padding rows masked out); MLA
re-expands every cached latent into per-head keys and values each step; MoE loops in Python over the
experts actually selected. Slow on purpose: it is the reference every other stage is compared with.
"""

from __future__ import annotations

import torch

from kimik3.model.modeling import acc_dtype
from kimik3.stages.absorbed import copy_state_
from kimik3.stages.base import Stage, StageSupport

__all__ = ["NaiveStage"]


class NaiveStage(Stage):
    name = "naive"
    # fp64 too: the validation suite's oracle is this stage run in float64; routed experts held as MXFP4 are
    # dequantised one selected expert at a time (MoE.expert), to the values a dequantising load stores
    support = StageSupport(dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
                           kept_experts=("mxfp4",))

    def __init__(self, model, batch_size: int, max_seq_len: int, prefill: str = "token") -> None:
        if prefill not in ("token", "chunked"):
            raise ValueError(f"naive prefill must be 'token' or 'chunked', got {prefill!r}")
        super().__init__(model, batch_size, max_seq_len)
        self.prefill_mode = prefill  # "chunked": the model's full-sequence forward (fills long contexts fast)

    def reset(self) -> None:
        self.state = self.model.new_state(self.batch_size, self.max_seq_len)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.reset()
        B, T = input_ids.shape
        if self.prefill_mode == "chunked":
            pos = torch.arange(T, device=input_ids.device).expand(B, T)
            tmp = self.model.new_state(B, T)
            logits = self.model.forward_tokens(input_ids, tmp, pos, pos < lengths[:, None])
            copy_state_(self.state, tmp)
            return logits[torch.arange(B, device=input_ids.device), lengths - 1]
        out = torch.full((B, self.model.config.vocab_size), float("nan"), device=input_ids.device,
                         dtype=acc_dtype(self.model.dtype))  # fp32 logits (fp64 for the fp64 oracle)
        for t in range(T):
            active = t < lengths
            pos = torch.full((B, 1), t, device=input_ids.device, dtype=torch.long)
            logits = self.model.forward_tokens(input_ids[:, t : t + 1], self.state, pos, active[:, None])
            last = lengths == t + 1
            out[last] = logits[last, 0]
        return out

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward_tokens(ids[:, None], self.state, positions[:, None])[:, 0]
