"""The device check's verdict: every failure of the run by name (a phase that did not finish, a test that did not
pass, a preflight mismatch, a hung / faulted / refused child item, a row that disagrees with ``naive``), and the
measured rows in the ``data/measurements`` format. docs/device-check.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devcheck.common import BENCH_PRESET, DRY_STATUS, read, write
from devcheck.pytests import judge_tests
from kimik3.validation.metric import TOL


def _item_failure(phase: str, r: dict[str, Any]) -> str | None:
    if r.get("status") == "ok":
        return None
    return f"{r.get('name', phase)}: {str(r.get('status'))[:300]}"


def judge_items(rec: dict[str, Any] | None, phase: str) -> list[str]:
    """Every planned child item of ``phase`` that did not end "ok" (a hang, a fault, a refusal, a mismatch, an
    error, a skip), and every planned item without a record."""
    if rec is None:
        return [f"{phase}: no result file (the phase did not run)"]
    done = {r.get("name"): r for r in rec.get("results", [])}
    failures = []
    for it in rec.get("items", []):
        r = done.get(it["name"])
        if r is None:
            failures.append(f"{it['name']}: not run")
        elif (f := _item_failure(phase, r)) is not None:
            failures.append(f)
    return failures


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
        else:
            failures += _row_failures(name, r, tol)
    return failures


def _row_failures(name: str, r: dict[str, Any], tol: float) -> list[str]:
    if r.get("status") != "ok":
        return [f"{name}: {str(r.get('status'))[:300]}"]
    if r.get("rel_err_vs_naive") is None:
        return [f"{name}: no comparison with naive"]
    if not float(r["rel_err_vs_naive"]) <= tol:  # (NaN fails too)
        return [f"{name}: disagrees with naive (first-step rel err {r['rel_err_vs_naive']:.3g} > {tol})"]
    return []


def judge_megakernel(rec: dict[str, Any] | None) -> list[str]:
    """The megakernel phase: every item ran (a hang, fault or refusal is named by ``judge_items``), and each
    benchmark row was measured and agrees with ``naive``. The timing-buffer reports are not judged."""
    failures = judge_items(rec, "megakernel")
    if rec is None:
        return failures
    tol = float(rec.get("tolerance_vs_naive", TOL["bf16_stage"]))
    for r in rec.get("results", []):
        if r.get("status") == "ok" and r.get("kind") == "bench":
            failures += _row_failures(r["name"], r.get("row") or {}, tol)
    return failures


def judge_mxfp4(rec: dict[str, Any] | None) -> list[str]:
    """The failures of the MXFP4 megakernel phase, by variant: a planned item not run (skipped, crashed, hung), a
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
            if (f := _comparison_failure(r.get(key), key.replace("_", " "))) is not None:
                failures.append(f"{name}: {f}")
    return failures


def _comparison_failure(c: Any, what: str) -> str | None:
    """What is wrong with one comparison record (``max_error``, ``tolerance``, greedy ``tokens_equal``), if anything."""
    if not isinstance(c, dict):
        return f"no {what}"
    if not float(c["max_error"]) <= float(c["tolerance"]):  # (NaN fails too)
        return f"{what} rel err {c['max_error']:.3g} > {c['tolerance']}"
    if c.get("mode") == "greedy" and not c.get("tokens_equal", True):
        return f"{what}: greedy tokens differ"
    return None


def judge_ranks(rec: dict[str, Any] | None) -> list[str]:
    """The rank items: each ran ("ok"); a loopback agrees with naive within its tolerance (teacher-forced, or the
    same greedy tokens in fp32); a rank alone has its measured (or, dry, modelled) step and NVL72 prediction."""
    failures = judge_items(rec, "ranks")
    if rec is None:
        return failures
    for r in rec.get("results", []):
        if r.get("status") != "ok":
            continue
        name = r["name"]
        if r.get("kind") == "loopback":
            if (f := _comparison_failure(r.get("vs_naive"), "vs naive")) is not None:
                failures.append(f"{name}: {f}")
        elif not (r.get("step_ms") and r.get("nvl72", {}).get("tokens_per_s_per_sequence")):
            failures.append(f"{name}: no step time or NVL72 prediction")
    return failures


def judge_constants(rec: dict[str, Any] | None) -> list[str]:
    """The constants phase: its child ran; on a GPU it measured at least one constant."""
    failures = judge_items(rec, "constants")
    if rec is None or failures:
        return failures
    doc = (rec["results"][0] or {}).get("document") or {}
    if not rec.get("dry_run") and not doc.get("constants"):
        failures.append("constants: the probes measured nothing")
    return failures


