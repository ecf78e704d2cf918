"""The GPU device check: one command, one run inside 8 minutes on an H200 with a quarter of it left as slack,
every result written as it goes, and an exit status that is 0 only when everything it planned ran and agreed with
``naive``. Every megakernel launch runs in a child process with a hard timeout: a hang or fault costs its item,
named, not the run.

``python3 scripts/device_check.py --out DIR --prebuilt DIR [--quick]`` on a GPU machine that has the prebuilt
kernels (exported on a CPU machine with ``--build-prebuilt DIR``); ``scripts/device_check.sh`` is the command for
the device tool. ``--dry-run`` executes the same plan on a CPU with the GPU launches left out (the child
processes run the CPU counterparts); ``--plant KIND:ITEM-GLOB`` injects a failure (hang, fault, wrong, refuse,
preflight) into the child item it names, to prove the check names it. The phases, their files and their budgets:
docs/device-check.md; the code: ``scripts/devcheck/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]))
                if p not in sys.path]  # a bare copy of the repository (the GPU machine): run from the checkout

import torch  # noqa: E402
from devcheck import judge, phases, phases_bench  # noqa: E402
from devcheck.common import (  # noqa: E402
    DEVICE_WINDOW_S,
    DRY_STATUS,
    FILES,
    PHASE_BUDGETS,
    PHASE_ESTIMATES_S,
    QUICK_BUDGETS,
    REPO,
    RUNTIME_LIB,
    TOTAL_BUDGET_S,
    drop_models,
    kernel_hashes,
    now,
    read,
    write,
)
from devcheck.isolate import PLANT_KINDS, parse_plants  # noqa: E402
from devcheck.judge import judge_bench, judge_mxfp4, judge_tests, verdict  # noqa: E402
from devcheck.plan import (  # noqa: E402
    BENCH_RESERVE_DEFAULT_S,
    BENCH_RESERVE_S,
    CPU_COUNTERPARTS,
    MXFP4_STEPS,
    carried_files,
    device_provenance,
    plan,
    prebuilt_status,
    verify_prebuilt,
)
from devcheck.report import print_summary  # noqa: E402
from kimik3.kernels.toolchain.targets import megakernel_variants, probe_variants, select  # noqa: E402

from kimik3.perf.provenance import commit_info  # noqa: E402

__all__ = ["main", "plan", "run_phases", "verdict", "judge_tests", "judge_bench", "judge_mxfp4", "TOTAL_BUDGET_S",
           "PHASE_BUDGETS", "QUICK_BUDGETS", "PHASE_ESTIMATES_S", "FILES", "CPU_COUNTERPARTS", "RUNTIME_LIB",
           "MXFP4_STEPS", "BENCH_RESERVE_S", "BENCH_RESERVE_DEFAULT_S", "DEVICE_WINDOW_S", "prebuilt_status",
           "carried_files", "verify_prebuilt", "write", "read"]

Phase = Callable[[Path, argparse.Namespace], None]
# the order of the run: the megakernel's preflight and tests first, its benchmark rows, then the rank items, last
PHASES: dict[str, Phase] = {
    "preflight": phases.phase_preflight, "smoke": phases.phase_smoke,
    "megakernel_tests": phases.phase_megakernel_tests,
    "copy_bandwidth": phases.phase_copy_bandwidth, "constants": phases.phase_constants, "tests": phases.phase_tests,
    "kernels": phases_bench.phase_kernels, "bench": phases_bench.phase_bench,
    "megakernel_mxfp4": phases.phase_megakernel_mxfp4, "megakernel": phases.phase_megakernel,
    "ranks": phases.phase_ranks}
DRY_PHASES: dict[str, Phase | None] = {**PHASES, "copy_bandwidth": None, "kernels": phases.phase_kernels_dry}
CHILD_PHASES = ("preflight", "smoke", "constants", "megakernel_mxfp4", "megakernel", "ranks")
DRY_PHASE_LIMIT_S = 900.0
# the names the tests and earlier callers use
_write, _read, _judge, _speedups = write, read, phases_bench.judge_kernel, phases_bench.speedups
_phase_tests, _phase_bench, _measurements = phases.phase_tests, phases_bench.phase_bench, judge.measurements
_prebuilt_status = prebuilt_status


def run_phases(out: Path, args: argparse.Namespace, phases_: Sequence[str], t_start: float | None = None,
               table: dict[str, Any] | None = None) -> int:
    """Run ``phases_`` in order, each under its budget, write the summary after each, judge the whole: 0 when
    :func:`verdict` finds nothing, else 1."""
    t_start = time.time() if t_start is None else t_start
    dry = bool(getattr(args, "dry_run", False))
    table = (DRY_PHASES if dry else PHASES) if table is None else table
    pl = read(out, "plan") or plan(args.prebuilt, bool(args.quick), getattr(args, "presets", ""),
                                   getattr(args, "batches", ""))
    budgets = pl["phase_budgets_s"]
    summary: dict[str, Any] = {"date": now(), "dry_run": dry, "phases": [], "failures": [],
                               "planted": list(getattr(args, "plant", None) or [])}
    prov = read(out, "provenance") or {}
    summary["commit"] = prov.get("commit")
    for i, phase in enumerate(phases_):
        left = TOTAL_BUDGET_S - (time.time() - t_start)
        # bench takes what is left once the phases after it have their budgets
        later = sum(budgets.get(q, 0.0) for q in phases_[i + 1:] if q != "bench")
        budget = min(budgets.get(phase, left) if phase != "bench" else left - later, left)
        rec: dict[str, Any] = {"phase": phase, "estimate_s": PHASE_ESTIMATES_S.get(phase), "budget_s": round(budget)}
        fn = table.get(phase)
        if fn is None:
            rec["status"] = DRY_STATUS if dry else "unknown phase"
        elif budget < 5 and not dry:
            rec["status"] = f"skipped: {left:.0f} s left of the budget"
        else:
            print(f"[device_check] {phase} (estimate {PHASE_ESTIMATES_S.get(phase, 0):.0f} s, budget {budget:.0f} s)"
                  " ...", flush=True)
            if phase in CHILD_PHASES and torch.cuda.is_available():
                drop_models()  # the child builds its own: the device memory of this process's model is freed first
                torch.cuda.empty_cache()
            t0 = time.time()
            # a dry run is not timed (a CPU is far slower than the device): its phases only have a hang limit
            ns = argparse.Namespace(**{**vars(args), "deadline": str(time.time() + (DRY_PHASE_LIMIT_S if dry
                                                                                    else budget))})
            try:
                fn(out, ns)
                rec["status"] = "ok"
            except Exception as e:  # one phase failing must not lose the others' results
                rec["status"] = f"error: {type(e).__name__}: {e}"[:2000]
            rec["seconds"] = round(time.time() - t0, 1)
        summary["phases"].append(rec)
        summary["elapsed_s"] = round(time.time() - t_start, 1)
        write(out, "summary", summary)
    if not dry:
        judge.measurements(out, prov)
    summary["failures"] = verdict(out, summary)
    summary["exit_status"] = 1 if summary["failures"] else 0
    summary["elapsed_s"] = round(time.time() - t_start, 1)
    write(out, "summary", summary)
    print_summary(out, summary)
    return summary["exit_status"]


def _orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    t_start = time.time()
    write(out, "provenance", device_provenance(args.prebuilt))
    pl = plan(args.prebuilt, bool(args.quick), args.presets, args.batches)
    write(out, "plan", pl)
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
    write(out, "plan", pl)
    print(f"[device_check] prebuilt {pb['dir']}: {len(pl['verified'])} artefacts checked, {len(pb['missing'])} "
          f"missing, {len(pb['stale'])} stale; carry {pl['carry']['total_MiB']} MiB", flush=True)
    return run_phases(out, args, [args.phase] if args.phase else list(PHASES), t_start)


def _build(args: argparse.Namespace) -> int:
    """Compile + export every kernel of the targets (CPU machine with the CuTe DSL), record the commit."""
    from kimik3.kernels.toolchain import prebuilt as pb
    from kimik3.kernels.toolchain.registry import get_variant

    from kimik3.fused.loading import build_prebuilt_kernels

    out = Path(args.build_prebuilt)
    targets, mk_targets = select(args.presets, args.batches)
    t0 = time.time()
    # dense, then those for MXFP4 routed experts, then those for rank programs
    names = megakernel_variants(args.presets, args.batches, ranks=True)
    mk = [get_variant(n) for n in names]
    # the DSL runtime is compressed once, by the last export into the directory (xz of 43 MB takes a while)
    build_prebuilt_kernels(args.arch, out, targets, ship_runtime=False)
    # the probe kernels, then the megakernel, into the same directory and manifest (build_prebuilt extends it)
    pb.build_prebuilt(args.arch, out, [get_variant(n) for n in probe_variants()], fmt="tvm-ffi", ship_runtime=not mk)
    if mk:
        pb.build_prebuilt(args.arch, out, mk, fmt="tvm-ffi", ship_runtime=True)
    commit, source, dirty = commit_info(None)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout \
        if (REPO / ".git").exists() else ""
    info = {"commit": commit, "commit_source": source, "dirty": dirty,
            "dirty_files": [ln[3:] for ln in status.splitlines()][:200], "date": now(), "arch": args.arch,
            "targets": [list(t) for t in targets], "megakernel_targets": [list(t) for t in mk_targets],
            "megakernel_variants": names,
            "seconds": round(time.time() - t0, 1), "kernel_source_hashes": kernel_hashes()}
    tmp = out / "BUILD_INFO.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, out / "BUILD_INFO.json")
    print(f"built {len(targets)} fused target(s) and {len(mk)} megakernel variant(s) into {out} in "
          f"{time.time() - t0:.0f} s (commit {commit}, dirty={dirty})")
    return 0


def _plant(text: str) -> str:
    parse_plants(text)  # a bad kind or form is a usage error, said before anything runs
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 scripts/device_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output directory for the JSON files (the device tool's $OUT)")
    p.add_argument("--prebuilt", type=Path, default=None, help="prebuilt kernel directory (manifest.json + .so)")
    p.add_argument("--quick", action="store_true", help="fewer batches, steps and rows")
    p.add_argument("--dry-run", action="store_true", help="execute the plan on this machine, GPU launches left out")
    p.add_argument("--plant", action="append", type=_plant, metavar="KIND:ITEM-GLOB",
                   help=f"inject a failure into the child item(s) the glob names; KIND one of {', '.join(PLANT_KINDS)}")
    p.add_argument("--item-timeout", type=float, default=None, metavar="S",
                   help="seconds a child item may run before it counts as hung (default: the plan's, per phase)")
    p.add_argument("--build-prebuilt", metavar="DIR", help="build the kernels the check needs into DIR and exit")
    p.add_argument("--arch", default="sm_90a", help="target architecture for --build-prebuilt")
    p.add_argument("--presets", default="", help="only these presets' targets (comma-separated; build and dry run)")
    p.add_argument("--batches", default="", help="only these batch sizes' targets (comma-separated)")
    p.add_argument("--phase", choices=list(PHASES), help="run this phase only (after provenance and plan)")
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
