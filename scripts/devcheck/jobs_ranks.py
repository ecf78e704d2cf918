"""The device check's rank items, each in a child process of its own (``devcheck.child``): every rank of ``tiny`` over
2 in one launch on the GPU (loopback) against ``naive``, teacher-forced; one rank of K3 on the rack (``k3-rank``,
batch 1 and 8, MXFP4 experts) alone, timed per opcode with its collectives' waits, and the NVL72 prediction from
its measured step. The dry run: the interpreter's ranks against ``naive``, and every item's launch plan (programs
built, hazard-checked where cheap, fitted to the ranks kernel's contract) with the model's own timeline standing in
for the measurement. docs/device-check.md."""

from __future__ import annotations

import statistics
from typing import Any

import torch
from kimik3.kernels.contracts.isa import COLLECTIVE_OPS

from devcheck.common import model as shared_model
from devcheck.common import perturbed

_COLLECTIVES = {op.name for op in COLLECTIVE_OPS}


def _device(ctx: dict[str, Any]) -> tuple[str, torch.dtype]:
    return ("cpu", torch.float32) if ctx["dry"] else ("cuda", torch.bfloat16)


def _sms(dry: bool) -> int:
    return 132 if dry else torch.cuda.get_device_properties(0).multi_processor_count


def opcode_times(timeline: Any) -> dict[str, Any]:
    """Per opcode: instructions, busy µs (summed over SMs), waiting µs; the collectives' waits apart."""
    df = timeline.assign(busy=timeline["end_ns"] - timeline["start_ns"],
                         wait=timeline["start_ns"] - timeline["arrive_ns"])
    by = df.groupby("op").agg(n=("op", "size"), busy_us=("busy", "sum"), wait_us=("wait", "sum"))
    by[["busy_us", "wait_us"]] /= 1e3
    per = {op: {"n": int(r.n), "busy_us": round(float(r.busy_us), 3), "wait_us": round(float(r.wait_us), 3)}
           for op, r in by.iterrows()}
    coll = df[df["op"].isin(_COLLECTIVES)]
    return {"by_opcode": per, "makespan_us": round(float(df["end_ns"].max() - df["start_ns"].min()) / 1e3, 3),
            "collective_wait_us": round(float(coll["wait"].sum()) / 1e3, 3),
            "collective_wait_max_us": round(float(coll["wait"].max()) / 1e3, 3) if len(coll) else 0.0}


def _setup(ctx: dict[str, Any]) -> dict[str, Any]:
    return {**ctx, "models": {}}


