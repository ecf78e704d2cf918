"""The host JIT's float -> bf16 conversion, for CPUs that have no instruction for it.

Host execution JIT-compiles the kernels' ``@cute.jit`` helpers for this CPU. Where the CPU has no bf16 conversion
instruction (x86 without AVX512-BF16: AMD Zen 3, older Intel), LLVM lowers ``fptrunc f32 -> bf16`` to a call of
compiler-rt's ``__truncsfbf2``, which neither the DSL runtime nor Debian 12's libgcc exports: every helper that
rounds to bf16 then fails to link ("Symbols not found: [ __truncsfbf2 ]"). :func:`ensure_bf16_conversion` builds a
one-function library with the semantics of the instruction the same code gets on a CPU that has it
(``VCVTNEPS2BF16``: round to nearest even, denormal inputs and outputs flushed to signed zero, NaN quieted) and
appends it to ``CUTE_DSL_LIBS``; call it before the CuTe DSL is imported (``kernels/verify/__init__.py`` does).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["SOURCE", "ensure_bf16_conversion", "runtime_libraries"]

SOURCE = r"""
#include <stdint.h>
#include <string.h>
/* bf16 is returned in the low half of xmm0, as _Float16 is */
_Float16 __truncsfbf2(float a) {
  uint32_t u;
  uint16_t r;
  _Float16 h;
  memcpy(&u, &a, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) r = (uint16_t)((u >> 16) | 0x0040u);      /* NaN: quiet, sign kept */
  else if ((u & 0x7f800000u) == 0) r = (uint16_t)((u >> 16) & 0x8000u);          /* denormal or zero: signed 0 */
  else r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                   /* nearest even */
  memcpy(&h, &r, 2);
  return h;
}
"""
_VAR = "CUTE_DSL_LIBS"


def runtime_libraries() -> list[str]:
    """The DSL runtime library the DSL would find by itself (the installed package's ``lib`` or ``cu*/lib``)."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    return [str(p) for pattern in ("lib/libcute_dsl_runtime.so", "cu*/lib/libcute_dsl_runtime.so")
            for p in sorted(root.glob(pattern))][:1]


def _build() -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    root = Path(os.environ.get("KIMIK3_CACHE") or Path.home() / ".cache" / "kimik3")
    target = root / "host-runtime" / hashlib.sha256(SOURCE.encode()).hexdigest()[:16] / "libkimik3_bf16.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "bf16.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], capture_output=True, text=True,
                           timeout=120)
        if r.returncode:
            return None
        os.replace(out, target)  # atomic: a concurrent build writes the same bytes
    return target


def ensure_bf16_conversion() -> None:
    """Append the conversion library to ``CUTE_DSL_LIBS`` (keeping what it names, or the runtime the DSL would find
    itself); without a C compiler nothing changes, and the DSL's own error names the missing symbol."""
    current = [p for p in os.environ.get(_VAR, "").split(os.pathsep) if p]
    if any(Path(p).name == "libkimik3_bf16.so" for p in current):
        return
    base = current or runtime_libraries()
    lib = _build() if base else None
    if lib is not None:
        os.environ[_VAR] = os.pathsep.join([*base, str(lib)])
