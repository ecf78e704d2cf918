"""Optimisation stages behind one :class:`kimik3.Decoder` API, registered by name in ladder order."""

from __future__ import annotations

from kimik3.stages.base import Stage, StageSupport
from kimik3.stages.naive import NaiveStage

__all__ = ["Stage", "StageSupport", "STAGES", "get_stage", "register_stage"]

STAGES: dict[str, type[Stage]] = {"naive": NaiveStage}


def register_stage(cls: type[Stage]) -> type[Stage]:
    STAGES[cls.name] = cls
    return cls


def get_stage(name: str) -> type[Stage]:
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; known stages: {', '.join(STAGES)}") from None
