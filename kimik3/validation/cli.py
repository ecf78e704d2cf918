"""``python -m kimik3 validate``: the arguments (checked before anything runs), the run, the printed summary and
the exit code."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import pandas as pd
import torch

from kimik3.model.config import PRESET_NAMES
from kimik3.stages import get_stage
from kimik3.util.args import (
    MAX_STEPS,
    MAX_THREADS,
    bounded_int,
    choice_list,
    name_list,
    output_folder,
    positive_int_list,
    seed_int,
)
from kimik3.util.files import check_output_folder, check_writable
from kimik3.util.text import refuse
from kimik3.validation.config import DTYPE_NAMES, default_config, quick_config
from kimik3.validation.matrix import run_validation
from kimik3.validation.report import is_report_folder

__all__ = ["main"]


def seed_list(text: str) -> tuple[int, ...]:
    """Comma-separated seeds, each in 0..2**63 - 1."""
    return tuple(seed_int(x) for x in name_list(text))


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3 validate``: run the matrix, write the report, exit 0 only if every run cell passed."""
    ap = argparse.ArgumentParser(prog="python -m kimik3 validate", description=main.__doc__)
    ap.add_argument("--quick", action="store_true", help="the CI subset: micro, one seed, 2 steps, short+long context")
    ap.add_argument("--presets", type=name_list, default=None, help="comma-separated, e.g. micro,tiny")
    ap.add_argument("--stages", type=name_list, default=None, help="comma-separated (default: every stage)")
    ap.add_argument("--dtypes", type=choice_list(DTYPE_NAMES, "dtype"), default=None, help="float32,bfloat16")
    ap.add_argument("--batch-sizes", type=positive_int_list, default=None)
    ap.add_argument("--seeds", type=seed_list, default=None)
    ap.add_argument("--steps", type=bounded_int(0, MAX_STEPS, "decode steps per cell"), default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None,
                    help="torch threads during the run (default 1)")
    ap.add_argument("--no-determinism", action="store_true")
    ap.add_argument("--no-hazards", action="store_true")
    ap.add_argument("--no-ep", action="store_true", help="skip the expert-parallel processes")
    ap.add_argument("--drift-tokens", type=bounded_int(0, MAX_STEPS, "decoded tokens"), default=None,
                    help="0 skips the bf16 drift curve")
    ap.add_argument("--out", default="runs/validate", type=output_folder,
                    help="run folder for report.html, cells.csv, summary.json")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into a non-empty --out that does not hold an earlier validation report")
    ap.add_argument("--report-only", action="store_true", help="exit 0 whatever failed")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        _check_cli_args(a)
    except ValueError as e:
        return refuse("validate", e)
    over: dict[str, Any] = {}
    for key, val in (("stages", a.stages), ("dtypes", a.dtypes), ("batch_sizes", a.batch_sizes), ("seeds", a.seeds),
                     ("steps", a.steps), ("drift_tokens", a.drift_tokens)):
        if val is not None:
            over[key] = val
    if a.threads is not None:
        over["threads"] = a.threads
    if a.no_determinism:
        over["determinism"] = False
    if a.no_hazards:
        over["hazards"] = False
    if a.no_ep:
        over["ep_runs"] = ()
    if a.quick:
        cfg = quick_config(a.device, **over)
        if a.presets:
            extra = tuple(w for w in cfg.not_run if not any(w[0] == f"preset {p}" for p in a.presets))
            cfg = dataclasses.replace(cfg, presets=a.presets, not_run=extra)
    else:
        cfg = default_config(a.presets, a.device, **over)
    try:
        report = run_validation(cfg, a.out, progress=not a.no_progress)
    except ValueError as e:  # what only the matrix's own checks can tell (a cache that would not fit)
        return refuse("validate", e)
    s = report.summary()
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 160):
        print(s.to_string())
        acc = report.accuracy_summary()
        if not acc.empty:
            print(acc.to_string())
        f = report.failures()
        if not f.empty:
            print("\nFAILED:")
            print(f[["check", "preset", "stage", "dtype", "batch", "context", "seed", "reason"]].to_string())
        nr = report.not_run()
        if not nr.empty:
            print("\nNOT RUN:")
            print(nr.to_string())
    print(f"\nreport: {report.files.get('report')}  ({report.seconds:.0f} s)")
    code = report.exit_code(a.report_only)
    if not report.passed:
        print("some cells failed" + (" (--report-only: exit 0)" if a.report_only else ""))
    if not report.validated:  # every cell refused: not a pass, whatever --report-only says
        print("validate: nothing was validated: every accuracy cell was refused (see NOT RUN above)",
              file=sys.stderr)
        return 1
    return code


def _check_cli_args(a: argparse.Namespace) -> None:
    """Everything that would make the run validate nothing, refused before it starts."""
    if a.device is not None:
        if not (a.device == "cpu" or a.device == "cuda" or a.device.startswith("cuda:")):
            raise ValueError(f"--device must be cpu or cuda, got {a.device!r}")
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {a.device}: no CUDA device is available on this machine")
    for flag, names in (("--presets", a.presets), ("--stages", a.stages), ("--dtypes", a.dtypes),
                        ("--batch-sizes", a.batch_sizes), ("--seeds", a.seeds)):
        if names is not None and not names:
            raise ValueError(f"{flag} is empty")
    for p in a.presets or ():
        if p not in PRESET_NAMES:
            raise ValueError(f"--presets: unknown preset {p!r}; known: {', '.join(PRESET_NAMES)}")
    for st in a.stages or ():
        get_stage(st)
    check_output_folder(a.out, is_report_folder, a.overwrite, "an earlier validation report")
    check_writable(a.out, is_dir=True)
