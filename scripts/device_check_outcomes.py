"""pytest plugin of the device check: records every test's outcome as a JSON line the moment it is known.

Loaded with ``-p device_check_outcomes`` (``scripts/`` on ``PYTHONPATH``) into the one pytest process of the
check's tests phase; writes to ``$KIMIK3_TEST_OUTCOMES``. The collected test ids come first, so a process killed
at its budget still tells which planned tests never reported (the check counts them as timed out), and a module
skipped or broken at collection is recorded under its file's id.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

_PATH = os.environ.get("KIMIK3_TEST_OUTCOMES")


def _emit(rec: dict[str, Any]) -> None:
    if not _PATH:
        return
    with open(_PATH, "a") as f:  # one short line per write, flushed: a kill loses at most the test in flight
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()


def _detail(report: Any) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    return str(report.longrepr or "")[-1500:]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit({"nodeid": report.nodeid, "outcome": "error", "when": "collect", "detail": _detail(report)})
    elif report.skipped:
        _emit({"nodeid": report.nodeid, "outcome": "skipped", "when": "collect", "detail": _detail(report)})


def pytest_collection_finish(session: pytest.Session) -> None:
    _emit({"collected": [item.nodeid for item in session.items], "rootdir": str(session.config.rootpath)})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _emit({"started": nodeid, "t": time.time()})  # a test that never reports is then the one that hung


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        if report.passed:
            outcome = "passed"
        elif report.skipped:
            outcome = "skipped"
        else:
            outcome = "timeout" if "Timeout" in str(report.longrepr or "") else "failed"
    elif report.failed:  # setup or teardown
        outcome = "error"
    elif report.skipped:  # skipped in setup (a skip mark or a fixture that skips)
        outcome = "skipped"
    else:
        return
    _emit({"nodeid": report.nodeid, "outcome": outcome, "when": report.when, "seconds": round(report.duration, 2),
           "detail": _detail(report) if outcome != "passed" else ""})
