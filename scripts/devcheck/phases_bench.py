"""The device check's measurements in its own process: each fused kernel of the bench preset timed alone and
judged against copy bandwidth or the launch floor, and the benchmark rows of every stage but the megakernel (whose
rows run last, in a child process), each compared with ``naive``. docs/device-check.md."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from devcheck import plan as P
from devcheck.common import CHILDREN_DIR, kernel_hashes, model, now, write
from devcheck.phases import copy_bw, time_launch
from kimik3.validation.metric import TOL


def judge_kernel(nbytes: float, seconds: float, copy_bw_Bps: float, floor: float) -> dict[str, Any]:
    achieved = nbytes / seconds
    rec: dict[str, Any] = {"gb_per_s": achieved / 1e9, "pct_copy_bw": 100 * achieved / copy_bw_Bps}
    if nbytes >= P.BIG_KERNEL_BYTES:
        target = nbytes / (0.8 * copy_bw_Bps)
        rec.update(judged_against="80% of copy bandwidth", target_s=target, ratio_to_target=seconds / target,
                   verdict="meets" if seconds <= target else "below")
    else:
        target = max(floor, nbytes / copy_bw_Bps)
        rec.update(judged_against="launch-latency floor", target_s=target, ratio_to_target=seconds / target,
                   verdict="within 2x of the floor" if seconds <= 2 * target else "above 2x the floor")
    return rec


def phase_kernels(out: Path, args: argparse.Namespace) -> None:
    from dataclasses import replace

    from kimik3.fused.launch_cost import launch_bytes, launch_flops
    from kimik3.fused.loading import load_kernels
    from kimik3.fused.runners import KernelRunner
    from kimik3.model.quant import mxfp4_quantize as mxfp4_pack
    from kimik3.stages.fused import FusedStage

    deadline = float(args.deadline)
    cbw, floor = copy_bw(out)
    hashes = kernel_hashes()
    result: dict[str, Any] = {"date": now(), "preset": P.BENCH_PRESET, "copy_bandwidth_Bps": cbw,
                              "launch_floor_s": floor, "method": time_launch.__doc__, "kernels": [],
                              "mxfp4_vs_bf16": [], "steps": []}
    m = model(P.BENCH_PRESET)
    prompt = 64 if args.quick else 256
    for B in ([1] if args.quick else [1, 8]):
        if time.time() > deadline - 10:
            result.setdefault("skipped", []).append(f"batch {B}: out of budget")
            break
        st = FusedStage(m, B, prompt + 8, kernels="prebuilt", prebuilt=args.prebuilt)
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(3, m.config.vocab_size, (B, prompt), generator=g).cuda()
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
            sec = time_launch(runner, ln)  # (the MoE op's align re-ran for this launch's routing: n_act is its)
            distinct = int(ln.args["n_act"].item()) if ln.op.family in ("moe.bf16", "moe.mxfp4") else None
            nbytes = launch_bytes(ln, context=prompt + 1, distinct_experts=distinct)
            rec = {"batch": B, "launch": ln.name, "op": ln.op.name, "family": ln.op.family, "shapes": ln.op.shapes,
                   "source_hash": hashes.get(ln.op.module_name), "bytes": nbytes, "flops": launch_flops(ln, prompt + 1),
                   "seconds": sec, "distinct_experts": distinct, **judge_kernel(nbytes, sec, cbw, floor)}
            result["kernels"].append(rec)
            write(out, "kernels", result)
        try:  # the performance model (kimik3.perfmodel) against these kernel times, per launch
            from kimik3.perfmodel.device import fused_kernel_report

            result.setdefault("model_vs_measured_fused", []).append(
                fused_kernel_report(result["kernels"], P.BENCH_PRESET, B, prompt + 1, prompt + 8))
        except Exception as e:  # the comparison must never cost the measurements
            result.setdefault("model_vs_measured_fused", []).append({"batch": B, "error": f"{type(e).__name__}: {e}"})
        # MXFP4 vs bf16 routed experts: the same x / routing / scratch, layer 0's experts packed on the GPU
        moe_ln = next((ln for ln in fused.program if ln.kind == "kernel" and ln.op.family == "moe.bf16"
                       and ln.op.shapes["E"] > 1), None)
        if moe_ln is not None and time.time() < deadline - 8:
            op4 = replace(moe_ln.op, family="moe.mxfp4")
            fns = load_kernels([op4], st.arch, "prebuilt", args.prebuilt)
            a4 = dict(moe_ln.args)
            (a4["w1"], a4["s1"]), (a4["w3"], a4["s3"]), (a4["w2"], a4["s2"]) = (
                mxfp4_pack(moe_ln.args["w1"]), mxfp4_pack(moe_ln.args["w3"]), mxfp4_pack(moe_ln.args["w2"]))
            ln4 = type(moe_ln)(moe_ln.name + ".mxfp4", "kernel", op4, a4)
            t16 = time_launch(runner, moe_ln)
            t4 = time_launch(KernelRunner(fns), ln4)
            distinct = int(moe_ln.args["n_act"].item())
            b16, b4 = launch_bytes(moe_ln, distinct_experts=distinct), launch_bytes(ln4, distinct_experts=distinct)
            result["mxfp4_vs_bf16"].append({"batch": B, "distinct_experts": distinct, "bf16_s": t16, "mxfp4_s": t4,
                                            "time_ratio_mxfp4_over_bf16": t4 / t16, "bf16_bytes": b16,
                                            "mxfp4_bytes": b4, "byte_ratio": b4 / b16})
            write(out, "kernels", result)
        del st
        torch.cuda.empty_cache()
    write(out, "kernels", result)


def phase_bench(out: Path, args: argparse.Namespace) -> None:
    import functools

    import kimik3
    import kimik3.bench as bench

    deadline = float(args.deadline)
    dry = bool(getattr(args, "dry_run", False))
    p = dict(P.plan(args.prebuilt, bool(args.quick))["bench"])
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    if dry:  # the same rows code on the CPU: only the GPU stages and the large preset are left out
        p.update(preset=P.DRY_BENCH["preset"], order=[list(x) for x in P.DRY_BENCH["order"]],
                 context=P.DRY_BENCH["context"], steps=P.DRY_BENCH["steps"], repeats=P.DRY_BENCH["repeats"])
    preset = p["preset"]
    # one model for every row: run_bench builds its model through kimik3.from_preset, which here returns the run's
    # one model (built on the device, shared with phase 'kernels'); one copy-bandwidth measurement for all rows
    saved_from_preset, saved_measure = kimik3.from_preset, bench.measure_local

    def shared_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> Any:
        return model(name, seed, dtype, str(device))

    kimik3.from_preset = shared_model  # type: ignore[assignment]
    bench.measure_local = functools.lru_cache(maxsize=None)(bench.measure_local)  # type: ignore[assignment]
    reference: dict[tuple[int, int, int], torch.Tensor] = {}  # naive first-step logits, per batch, on the device
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    record: dict[str, Any] = {"date": now(), "preset": preset, "dtype": dtype, "device": device,
                              "context": p["context"], "steps": p["steps"], "repeats": p["repeats"],
                              "order": p["order"], "rows": rows, "skipped": skipped, "dry_run": dry,
                              "tolerance_vs_naive": TOL["bf16_stage"],
                              "weights": "kimik3.model.random_init rules, drawn on the device "
                                         "(kimik3.model.random_init.device_model)"}
    try:
        for stage, batch in p["order"]:
            left = deadline - time.time()
            need = 0.0 if dry else P.BENCH_RESERVE_S.get(stage, P.BENCH_RESERVE_DEFAULT_S)
            if left < need:
                skipped.append({"stage": stage, "batch": batch, "reason": f"skipped: {left:.0f} s of the phase's "
                                f"budget left, this row needs about {need:.0f} s"})
                write(out, "bench", record)
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
            speedups(rows)
            write(out, "bench", record)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        kimik3.from_preset, bench.measure_local = saved_from_preset, saved_measure  # type: ignore[assignment]
    _save_reference(out, reference)
    write(out, "bench", record)


def _save_reference(out: Path, reference: dict[tuple[int, int, int], torch.Tensor]) -> None:
    """naive's first-step logits for the megakernel's child process, which compares its rows with them."""
    from safetensors.torch import save_file

    if not reference:
        return
    path = Path(out) / CHILDREN_DIR / "naive_reference.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({f"b{b}_c{c}_s{s}": v.contiguous() for (b, c, s), v in reference.items()}, str(tmp))
    tmp.replace(path)


def speedups(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_naive / speedup_vs_compiled across rows measured in separate run_bench calls of this run."""
    for ref in ("naive", "compiled"):
        base = {r["batch"]: r["ms_per_token"] for r in rows if r.get("stage") == ref and r.get("ms_per_token")}
        for r in rows:
            ms = r.get("ms_per_token")
            r[f"speedup_vs_{ref}"] = base[r["batch"]] / ms if ms and r["batch"] in base else None
