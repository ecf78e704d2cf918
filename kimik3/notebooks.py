"""Execute the notebooks headless with papermill (the README's run command, and the test suite).

``DEFAULTS`` are what ``make run`` uses (the ``tiny`` preset on a CPU, the GPU when one is present); ``CI`` are
the small parameters the test suite injects so every notebook runs in CI time. Executed copies and their figures
go under ``runs/`` (ignored by git); the committed notebooks stay without outputs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

__all__ = ["NOTEBOOK_DIR", "list_notebooks", "run_notebook", "run_all", "DEFAULTS", "CI"]

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"

# Per-notebook parameter overrides (merged over each notebook's own `parameters` cell).
DEFAULTS: dict[str, dict] = {}
CI: dict[str, dict] = {
    "01_naive_decode": {"preset": "micro", "new_tokens": 4, "prompt_len": 8},
    "02_memory_and_rooflines": {"batch_sizes": [1, 8, 64], "context_lens": [1024, 8192]},
    "03_absorption_graphs_compile": {"preset": "micro", "steps": 4, "repeats": 3, "context": 32},
    "04_fused_kernels": {"compile_kernels": False},
    "05_megakernel": {"preset": "micro", "steps": 2, "interleavings": 2, "compile_kernel": False},
    "06_validation": {"presets": ["micro"], "quick": True},
    "07_scaling_to_nvl72": {"batch_sizes": [1, 8, 64]},
}


def list_notebooks(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    return sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb"))


def run_notebook(path: Path, out_root: Path, params: dict | None = None, timeout: int = 1800) -> Path:
    """Execute one notebook; its figures go to ``out_root/<stem>/`` (passed as the ``out_dir`` parameter)."""
    import papermill as pm

    out_dir = out_root / path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    parameters = {"out_dir": str(out_dir), **(params or {})}
    # the kernel must be this interpreter's, whatever PATH says (a venv that is not activated)
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    out_nb = out_dir / path.name
    pm.execute_notebook(str(path), str(out_nb), parameters=parameters, kernel_name="python3",
                        cwd=str(path.parent.parent), execution_timeout=timeout, progress_bar=False)
    return out_nb


def run_all(out_root: str | Path = "runs", only: list[str] | None = None, ci: bool = False) -> list[Path]:
    out_root = Path(out_root)
    done = []
    for nb in list_notebooks():
        if only and not any(nb.stem.startswith(o) for o in only):
            continue
        params = dict((CI if ci else DEFAULTS).get(nb.stem, {}))
        t0 = time.perf_counter()
        print(f"[kimik3] running {nb.name} -> {out_root / nb.stem}/ ...", flush=True)
        done.append(run_notebook(nb, out_root, params))
        print(f"[kimik3]   done in {time.perf_counter() - t0:.1f} s", flush=True)
    return done
