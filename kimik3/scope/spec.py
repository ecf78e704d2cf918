"""A stage's scope as data: what it supports, and every reason a request falls outside it (docs/architecture.md
§13).

:class:`ScopeSpec` is the declaration (dtypes, devices, GPU architectures, batch widths, expert formats, world
sizes, SM counts, context, the config features it implements and the shape rules its kernels impose);
:meth:`ScopeSpec.refuse` returns *every* reason a request is refused, never stopping at the first, and needs no
GPU; :meth:`ScopeSpec.check` raises them as one ``ValueError``. A spec with ``features=None`` is a reference
stage's: it runs whatever the model implements. A spec with features lists each one; a feature it does not list,
a value it does not list, a config field or checkpoint key nobody reviewed, or a rule that cannot be evaluated
refuses (fail closed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kimik3.model.config import ModelConfig
from kimik3.scope.features import FEATURES, config_features, unreviewed

__all__ = ["Request", "Rule", "ScopeSpec", "request_of"]


@dataclass(frozen=True)
class Request:
    """What a caller asks of a stage, besides the config: the model's dtype and device, the batch width, the
    context (``max_seq_len``), the routed experts' format asked for (``experts``; None: as the model holds them)
    and as held (``storage``), the GPU's architecture and SM count (None off a GPU or when unknown) and the
    deployment's world size."""

    dtype: torch.dtype
    device: str
    batch: int
    context: int | None = None
    experts: str | None = None
    storage: str = "dense"
    arch: str | None = None
    sms: int | None = None
    world: int = 1
    storage_memory: str = ""  # what the held experts take and would take dense (model.expert_memory())


@dataclass(frozen=True)
class Rule:
    """A constraint a kernel puts on the config's shapes or constants: ``check(cfg, request)`` returns the reasons
    it is refused (a string, a list of them, or None / [] when it holds). ``about`` says what it checks (the dossier
    lists it)."""

    about: str
    check: Callable[[ModelConfig, Request], str | list[str] | None]


