"""Execute the notebooks headless with papermill (the README's run command, and the test suite).

``DEFAULTS`` are what ``make run`` uses (the ``tiny`` preset on a CPU, the GPU when one is present; on a CPU
``CPU_DEFAULTS`` on top); ``CI`` are
the small parameters the test suite injects so every notebook runs in CI time. Executed copies and their figures
go under ``runs/`` (ignored by git); the committed notebooks stay without outputs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

__all__ = ["NOTEBOOK_DIR", "list_notebooks", "run_notebook", "run_all", "DEFAULTS", "CPU_DEFAULTS", "CI",
           "check_params", "default_params"]

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"

# Per-notebook parameter overrides (merged over each notebook's own `parameters` cell).
# Notebooks 01-05 carry workshop exercises: a run checks the reference solutions (a learner runs with their own).
_SOLUTIONS = {nb: {"solutions": True} for nb in ("01_naive_decode", "02_memory_and_rooflines",
                                                  "03_absorption_graphs_compile", "04_fused_kernels", "05_megakernel")}
DEFAULTS: dict[str, dict] = {k: dict(v) for k, v in _SOLUTIONS.items()}
CI: dict[str, dict] = {
    # (notebooks 01-05 also get the workshop's solutions=True, merged in below)
    "01_naive_decode": {"preset": "micro", "new_tokens": 4, "prompt_len": 8},
    "02_memory_and_rooflines": {"batch_sizes": [1, 8, 64], "context_lens": [1024, 8192]},
    "03_absorption_graphs_compile": {"preset": "micro", "steps": 4, "repeats": 3, "context": 32},
    "04_fused_kernels": {"compile_kernels": False},
    "05_megakernel": {"preset": "micro", "steps": 2, "interleavings": 2, "compile_kernel": False,
                      "curve_batches": [1, 8, 64], "cpu_batches": [1, 8]},
    # the whole quick matrix runs in tests/test_validate.py (validate --quick); the notebook's cells need two batches
    "06_validation": {"presets": ["micro"], "quick": True, "batch_sizes": [1, 33]},
    "07_scaling_to_nvl72": {"batch_sizes": [1, 8, 64], "rank_batches": [1]},
    "08_evidence": {},
}
CI.update({k: {**v, **CI[k]} for k, v in _SOLUTIONS.items()})
# Without a GPU, notebook 06 runs the quick matrix (every stage x dtype x batch the CPU supports, two contexts, one
# seed; the report lists what it leaves out): its full micro matrix is 660 cells, hours on 2 CPU cores, one cell past
# papermill's per-cell limit, so `make run` never finished there. With a GPU it runs the notebook's own full matrix.
CPU_DEFAULTS: dict[str, dict] = {"06_validation": {"quick": True}}


def default_params(name: str, gpu: bool | None = None) -> dict:
    """The parameters ``make run`` gives notebook ``name``: :data:`DEFAULTS`, plus :data:`CPU_DEFAULTS` when no GPU
    is present (``gpu`` None: ask torch)."""
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    return {**DEFAULTS.get(name, {}), **({} if gpu else CPU_DEFAULTS.get(name, {}))}


def list_notebooks(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    return sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb"))


def run_notebook(path: Path, out_root: Path, params: dict | None = None, timeout: int = 1800) -> Path:
    """Execute one notebook; its figures go to ``out_root/<stem>/`` (passed as the ``out_dir`` parameter)."""
    import papermill as pm

    check_params(params or {}, where=path.stem)
    # absolute: the kernel runs with the repository as its working folder, so a relative out_dir would put the
    # figures somewhere else than the notebook
    out_dir = Path(out_root).resolve() / path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    parameters = {"out_dir": str(out_dir), **(params or {})}
    # the kernel must be this interpreter's, whatever PATH says (a venv that is not activated)
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    out_nb = out_dir / path.name
    # executed into a marked partial file and renamed only when complete: an interrupted or failed run never
    # leaves a notebook that looks finished (nor the previous run's, beside this run's figures)
    partial = out_dir / f"{path.stem}.partial.ipynb"
    failed = out_dir / f"{path.stem}.FAILED.ipynb"
    for stale in (out_nb, failed):
        stale.unlink(missing_ok=True)
    try:
        pm.execute_notebook(str(path), str(partial), parameters=parameters, kernel_name="python3",
                            cwd=str(path.parent.parent), execution_timeout=timeout, progress_bar=False)
    except BaseException:
        if partial.exists():
            os.replace(partial, failed)
        raise
    os.replace(partial, out_nb)
    return out_nb


def run_all(out_root: str | Path = "runs", only: list[str] | None = None, ci: bool = False) -> list[Path]:
    """Execute the notebooks (those whose name starts with one of ``only``); ``ValueError`` before running
    anything when a prefix matches no notebook or ``out_root`` cannot be written."""
    from kimik3.util.files import check_writable

    out_root = Path(out_root).resolve()
    notebooks = list_notebooks()
    if only:
        unknown = [o for o in only if not any(nb.stem.startswith(o) for nb in notebooks)]
        if unknown:
            raise ValueError(f"--only {','.join(unknown)} matches no notebook; available: "
                             f"{', '.join(nb.stem for nb in notebooks)}")
    if not notebooks:
        raise ValueError(f"no notebooks found in {NOTEBOOK_DIR}")
    check_writable(out_root, is_dir=True)
    done = []
    for nb in notebooks:
        if only and not any(nb.stem.startswith(o) for o in only):
            continue
        params = dict(CI.get(nb.stem, {})) if ci else default_params(nb.stem)
        t0 = time.perf_counter()
        print(f"[kimik3] running {nb.name} -> {out_root / nb.stem}/ ...", flush=True)
        done.append(run_notebook(nb, out_root, params))
        print(f"[kimik3]   done in {time.perf_counter() - t0:.1f} s", flush=True)
    from kimik3.evidence.cli import build
    from kimik3.notebook.site import write_site

    # the evidence page of every unit (its dossier, the last recorded test results), part of the same site
    t0 = time.perf_counter()
    ds, notes, _ = build(out_root / "evidence")
    print(f"[kimik3] evidence for {len(ds)} units ({len(notes)} note(s)) -> {out_root / 'evidence'}/ in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    # every executed notebook under out_root (this run's and earlier ones'), viewable offline from file://
    print(f"[kimik3] static site (HTML exports + figures, no network needed): {write_site(out_root)}", flush=True)
    return done


# ---------------------------------------------------------------------- parameter checks (called by the notebooks)

_POSITIVE = ("batch_size", "batch", "prompt_len", "new_tokens", "steps", "repeats", "context", "interleavings")
_NONNEG = ("seed",)
_POSITIVE_LISTS = ("batch_sizes", "rank_batches", "curve_batches", "cpu_batches")
_NONNEG_LISTS = ("context_lens",)


def check_params(params: dict, where: str = "notebook") -> None:
    """Validate a notebook's parameters (those of its ``parameters`` cell, as papermill or a user set them):
    counts must be integers in range, presets known. Raises ``ValueError`` naming the parameter — instead of a
    shape error or a silently empty run deep inside the notebook. Unknown names are left alone."""
    from kimik3.model.config import PRESET_NAMES

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name, v in params.items():
        if name in _POSITIVE and not (is_int(v) and v >= 1):
            raise ValueError(f"{where}: parameter {name} must be a positive integer, got {v!r}")
        if name in _NONNEG and not (is_int(v) and v >= 0):
            raise ValueError(f"{where}: parameter {name} must be a non-negative integer, got {v!r}")
        if name in _POSITIVE_LISTS + _NONNEG_LISTS:
            lo = 1 if name in _POSITIVE_LISTS else 0
            if not (isinstance(v, (list, tuple)) and v and all(is_int(x) and x >= lo for x in v)):
                raise ValueError(f"{where}: parameter {name} must be a non-empty list of integers >= {lo}, "
                                 f"got {v!r}")
        if name == "preset" and v not in PRESET_NAMES:
            raise ValueError(f"{where}: parameter preset {v!r} is not a preset; known: {', '.join(PRESET_NAMES)}")
        if name == "presets" and not (isinstance(v, (list, tuple)) and v and all(p in PRESET_NAMES for p in v)):
            raise ValueError(f"{where}: parameter presets must be a non-empty list of presets "
                             f"({', '.join(PRESET_NAMES)}), got {v!r}")
        if name == "device" and not (isinstance(v, str) and (v in ("auto", "cpu", "cuda") or v.startswith("cuda:"))):
            raise ValueError(f"{where}: parameter device must be 'auto', 'cpu' or 'cuda', got {v!r}")
        if name == "stages":
            from kimik3.stages import get_stage

            if not (isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v)):
                raise ValueError(f"{where}: parameter stages must be a non-empty list of stage names, got {v!r}")
            for x in v:
                get_stage(x)
