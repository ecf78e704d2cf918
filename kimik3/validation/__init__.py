"""The correctness matrix: every stage × preset × dtype × batch × context × seed against an fp64 oracle, with a report.

Each stage claims to compute the reference's function over the space its :class:`~kimik3.stages.base.StageSupport`
declares, and a bug lives in a corner, so ``python -m kimik3 validate [--quick]`` (:func:`run_validation`) walks
that space with the rules of ``docs/validation.md``: accuracy against ``naive`` in float64, poisoned state,
determinism, fail-closed refusals, megakernel hazards, expert-parallel and bf16 drift with depth, and reports cell
by cell what passed, failed or was not run and why. Modules: :mod:`~kimik3.validation.metric` (``rel_error``,
``TOL``), :mod:`~kimik3.validation.compare` (one stage against the reference), :mod:`~kimik3.validation.config`
(what a run covers), :mod:`~kimik3.validation.matrix` (running it), :mod:`~kimik3.validation.report` (HTML, CSV,
JSON) and :mod:`~kimik3.validation.cli`. Only the metric is imported with the package; every other public name
loads from its module on first use. What each cell checks: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import importlib
from typing import Any

from kimik3.validation.metric import TOL, assert_close, poison, rel_error

_LAZY = {
    "StageComparison": "compare",
    "ReferenceTrace": "compare",
    "bf16_pair": "compare",
    "compare_to_reference": "compare",
    "compare_with_trace": "compare",
    "mixed_lengths": "compare",
    "poison_stage_state": "compare",
    "reference_trace": "compare",
    "CHUNK_TOKENS": "config",
    "ValidationConfig": "config",
    "default_config": "config",
    "quick_config": "config",
    "only_batches": "config",
    "CELL_COLUMNS": "report",
    "Cell": "report",
    "ValidationReport": "report",
    "drift_figure": "report",
    "error_figure": "report",
    "drift_with_depth": "matrix",
    "hazard_table": "matrix",
    "known_stages": "matrix",
    "run_validation": "matrix",
    "support_refusal": "matrix",
    "support_table": "matrix",
    "main": "cli",
}

__all__ = ["TOL", "assert_close", "poison", "rel_error", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
