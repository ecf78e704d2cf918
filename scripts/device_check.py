"""The GPU device check: one command, one run, under 5 minutes on an H200, every result written as it goes, and
an exit status that is 0 only when everything it planned ran and agreed with ``naive``.

``python3 scripts/device_check.py --out DIR --prebuilt DIR [--quick]`` on a GPU machine that has the prebuilt
kernels (exported on a CPU machine with ``--build-prebuilt DIR``: the GPU machine has no CuTe DSL compiler) and
installs nothing. ``scripts/device_check.sh`` is the exact command for the device tool. Phases, in order, each
with its time estimate on an H200 and one JSON file in ``--out`` written as soon as it has something (a run cut
short keeps what it measured):

====  ===============  =====  ======================================================================================
file  phase            est.   what
====  ===============  =====  ======================================================================================
00    provenance         1 s  ``kimik3.perf.provenance``: commit (``$KIMIK3_COMMIT``, ``BUILD_INFO.json`` or git), dirty
                              tree, GPU and clocks, versions, load, date; the kernel source hashes
01    plan               5 s  what will run, every prebuilt artefact it loads verified against its manifest entry
                              (source hash, arch, shapes, file sha256), the carried size (<= 64 MiB)
02    copy_bandwidth    10 s  device copy bandwidth and the launch-latency floor
03    tests            120 s  every planned GPU test in one pytest process, each test's outcome recorded as it ends
04    kernels           30 s  each fused kernel of the k3-shard step timed alone (CUDA graph, CUDA events), judged
                              against 80 % of copy bandwidth (>= 32 MB per call) or the launch floor
05    bench             95 s  ``kimik3.bench.run_bench`` on k3-shard, one row per (stage, batch) in priority order,
                              every row's first decode step compared with ``naive`` on the device
06    megakernel_mxfp4  20 s  the megakernel variants for MXFP4 routed experts (``megakernel/<preset>/b<B>-mxfp4``)
                              on the model holding its experts as MXFP4 (``model.quantize_experts()``; k3-shard's is
                              the run's model, quantised in place, hence last): teacher-forced against ``naive`` on
                              the same model; at tiny also against ``megakernel-interp`` (the CPU interpreter, fp32
                              on the same weights); at k3-shard the per-instruction timing buffer against the model
                              (``megakernel_opcode_report``)
--    summary                 phase times and statuses, the failures by name; measurements.json in the
                              ``data/measurements`` format
====  ===============  =====  ======================================================================================

The k3-shard model is built once, on the GPU (``kimik3.model.random_init.device_model``), and shared by the kernels
and bench phases; prompts go through the model's chunked forward; every kernel is loaded in this process.

Exit status: 0 only if every phase ran, every planned GPU test passed (failed, errored, timed out or skipped
tests fail the check, each named), every benchmark row was measured and agrees with ``naive`` within
``kimik3.validation.metric.TOL["bf16_stage"]``, and every planned MXFP4 megakernel item ran and agrees with ``naive``
(and the interpreter) within the same tolerance; 1 otherwise; 2 for a real run without CUDA.

``--dry-run`` (a CPU machine): executes the same plan with only the GPU launches left out — provenance, the plan
with every prebuilt artefact it would load verified and loaded, the carried size, the test files and the outcome
recorder, the benchmark rows on the CPU for a small preset (``naive`` and ``absorbed``, compared with ``naive``),
the MXFP4 megakernel phase on ``tiny`` batch 1 on the CPU (the quantised model, the ``naive`` trace, the interpreter
against it, the MXFP4 program scored by the performance model) — and exits non-zero if anything it could check
fails. Without a prebuilt manifest it writes the provenance and the plan (which kernels are missing) and stops:
there is nothing to execute. ``--build-prebuilt DIR`` (a CPU machine with the CuTe DSL): exports every kernel of
``kimik3.kernels.toolchain.targets`` (the megakernel for dense and for MXFP4 routed experts) and records the commit in
``DIR/BUILD_INFO.json`` (the copy that travels to the GPU machine may lack ``.git``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a bare copy of the repository (the GPU machine): no install, run from the checkout
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from kimik3.kernels.toolchain.targets import FUSED_TARGETS, megakernel_variants, select  # noqa: E402

from kimik3.model.random_init import device_model  # noqa: E402
from kimik3.perf.provenance import commit_info, provenance, utc_now  # noqa: E402
from kimik3.validation.metric import TOL  # noqa: E402

__all__ = ["main", "plan", "run_phases", "verdict", "judge_tests", "judge_bench", "judge_mxfp4", "TOTAL_BUDGET_S",
           "PHASE_BUDGETS", "PHASE_ESTIMATES_S", "FILES"]

TARGETS = FUSED_TARGETS  # (preset, batch, expert format) of every fused step the check runs
TOTAL_BUDGET_S = 285.0  # under 5 minutes on an H200, with margin for process start-up
# seconds each timed phase may take (bench gets what is left); the estimates below are what they take on an H200
# (bench runs before megakernel_mxfp4, which quantises the shared model in place, and leaves it its budget)
PHASE_BUDGETS = {"copy_bandwidth": 20.0, "tests": 130.0, "kernels": 35.0, "megakernel_mxfp4": 25.0}
QUICK_BUDGETS = {"copy_bandwidth": 15.0, "tests": 90.0, "kernels": 25.0, "megakernel_mxfp4": 20.0}
PHASE_ESTIMATES_S = {"provenance": 1.0, "plan": 5.0, "copy_bandwidth": 10.0, "tests": 120.0, "kernels": 30.0,
                     "bench": 95.0, "megakernel_mxfp4": 20.0}
BENCH_PRESET = "k3-shard"
# The CPU counterpart of everything this check runs on the GPU: the host execution (the same @cute.jit helpers the
# device code calls, run over every block / warp / lane on the CPU; tests/test_host_exec*.py) that covers each fused
# kernel family and each megakernel opcode, as (test module, a key and value one of its CI cases has).
# tests/test_device_check.py checks that every registry family and every opcode is listed and the case exists.
_TILE_GEMV = ("tests/test_host_exec.py", "family", "megakernel.tile_gemv")
CPU_COUNTERPARTS: dict[str, tuple[str, str, str]] = {
    **{f: ("tests/test_host_exec.py", "family", f) for f in ("gemv.plain", "gemv.rmsnorm", "gemv.residual",
                                                             "gemv.f32out", "gemv.lm_head", "moe.bf16", "moe.mxfp4",
                                                             "attn_res")},
    "router": ("tests/test_host_exec_router.py", "family", "router"),
    "kda": ("tests/test_host_exec_kda.py", "family", "kda"),
    "mla": ("tests/test_host_exec_mla.py", "preset", "k3-shard"),
    **{op: _TILE_GEMV for op in ("NORM_PROJ", "MLP_GATE_UP", "O_PROJ_RESIDUAL", "FFN_OUT", "LM_HEAD")},
    "KDA_STEP": ("tests/test_host_exec_kda.py", "family", "mk_kda"),
    "MLA_Q": ("tests/test_host_exec_mk_mla.py", "op", "q"),
    "MLA_KV_APPEND": ("tests/test_host_exec_mk_mla.py", "op", "kv_append"),
    "MLA_PARTIAL": ("tests/test_host_exec_mk_mla.py", "op", "partial"),
    "MLA_REDUCE": ("tests/test_host_exec_mk_mla.py", "op", "reduce"),
    **{op: ("tests/test_host_exec_router.py", "family", "mk.moe") for op in ("ROUTER", "EXPERT_GATE_UP",
                                                                             "EXPERT_DOWN")},
    **{op: ("tests/test_host_exec_router.py", "family", "mk.misc") for op in ("EMBED", "ATTN_RES_MIX", "ARGMAX")},
    # the expert opcodes of the MXFP4 variants (code groups, E8M0 scales): programs built with expert_format="mxfp4"
    **{f"{op}.mxfp4": ("tests/test_host_exec_router.py", "expert_format", "mxfp4") for op in ("EXPERT_GATE_UP",
                                                                                              "EXPERT_DOWN")},
}
BENCH_ORDER = (("megakernel", 1), ("fused", 1), ("graphs", 1), ("absorbed", 1), ("naive", 1), ("megakernel", 8),
               ("fused", 8), ("graphs", 8), ("megakernel", 64), ("fused", 64), ("absorbed", 8), ("compiled", 1),
               ("compiled", 8), ("naive", 8))
QUICK_BENCH_ORDER = (("megakernel", 1), ("fused", 1), ("graphs", 1), ("absorbed", 1), ("naive", 1),
                     ("megakernel", 8), ("fused", 8), ("graphs", 8))
# the dry run's benchmark: the same rows code on the CPU, for a preset that runs there in seconds
DRY_BENCH = {"preset": "micro", "order": (("absorbed", 1), ("naive", 1)), "context": 16, "steps": 1, "repeats": 1}
# seconds an item needs at least (model already built; compile/capture included), to decide whether to start it
BENCH_RESERVE_S = {"compiled": 100.0, "naive": 25.0}
BENCH_RESERVE_DEFAULT_S = 15.0
BIG_KERNEL_BYTES = 32e6  # >= this per call: judged against 80 % of copy bandwidth; below: the launch floor
GPU_TEST_FILES = ("tests/test_fused_stage.py", "tests/test_kernels_gpu.py", "tests/test_megakernel_gpu.py")
CARRY_LIMIT_BYTES = 64 * 2**20  # what the device tool carries to the GPU machine
RUNTIME_LIB = "libcute_dsl_runtime.so"  # unpacked from its .xz by a load: never carried (43 MB)
OUTCOMES_PLUGIN = "device_check_outcomes"  # scripts/device_check_outcomes.py, loaded into the pytest process
FILES = {"provenance": "00_provenance.json", "plan": "01_plan.json", "copy_bandwidth": "02_copy_bandwidth.json",
         "tests": "03_tests.json", "kernels": "04_kernels.json", "bench": "05_bench.json",
         "megakernel_mxfp4": "06_megakernel_mxfp4.json", "summary": "summary.json",
         "measurements": "measurements.json"}
# the MXFP4 megakernel phase: prompt and decode steps per item; seconds an item needs at least to be started; the dry
# run's item (the CPU: fp32, the GPU launches left out)
MXFP4_PROMPT, MXFP4_STEPS = 8, 3
MXFP4_RESERVE_S = 6.0
DRY_MXFP4 = {"variant": "megakernel/tiny/b1-mxfp4", "preset": "tiny", "batch": 1, "interp": True, "timings": True}


# ====================================================================== small helpers


def _now() -> str:
    return utc_now()


def _write(out: Path, phase: str, data: dict[str, Any]) -> Path:
    """Write one phase file atomically (tmp + rename) and flushed, so a killed run leaves valid JSON behind."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / FILES[phase]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _read(out: Path, phase: str) -> dict[str, Any] | None:
    try:
        return json.loads((out / FILES[phase]).read_text())
    except (OSError, ValueError):
        return None


