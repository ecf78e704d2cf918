"""Before the first launch of a megakernel variant: what its cubin, its compile report, the design and (on a GPU)
the driver say about registers, block shape, shared memory, occupancy of the cooperative grid and the L1 the
carveout leaves, compared; a mismatch is a named failure, not a crash. docs/device-check.md."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kimik3.kernels.contracts.isa import CTA_THREADS, SMEM_CARVEOUT_PERCENT

from devcheck.cubin import kernel_attributes

# sm_90 limits (CUDA C++ Programming Guide, "Compute Capabilities", compute capability 9.0): the unified L1 /
# shared array per SM, the carveouts the driver can choose, the opt-in maximum per block, the shared memory the
# system reserves per CTA, registers per SM and their allocation unit per warp. On a GPU the driver's own device
# attributes are read beside them and any difference is a mismatch.
SM90 = {"l1_shared_bytes": 256 * 1024, "carveouts_KiB": (0, 8, 16, 32, 64, 100, 132, 164, 196, 228),
        "max_shared_per_block_optin": 227 * 1024, "reserved_shared_per_cta": 1024, "registers_per_sm": 65536,
        "register_unit_per_warp": 256}


def _regs_per_cta(registers: int, threads: int) -> int:
    unit = SM90["register_unit_per_warp"]
    warps = math.ceil(threads / 32)
    return warps * math.ceil(registers * 32 / unit) * unit


def carveout_for(shared_per_cta: int) -> int:
    """The carveout (bytes) the driver takes for one CTA of ``shared_per_cta`` bytes when L1 is preferred: the
    smallest supported one that holds it."""
    need = shared_per_cta + SM90["reserved_shared_per_cta"]
    for kib in SM90["carveouts_KiB"]:
        if kib * 1024 >= need:
            return kib * 1024
    raise ValueError(f"{need} bytes of shared memory per CTA do not fit any sm_90 carveout")


def _design(variant: Any) -> dict[str, Any] | None:
    """The current design's figures for this variant, where the design describes it (the bench preset)."""
    from kimik3.perfmodel.data import CURRENT_DESIGN, load_design

    if variant.preset != "k3-shard" or variant.expert_format != "dense":
        return None
    mk = load_design(CURRENT_DESIGN)["megakernel"]
    b = str(variant.batch)
    regs, smem = mk["registers"]["value"], mk["shared_bytes"]["value"]
    if b not in regs or b not in smem:
        return None
    return {"design": CURRENT_DESIGN, "threads": int(mk["threads"]["value"]), "registers": int(regs[b]),
            "shared_bytes": int(smem[b]), "ctas_per_sm": int(mk["ctas_per_sm"]["value"])}


def _model_l1_assumed(shared_bytes: int) -> tuple[int, int]:
    """The L1 the performance model gives a CTA beside its shared memory (kimik3.perfmodel.megakernel): its point
    value and its pessimistic end (the low end of the range of ``l1_free_fraction``)."""
    from kimik3.perfmodel.data import load_constants

    c = load_constants()
    point = c.l1_capacity_bytes - shared_bytes
    low = c.ranges.get("l1_free_fraction", (c.values.get("l1_free_fraction", 1.0),) * 2)[0]
    return int(point * c.values.get("l1_free_fraction", 1.0)), int(point * low)


