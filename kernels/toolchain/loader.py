"""Where a GPU stage's compiled CuTe DSL kernels come from: the DSL's JIT, or verified prebuilt artefacts.

Stage ``fused`` (:func:`kimik3.fused.loading.load_kernels`) and stage ``megakernel`` (:mod:`kimik3.megakernel.gpu`)
load their kernels here, by the same rules. JIT (``nvidia-cutlass-dsl`` installed): compiled in-process to a
TVM-FFI function, once per process per (arch, module, variant, static shapes) — :func:`jit_compiled`. Prebuilt (a
GPU machine without the DSL compiler): the ``.so`` files ``kimik3.kernels.toolchain.prebuilt`` exported, from an
explicit directory, ``$KIMIK3_PREBUILT`` or ``<repo>/prebuilt`` (:func:`default_prebuilt_dir`); every load passes
the prebuilt module's checks (manifest entry, source hash, arch, static shapes, file sha256) and a mismatch is a
``ValueError`` naming it: a stale or foreign kernel never runs. See docs/architecture.md (map).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

__all__ = [
    "PREBUILT_ENV",
    "KERNEL_SOURCES",
    "dsl_available",
    "default_prebuilt_dir",
    "resolve_source",
    "norm_shapes",
    "jit_compiled",
    "find_prebuilt",
    "load_prebuilt_fn",
    "load_prebuilt_kernel",
]

_REPO = Path(__file__).resolve().parents[2]
PREBUILT_ENV = "KIMIK3_PREBUILT"
KERNEL_SOURCES = ("auto", "jit", "prebuilt")

# per process: JIT-compiled kernels, loaded prebuilt functions, and the prebuilt directories whose DSL runtime
# library is already loaded (locating and loading it costs a subprocess, so it happens once per directory)
_JIT_CACHE: dict[Hashable, Any] = {}
_PREBUILT_FNS: dict[tuple[str, str], Any] = {}
_RUNTIME_READY: set[str] = set()


def dsl_available() -> bool:
    """True when the CuTe DSL compiler can be imported (the JIT path)."""
    return importlib.util.find_spec("cutlass") is not None


def default_prebuilt_dir() -> Path | None:
    """``$KIMIK3_PREBUILT``, else ``<repo>/prebuilt`` when it holds a manifest, else None."""
    env = os.environ.get(PREBUILT_ENV)
    if env:
        return Path(env)
    d = _REPO / "prebuilt"
    return d if (d / "manifest.json").exists() else None


def resolve_source(source: str, prebuilt_dir: str | os.PathLike | None) -> str:
    """``"jit"`` or ``"prebuilt"`` for a requested kernel source: ``"auto"`` means the JIT when the DSL is installed
    and no prebuilt directory was given, else the prebuilt kernels."""
    if source not in KERNEL_SOURCES:
        raise ValueError(f"kernels must be one of {KERNEL_SOURCES}, got {source!r}")
    if source == "auto":
        return "prebuilt" if prebuilt_dir is not None or not dsl_available() else "jit"
    return source


def norm_shapes(shapes: dict[str, Any]) -> str:
    """Static shapes as a canonical string: the identity of a compiled kernel next to its module and variant."""
    return json.dumps(shapes, sort_keys=True, default=str)


def jit_compiled(key: Hashable, compile_fn: Callable[[], Any]) -> Any:
    """``compile_fn()``, once per process for ``key`` (compiling a kernel takes seconds to minutes)."""
    if key not in _JIT_CACHE:
        _JIT_CACHE[key] = compile_fn()
    return _JIT_CACHE[key]


def find_prebuilt(manifest: dict[str, Any], module: str, variant: str, arch: str, shapes: dict[str, Any]
                  ) -> str | None:
    """The name of the manifest entry for this kernel module, variant, arch and static shapes, or None."""
    want = norm_shapes(shapes)
    for name, e in sorted(manifest.get("kernels", {}).items()):
        if (e.get("module"), e.get("variant"), e.get("arch")) == (module, variant, arch) \
                and norm_shapes(e.get("shapes", {})) == want:
            return name
    return None


def load_prebuilt_fn(directory: Path, manifest: dict[str, Any], name: str, arch: str, shapes: dict[str, Any]) -> Any:
    """The TVM-FFI function of one prebuilt kernel, or None for a cubin-only export.

    ``load_prebuilt`` once per directory (it verifies and loads the DSL runtime library, which costs a subprocess
    per call), then the same verification (``_verify``: source hash, arch, shapes, file hashes) and a plain TVM-FFI
    module load for the other kernels; each kernel is loaded once per process."""
    from kimik3.kernels.toolchain import prebuilt as pb

    key = (str(directory.resolve()), name)
    if key in _PREBUILT_FNS:
        return _PREBUILT_FNS[key]
    if key[0] not in _RUNTIME_READY:
        fn = pb.load_prebuilt(directory, name, arch=arch, shapes=shapes).fn
        if fn is not None:
            _RUNTIME_READY.add(key[0])
    else:
        e = pb._verify(directory, manifest, name, arch, shapes, True)
        fn = None
        if e.get("format") == "tvm-ffi":
            import tvm_ffi

            fn = tvm_ffi.load_module(str(directory / e["files"]["so"]))[e["function_name"]]
    _PREBUILT_FNS[key] = fn
    return fn


def load_prebuilt_kernel(directory: str | os.PathLike, name: str, arch: str, shapes: dict[str, Any]) -> Any:
    """One prebuilt kernel as a callable :class:`kimik3.kernels.toolchain.prebuilt.PrebuiltKernel`, after every check of
    :func:`kimik3.kernels.toolchain.prebuilt.load_prebuilt` (a ``ValueError`` naming what does not match)."""
    from kimik3.kernels.toolchain.prebuilt import load_prebuilt

    return load_prebuilt(directory, name, arch=arch, shapes=shapes)
