"""Tiny helper to write notebooks from Python lists of cells (the committed .ipynb files are the source;
this only saves hand-writing JSON). Usage: ``write(path, [md("..."), code("...", tags=["parameters"]), ...])``."""

from __future__ import annotations

import nbformat


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = tags
    return cell


def notebook(cells: list, stable_ids: bool = False) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    if stable_ids:
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"c{i:02d}"  # regenerating gives an identical file
    return nb


def write(path: str, cells: list) -> None:
    nb = notebook(cells)
    nbformat.validate(nb)
    nbformat.write(nb, path)


def from_pairs(pairs: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """("md" | "code", source) pairs -> a notebook whose first code cell is tagged ``parameters``, stable ids."""
    cells, first_code = [], True
    for kind, src in pairs:
        if kind == "md":
            cells.append(nbformat.v4.new_markdown_cell(src))
        else:
            cell = nbformat.v4.new_code_cell(src)
            if first_code:
                cell.metadata["tags"] = ["parameters"]
                first_code = False
            cells.append(cell)
    return notebook(cells, stable_ids=True)
