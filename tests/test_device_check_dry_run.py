"""The device check's dry run executes its whole plan on a CPU, only the GPU launches left out: the kernels of the
``tiny`` batch-1 targets exported (fused ops and the megakernel, the DSL runtime compressed), every artefact
verified and loaded, the carried size measured against 64 MiB, the tests phase's files and recorder checked, the
benchmark rows measured on the CPU and compared with naive, the MXFP4 megakernel phase's item on the CPU (the quantised
model, naive's trace, the interpreter against it, the MXFP4 program scored), the rank items (tiny's two ranks
through the interpreter against naive, their launch plan for the ranks kernel) — and it exits 0 only when all of
that holds.

Only the ``tiny`` batch-1 targets, because the kernel export dominates the run time; the full target set (every
preset and batch the GPU run uses) is under ``slow``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from device_check_script import build_prebuilt, load_script

from kimik3.perfmodel import design_expert_formats
from kimik3.perfmodel.data import CURRENT_DESIGN

REPO = Path(__file__).resolve().parents[1]


dc = load_script()


def _dry_run(out: Path, prebuilt: Path, *select: str) -> tuple[int, dict]:
    code = dc.main(["--out", str(out), "--dry-run", "--prebuilt", str(prebuilt), *select])
    read = {k: json.loads((out / f).read_text()) for k, f in dc.FILES.items() if (out / f).exists()}
    return code, read


def test_dry_run_executes_the_plan_for_tiny(tiny_prebuilt: Path, tmp_path: Path) -> None:
    code, r = _dry_run(tmp_path / "out", tiny_prebuilt, "--presets", "tiny,tiny-rank", "--batches", "1")
    summary, plan = r["summary"], r["plan"]
    assert code == 0 and summary["exit_status"] == 0 and summary["failures"] == [], summary["failures"]
    # every phase ran or says it was left out for its GPU launches
    assert [p["phase"] for p in summary["phases"]] == list(dc.PHASES)
    assert {p["phase"] for p in summary["phases"] if p["status"] != "ok"} == {"copy_bandwidth"}
    assert next(p for p in summary["phases"] if p["phase"] == "copy_bandwidth")["status"].startswith(
        "left out in the dry run")
    assert all(p["estimate_s"] for p in summary["phases"])
    # the artefacts the run loads: all of the targets', each verified and loaded here
    pb = plan["prebuilt"]
    assert pb["ready"] and not pb["missing"] and not pb["stale"] and pb["runtime_shipped"]
    assert len(plan["verified"]) == pb["distinct_ops"] > 20
    assert {v["status"] for v in plan["verified"]} == {"loaded"}
    assert {"megakernel/tiny/b1", "megakernel/tiny/b1-mxfp4", "megakernel/tiny-rank/b1"} <= {
        v["name"] for v in plan["verified"]}
    assert not (tiny_prebuilt / dc.RUNTIME_LIB).exists()  # the unpacked runtime is not left to be carried
    # the carried size, the runtime compressed
    carry = plan["carry"]
    assert carry["fits"] and carry["prebuilt_bytes"] > 5 * 2**20 and carry["total_bytes"] <= 64 * 2**20
    # phase estimates: the whole fits its budget on an H200
    assert sum(plan["phase_estimates_s"].values()) < dc.TOTAL_BUDGET_S
    # the tests phase: the planned files exist and the outcome recorder is there
    assert r["tests"]["dry_run"] and not r["tests"]["missing_files"] and r["tests"]["outcome_recorder"]
    # the benchmark rows: measured on the CPU, each compared with naive
    rows = {(x["stage"], x["batch"]): x for x in r["bench"]["rows"]}
    assert set(rows) == {("absorbed", 1), ("naive", 1)}
    assert all(x["status"] == "ok" and x["rel_err_vs_naive"] <= 3e-2 for x in rows.values())
    # the MXFP4 megakernel phase: its item on the CPU, the megakernel launches left out
    mx = r["megakernel_mxfp4"]
    assert mx["dry_run"] and [x["variant"] for x in mx["results"]] == ["megakernel/tiny/b1-mxfp4"], mx
    (item,) = mx["results"]
    assert item["status"] == "ok" and item["expert_storage"] == "mxfp4"
    assert item["megakernel_vs_naive"].startswith("left out in the dry run")
    iv = item["interp_vs_naive"]
    assert iv["passed"] and iv["tokens_equal"] and len(iv["errors"]) == dc.MXFP4_STEPS + 1
    ops = item["opcodes"]
    if "mxfp4" in design_expert_formats(CURRENT_DESIGN):  # the program's MXFP4 expert opcodes scored
        assert {"EXPERT_GATE_UP", "EXPERT_DOWN"} <= set(ops["by_opcode"]), ops
    else:
        assert ops == {"not_scored": f"design {CURRENT_DESIGN} does not describe MXFP4 experts"}, ops
    assert r["provenance"]["commit_source"] and r["provenance"]["kernel_source_hashes"]
    # the child-process phases ran their CPU counterparts: the preflight of both megakernel variants, the
    # megakernel's row (the interpreter, compared with naive) and its timing report (the model's own timeline)
    assert {x["variant"]: x["status"] for x in r["preflight"]["results"]} == {
        "megakernel/tiny/b1": "ok", "megakernel/tiny/b1-mxfp4": "ok", "megakernel/tiny-rank/b1": "ok"}
    # the rank items: both ranks of tiny over 2, their launch plan for the ranks kernel, through the interpreter's
    # ranks against naive (fp32: the same greedy tokens)
    (loop,) = r["ranks"]["results"]
    assert loop["status"] == "ok" and loop["kernel"] == "megakernel/tiny-rank/b1" and loop["world"] == 2
    assert loop["stage"] == "megakernel-interp" and loop["vs_naive"]["passed"] and loop["vs_naive"]["tokens_equal"]
    mk = {x["name"]: x for x in r["megakernel"]["results"]}
    row = mk["megakernel bench b1 ctx16"]["row"]
    assert row["stage"] == "megakernel-interp" and row["rel_err_vs_naive"] <= 3e-2
    assert mk["megakernel opcodes b1"]["status"] == "ok" and mk["megakernel opcodes b1"]["opcodes"]["by_opcode"]
    assert r["constants"]["results"][0]["status"] == "ok"


PLANTS = {"preflight": "preflight megakernel/tiny/b1", "refuse": "preflight megakernel/tiny/b1-mxfp4",
          "hang": "megakernel bench b1 ctx16", "fault": "megakernel opcodes b1", "wrong": "mxfp4 *"}


@pytest.mark.slow
def test_dry_run_names_each_planted_failure_and_runs_every_other_phase(tiny_prebuilt: Path, tmp_path: Path) -> None:
    """A hang, a fault, a wrong result, a refused launch and a preflight mismatch planted into the child processes:
    each is named in summary.json, every phase still ran and wrote its file, the exit status is non-zero. (The
    mechanism, with real child processes, is tested in CI by tests/test_device_check_isolation.py; this is the whole
    dry run with the plants, a second run of it, under ``slow``.)"""
    plants = [a for k, glob in PLANTS.items() for a in ("--plant", f"{k}:{glob}")]
    code, r = _dry_run(tmp_path / "out", tiny_prebuilt, "--presets", "tiny", "--batches", "1", "--item-timeout",
                       "30", *plants)
    failures = r["summary"]["failures"]
    assert code == 1 and r["summary"]["exit_status"] == 1
    named = {
        "preflight": "preflight megakernel/tiny/b1: preflight mismatch: registers: cubin = compile report",
        "refuse": "preflight megakernel/tiny/b1-mxfp4: refused: LaunchRefused: planted",
        "hang": "megakernel bench b1 ctx16: hang: no result after",
        "fault": "megakernel opcodes b1: fault: the child died by SIGSEGV",
        "wrong": "megakernel_mxfp4 megakernel/tiny/b1-mxfp4: interp vs naive rel err"}
    for kind, text in named.items():
        assert sum(f.startswith(text) for f in failures) == 1, (kind, failures)
    assert len(failures) == len(named), failures
    assert [p["phase"] for p in r["summary"]["phases"]] == list(dc.PHASES)
    assert {p["phase"] for p in r["summary"]["phases"] if p["status"] != "ok"} == {"copy_bandwidth"}
    assert set(dc.FILES) - {"measurements", "copy_bandwidth"} <= set(r), sorted(r)  # (no GPU: nothing to copy)
    assert sorted(r["summary"]["planted"]) == sorted(f"{k}:{g}" for k, g in PLANTS.items())


@pytest.mark.slow
def test_dry_run_tampered_artefact_fails_and_is_named(tiny_prebuilt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "prebuilt"
    shutil.copytree(tiny_prebuilt, bad)
    victim = next(p for p in sorted(bad.glob("fused__*.so")))
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    code, r = _dry_run(tmp_path / "out", bad, "--presets", "tiny", "--batches", "1")
    assert code == 1
    assert any("does not match its sha256" in f for f in r["summary"]["failures"]), r["summary"]["failures"]


@pytest.mark.slow
def test_dry_run_full_target_set(tmp_path: Path) -> None:
    """Every target the GPU run uses (kimik3.kernels.toolchain.targets): exported, verified, loaded, carried under 64
    MiB."""
    prebuilt = build_prebuilt(tmp_path / "prebuilt")
    code, r = _dry_run(tmp_path / "out", prebuilt)
    assert code == 0 and r["summary"]["failures"] == [], r["summary"]["failures"]
    assert r["plan"]["prebuilt"]["distinct_ops"] == len(r["plan"]["verified"]) > 100
    assert r["plan"]["carry"]["fits"]