def verdict(out: Path, summary: dict[str, Any]) -> list[str]:
    """Every failure of the run, by name. Empty only when everything planned ran and agreed."""
    failures = [f"phase {p['phase']}: {p['status']}" for p in summary["phases"]
                if p["status"] not in ("ok", DRY_STATUS)]
    ran = {p["phase"] for p in summary["phases"] if p["status"] != DRY_STATUS}
    pl = read(out, "plan") or {}
    pb = pl.get("prebuilt") or {}
    failures += [f"prebuilt kernel {n}: missing" for n in pb.get("missing", [])]
    failures += [f"prebuilt kernel {n}: stale (built from other kernel sources)" for n in pb.get("stale", [])]
    failures += [f"prebuilt kernel {v['name']}: {v['status']}" for v in pl.get("verified", [])
                 if v["status"] not in ("loaded", "verified")]
    carry = pl.get("carry")
    if carry and not carry["fits"]:
        failures.append(f"carry: {carry['total_MiB']} MiB is over the {carry['limit_MiB']:.0f} MiB limit")
    judges = {"preflight": lambda r: judge_items(r, "preflight"), "smoke": lambda r: judge_items(r, "smoke"),
              "megakernel_tests":
              lambda r: judge_tests(r, "megakernel_tests"), "constants": judge_constants, "tests": judge_tests,
              "bench": judge_bench, "megakernel_mxfp4": judge_mxfp4, "megakernel": judge_megakernel,
              "ranks": judge_ranks}
    for phase, judge in judges.items():
        if phase in ran:
            failures += judge(read(out, phase))
    return failures


def measurements(out: Path, prov: dict[str, Any]) -> dict[str, Any] | None:
    """The measured rows in the data/measurements format (copy into data/measurements/ to commit them)."""
    from kimik3.perf.cost import decode_cost

    records: list[dict[str, Any]] = []
    bench = read(out, "bench") or {}
    rows = [(r, bench.get("context", 512)) for r in bench.get("rows", [])]
    mk = read(out, "megakernel") or {}
    rows += [(r["row"], r["context"]) for r in mk.get("results", []) if r.get("status") == "ok" and r.get("row")]
    steps = bench.get("steps", 8)
    for r, context in rows:
        if r.get("status") == "ok" and r.get("ms_per_token"):
            cost = decode_cost(BENCH_PRESET, r["batch"], context + steps)
            records.append({"block": "step", "stage": r["stage"], "batch_size": r["batch"],
                            "context_len": context, "seconds": r["ms_per_token"] / 1e3,
                            "bytes": cost.total_bytes, "flops": cost.total_flops, "ms_min": r.get("ms_min"),
                            "ms_max": r.get("ms_max"), "pct_read_bw": r.get("pct_read_bw"),
                            "pct_copy_bw": r.get("pct_copy_bw"), "rel_err_vs_naive": r.get("rel_err_vs_naive")})
    kern = read(out, "kernels") or {}
    for k in kern.get("kernels", []):
        records.append({"block": f"kernel:{k['launch']}", "stage": "fused", "batch_size": k["batch"],
                        "seconds": k["seconds"], "bytes": k["bytes"], "flops": k["flops"], "op": k["op"],
                        "source_hash": k["source_hash"], "pct_copy_bw": k["pct_copy_bw"], "verdict": k["verdict"]})
    for m in kern.get("mxfp4_vs_bf16", []):
        for fmt in ("bf16", "mxfp4"):
            records.append({"block": f"experts:{fmt}", "stage": "fused", "batch_size": m["batch"],
                            "seconds": m[f"{fmt}_s"], "bytes": m[f"{fmt}_bytes"],
                            "time_ratio_mxfp4_over_bf16": m["time_ratio_mxfp4_over_bf16"]})
    ranks = read(out, "ranks") or {}
    for r in ranks.get("results", []):
        if r.get("status") == "ok" and r.get("kind") == "alone" and not ranks.get("dry_run"):
            nv = r["nvl72"]
            records.append({"block": "rank_step", "stage": "megakernel", "preset": r["preset"],
                            "rank_slice": r["rank_slice"], "batch_size": r["batch"], "context_len": r["context"],
                            "seconds": r["step_ms"]["median"] / 1e3, "ms_min": r["step_ms"]["min"],
                            "ms_max": r["step_ms"]["max"], "collective_wait_us": r["timings"]["collective_wait_us"],
                            "nvl72_step_ms": nv["step_ms"], "nvl72_step_ms_range": nv["step_ms_range"],
                            "nvl72_tokens_per_s_per_sequence": nv["tokens_per_s_per_sequence"],
                            "nvl72_tokens_per_s_per_sequence_range": nv["tokens_per_s_per_sequence_range"],
                            "nvl72_parts": nv["parts"]})
    if not records:
        return None
    data = {"date": prov.get("date"), "commit": prov.get("commit"),
            "dirty_working_tree": prov.get("dirty_working_tree"),
            "device": prov.get("gpu"), "torch_version": prov.get("torch"), "preset": BENCH_PRESET,
            "kernel_source_hashes": prov.get("kernel_source_hashes"), "source": "scripts/device_check.py",
            "records": records}
    write(out, "measurements", data)
    return data
