"""Source hashes of the kernel modules (no CuTe DSL import, so a GPU machine can verify prebuilt kernels).

A kernel op's hash covers its module file, the modules whose device code it inlines, the DSL-free contract
modules it takes its constants from (``isa.py``, ``meta.py``: the host reads the same files) and ``_common.py``
(device helpers). A prebuilt artefact is only used when this hash still matches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# device code pulled in from other kernel modules (router launches gemv.gemv_kernel; the megakernel inlines the
# device functions of device_fns.py; gemv, moe, mla_decode and kda take their trace-time host switch from _trace.py,
# attn_res through _common's MXFP4 helpers)
DEPENDENCIES: dict[str, tuple[str, ...]] = {"router": ("gemv", "_trace"), "megakernel": ("device_fns",),
                                           "gemv": ("_trace",), "moe": ("_trace",), "mla_decode": ("_trace",),
                                           "kda": ("_trace",), "attn_res": ("_trace",)}
# The megakernel's opcode families, one module each (the VM in megakernel.py dispatches to them): hashed with the
# megakernel (through CONTRACTS below, which every kernel's hash and the hash-coverage test read)
OPCODE_MODULES: tuple[str, ...] = ("mk_operands", "mk_mma", "mk_gemv", "mk_kda", "mk_mla", "mk_moe", "mk_misc")
# DSL-free contract modules a kernel module imports (the megakernel's instruction encoding; the fused kernels'
# layouts, eps values and parameter order): they decide what the kernel compiles to, so its hash covers them
CONTRACTS: dict[str, tuple[str, ...]] = {
    # meta through _common (the supported architectures); mk_addr: the address arithmetic the opcodes share with
    # the host's address replay; then the VM's opcode modules (device code the megakernel inlines) and the trace-time
    # host switch some of them take from _trace.py
    "megakernel": ("isa", "meta", "mk_addr", *OPCODE_MODULES, "_trace"),
    **{m: ("meta",) for m in ("gemv", "router", "kda", "mla_decode", "moe", "attn_res")},
}


def kernel_source_hash(module_name: str) -> str:
    """sha256 over ``<module>.py``, its DEPENDENCIES, its CONTRACTS and ``_common.py``, in that order."""
    h = hashlib.sha256()
    for name in (module_name, *DEPENDENCIES.get(module_name, ()), *CONTRACTS.get(module_name, ()), "_common"):
        path = KERNEL_DIR / f"{name}.py"
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()
