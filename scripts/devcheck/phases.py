"""The device check's phases that run in its own process — copy bandwidth, the GPU test files (each a pytest
child), the fused kernels timed alone, the benchmark rows of every stage but the megakernel — and those whose every
launch runs in a child process (``devcheck.isolate``): preflight, constants, the MXFP4 megakernel items, the
megakernel's rows, the rank items. docs/device-check.md."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from devcheck import plan as P
from devcheck.common import REPO, RUNTIME_LIB, now, read, write, write_json
from devcheck.isolate import run_items
from devcheck.pytests import run_tests
from kimik3.validation.metric import TOL


def _deadline(args: argparse.Namespace) -> float:
    return float(args.deadline)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    return read(Path(args.out), "plan") or P.plan(args.prebuilt, bool(args.quick), getattr(args, "presets", ""),
                                                   getattr(args, "batches", ""))


def _dry(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "dry_run", False))


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    import os

    env = os.environ.copy()
    if args.prebuilt is not None:
        env["KIMIK3_PREBUILT"] = str(Path(args.prebuilt).resolve())
    if getattr(args, "plant", None):
        env["KIMIK3_DEVCHECK_PLANT"] = ";".join(args.plant)
    if _dry(args):
        # the dry run shares a small CPU with whatever else runs (CI's test workers): a child's idle OpenMP threads
        # spin against theirs, which slowed the MXFP4 item ten-fold (10 s alone, 97 s beside a 2-thread torch job)
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _children(out: Path, args: argparse.Namespace, job: str, items: list[dict[str, Any]],
              context: dict[str, Any]) -> list[dict[str, Any]]:
    dry = _dry(args)
    runtime = Path(args.prebuilt) / RUNTIME_LIB if args.prebuilt else None
    had_runtime = runtime is not None and runtime.exists()
    try:
        return run_items(out, job, items, context={"dry": dry, "prebuilt": str(args.prebuilt) if args.prebuilt
                                                   else None, **context},
                         deadline=_deadline(args), item_timeout_s=getattr(args, "item_timeout", None) or (
                             P.DRY_ITEM_TIMEOUT_S if dry else P.ITEM_TIMEOUT_S[job]),
                         startup_s=P.DRY_CHILD_STARTUP_S if dry else P.CHILD_STARTUP_S, env=_child_env(args))
    finally:
        if runtime is not None and not had_runtime and runtime.exists():  # unpacked by a child's load: not carried
            runtime.unlink()


# ---------------------------------------------------------------------------------------------- child phases


def phase_preflight(out: Path, args: argparse.Namespace) -> None:
    """Every megakernel variant's cubin, compile report, design and (GPU) driver attributes, compared."""
    items = _plan(args)["preflight"]["items"]
    rec: dict[str, Any] = {"date": now(), "dry_run": _dry(args), "items": items, "results": []}
    if args.prebuilt is None or not (Path(args.prebuilt) / "manifest.json").exists():
        rec["results"] = [{**it, "status": "error: no prebuilt manifest to read the cubin from"} for it in items]
    else:
        rec["results"] = _children(out, args, "preflight", items, {})
    write(out, "preflight", rec)


def phase_smoke(out: Path, args: argparse.Namespace) -> None:
    """One opcode family at a time as a program of its own, against the interpreter: a bad opcode is named before
    the full step runs."""
    items = _plan(args)["smoke"]["items"]
    write(out, "smoke", {"date": now(), "dry_run": _dry(args), "items": items,
                         "results": _children(out, args, "smoke", items, {})})


def phase_constants(out: Path, args: argparse.Namespace) -> None:
    """The performance model's constants measured by the probe kernels, in the format kimik3.perfmodel reads."""
    left = _deadline(args) - time.time()
    item = {"name": "constants probes"}
    (res,) = _children(out, args, "constants", [item], {"budget_s": max(1.0, left - 8.0)})
    write(out, "constants", {"date": now(), "dry_run": _dry(args), "items": [item], "results": [res]})
    doc = res.get("document") or {}
    if doc.get("constants") and not doc.get("dry_run"):  # ready to commit as data/measurements/constants-<hw>.json
        write_json(Path(out) / f"constants-{doc.get('hardware', 'h200')}.json", doc)


