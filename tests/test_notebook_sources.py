"""Notebooks are code: each `.ipynb` is paired with a jupytext percent-format `.py`, its source of truth.

The pair must hold the same cells (kind, source, tags); CI fails when one was edited without `jupytext --sync`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PAIRS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", ()))) for c in nb.cells]


def pair_divergence(ipynb: Path) -> list[str]:
    """What differs between a notebook and its paired `.py` source (empty when in sync)."""
    source = ipynb.with_suffix(".py")
    if not source.exists():
        return [f"{ipynb.name}: no paired source {source.name}"]
    a, b = _cells(jupytext.read(source)), _cells(jupytext.read(ipynb))
    problems = []
    if len(a) != len(b):
        problems.append(f"{ipynb.name}: {len(a)} cells in {source.name}, {len(b)} in the notebook")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            problems.append(f"{ipynb.name}: cell {i} differs ({x[0]}: {x[1][:60]!r} vs {y[0]}: {y[1][:60]!r})")
    fmt = jupytext.read(ipynb).metadata.get("jupytext", {}).get("formats", "")
    if "py:percent" not in fmt:
        problems.append(f"{ipynb.name}: not paired with a py:percent source (jupytext formats {fmt!r})")
    return problems


def test_every_notebook_has_a_percent_source() -> None:
    assert PAIRS, "no notebooks found"
    sources = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    assert [p.stem for p in sources] == [p.stem for p in PAIRS]
    for src in sources:
        assert src.read_text().lstrip().startswith("# ---"), f"{src.name} lacks the jupytext header"


@pytest.mark.parametrize("ipynb", PAIRS, ids=[p.stem for p in PAIRS])
def test_pair_in_sync(ipynb: Path) -> None:
    assert pair_divergence(ipynb) == []


@pytest.mark.parametrize("ipynb", PAIRS, ids=[p.stem for p in PAIRS])
def test_cell_ids_are_committed(ipynb: Path) -> None:
    nb = jupytext.read(ipynb)
    ids = [c.get("id") for c in nb.cells]
    assert all(ids) and len(set(ids)) == len(ids), f"{ipynb.name}: missing or repeated cell ids"


def test_planted_divergence_is_caught(tmp_path: Path) -> None:
    src = PAIRS[0]
    shutil.copy(src, tmp_path / src.name)
    shutil.copy(src.with_suffix(".py"), tmp_path / src.with_suffix(".py").name)
    assert pair_divergence(tmp_path / src.name) == []
    py = tmp_path / src.with_suffix(".py").name
    py.write_text(py.read_text() + "\n# %%\nprint('edited only in the source')\n")
    assert any("cells" in p for p in pair_divergence(tmp_path / src.name))
    shutil.copy(src.with_suffix(".py"), py)
    text = py.read_text()
    marker = "# %%\n"
    i = text.rindex(marker)
    py.write_text(text[: i + len(marker)] + "x_planted = 1\n" + text[i + len(marker):])
    assert any("differs" in p for p in pair_divergence(tmp_path / src.name))
