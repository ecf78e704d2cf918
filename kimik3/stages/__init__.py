"""Optimisation stages behind one :class:`kimik3.Decoder` API, registered by name in ladder order."""

from __future__ import annotations

import importlib

from kimik3.stages.absorbed import AbsorbedStage
from kimik3.stages.base import Stage, StageSupport
from kimik3.stages.compiled import CompiledStage, GraphsStage
from kimik3.stages.fused import FusedStage
from kimik3.stages.naive import NaiveStage

__all__ = ["Stage", "StageSupport", "STAGES", "get_stage", "register_stage"]

STAGES: dict[str, type[Stage]] = {
    "naive": NaiveStage,
    "absorbed": AbsorbedStage,
    "graphs": GraphsStage,
    "compiled": CompiledStage,
    "fused": FusedStage,
}


def register_stage(cls: type[Stage]) -> type[Stage]:
    STAGES[cls.name] = cls
    return cls


# Stages that live outside this package and register themselves on import (kept lazy: importing
# kimik3.scale.expert_parallel here would make `python -m kimik3.scale.expert_parallel` warn about a module already
# imported).
_LAZY_STAGES = {"expert-parallel": "kimik3.scale.expert_parallel",
                "megakernel-interp": "kimik3.megakernel.interp_ranks", "megakernel-cpu": "kimik3.megakernel.cpu",
                "megakernel": "kimik3.megakernel.gpu_stage"}


def get_stage(name: str) -> type[Stage]:
    known = list(STAGES) + [n for n in _LAZY_STAGES if n not in STAGES]
    if not isinstance(name, str):
        raise ValueError(f"stage must be a stage name, got {name!r}; known stages: {', '.join(known)}")
    if name not in STAGES and name in _LAZY_STAGES:
        importlib.import_module(_LAZY_STAGES[name])
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; known stages: {', '.join(known)}") from None
