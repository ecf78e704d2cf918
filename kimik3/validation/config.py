"""What one validation run covers: :class:`ValidationConfig` and the two standard runs (:func:`default_config`,
the full matrix; :func:`quick_config`, the CI subset)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kimik3.model.config import get_preset

__all__ = ["CHUNK_TOKENS", "ValidationConfig", "default_config", "quick_config"]

# The longest context tile any stage uses: the GPU MLA decode kernel splits each sequence into slices of at least
# 64 tokens (kernels/fused/mla_decode.py ``default_splits``), the CPU megakernel splits the cache in >= 2 parts; naive,
# absorbed and compiled attend over the whole cache. Every context but "short" is longer than this.
CHUNK_TOKENS = 64

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = tuple(_DTYPES)  # what --dtypes accepts
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class ValidationConfig:
    """What one validation run covers. ``contexts``: (name, prompt tokens) — the padded prompt width; each row's
    own length is drawn in [width/2, width] (the first row is full length). ``not_run``: (what, why) pairs the run
    deliberately leaves out (e.g. ``("preset tiny", "tiny skipped: --quick")``), listed in the report."""

    presets: tuple[str, ...] = ("micro",)
    stages: tuple[str, ...] | None = None  # None: every registered stage
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    batch_sizes: tuple[int, ...] = (1, 2, 8, 33, 64)
    contexts: tuple[tuple[str, int], ...] = (("short", 8), ("over-chunk", 72), ("long", 200))
    steps: int = 8
    seeds: tuple[int, ...] = (0, 1)
    device: str = "cpu"
    determinism: bool = True
    hazards: bool = True
    hazard_presets: tuple[str, ...] = ("k3-shard",)  # checked at 132 SMs in addition to ``presets``
    hazard_sms: tuple[int, ...] = (8, 132)
    hazard_policies: tuple[str, ...] = ("critical_path", "round_robin")
    hazard_max_seq_len: int = 4096
    ep_runs: tuple[tuple[int, int], ...] = ((2, 1), (2, 8), (2, 33), (4, 8))  # (world, batch), fp32
    ep_steps: int = 8
    ep_prompt_len: int = 8
    drift_preset: str = "k3-deep-tiny"
    drift_tokens: int = 16  # 0: skip the drift curve
    drift_batch: int = 1
    threads: int | None = 1  # torch intra-op threads during the run (small models: 1 is fastest on 2 cores)
    quick: bool = False
    not_run: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for d in self.dtypes:
            if d not in _DTYPES:
                raise ValueError(f"unknown dtype {d!r}; use float32 / bfloat16")
        for b in self.batch_sizes:
            if not isinstance(b, int) or b < 1:
                raise ValueError(f"batch sizes must be positive ints, got {b!r}")
        for name, n in self.contexts:
            if n < 1:
                raise ValueError(f"context {name!r}: prompt width must be >= 1, got {n}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        for p in (*self.presets, *self.hazard_presets):
            get_preset(p)  # unknown names raise with the list of known ones

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_config(presets: Sequence[str] | None = None, device: str | None = None, **overrides: Any
                   ) -> ValidationConfig:
    """The full matrix: two seeds, three contexts, 8 steps, every batch size; ``micro`` on a CPU (``tiny`` when
    asked for: it takes hours there), ``micro`` and ``tiny`` on a GPU."""
    device = device or _default_device()
    presets = tuple(presets) if presets else (("micro",) if device == "cpu" else ("micro", "tiny"))
    not_run = tuple((f"preset {p}", f"{p} not requested (pass --presets {','.join((*presets, p))})")
                    for p in ("micro", "tiny") if p not in presets)
    return dataclasses.replace(ValidationConfig(presets=presets, device=device, not_run=not_run), **overrides)


def quick_config(device: str | None = None, **overrides: Any) -> ValidationConfig:
    """The CI subset: ``micro`` only, one seed, 2 steps, the short and one long context (72 tokens, longer than any
    internal chunk), still every stage × dtype × batch the device supports; fewer hazard programs, one
    expert-parallel run and a 4-token drift curve."""
    device = device or _default_device()
    cfg = ValidationConfig(
        presets=("micro",), contexts=(("short", 8), ("long", 72)), steps=2, seeds=(0,), device=device,
        hazard_sms=(8, 132), hazard_policies=("critical_path",), ep_runs=((2, 8),), ep_steps=4, drift_tokens=4,
        quick=True,
        not_run=(("preset tiny", "tiny skipped: --quick"),
                 ("context over-chunk", "over-chunk context skipped: --quick (its 'long' context, 72 tokens, is "
                                        f"already longer than every internal chunk of {CHUNK_TOKENS} tokens)"),
                 ("seed 1", "seed 1 skipped: --quick (one seed)"),
                 ("hazards round_robin", "round_robin scheduling policy skipped: --quick")))
    return dataclasses.replace(cfg, **overrides)


def only_batches(config: ValidationConfig, batches: Sequence[int]) -> ValidationConfig:
    """``config`` run at ``batches`` only; the batch sizes it leaves out are listed among the run's ``not_run``."""
    chosen = tuple(batches)
    if not chosen:
        raise ValueError("only_batches needs at least one batch size")
    left = [b for b in config.batch_sizes if b not in chosen]
    why = ((f"batch sizes {', '.join(map(str, left))}", f"batch sizes {', '.join(map(str, left))} not requested "
            f"(this run takes {', '.join(map(str, chosen))})"),) if left else ()
    return dataclasses.replace(config, batch_sizes=chosen, not_run=config.not_run + why)

