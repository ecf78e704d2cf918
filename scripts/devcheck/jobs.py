"""The jobs a device-check child process runs (``devcheck.child``), one set-up and one function per item: the
preflight of each megakernel variant, the megakernel's benchmark rows and timing-buffer reports, the MXFP4
megakernel items, the constants probes; the rank items (``devcheck.jobs_ranks``). The dry run runs the same jobs
with their CPU counterparts. docs/device-check.md."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from devcheck import jobs_ranks
from devcheck.common import model as shared_model
from devcheck.common import perturbed
from kimik3.validation.metric import TOL


@dataclass(frozen=True)
class Job:
    setup: Callable[[dict[str, Any]], Any]
    run: Callable[[Any, dict[str, Any], str | None], dict[str, Any]]


def _device(ctx: dict[str, Any]) -> tuple[str, torch.dtype]:
    return ("cpu", torch.float32) if ctx["dry"] else ("cuda", torch.bfloat16)


# ---------------------------------------------------------------------------------------------- preflight


def _preflight_setup(ctx: dict[str, Any]) -> dict[str, Any]:
    return ctx


def _preflight_run(ctx: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    from devcheck.preflight import preflight

    return preflight(Path(ctx["prebuilt"]), it["variant"], dry=ctx["dry"], plant=plant)


# ---------------------------------------------------------------------------------------------- smoke programs


def _smoke_setup(ctx: dict[str, Any]) -> dict[str, Any]:
    return {**ctx, "models": {}}


def _smoke_run(st: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    """One opcode family of one layer as a program of its own (``kimik3.megakernel.smoke``) on the device (the dry
    run: the CPU megakernel, under its watchdog), its written boxes against the interpreter's on the same inputs."""
    from kimik3.megakernel.interpreter import CPUInterpreter
    from kimik3.megakernel.smoke import compare_smoke, smoke_program, smoke_run

    dry, fmt = st["dry"], it["expert_format"]
    key = (it["preset"], fmt)
    if key not in st["models"]:
        st["models"].clear()
        device, dtype = _device(st)
        m = shared_model(it["preset"], dtype=dtype, device=device)
        m = copy.deepcopy(m).quantize_experts() if fmt == "mxfp4" else m  # (in place: not the shared dense one)
        ref = m if dry else copy.deepcopy(m).to("cpu").cast_(torch.float32)
        st["models"][key] = (m, ref)
    m, ref = st["models"][key]
    # the step's tiling follows the SM count: the reference runs the same boxes the device does
    sms = 4 if dry else torch.cuda.get_device_properties(0).multi_processor_count
    want = smoke_run(CPUInterpreter(smoke_program(ref.config, it["batch"], sms, it["family"], expert_format=fmt,
                                                  act_dtype=torch.float32), ref), ref)
    if dry:
        from kimik3.megakernel.cpu import CPUMegakernel

        # the CPU executor reads dense expert operands and streams held MXFP4 codes itself (experts=fmt)
        prog = smoke_program(m.config, it["batch"], sms, it["family"], act_dtype=m.dtype)
        runner = CPUMegakernel(m, it["batch"], prog.max_seq_len, program=prog, pin=False, timeout_s=20.0,
                               experts=fmt)
        tol = TOL["fp32_stage"]
    else:
        from kimik3.megakernel.gpu import MegakernelRunner

        prog = smoke_program(m.config, it["batch"], sms, it["family"], expert_format=fmt)
        runner = MegakernelRunner(m, it["batch"], prog.max_seq_len, program=prog, prebuilt=st["prebuilt"])
        tol = TOL["bf16_stage"]
    got = smoke_run(runner, m)
    if hasattr(runner, "close"):
        runner.close()
    if plant == "wrong":  # a wrong result injected into what the device wrote
        k = next(iter(got))
        got[k] = got[k] + 1.0
    bad = compare_smoke(got, want, tol)
    rec = {"instructions": len(prog.instructions), "boxes": len(want), "tolerance": tol,
           "executor": "megakernel-cpu (dry run)" if dry else "megakernel"}
    if bad:
        rec["status"] = f"wrong result: {'; '.join(bad[:3])}"[:2000]
        rec["mismatches"] = bad
    return rec


# ---------------------------------------------------------------------------------------------- megakernel rows


