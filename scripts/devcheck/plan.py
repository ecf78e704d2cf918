"""What the device check will run, decided before anything runs: the phases' items and budgets, the prebuilt
artefacts each needs (verified against the manifest), what the device tool carries, the CPU counterpart of every
GPU item. docs/device-check.md."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from kimik3.kernels.toolchain.targets import FUSED_TARGETS, megakernel_variants, probe_variants, rank_variants, select

from devcheck.common import (
    BENCH_PRESET,
    CARRY_LIMIT_BYTES,
    PHASE_BUDGETS,
    PHASE_ESTIMATES_S,
    QUICK_BUDGETS,
    REPO,
    RUNTIME_LIB,
    TOTAL_BUDGET_S,
    kernel_hashes,
    now,
)
from kimik3.perf.provenance import provenance
from kimik3.validation.metric import TOL

# The CPU counterpart of everything this check runs on the GPU: the host execution (the same @cute.jit helpers the
# device code calls, run over every block / warp / lane on the CPU; tests/test_host_exec*.py) that covers each fused
# kernel family and each megakernel opcode, as (test module, a key and value one of its CI cases has).
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
    # the probe kernels of phase 'constants' (the signal probe's atomics abort on the host: its case checks PTX)
    **{f"probe.{p}": ("tests/test_probes.py", "probe", p) for p in ("bandwidth", "latency", "signal")},
}
# the main process's benchmark rows (no megakernel: its rows run last, in a child process, phase 'megakernel').
# No "compiled" row: torch.compile of the large preset takes longer than the whole window (run `kimik3 bench`
# for that baseline when a GPU is lent for longer).
BENCH_ORDER = (("fused", 1), ("graphs", 1), ("absorbed", 1), ("naive", 1), ("fused", 8), ("graphs", 8),
               ("fused", 64), ("absorbed", 8), ("naive", 8))
QUICK_BENCH_ORDER = (("fused", 1), ("graphs", 1), ("absorbed", 1), ("naive", 1), ("fused", 8))
BENCH_CONTEXT, QUICK_BENCH_CONTEXT = 512, 128
MODEL_CONTEXT = 4096  # the context the performance model's committed scores are at (data/perf/scores-*.json)
# the megakernel's rows, in priority order: (batch, context); then its per-instruction timing buffer per batch
MEGAKERNEL_ROWS = ((1, BENCH_CONTEXT), (1, MODEL_CONTEXT), (8, BENCH_CONTEXT), (64, BENCH_CONTEXT),
                   (8, MODEL_CONTEXT), (64, MODEL_CONTEXT))
QUICK_MEGAKERNEL_ROWS = ((1, QUICK_BENCH_CONTEXT), (1, MODEL_CONTEXT), (8, QUICK_BENCH_CONTEXT))
MEGAKERNEL_OPCODE_BATCHES, QUICK_MEGAKERNEL_OPCODE_BATCHES = (1, 8), (1,)
# the dry run's benchmark: the same rows code on the CPU, for a preset that runs there in seconds; the megakernel's
# rows there run its CPU counterpart (the interpreter) through the same child process
DRY_BENCH = {"preset": "micro", "order": (("absorbed", 1), ("naive", 1)), "context": 16, "steps": 1, "repeats": 1}
DRY_MEGAKERNEL = {"preset": "micro", "stage": "megakernel-interp", "rows": ((1, 16),), "opcode_batches": (1,)}
# seconds an item needs at least (model already built; compile/capture included), to decide whether to start it
BENCH_RESERVE_S = {"naive": 25.0}
BENCH_RESERVE_DEFAULT_S = 15.0
BIG_KERNEL_BYTES = 32e6  # >= this per call: judged against 80 % of copy bandwidth; below: the launch floor
MEGAKERNEL_TEST_FILE = "tests/test_megakernel_gpu.py"
GPU_TEST_FILES = ("tests/test_fused_stage.py", "tests/test_kernels_gpu.py")
# the MXFP4 megakernel phase: prompt and decode steps per item; the dry run's item (the CPU, GPU launches left out)
MXFP4_PROMPT, MXFP4_STEPS = 8, 3
DRY_MXFP4 = {"variant": "megakernel/tiny/b1-mxfp4", "preset": "tiny", "batch": 1, "interp": True, "timings": True}
# a child process's item: seconds it may run before it counts as hung (the device's megakernel watchdog gives up
# well before: DEFAULT_SPINS x sleep), and the start-up a child gets before its first item (imports, CUDA, model)
SMOKE_PRESETS = ("tiny",)
ITEM_TIMEOUT_S = {"preflight": 20.0, "smoke": 20.0, "megakernel": 45.0, "megakernel_mxfp4": 30.0, "constants": 20.0,
                  "ranks": 90.0}
DRY_ITEM_TIMEOUT_S = 120.0  # a CPU item takes 10-20 s; CI's two cores are shared with the other test worker
# the rank items: prompt and steps of the loopback's teacher-forced run, steps timed; the context a rank alone is
# timed at (its cache rows empty: the attention still reads them); a rank item's timeout in the dry run (the CPU
# builds k3-rank's ~65k-instruction program, as the GPU machine does)
RANKS_PROMPT, RANKS_STEPS, RANKS_CONTEXT = 8, 3, 512
DRY_RANKS_ITEM_TIMEOUT_S = 300.0
CHILD_STARTUP_S, DRY_CHILD_STARTUP_S = 60.0, 90.0


def device_provenance(prebuilt: Path | None) -> dict[str, Any]:
    """``kimik3.perf.provenance`` for this run's device and prebuilt directory, plus the kernel source hashes."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {**provenance(dev, prebuilt), "kernel_source_hashes": kernel_hashes()}


