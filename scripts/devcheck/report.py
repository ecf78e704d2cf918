"""The device check's summary on the terminal: phases with their times, the benchmark rows beside each other, the
fused kernels against their targets, the preflight and child items, the failures by name.
docs/device-check.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devcheck.common import read


def _rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if r.get("ms_per_token"):
            pct = r.get("pct_read_bw", r.get("pct_copy_bw")) or float("nan")
            err = r.get("rel_err_vs_naive")
            print(f"  {r['stage']:10s} {r['batch']:3d} {r.get('context', 0):5d} {r['ms_per_token']:9.3f} "
                  f"{r.get('tokens_per_s') or float('nan'):9.1f} {pct:6.1f} "
                  f"{r.get('speedup_vs_naive') or float('nan'):7.2f} {'n/a' if err is None else f'{err:.2e}'}")
        else:
            print(f"  {r.get('stage', '?'):10s} {r.get('batch', 0):3d} {r.get('status')}")


def print_summary(out: Path, summary: dict[str, Any]) -> None:
    print(f"\n== device check summary{' (dry run)' if summary.get('dry_run') else ''} ==")
    for p in summary["phases"]:
        print(f"{p['phase']:16s} {p['status'][:60]:60s} {p.get('seconds', 0):7.1f} s (estimate "
              f"{p.get('estimate_s') or 0:.0f} s, budget {p.get('budget_s', 0):.0f} s)")
    pre = read(out, "preflight")
    if pre and pre.get("results"):
        print("\npreflight: variant status")
        for r in pre["results"]:
            print(f"  {r.get('variant', r.get('name')):28s} {str(r.get('status'))[:90]}")
            for n in r.get("notes", []):
                print(f"  {'':28s} note: {n[:150]}")
    bench = read(out, "bench")
    mk = read(out, "megakernel")
    if bench or mk:
        print("\nbench: stage batch context ms/token tok/s %readBW x_naive rel_err_vs_naive")
        _rows((bench or {}).get("rows", []))
        for s in (bench or {}).get("skipped", []):
            print(f"  {s['stage']:10s} {s['batch']:3d} {s['reason']}")
        for r in (mk or {}).get("results", []):
            if r.get("kind") == "bench":
                _rows([r["row"]] if r.get("status") == "ok" else [{"stage": "megakernel", "batch": r["batch"],
                                                                   "status": r.get("status")}])
    kern = read(out, "kernels")
    if kern and kern.get("kernels"):
        print("\nkernels (k3-shard): launch batch MB us GB/s %copyBW verdict")
        for k in kern["kernels"]:
            print(f"  {k['launch']:24s} {k['batch']:3d} {k['bytes'] / 1e6:9.2f} {k['seconds'] * 1e6:9.1f} "
                  f"{k['gb_per_s']:8.1f} {k['pct_copy_bw']:6.1f} {k['verdict']}")
        for m in kern.get("mxfp4_vs_bf16", []):
            print(f"  MXFP4/bf16 routed experts B={m['batch']}: time ratio {m['time_ratio_mxfp4_over_bf16']:.3f}, "
                  f"byte ratio {m['byte_ratio']:.3f}")
    mx = read(out, "megakernel_mxfp4")
    if mx and mx.get("results"):
        print("\nmegakernel, MXFP4 experts: variant status max rel err vs naive (megakernel, interpreter), "
              "megakernel vs interpreter")
        for r in mx["results"]:
            errs = [r.get(k, {}).get("max_error") if isinstance(r.get(k), dict) else None
                    for k in ("megakernel_vs_naive", "interp_vs_naive", "megakernel_vs_interp")]
            print(f"  {r['variant']:28s} {r['status'][:40]:40s} "
                  + " ".join("n/a" if e is None else f"{e:.2e}" for e in errs))
    fails = summary.get("failures") or []
    print(f"\n{len(fails)} failure(s){':' if fails else ': everything planned ran and agreed with naive'}")
    for f in fails:
        print(f"  FAILED {f}")
