"""A child process of the device check: ``python -m devcheck.child SPEC LOG`` runs one job's items in order,
writing a JSON line to LOG when each starts and when it ends, so the parent can name a hang or a fault by item
(``devcheck.isolate``). A CUDA error that poisons the context ends the child after its item: the rest go on in a
fresh one. docs/device-check.md."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from devcheck.isolate import PLANT_ENV, LaunchRefused, parse_plants, planted

# text of errors after which the CUDA context cannot be trusted (the driver's "sticky" errors)
_POISONED = ("illegal memory access", "illegal address", "unspecified launch failure", "misaligned address",
             "illegal instruction", "hardware stack error", "an illegal", "CUDA_ERROR_ILLEGAL")
# text of errors that mean the launch was refused before anything ran
_REFUSED = ("too many resources", "out of resources", "cooperative launch too large", "COOPERATIVE_LAUNCH_TOO_LARGE",
            "invalid configuration argument", "LAUNCH_OUT_OF_RESOURCES", "too large")


def classify(e: BaseException) -> tuple[str, bool]:
    """(status, the context is poisoned) for an exception an item raised."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, LaunchRefused) or any(s.lower() in text.lower() for s in _REFUSED):
        return f"refused: {text}"[:2000], False
    if any(s.lower() in text.lower() for s in _POISONED):
        return f"fault: {text}"[:2000], True
    return f"error: {text}"[:2000], False


def _watchdog(e: BaseException) -> dict[str, Any] | None:
    """The megakernel watchdog's report of the wait that gave up, when the error is one."""
    keys = ("code", "instruction", "counter", "target", "seen", "cta", "sm", "step")
    if type(e).__name__ != "MegakernelError" or not all(hasattr(e, k) for k in keys):
        return None
    return {k: int(getattr(e, k)) for k in keys} | {"message": str(e)}


def main(argv: list[str]) -> int:
    from devcheck.jobs import JOBS

    spec_path, log_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    plants = parse_plants(os.environ.get(PLANT_ENV))
    log = open(log_path, "a")

    def emit(event: dict[str, Any]) -> None:
        log.write(json.dumps(event, default=str) + "\n")
        log.flush()
        os.fsync(log.fileno())

    job = JOBS[spec["job"]]
    try:
        state = job.setup(spec["context"])
    except Exception as e:  # every item gets the reason; nothing ran
        tb = traceback.format_exc()[-1500:]
        for it in spec["items"]:
            emit({"event": "start", "item": it["name"], "t": time.time()})
            emit({"event": "done", "item": it["name"], "record": {
                "status": f"error: set-up of job {spec['job']!r} failed: {type(e).__name__}: {e}"[:2000],
                "traceback": tb}})
        return 0
    for it in spec["items"]:
        emit({"event": "start", "item": it["name"], "t": time.time()})
        kind = planted(it["name"], plants)
        t0 = time.time()
        if kind == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a spinning kernel would: only SIGKILL ends it
            while True:
                time.sleep(1)
        if kind == "fault":
            sys.stderr.write(f"planted fault in {it['name']}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSEGV)
        poisoned = False
        try:
            if kind == "refuse":
                raise LaunchRefused("planted: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE (the grid cannot be co-resident)")
            rec = dict(job.run(state, it, kind))
            rec.setdefault("status", "ok")
        except Exception as e:  # each item's own verdict; the others still run
            status, poisoned = classify(e)
            rec = {"status": status, "traceback": traceback.format_exc()[-1500:]}
            if (w := _watchdog(e)) is not None:
                rec["status"] = f"watchdog: {e}"[:2000]
                rec["watchdog"] = w
        rec["seconds"] = round(time.time() - t0, 2)
        if kind:
            rec["planted"] = kind
        emit({"event": "done", "item": it["name"], "record": rec})
        if poisoned:
            emit({"event": "abandon", "reason": rec["status"]})
            return 70
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
