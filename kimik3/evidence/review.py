"""A bounded review of a change (docs/architecture.md §13): which units a diff touches, whose evidence it leaves
stale, exactly the checks that cover them, and a verdict that flags a change reaching past the scope it declares.

The diff is ``git diff REV`` (committed and uncommitted changes) plus untracked files; the declared scope is the
``--scope`` argument or the ``Evidence-Scope:`` trailers of the commits after REV (unit names, comma-separated;
``room/*`` takes a room).
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimik3.evidence.coverage import covering_tests
from kimik3.evidence.results import read_results
from kimik3.evidence.units import ROOT, Unit, discover

__all__ = ["Review", "review", "changed_files", "declared_scope", "TRAILER"]

TRAILER = "Evidence-Scope"


def _git(*args: str, root: Path = ROOT) -> str:
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"git {' '.join(args)}: {e}") from None
    if r.returncode:
        raise ValueError(f"git {' '.join(args)}: {r.stderr.strip() or 'failed'}")
    return r.stdout


def changed_files(rev: str, root: Path = ROOT) -> list[str]:
    """Files that differ from ``rev`` (committed after it or not yet committed), and untracked files."""
    if not rev or rev.startswith("-"):
        raise ValueError(f"--since needs a revision, got {rev!r}")
    try:
        _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", root=root)
    except ValueError:
        raise ValueError(f"--since {rev!r} is not a revision of the repository at {root}") from None
    files = set(_git("diff", "--name-only", rev, "--", root=root).split())
    files |= set(_git("ls-files", "--others", "--exclude-standard", root=root).split())
    return sorted(files)


def declared_scope(rev: str, root: Path = ROOT) -> list[str]:
    """The ``Evidence-Scope:`` trailers of the commits after ``rev`` (empty when none declares one)."""
    out: list[str] = []
    for line in _git("log", "--format=%B", f"{rev}..HEAD", root=root).splitlines():
        if line.lower().startswith(TRAILER.lower() + ":"):
            out += [s.strip() for s in line.split(":", 1)[1].split(",") if s.strip()]
    return out


@dataclass
class Review:
    """What a change touches and what stands behind it."""

    since: str
    files: list[str]
    touched: dict[str, list[str]]  # unit -> its changed files
    outside_units: list[str]  # changed files no unit owns (docs, tests, tooling)
    scope: list[str]
    outside_scope: list[str]
    stale: list[str]
    checks: list[str]  # test modules, the union of the touched units' covering tests
    result: str = "not run"
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.outside_scope and self.result in ("not run", "passed")

    def lines(self) -> list[str]:
        out = [f"change since {self.since}: {len(self.files)} file(s), {len(self.touched)} unit(s) touched"]
        out += [f"  {u}: {', '.join(fs)}" for u, fs in sorted(self.touched.items())]
        if self.outside_units:
            out.append(f"  outside every unit: {', '.join(self.outside_units)}")
        out.append(f"declared scope: {', '.join(self.scope) if self.scope else 'none declared'}")
        if self.outside_scope:
            out.append(f"FLAGGED: the change touches units outside its declared scope: {', '.join(self.outside_scope)}")
        out.append(f"stale evidence (source changed since its tests last ran): {', '.join(self.stale) or 'none'}")
        out.append(f"checks ({len(self.checks)}): {' '.join(self.checks) or 'none'}")
        out.append(f"verdict: {'ok' if self.ok else 'flagged'}; checks {self.result}")
        return out


def _in_scope(unit: str, scope: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(unit, s) for s in scope)


def review(since: str, scope: list[str] | None = None, units: list[Unit] | None = None) -> Review:
    """The review of the change since ``since`` (see the module docstring); runs nothing."""
    units = units or discover()
    files = changed_files(since)
    touched: dict[str, list[str]] = {}
    outside = []
    for f in files:
        owners = [u.name for u in units if f in u.files]
        for o in owners:
            touched.setdefault(o, []).append(f)
        if not owners:
            outside.append(f)
    declared = list(scope) if scope else declared_scope(since)
    known = {u.name for u in units}
    bad = [s for s in declared if not any(fnmatch.fnmatchcase(n, s) for n in known)]
    if bad:
        raise ValueError(f"declared scope names no unit: {', '.join(bad)} (units: python -m kimik3 evidence --list)")
    out_of_scope = sorted(u for u in touched if declared and not _in_scope(u, declared))
    results = read_results()
    stale = []
    checks: set[str] = set()
    by_name = {u.name: u for u in units}
    for name in touched:
        u = by_name[name]
        cov = covering_tests(u)
        checks |= set(cov)
        ran = {results["runs"].get(t["run"], {}).get("unit_hashes", {}).get(name)
               for k, t in results["tests"].items() if k.split("::")[0] in cov}
        if ran and u.hash not in ran:
            stale.append(name)
    return Review(since, files, touched, outside, declared, out_of_scope, sorted(stale), sorted(checks))


def run_checks(rv: Review, extra: list[str] | None = None) -> Review:
    """Run exactly ``rv.checks`` with pytest (the results file records them); sets ``rv.result``."""
    if not rv.checks:
        rv.result = "passed"  # nothing to run: no touched unit has a covering test
        rv.details["note"] = "no checks cover the touched units"
        return rv
    cmd = [sys.executable, "-m", "pytest", "-q", *rv.checks, *(extra or [])]
    r = subprocess.run(cmd, cwd=ROOT)
    rv.result = "passed" if r.returncode == 0 else f"failed (pytest exit {r.returncode})"
    rv.details["command"] = cmd
    return rv