def phase_megakernel_mxfp4(out: Path, args: argparse.Namespace) -> None:
    """The MXFP4 megakernel variants on MXFP4-holding models, item by item, each in a child process."""
    pl = _plan(args)
    dry = _dry(args)
    items = [{"name": f"mxfp4 {P.DRY_MXFP4['variant']}", **P.DRY_MXFP4}] if dry else pl["megakernel_mxfp4"]["items"]
    res = _children(out, args, "megakernel_mxfp4", items, {"prompt": P.MXFP4_PROMPT, "steps": P.MXFP4_STEPS})
    write(out, "megakernel_mxfp4", {"date": now(), "dry_run": dry, "items": items, "results": res,
                                    "prompt_len": P.MXFP4_PROMPT, "steps": P.MXFP4_STEPS,
                                    "tolerance": TOL["bf16_stage"]})


def phase_megakernel(out: Path, args: argparse.Namespace) -> None:
    """The megakernel's benchmark rows (the bench preset, at the bench's context and the model's) and its timing
    buffer against the performance model, last, in a child process."""
    pl = _plan(args)
    dry = _dry(args)
    mk = pl["megakernel"]
    if dry:
        items = P.megakernel_items(P.DRY_MEGAKERNEL["rows"], P.DRY_MEGAKERNEL["opcode_batches"])
        ctx = {"preset": P.DRY_MEGAKERNEL["preset"], "stage": P.DRY_MEGAKERNEL["stage"], "steps": 1, "repeats": 1,
               "opcode_prompt": 8}
    else:
        items = mk["items"]
        ctx = {"preset": mk["preset"], "stage": "megakernel", "steps": mk["steps"], "repeats": mk["repeats"],
               "opcode_prompt": pl["kernels"].get("prompt", 256)}
    ref = Path(out) / "children" / "naive_reference.safetensors"
    res = _children(out, args, "megakernel", items, {**ctx, "reference_file": str(ref)})
    write(out, "megakernel", {"date": now(), "dry_run": dry, "preset": ctx["preset"], "stage": ctx["stage"],
                              "items": items, "results": res, "tolerance_vs_naive": TOL["bf16_stage"]})


def phase_ranks(out: Path, args: argparse.Namespace) -> None:
    """The rank items, each in a child process of its own with its timeout: the loopback against naive, then one
    rank alone timed with the NVL72 prediction from its measured step."""
    pl = _plan(args)
    dry = _dry(args)
    items = pl["ranks"]["items"]
    ctx = {"dry": dry, "prebuilt": str(args.prebuilt) if args.prebuilt else None, "prompt": pl["ranks"]["prompt_len"],
           "steps": pl["ranks"]["steps"]}
    timeout = getattr(args, "item_timeout", None) or (P.DRY_RANKS_ITEM_TIMEOUT_S if dry else P.ITEM_TIMEOUT_S["ranks"])
    res = []
    for it in items:  # one child per item: a k3-rank model (tens of GB) never shares a process with another
        res += run_items(out, "ranks", [it], context=ctx, deadline=_deadline(args), item_timeout_s=timeout,
                         startup_s=P.DRY_CHILD_STARTUP_S if dry else P.CHILD_STARTUP_S, env=_child_env(args))
    write(out, "ranks", {"date": now(), "dry_run": dry, "items": items, "results": res,
                         "tolerance_vs_naive": TOL["bf16_stage"]})


# ---------------------------------------------------------------------------------------------- tests


