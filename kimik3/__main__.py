"""Command line: ``python -m kimik3 <command>``.

  run-notebooks   execute the notebooks headless with papermill into runs/
  export          write a preset's random weights as an HF-format checkpoint
  bench           benchmark the stages side by side
  validate        the correctness matrix with an HTML report
  kernels build   compile the CuTe DSL kernels ahead of time (prebuilt kernels)
  predict         the GPU performance model's step time for fused / megakernel (a model, not a measurement)
  evidence        a dossier per unit (scope, contract, launch, numerics, validation, performance, unproven);
                  --since REV: the units a change touches and exactly their checks
"""

from __future__ import annotations

import argparse
import sys

from kimik3.util.args import name_list, output_folder, positive_int, seed_int
from kimik3.util.text import refuse

__all__ = ["main"]



def _export(argv: list[str]) -> int:
    import torch

    import kimik3
    from kimik3.model.checkpoint import is_export
    from kimik3.util.files import check_output_folder, check_writable

    ap = argparse.ArgumentParser(prog="python -m kimik3 export", description=_export.__doc__)
    ap.add_argument("--preset", required=True, choices=kimik3.PRESET_NAMES)
    ap.add_argument("--out", required=True, type=output_folder)
    ap.add_argument("--seed", type=seed_int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--expert-format", default="bf16", choices=["bf16", "mxfp4", "int4", "fp8"],
                    help="mxfp4 / int4: routed experts quantized (K3 / K2-Thinking layout); fp8: every linear weight "
                         "in 128x128-block FP8 (DeepSeek-V3 / K2 layout)")
    ap.add_argument("--max-shard-mb", type=positive_int, default=None)
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty --out that is not a kimik3 export (its files are deleted)")
    a = ap.parse_args(argv)
    from pathlib import Path

    out = Path(a.out)
    try:  # before building the model: a refused --out should cost nothing
        if kimik3.get_preset(a.preset).rank_slice:
            raise ValueError(f"preset {a.preset!r} is one rank's slice of a deployment, not a model a checkpoint "
                             "holds: export the whole model's preset")
        check_output_folder(out, is_export, a.overwrite, "a kimik3 export")
        check_writable(out.resolve().parent, is_dir=True)
        model = kimik3.from_preset(a.preset, seed=a.seed, dtype=getattr(torch, a.dtype))
        shard = a.max_shard_mb * 2**20 if a.max_shard_mb else None
        path = kimik3.save_pretrained(model, a.out, expert_format=a.expert_format, max_shard_bytes=shard,
                                      overwrite=a.overwrite)
    except ValueError as e:
        return refuse("export", e)
    print(f"wrote {a.preset} (seed {a.seed}, {a.dtype}, experts {a.expert_format}) to {path}")
    return 0


_export.__doc__ = "Write a preset's deterministic random weights as an HF-format safetensors checkpoint."


def _run_notebooks(argv: list[str]) -> int:
    from kimik3.notebook.runner import run_all

    ap = argparse.ArgumentParser(prog="python -m kimik3 run-notebooks")
    ap.add_argument("--out", default="runs", type=output_folder)
    ap.add_argument("--only", default=None, type=name_list, help="comma-separated notebook number prefixes, e.g. 01,03")
    ap.add_argument("--small", action="store_true", help="the small CI parameters")
    a = ap.parse_args(argv)
    try:
        done = run_all(a.out, only=list(a.only) if a.only else None, ci=a.small)
    except ValueError as e:
        return refuse("run-notebooks", e)
    print(f"executed {len(done)} notebook(s) into {a.out}/")
    return 0


def _kernels(argv: list[str]) -> int:
    try:
        from kimik3.kernels.toolchain.prebuilt import main as kernels_main

        return kernels_main(argv)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("cutlass", "cuda", "tvm_ffi"):
            raise
        print(f"kernels: the CuTe DSL compiler is not installed (no module {e.name!r}); building kernels needs it: "
              "pip install nvidia-cutlass-dsl==4.8.1 (a GPU machine without it runs kernels prebuilt elsewhere, "
              "see README 'GPU without a GPU at hand')", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "export": _export,
        "run-notebooks": _run_notebooks,
        "bench": lambda rest: __import__("kimik3.bench", fromlist=["main"]).main(rest),
        "validate": lambda rest: __import__("kimik3.validation.cli", fromlist=["main"]).main(rest),
        "kernels": _kernels,
        "predict": lambda rest: __import__("kimik3.perfmodel.cli", fromlist=["main"]).main(rest),
        "evidence": lambda rest: __import__("kimik3.evidence.cli", fromlist=["main"]).main(rest),
    }
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return refuse("kimik3", ValueError(f"unknown command {argv[0]!r}; the commands: {', '.join(commands)}"))
    return int(commands[argv[0]](argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
