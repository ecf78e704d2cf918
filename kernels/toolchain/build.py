"""Compile a registry variant for an architecture, keep PTX/cubin, read the ptxas report, check the budget.

No GPU is needed: the DSL carries its own NVVM and ptxas. Artefacts are cached on disk under
``.cache/kimik3-kernels/`` (or ``$KIMIK3_KERNEL_CACHE``) keyed by the kernel module's source hash,
the DSL version, the architecture and the static shapes, so repeated test runs skip the compile.

The ptxas resource report comes from the DSL's own ptxas (``remarks{ptx} --remark-output file``,
one "Compiling entry function ... Used N registers" block per kernel of the op). Shared memory is
dynamic (``SmemAllocator``) and absent from that report; the kernels record it at trace time
(:func:`kimik3.kernels.common.device.smem_tensor`) and it is added per kernel here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kimik3.kernels.common import device as C
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.registry import Budget, KernelVariant

__all__ = ["BuildResult", "build", "store", "cache_root", "cache_key", "parse_ptxas_report", "check_budget",
           "ptx_target", "SUPPORTED_ARCHS"]

SUPPORTED_ARCHS = dsl.SUPPORTED_ARCHS
_ENTRY = re.compile(r"Compiling entry function '+([\w$]+)'+ for '+(sm_\w+)'+")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


@dataclass
class BuildResult:
    name: str
    arch: str
    key: str
    directory: str
    ptx_path: str
    cubin_path: str
    kernels: list[dict[str, Any]]  # per kernel: name, registers, spill_stores, spill_loads, stack, shared_bytes
    resources: dict[str, int]  # aggregate: max registers / stack / shared, summed spills
    shapes: dict[str, Any]
    source_hash: str
    dsl_version: str
    compile_seconds: float
    cached: bool = False
    compiled: Any = field(default=None, repr=False)  # the JitCompiledFunction when compiled in-process

    @property
    def ptx(self) -> str:
        return Path(self.ptx_path).read_text()

    @property
    def cubin(self) -> bytes:
        return Path(self.cubin_path).read_bytes()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("compiled")
        d.pop("cached")
        return d


def cache_root() -> Path:
    """``$KIMIK3_KERNEL_CACHE``, else ``<repo>/.cache/kimik3-kernels`` when the repo is writable, else ~/.cache."""
    env = os.environ.get("KIMIK3_KERNEL_CACHE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").exists() and os.access(repo, os.W_OK):
        return repo / ".cache" / "kimik3-kernels"
    return Path.home() / ".cache" / "kimik3-kernels"


def cache_key(variant: KernelVariant, arch: str, source_hash: str | None = None) -> str:
    src = source_hash or dsl.source_hash(variant.module)
    blob = json.dumps({"source": src, "dsl": dsl.dsl_version(), "arch": arch, "family": variant.family,
                       "shapes": variant.shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def parse_ptxas_report(text: str) -> list[dict[str, Any]]:
    """One dict per 'Compiling entry function' block of a ptxas -v report (raw text or the remark YAML)."""
    out: list[dict[str, Any]] = []
    for block in re.split(r"(?=Compiling entry function)", text)[1:]:
        entry = _ENTRY.search(block)
        frame = _FRAME.search(block)
        used = _USED.search(block)
        if not (entry and frame and used):
            continue
        out.append({"name": entry.group(1), "arch": entry.group(2), "registers": int(used.group(1)),
                    "barriers": int(used.group(2) or 0), "static_smem": int(used.group(3) or 0),
                    "stack": int(frame.group(1)), "spill_stores": int(frame.group(2)),
                    "spill_loads": int(frame.group(3))})
    return out


def _attach_smem(kernels: list[dict[str, Any]], smem: dict[str, int]) -> None:
    for k in kernels:
        dyn = sum(v for label, v in smem.items() if k["name"].startswith(f"kernel_cutlass_{label}_kernel"))
        k["shared_bytes"] = k["static_smem"] + dyn


def _aggregate(kernels: list[dict[str, Any]]) -> dict[str, int]:
    return {"registers": max(k["registers"] for k in kernels),
            "spill_stores": sum(k["spill_stores"] for k in kernels),
            "spill_loads": sum(k["spill_loads"] for k in kernels),
            "stack": max(k["stack"] for k in kernels),
            "shared_bytes": max(k["shared_bytes"] for k in kernels),
            "kernels": len(kernels)}


def check_budget(result: BuildResult, budget: Budget) -> list[str]:
    """Human-readable violations of ``budget`` (empty when every kernel of the op fits)."""
    bad = []
    for k in result.kernels:
        short = re.sub(r"^kernel_cutlass_(\w+?_kernel).*", r"\1", k["name"])
        if k["registers"] > budget.max_registers:
            bad.append(f"{short}: {k['registers']} registers > {budget.max_registers}")
        if k["spill_stores"] + k["spill_loads"] > budget.max_spill_bytes:
            bad.append(f"{short}: spills {k['spill_stores']} B stores / {k['spill_loads']} B loads")
        if k["stack"] > budget.max_stack_bytes:
            bad.append(f"{short}: {k['stack']} bytes stack frame")
        if k["shared_bytes"] > budget.max_shared_bytes:
            bad.append(f"{short}: {k['shared_bytes']} bytes shared memory > {budget.max_shared_bytes}")
    return bad


def ptx_target(ptx: str) -> str:
    m = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    return m.group(1) if m else ""


def _load_cached(d: Path) -> BuildResult | None:
    meta = d / "result.json"
    if not meta.exists():
        return None
    try:
        data = json.loads(meta.read_text())
        data["directory"] = str(d)
        data["ptx_path"] = str(d / "kernel.ptx")
        data["cubin_path"] = str(d / "kernel.cubin")
        if not (Path(data["ptx_path"]).exists() and Path(data["cubin_path"]).exists()):
            return None
        return BuildResult(**data, cached=True)
    except (ValueError, TypeError):
        return None


def _entry_dir(variant: KernelVariant, arch: str, key: str, cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir) if cache_dir else cache_root()
    return root / f"{variant.name.replace('/', '_')}-{arch}-{key}"


def build(variant: KernelVariant, arch: str, *, use_cache: bool = True, cache_dir: str | os.PathLike | None = None
          ) -> BuildResult:
    """Compile ``variant`` for ``arch`` (or load it from the disk cache) and return its artefacts and report."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}")
    if arch not in variant.archs:
        raise ValueError(f"{variant.name} does not support {arch} (supports {variant.archs})")
    if use_cache:
        hit = _load_cached(_entry_dir(variant, arch, cache_key(variant, arch), cache_dir))
        if hit is not None:
            return hit
    with tempfile.TemporaryDirectory(prefix="kimik3-build-") as tmp:
        remark = Path(tmp) / "ptxas.yaml"
        t0 = time.perf_counter()
        with dsl.dump_dir_scope(tmp), C.smem_log() as smem:
            compiled = variant.compile(arch, remark_file=str(remark))
        seconds = time.perf_counter() - t0
        # the artefacts may be files in the dump folder: read before it goes
        ptx, cubin = dsl.artifact_text(compiled.__ptx__), dsl.artifact_bytes(compiled.__cubin__)
        report = remark.read_text() if remark.exists() else ""
    result = store(variant, arch, ptx, cubin, report, smem, seconds, cache_dir=cache_dir)
    result.compiled = compiled
    return result