def _dry_tests(out: Path, phase: str, tests: list[dict[str, Any]]) -> None:
    missing = [t["file"] for t in tests if t["run"] and not (REPO / t["file"]).exists()]
    plugin = (REPO / "scripts" / "device_check_outcomes.py").exists()
    write(out, phase, {"date": now(), "dry_run": True, "planned": [t["file"] for t in tests if t["run"]],
                       "missing_files": missing, "outcome_recorder": plugin,
                       "left_out": "the GPU launches: every planned test needs CUDA", "results": []})


def _test_env(args: argparse.Namespace) -> dict[str, str]:
    env = _child_env(args)
    env["KIMIK3_QUICK"] = "1" if args.quick else "0"
    return env


def phase_megakernel_tests(out: Path, args: argparse.Namespace) -> None:
    """The megakernel's GPU tests, first of all GPU work: a hung test is killed and named, the rest go on."""
    tests = [{"file": P.MEGAKERNEL_TEST_FILE, "run": True}]
    if _dry(args):
        return _dry_tests(out, "megakernel_tests", tests)
    run_tests(out, tests, max(10.0, _deadline(args) - time.time() - 2), env=_test_env(args),
              keyword="not b64" if args.quick else None, phase="megakernel_tests", per_test_s=30.0)


def phase_tests(out: Path, args: argparse.Namespace) -> None:
    p = P.plan(args.prebuilt, bool(args.quick))
    tests = [{"file": f, "run": True} for f in args.tests] if getattr(args, "tests", None) else p["tests"]
    if _dry(args):
        return _dry_tests(out, "tests", tests)
    # --quick leaves batch 64 out of the plan (deselected, so not counted as run, rather than skipped)
    run_tests(out, tests, max(10.0, _deadline(args) - time.time() - 2), env=_test_env(args),
              keyword="not b64" if args.quick else None)


# ---------------------------------------------------------------------------------------------- copy bandwidth


def _graph_time(g: torch.cuda.CUDAGraph, per_replay: int, replays: int = 7) -> float:
    """Median seconds per launch over ``replays`` replays of a graph holding ``per_replay`` launches."""
    import statistics

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


def _captured(fn: Any, n: int) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return g


def launch_floor_s(reps: int = 50) -> float:
    """Median time of one tiny kernel replayed from a CUDA graph: what any launch costs, however small."""
    x = torch.zeros(1, device="cuda")
    return _graph_time(_captured(lambda: x.add_(1), reps), reps)


def time_launch(runner: Any, ln: Any, n: int = 20) -> float:
    """Seconds per launch of one kernel: ``n`` back-to-back launches captured in a CUDA graph (no host overhead),
    replayed, timed with CUDA events. Data under ~50 MB can stay in L2 between launches: in-step times of small
    kernels may be higher."""
    return _graph_time(_captured(lambda: runner(ln), n), n)


def phase_copy_bandwidth(out: Path, args: argparse.Namespace) -> None:
    from kimik3.perf.hardware import measure_local

    m = measure_local(device="cuda", quick=bool(args.quick))
    floor = launch_floor_s()
    write(out, "copy_bandwidth", {"date": now(), "measure_local": m, "copy_bandwidth_Bps": m["copy_bandwidth_Bps"],
                                  "launch_floor_s": floor, "launch_floor_method": "median per-launch time of a "
                                  "1-element add_ replayed 50x from one CUDA graph, CUDA events"})


def copy_bw(out: Path) -> tuple[float, float]:
    d = read(out, "copy_bandwidth")
    if d:
        return float(d["copy_bandwidth_Bps"]), float(d["launch_floor_s"])
    from kimik3.perf.hardware import measure_local

    return float(measure_local(device="cuda", quick=True)["copy_bandwidth_Bps"]), launch_floor_s()


def phase_kernels_dry(out: Path, args: argparse.Namespace) -> None:
    """The dry run of phase 'kernels': the ops it would time, each of which must be among the verified artefacts."""
    p = _plan(args)
    write(out, "kernels", {"date": now(), "dry_run": True, "preset": P.BENCH_PRESET, "ops": p["kernels"]["ops"],
                           "left_out": "the GPU launches (every kernel is timed on the device)"})

