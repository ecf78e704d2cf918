"""Make ``kimik3.kernels`` importable wherever the repository is, installed or not.

``kimik3.kernels`` is the top-level ``kernels/`` folder. An install maps it there (a setuptools package-dir entry in
``pyproject.toml``, so that a top-level ``kernels`` package does not shadow the PyPI package of that name). A bare
copy of the repository (a GPU machine running from a checkout, no install) has no such mapping: there, the package
also searches the repository root for its subpackages, and ``kimik3.kernels`` is found by the ordinary import
system like any other subpackage. This module is the package's first import, so every later import can rely on it;
importing ``kimik3.kernels`` itself imports no CuTe DSL.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["KERNELS_DIR"]

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"

_package = sys.modules[__name__.rpartition(".")[0]]
if importlib.util.find_spec(f"{_package.__name__}.kernels") is None and (KERNELS_DIR / "__init__.py").is_file():
    _package.__path__.append(str(KERNELS_DIR.parent))