def prebuilt_status(prebuilt: Path | None, arch: str = "sm_90a",
                    fused_targets: Sequence[tuple[str, int, str]] = FUSED_TARGETS,
                    megakernels: Sequence[str] | None = None) -> dict[str, Any]:
    """Which kernels of the targets the prebuilt directory has, at the current kernel sources (``megakernels``: the
    registry names of the megakernel variants, dense and MXFP4; default: every exported one)."""
    import json

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
    # by registry name: the megakernel variants (dense and MXFP4), then the probe kernels of phase 'constants'
    mk = megakernel_variants() if megakernels is None else megakernels
    for name, is_mk in [(n, True) for n in mk] + [(n, False) for n in probe_variants()]:
        v = get_variant(name)
        seen.add(name)
        entry = manifest.get("kernels", {}).get(name)
        if entry is None or manifest.get("arch") != arch:
            missing.append(name)
        elif entry.get("source_hash") != kernel_source_hash(v.module_name):
            stale.append(name)
        else:  # the megakernel's shapes follow from its preset and batch (verify_prebuilt), a probe's are its own
            names.append({"name": name, "preset": v.preset, "batch": v.batch, "expert_format": v.expert_format}
                         if is_mk else {"name": name, "shapes": v.shapes})
    size = sum(f.stat().st_size for f in prebuilt.iterdir() if f.is_file()) if prebuilt and prebuilt.is_dir() else 0
    unpacked = bool(prebuilt and (prebuilt / RUNTIME_LIB).exists())
    return {"dir": str(prebuilt) if prebuilt else None, "arch": arch, "manifest_found": bool(manifest),
            "bytes": size, "unpacked_runtime_present": unpacked,
            "carry_note": (f"{RUNTIME_LIB} (unpacked by a local load) is left behind when carrying: the .xz travels"
                           if unpacked else "ok") if prebuilt else None,
            "distinct_ops": len(seen), "missing": missing, "stale": stale, "targets": targets, "load": names,
            "ready": bool(manifest) and not missing and not stale,
            "runtime_shipped": bool((manifest.get("runtime") or {}).get("shipped"))}


def budgets(quick: bool) -> dict[str, float]:
    """Each phase's budget; bench gets what is left of :data:`TOTAL_BUDGET_S`."""
    b = dict(QUICK_BUDGETS if quick else PHASE_BUDGETS)
    b["bench"] = TOTAL_BUDGET_S - sum(b.values())
    return b


