"""Model vs measured on a GPU: the hooks the device check calls so that the first GPU run tests the model.

* :func:`megakernel_opcode_report` — runs a few megakernel decode steps, keeps the last step's per-instruction
  timing buffer (``%globaltimer`` start/end and ``%smid`` per instruction, ``kernels/megakernel/vm.py``) and sets it
  against the calibrated model of the *same* program, per opcode (:func:`kimik3.perfmodel.opcode_report`);
* :func:`fused_kernel_report` — the per-launch kernel times a device check measured for the fused stage against
  the model's time for the same launches.

Both label their output as model vs measurement and say which constants and design were used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kimik3.perfmodel.data import CURRENT_DESIGN, load_constants, load_design

__all__ = ["megakernel_opcode_report", "fused_kernel_report"]


def megakernel_opcode_report(model: Any, batch: int, prompt_len: int, design: str = CURRENT_DESIGN,
                             steps: int = 3,
                             prebuilt: str | None = None, seed: int = 0, check: bool = True) -> dict[str, Any]:
    """Decode ``steps`` steps with stage ``megakernel`` after a random ``prompt_len``-token prompt; the last
    step's timing buffer against the model (context = the last step's position + 1). Needs CUDA. ``check``:
    hazard-check the program first (the GPU tests do it too; a time-boxed caller may skip it here)."""
    import torch

    import kimik3
    from kimik3.perfmodel import opcode_report

    if not torch.cuda.is_available():
        raise ValueError("megakernel_opcode_report needs a CUDA device")
    if batch < 1 or prompt_len < 1 or steps < 1:
        raise ValueError(f"batch, prompt_len and steps must be positive, got {batch}, {prompt_len}, {steps}")
    opts: dict[str, Any] = {"check": check, **({"prebuilt": str(prebuilt)} if prebuilt else {})}
    dec = kimik3.Decoder(model, "megakernel", batch_size=batch, max_seq_len=prompt_len + steps + 8, **opts)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).to(model.device)
    logits = dec.prefill(ids)
    for _ in range(steps):
        logits = dec.step(logits.argmax(-1))
    torch.cuda.synchronize()
    stage = dec.stage
    t = stage.timings
    t = t() if callable(t) else t
    timings = np.asarray(t.cpu() if hasattr(t, "cpu") else t, dtype=np.int64)
    program = stage.program
    if getattr(program, "cfg", None) is None:
        program.cfg = model.config
    context = prompt_len + steps
    t0 = int(timings[:, 0].min()) if len(timings) else 0
    raw = {"batch": batch, "prompt_len": prompt_len, "steps": steps, "num_sms": program.num_sms,
           "constants": load_constants().hardware, "device": torch.cuda.get_device_name(),
           "instruction_timings_ns": [[int(a - t0), int(b - t0), int(c)] for a, b, c in timings[:, :3]],
           "instruction_ops": [x.op.name for x in program.instructions]}
    try:
        rep = opcode_report(program, timings, model.config.name or "custom", context, design)
    except ValueError as e:  # the measurement is kept even when the model cannot score it
        return {**raw, "design": design, "label": "measured (not scored)", "model_error": str(e)}
    return {**rep, **raw}


def fused_kernel_report(kernel_records: Sequence[dict[str, Any]], preset: str, batch: int, context_len: int,
                        cache_len: int, design: str = CURRENT_DESIGN, expert_format: str = "bf16") -> dict[str, Any]:
    """Per measured launch (``{"launch", "family", "seconds", "batch"}`` records, as the device check writes them):
    the model's time for that launch (sum of its kernels, kernel boundary included — the measurement times
    back-to-back launches in a graph) and measured ÷ model; plus per family the sums over the measured launches."""
    from kimik3.perfmodel.fused import fused_times

    recs = [r for r in kernel_records if int(r.get("batch", batch)) == batch and "seconds" in r]
    bad = [r.get("launch") for r in recs if not np.isfinite(float(r["seconds"])) or float(r["seconds"]) <= 0]
    if bad:
        raise ValueError(f"measured kernel times must be positive and finite: {bad}")
    ft = fused_times(preset, batch, load_design(design), load_constants(), context_len, cache_len, expert_format)
    per_launch = ft.groupby("launch", sort=False)["ns"].sum()
    rows, fams = [], {}
    for r in recs:
        name = r["launch"]
        if name not in per_launch:
            rows.append({"launch": name, "family": r.get("family"), "measured_us": float(r["seconds"]) * 1e6,
                         "model_us": None, "note": "launch not in the modelled program"})
            continue
        m, x = float(per_launch[name]) / 1e3, float(r["seconds"]) * 1e6
        rows.append({"launch": name, "family": r.get("family"), "measured_us": x, "model_us": m,
                     "measured_over_model": x / m})
        f = fams.setdefault(str(r.get("family")), {"measured_us": 0.0, "model_us": 0.0, "launches": 0})
        f["measured_us"] += x
        f["model_us"] += m
        f["launches"] += 1
    for f in fams.values():
        f["measured_over_model"] = f["measured_us"] / f["model_us"]
    return {"design": design, "label": "model vs measured", "preset": preset, "batch": batch, "context": context_len,
            "constants": load_constants().hardware, "by_launch": rows, "by_family": fams}