_MODELS: dict[tuple[str, int, str, str], Any] = {}


def _model(preset: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> Any:
    """One model per (preset, seed, dtype, device) for the whole run: k3-shard is built once, on the device."""
    key = (preset, seed, str(dtype), str(device))
    if key not in _MODELS:
        _MODELS.clear()  # one large model resident at a time
        _MODELS[key] = device_model(preset, seed=seed, dtype=dtype, device=device)
    return _MODELS[key]


# ====================================================================== provenance and plan


def _kernel_hashes() -> dict[str, str]:
    from kimik3.kernels.toolchain.source import kernel_source_hash

    return {m: kernel_source_hash(m)[:16] for m in ("gemv", "router", "kda", "mla_decode", "moe", "attn_res",
                                                         "megakernel")}


def device_provenance(prebuilt: Path | None) -> dict[str, Any]:
    """``kimik3.perf.provenance`` for this run's device and prebuilt directory, plus the kernel source hashes."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {**provenance(dev, prebuilt), "kernel_source_hashes": _kernel_hashes()}


def _prebuilt_status(prebuilt: Path | None, arch: str = "sm_90a",
                     fused_targets: Sequence[tuple[str, int, str]] = TARGETS,
                     megakernels: Sequence[str] | None = None) -> dict[str, Any]:
    """Which kernels of the targets the prebuilt directory has, at the current kernel sources (``megakernels``: the
    registry names of the megakernel variants, dense and MXFP4; default: every exported one)."""
    from kimik3.kernels.toolchain.registry import get_variant
    from kimik3.kernels.toolchain.source import kernel_source_hash

    from kimik3.fused.loading import _find_prebuilt
    from kimik3.fused.plan import fused_ops

    manifest: dict[str, Any] = {}
    if prebuilt is not None and (prebuilt / "manifest.json").exists():
        manifest = json.loads((prebuilt / "manifest.json").read_text())
    targets, missing, stale, seen, names = [], [], [], set(), []
    for preset, batch, fmt in fused_targets:
        ops = fused_ops(preset, batch, fmt)
        targets.append({"preset": preset, "batch": batch, "expert_format": fmt, "ops": len(ops)})
        for op in ops:
            if op.key in seen:
                continue
            seen.add(op.key)
            name = _find_prebuilt(manifest, op, arch)
            if name is None:
                missing.append(op.name)
            elif manifest["kernels"][name].get("source_hash") != kernel_source_hash(op.module_name):
                stale.append(op.name)
            else:
                names.append({"name": name, "shapes": op.shapes})
    for name in megakernel_variants() if megakernels is None else megakernels:  # by registry name
        v = get_variant(name)
        seen.add(name)
        entry = manifest.get("kernels", {}).get(name)
        if entry is None or manifest.get("arch") != arch:
            missing.append(name)
        elif entry.get("source_hash") != kernel_source_hash("megakernel"):
            stale.append(name)
        else:
            names.append({"name": name, "preset": v.preset, "batch": v.batch, "expert_format": v.expert_format})
    size = sum(f.stat().st_size for f in prebuilt.iterdir() if f.is_file()) if prebuilt and prebuilt.is_dir() else 0
    unpacked = bool(prebuilt and (prebuilt / RUNTIME_LIB).exists())
    return {"dir": str(prebuilt) if prebuilt else None, "arch": arch, "manifest_found": bool(manifest),
            "bytes": size, "unpacked_runtime_present": unpacked,
            "carry_note": (f"{RUNTIME_LIB} (unpacked by a local load) is left behind when carrying: the .xz travels"
                           if unpacked else "ok") if prebuilt else None,
            "distinct_ops": len(seen), "missing": missing, "stale": stale, "targets": targets, "load": names,
            "ready": bool(manifest) and not missing and not stale,
            "runtime_shipped": bool((manifest.get("runtime") or {}).get("shipped"))}


def _gpu_test_files() -> list[str]:
    return [f for f in GPU_TEST_FILES if (REPO / f).exists()]


def plan(prebuilt: Path | None, quick: bool, presets: str = "", batches: str = "") -> dict[str, Any]:
    """What the run will do, with budgets and estimates, and whether the prebuilt kernels it needs are there
    (``presets`` / ``batches``: only those targets, comma-separated)."""
    from kimik3.kernels.toolchain.loader import dsl_available

    from kimik3.fused.plan import fused_ops

    fused_targets, mk_targets = select(presets, batches)
    megakernels = megakernel_variants(presets, batches)

    budgets = dict(QUICK_BUDGETS if quick else PHASE_BUDGETS)
    budgets["bench"] = TOTAL_BUDGET_S - sum(budgets.values())
    tests = []
    for f in _gpu_test_files():
        if f.endswith("test_kernels_gpu.py") and not dsl_available():
            # not planned (so never counted as run): it JIT-compiles each registry variant, and the kernel modules
            # import the DSL for their references too; every fused kernel runs from the prebuilt directory in
            # test_fused_stage.py's GPU tests and in phase 'kernels'
            tests.append({"file": f, "run": False, "reason": "JIT-compiles every registry variant: needs the CuTe DSL "
                          "compiler, which this machine does not have (the kernels run through the prebuilt fused "
                          "stage in test_fused_stage.py and phase 'kernels' instead)"})
        else:
            tests.append({"file": f, "run": True})
    kernel_ops = [{"name": o.name, "family": o.family, "shapes": o.shapes} for o in fused_ops(BENCH_PRESET, 1)]
    return {
        "date": _now(), "quick": quick, "total_budget_s": TOTAL_BUDGET_S, "phase_budgets_s": budgets,
        "phase_estimates_s": PHASE_ESTIMATES_S,
        "targets": {"fused": [list(t) for t in fused_targets], "megakernel": [list(t) for t in mk_targets],
                    "megakernel_variants": megakernels},
        "tests": tests, "kernels": {"preset": BENCH_PRESET, "batches": [1] if quick else [1, 8], "ops": kernel_ops,
                                    "big_kernel_bytes": BIG_KERNEL_BYTES, "mxfp4_vs_bf16": True},
        "bench": {"preset": BENCH_PRESET, "order": [list(x) for x in (QUICK_BENCH_ORDER if quick else BENCH_ORDER)],
                  "context": 128 if quick else 512, "steps": 4 if quick else 8, "repeats": 3 if quick else 5,
                  "reserve_s": BENCH_RESERVE_S, "tolerance_vs_naive": TOL["bf16_stage"]},
        "megakernel_mxfp4": {"items": _mxfp4_items(megakernels, quick), "prompt_len": MXFP4_PROMPT,
                             "steps": MXFP4_STEPS, "reserve_s": MXFP4_RESERVE_S,
                             "tolerance": TOL["bf16_stage"], "reference": "naive on the same MXFP4-holding model, "
                             "teacher-forced; megakernel-interp (CPU, fp32 on the same weights) where planned"},
        "prebuilt": _prebuilt_status(prebuilt, fused_targets=fused_targets, megakernels=megakernels),
        "cpu_counterparts": {k: f"{m} ({key} = {val!r})" for k, (m, key, val) in CPU_COUNTERPARTS.items()},
    }


def _mxfp4_items(megakernels: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    """The MXFP4 megakernel variants among ``megakernels`` the run executes (``--quick``: batch 1 only): the run's
    k3-shard model first (quantised in place once the bench is done), then the small presets, built for the item.
    The interpreter runs on the CPU, so only where the model is small; the timing buffer is read at k3-shard."""
    from kimik3.kernels.toolchain.registry import get_variant

    items = []
    for name in megakernels:
        v = get_variant(name)
        if v.expert_format == "mxfp4" and not (quick and v.batch != 1):
            small = v.preset != BENCH_PRESET
            items.append({"variant": name, "preset": v.preset, "batch": v.batch, "interp": small, "timings": not small})
    return sorted(items, key=lambda it: it["preset"] != BENCH_PRESET)


def carried_files(prebuilt: Path | None, extra: Sequence[str] = (".whl",)) -> dict[str, Any]:
    """What the device tool carries: the working tree (tracked + untracked files git does not ignore), the prebuilt
    directory without the unpacked DSL runtime (its .xz travels) and the carried wheels."""
    listed = None
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, timeout=30)
        if r.returncode == 0:
            listed = [REPO / p for p in r.stdout.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        pass
    if listed is None:  # no git (a copy): everything but caches, environments and outputs
        skip = {".git", ".venv", "runs", "prebuilt", ".whl", "__pycache__", ".pytest_cache", ".ruff_cache"}
        listed = [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)]
    carried_dirs = [d.resolve() for d in [prebuilt, *(REPO / e for e in extra)] if d is not None]
    # counted once: a carried folder that git does not ignore is in the listing too
    tree = sum(p.stat().st_size for p in listed if p.is_file()
               and not any(p.resolve().is_relative_to(d) for d in carried_dirs))
    pb = 0
    if prebuilt is not None and prebuilt.is_dir():
        pb = sum(f.stat().st_size for f in prebuilt.rglob("*") if f.is_file() and f.name != RUNTIME_LIB)
    wheels = sum(f.stat().st_size for d in extra if (REPO / d).is_dir() for f in (REPO / d).rglob("*") if f.is_file())
    total = tree + pb + wheels
    return {"working_tree_bytes": tree, "prebuilt_bytes": pb, "wheels_bytes": wheels, "total_bytes": total,
            "total_MiB": round(total / 2**20, 2), "limit_MiB": CARRY_LIMIT_BYTES / 2**20,
            "fits": total <= CARRY_LIMIT_BYTES}


def verify_prebuilt(prebuilt: Path, status: dict[str, Any], load: bool) -> list[dict[str, Any]]:
    """Every artefact the run would load, through the loader's own checks (manifest entry, source hash, arch,
    static shapes, file sha256) and, with ``load``, loaded (the shared object and the DSL runtime it links; a CPU
    machine can load them, only launching needs the GPU). One pass in this process, the runtime library located
    once: no subprocess per kernel."""
    from kimik3.kernels.toolchain import prebuilt as pb
    from kimik3.kernels.toolchain.loader import load_prebuilt_fn

    from kimik3.megakernel.kernel_shapes import static_shapes

    results = []
    had_runtime = (prebuilt / RUNTIME_LIB).exists()
    manifest = pb.read_manifest(prebuilt)
    try:
        for item in status["load"]:
            shapes = (static_shapes(item["preset"], item["batch"], expert_format=item["expert_format"])
                      if "preset" in item else item["shapes"])
            rec: dict[str, Any] = {"name": item["name"]}
            try:
                if load:
                    fn = load_prebuilt_fn(prebuilt, manifest, item["name"], status["arch"], shapes)
                    rec["status"] = "loaded" if fn is not None else "exported as a cubin only (needs tvm-ffi)"
                else:
                    pb._verify(prebuilt, manifest, item["name"], status["arch"], shapes, True)
                    rec["status"] = "verified"
            except Exception as e:  # each artefact's own verdict; the others are still checked
                rec["status"] = f"error: {type(e).__name__}: {e}"[:600]
            results.append(rec)
    finally:
        if not had_runtime and (prebuilt / RUNTIME_LIB).exists():  # unpacked by the load: not carried, not kept
            (prebuilt / RUNTIME_LIB).unlink()
    return results


# ====================================================================== phase: copy bandwidth + launch floor


def _launch_floor_s(reps: int = 50) -> float:
    """Median time of one tiny kernel replayed from a CUDA graph: what any launch costs, however small."""
    x = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            x.add_(1)
    return _graph_time(g, reps)


def _graph_time(g: torch.cuda.CUDAGraph, per_replay: int, replays: int = 7) -> float:
    """Median seconds per launch over ``replays`` replays of a graph holding ``per_replay`` launches."""
    g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / per_replay)
    return statistics.median(samples)


def _phase_copy_bandwidth(out: Path, args: argparse.Namespace) -> None:
    from kimik3.perf.hardware import measure_local

    m = measure_local(device="cuda", quick=bool(args.quick))
    floor = _launch_floor_s()
    _write(out, "copy_bandwidth", {"date": _now(), "measure_local": m, "copy_bandwidth_Bps": m["copy_bandwidth_Bps"],
                                   "launch_floor_s": floor, "launch_floor_method": "median per-launch time of a "
                                   "1-element add_ replayed 50x from one CUDA graph, CUDA events"})


def _copy_bw(out: Path) -> tuple[float, float]:
    d = _read(out, "copy_bandwidth")
    if d:
        return float(d["copy_bandwidth_Bps"]), float(d["launch_floor_s"])
    from kimik3.perf.hardware import measure_local

    return float(measure_local(device="cuda", quick=True)["copy_bandwidth_Bps"]), _launch_floor_s()


# ====================================================================== phase: tests


def _outcomes(path: Path) -> tuple[list[str], dict[str, dict[str, Any]], Path]:
    """(collected test ids, outcome per test id, the ids' root directory) from the outcome recorder's lines."""
    collected: list[str] = []
    root = REPO
    results: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return collected, results, root
    for ln in lines:
        try:
            rec = json.loads(ln)
        except ValueError:  # a line cut by a kill
            continue
        if "collected" in rec:
            collected, root = rec["collected"], Path(rec.get("rootdir") or REPO)
        elif rec.get("nodeid"):
            prev = results.get(rec["nodeid"])
            # the worst report of a test wins: an error in teardown after a pass is an error
            rank = {"passed": 0, "skipped": 1, "failed": 2, "timeout": 2, "error": 3}
            if prev is None or rank.get(rec["outcome"], 3) >= rank.get(prev["outcome"], 3):
                results[rec["nodeid"]] = rec
    return collected, results, root


def _same_file(nodeid: str, root: Path, planned: str) -> bool:
    """Whether a test id (relative to pytest's root directory) belongs to a planned file (relative to the
    repository, or absolute)."""
    return (root / nodeid.split("::")[0]).resolve() == (REPO / planned).resolve()


def run_tests(out: Path, tests: list[dict[str, Any]], budget_s: float, env: dict[str, str] | None = None,
              marker: str | None = "gpu", keyword: str | None = None) -> dict[str, Any]:
    """Every planned test file in one pytest process (models and kernels loaded once), each test's outcome
    recorded as it ends by the outcome recorder, so a process killed at the budget still says what ran."""
    planned = [t["file"] for t in tests if t["run"]]
    record: dict[str, Any] = {"date": _now(), "budget_s": round(budget_s, 1), "results": [], "tests": {},
                              "not_planned": [t for t in tests if not t["run"]]}
    outcomes_path = out / "03_tests.outcomes.jsonl"
    outcomes_path.unlink(missing_ok=True)
    text, code, timed_out = "", None, False
    t0 = time.time()
    if planned:
        per_test = max(5, int(budget_s) - 5)
        cmd = [sys.executable, "-m", "pytest", *planned, "-q", "-rs", "--no-header", "-p", "no:cacheprovider",
               "-p", OUTCOMES_PLUGIN] + (["-m", marker] if marker else []) + (["-k", keyword] if keyword else [])
        if importlib.util.find_spec("pytest_timeout") is not None:  # a hung test then fails alone, named
            cmd.append(f"--timeout={per_test}")
        child_env = dict(os.environ if env is None else env)
        child_env["KIMIK3_TEST_OUTCOMES"] = str(outcomes_path)
        child_env["PYTHONPATH"] = os.pathsep.join([str(REPO / "scripts"), str(REPO),
                                                   child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=budget_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the pytest process group only
            text, _ = proc.communicate()
            timed_out = True
    collected, results, root = _outcomes(outcomes_path)
    for nodeid in collected:
        if nodeid not in results:
            results[nodeid] = {"nodeid": nodeid, "outcome": "timeout" if timed_out else "not run",
                               "detail": f"no result before the {budget_s:.0f} s budget ran out" if timed_out
                               else "collected but never reported"}
    record["tests"] = {k: {"outcome": v["outcome"], "detail": v.get("detail", "")[:1500],
                           "seconds": v.get("seconds")} for k, v in results.items()}
    record["rootdir"] = str(root)
    for f in planned:
        mine = [v["outcome"] for k, v in results.items() if _same_file(k, root, f)]
        counts = {o: mine.count(o) for o in sorted(set(mine))}
        summary = ", ".join(f"{n} {o}" for o, n in counts.items()) or "no tests ran"
        if timed_out and (not mine or "timeout" in counts):
            status = f"timeout after {budget_s:.0f} s"
        elif not mine:
            status = "no tests ran"
        elif set(counts) == {"passed"}:
            status = "passed"
        elif set(counts) == {"skipped"}:
            status = "all skipped"
        else:
            status = "failed"
        record["results"].append({"file": f, "status": status, "summary": summary, "returncode": code,
                                  "counts": counts})
    for t in record["not_planned"]:
        record["results"].append({"file": t["file"], "status": "not planned", "reason": t["reason"]})
    record.update(seconds=round(time.time() - t0, 1), returncode=code, timed_out=timed_out,
                  output_tail=text[-6000:])
    _write(out, "tests", record)
    return record


def _phase_tests(out: Path, args: argparse.Namespace) -> None:
    p = plan(args.prebuilt, bool(args.quick))
    tests = [{"file": f, "run": True} for f in args.tests] if getattr(args, "tests", None) else p["tests"]
    if getattr(args, "dry_run", False):
        # the GPU tests skip without CUDA: the dry run checks that the files and the recorder are there
        missing = [t["file"] for t in tests if t["run"] and not (REPO / t["file"]).exists()]
        plugin = (REPO / "scripts" / f"{OUTCOMES_PLUGIN}.py").exists()
        _write(out, "tests", {"date": _now(), "dry_run": True, "planned": [t["file"] for t in tests if t["run"]],
                              "missing_files": missing, "outcome_recorder": plugin,
                              "left_out": "the GPU launches: every planned test needs CUDA", "results": []})
        return
    env = os.environ.copy()
    env["KIMIK3_QUICK"] = "1" if args.quick else "0"
    if args.prebuilt is not None:
        env["KIMIK3_PREBUILT"] = str(Path(args.prebuilt).resolve())
    # --quick leaves batch 64 out of the plan (deselected, so not counted as run, rather than skipped)
    run_tests(out, tests, max(10.0, float(args.deadline) - time.time() - 2), env=env,
              keyword="not b64" if args.quick else None)


def judge_tests(rec: dict[str, Any] | None) -> list[str]:
    """The failures of the tests phase, by name: every planned test that did not pass, every planned file that
    ran no test. Deliberately unplanned files are not failures (the plan says why)."""
    if rec is None:
        return ["tests: no result file (the phase did not run)"]
    if rec.get("dry_run"):
        bad = [f"tests: file {f} is missing" for f in rec.get("missing_files", [])]
        return bad + ([] if rec.get("outcome_recorder") else ["tests: the outcome recorder is missing"])
    failures = []
    for nodeid, r in sorted(rec.get("tests", {}).items()):
        if r["outcome"] != "passed":
            detail = f" ({r['detail'].splitlines()[0][:200]})" if r.get("detail") else ""
            failures.append(f"test {nodeid}: {r['outcome']}{detail}")
    for f in rec.get("results", []):
        if f["status"] == "no tests ran" or (f["status"].startswith("timeout") and not f.get("counts")):
            failures.append(f"tests in {f['file']}: {f['status']}")
    if rec.get("timed_out") and not failures:
        failures.append(f"tests: the pytest process ran past its {rec.get('budget_s')} s budget")
    if not rec.get("tests") and not any(f["status"] == "not planned" for f in rec.get("results", [])):
        failures.append("tests: no test ran")
    return failures


# ====================================================================== phase: per-kernel bandwidth


def _time_launch(runner: Callable[[Any], None], ln: Any, n: int = 20) -> float:
    """Seconds per launch of one kernel: ``n`` back-to-back launches captured in a CUDA graph (no host overhead),
    replayed, timed with CUDA events. Data under ~50 MB can stay in L2 between launches: in-step times of small
    kernels may be higher."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        runner(ln)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            runner(ln)
    return _graph_time(g, n)


def _judge(nbytes: float, seconds: float, copy_bw: float, floor: float) -> dict[str, Any]:
    achieved = nbytes / seconds
    rec: dict[str, Any] = {"gb_per_s": achieved / 1e9, "pct_copy_bw": 100 * achieved / copy_bw}
    if nbytes >= BIG_KERNEL_BYTES:
        target = nbytes / (0.8 * copy_bw)
        rec.update(judged_against="80% of copy bandwidth", target_s=target, ratio_to_target=seconds / target,
                   verdict="meets" if seconds <= target else "below")
    else:
        target = max(floor, nbytes / copy_bw)
        rec.update(judged_against="launch-latency floor", target_s=target, ratio_to_target=seconds / target,
                   verdict="within 2x of the floor" if seconds <= 2 * target else "above 2x the floor")
    return rec


def _phase_kernels(out: Path, args: argparse.Namespace) -> None:
    from kimik3.fused.launch_cost import launch_bytes, launch_flops
    from kimik3.fused.loading import load_kernels
    from kimik3.fused.runners import KernelRunner
    from kimik3.model.quant import mxfp4_quantize as mxfp4_pack
    from kimik3.stages.fused import FusedStage

    deadline = float(args.deadline)
    copy_bw, floor = _copy_bw(out)
    hashes = _kernel_hashes()
    result: dict[str, Any] = {"date": _now(), "preset": BENCH_PRESET, "copy_bandwidth_Bps": copy_bw,
                              "launch_floor_s": floor, "method": _time_launch.__doc__, "kernels": [],
                              "mxfp4_vs_bf16": [], "steps": []}
    model = _model(BENCH_PRESET)
    prompt = 64 if args.quick else 256
    for B in ([1] if args.quick else [1, 8]):
        if time.time() > deadline - 10:
            result.setdefault("skipped", []).append(f"batch {B}: out of budget")
            break
        st = FusedStage(model, B, prompt + 8, kernels="prebuilt", prebuilt=args.prebuilt)
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(3, model.config.vocab_size, (B, prompt), generator=g).cuda()
        lens = torch.full((B,), prompt, device="cuda")
        logits = st.prefill(ids, lens)
        st.step(logits.argmax(-1), lens)  # captures the graph, fills routing and cache
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            st.graph.replay()
        b.record()
        b.synchronize()
        result["steps"].append({"batch": B, "graph_step_s": a.elapsed_time(b) / 5e3, "kernel_source": st.kernel_source})
        fused, runner = st.fused, st.fused.runner
        done: set = set()
        for ln in fused.program:
            if ln.kind != "kernel" or ln.op.key in done:
                continue
            done.add(ln.op.key)
            if time.time() > deadline - 5:
                result.setdefault("skipped", []).append(f"{ln.op.name}: out of budget")
                continue
            sec = _time_launch(runner, ln)  # (the MoE op's align re-ran for this launch's routing: n_act is its)
            distinct = int(ln.args["n_act"].item()) if ln.op.family in ("moe.bf16", "moe.mxfp4") else None
            nbytes = launch_bytes(ln, context=prompt + 1, distinct_experts=distinct)
            rec = {"batch": B, "launch": ln.name, "op": ln.op.name, "family": ln.op.family, "shapes": ln.op.shapes,
                   "source_hash": hashes.get(ln.op.module_name), "bytes": nbytes, "flops": launch_flops(ln, prompt + 1),
                   "seconds": sec, "distinct_experts": distinct, **_judge(nbytes, sec, copy_bw, floor)}
            result["kernels"].append(rec)
            _write(out, "kernels", result)
        try:  # the performance model (kimik3.perfmodel, design v1) against these kernel times, per launch
            from kimik3.perfmodel.device import fused_kernel_report

            result.setdefault("model_vs_measured_fused", []).append(
                fused_kernel_report(result["kernels"], BENCH_PRESET, B, prompt + 1, prompt + 8))
        except Exception as e:  # the comparison must never cost the measurements
            result.setdefault("model_vs_measured_fused", []).append({"batch": B, "error": f"{type(e).__name__}: {e}"})
        # MXFP4 vs bf16 routed experts: the same x / routing / scratch, layer 0's experts packed on the GPU
        moe_ln = next((ln for ln in fused.program if ln.kind == "kernel" and ln.op.family == "moe.bf16"
                       and ln.op.shapes["E"] > 1), None)
        if moe_ln is not None and time.time() < deadline - 8:
            from dataclasses import replace

            op4 = replace(moe_ln.op, family="moe.mxfp4")
            fns = load_kernels([op4], st.arch, "prebuilt", args.prebuilt)
            a4 = dict(moe_ln.args)
            (a4["w1"], a4["s1"]), (a4["w3"], a4["s3"]), (a4["w2"], a4["s2"]) = (
                mxfp4_pack(moe_ln.args["w1"]), mxfp4_pack(moe_ln.args["w3"]), mxfp4_pack(moe_ln.args["w2"]))
            ln4 = type(moe_ln)(moe_ln.name + ".mxfp4", "kernel", op4, a4)
            t16 = _time_launch(runner, moe_ln)
            t4 = _time_launch(KernelRunner(fns), ln4)
            distinct = int(moe_ln.args["n_act"].item())
            b16, b4 = launch_bytes(moe_ln, distinct_experts=distinct), launch_bytes(ln4, distinct_experts=distinct)
            result["mxfp4_vs_bf16"].append({"batch": B, "distinct_experts": distinct, "bf16_s": t16, "mxfp4_s": t4,
                                            "time_ratio_mxfp4_over_bf16": t4 / t16, "bf16_bytes": b16,
                                            "mxfp4_bytes": b4, "byte_ratio": b4 / b16})
            _write(out, "kernels", result)
        del st
        torch.cuda.empty_cache()
        # the megakernel's per-instruction timing buffer (last of 3 steps) against the model, per opcode
        if time.time() < deadline - 20:
            try:
                from kimik3.perfmodel.device import megakernel_opcode_report

                result.setdefault("megakernel_opcodes", []).append(
                    megakernel_opcode_report(model, B, prompt, prebuilt=args.prebuilt, check=False))
            except Exception as e:  # reported, never fatal to the phase
                result.setdefault("megakernel_opcodes", []).append(
                    {"batch": B, "error": f"{type(e).__name__}: {e}"[:2000]})
            _write(out, "kernels", result)
            torch.cuda.empty_cache()
        else:
            result.setdefault("skipped", []).append(f"megakernel per-opcode timings, batch {B}: out of budget")
    _write(out, "kernels", result)


# ====================================================================== phase: bench


def _phase_bench(out: Path, args: argparse.Namespace) -> None:
    import kimik3
    import kimik3.bench as bench

    deadline = float(args.deadline)
    dry = bool(getattr(args, "dry_run", False))
    p = dict(plan(args.prebuilt, bool(args.quick))["bench"])
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    if dry:  # the same rows code on the CPU: only the GPU stages and the large preset are left out
        p.update(preset=DRY_BENCH["preset"], order=[list(x) for x in DRY_BENCH["order"]], context=DRY_BENCH["context"],
                 steps=DRY_BENCH["steps"], repeats=DRY_BENCH["repeats"])
    preset = p["preset"]
    # one model for every row: run_bench builds its model through kimik3.from_preset, which here returns the run's
    # one model (built on the device, shared with phase 'kernels'); one copy-bandwidth measurement for all rows
    saved_from_preset, saved_measure = kimik3.from_preset, bench.measure_local

    def shared_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> Any:
        return _model(name, seed, dtype, str(device))

    kimik3.from_preset = shared_model  # type: ignore[assignment]
    bench.measure_local = functools.lru_cache(maxsize=None)(bench.measure_local)  # type: ignore[assignment]
    reference: dict[tuple[int, int, int], torch.Tensor] = {}  # naive first-step logits, per batch, on the device
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    record: dict[str, Any] = {"date": _now(), "preset": preset, "dtype": dtype, "device": device,
                              "context": p["context"], "steps": p["steps"], "repeats": p["repeats"],
                              "order": p["order"], "rows": rows, "skipped": skipped, "dry_run": dry,
                              "tolerance_vs_naive": TOL["bf16_stage"],
                              "weights": "kimik3.model.random_init rules, drawn on the device "
                                         "(kimik3.model.random_init.device_model)"}
    try:
        for stage, batch in p["order"]:
            left = deadline - time.time()
            need = 0.0 if dry else BENCH_RESERVE_S.get(stage, BENCH_RESERVE_DEFAULT_S)
            if left < need:
                skipped.append({"stage": stage, "batch": batch, "reason": f"skipped: {left:.0f} s of the 5-minute "
                                f"budget left, this row needs about {need:.0f} s"})
                _write(out, "bench", record)
                continue
            t0 = time.time()
            try:
                df = bench.run_bench(preset, [stage], [batch], p["context"], device=device, dtype=dtype,
                                     steps=p["steps"], repeats=p["repeats"], out=None, progress=False,
                                     reference=reference)
                new = json.loads(df.to_json(orient="records"))
            except Exception as e:  # a crash in one row must not lose the others
                new = [{"stage": stage, "batch": batch, "status": f"error: {type(e).__name__}: {e}"[:2000]}]
            for r in new:
                r["wall_s"] = round(time.time() - t0, 1)
            rows.extend(new)
            _speedups(rows)
            _write(out, "bench", record)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        kimik3.from_preset, bench.measure_local = saved_from_preset, saved_measure  # type: ignore[assignment]
    _write(out, "bench", record)


def judge_bench(rec: dict[str, Any] | None) -> list[str]:
    """The failures of the bench phase, by row: a planned row not measured (skipped, refused, crashed), a row
    without its comparison with ``naive``, a row whose first decode step disagrees with ``naive``."""
    if rec is None:
        return ["bench: no result file (the phase did not run)"]
    tol = float(rec.get("tolerance_vs_naive", TOL["bf16_stage"]))
    rows = {(r.get("stage"), r.get("batch")): r for r in rec.get("rows", [])}
    skipped = {(s["stage"], s["batch"]): s["reason"] for s in rec.get("skipped", [])}
    failures = []
    for stage, batch in rec.get("order", []):
        name = f"bench {stage} batch {batch}"
        r = rows.get((stage, batch))
        if r is None:
            failures.append(f"{name}: {skipped.get((stage, batch), 'not measured')}")
        elif r.get("status") != "ok":
            failures.append(f"{name}: {str(r.get('status'))[:300]}")
        elif r.get("rel_err_vs_naive") is None:
            failures.append(f"{name}: no comparison with naive")
        elif not float(r["rel_err_vs_naive"]) <= tol:  # (NaN fails too)
            failures.append(f"{name}: disagrees with naive (first-step rel err {r['rel_err_vs_naive']:.3g} > {tol})")
    return failures


def _speedups(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_naive / speedup_vs_compiled across rows measured in separate run_bench calls of this run."""
    for ref in ("naive", "compiled"):
        base = {r["batch"]: r["ms_per_token"] for r in rows if r.get("stage") == ref and r.get("ms_per_token")}
        for r in rows:
            ms = r.get("ms_per_token")
            r[f"speedup_vs_{ref}"] = base[r["batch"]] / ms if ms and r["batch"] in base else None


# ====================================================================== phase: megakernel, MXFP4 experts


def _mxfp4_model(preset: str, dry: bool) -> Any:
    """``preset``'s model holding its routed experts as MXFP4. k3-shard: the run's one model (built for the kernels
    and bench phases, which ran before), quantised in place and dropped from the cache, so nothing later takes it
    for the dense one; the dry run: fp32 on the CPU."""
    dtype, device = (torch.float32, "cpu") if dry else (torch.bfloat16, "cuda")
    model = _model(preset, dtype=dtype, device=device).quantize_experts()
    _MODELS.clear()
    return model


def _modelled_opcode_report(program: Any, preset: str, context: int) -> dict[str, Any]:
    """The dry run's stand-in for the timing buffer: ``program`` scored by ``kimik3.perfmodel.opcode_report`` with the
    model's own simulated timeline as the "measurement" (measured / model = 1 for every opcode). It exercises the
    scoring of an MXFP4 program (its expert opcodes from the design's MXFP4 entries), not the device."""
    import numpy as np

    from kimik3.perfmodel import design_expert_formats, megakernel_model, opcode_report
    from kimik3.perfmodel.data import CURRENT_DESIGN

    if program.expert_format == "mxfp4" and "mxfp4" not in design_expert_formats(CURRENT_DESIGN):
        return {"not_scored": f"design {CURRENT_DESIGN} does not describe MXFP4 experts"}
    _, tl = megakernel_model(preset, program.batch, CURRENT_DESIGN, None, context, program=program,
                             experts="mxfp4" if program.expert_format == "mxfp4" else "bf16")
    timings = np.stack([tl["start_ns"].to_numpy(), tl["end_ns"].to_numpy(), tl["sm"].to_numpy()], 1).astype(np.int64)
    return {**opcode_report(program, timings, preset, context), "timings": "the model's own timeline (dry run)"}


def _mxfp4_item(it: dict[str, Any], model: Any, prebuilt: Path | None, dry: bool) -> dict[str, Any]:
    """One MXFP4 megakernel item: ``naive``'s teacher-forcing trace on ``model``, the megakernel (a GPU run) and the
    interpreter (where planned) against it and against each other, per step; the timing buffer (where planned)."""
    import copy

    import kimik3.megakernel.interpreter  # noqa: F401  (registers stage "megakernel-interp")
    from kimik3.validation import reference_trace
    from kimik3.validation.compare import run_stage  # the comparison loop, also returning each step's logits
    from kimik3.validation.metric import rel_error

    B = it["batch"]
    rec: dict[str, Any] = {**it, "expert_storage": model.expert_storage}
    trace = reference_trace(model, B, MXFP4_PROMPT, MXFP4_STEPS, seed=B)
    opts = {"check": False, **({"prebuilt": str(prebuilt)} if prebuilt else {})}  # (the GPU tests hazard-check)
    mk_out = None
    if dry:
        rec["megakernel_vs_naive"] = "left out in the dry run: GPU launches only"
    else:
        mk, mk_out, _ = run_stage(model, "megakernel", trace, False, **opts)
        rec["megakernel_vs_naive"] = mk.as_dict()
    if it["interp"]:
        # the CPU interpreter of the same kind of program, in fp32 on the same (bf16-rounded) weights: the reference
        # the megakernel's bf16 error is measured against; against naive (bf16 on the device) by the bf16 rule
        cpu = model if dry else copy.deepcopy(model).to("cpu").cast_(torch.float32)
        ir, ir_out, _ = run_stage(cpu, "megakernel-interp", trace, False)
        d = ir.as_dict()  # the dry run: fp32 against naive in fp32, the fp32 rule (greedy: the same tokens)
        if not dry:  # fp32 against naive in bf16 on the device: teacher-forced, the bf16 rule
            d.update(mode="teacher-forced", tolerance=TOL["bf16_stage"], passed=d["max_error"] <= TOL["bf16_stage"])
        rec["interp_vs_naive"] = d
        if mk_out is not None:
            e = [rel_error(m.float(), r.float()) for m, r in zip(mk_out, ir_out)]
            rec["megakernel_vs_interp"] = {"errors": e, "max_error": max(e), "tolerance": TOL["bf16_stage"]}
        del cpu
    if it["timings"]:
        try:  # reported, never fatal (as the dense megakernel's in phase 'kernels')
            if dry:
                from kimik3.perfmodel import model_program

                prog = model_program(it["preset"], B, experts="mxfp4")
                rec["opcodes"] = _modelled_opcode_report(prog, it["preset"], MXFP4_PROMPT + MXFP4_STEPS)
            else:
                from kimik3.perfmodel.device import megakernel_opcode_report

                rec["opcodes"] = megakernel_opcode_report(model, B, MXFP4_PROMPT, steps=MXFP4_STEPS, **opts)
        except Exception as e:
            rec["opcodes"] = {"batch": B, "error": f"{type(e).__name__}: {e}"[:2000]}
    return rec


def _phase_megakernel_mxfp4(out: Path, args: argparse.Namespace) -> None:
    """The MXFP4 megakernel variants on MXFP4-holding models, item by item in the plan's order, each item's record
    written as it ends; the dry run: ``DRY_MXFP4`` on the CPU, its megakernel launches left out."""
    deadline = float(args.deadline)
    dry = bool(getattr(args, "dry_run", False))
    p = plan(args.prebuilt, bool(args.quick), getattr(args, "presets", ""), getattr(args, "batches", ""))
    items = [DRY_MXFP4] if dry else p["megakernel_mxfp4"]["items"]
    result: dict[str, Any] = {"date": _now(), "dry_run": dry, "items": items, "results": [], "skipped": [],
                              "prompt_len": MXFP4_PROMPT, "steps": MXFP4_STEPS, "tolerance": TOL["bf16_stage"]}
    models: dict[str, Any] = {}
    for it in items:
        left = deadline - time.time()
        if not dry and left < MXFP4_RESERVE_S:
            result["skipped"].append({"variant": it["variant"], "reason": f"skipped: {left:.0f} s of the phase's "
                                      f"budget left, an item needs about {MXFP4_RESERVE_S:.0f} s"})
            _write(out, "megakernel_mxfp4", result)
            continue
        t0 = time.time()
        try:
            if it["preset"] not in models:
                models.clear()  # one model resident at a time
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                models[it["preset"]] = _mxfp4_model(it["preset"], dry)
            rec = _mxfp4_item(it, models[it["preset"]], args.prebuilt, dry)
            rec["status"] = "ok"
        except Exception as e:  # one item failing must not lose the others
            rec = {**it, "status": f"error: {type(e).__name__}: {e}"[:2000]}
        rec["seconds"] = round(time.time() - t0, 1)
        result["results"].append(rec)
        _write(out, "megakernel_mxfp4", result)
    models.clear()
    _write(out, "megakernel_mxfp4", result)


def judge_mxfp4(rec: dict[str, Any] | None) -> list[str]:
    """The failures of the MXFP4 megakernel phase, by variant: a planned item not run (skipped, crashed), a
    comparison missing or over its tolerance (the megakernel against ``naive``, the interpreter against ``naive``,
    the megakernel against the interpreter). The timing report is not judged (as the dense megakernel's)."""
    if rec is None:
        return ["megakernel_mxfp4: no result file (the phase did not run)"]
    dry = bool(rec.get("dry_run"))
    done = {r["variant"]: r for r in rec.get("results", [])}
    skipped = {s["variant"]: s["reason"] for s in rec.get("skipped", [])}
    failures = []
    for it in rec.get("items", []):
        name = f"megakernel_mxfp4 {it['variant']}"
        r = done.get(it["variant"])
        if r is None:
            failures.append(f"{name}: {skipped.get(it['variant'], 'not run')}")
            continue
        if r.get("status") != "ok":
            failures.append(f"{name}: {str(r.get('status'))[:300]}")
            continue
        need = ([] if dry else ["megakernel_vs_naive"]) + (["interp_vs_naive"] if it["interp"] else []) + (
            ["megakernel_vs_interp"] if it["interp"] and not dry else [])
        for key in need:
            c = r.get(key)
            if not isinstance(c, dict):
                failures.append(f"{name}: no {key.replace('_', ' ')}")
            elif not float(c["max_error"]) <= float(c["tolerance"]):  # (NaN fails too)
                failures.append(f"{name}: {key.replace('_', ' ')} rel err {c['max_error']:.3g} > {c['tolerance']}")
            elif c.get("mode") == "greedy" and not c.get("tokens_equal", True):
                failures.append(f"{name}: {key.replace('_', ' ')}: greedy tokens differ")
    return failures


# ====================================================================== measurements


def _measurements(out: Path, prov: dict[str, Any]) -> dict[str, Any] | None:
    """The measured rows in the data/measurements format (copy into data/measurements/ to commit them)."""
    from kimik3.perf.cost import decode_cost

    records: list[dict[str, Any]] = []
    bench = _read(out, "bench") or {}
    for r in bench.get("rows", []):
        if r.get("status") == "ok" and r.get("ms_per_token"):
            cost = decode_cost(BENCH_PRESET, r["batch"], bench.get("context", 512) + bench.get("steps", 8))
            records.append({"block": "step", "stage": r["stage"], "batch_size": r["batch"],
                            "context_len": bench.get("context"), "seconds": r["ms_per_token"] / 1e3,
                            "bytes": cost.total_bytes, "flops": cost.total_flops, "ms_min": r.get("ms_min"),
                            "ms_max": r.get("ms_max"), "pct_read_bw": r.get("pct_read_bw"),
                            "pct_copy_bw": r.get("pct_copy_bw"), "rel_err_vs_naive": r.get("rel_err_vs_naive")})
    kern = _read(out, "kernels") or {}
    for k in kern.get("kernels", []):
        records.append({"block": f"kernel:{k['launch']}", "stage": "fused", "batch_size": k["batch"],
                        "seconds": k["seconds"], "bytes": k["bytes"], "flops": k["flops"], "op": k["op"],
                        "source_hash": k["source_hash"], "pct_copy_bw": k["pct_copy_bw"], "verdict": k["verdict"]})
    for m in kern.get("mxfp4_vs_bf16", []):
        for fmt in ("bf16", "mxfp4"):
            records.append({"block": f"experts:{fmt}", "stage": "fused", "batch_size": m["batch"],
                            "seconds": m[f"{fmt}_s"], "bytes": m[f"{fmt}_bytes"],
                            "time_ratio_mxfp4_over_bf16": m["time_ratio_mxfp4_over_bf16"]})
    if not records:
        return None
    data = {"date": prov.get("date"), "commit": prov.get("commit"),
            "dirty_working_tree": prov.get("dirty_working_tree"),
            "device": prov.get("gpu"), "torch_version": prov.get("torch"), "preset": BENCH_PRESET,
            "kernel_source_hashes": prov.get("kernel_source_hashes"), "source": "scripts/device_check.py",
            "records": records}
    _write(out, "measurements", data)
    return data


# ====================================================================== orchestration


def _phase_kernels_dry(out: Path, args: argparse.Namespace) -> None:
    """The dry run of phase 'kernels': the ops it would time, each of which must be among the verified artefacts."""
    p = plan(args.prebuilt, bool(args.quick), getattr(args, "presets", ""), getattr(args, "batches", ""))
    _write(out, "kernels", {"date": _now(), "dry_run": True, "preset": BENCH_PRESET, "ops": p["kernels"]["ops"],
                            "left_out": "the GPU launches (every kernel is timed on the device)"})


PHASES: dict[str, Callable[[Path, argparse.Namespace], None]] = {
    "copy_bandwidth": _phase_copy_bandwidth, "tests": _phase_tests, "kernels": _phase_kernels, "bench": _phase_bench,
    "megakernel_mxfp4": _phase_megakernel_mxfp4}
DRY_PHASES: dict[str, Callable[[Path, argparse.Namespace], None] | None] = {
    "copy_bandwidth": None, "tests": _phase_tests, "kernels": _phase_kernels_dry, "bench": _phase_bench,
    "megakernel_mxfp4": _phase_megakernel_mxfp4}


def verdict(out: Path, summary: dict[str, Any]) -> list[str]:
    """Every failure of the run, by name: a phase that did not finish, a planned test that did not pass, a benchmark
    row not measured or disagreeing with ``naive``, an MXFP4 megakernel item not run or disagreeing, a prebuilt
    artefact missing, stale or not loadable, a carry over the limit. Empty only when everything planned ran and
    agreed."""
    failures = [f"phase {p['phase']}: {p['status']}" for p in summary["phases"]
                if p["status"] not in ("ok", "left out in the dry run: GPU launches only")]
    ran = {p["phase"] for p in summary["phases"]}
    pl = _read(out, "plan") or {}
    pb = pl.get("prebuilt") or {}
    failures += [f"prebuilt kernel {n}: missing" for n in pb.get("missing", [])]
    failures += [f"prebuilt kernel {n}: stale (built from other kernel sources)" for n in pb.get("stale", [])]
    failures += [f"prebuilt kernel {v['name']}: {v['status']}" for v in pl.get("verified", [])
                 if v["status"] not in ("loaded", "verified")]
    carry = pl.get("carry")
    if carry and not carry["fits"]:
        failures.append(f"carry: {carry['total_MiB']} MiB is over the {carry['limit_MiB']:.0f} MiB limit")
    if "tests" in ran:
        failures += judge_tests(_read(out, "tests"))
    if "bench" in ran:
        failures += judge_bench(_read(out, "bench"))
    if "megakernel_mxfp4" in ran:
        failures += judge_mxfp4(_read(out, "megakernel_mxfp4"))
    return failures


def run_phases(out: Path, args: argparse.Namespace, phases: Sequence[str], t_start: float | None = None,
               table: dict[str, Any] | None = None) -> int:
    """Run ``phases`` in order, in this process (one model, one set of loaded kernels), each under its budget,
    write the summary after each, judge the whole: 0 when :func:`verdict` finds nothing, else 1."""
    t_start = time.time() if t_start is None else t_start
    dry = bool(getattr(args, "dry_run", False))
    table = (DRY_PHASES if dry else PHASES) if table is None else table
    pl = _read(out, "plan") or plan(args.prebuilt, bool(args.quick), getattr(args, "presets", ""),
                                    getattr(args, "batches", ""))
    budgets = pl["phase_budgets_s"]
    summary: dict[str, Any] = {"date": _now(), "dry_run": dry, "phases": [], "failures": []}
    prov = _read(out, "provenance") or {}
    summary["commit"] = prov.get("commit")
    for i, phase in enumerate(phases):
        left = TOTAL_BUDGET_S - (time.time() - t_start)
        # bench takes what is left once the phases after it have their budgets
        later = sum(budgets.get(q, 0.0) for q in phases[i + 1:] if q != "bench")
        budget = min(budgets.get(phase, left) if phase != "bench" else left - later, left)
        rec: dict[str, Any] = {"phase": phase, "estimate_s": PHASE_ESTIMATES_S.get(phase), "budget_s": round(budget)}
        fn = table.get(phase)
        if fn is None:
            rec["status"] = "left out in the dry run: GPU launches only" if dry else "unknown phase"
        elif budget < 10 and not dry:
            rec["status"] = f"skipped: {left:.0f} s left of the budget"
        else:
            print(f"[device_check] {phase} (estimate {PHASE_ESTIMATES_S.get(phase, 0):.0f} s, budget {budget:.0f} s)"
                  " ...", flush=True)
            t0 = time.time()
            ns = argparse.Namespace(**{**vars(args), "deadline": str(time.time() + budget)})
            try:
                fn(out, ns)
                rec["status"] = "ok"
            except Exception as e:  # one phase failing must not lose the others' results
                rec["status"] = f"error: {type(e).__name__}: {e}"[:2000]
            rec["seconds"] = round(time.time() - t0, 1)
        summary["phases"].append(rec)
        summary["elapsed_s"] = round(time.time() - t_start, 1)
        _write(out, "summary", summary)
    if not dry:
        _measurements(out, prov)
    summary["failures"] = verdict(out, summary)
    summary["exit_status"] = 1 if summary["failures"] else 0
    summary["elapsed_s"] = round(time.time() - t_start, 1)
    _write(out, "summary", summary)
    _print_summary(out, summary)
    return summary["exit_status"]


def _orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    t_start = time.time()
    _write(out, "provenance", device_provenance(args.prebuilt))
    pl = plan(args.prebuilt, bool(args.quick), args.presets, args.batches)
    _write(out, "plan", pl)
    pb = pl["prebuilt"]
    if args.dry_run and not pb["manifest_found"]:
        print(f"dry run, plan only: wrote {out / FILES['provenance']} and {out / FILES['plan']}; no prebuilt "
              f"manifest in {pb['dir']}, so nothing to execute: {pb['distinct_ops']} kernels needed, "
              f"{len(pb['missing'])} missing (build them with --build-prebuilt DIR on a machine with the CuTe DSL)")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("refusing a real device check: no CUDA device here. Run it on the GPU machine (scripts/device_check.sh), "
              "or use --dry-run to check the plan and the prebuilt kernels on this machine.", file=sys.stderr)
        return 2
    # the plan's own checks, executed: every artefact the run loads, and what the device tool would carry
    pl["verified"] = verify_prebuilt(Path(args.prebuilt), pb, load=True) if pb["manifest_found"] else []
    pl["carry"] = carried_files(Path(args.prebuilt) if args.prebuilt else None)
    _write(out, "plan", pl)
    print(f"[device_check] prebuilt {pb['dir']}: {len(pl['verified'])} artefacts checked, {len(pb['missing'])} "
          f"missing, {len(pb['stale'])} stale; carry {pl['carry']['total_MiB']} MiB", flush=True)
    phases = [args.phase] if args.phase else list(PHASES)
    return run_phases(out, args, phases, t_start)


def _print_summary(out: Path, summary: dict[str, Any]) -> None:
    print(f"\n== device check summary{' (dry run)' if summary.get('dry_run') else ''} ==")
    for p in summary["phases"]:
        print(f"{p['phase']:16s} {p['status'][:60]:60s} {p.get('seconds', 0):7.1f} s (estimate "
              f"{p.get('estimate_s') or 0:.0f} s)")
    bench = _read(out, "bench")
    if bench:
        print(f"\nbench ({bench.get('preset')}, {bench.get('dtype')}): stage batch ms/token tok/s %readBW x_naive "
              "x_compiled rel_err_vs_naive")
        for r in bench["rows"]:
            if r.get("ms_per_token"):
                pct = r.get("pct_read_bw", r.get("pct_copy_bw")) or float("nan")
                err = r.get("rel_err_vs_naive")
                print(f"  {r['stage']:9s} {r['batch']:3d} {r['ms_per_token']:9.3f} "
                      f"{r.get('tokens_per_s') or float('nan'):9.1f} "
                      f"{pct:6.1f} {r.get('speedup_vs_naive') or float('nan'):7.2f} "
                      f"{r.get('speedup_vs_compiled') or float('nan'):7.2f} "
                      f"{'n/a' if err is None else f'{err:.2e}'}")
            else:
                print(f"  {r['stage']:9s} {r['batch']:3d} {r.get('status')}")
        for s in bench.get("skipped", []):
            print(f"  {s['stage']:9s} {s['batch']:3d} {s['reason']}")
    kern = _read(out, "kernels")
    if kern and kern.get("kernels"):
        print("\nkernels (k3-shard): launch batch MB us GB/s %copyBW verdict")
        for k in kern["kernels"]:
            print(f"  {k['launch']:24s} {k['batch']:3d} {k['bytes'] / 1e6:9.2f} {k['seconds'] * 1e6:9.1f} "
                  f"{k['gb_per_s']:8.1f} {k['pct_copy_bw']:6.1f} {k['verdict']}")
        for m in kern.get("mxfp4_vs_bf16", []):
            print(f"  MXFP4/bf16 routed experts B={m['batch']}: time ratio {m['time_ratio_mxfp4_over_bf16']:.3f}, "
                  f"byte ratio {m['byte_ratio']:.3f}")
    mx = _read(out, "megakernel_mxfp4")
    if mx and (mx.get("results") or mx.get("skipped")):
        print("\nmegakernel, MXFP4 experts: variant max rel err vs naive (megakernel, interpreter), megakernel vs "
              "interpreter, opcode report")
        for r in mx.get("results", []):
            errs = [r.get(k, {}).get("max_error") if isinstance(r.get(k), dict) else None
                    for k in ("megakernel_vs_naive", "interp_vs_naive", "megakernel_vs_interp")]
            ops = r.get("opcodes") or {}
            rep = ("error" if "error" in ops else "not scored" if "not_scored" in ops else "ok" if ops else "-")
            print(f"  {r['variant']:28s} {r['status'][:40]:40s} "
                  + " ".join("n/a" if e is None else f"{e:.2e}" for e in errs) + f" {rep}")
        for s in mx.get("skipped", []):
            print(f"  {s['variant']:28s} {s['reason']}")
    fails = summary.get("failures") or []
    print(f"\n{len(fails)} failure(s){':' if fails else ': everything planned ran and agreed with naive'}")
    for f in fails:
        print(f"  FAILED {f}")


def _build(args: argparse.Namespace) -> int:
    """Compile + export every kernel of the targets (CPU machine with the CuTe DSL), record the commit."""
    from kimik3.fused.loading import build_prebuilt_kernels

    out = Path(args.build_prebuilt)
    targets, mk_targets = select(args.presets, args.batches)
    from kimik3.kernels.toolchain import prebuilt as pb
    from kimik3.kernels.toolchain.registry import get_variant

    t0 = time.time()
    names = megakernel_variants(args.presets, args.batches)  # dense, then those for MXFP4 routed experts
    mk = [get_variant(n) for n in names]
    # the DSL runtime is compressed once, by the last export into the directory (xz of 43 MB takes a while)
    build_prebuilt_kernels(args.arch, out, targets, ship_runtime=not mk)
    if mk:  # the megakernel goes into the same directory and manifest (build_prebuilt extends the manifest)
        pb.build_prebuilt(args.arch, out, mk, fmt="tvm-ffi", ship_runtime=True)
    commit, source, dirty = commit_info(None)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout \
        if (REPO / ".git").exists() else ""
    info = {"commit": commit, "commit_source": source, "dirty": dirty,
            "dirty_files": [ln[3:] for ln in status.splitlines()][:200], "date": _now(), "arch": args.arch,
            "targets": [list(t) for t in targets], "megakernel_targets": [list(t) for t in mk_targets],
            "megakernel_variants": names,
            "seconds": round(time.time() - t0, 1), "kernel_source_hashes": _kernel_hashes()}
    tmp = out / "BUILD_INFO.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, out / "BUILD_INFO.json")
    print(f"built {len(targets)} fused target(s) and {len(mk)} megakernel variant(s) into {out} in "
          f"{time.time() - t0:.0f} s (commit {commit}, dirty={dirty})")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 scripts/device_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output directory for the JSON files (the device tool's $OUT)")
    p.add_argument("--prebuilt", type=Path, default=None, help="prebuilt kernel directory (manifest.json + .so)")
    p.add_argument("--quick", action="store_true", help="fewer batches, steps and rows (about 3 minutes)")
    p.add_argument("--dry-run", action="store_true", help="execute the plan on this machine, GPU launches left out")
    p.add_argument("--build-prebuilt", metavar="DIR", help="build the kernels the check needs into DIR and exit")
    p.add_argument("--arch", default="sm_90a", help="target architecture for --build-prebuilt")
    p.add_argument("--presets", default="", help="only these presets' targets (comma-separated; build and dry run)")
    p.add_argument("--batches", default="", help="only these batch sizes' targets (comma-separated)")
    p.add_argument("--phase", choices=sorted(PHASES), help="run this phase only (after provenance and plan)")
    p.add_argument("--deadline", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.build_prebuilt:
        return _build(args)
    if not args.out:
        _parser().error("--out is required")
    if args.prebuilt is None:
        from kimik3.kernels.toolchain.loader import default_prebuilt_dir

        args.prebuilt = default_prebuilt_dir()
    return _orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
