"""Source hashes of the kernels (no CuTe DSL import, so a GPU machine can verify prebuilt kernels).

A kernel op's hash covers the device files it compiles from: its own module, the modules whose device code it
inlines, the DSL-free contracts it takes constants from, the shared device helpers and the DSL compile plumbing.
Reference inputs (``kernels/reference/``) and host verification (``kernels/verify/``) are never hashed: editing
them invalidates no prebuilt artefact. A prebuilt artefact is used only while this hash still matches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["KERNEL_DIR", "OPS", "OPCODE_MODULES", "DEPENDENCIES", "CONTRACTS", "COMMON", "UNHASHED_ROOMS",
           "module_path", "hashed_modules", "kernel_source_hash"]

KERNEL_DIR = Path(__file__).resolve().parents[1]
# kernel op (the name the registry, the prebuilt manifest and the build cache use) -> its module under kernels/
OPS: dict[str, str] = {"gemv": "fused.gemv", "router": "fused.router", "kda": "fused.kda",
                       "mla_decode": "fused.mla_decode", "moe": "fused.moe", "attn_res": "fused.attn_res",
                       "megakernel": "megakernel.vm", "probe_bandwidth": "probes.bandwidth",
                       "probe_latency": "probes.latency", "probe_signal": "probes.signal"}
# device code pulled in from other kernel modules (router launches gemv.gemv_kernel; the megakernel inlines the
# device functions of megakernel/device_fns.py; the fused kernels take their trace-time host switch from
# common/trace.py)
DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "router": ("fused.gemv", "common.trace"), "megakernel": ("megakernel.device_fns",),
    **{m: ("common.trace",) for m in ("gemv", "moe", "mla_decode", "kda", "attn_res")},
    "probe_latency": ("probes.bandwidth",)}
# The megakernel's opcode families, one module each (the VM in megakernel/vm.py dispatches to them)
OPCODE_MODULES: tuple[str, ...] = ("megakernel.operands", "megakernel.mma", "megakernel.gemv", "megakernel.kda",
                                   "megakernel.mla", "megakernel.router", "megakernel.moe", "megakernel.misc",
                                   "megakernel.collective")
# DSL-free contracts a kernel module imports (the megakernel's instruction encoding and address arithmetic; the fused
# kernels' layouts, eps values and parameter order): they decide what the kernel compiles to
CONTRACTS: dict[str, tuple[str, ...]] = {
    "megakernel": ("contracts.isa", "contracts.peers", "contracts.meta", "contracts.addr", *OPCODE_MODULES,
                   "common.trace"),
    **{m: ("contracts.meta",) for m in ("gemv", "router", "kda", "mla_decode", "moe", "attn_res")},
    **{m: ("contracts.meta", "common.trace") for m in ("probe_bandwidth", "probe_latency", "probe_signal")},
}
# hashed into every kernel: the shared device helpers and the compile plumbing (target, options)
COMMON: tuple[str, ...] = ("common.device", "toolchain.dsl")
# rooms no kernel's hash may cover
UNHASHED_ROOMS: tuple[str, ...] = ("reference", "verify")


def module_path(name: str) -> Path:
    """The file of a kernel op (``"gemv"``) or of a module named from ``kernels/`` (``"common.trace"``)."""
    return KERNEL_DIR / (OPS.get(name, name).replace(".", "/") + ".py")


def hashed_modules(op: str) -> tuple[str, ...]:
    """The modules (named from ``kernels/``) whose bytes make up ``op``'s hash, in hashing order."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; expected one of {sorted(OPS)}")
    return (OPS[op], *DEPENDENCIES.get(op, ()), *CONTRACTS.get(op, ()), *COMMON)


def kernel_source_hash(op: str) -> str:
    """sha256 over the files of :func:`hashed_modules`, each preceded by its module name."""
    h = hashlib.sha256()
    for name in hashed_modules(op):
        h.update(name.encode() + b"\0")
        h.update(module_path(name).read_bytes())
    return h.hexdigest()
