"""Ahead-of-time kernels (guide §7): build on a CPU machine, ship a directory, load on the GPU machine.

:func:`build_prebuilt` compiles each registry variant into ``<name>.so`` (``tvm-ffi`` format, when
``apache-tvm-ffi`` is installed: torch CUDA tensors on the current stream) and always ``<name>.cubin`` +
``<name>.ptx`` (the device code alone, with what a ``cuLaunchKernel`` launcher needs per entry, guide §7.3), and
records each kernel in ``manifest.json``. :func:`load_prebuilt` refuses, with a ``ValueError`` naming the mismatch,
a kernel whose source hash, architecture, static shapes or file hashes differ: a stale kernel is never run.
CLI: ``python -m kimik3 kernels build --arch sm_90a --out DIR [--preset k3-shard] [--batch 1,8]
[--expert-format mxfp4]`` (``kimik3/__main__.py`` forwards to :func:`main`). The artefacts and the manifest:
docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimik3.kernels.toolchain.registry import EXPERT_FORMATS, FAMILIES, KernelVariant, get_variant, variants_for
from kimik3.kernels.toolchain.source import kernel_source_hash

from kimik3.util.args import output_folder, positive_int_list
from kimik3.util.files import check_output_folder
from kimik3.util.text import refuse

__all__ = ["build_prebuilt", "load_prebuilt", "read_manifest", "PrebuiltKernel", "main", "MANIFEST", "FORMATS"]

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
FORMATS = ("tvm-ffi", "cubin")
RUNTIME_LIB = "libcute_dsl_runtime.so"
_ARCH_CC = {"sm_90a": (9, 0), "sm_100a": (10, 0)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _function_name(name: str) -> str:
    """A C identifier from a variant name: gemv.plain/k3-shard/b8 -> gemv_plain__k3_shard__b8."""
    return re.sub(r"\W", "_", name.replace("/", "__"))


def _dsl_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:
        return None


def _aot_config(*flags: str) -> str:
    return subprocess.check_output([sys.executable, "-m", "cutlass.cute.export.aot_config", *flags], text=True).strip()


def _tvm_ffi_available() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _ptx_entries(ptx: str, smem: dict[str, int]) -> list[dict[str, Any]]:
    """Per .entry: name, parameter byte sizes, block shape and dynamic shared memory (pointer-only ABI)."""
    out = []
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)\s*(.*?)\{", ptx, re.S):
        name, params, directives = m.groups()
        sizes = []
        for decl in params.split(","):
            if not decl.strip():
                continue
            b = re.search(r"\.b8\s+\w+\[(\d+)\]", decl)
            sizes.append(int(b.group(1)) if b else 4 if re.search(r"\.[usbf]32", decl) else 8)
        block = re.search(r"\.reqntid\s+(\d+),\s*(\d+),\s*(\d+)", directives)
        dyn = sum(v for label, v in smem.items() if name.startswith(f"kernel_cutlass_{label}_kernel"))
        out.append({"name": name, "param_bytes": sizes, "block": [int(x) for x in block.groups()] if block else None,
                    "dynamic_shared_bytes": dyn, "pointer_only": all(s in (4, 8) for s in sizes)})
    return out


def _compress(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, lzma.open(dst, "wb", preset=6) as g:
        shutil.copyfileobj(f, g, 1 << 20)


def build_prebuilt(arch: str, out_dir: str | os.PathLike, variants: Sequence[KernelVariant | str], *,
                   fmt: str = "auto", ship_runtime: bool = False, log: Callable[[str], None] | None = print
                   ) -> dict[str, Any]:
    """Export ``variants`` for ``arch`` into ``out_dir`` and write its manifest (returned).

    ``fmt``: ``tvm-ffi`` (a loadable .so per kernel, plus cubin/PTX), ``cubin`` (cubin/PTX only) or
    ``auto`` (tvm-ffi when apache-tvm-ffi and g++ are available). An existing manifest in ``out_dir``
    is extended: kernels built earlier for the same arch stay listed unless rebuilt.
    """
    from kimik3.kernels.common import device as C
    from kimik3.kernels.toolchain import dsl
    from kimik3.kernels.toolchain.build import check_budget, parse_ptxas_report, store

    if arch not in dsl.SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {dsl.SUPPORTED_ARCHS}")
    if fmt == "auto":
        fmt = "tvm-ffi" if _tvm_ffi_available() else "cubin"
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS} or 'auto'")
    if fmt == "tvm-ffi" and not _tvm_ffi_available():
        raise RuntimeError("format tvm-ffi needs `pip install apache-tvm-ffi` and g++")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    libdir = _aot_config("--libdir")
    link_flags = _aot_config("--ldflags", "--libs").split() if fmt == "tvm-ffi" else []
    manifest = _existing_manifest(out, arch)
    manifest.update({"format_version": MANIFEST_VERSION, "arch": arch, "dsl_version": dsl.dsl_version(),
                     "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})
    manifest.setdefault("kernels", {})
    resolved = [get_variant(v) if isinstance(v, str) else v for v in variants]
    for v in resolved:
        if arch not in v.archs:
            raise ValueError(f"{v.name} does not support {arch} (supports {v.archs})")
        t0 = time.perf_counter()
        fn = _function_name(v.name)
        files: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="kimik3-aot-") as tmp:
            remark = Path(tmp) / "ptxas.yaml"
            with dsl.dump_dir_scope(tmp), C.smem_log() as smem:
                compiled = v.compile(arch, tvm_ffi=(fmt == "tvm-ffi"), remark_file=str(remark))
            seconds = time.perf_counter() - t0
            ptx, cubin = dsl.artifact_text(compiled.__ptx__), dsl.artifact_bytes(compiled.__cubin__)
            (out / f"{fn}.ptx").write_text(ptx)
            (out / f"{fn}.cubin").write_bytes(cubin)
            files.update(ptx=f"{fn}.ptx", cubin=f"{fn}.cubin")
            if fmt == "tvm-ffi":
                obj = Path(tmp) / f"{fn}.o"
                compiled.export_to_c(str(obj), function_name=fn)
                cxx = os.environ.get("CXX", "g++")
                subprocess.run([cxx, "-shared", "-o", str(out / f"{fn}.so"), str(obj), *link_flags,
                                "-Wl,-rpath,$ORIGIN", f"-Wl,-rpath,{libdir}"], check=True, capture_output=True)
                files["so"] = f"{fn}.so"
            report = remark.read_text() if remark.exists() else ""
        kernels = parse_ptxas_report(report)
        if kernels:  # the device code build() compiles: later builds of this variant load it from the cache
            kernels = store(v, arch, ptx, cubin, report, smem, seconds).kernels
        entry = {
            "family": v.family, "module": v.module_name, "variant": v.variant, "preset": v.preset, "batch": v.batch,
            "expert_format": getattr(v, "expert_format", "dense"), "shapes": v.shapes, "runtime": v.runtime,
            "source_hash": dsl.source_hash(v.module),
            "dsl_version": dsl.dsl_version(), "arch": arch, "format": fmt, "function_name": fn, "files": files,
            "sha256": {kind: _sha256(out / f) for kind, f in files.items()},
            "entries": _ptx_entries(ptx, smem), "ptxas": kernels,
            "budget_violations": check_budget(_Report(kernels), v.budget) if kernels else ["no ptxas report"],
        }
        manifest["kernels"][v.name] = entry
        if log:
            regs = [k["registers"] for k in kernels]
            log(f"built {v.name} ({fmt}, {arch}) in {time.perf_counter() - t0:.1f}s, registers {regs}")
    runtime = Path(libdir) / RUNTIME_LIB
    manifest["runtime"] = {"library": RUNTIME_LIB, "build_path": str(runtime),
                           "sha256": _sha256(runtime) if runtime.exists() else None, "shipped": None}
    if ship_runtime and runtime.exists():
        _compress(runtime, out / f"{RUNTIME_LIB}.xz")
        manifest["runtime"]["shipped"] = f"{RUNTIME_LIB}.xz"
    # written last and atomically: an interrupted build leaves no manifest, so the loader refuses the folder
    from kimik3.util.files import atomic_write_text

    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=str))
    return manifest


@dataclass
class _Report:  # the two attributes check_budget reads
    kernels: list[dict[str, Any]]


def holds_prebuilt(out: Path) -> bool:
    """Whether ``out`` holds only what :func:`build_prebuilt` wrote there: its manifest and the files the manifest
    lists (so building into it again loses nothing of anyone else's)."""
    try:
        m = json.loads((Path(out) / MANIFEST).read_text())
        if not (isinstance(m, dict) and "format_version" in m and isinstance(m.get("kernels"), dict)):
            return False
        listed = {MANIFEST, f"{RUNTIME_LIB}.xz"}
        for entry in m["kernels"].values():
            listed.update(entry["files"].values())
        return {e.name for e in Path(out).iterdir()} <= listed
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def _existing_manifest(out: Path, arch: str) -> dict[str, Any]:
    try:
        m = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return m if m.get("arch") == arch else {}


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text())
    except OSError:
        raise ValueError(f"no prebuilt kernels in {directory}: {path} is missing") from None
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


