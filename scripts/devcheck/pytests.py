"""The device check's GPU test files, each in a pytest child process with every test's outcome recorded as it
ends (``scripts/device_check_outcomes.py``): a test that hangs is killed, named, and the tests after it go on in a
fresh pytest process. docs/device-check.md."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from devcheck.common import OUTCOMES_PLUGIN, REPO, SCRIPTS, now, read_jsonl, write

_RANK = {"passed": 0, "skipped": 1, "failed": 2, "timeout": 2, "hang": 2, "error": 3}


def _outcomes(path: Path) -> tuple[list[str], dict[str, dict[str, Any]], Path, list[tuple[str, float]]]:
    """(collected test ids, outcome per test id, the ids' root directory, (test id, start time) in order) from the
    outcome recorder's lines."""
    collected: list[str] = []
    root = REPO
    results: dict[str, dict[str, Any]] = {}
    started: list[tuple[str, float]] = []
    for rec in read_jsonl(path):
        if "collected" in rec:
            collected, root = rec["collected"], Path(rec.get("rootdir") or REPO)
        elif "started" in rec:
            started.append((rec["started"], float(rec["t"])))
        elif rec.get("nodeid"):
            prev = results.get(rec["nodeid"])
            # the worst report of a test wins: an error in teardown after a pass is an error
            if prev is None or _RANK.get(rec["outcome"], 3) >= _RANK.get(prev["outcome"], 3):
                results[rec["nodeid"]] = rec
    return collected, results, root, started


def _same_file(nodeid: str, root: Path, planned: str) -> bool:
    """Whether a test id (relative to pytest's root directory) belongs to a planned file (relative to the
    repository, or absolute)."""
    return (root / nodeid.split("::")[0]).resolve() == (REPO / planned).resolve()


def _pytest(args: list[str], outcomes: Path, env: dict[str, str] | None, marker: str | None, keyword: str | None,
            per_test_s: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-rs", "--no-header", "-p", "no:cacheprovider",
           "-p", OUTCOMES_PLUGIN] + (["-m", marker] if marker else []) + (["-k", keyword] if keyword else [])
    if importlib.util.find_spec("pytest_timeout") is not None:  # a hung test then fails alone, named
        cmd.append(f"--timeout={max(5, int(per_test_s))}")
    child_env = dict(os.environ if env is None else env)
    child_env["KIMIK3_TEST_OUTCOMES"] = str(outcomes)
    child_env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), str(REPO), child_env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run_tests(out: Path, tests: list[dict[str, Any]], budget_s: float, env: dict[str, str] | None = None,
              marker: str | None = "gpu", keyword: str | None = None, phase: str = "tests",
              per_test_s: float | None = None) -> dict[str, Any]:
    """The planned test files in one pytest process (models and kernels loaded once), each test's outcome recorded
    as it ends. A test running past ``per_test_s`` is killed and recorded as a hang; the tests it held up run in a
    fresh pytest process. The process killed at the budget still says what ran."""
    planned = [t["file"] for t in tests if t["run"]]
    record: dict[str, Any] = {"date": now(), "budget_s": round(budget_s, 1), "results": [], "tests": {},
                              "not_planned": [t for t in tests if not t["run"]], "restarts": 0}
    # pytest-timeout (where installed) fails a slow test itself; the kill below is for one that ignores it
    per_test = per_test_s if per_test_s is not None else max(5.0, budget_s - 5)
    hang_after = per_test + 3.0 if per_test_s is not None else float("inf")
    deadline = time.time() + budget_s
    outcomes_path = Path(out) / f"{phase}.outcomes.jsonl"
    outcomes_path.unlink(missing_ok=True)
    text, code, timed_out = "", None, False
    results: dict[str, dict[str, Any]] = {}
    collected: list[str] = []
    root = REPO
    t0 = time.time()
    args = [str(REPO / f) if not Path(f).is_absolute() else f for f in planned]
    while args:
        outcomes_path.unlink(missing_ok=True)
        proc = _pytest(args, outcomes_path, env, marker, keyword, per_test)
        hung = None
        while proc.poll() is None:
            time.sleep(0.2)
            c, res, r, started = _outcomes(outcomes_path)
            current = next(((n, t) for n, t in reversed(started) if n not in res), None)
            if time.time() > deadline:
                timed_out = True
            elif current and time.time() - current[1] > hang_after:
                hung = current
            if timed_out or hung:
                os.killpg(proc.pid, signal.SIGKILL)  # the pytest process group only
                break
        out_text, _ = proc.communicate()
        text += out_text or ""
        code = proc.returncode
        c, res, r, started = _outcomes(outcomes_path)
        if c and not collected:
            collected, root = c, r
        results.update(res)
        if hung:
            results[hung[0]] = {"nodeid": hung[0], "outcome": "hang", "detail": f"no result after {hang_after:.0f} s: "
                                "killed, the tests after it run in a fresh process"}
        if not hung or timed_out:
            break
        rest = [n for n in c if n not in results]
        record["restarts"] += 1
        args = [str(r / n) for n in rest]
    for nodeid in collected:
        if nodeid not in results:
            results[nodeid] = {"nodeid": nodeid, "outcome": "timeout" if timed_out else "not run",
                               "detail": f"no result before the {budget_s:.0f} s budget ran out" if timed_out
                               else "collected but never reported"}
    record["tests"] = {k: {"outcome": v["outcome"], "detail": v.get("detail", "")[:1500],
                           "seconds": v.get("seconds")} for k, v in results.items()}
    record["rootdir"] = str(root)
    for f in planned:
        mine = [v["outcome"] for k, v in results.items() if _same_file(k, root, f)]
        counts = {o: mine.count(o) for o in sorted(set(mine))}
        summary = ", ".join(f"{n} {o}" for o, n in counts.items()) or "no tests ran"
        if timed_out and (not mine or "timeout" in counts):
            status = f"timeout after {budget_s:.0f} s"
        elif not mine:
            status = "no tests ran"
        elif set(counts) == {"passed"}:
            status = "passed"
        elif set(counts) == {"skipped"}:
            status = "all skipped"
        else:
            status = "failed"
        record["results"].append({"file": f, "status": status, "summary": summary, "returncode": code,
                                  "counts": counts})
    for t in record["not_planned"]:
        record["results"].append({"file": t["file"], "status": "not planned", "reason": t["reason"]})
    record.update(seconds=round(time.time() - t0, 1), returncode=code, timed_out=timed_out,
                  output_tail=text[-6000:])
    write(out, phase, record)
    return record


