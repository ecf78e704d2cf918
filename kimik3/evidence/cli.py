"""``python -m kimik3 evidence``: a dossier per unit and the page of all of them, or, with ``--since REV``, the
bounded review of a change (docs/architecture.md §13).

  python -m kimik3 evidence [--out runs/evidence] [--strict]      the pages; --strict fails on any gap
  python -m kimik3 evidence --list                                the units, their files and hashes
  python -m kimik3 evidence --since REV [--scope U,...] [--run | --dry-run]
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from kimik3.util.args import name_list, output_folder
from kimik3.util.text import refuse

__all__ = ["main", "build", "strict_problems"]


def _is_evidence(p: Path) -> bool:
    return (p / "evidence.json").is_file() and (p / "index.html").is_file()


def strict_problems(ds: list[dict], notes: list[str]) -> list[str]:
    """What ``--strict`` fails on: a unit with no test, a failing, stale or unrecorded one, and every note."""
    from kimik3.evidence.dossier import status

    out = [f"{d['unit']}: {status(d)}" for d in ds if status(d) in ("untested", "failing", "stale", "not recorded")]
    return out + notes


def build(out: Path | None = None) -> tuple[list[dict], list[str], dict]:
    """Every unit's dossier, the notes on the whole (unowned files, undocumented mutants), and the run's metadata;
    with ``out``, the pages written there."""
    from kimik3.evidence.dossier import dossiers, undocumented_mutants
    from kimik3.evidence.page import write_pages
    from kimik3.evidence.results import git_commit, read_results
    from kimik3.evidence.units import discover, unowned

    if out is not None:  # never into a folder of someone else's files
        from kimik3.util.files import check_output_folder

        check_output_folder(out, _is_evidence, False, "an earlier evidence page")
    units = discover()
    results = read_results()
    ds = dossiers(units, results)
    notes = [f"{f}: a device or stage file that belongs to no unit" for f in unowned(units)]
    notes += [f"planted mutant {m!r} is in the tests but has no row in docs/planted-bugs.md"
              for m in undocumented_mutants()]
    commit, dirty = git_commit()
    meta = {"commit": commit, "dirty": dirty, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "recorded_tests": len(results["tests"]), "units": len(units)}
    if out is not None:
        write_pages(out, ds, notes, meta)
    return ds, notes, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimik3 evidence", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/evidence", type=output_folder)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a unit is untested, failing, stale or not "
                    "recorded, a device or stage file belongs to no unit, or a planted mutant has no row")
    ap.add_argument("--list", action="store_true", help="list the units and exit")
    ap.add_argument("--since", default=None, metavar="REV", help="review the change since REV")
    ap.add_argument("--scope", default=None, type=name_list, help="the units the change declares it touches "
                    "(default: the commits' Evidence-Scope: trailers)")
    run = ap.add_mutually_exclusive_group()
    run.add_argument("--run", action="store_true", help="with --since: run the touched units' checks")
    run.add_argument("--dry-run", action="store_true", help="with --since: print the pytest command, run nothing")
    a = ap.parse_args(argv)
    try:
        if a.list:
            from kimik3.evidence.units import discover

            for u in discover():
                print(f"{u.name:28s} {u.kind:16s} {u.hash[:12]}  {' '.join(u.files)}")
            return 0
        if a.since is not None:
            return _review(a)
        out = Path(a.out)
        ds, notes, meta = build(out)
    except ValueError as e:
        return refuse("evidence", e)
    from kimik3.evidence.dossier import status

    counts: dict[str, int] = {}
    for d in ds:
        counts[status(d)] = counts.get(status(d), 0) + 1
    print(f"evidence for {len(ds)} units at commit {(meta['commit'] or 'unknown')[:10]}: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for n in notes:
        print(f"  note: {n}")
    print(f"wrote {out / 'index.html'}")
    if a.strict:
        problems = strict_problems(ds, notes)
        for p in problems:
            print(f"  strict: {p}", file=sys.stderr)
        return 1 if problems else 0
    return 0


def _review(a: argparse.Namespace) -> int:
    from kimik3.evidence.review import review, run_checks

    rv = review(a.since, list(a.scope) if a.scope else None)
    if a.dry_run:
        print(" ".join([sys.executable, "-m", "pytest", "-q", *rv.checks]) if rv.checks else "no checks to run")
    elif a.run:
        run_checks(rv)
    for line in rv.lines():
        print(line)
    return 0 if rv.ok else 1
