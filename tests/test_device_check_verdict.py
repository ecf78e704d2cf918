"""The device check cannot report success on nothing: its orchestrator, fed planted outcomes on the CPU, exits
non-zero for a failing, erroring, timing-out or skipped test and for a benchmark row that disagrees with naive, is
not measured or lacks its comparison — and names what failed. A planted all-passing run exits 0, so the check
can also succeed."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from device_check_script import load_script

REPO = Path(__file__).resolve().parents[1]


dc = load_script()

PASSING = """
def test_fine():
    assert 1 + 1 == 2
"""
PLANTED = {
    "failing": ("def test_planted():\n    assert 1 == 2, 'planted failure'\n", "failed"),
    "erroring": ("import pytest\n\n@pytest.fixture\ndef broken():\n    raise RuntimeError('planted setup error')\n\n"
                 "def test_planted(broken):\n    pass\n", "error"),
    "skipped": ("import pytest\n\ndef test_planted():\n    pytest.skip('planted skip: no cutlass')\n", "skipped"),
    "timing-out": ("import time\n\ndef test_planted():\n    time.sleep(600)\n", "timeout"),
}


def _args(tmp_path: Path, tests: list[str]) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path), prebuilt=None, quick=False, dry_run=False, presets="", batches="",
                              tests=tests, phase=None)


def _plant(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "planted" / "test_planted_gpu.py"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("import pytest\n\npytestmark = pytest.mark.gpu\n" + textwrap.dedent(PASSING) + "\n" + body)
    return f


def _run_tests_phase(tmp_path: Path, f: Path, monkeypatch: pytest.MonkeyPatch, budget: float) -> dict[str, Any]:
    out = tmp_path / "out"
    # the plan's budgets, with a short one for the tests phase so the planted hang is cut quickly
    plan = {"phase_budgets_s": {"copy_bandwidth": 10.0, "tests": budget, "kernels": 10.0, "bench": 10.0}}
    dc._write(out, "plan", plan)
    code = dc.run_phases(out, _args(tmp_path, [str(f)]), ["tests"])
    summary = json.loads((out / dc.FILES["summary"]).read_text())
    return {"code": code, "summary": summary, "tests": json.loads((out / dc.FILES["tests"]).read_text())}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_planted_test_outcome_fails_the_check_and_is_named(kind: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    body, outcome = PLANTED[kind]
    f = _plant(tmp_path, body)
    r = _run_tests_phase(tmp_path, f, monkeypatch, budget=12.0)
    assert r["code"] == 1 and r["summary"]["exit_status"] == 1
    failures = r["summary"]["failures"]
    named = [x for x in failures if "test_planted" in x and "test_fine" not in x]
    assert named and named[0].startswith("test ") and f": {outcome}" in named[0], failures
    assert not any("test_fine" in x for x in failures), failures  # the passing test is not blamed
    assert r["tests"]["tests"][next(k for k in r["tests"]["tests"] if k.endswith("::test_fine"))]["outcome"] == \
        "passed"
    assert "FAILED test " in capsys.readouterr().out


def test_all_passing_planted_run_exits_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _plant(tmp_path, "def test_also_fine():\n    assert True\n")
    r = _run_tests_phase(tmp_path, f, monkeypatch, budget=60.0)
    assert r["code"] == 0 and r["summary"]["failures"] == [], r["summary"]
    assert {v["outcome"] for v in r["tests"]["tests"].values()} == {"passed"} and len(r["tests"]["tests"]) == 2


def test_a_file_that_runs_no_test_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "planted" / "test_empty_gpu.py"
    f.parent.mkdir(parents=True)
    f.write_text("def helper():\n    pass\n")
    r = _run_tests_phase(tmp_path, f, monkeypatch, budget=60.0)
    assert r["code"] == 1 and any("no test" in x for x in r["summary"]["failures"]), r["summary"]["failures"]


def _bench_table(rows: list[dict[str, Any]], skipped: list[dict[str, Any]] | None = None,
                 order: list[list[Any]] | None = None) -> dict[str, Any]:
    def phase(out: Path, args: argparse.Namespace) -> None:
        dc._write(out, "bench", {"rows": rows, "skipped": skipped or [], "tolerance_vs_naive": 3e-2,
                                 "order": order or [[r["stage"], r["batch"]] for r in rows]})
    return {"bench": phase}


OK_ROWS = [{"stage": "naive", "batch": 1, "status": "ok", "ms_per_token": 9.0, "rel_err_vs_naive": 0.0},
           {"stage": "fused", "batch": 1, "status": "ok", "ms_per_token": 1.0, "rel_err_vs_naive": 4e-3}]


@pytest.mark.parametrize("case", ["disagrees", "no comparison", "crashed", "skipped for budget", "error"])
def test_planted_bench_rows_fail_the_check_and_are_named(case: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    dc._write(out, "plan", {"phase_budgets_s": {"bench": 60.0}})
    rows = [dict(r) for r in OK_ROWS]
    skipped, order = [], None
    if case == "disagrees":
        rows[1]["rel_err_vs_naive"] = 0.5
    elif case == "no comparison":
        del rows[1]["rel_err_vs_naive"]
    elif case == "crashed":
        rows[1] = {"stage": "fused", "batch": 1, "status": "error: RuntimeError: planted"}
    elif case == "skipped for budget":
        order = [["naive", 1], ["fused", 1]]
        rows = rows[:1]
        skipped = [{"stage": "fused", "batch": 1, "reason": "skipped: 3 s of the 5-minute budget left"}]
    if case == "error":
        def table_phase(out: Path, args: argparse.Namespace) -> None:
            raise RuntimeError("planted phase crash")
        table = {"bench": table_phase}
    else:
        table = _bench_table(rows, skipped, order)
    code = dc.run_phases(out, _args(tmp_path, []), ["bench"], table=table)
    failures = json.loads((out / dc.FILES["summary"]).read_text())["failures"]
    assert code == 1 and failures
    expected = {"disagrees": "bench fused batch 1: disagrees with naive", "no comparison": "bench fused batch 1: no "
                "comparison with naive", "crashed": "bench fused batch 1: error: RuntimeError: planted",
                "skipped for budget": "bench fused batch 1: skipped", "error": "phase bench: error: RuntimeError"}[case]
    assert any(x.startswith(expected) for x in failures), failures


def test_agreeing_bench_rows_pass(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dc._write(out, "plan", {"phase_budgets_s": {"bench": 60.0}})
    assert dc.run_phases(out, _args(tmp_path, []), ["bench"], table=_bench_table(OK_ROWS)) == 0


def test_prebuilt_and_carry_problems_fail_the_verdict(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dc._write(out, "plan", {"prebuilt": {"missing": ["megakernel/tiny/b1"], "stale": ["fused/x"]},
                            "verified": [{"name": "fused/y", "status": "error: ValueError: sha256"}],
                            "carry": {"fits": False, "total_MiB": 70.0, "limit_MiB": 64.0}})
    failures = dc.verdict(out, {"phases": []})
    assert failures == ["prebuilt kernel megakernel/tiny/b1: missing",
                        "prebuilt kernel fused/x: stale (built from other kernel sources)",
                        "prebuilt kernel fused/y: error: ValueError: sha256",
                        "carry: 70.0 MiB is over the 64 MiB limit"]
