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


def write(path: str, cells: list) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    nbformat.write(nb, path)
