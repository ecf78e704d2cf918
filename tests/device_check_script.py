"""scripts/device_check.py is a script of the repository, not part of the library: the tests load it by path, once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"


def load_script() -> ModuleType:
    if "device_check" in sys.modules:
        return sys.modules["device_check"]
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def build_prebuilt(out: Path, *select: str) -> Path:
    """``scripts/device_check.py --build-prebuilt OUT [selection]``: the kernels the device check runs, exported into
    ``out``."""
    import pytest

    pytest.importorskip("cutlass")  # exporting compiles: needs the CuTe DSL (the CPU machines of CI have it)
    pytest.importorskip("tvm_ffi")
    assert load_script().main(["--build-prebuilt", str(out), *select]) == 0
    return out