def plan(prebuilt: Path | None, quick: bool, presets: str = "", batches: str = "") -> dict[str, Any]:
    """What the run will do, with budgets and estimates, and whether the prebuilt kernels it needs are there
    (``presets`` / ``batches``: only those targets, comma-separated)."""
    from kimik3.kernels.toolchain.loader import dsl_available

    from kimik3.fused.plan import fused_ops

    fused_targets, mk_targets = select(presets, batches)
    megakernels = megakernel_variants(presets, batches)
    ranks = rank_variants(presets, batches)
    tests = []
    for f in GPU_TEST_FILES:
        if not (REPO / f).exists():
            continue
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
    rows = QUICK_MEGAKERNEL_ROWS if quick else MEGAKERNEL_ROWS
    opcode_batches = QUICK_MEGAKERNEL_OPCODE_BATCHES if quick else MEGAKERNEL_OPCODE_BATCHES
    return {
        "date": now(), "quick": quick, "total_budget_s": TOTAL_BUDGET_S, "phase_budgets_s": budgets(quick),
        "phase_estimates_s": PHASE_ESTIMATES_S,
        "targets": {"fused": [list(t) for t in fused_targets], "megakernel": [list(t) for t in mk_targets],
                    "megakernel_variants": megakernels},
        "preflight": {"items": preflight_items(megakernels + ranks), "item_timeout_s": ITEM_TIMEOUT_S["preflight"]},
        "smoke": {"items": smoke_items(megakernels), "item_timeout_s": ITEM_TIMEOUT_S["smoke"]},
        "megakernel_tests": {"file": MEGAKERNEL_TEST_FILE, "run": (REPO / MEGAKERNEL_TEST_FILE).exists()},
        "tests": tests, "kernels": {"preset": BENCH_PRESET, "batches": [1] if quick else [1, 8], "ops": kernel_ops,
                                    "big_kernel_bytes": BIG_KERNEL_BYTES, "mxfp4_vs_bf16": True},
        "bench": {"preset": BENCH_PRESET, "order": [list(x) for x in (QUICK_BENCH_ORDER if quick else BENCH_ORDER)],
                  "context": QUICK_BENCH_CONTEXT if quick else BENCH_CONTEXT, "steps": 4 if quick else 8,
                  "repeats": 3 if quick else 5, "reserve_s": BENCH_RESERVE_S, "tolerance_vs_naive": TOL["bf16_stage"]},
        "megakernel": {"preset": BENCH_PRESET, "items": megakernel_items(rows, opcode_batches),
                       "steps": 4 if quick else 8, "repeats": 3 if quick else 5,
                       "item_timeout_s": ITEM_TIMEOUT_S["megakernel"], "tolerance_vs_naive": TOL["bf16_stage"]},
        "megakernel_mxfp4": {"items": mxfp4_items(megakernels, quick), "prompt_len": MXFP4_PROMPT,
                             "steps": MXFP4_STEPS, "item_timeout_s": ITEM_TIMEOUT_S["megakernel_mxfp4"],
                             "tolerance": TOL["bf16_stage"], "reference": "naive on the same MXFP4-holding model, "
                             "teacher-forced; megakernel-interp (CPU, fp32 on the same weights) where planned"},
        "constants": {"item_timeout_s": ITEM_TIMEOUT_S["constants"]},
        "ranks": {"items": rank_items(ranks, quick), "prompt_len": RANKS_PROMPT, "steps": RANKS_STEPS,
                  "item_timeout_s": ITEM_TIMEOUT_S["ranks"], "tolerance_vs_naive": TOL["bf16_stage"],
                  "alone": "a rank of a world larger than one launch holds runs alone: its peers' counter words "
                           "credited, their pushes into a sink, their partials zeros (timed, not compared)"},
        "prebuilt": prebuilt_status(prebuilt, fused_targets=fused_targets, megakernels=megakernels + ranks),
        "cpu_counterparts": {k: f"{m} ({key} = {val!r})" for k, (m, key, val) in CPU_COUNTERPARTS.items()},
    }


