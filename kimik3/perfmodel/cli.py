"""``python -m kimik3 predict``: the performance model's step time for a stage, batch and design (a model, not a
measurement)."""

from __future__ import annotations

import argparse
import json
import sys

from kimik3.util.args import positive_int

__all__ = ["main"]



def main(argv: list[str] | None = None) -> int:
    from kimik3.perfmodel import CURRENT_DESIGN, EXPERT_DTYPES, STAGES, design_names, predict

    ap = argparse.ArgumentParser(prog="python -m kimik3 predict", description=__doc__)
    ap.add_argument("--preset", default="k3-shard")
    ap.add_argument("--stage", required=True, choices=STAGES)
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--design", default=CURRENT_DESIGN,
                    help=f"a design in data/perf/designs ({', '.join(design_names())}; default {CURRENT_DESIGN}: "
                         "today's kernels)")
    ap.add_argument("--experts", default="bf16", choices=EXPERT_DTYPES,
                    help="how the routed experts are stored (mxfp4: the K3 release's format); the roofline moves the "
                         "same bytes")
    ap.add_argument("--context", type=positive_int, default=4096, help="cached tokens per sequence (<= 4096)")
    ap.add_argument("--json", action="store_true", help="print the full result as JSON")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        r = predict(a.preset, a.stage, a.batch, a.design, a.context, experts=a.experts)
    except ValueError as e:
        print(f"predict: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print(f"{a.preset} {a.stage} batch {a.batch} experts {a.experts} design {r['design']} "
              "(model, not a measurement): "
              f"{r['predicted_ms']:.3f} ms vs roofline {r['roofline_ms']:.3f} ms "
              f"({100 * r['fraction_of_roofline']:.1f}% of the achievable-bandwidth roofline)")
        for op, v in sorted(r["by_opcode"].items(), key=lambda kv: -kv[1]["total_us"]):
            print(f"  {op:18s} {v['count']:5d} x {v['mean_us']:10.2f} us = {v['total_us']:12.1f} us  "
                  f"({v['limited_by']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
