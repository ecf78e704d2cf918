"""Command line: ``python -m kimik3 <command>``.

  run-notebooks   execute the notebooks headless with papermill into runs/
  export          write a preset's random weights as an HF-format checkpoint
  bench           benchmark the stages side by side (issue "first rungs")
  validate        the correctness matrix with an HTML report
  kernels build   compile the CuTe DSL kernels ahead of time (prebuilt kernels)
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _export(argv: list[str]) -> int:
    import torch

    import kimik3

    ap = argparse.ArgumentParser(prog="python -m kimik3 export", description=_export.__doc__)
    ap.add_argument("--preset", required=True, choices=kimik3.PRESET_NAMES)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--expert-format", default="bf16", choices=["bf16", "mxfp4"])
    ap.add_argument("--max-shard-mb", type=int, default=None)
    a = ap.parse_args(argv)
    model = kimik3.from_preset(a.preset, seed=a.seed, dtype=getattr(torch, a.dtype))
    shard = a.max_shard_mb * 2**20 if a.max_shard_mb else None
    path = kimik3.save_pretrained(model, a.out, expert_format=a.expert_format, max_shard_bytes=shard)
    print(f"wrote {a.preset} (seed {a.seed}, {a.dtype}, experts {a.expert_format}) to {path}")
    return 0


_export.__doc__ = "Write a preset's deterministic random weights as an HF-format safetensors checkpoint."


def _run_notebooks(argv: list[str]) -> int:
    from kimik3.notebooks import run_all

    ap = argparse.ArgumentParser(prog="python -m kimik3 run-notebooks")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--only", default="", help="comma-separated notebook number prefixes, e.g. 01,03")
    ap.add_argument("--small", action="store_true", help="the small CI parameters")
    a = ap.parse_args(argv)
    done = run_all(a.out, only=[s for s in a.only.split(",") if s] or None, ci=a.small)
    print(f"executed {len(done)} notebook(s) into {a.out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "export": _export,
        "run-notebooks": _run_notebooks,
        "bench": lambda rest: __import__("kimik3.bench", fromlist=["main"]).main(rest),
        "validate": lambda rest: __import__("kimik3.validate", fromlist=["main"]).main(rest),
        "kernels": lambda rest: __import__("kimik3.kernels.prebuilt", fromlist=["main"]).main(rest),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return int(commands[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