def _run(st: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    return _loopback(st, it, plant) if it["kind"] == "loopback" else _alone(st, it, plant)


def _loopback(st: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    """Every rank of the item's preset over ``world`` in one launch against naive's teacher-forcing trace (the dry
    run: the interpreter's ranks, the CPU counterpart of the same programs), then a few steps timed per rank."""
    import kimik3
    import kimik3.megakernel.interp_ranks  # noqa: F401  (registers stage "megakernel-interp")
    from kimik3.megakernel.gpu_ranks import launch_plan
    from kimik3.validation import reference_trace
    from kimik3.validation.compare import run_stage

    dry, B, W = st["dry"], it["batch"], it["world"]
    device, dtype = _device(st)
    model = shared_model(it["preset"], dtype=dtype, device=device)
    trace = reference_trace(model, B, st["prompt"], st["steps"], seed=B)
    if plant == "wrong":  # a wrong result injected: the model under test differs from the one naive traced
        model = perturbed(model)
    plan = launch_plan(model.config, B, trace.max_seq_len, W, _sms(dry), expert_format=model.expert_storage)
    rec: dict[str, Any] = {"world": W, "kernel": plan.kernel, "ctas_per_rank": plan.ctas_per_rank,
                           "instructions": [len(p.instructions) for p in plan.programs]}
    opts: dict[str, Any] = {"world": W, "check": False}
    if dry:
        res, _, _ = run_stage(model, "megakernel-interp", trace, False, **opts)
        rec["stage"] = "megakernel-interp"
    else:
        if st["prebuilt"]:
            opts["prebuilt"] = str(st["prebuilt"])
        res, _, _ = run_stage(model, "megakernel", trace, False, **opts)
        rec["stage"] = "megakernel"
        dec = kimik3.Decoder(model, "megakernel", batch_size=B, max_seq_len=trace.max_seq_len, **opts)
        dec.prefill(trace.ids.to(model.device), trace.lengths)
        ms = _timed(lambda: dec.step(trace.ids[:, -1].to(model.device)), st["steps"])
        rec["step_ms"] = ms
        rec["timings"] = [opcode_times(dec.stage.runner.timeline(r)) for r in range(W)]
    rec["vs_naive"] = res.as_dict()
    return rec


def _timed(fn: Any, n: int) -> dict[str, float]:
    """Median, min and max milliseconds of ``n`` calls of ``fn`` (CUDA events around each)."""
    out = []
    for _ in range(max(1, n)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return {"median": statistics.median(out), "min": min(out), "max": max(out), "n": len(out)}


def _alone(st: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    """One rank's slice alone (its peers credited, their pushes into a sink): the launch plan, on the GPU the timed
    steps, the per-opcode times and collectives' waits, and the NVL72 prediction from the measured step (the dry
    run: the model's own timeline as the measurement)."""
    import kimik3
    from kimik3.megakernel.gpu_ranks import launch_plan
    from kimik3.perf.cost import decode_cost
    from kimik3.perfmodel.ranks import measured_extras

    dry, B, ctx = st["dry"], it["batch"], it["context"]
    cfg = kimik3.get_preset(it["preset"])
    rec: dict[str, Any] = {"preset": it["preset"], "batch": B, "context": ctx, "rank_slice": list(cfg.rank_slice)}
    step_bytes = decode_cost(it["preset"], B, ctx, expert_dtype="mxfp4").total_bytes
    if dry:
        from kimik3.perfmodel import load_constants, megakernel_model
        from kimik3.perfmodel.data import CURRENT_DESIGN

        plan = launch_plan(cfg, B, ctx + 1, None, _sms(dry), expert_format="mxfp4", check=False)
        (prog,) = plan.programs
        _, tl = megakernel_model(it["preset"], B, CURRENT_DESIGN, None, ctx, program=prog, experts="mxfp4")
        ms = (float(tl["end_ns"].max()) + load_constants().kernel_boundary_ns) / 1e6
        rec.update(kernel=plan.kernel, instructions=len(prog.instructions), measured="the model's own timeline "
                   "(dry run)", step_ms={"median": ms, "min": ms, "max": ms, "n": 0})
    else:
        from kimik3.megakernel.gpu_ranks import RanksRunner
        from kimik3.model.random_init import from_preset

        key = it["preset"]
        if key not in st["models"]:
            st["models"].clear()
            st["models"][key] = from_preset(key, dtype=torch.bfloat16, device="cuda", init_device="cuda",
                                            experts="mxfp4")
        model = st["models"][key]
        runner = RanksRunner(model, B, ctx + st["steps"] + 2, check=False,
                             prebuilt=str(st["prebuilt"]) if st["prebuilt"] else None)
        prog = runner.programs[0]
        runner.bind_state(runner.new_states())
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(3, cfg.vocab_size, (B,), generator=g)
        pos = torch.full((B,), ctx, dtype=torch.int64)
        logits = runner.run_step(ids, pos)  # the first launch: the watchdog and the numbers are checked
        if plant == "wrong":
            logits = logits * float("nan")
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("k3-rank alone: non-finite logits from the rank's own step")
        rec["step_ms"] = _timed(lambda: runner.run_step(ids, pos, check_error=False), st["steps"])
        runner.check_error()
        tl = runner.timeline()
        rec.update(kernel=runner.name, instructions=len(prog.instructions), measured=torch.cuda.get_device_name(0))
    sm = rec["step_ms"]
    rec["timings"] = opcode_times(tl)
    rec["nvl72"] = measured_extras(prog, tl, B, sm["median"], (sm["min"], sm["max"]), step_bytes,
                                   str(rec["measured"]))["rank"]
    if dry:  # nothing was measured: say so where the prediction names its parts
        rec["nvl72"]["parts"]["local step"] = "dry run: the model's own timeline of the rank program (not measured)"
    return rec