def preflight(prebuilt: Path, name: str, *, dry: bool, plant: str | None = None) -> dict[str, Any]:
    """The preflight record of megakernel variant ``name`` (a registry name) from ``prebuilt``: every check with
    its two sides; ``status`` "ok" or "preflight mismatch: <the checks that failed>"."""
    from kimik3.kernels.toolchain.registry import get_variant

    manifest = json.loads((prebuilt / "manifest.json").read_text())
    entry = manifest["kernels"][name]
    variant = get_variant(name)
    (ent,) = entry["entries"]  # the megakernel is one entry point
    fn = ent["name"]
    cubin = kernel_attributes((prebuilt / entry["files"]["cubin"]).read_bytes())[fn]
    if plant == "preflight":  # a planted mismatch: the cubin read as if compiled with more registers
        cubin = {**cubin, "registers": cubin["registers"] + 16}
    (report,) = [k for k in entry["ptxas"] if k["name"] == fn]
    dyn = int(ent["dynamic_shared_bytes"])
    shared = dyn + int(cubin["static_shared_bytes"])
    carve = carveout_for(shared)
    l1_left = SM90["l1_shared_bytes"] - carve
    checks: list[dict[str, Any]] = []

    def check(what: str, ok: bool, detail: str, failure: bool = True) -> None:
        checks.append({"check": what, "ok": bool(ok), "failure": failure, "detail": detail})

    check("registers: cubin = compile report", cubin["registers"] == report["registers"],
          f"cubin {cubin['registers']}, ptxas report {report['registers']}")
    check("block: cubin = launch", cubin.get("reqntid") == [CTA_THREADS, 1, 1] == ent.get("block"),
          f"cubin reqntid {cubin.get('reqntid')}, manifest {ent.get('block')}, launch [{CTA_THREADS}, 1, 1]")
    check("no stack frame (no spills)", not cubin.get("frame_bytes") and not report.get("spill_stores"),
          f"frame {cubin.get('frame_bytes')} B, spill stores {report.get('spill_stores')}")
    regs_cta = _regs_per_cta(cubin["registers"], CTA_THREADS)
    check("one CTA per SM: registers", regs_cta <= SM90["registers_per_sm"],
          f"{regs_cta} registers per CTA of {SM90['registers_per_sm']}")
    check("one CTA per SM: shared memory", shared <= SM90["max_shared_per_block_optin"],
          f"{shared} B (dynamic {dyn} + static {cubin['static_shared_bytes']}) of {SM90['max_shared_per_block_optin']}")
    assumed, pessimistic = _model_l1_assumed(dyn)
    # below the model's point is a note (its range covers it); below its pessimistic end the range is wrong
    check("L1 the carveout leaves vs the model", l1_left >= assumed,
          f"carveout {carve // 1024} KiB (launcher asks {SMEM_CARVEOUT_PERCENT} %: prefer L1) leaves "
          f"{l1_left // 1024} KiB of L1; the performance model assumes {assumed // 1024} KiB (pessimistic "
          f"{pessimistic // 1024} KiB)", failure=l1_left < pessimistic)
    design = _design(variant)
    if design is not None:
        check(f"registers: compile report = design {design['design']}", report["registers"] == design["registers"],
              f"report {report['registers']}, design {design['registers']}")
        check(f"dynamic shared memory = design {design['design']}", dyn == design["shared_bytes"],
              f"manifest {dyn} B, design {design['shared_bytes']} B")
        check(f"threads = design {design['design']}", CTA_THREADS == design["threads"],
              f"launch {CTA_THREADS}, design {design['threads']}")
    rec: dict[str, Any] = {"variant": name, "function": fn, "cubin": cubin, "report": report,
                           "dynamic_shared_bytes": dyn, "design": design,
                           "carveout": {"percent_asked": SMEM_CARVEOUT_PERCENT, "chosen_bytes": carve,
                                        "l1_left_bytes": l1_left, "how": "derived: the smallest sm_90 carveout "
                                        "holding the CTA's shared memory (L1 preferred)"}}
    if dry:
        rec["driver"] = "left out in the dry run: needs the CUDA driver"
    else:
        from devcheck.driver import driver_preflight

        drv = driver_preflight((prebuilt / entry["files"]["cubin"]).read_bytes(), fn, dyn, CTA_THREADS,
                               SMEM_CARVEOUT_PERCENT)
        rec["driver"] = drv
        check("registers: driver = cubin", drv["registers"] == cubin["registers"],
              f"driver {drv['registers']}, cubin {cubin['registers']}")
        check("static shared memory: driver = cubin", drv["static_shared_bytes"] == cubin["static_shared_bytes"],
              f"driver {drv['static_shared_bytes']}, cubin {cubin['static_shared_bytes']}")
        check("cooperative grid fits: one CTA on every SM", drv["blocks_per_sm"] >= 1 and drv["cooperative_launch"],
              f"occupancy {drv['blocks_per_sm']} CTA/SM x {drv['sm_count']} SMs; cooperative launch supported: "
              f"{drv['cooperative_launch']}")
        check("shared memory per block: driver limit", shared <= drv["max_shared_per_block_optin"],
              f"{shared} B of the driver's {drv['max_shared_per_block_optin']} B")
        check("sm_90 table = driver", drv["max_shared_per_sm"] == max(SM90["carveouts_KiB"]) * 1024
              and drv["max_shared_per_block_optin"] == SM90["max_shared_per_block_optin"],
              f"driver: {drv['max_shared_per_sm']} B per SM, {drv['max_shared_per_block_optin']} B per block")
    rec["checks"] = checks
    bad = [c["check"] for c in checks if not c["ok"] and c["failure"]]
    rec["notes"] = [f"{c['check']}: {c['detail']}" for c in checks if not c["ok"] and not c["failure"]]
    rec["status"] = "ok" if not bad else f"preflight mismatch: {'; '.join(bad)}"
    return rec