@dataclass
class PrebuiltKernel:
    """A verified prebuilt kernel. ``fn`` is the TVM-FFI function (tvm-ffi format) or None (cubin)."""

    name: str
    entry: dict[str, Any]
    directory: Path
    fn: Any = None
    cubin: bytes | None = field(default=None, repr=False)

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:
            entries = [e["name"] for e in self.entry["entries"]]
            raise NotImplementedError(f"{self.name} was exported as a cubin only; launch its entries {entries} with "
                                      "cuda-python (guide §7.3) or rebuild with format tvm-ffi")
        return self.fn(*args)


def _cuda_arch() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        cc = torch.cuda.get_device_capability()
    except Exception:
        return None
    return next((a for a, c in _ARCH_CC.items() if c == cc), f"sm_{cc[0]}{cc[1]}")


def _normalise(shapes: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(shapes, sort_keys=True, default=str))


def _verify(directory: Path, manifest: dict[str, Any], name: str, arch: str | None, shapes: dict[str, Any] | None,
            verify_files: bool) -> dict[str, Any]:
    kernels = manifest.get("kernels", {})
    if name not in kernels:
        raise ValueError(f"kernel {name!r} is not in {directory / MANIFEST}; available: {sorted(kernels)}")
    e = kernels[name]
    want_arch = arch or _cuda_arch()
    if want_arch is not None and e.get("arch") != want_arch:
        raise ValueError(f"prebuilt kernel {name!r} was built for arch {e.get('arch')!r}, but {want_arch!r} was "
                         f"requested{'' if arch else ' (the GPU here)'}: rebuild with --arch {want_arch}")
    if shapes is not None:
        got, want = _normalise(e.get("shapes", {})), _normalise(shapes)
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        if diff:
            detail = ", ".join(f"{k}: built {got.get(k)!r}, requested {want.get(k)!r}" for k in diff)
            raise ValueError(f"prebuilt kernel {name!r} has different static shapes ({detail})")
    module = e.get("module") or FAMILIES[e["family"]].module
    current = kernel_source_hash(module)
    if e.get("source_hash") != current:
        raise ValueError(f"prebuilt kernel {name!r} is stale: source hash {str(e.get('source_hash'))[:12]}... "
                         f"recorded, but the current kernels/{module}.py (+ deps, contracts, _common.py) hash is "
                         f"{current[:12]}...; rebuild it")
    dsl = _dsl_version()
    if dsl is not None and e.get("dsl_version") != dsl and not (manifest.get("runtime") or {}).get("shipped"):
        raise ValueError(f"prebuilt kernel {name!r} was built with nvidia-cutlass-dsl {e.get('dsl_version')}, "
                         f"but {dsl} is installed (its runtime library would be used): rebuild or ship the runtime")
    if verify_files:
        for kind, fname in e.get("files", {}).items():
            path = directory / fname
            if not path.exists():
                raise ValueError(f"prebuilt kernel {name!r}: file {fname} is missing")
            if _sha256(path) != e.get("sha256", {}).get(kind):
                raise ValueError(f"prebuilt kernel {name!r}: {fname} does not match its sha256 in the manifest")
    return e