def store(variant: KernelVariant, arch: str, ptx: str, cubin: bytes, ptxas_report: str, smem: dict[str, int],
          seconds: float, *, cache_dir: str | os.PathLike | None = None) -> BuildResult:
    """Put one compile of ``variant`` for ``arch`` into the disk cache and return its result: the PTX, the cubin,
    the ptxas report (remark YAML or ``ptxas -v`` text) and the shared memory recorded at trace time. :func:`build`
    stores its compiles here, and so does the ahead-of-time export (``prebuilt.build_prebuilt``): exporting with
    TVM-FFI changes only the host-side launcher, the device code is the same, so an export's compile is a build.
    The entry appears atomically (a work folder renamed into place); one already there is kept."""
    if not ptx or not cubin:
        raise RuntimeError(f"{variant.name}: the DSL returned no PTX/cubin (keep options ignored?)")
    kernels = parse_ptxas_report(ptxas_report)
    if not kernels:
        raise RuntimeError(f"{variant.name}: no ptxas resource report found")
    _attach_smem(kernels, smem)
    src = dsl.source_hash(variant.module)
    key = cache_key(variant, arch, src)
    final = _entry_dir(variant, arch, key, cache_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        (work / "ptxas.yaml").write_text(ptxas_report)
        (work / "kernel.ptx").write_text(ptx)
        (work / "kernel.cubin").write_bytes(cubin)
        result = BuildResult(name=variant.name, arch=arch, key=key, directory=str(final),
                             ptx_path=str(final / "kernel.ptx"), cubin_path=str(final / "kernel.cubin"),
                             kernels=kernels, resources=_aggregate(kernels), shapes=variant.shapes, source_hash=src,
                             dsl_version=dsl.dsl_version(), compile_seconds=round(seconds, 3))
        (work / "result.json").write_text(json.dumps(result.to_json(), indent=1, default=str))
        if final.exists():  # a concurrent build got there first; theirs is as good as ours
            shutil.rmtree(work, ignore_errors=True)
        else:
            os.replace(work, final)
        return result
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
