"""The one public decode API every stage sits behind.

```python
model = kimik3.from_preset("tiny", seed=0)
dec = kimik3.Decoder(model, stage="naive", batch_size=2, max_seq_len=256)
logits = dec.prefill(input_ids)          # [B, T] -> fp32 [B, vocab] at the last prompt position
logits = dec.step(next_ids)              # [B]    -> fp32 [B, vocab]
tokens = dec.generate(input_ids, max_new_tokens=16)   # greedy -> [B, T + 16]
```
Right-padded batches pass ``lengths``; every misuse is a ``ValueError`` that says what was wrong. A call that fails
part-way (a hook's exception, Ctrl-C) leaves the Decoder refusing all but ``reset()``, saying why; a call while
another thread's call runs is refused.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from kimik3.model.checks import require_memory
from kimik3.model.modeling import DecodeState, KimiForCausalLM
from kimik3.stages import get_stage

__all__ = ["Decoder", "check_state_fits", "MAX_SEQ_LEN"]

MAX_SEQ_LEN = 2**31 - 1  # positions as int32 index them; far past any memory


class Decoder:
    def __init__(self, model: KimiForCausalLM, stage: str = "naive", batch_size: int = 1,
                 max_seq_len: int = 1024, **stage_options) -> None:
        if not isinstance(model, KimiForCausalLM):
            raise ValueError(f"Decoder needs a kimik3 model (from_preset / from_pretrained), got {type(model)}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or not 1 <= max_seq_len <= MAX_SEQ_LEN:
            raise ValueError(f"max_seq_len must be a positive int of at most {MAX_SEQ_LEN}, got {max_seq_len!r}")
        check_state_fits(model, batch_size, max_seq_len)
        self.model = model
        self.stage_name = stage
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.stage = get_stage(stage)(model, batch_size, max_seq_len, **stage_options)
        self.lengths: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._broken: str | None = None  # why the state can no longer be trusted (until reset)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @contextlib.contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """One public call: refused while another thread's call runs, or (but ``reset``) after a call failed
        part-way."""
        if not self._lock.acquire(blocking=False):
            raise ValueError(f"{what}() while another call on this Decoder is running (another thread?): a Decoder "
                             "holds one batch's caches; use one Decoder per thread")
        try:
            if self._broken is not None and what != "reset":
                raise ValueError(f"this Decoder's state is unusable: {self._broken}; call reset() and prefill again")
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _changing(self, what: str) -> Iterator[None]:
        """The part of a call that changes caches and states (every check is done before it): if it raises, the
        Decoder is marked unusable until :meth:`reset`."""
        try:
            yield
        except BaseException as e:
            self._broken = (f"{what}() failed part-way ({type(e).__name__}: {e}), after some layers' caches and "
                            "states may have advanced")
            raise

    def reset(self) -> None:
        """Forget every sequence (caches, states, lengths); also clears a failed call's mark."""
        with self._call("reset"), self._changing("reset"):
            self.lengths = None
            self.stage.reset()
            self._broken = None

    def _ids(self, ids: torch.Tensor, what: str, ndim: int) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError, OverflowError) as e:
                raise ValueError(f"{what} must be integer token ids, got {type(ids).__name__} ({e})") from None
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{what} must be an integer tensor, got {ids.dtype}")
        if ids.is_meta:
            raise ValueError(f"{what} is a meta tensor (a shape without values): token ids need values")
        if ids.dim() != ndim:
            raise ValueError(f"{what} must have {ndim} dimension(s) ({'[B, T]' if ndim == 2 else '[B]'}), "
                             f"got shape {list(ids.shape)}")
        if ids.shape[0] != self.batch_size:
            raise ValueError(f"{what} has batch size {ids.shape[0]}, but this Decoder was built for "
                             f"batch_size={self.batch_size}")
        return ids.to(device=self.model.device, dtype=torch.long)

    def _check_vocab(self, ids: torch.Tensor, what: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0].item()
            raise ValueError(f"{what} contains token id {bad} outside the vocabulary [0, {self.vocab_size})")

    def _prompt_lengths(self, ids: torch.Tensor, lengths: torch.Tensor | list[int] | None) -> torch.Tensor:
        B, T = ids.shape
        if T < 1:
            raise ValueError("input_ids must hold at least one token per sequence")
        if lengths is None:
            lens = torch.full((B,), T, dtype=torch.long, device=ids.device)
        else:
            try:
                raw = lengths if isinstance(lengths, torch.Tensor) else torch.as_tensor(lengths)
            except (TypeError, ValueError, RuntimeError, OverflowError) as e:
                raise ValueError(f"lengths must be integers, one per sequence, got {lengths!r} ({e})") from None
            if raw.is_meta:
                raise ValueError("lengths is a meta tensor (a shape without values)")
            if raw.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
                # a float length would be truncated silently: 5.7 -> 5
                raise ValueError(f"lengths must be integers, got dtype {raw.dtype}")
            lens = raw.to(device=ids.device, dtype=torch.long)
            if lens.shape != (B,):
                raise ValueError(f"lengths must have shape [{B}], got {list(lens.shape)}")
            if int(lens.min()) < 1 or int(lens.max()) > T:
                raise ValueError(f"lengths must be in 1..{T} (the padded prompt width), got {lens.tolist()}")
        if int(lens.max()) > self.max_seq_len:
            raise ValueError(f"prompt of {int(lens.max())} tokens exceeds max_seq_len={self.max_seq_len}")
        return lens

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Start (or restart) every sequence from its prompt; returns fp32 logits at each last prompt token."""
        with self._call("prefill"):
            return self._prefill(input_ids, lengths)

    def _prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | list[int] | None) -> torch.Tensor:
        ids = self._ids(input_ids, "input_ids", 2)
        B, T = ids.shape
        lens = self._prompt_lengths(ids, lengths)
        valid = torch.arange(T, device=ids.device)[None, :] < lens[:, None]
        self._check_vocab(ids[valid], "input_ids")
        ids = torch.where(valid, ids, torch.zeros_like(ids))  # padding values are never embedded into a state
        with self._changing("prefill"):
            self.lengths = None
            logits = self.stage.prefill(ids, lens)
            self.lengths = lens.clone()
        return logits

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """Append one token to every sequence; returns fp32 logits [B, vocab]."""
        with self._call("step"):
            return self._step(next_ids)

    def _step(self, next_ids: torch.Tensor) -> torch.Tensor:
        if self.lengths is None:
            raise ValueError("step() called before prefill(): there is no sequence to continue")
        ids = self._ids(next_ids, "next_ids", 1)
        self._check_vocab(ids, "next_ids")
        if int(self.lengths.max()) + 1 > self.max_seq_len:
            raise ValueError(f"sequence would grow to {int(self.lengths.max()) + 1} tokens, past the cache "
                             f"(max_seq_len={self.max_seq_len}); call reset() or build a Decoder with a larger one")
        with self._changing("step"):
            logits = self.stage.step(ids, self.lengths)
            self.lengths = self.lengths + 1
        return logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16,
                 lengths: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Greedy decoding. Returns [B, T + max_new_tokens]: each row is its own prompt (``lengths[b]`` tokens)
        followed by its new tokens, then ``pad_token_id`` (0 if unset) up to the common width."""
        with self._call("generate"):
            return self._generate(input_ids, max_new_tokens, lengths)

    def _generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                  lengths: torch.Tensor | list[int] | None) -> torch.Tensor:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        ids = self._ids(input_ids, "input_ids", 2)
        B, T = ids.shape
        longest = int(self._prompt_lengths(ids, lengths).max())
        if longest + max_new_tokens > self.max_seq_len + 1:  # checked before prefill: a refusal changes nothing
            raise ValueError(f"{longest} prompt + {max_new_tokens} new tokens exceed "
                             f"max_seq_len={self.max_seq_len}")
        logits = self._prefill(ids, lengths)
        lens0 = self.lengths.clone()
        pad = self.model.config.pad_token_id or 0
        out = torch.full((B, T + max_new_tokens), pad, dtype=torch.long, device=ids.device)
        cols = torch.arange(T, device=ids.device)[None, :]
        out[:, :T] = torch.where(cols < lens0[:, None], ids, torch.full_like(ids, pad))
        rows = torch.arange(B, device=ids.device)
        for i in range(max_new_tokens):
            nxt = logits.argmax(-1)
            out[rows, lens0 + i] = nxt
            if i + 1 < max_new_tokens:
                logits = self._step(nxt)
        return out


def check_state_fits(model: KimiForCausalLM, batch_size: int, max_seq_len: int) -> None:
    """Refuse, with the figure, a cache that cannot fit in the device's memory — instead of a raw allocator error
    or (on Linux, where allocation is lazy) the process being killed halfway through filling it."""
    states = [layer.self_attn.new_state(batch_size, "meta", model.dtype) if layer.kind == "kda"
              else layer.self_attn.new_cache(batch_size, max_seq_len, "meta", model.dtype)
              for layer in model.model.layers]
    need = DecodeState(states, max_seq_len).nbytes()
    require_memory(need, model.device, f"the decode state (caches) for batch_size={batch_size}, "
                   f"max_seq_len={max_seq_len}", "use a smaller max_seq_len or batch_size")