def judge_tests(rec: dict[str, Any] | None, phase: str = "tests") -> list[str]:
    """The failures of a tests phase, by name: every planned test that did not pass, every planned file that ran
    no test. Deliberately unplanned files are not failures (the plan says why)."""
    if rec is None:
        return [f"{phase}: no result file (the phase did not run)"]
    if rec.get("dry_run"):
        bad = [f"{phase}: file {f} is missing" for f in rec.get("missing_files", [])]
        return bad + ([] if rec.get("outcome_recorder") else [f"{phase}: the outcome recorder is missing"])
    failures = []
    for nodeid, r in sorted(rec.get("tests", {}).items()):
        if r["outcome"] != "passed":
            detail = f" ({r['detail'].splitlines()[0][:200]})" if r.get("detail") else ""
            failures.append(f"test {nodeid}: {r['outcome']}{detail}")
    for f in rec.get("results", []):
        if f["status"] == "no tests ran" or (f["status"].startswith("timeout") and not f.get("counts")):
            failures.append(f"tests in {f['file']}: {f['status']}")
    if rec.get("timed_out") and not failures:
        failures.append(f"{phase}: the pytest process ran past its {rec.get('budget_s')} s budget")
    if not rec.get("tests") and not any(f["status"] == "not planned" for f in rec.get("results", [])):
        failures.append(f"{phase}: no test ran")
    return failures
