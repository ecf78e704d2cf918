"""What every room of the device check shares: the output files and their atomic writes, the budgets, the one
model of the run. docs/device-check.md."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
for _p in (str(REPO), str(SCRIPTS)):  # a bare copy of the repository (the GPU machine): run from the checkout
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from kimik3.model.random_init import device_model  # noqa: E402
from kimik3.perf.provenance import utc_now  # noqa: E402

BENCH_PRESET = "k3-shard"
# The whole run's planned budget: 75 % of its window, so the run leaves a quarter of its device time as slack
# (process start-up, child processes, the device tool's own transfers); the window stays under the device tool's
# 10 minutes per command.
TOTAL_BUDGET_S = 375.0
DEVICE_WINDOW_S = 500.0
# seconds each timed phase may take (bench gets what is left); the estimates are what they take on an H200
PHASE_BUDGETS = {"preflight": 12.0, "smoke": 12.0, "megakernel_tests": 40.0, "copy_bandwidth": 8.0,
                 "constants": 18.0, "tests": 50.0, "kernels": 20.0, "megakernel_mxfp4": 25.0, "megakernel": 45.0,
                 "ranks": 105.0}
QUICK_BUDGETS = {"preflight": 10.0, "smoke": 10.0, "megakernel_tests": 30.0, "copy_bandwidth": 6.0,
                 "constants": 12.0, "tests": 40.0, "kernels": 15.0, "megakernel_mxfp4": 18.0, "megakernel": 30.0,
                 "ranks": 70.0}
PHASE_ESTIMATES_S = {"provenance": 1.0, "plan": 5.0, "preflight": 8.0, "smoke": 10.0, "megakernel_tests": 35.0,
                     "copy_bandwidth": 6.0, "constants": 15.0, "tests": 45.0, "kernels": 18.0, "bench": 35.0,
                     "megakernel_mxfp4": 20.0, "megakernel": 38.0, "ranks": 80.0}
FILES = {"provenance": "00_provenance.json", "plan": "01_plan.json", "preflight": "02_preflight.json",
         "smoke": "03_smoke.json", "megakernel_tests": "04_megakernel_tests.json",
         "copy_bandwidth": "05_copy_bandwidth.json", "constants": "06_constants.json", "tests": "07_tests.json",
         "kernels": "08_kernels.json", "bench": "09_bench.json", "megakernel_mxfp4": "10_megakernel_mxfp4.json",
         "megakernel": "11_megakernel.json", "ranks": "12_ranks.json", "summary": "summary.json",
         "measurements": "measurements.json"}
CHILDREN_DIR = "children"  # one spec, progress log and stderr file per child process, under --out
CARRY_LIMIT_BYTES = 64 * 2**20  # what the device tool carries to the GPU machine
RUNTIME_LIB = "libcute_dsl_runtime.so"  # unpacked from its .xz by a load: never carried (43 MB)
OUTCOMES_PLUGIN = "device_check_outcomes"  # scripts/device_check_outcomes.py, loaded into the pytest process
DRY_STATUS = "left out in the dry run: GPU launches only"


def now() -> str:
    return utc_now()


def write(out: Path, phase: str, data: dict[str, Any]) -> Path:
    """Write one phase file atomically (tmp + rename) and flushed, so a killed run leaves valid JSON behind."""
    return write_json(Path(out) / FILES[phase], data)


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a progress log written by a process that may have been killed mid-line (that line is
    dropped); [] when the file is not there."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:  # a line cut by a kill
            continue
    return out


def read(out: Path, phase: str) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out) / FILES[phase]).read_text())
    except (OSError, ValueError):
        return None


_MODELS: dict[tuple[str, int, str, str], Any] = {}


def model(preset: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> Any:
    """One model per (preset, seed, dtype, device) per process: k3-shard is built once, on the device."""
    key = (preset, seed, str(dtype), str(device))
    if key not in _MODELS:
        _MODELS.clear()  # one large model resident at a time
        _MODELS[key] = device_model(preset, seed=seed, dtype=dtype, device=device)
    return _MODELS[key]


def perturbed(model: Any) -> Any:
    """A copy of ``model`` with its output projection off by ten standard deviations of noise: the model a planted
    "wrong" result runs, against the trace of the original."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        w = out.lm_head.weight
        w.add_(10 * w.float().std().to(w.dtype) * torch.randn_like(w))
    return out


def drop_models() -> None:
    _MODELS.clear()


def kernel_hashes() -> dict[str, str]:
    from kimik3.kernels.toolchain.source import kernel_source_hash

    return {m: kernel_source_hash(m)[:16] for m in ("gemv", "router", "kda", "mla_decode", "moe", "attn_res",
                                                    "megakernel")}