def _megakernel_setup(ctx: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    device, dtype = _device(ctx)
    ref: dict[tuple[int, int, int], torch.Tensor] = {}
    path = ctx.get("reference_file")
    if path and Path(path).exists():  # naive's first-step logits the bench phase already computed
        for k, v in load_file(path).items():
            b, c, s = (int(x[1:]) for x in k.split("_"))
            ref[(b, c, s)] = v
    return {**ctx, "model": shared_model(ctx["preset"], dtype=dtype, device=device), "reference": ref}


def _megakernel_run(st: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    import json

    import kimik3.bench as bench

    device, dtype = _device(st)
    model = st["model"]
    if it["kind"] == "opcodes":
        return {"opcodes": _opcode_report(st, model, it["batch"])}
    B, ctx = it["batch"], it["context"]
    ref = st["reference"]
    if plant == "wrong":  # a wrong result injected: the reference this row is compared with is corrupted
        key = (B, ctx, 0)
        base = ref[key] if key in ref else _naive_first_step(model, B, ctx)
        ref = {**ref, key: base + 10 * base.std() * torch.randn_like(base)}
    df = bench.run_bench(st["preset"], [st["stage"]], [B], ctx, device=device, dtype=str(dtype).split(".")[-1],
                         steps=st["steps"], repeats=st["repeats"], out=None, progress=False, model=model,
                         reference=ref)
    (row,) = json.loads(df.to_json(orient="records"))
    if row.get("status") != "ok":
        raise RuntimeError(str(row.get("status")))
    return {"row": row}


def _naive_first_step(model: Any, batch: int, context: int) -> torch.Tensor:
    """naive's first decode step after ``run_bench``'s prompt (seed 0): what the bench compares every row with."""
    import kimik3

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=g).to(model.device)
    dec = kimik3.Decoder(model, "naive", batch_size=batch, max_seq_len=context + 2, prefill="chunked")
    dec.prefill(ids)
    return dec.step(ids[:, -1]).float().cpu()


def _opcode_report(st: dict[str, Any], model: Any, batch: int) -> dict[str, Any]:
    """The per-instruction timing buffer against the performance model; the dry run: the model's own timeline."""
    if st["dry"]:
        from kimik3.perfmodel import model_program

        return modelled_opcode_report(model_program(st["preset"], batch), st["preset"], st["opcode_prompt"] + 3)
    from kimik3.perfmodel.device import megakernel_opcode_report

    return megakernel_opcode_report(model, batch, st["opcode_prompt"], prebuilt=st["prebuilt"], check=False)


def modelled_opcode_report(program: Any, preset: str, context: int) -> dict[str, Any]:
    """The dry run's stand-in for the timing buffer: ``program`` scored by ``kimik3.perfmodel.opcode_report`` with the
    model's own simulated timeline as the "measurement" (measured / model = 1 for every opcode). It exercises the
    scoring (the expert opcodes of an MXFP4 program from the design's MXFP4 entries), not the device."""
    import numpy as np

    from kimik3.perfmodel import design_expert_formats, megakernel_model, opcode_report
    from kimik3.perfmodel.data import CURRENT_DESIGN

    if program.expert_format == "mxfp4" and "mxfp4" not in design_expert_formats(CURRENT_DESIGN):
        return {"not_scored": f"design {CURRENT_DESIGN} does not describe MXFP4 experts"}
    _, tl = megakernel_model(preset, program.batch, CURRENT_DESIGN, None, context, program=program,
                             experts="mxfp4" if program.expert_format == "mxfp4" else "bf16")
    timings = np.stack([tl["start_ns"].to_numpy(), tl["end_ns"].to_numpy(), tl["sm"].to_numpy()], 1).astype(np.int64)
    return {**opcode_report(program, timings, preset, context), "timings": "the model's own timeline (dry run)"}


# ---------------------------------------------------------------------------------------------- MXFP4 items


def _mxfp4_setup(ctx: dict[str, Any]) -> dict[str, Any]:
    return {**ctx, "models": {}}


def _mxfp4_run(st: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    """One MXFP4 megakernel item: ``naive``'s teacher-forcing trace on the MXFP4-holding model, the megakernel (a GPU
    run) and the interpreter (where planned) against it and against each other, per step; the timing buffer."""
    import kimik3.megakernel.interpreter  # noqa: F401  (registers stage "megakernel-interp")
    from kimik3.validation import reference_trace
    from kimik3.validation.compare import run_stage  # the comparison loop, also returning each step's logits
    from kimik3.validation.metric import rel_error

    dry, B = st["dry"], it["batch"]
    device, dtype = _device(st)
    models = st["models"]
    if it["preset"] not in models:
        models.clear()  # one model resident at a time
        models[it["preset"]] = shared_model(it["preset"], dtype=dtype, device=device).quantize_experts()
    model = models[it["preset"]]
    rec: dict[str, Any] = {"expert_storage": model.expert_storage}
    trace = reference_trace(model, B, st["prompt"], st["steps"], seed=B)
    if plant == "wrong":  # a wrong result injected: the model under test differs from the one naive traced
        model = perturbed(model)
    opts = {"check": False, **({"prebuilt": str(st["prebuilt"])} if st["prebuilt"] else {})}
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
        try:  # reported, never fatal (as the dense megakernel's)
            if dry:
                from kimik3.perfmodel import model_program

                prog = model_program(it["preset"], B, experts="mxfp4")
                rec["opcodes"] = modelled_opcode_report(prog, it["preset"], st["prompt"] + st["steps"])
            else:
                from kimik3.perfmodel.device import megakernel_opcode_report

                rec["opcodes"] = megakernel_opcode_report(model, B, st["prompt"], steps=st["steps"], **opts)
        except Exception as e:
            rec["opcodes"] = {"batch": B, "error": f"{type(e).__name__}: {e}"[:2000]}
    return rec


# ---------------------------------------------------------------------------------------------- constants


def _constants_run(ctx: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    from devcheck.probes import run_probes

    return {"document": run_probes(Path(ctx["prebuilt"]) if ctx["prebuilt"] else None, dry=ctx["dry"],
                                   budget_s=float(ctx["budget_s"]))}


def _echo_run(ctx: dict[str, Any], it: dict[str, Any], plant: str | None) -> dict[str, Any]:
    """The child machinery's self-check (tests/test_device_check_isolation.py): the item's payload back, corrupted
    when a wrong result is planted."""
    return {"payload": -it.get("payload", 0) if plant == "wrong" else it.get("payload", 0)}


JOBS: dict[str, Job] = {
    "echo": Job(lambda ctx: ctx, _echo_run),
    "preflight": Job(_preflight_setup, _preflight_run),
    "smoke": Job(_smoke_setup, _smoke_run),
    "megakernel": Job(_megakernel_setup, _megakernel_run),
    "megakernel_mxfp4": Job(_mxfp4_setup, _mxfp4_run),
    "constants": Job(lambda ctx: ctx, _constants_run),
    "ranks": Job(jobs_ranks._setup, jobs_ranks._run),
}
