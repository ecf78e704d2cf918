"""Where, when and with what a result was produced: the one provenance record of benchmarks, validation reports
and the GPU device check (docs/architecture.md, map).

A figure without its provenance cannot be compared with another one, so every result file carries this record:
the commit and whether the working tree had uncommitted changes, the date (UTC), the device (on a GPU also its
name, capability and clocks), the versions of what computed it, and the machine's load when it started. The
commit comes from ``$KIMIK3_COMMIT``, else a prebuilt kernel directory's ``BUILD_INFO.json``, else ``git``, and
``commit_source`` says which answered (:func:`commit_info`). Nothing here needs a GPU, the CuTe DSL or the
network; every probe that can fail records ``None`` instead.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

__all__ = ["provenance", "cpu_info", "commit_info", "package_versions", "nvidia_smi", "utc_now", "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parents[2]
# distribution names whose versions decide a result (None when not installed)
PACKAGES = {"transformers": "transformers", "cutlass_dsl": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi",
            "cupy": "cupy-cuda12x", "cuda_python": "cuda-python", "pytest": "pytest"}
_SMI_FIELDS = ("name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,power.limit,"
               "temperature.gpu,memory.total,persistence_mode,compute_mode")


def utc_now() -> str:
    """The current time, UTC, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _run(cmd: Sequence[str], timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _build_info(prebuilt: str | os.PathLike | None) -> dict[str, Any]:
    if prebuilt is None:
        return {}
    try:
        info = json.loads((Path(prebuilt) / "BUILD_INFO.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def commit_info(prebuilt: str | os.PathLike | None = None) -> tuple[str | None, str, bool | None]:
    """(commit, where it came from, working tree dirty?). Dirty is ``None`` where it cannot be known."""
    if os.environ.get("KIMIK3_COMMIT"):
        return os.environ["KIMIK3_COMMIT"], "env KIMIK3_COMMIT", None
    info = _build_info(prebuilt)
    if info.get("commit"):
        return str(info["commit"]), f"{prebuilt}/BUILD_INFO.json", info.get("dirty")
    head = _run(["git", "rev-parse", "HEAD"], timeout=5)
    if head:
        # untracked files do not change what was measured; modified tracked files do
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"], timeout=5)
        return head, "git", bool(status) if status is not None else None
    return None, "unknown (no KIMIK3_COMMIT, no BUILD_INFO.json, no .git)", None


def package_versions() -> dict[str, str | None]:
    """Versions of the packages that decide a result, ``None`` for those not installed."""
    out: dict[str, str | None] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                                  "python": platform.python_version()}
    for key, dist in PACKAGES.items():
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            out[key] = None
    from kimik3._version import __version__

    out["kimik3"] = __version__
    return out


def nvidia_smi() -> dict[str, str] | None:
    """The first GPU's clocks, power and modes as ``nvidia-smi --query-gpu`` reports them (read only)."""
    raw = _run(["nvidia-smi", f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader"])
    if not raw:
        return None
    return dict(zip(_SMI_FIELDS.split(","), [v.strip() for v in raw.splitlines()[0].split(",")]))


# the x86 / Arm vector extensions a CPU timing depends on (the native executor's hot loops are built for them)
_VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
                 "amx_bf16", "neon", "asimd", "sve")


def cpu_info() -> dict[str, Any]:
    """This CPU's model name and the vector extensions it reports (``/proc/cpuinfo``; ``None`` where unreadable)."""
    model, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = val.strip()
                elif key in ("flags", "Features") and flags is None:
                    flags = val.split()
                if model is not None and flags is not None:
                    break
    except OSError:
        pass
    return {"cpu_model": model,
            "cpu_vector_flags": None if flags is None else [f for f in _VECTOR_FLAGS if f in set(flags)]}


def provenance(device: str | torch.device = "cpu", prebuilt: str | os.PathLike | None = None) -> dict[str, Any]:
    """The provenance record: commit, dirty tree, date, device, versions, load (see the module docstring).

    ``prebuilt``: a prebuilt kernel directory, consulted for the commit and recorded (its manifest's architecture,
    DSL version and kernel count)."""
    try:
        dev: torch.device | None = torch.device(device)
    except (RuntimeError, ValueError):  # a label such as "auto" is recorded as given
        dev = None
    commit, source, dirty = commit_info(prebuilt)
    info: dict[str, Any] = {
        "commit": commit, "commit_source": source, "dirty_working_tree": dirty, "date": utc_now(),
        "device": str(dev if dev is not None else device), **package_versions(),
        "platform": platform.platform(), "host": platform.node(),
        "host_cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(), **cpu_info(),
        # a loaded machine measures slow: the load at the start says how far to trust a timing
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cuda_available": torch.cuda.is_available(),
    }
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                    gpu_memory_GiB=round(p.total_memory / 2**30, 1), nvidia_smi=nvidia_smi())
    if prebuilt is not None:
        pb: dict[str, Any] = {"dir": str(prebuilt), "build_info": _build_info(prebuilt)}
        try:
            m = json.loads((Path(prebuilt) / "manifest.json").read_text())
            pb.update(arch=m.get("arch"), dsl_version=m.get("dsl_version"), created=m.get("created"),
                      kernels=len(m.get("kernels", {})), runtime_shipped=(m.get("runtime") or {}).get("shipped"))
        except (OSError, ValueError):
            pb["manifest"] = "missing"
        info["prebuilt"] = pb
    return info
