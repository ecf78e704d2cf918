"""Every megakernel launch of the device check runs in a child process: a hard timeout per item, a progress log
per child, a hang or fault named by its item while the rest go on in a fresh child. Planted failures (hang, fault,
wrong result, refused launch, preflight mismatch) are injected here, so the dry run proves the parent names each.
docs/device-check.md."""

from __future__ import annotations

import fnmatch
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devcheck.common import CHILDREN_DIR, REPO, SCRIPTS, read_jsonl, write_json

PLANT_ENV = "KIMIK3_DEVCHECK_PLANT"  # "kind:item-glob[;kind:item-glob...]"
PLANT_KINDS = ("hang", "fault", "wrong", "refuse", "preflight")
_POLL_S = 0.1


class LaunchRefused(RuntimeError):
    """The driver refused the launch (too many resources, a cooperative grid too large): nothing ran."""


def parse_plants(text: str | None) -> list[tuple[str, str]]:
    """``kind:glob`` pairs separated by ``;`` (an item's name matched with fnmatch); a bad kind is an error."""
    plants = []
    for part in (text or "").split(";"):
        part = part.strip()
        if not part:
            continue
        kind, sep, glob = part.partition(":")
        if not sep or kind not in PLANT_KINDS or not glob:
            raise ValueError(f"bad planted failure {part!r}: expected KIND:ITEM-GLOB with KIND one of {PLANT_KINDS}")
        plants.append((kind, glob))
    return plants


def planted(name: str, plants: Sequence[tuple[str, str]]) -> str | None:
    """The planted failure for item ``name`` (the first match), or None."""
    return next((kind for kind, glob in plants if fnmatch.fnmatchcase(name, glob)), None)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's process group only
    except ProcessLookupError:
        pass
    proc.wait()


def run_items(out: Path, job: str, items: Sequence[dict[str, Any]], *, context: dict[str, Any], deadline: float,
              item_timeout_s: float, startup_s: float, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``items`` (each with a unique ``name``) of child job ``job`` (``devcheck.jobs.JOBS``) in child
    processes, in order, until done or ``deadline``: one record per item, ``status`` "ok", or what went wrong
    by name — "hang: ..." (killed after ``item_timeout_s``), "fault: ..." (the child died), "refused: ...",
    "error: ...", "skipped: ...". After a hang or fault the remaining items go on in a fresh child."""
    pending = list(items)
    records: dict[str, dict[str, Any]] = {}
    children = Path(out) / CHILDREN_DIR
    children.mkdir(parents=True, exist_ok=True)
    attempt = 0
    while pending:
        left = deadline - time.time()
        if left < 1.0:
            for it in pending:
                records[it["name"]] = {**it, "status": f"skipped: the phase's budget ran out ({left:.0f} s left)"}
            break
        attempt += 1
        spec, log, err = (children / f"{job}.{attempt}.{s}" for s in ("spec.json", "log.jsonl", "stderr.txt"))
        for f in (log, err):
            f.unlink(missing_ok=True)
        write_json(spec, {"job": job, "items": pending, "context": context})
        child_env = dict(os.environ if env is None else env)
        child_env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), str(REPO), child_env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
        with open(err, "w") as ferr:
            proc = subprocess.Popen([sys.executable, "-m", "devcheck.child", str(spec), str(log)], cwd=REPO,
                                    env=child_env, stdout=ferr, stderr=subprocess.STDOUT, start_new_session=True)
        t_spawn = time.time()
        killed: str | None = None
        while proc.poll() is None:
            time.sleep(_POLL_S)
            events = read_jsonl(log)
            started = [e for e in events if e.get("event") == "start"]
            finished = {e["item"] for e in events if e.get("event") == "done"}
            current = started[-1] if started and started[-1]["item"] not in finished else None
            t = time.time()
            if t > deadline:
                killed = "budget"
            elif current is not None and t - current["t"] > item_timeout_s:
                killed = "hang"
            elif current is None and not started and t - t_spawn > startup_s:
                killed = "startup"
            if killed:
                _kill(proc)
                break
        events = read_jsonl(log)
        done = {e["item"]: e["record"] for e in events if e.get("event") == "done"}
        started_names = [e["item"] for e in events if e.get("event") == "start"]
        in_flight = next((n for n in reversed(started_names) if n not in done), None)
        for it in pending:
            if it["name"] in done:
                records[it["name"]] = {**it, **done[it["name"]]}
        rest = [it for it in pending if it["name"] not in done]
        if in_flight is not None:
            it = next(i for i in rest if i["name"] == in_flight)
            seconds = round(time.time() - next(e["t"] for e in events if e.get("item") == in_flight), 1)
            if killed == "hang":
                status = f"hang: no result after {seconds:.0f} s (limit {item_timeout_s:.0f} s), child killed"
            elif killed == "budget":
                status = f"hang: still running when the phase's budget ran out ({seconds:.0f} s), child killed"
            elif proc.returncode is not None and proc.returncode < 0:
                status = f"fault: the child died by {_signal_name(proc.returncode)} during this item"
            else:
                status = f"fault: the child exited with status {proc.returncode} during this item"
            records[in_flight] = {**it, "status": status, "child_output_tail": _tail(err)}
            rest = [i for i in rest if i["name"] != in_flight]
        elif rest and killed == "startup":
            for i in rest:
                records[i["name"]] = {**i, "status": f"fault: the child did not start an item within {startup_s:.0f} s",
                                      "child_output_tail": _tail(err)}
            rest = []
        elif rest and any(e.get("event") == "abandon" for e in events):
            pass  # the child gave up a poisoned CUDA context after its item: the rest go on in a fresh child
        elif rest and killed is None:  # the child ended between items without saying why
            for i in rest:
                records[i["name"]] = {**i, "status": f"fault: the child exited with status {proc.returncode} before "
                                      "this item started", "child_output_tail": _tail(err)}
            rest = []
        pending = rest
    return [records[it["name"]] for it in items if it["name"] in records]

