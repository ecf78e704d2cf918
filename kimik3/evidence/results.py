"""The results file ``make test`` writes (docs/architecture.md §13): every test's last outcome, with the commit,
date and unit source hashes of the run it came from, merged run after run (a partial run keeps the others' last
results). Written by the pytest hooks in tests/conftest.py; read by the dossiers and the bounded review.

``runs/test-results.json``: ``{"schema": 1, "runs": {id: {commit, dirty, date, unit_hashes}}, "tests": {nodeid:
{outcome, duration_s, run}}}``; written atomically under a lock, so two test runs at once lose nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kimik3.evidence.units import ROOT, discover

__all__ = ["RESULTS", "Recorder", "read_results", "git_commit"]

RESULTS = ROOT / "runs" / "test-results.json"
SCHEMA = 1


def git_commit(root: Path = ROOT) -> tuple[str | None, bool]:
    """(HEAD's commit, whether the tree has uncommitted changes); (None, True) outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=30, check=True).stdout.strip())
        return head, dirty
    except (OSError, subprocess.SubprocessError):
        return None, True


def read_results(path: Path = RESULTS) -> dict[str, Any]:
    """The results file, or an empty one when there is none; a malformed file is a ``ValueError`` naming it."""
    if not path.is_file():
        return {"schema": SCHEMA, "runs": {}, "tests": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable results file ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("tests"), dict) \
            or not isinstance(data.get("runs"), dict):
        raise ValueError(f"{path}: not a results file of schema {SCHEMA}")
    return data


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Recorder:
    """Collects a test run's outcomes (``add``) and merges them into the results file (``write``)."""

    def __init__(self, path: Path = RESULTS) -> None:
        self.path = path
        commit, dirty = git_commit()
        self.run_id = f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.run = {"commit": commit, "dirty": dirty, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "unit_hashes": {u.name: u.hash for u in discover()}}
        self.tests: dict[str, dict[str, Any]] = {}
        self.t0 = time.time()

    def add(self, nodeid: str, when: str, outcome: str, duration: float) -> None:
        """One phase's report: the call's outcome, or a setup / teardown that failed or skipped."""
        if when == "call" or (outcome in ("failed", "skipped") and nodeid not in self.tests):
            if when != "call" and outcome == "failed":
                outcome = "error"
            self.tests[nodeid] = {"outcome": outcome, "duration_s": round(duration, 3), "run": self.run_id}

    def write(self) -> None:
        if not self.tests:
            return
        with _locked(self.path):
            try:
                data = read_results(self.path)
            except ValueError:  # a damaged file is replaced, not merged into
                data = read_results(self.path.with_name("missing.json"))
            data["tests"].update(self.tests)
            data["runs"][self.run_id] = self.run
            used = {t["run"] for t in data["tests"].values()}
            data["runs"] = {k: v for k, v in data["runs"].items() if k in used}
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
            os.replace(tmp, self.path)
