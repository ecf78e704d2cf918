"""Every notebook executes headless under papermill with small parameters (the CI half of `make run`)."""

from __future__ import annotations

import json

import pytest

from kimik3.notebook.runner import CI, CPU_DEFAULTS, DEFAULTS, default_params, list_notebooks, run_notebook
from kimik3.notebook.start import cdn_references

NOTEBOOKS = list_notebooks()


def test_notebooks_exist_and_are_committed_clean():
    assert NOTEBOOKS, "no notebooks found"
    for nb in NOTEBOOKS:
        data = json.loads(nb.read_text())
        code = [c for c in data["cells"] if c["cell_type"] == "code"]
        assert code and "parameters" in code[0].get("metadata", {}).get("tags", []), f"{nb.name}: no parameters cell"
        assert not any(c.get("outputs") or c.get("execution_count") for c in code), f"{nb.name} has outputs"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(nb, tmp_path):
    out = run_notebook(nb, tmp_path, CI.get(nb.stem, {}), timeout=900)
    data = json.loads(out.read_text())
    errors = [o for c in data["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert any((tmp_path / nb.stem).glob("*.html")), f"{nb.name} wrote no figure"
    assert cdn_references(out.read_text()) == [], f"{nb.name}: an executed output loads from the network"


def test_make_run_takes_a_matrix_a_cpu_finishes():
    # notebook 06's full micro matrix is hours on a 2-core CPU (one papermill cell past its limit): without a GPU
    # `make run` gives it the quick matrix, with one the notebook's own; every other notebook gets DEFAULTS either way
    from kimik3.validation import default_config, quick_config

    assert default_params("06_validation", gpu=False) == {"quick": True}
    assert default_params("06_validation", gpu=True) == DEFAULTS.get("06_validation", {})
    for nb in NOTEBOOKS:
        if nb.stem not in CPU_DEFAULTS:
            assert default_params(nb.stem, gpu=False) == default_params(nb.stem, gpu=True) == DEFAULTS.get(nb.stem, {})
    quick, full = quick_config("cpu"), default_config(["micro"], "cpu")
    assert len(quick.contexts) * len(quick.seeds) * quick.steps < len(full.contexts) * len(full.seeds) * full.steps
