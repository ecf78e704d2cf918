"""Running host-execution cases in a subprocess, shared by the tests/test_host_exec*.py modules.

A subprocess because executing a device-only instruction on the host aborts the process (it cannot be caught), and
a planted mutant may reach one: the test then reports the signal instead of dying with the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cases(module: str, cases: list[dict], tmp: Path, timeout: int) -> list[dict]:
    """``python -m <module> cases.json`` (``kimik3.kernels.verify.host_exec.cases_main``): one result per case, in
    order; fails with the subprocess's stderr when it did not report every case."""
    path = tmp / "cases.json"
    path.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", module, str(path)], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env=env)
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and len(lines) == len(cases), (
        f"host execution exited {r.returncode} after {len(lines)}/{len(cases)} cases "
        f"(a negative code is a signal: a device-only instruction reached on the host aborts)\n{r.stderr[-3000:]}")
    return lines


def run_with_mutants(module: str, cases: list[dict], mutants: dict[str, tuple[list, dict]], tmp: Path, timeout: int,
                     name: Callable[[dict], str]) -> dict[str, dict]:
    """The clean ``cases`` and each planted mutant's case (``mutants``: name -> (mutant, case)) in one subprocess:
    the results by ``name(case)`` and by ``"mutant:<name>"``."""
    runs = cases + [{**case, "mutant": mut} for mut, case in mutants.values()]
    res = run_cases(module, runs, tmp, timeout)
    out = {name(r["case"]): r for r in res[:len(cases)]}
    out.update({f"mutant:{m}": r for m, r in zip(mutants, res[len(cases):])})
    return out