def _load_runtime(directory: Path, manifest: dict[str, Any]) -> None:
    """Load libcute_dsl_runtime.so RTLD_GLOBAL (the .so files import their launch helpers from it)."""
    rt = manifest.get("runtime") or {}
    candidates = []
    if rt.get("shipped"):
        unpacked = directory / RUNTIME_LIB
        if not unpacked.exists():
            tmp = unpacked.with_suffix(".tmp")
            with lzma.open(directory / rt["shipped"], "rb") as f, open(tmp, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 20)
            os.replace(tmp, unpacked)
        candidates.append(unpacked)
    try:
        candidates.append(Path(_aot_config("--libdir")) / RUNTIME_LIB)
    except Exception:
        pass
    if rt.get("build_path"):
        candidates.append(Path(rt["build_path"]))
    for c in candidates:
        if c.exists():
            ctypes.CDLL(str(c), mode=ctypes.RTLD_GLOBAL)
            return
    raise ValueError(f"{RUNTIME_LIB} not found (tried {[str(c) for c in candidates]}); build with --ship-runtime")


def load_prebuilt(directory: str | os.PathLike, name: str, *, arch: str | None = None,
                  shapes: dict[str, Any] | None = None, verify_files: bool = True) -> PrebuiltKernel:
    """Verify and load one prebuilt kernel (see the module docstring for what is checked).

    ``arch`` defaults to the current GPU's architecture (no check without a GPU); ``shapes`` are the
    static shapes the caller is about to use (e.g. ``registry.get_variant(name).shapes``).
    """
    d = Path(directory)
    manifest = read_manifest(d)
    e = _verify(d, manifest, name, arch, shapes, verify_files)
    if e.get("format") == "tvm-ffi":
        try:
            import tvm_ffi
        except ImportError:
            raise ImportError(f"{name!r} was exported with TVM-FFI: `pip install apache-tvm-ffi` to load it") from None
        _load_runtime(d, manifest)
        mod = tvm_ffi.load_module(str(d / e["files"]["so"]))
        return PrebuiltKernel(name, e, d, fn=mod[e["function_name"]])
    return PrebuiltKernel(name, e, d, cubin=(d / e["files"]["cubin"]).read_bytes())


