"""Source hashes of the kernel modules (no CuTe DSL import, so a GPU machine can verify prebuilt kernels).

A kernel op's hash covers its module file, the modules whose device code it inlines, and
``_common.py`` (device helpers). A prebuilt artefact is only used when this hash still matches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# device code pulled in from other kernel modules (router launches gemv.gemv_kernel; the megakernel inlines the
# device functions of device_fns.py)
DEPENDENCIES: dict[str, tuple[str, ...]] = {"router": ("gemv",), "megakernel": ("device_fns",)}


def kernel_source_hash(module_name: str) -> str:
    """sha256 over ``<module>.py``, its DEPENDENCIES and ``_common.py``, in that order."""
    h = hashlib.sha256()
    for name in (module_name, *DEPENDENCIES.get(module_name, ()), "_common"):
        path = KERNEL_DIR / f"{name}.py"
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()
