"""The DSL's compile plumbing every kernel module uses: target-architecture scope, fake tensors for compiling
without a GPU, compile options, PTX / cubin artefacts (content or a path, guide pitfall 8), launching a compiled op,
the DSL version and a module's source hash. It decides what a kernel compiles to, so every kernel's source hash
covers it (``kernels/toolchain/source.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import cutlass
import torch
from cutlass import BFloat16, Float32, Int32, Uint8
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from kimik3.kernels.contracts.meta import SUPPORTED_ARCHS  # defined with the rest of the kernels' host-visible metadata


@contextlib.contextmanager
def arch_scope(arch: str) -> Iterator[None]:
    """Compile for ``arch``: set CUTE_DSL_ARCH and the DSL's cached copy of it, restore afterwards.

    ``--gpu-arch`` in the options alone already selects the target (checked: sm_90a and sm_100a
    alternate fine in one process), but some trace-time checks consult the environment copy, and
    without either the DSL silently targets sm_100a (guide pitfall 1).
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}")
    from cutlass.cutlass_dsl import CuTeDSL

    old_env = os.environ.get("CUTE_DSL_ARCH")
    envar = CuTeDSL._get_dsl().envar
    old_arch = getattr(envar, "_arch", None)
    os.environ["CUTE_DSL_ARCH"] = arch
    envar.arch = arch
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = old_env
        if old_arch is not None:
            envar.arch = old_arch


def fake(dtype: Any, shape: Sequence[Any], align: int = 16) -> Any:
    """A row-major fake tensor (no data, no GPU needed) with a 16-byte aligned base pointer."""
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(dtype, tuple(shape), stride_order=order, assumed_align=align)


def fake_stream(tvm_ffi: bool = False) -> Any:
    """A stream placeholder; with TVM-FFI the caller's current torch stream is used implicitly."""
    return make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)


_DUMP_DIR: list[str] = []  # stack: innermost dump_dir_scope wins


@contextlib.contextmanager
def dump_dir_scope(path: str | os.PathLike) -> Iterator[None]:
    """Write the kept PTX/cubin of compiles inside the block to ``path``."""
    _DUMP_DIR.append(str(path))
    try:
        yield
    finally:
        _DUMP_DIR.pop()


def _default_dump_dir() -> str:
    # Kept artefacts would otherwise land in the current directory (the DSL's default dump dir).
    if not _DUMP_DIR:
        d = tempfile.mkdtemp(prefix="kimik3-cute-")
        atexit.register(shutil.rmtree, d, ignore_errors=True)
        _DUMP_DIR.insert(0, d)
    return _DUMP_DIR[-1]


def compile_options(arch: str, *, tvm_ffi: bool = False, keep: bool = True, remark_file: str | None = None) -> str:
    """Options string for ``cute.compile``: explicit target, artefacts kept (in the current dump dir,
    never the working directory), ptxas report to a YAML file."""
    opts = [f"--gpu-arch {arch}"]
    if keep:
        opts.append(f"--keep-ptx --keep-cubin --dump-dir {_default_dump_dir()}")
    if remark_file:
        opts.append(f"remarks{{ptx}} --remark-output {remark_file}")
    if tvm_ffi:
        opts.append("--enable-tvm-ffi")
    return " ".join(opts)


def artifact_text(value: Any) -> str:
    """``compiled.__ptx__`` is the PTX text or a path to it, depending on the keep options."""
    if isinstance(value, (str, os.PathLike)) and len(str(value)) < 4096 and os.path.exists(value):
        return Path(value).read_text()
    return value if isinstance(value, str) else (value.decode() if isinstance(value, bytes) else "")


def artifact_bytes(value: Any) -> bytes:
    """``compiled.__cubin__`` is the cubin bytes or a path to it."""
    if isinstance(value, (str, os.PathLike)) and len(str(value)) < 4096 and os.path.exists(value):
        return Path(value).read_bytes()
    return value if isinstance(value, bytes) else b""


_TORCH_DTYPES = {BFloat16: torch.bfloat16, Float32: torch.float32, Int32: torch.int32, Uint8: torch.uint8}


def torch_dtype(dtype: Any) -> torch.dtype:
    return _TORCH_DTYPES[dtype]


def launch(compiled: Any, args: Sequence[Any], tvm_ffi: bool) -> None:
    """Call a compiled op on CUDA tensors, every parameter positional (None for an absent optional
    tensor, a float for a scalar): the compiled signature keeps the None parameters.

    With TVM-FFI the torch tensors go in directly and the current torch stream is used (checked on CPU:
    the call is rejected only for the device type). Without it, tensors are wrapped with
    ``from_dlpack`` (16-byte alignment asserted, static layout as compiled) and the current stream is
    passed explicitly: that path is not exercised without a GPU.
    """
    if tvm_ffi:
        compiled(*args)
        return
    from cuda.bindings.driver import CUstream
    from cutlass.cute.runtime import from_dlpack

    wrapped = [from_dlpack(a, assumed_align=16) if isinstance(a, torch.Tensor) else a for a in args]
    compiled(*wrapped, CUstream(torch.cuda.current_stream().cuda_stream))


def dsl_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover - the wheel always has metadata
        return getattr(cutlass, "__version__", "unknown")


def source_hash(module: ModuleType) -> str:
    """sha256 of the kernel module's source, the kernel modules it inlines, the device helpers and this file (see
    ``kernels/toolchain/source.py``), as captured when the module was (re)imported, i.e. of the code that actually
    gets compiled."""
    from kimik3.kernels.toolchain.source import kernel_source_hash

    return getattr(module, "SOURCE_HASH", None) or kernel_source_hash(module.__name__.rsplit(".", 1)[-1])


