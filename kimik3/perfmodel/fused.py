"""The fused stage under the calibrated model: one kernel after another in a CUDA graph.

Per kernel of each launch of the fused step's plan (:func:`kimik3.fused.plan.meta_plan`: a ``meta`` model, no memory):
``kernel boundary + max(bytes / bandwidth, FMA issue, L2 re-reads) + serial loops``, where the bandwidth follows
Little's law over the SMs the grid covers: resident CTAs per SM (threads, registers from the compiled kernel's
resource report, CTA limit) × threads × loads in flight × load width, per SM capped by the SM's port, overall by
the achievable HBM bandwidth. Bytes and FLOPs per launch come from ``kimik3.fused.launch_cost.launch_bytes`` /
``launch_flops`` (the stage's own count); PyTorch glue ops are a design-given number of small kernels each.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import pandas as pd

from kimik3.perfmodel.data import Constants
from kimik3.perfmodel.expr import amount, evaluate

__all__ = ["SYMBOLS", "fused_program", "fused_times", "batch_tile"]

SYMBOLS = ("B", "bt", "fmt", "active", "nsplit", "shfl", "N", "K", "E", "L", "I", "topk", "NH", "R", "nh", "DL", "DR",
           "S", "D", "W", "H", "NC")


def batch_tile(B: int, cap: int = 16) -> int:
    """Batch rows per CTA of the fused GEMVs (``kernels._common.batch_tile``)."""
    return B if B <= cap else max(d for d in range(1, cap + 1) if B % d == 0)


@lru_cache(maxsize=16)
def fused_program(preset: str, batch: int, cache_len: int, expert_format: str = "bf16",
                  context_len: int | None = None) -> pd.DataFrame:
    """The fused step's launches (``FusedStep.describe``: bytes at ``context_len`` cached tokens, default the whole
    cache) for a preset, read from its plan on a meta model."""
    from kimik3.fused.plan import meta_plan

    step = meta_plan(preset, batch, cache_len, expert_format)
    df = step.describe(context=context_len or cache_len)
    df["family"] = [ln.op.family if ln.op is not None else "glue" for ln in step.program]
    df["shapes"] = [dict(ln.op.shapes) if ln.op is not None else {} for ln in step.program]
    return df


def _registers(kernel: dict[str, Any], family: str, fam_spec: dict[str, Any], B: int, fmt: int) -> float:
    table = kernel.get("registers_mxfp4") if fmt and "registers_mxfp4" in kernel else kernel["registers"]
    if family.startswith("gemv.") and "registers_by_variant" in fam_spec:
        table = fam_spec["registers_by_variant"].get(family.split(".", 1)[1], table)
    key = str(B)
    if key not in table:  # nearest compiled batch size at or above B (register use grows with the batch tile)
        sizes = sorted(int(x) for x in table)
        key = str(next((s for s in sizes if s >= B), sizes[-1]))
    return float(table[key])


def _family_spec(design: dict[str, Any], family: str) -> tuple[str, dict[str, Any]]:
    fams = design["fused"]["families"]
    if family in fams:
        return family, fams[family]
    base = family.split(".", 1)[0]
    if base in fams:
        return base, fams[base]
    raise ValueError(f"design {design['name']}: no fused family entry for {family!r}")


def fused_times(preset: str, batch: int, design: dict[str, Any], consts: Constants, context_len: int = 4096,
                cache_len: int | None = None, expert_format: str = "bf16") -> pd.DataFrame:
    """One row per kernel (glue ops: one row per op) with its modelled time in ns and what limits it."""
    from kimik3.kernels.contracts.meta import mla_default_splits
    from kimik3.perf.cost import expected_distinct_experts

    prog = fused_program(preset, batch, cache_len or context_len, expert_format, context_len)
    S = int(consts.sm_count)
    lat = consts.hbm_latency_ns
    rows = []
    glue = design["fused"]["families"].get("glue", {}).get("kernels_per_op", {})
    for _, ln in prog.iterrows():
        nbytes, flops, fam = float(ln["bytes"]), float(ln["flops"]), str(ln["family"])
        if fam == "glue":
            suffix = next((k for k in sorted(glue, key=len, reverse=True) if str(ln["launch"]).endswith(k)), None)
            if suffix is None:
                raise ValueError(f"design {design['name']}: no glue kernel count for launch {ln['launch']!r}")
            n = evaluate(glue[suffix], {})
            t = n * (consts.kernel_boundary_ns + lat) + nbytes / consts.achievable_Bps * 1e9
            rows.append({"launch": ln["launch"], "family": "glue", "kernel": suffix, "ns": t, "bytes": nbytes,
                         "limited_by": "kernel boundaries"})
            continue
        sh = dict(ln["shapes"])
        B = int(sh.get("B", batch))
        fmt = 1 if fam.endswith("mxfp4") else 0
        env: dict[str, float] = {k: float(v) for k, v in sh.items() if isinstance(v, (int, float))}
        env.update(B=float(B), bt=float(batch_tile(B)), fmt=float(fmt), shfl=consts.shuffle_latency_cycles)
        if "E" in sh and "topk" in sh:
            env["active"] = float(expected_distinct_experts(int(sh["E"]), int(sh["topk"]), B)) if sh["E"] > 1 else 1.0
        if fam == "mla":
            env["nsplit"] = float(mla_default_splits(B, int(sh["nh"]), int(sh["S"])))
        name, spec = _family_spec(design, fam)
        for k in spec["kernels"]:
            try:  # an entry that cannot be evaluated for this launch is named with its family and kernel
                share = float(k["share"])
                threads = evaluate(k["threads"], env)
                loads = evaluate(k["loads"], env)
                width = evaluate(k["load_bytes"], env)
                if min(threads, loads, width) <= 0:
                    raise ValueError(f"threads {threads:g} x loads {loads:g} x load_bytes {width:g} must all be > 0")
                ctas = max(1.0, evaluate(k["ctas"], env))
                regs = _registers(k, fam, spec, B, fmt)
                alloc = math.ceil(regs / consts.register_alloc_granularity) * consts.register_alloc_granularity
                resident = max(1.0, min(consts.max_ctas_per_sm, consts.max_threads_per_sm // threads,
                                        consts.registers_per_sm // (threads * alloc)))
                active = min(float(S), ctas)
                per_sm = min(resident, math.ceil(ctas / S))
                inflight = consts.inflight(per_sm * threads * loads * width)
                bw = min(active * min(consts.rate_Bps(inflight, lat), consts.sm_max_Bps), consts.achievable_Bps)
                b = share * nbytes
                mem = lat + b / bw * 1e9 if b > 0 else lat
                fma = share * flops / 2 * evaluate(spec.get("issue_per_fma", 1.0), env) / (
                    active * consts.issue_slots_per_sm_cycle * consts.sm_clock_Hz) * 1e9
                l2 = sum(amount(r["bytes"], env) for r in spec.get("rereads", [])) * share
                reread = l2 / (active * consts.l2_share_Bps) * 1e9
                serial = sum(amount(s["trips"], env) * (consts.latency_ns(s["level"]) + evaluate(
                    s["cycles"], env) * consts.cycle_ns) for s in k.get("serial", []))
                t = consts.kernel_boundary_ns + max(mem, fma, reread) + serial
                parts = {"hbm stream": mem, "FMA issue": fma, "L2 re-reads": reread}
                rows.append({"launch": ln["launch"], "family": name if name != "gemv" else fam, "kernel": k["name"],
                             "ns": t, "bytes": b, "ctas": ctas, "resident_ctas": resident,
                             "inflight_bytes_per_sm": inflight, "bandwidth_Bps": bw,
                             "limited_by": max(parts, key=parts.get) if max(parts.values()) > consts.kernel_boundary_ns
                             else "kernel boundary"})
            except ValueError as e:
                raise ValueError(f"design {design['name']}: fused family {name} kernel {k['name']} "
                                 f"({ln['launch']}): {e}") from None
    return pd.DataFrame(rows)
