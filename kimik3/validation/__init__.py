"""The correctness matrix: every stage × preset × dtype × batch × context × seed against an fp64 oracle, with a report.

Why a matrix and not a handful of tests: each optimisation stage claims to compute the same function as the
reference over a *space* (dtypes, batch sizes, padded prompts, context lengths, devices) and declares that space in
its :class:`~kimik3.stages.base.StageSupport`. A bug lives in a corner (batch 33 rows, a context longer than a
tile, bf16), so the suite walks the whole declared space, checks every cell against one reference with the rules
of ``docs/validation.md`` and says, cell by cell, what passed, what failed and what was not run and why.

What one run checks (``python -m kimik3 validate [--quick]``, or :func:`run_validation`):

* **accuracy** — per cell, the stage against stage ``naive`` run in **float64** on the same weights
  (``copy.deepcopy(model).cast_(torch.float64)``; for bf16 cells on the bf16-rounded weights). fp32: greedy,
  ``e ≤ TOL["fp32_stage"]`` per step and identical greedy tokens; bf16: teacher-forced, ``e ≤ TOL["bf16_stage"]``
  per step, top-1 agreement reported. Prompts are right-padded to mixed lengths (:func:`mixed_lengths`). The
  fp64 reference run of a (preset, seed, dtype, batch, context) is computed once and shared by every stage; the
  comparison loop is :func:`kimik3.validation.compare_to_reference`'s, applied to the stored reference, and every
  run checks that both give bit-identical errors on one cell (harness row "reference path").
* **poisoned state, NaN/inf** — every decode-state tensor a stage holds is filled with NaN before its prefill,
  so state the stage reads without writing shows up as NaN; any NaN/inf in an output fails the cell
  (``rel_error`` is inf). Harness rows check that a planted NaN and a planted inf are caught.
* **determinism** — stages whose support says ``deterministic`` run the short-context cell twice (fresh decoders,
  same inputs) and must agree bitwise (``torch.equal``); the others are listed as not run, with why.
* **support** — cells outside a stage's declared support are not run; the suite *verifies* that building the
  decoder there raises ``ValueError`` (fail closed) and reports the refusal message. A stage that accepts a
  configuration it does not declare fails.
* **hazards** — the megakernel hazard checker (:func:`kimik3.megakernel.check_program`) over the programs for
  every batch size (both scheduling policies, the CPU interpreter's 8 queues and an H100/H200's 132 SMs; also
  ``k3-shard``, the single-GPU target, at 132 SMs).
* **expert-parallel** — :func:`kimik3.scale.expert_parallel.run_local` on real gloo process groups against a single
  process, ``e ≤ TOL["expert_parallel"]`` and identical greedy tokens.
* **bf16 drift with depth** — ``k3-deep-tiny`` (K3's 93-layer pattern): the error of every layer's output in bf16
  against fp32 on the same bf16-rounded weights, a curve; reported, not bounded.

The report (:class:`ValidationReport`) is a pandas table plus a self-contained HTML file (``report.html``, plotly.js
inline) and ``cells.csv`` / ``summary.json`` in the run folder. The CLI exits 0 only if every cell that ran
passed (``--report-only``: always 0).

Known issue, reported as it is: on random-weight presets bf16 rounding can flip near-tied top-k expert choices, so
bf16 cells can exceed ``TOL["bf16_stage"]``; such cells fail with the measured error, the top-1 agreement and the
measured fraction of router top-k sets that differ from the fp64 reference (column ``router_flips``, from the
``naive`` stage's run of the same prompts). Tolerances are not loosened here.

The package, one concern a module:

* :mod:`~kimik3.validation.metric` — the error metric ``rel_error`` and the tolerance table ``TOL``;
* :mod:`~kimik3.validation.compare` — one stage against the reference (:func:`compare_to_reference`, and against a
  stored fp64 run: :func:`reference_trace`, :func:`compare_with_trace`);
* :mod:`~kimik3.validation.config` — what a run covers (:class:`ValidationConfig`, :func:`default_config`,
  :func:`quick_config`);
* :mod:`~kimik3.validation.matrix` — running the matrix: support, accuracy, determinism, hazard, expert-parallel
  and drift cells, on a process pool (:func:`run_validation`);
* :mod:`~kimik3.validation.report` — the report object, its files (HTML, CSV, JSON) and figures;
* :mod:`~kimik3.validation.cli` — ``python -m kimik3 validate``.

Only the metric is imported with the package: the library's own modules (the megakernel interpreter, the
expert-parallel decoder, the benchmarks) use it, and the matrix imports them in turn. Every other public name is
loaded from its module on first use.
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