# ---------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kimik3 kernels", description="Prebuilt CuTe DSL decode kernels.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile and export kernels ahead of time (no GPU needed)")
    b.add_argument("--arch", required=True, choices=sorted(_ARCH_CC), help="target architecture")
    b.add_argument("--out", required=True, type=output_folder, help="output directory (manifest.json + artefacts)")
    b.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that does not hold an earlier build's kernels")
    b.add_argument("--preset", action="append", help="config preset(s) to take shapes from (default: k3-shard)")
    b.add_argument("--batch", type=positive_int_list, default=(1, 8, 64),
                   help="comma-separated batch sizes (default: 1,8,64)")
    b.add_argument("--family", action="append", help=f"kernel families (default: all of {sorted(FAMILIES)})")
    b.add_argument("--expert-format", action="append", choices=EXPERT_FORMATS,
                   help="routed-expert formats of the families built per format (the megakernel; default: dense)")
    b.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="export format (default: auto)")
    b.add_argument("--ship-runtime", action="store_true", help="copy libcute_dsl_runtime.so (xz) into --out")
    ls = sub.add_parser("list", help="list the kernel variants of presets / batches")
    ls.add_argument("--preset", action="append")
    ls.add_argument("--batch", type=positive_int_list, default=(1, 8, 64))
    ls.add_argument("--expert-format", action="append", choices=EXPERT_FORMATS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``kernels build ...`` / ``kernels list ...`` (a leading ``kernels`` token is optional)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["kernels"]:
        args_in = args_in[1:]
    args = _parser().parse_args(args_in)
    presets = args.preset or ["k3-shard"]
    batches = list(args.batch)
    formats = args.expert_format or ["dense"]
    try:  # an unknown preset or family, an --out of someone else's files: one line, not a traceback
        variants = variants_for(presets, batches, None if args.cmd == "list" else args.family, formats)
        if args.cmd == "build":
            check_output_folder(args.out, holds_prebuilt, args.overwrite, "an earlier build's kernels")
    except ValueError as e:
        return refuse(f"kernels {args.cmd}", e)
    if args.cmd == "list":
        for v in variants:
            print(f"{v.name:34s} {v.spec.description}  {v.shapes}")
        return 0
    manifest = build_prebuilt(args.arch, args.out, variants, fmt=args.format, ship_runtime=args.ship_runtime)
    bad = {n: e["budget_violations"] for n, e in manifest["kernels"].items() if e["budget_violations"]}
    print(f"wrote {len(variants)} kernels for {args.arch} to {args.out}/{MANIFEST}"
          + (f"; budget violations: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