def preflight_items(megakernels: Sequence[str]) -> list[dict[str, Any]]:
    """One preflight per megakernel variant the run launches, the bench preset's first."""
    from kimik3.kernels.toolchain.registry import get_variant

    items = []
    for name in megakernels:
        v = get_variant(name)
        items.append({"name": f"preflight {name}", "variant": name, "preset": v.preset, "batch": v.batch,
                      "expert_format": v.expert_format})
    return sorted(items, key=lambda it: it["preset"] != BENCH_PRESET)


def smoke_items(megakernels: Sequence[str]) -> list[dict[str, Any]]:
    """One smoke program per opcode family on each small-preset batch-1 megakernel variant among ``megakernels``
    (its interpreter reference is cheap on the CPU); MXFP4 variants only for the families their format changes."""
    from kimik3.kernels.toolchain.registry import get_variant

    from kimik3.megakernel.smoke import smoke_families

    items = []
    for name in megakernels:
        v = get_variant(name)
        if v.preset not in SMOKE_PRESETS or v.batch != 1:
            continue
        fams = smoke_families(v.preset, 1, v.expert_format)
        for fam in (fams if v.expert_format == "dense" else [f for f in fams if f == "moe"]):
            items.append({"name": f"smoke {name} {fam}", "variant": name, "preset": v.preset, "batch": 1,
                          "expert_format": v.expert_format, "family": fam})
    return items


def megakernel_items(rows: Sequence[tuple[int, int]], opcode_batches: Sequence[int]) -> list[dict[str, Any]]:
    """The megakernel's benchmark rows (batch, context) in priority order, then its timing-buffer reports."""
    items = [{"name": f"megakernel bench b{b} ctx{c}", "kind": "bench", "batch": b, "context": c} for b, c in rows]
    items += [{"name": f"megakernel opcodes b{b}", "kind": "opcodes", "batch": b} for b in opcode_batches]
    return items


def rank_items(variants: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    """The rank items of the ``variants`` built for rank programs: a slice whose world one launch holds runs every
    rank of its whole model in loopback (against naive); a larger one runs alone, timed (``--quick``: batch 1)."""
    from kimik3.kernels.contracts.isa import MAX_LOCAL
    from kimik3.kernels.toolchain.registry import get_variant

    from kimik3.model.config import PRESET_NAMES, get_preset

    items = []
    for name in variants:
        v = get_variant(name)
        cfg = get_preset(v.preset)
        world = cfg.rank_slice[0]
        if world <= MAX_LOCAL:
            whole = next(p for p in PRESET_NAMES if get_preset(p) == cfg.whole().replace(name=p))
            items.append({"name": f"ranks loopback {whole} w{world} b{v.batch}", "kind": "loopback", "preset": whole,
                          "world": world, "batch": v.batch, "variant": name})
        elif not (quick and v.batch != 1):
            items.append({"name": f"ranks alone {v.preset} b{v.batch}", "kind": "alone", "preset": v.preset,
                          "batch": v.batch, "context": RANKS_CONTEXT, "variant": name})
    return items


def mxfp4_items(megakernels: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    """The MXFP4 megakernel variants among ``megakernels`` the run executes (``--quick``: batch 1 only): the bench
    preset first, then the small presets. The interpreter runs on the CPU, so only where the model is small; the
    timing buffer is read at the bench preset."""
    from kimik3.kernels.toolchain.registry import get_variant

    items = []
    for name in megakernels:
        v = get_variant(name)
        if v.expert_format == "mxfp4" and not (quick and v.batch != 1):
            small = v.preset != BENCH_PRESET
            items.append({"name": f"mxfp4 {name}", "variant": name, "preset": v.preset, "batch": v.batch,
                          "interp": small, "timings": not small})
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
        if not had_runtime and (prebuilt / RUNTIME_LIB).exists():  # unpacked by a load: not carried, not kept
            (prebuilt / RUNTIME_LIB).unlink()
    return results