def _names(values: Any) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class ScopeSpec:
    """What a stage supports (see the module docstring). ``kept_experts``: formats of routed experts held quantized
    (``model.expert_storage``) that the stage reads as they are; ``expert_formats``: the values its ``experts``
    option takes (() = no such option); ``worlds``: the deployment sizes it runs (inclusive range);
    ``min_sms_per_rank``: SMs (or CPU workers) each rank needs; ``max_context``: the longest ``max_seq_len`` (None:
    only the Decoder's own bound); ``device_note``: where it runs, as the refusal prints it after "runs"."""

    name: str = ""
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    min_batch: int = 1
    max_batch: int | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    deterministic: bool = True  # bitwise-identical outputs on identical inputs
    archs: tuple[str, ...] | None = None  # CUDA archs ("sm_90a", ...); None = any
    kept_experts: tuple[str, ...] = ()
    expert_formats: tuple[str, ...] = ()
    worlds: tuple[int, int] = (1, 1)
    min_sms_per_rank: int = 1
    max_context: int | None = None
    features: Mapping[str, frozenset[str]] | None = None
    rules: tuple[Rule, ...] = ()
    device_note: str = ""
    about: str = ""
    enforced_by: tuple[str, ...] = field(default=())  # the code that builds through this gate (for the dossier)

    # ------------------------------------------------------------------ the reasons
    def refuse_config(self, cfg: ModelConfig, request: Request | None = None) -> list[str]:
        """Every reason ``cfg`` itself is refused: unreviewed fields and keys, features, and (with a request) the
        rules."""
        if self.features is None:
            return []
        out = list(unreviewed(cfg))
        for feat, value in config_features(cfg).items():
            allowed = self.features.get(feat)
            if allowed is None:
                out.append(f"has not reviewed the config feature {feat!r} ({value!r}) (fail closed: "
                           "kimik3/scope/gates.py lists what each fast path supports)")
            elif value not in allowed:
                out.append(f"does not support {feat} = {value!r} (supported: {_names(map(repr, sorted(allowed)))})")
        if request is not None:
            for rule in self.rules:
                try:
                    why = rule.check(cfg, request)
                except Exception as e:  # a rule that cannot be evaluated refuses
                    why = f"could not check {rule.about}: {type(e).__name__}: {e}"
                out.extend([why] if isinstance(why, str) else (why or []))
        return out

    def refuse(self, cfg: ModelConfig, request: Request) -> list[str]:
        """Every reason this stage refuses ``request`` on ``cfg`` (empty: supported). Each reason reads after the
        stage's name ("stage 'fused' <reason>")."""
        r = request
        out = []
        if r.device not in self.devices:
            where = self.device_note or "on " + "/".join(self.devices)
            hint = " (on a CPU: stages 'naive', 'absorbed', 'compiled', 'megakernel-cpu')" if r.device == "cpu" else ""
            out.append(f"runs {where}, not on {r.device}{hint}")
        if r.dtype not in self.dtypes:
            out.append(f"supports dtypes {[str(d) for d in self.dtypes]}, got {r.dtype}")
        if r.storage != "dense" and r.storage not in self.kept_experts:
            memory = f" ({r.storage_memory})" if r.storage_memory else ""
            out.append(f"reads dense routed experts, but this model holds them as {r.storage} "
                       f"(quantized_experts='keep'): call model.dequantize_experts() first{memory} or load with "
                       "quantized_experts='dequantize'; the stages that read kept MXFP4 experts are 'naive' (one "
                       "expert dequantised at a time), 'fused' (expert_format='mxfp4'), 'megakernel-interp', "
                       "'megakernel' and 'megakernel-cpu' (experts='mxfp4')")
        if r.experts is not None and self.expert_formats and r.experts not in self.expert_formats:
            out.append(f"takes routed experts as {_names(self.expert_formats)}, got {r.experts!r}")
        hi = self.max_batch if self.max_batch is not None else float("inf")
        if not self.min_batch <= r.batch <= hi:
            out.append(f"supports batch sizes {self.min_batch}..{self.max_batch}, got {r.batch}")
        if self.archs is not None and r.device == "cuda" and r.arch is not None and r.arch not in self.archs:
            out.append(f"is built for {', '.join(self.archs)}; this GPU is {r.arch}")
        lo, hi_w = self.worlds
        if isinstance(r.world, bool) or not isinstance(r.world, int):
            out.append(f"takes an int world size, got {r.world!r}")
        elif not lo <= r.world <= hi_w:
            span = f"world size {lo}" if lo == hi_w else f"world sizes {lo}..{hi_w}"
            out.append(f"runs {span}, got world {r.world}")
        elif r.sms is not None and r.sms < self.min_sms_per_rank * r.world:
            out.append(f"needs {self.min_sms_per_rank} SM(s) per rank: {r.sms} SMs cannot hold {r.world} "
                       f"rank{'s' if r.world > 1 else ''}")
        if self.max_context is not None and r.context is not None and r.context > self.max_context:
            out.append(f"supports contexts up to {self.max_context} tokens, got max_seq_len={r.context}")
        return out + self.refuse_config(cfg, r)

    def check(self, stage: str, model: Any, batch_size: int, max_seq_len: int | None = None, **request: Any
              ) -> None:
        """Raise one ``ValueError`` with every reason ``stage`` refuses ``model`` at this request."""
        reasons = self.refuse(model.config, request_of(model, batch_size, max_seq_len, **request))
        if reasons:
            raise ValueError(f"stage {stage!r} " + "; ".join(reasons))

    # ------------------------------------------------------------------ for the dossier
    def describe(self) -> dict[str, Any]:
        """The spec as plain data (names, ranges, feature values, rule texts)."""
        return {
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "devices": list(self.devices), "archs": list(self.archs) if self.archs else "any",
            "batch": [self.min_batch, self.max_batch], "kept_experts": list(self.kept_experts),
            "expert_formats": list(self.expert_formats), "worlds": list(self.worlds),
            "min_sms_per_rank": self.min_sms_per_rank, "max_context": self.max_context,
            "features": ("every feature the model implements" if self.features is None else
                         {f: sorted(self.features.get(f, ())) for f in FEATURES}),
            "rules": [r.about for r in self.rules], "enforced_by": list(self.enforced_by),
        }


def request_of(model: Any, batch_size: int, max_seq_len: int | None = None, *, experts: str | None = None,
               world: int = 1, sms: int | None = None, arch: str | None = None) -> Request:
    """The request a stage makes for ``model``: its dtype, device, expert storage, and on a GPU the architecture
    and SM count (unless given)."""
    dev = model.device
    if dev.type == "cuda" and torch.cuda.is_available():
        if arch is None:
            major, minor = torch.cuda.get_device_capability(dev)
            arch = f"sm_{major}{minor}a"
        if sms is None:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
    storage = getattr(model, "expert_storage", "dense")
    memory = model.expert_memory() if storage != "dense" and hasattr(model, "expert_memory") else ""
    return Request(dtype=model.dtype, device=dev.type, batch=batch_size, context=max_seq_len, experts=experts,
                   storage=storage, arch=arch, sms=sms, world=world, storage_memory=memory)
