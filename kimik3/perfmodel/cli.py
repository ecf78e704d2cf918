"""``python -m kimik3 predict``: the performance model's step time for a stage, batch and design (a model, not a
measurement), with its range: the same step with every uncertain constant of data/perf/constants.json (those with a
"range") at its optimistic end, then at its pessimistic end; fractions are of the same roofline as the point
(docs/architecture.md, appendix "perfmodel: one instruction's time")."""

from __future__ import annotations

import argparse
import json
import sys

from kimik3.util.args import bounded_int_list, positive_int
from kimik3.util.text import refuse

__all__ = ["main"]



def main(argv: list[str] | None = None) -> int:
    from kimik3.perfmodel import CURRENT_DESIGN, EXPERT_DTYPES, MAX_BATCH, STAGES, design_names, predict

    ap = argparse.ArgumentParser(prog="python -m kimik3 predict", description=__doc__)
    ap.add_argument("--preset", default="k3-shard")
    ap.add_argument("--stage", required=True, choices=STAGES)
    ap.add_argument("--batch", type=bounded_int_list(1, MAX_BATCH, "decode rows per step"), default=(1,),
                    help=f"decode rows per step, one or a comma-separated list (each in 1..{MAX_BATCH})")
    ap.add_argument("--design", default=CURRENT_DESIGN,
                    help=f"a design in data/perf/designs ({', '.join(design_names())}; default {CURRENT_DESIGN}: "
                         "today's kernels)")
    ap.add_argument("--experts", default=None, choices=EXPERT_DTYPES,
                    help="how the routed experts are stored (mxfp4: the K3 release's format); the roofline moves the "
                         "same bytes. Default: bf16, or mxfp4 where bf16 experts would not fit one GPU (k3-rank)")
    ap.add_argument("--context", type=positive_int, default=4096, help="cached tokens per sequence (<= 4096)")
    ap.add_argument("--measured", default=None, metavar="PATH",
                    help="score with measured constants: a device check's data/measurements/constants-<hardware>.json "
                         "laid over data/perf/constants.json (each measured value replaces the point, its spread the "
                         "range). Without it only data/perf/constants.json is used, as for the committed scores, even "
                         "when such a file exists (a note says so)")
    ap.add_argument("--json", action="store_true", help="print the full result as JSON")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        consts = None
        if a.measured is not None:
            from kimik3.perfmodel.measured import measured_constants

            consts = measured_constants(a.measured)
        else:
            from kimik3.perfmodel.data import load_constants
            from kimik3.perfmodel.measured import measured_path

            found = measured_path(load_constants().hardware)
            if found.exists():
                print(f"predict: note: {found} exists; scoring with data/perf/constants.json only "
                      f"(--measured {found} uses it)", file=sys.stderr)
        rs = [predict(a.preset, a.stage, b, a.design, a.context, constants=consts, experts=a.experts)
              for b in a.batch]
    except ValueError as e:
        return refuse("predict", e)
    if a.json:
        print(json.dumps(rs[0] if len(rs) == 1 else rs, indent=1))
        return 0
    for r in rs:
        _print(a, r)
    return 0


def _print(a: argparse.Namespace, r: dict) -> None:
    """One prediction as the command prints it (the rank and rack lines for a rank slice)."""
    lo_ms, hi_ms = r["predicted_ms_range"]
    lo_f, hi_f = r["fraction_of_roofline_range"]
    print(f"{a.preset} {a.stage} batch {r['batch']} experts {r['experts']} design {r['design']} "
          "(model, not a measurement): "
          f"{r['predicted_ms']:.3f} ms ({lo_ms:.3f}–{hi_ms:.3f}) vs roofline {r['roofline_ms']:.3f} ms: "
          f"{r['fraction_of_roofline']:.3f} ({lo_f:.3f}–{hi_f:.3f}) of the achievable-bandwidth roofline")
    corners = ", ".join(f"{k} {v['optimistic']:g}..{v['pessimistic']:g}" for k, v in r["range_constants"].items())
    print(f"  range: optimistic..pessimistic {corners or '(no ranged constants)'}")
    for k, how in r["constants_measured"].items():
        print(f"  measured {k}: {how}")
    print(f"  {len(r['constants_recalled'])} constants still datasheet / recalled (data/perf/constants.json)"
          + ("" if r["constants_measured"] else ": none measured"))
    for op, v in sorted(r["by_opcode"].items(), key=lambda kv: -kv[1]["total_us"]):
        print(f"  {op:18s} {v['count']:5d} x {v['mean_us']:10.2f} us = {v['total_us']:12.1f} us  "
              f"({v['limited_by']})")
    if "rank" in r:
        k = r["rank"]
        slo, shi = k["step_ms_range"]
        tlo, thi = k["tokens_per_s_per_sequence_range"]
        print(f"  rank {k['rank']} of {k['world']}: step with the wire {k['step_ms']:.3f} ms ({slo:.3f}–{shi:.3f}); "
              f"{k['collectives']} collectives, {k['wire_bytes_out'] / 1e6:.1f} MB out, serial wire "
              f"{k['serial_wire_ms']:.3f} ms, exposed {k['exposed_wire_ms']:.3f} ms")
        print(f"  {k['rack']} rack ({k['replicas']} replicas of {k['world']} ranks on {k['rack_gpus']} GPUs): "
              f"{k['tokens_per_s_per_sequence']:.0f} tokens/s per sequence ({tlo:.0f}–{thi:.0f}), "
              f"{k['tokens_per_s_rack']:.0f} tokens/s for the rack at batch {r['batch']} per replica; bandwidth "
              f"bound {k['bound_tokens_per_s_per_sequence']:.0f} tokens/s per sequence ({k['bound_ms']:.3f} ms)")
        for part, how in k["parts"].items():
            print(f"    {part}: {how}")


if __name__ == "__main__":
    sys.exit(main())
