"""One unit's dossier, in the anchors' shape (docs/architecture.md §13): Scope, Contract, Launch, Numerics,
Validation, Performance, Unproven — every entry read from the code, the recorded compile reports and scores in
``data/``, ``docs/planted-bugs.md`` and the results file ``make test`` writes; nothing typed in by hand.

:func:`dossier` builds the data of one unit, :func:`status` its verdict at a glance, :func:`to_markdown` the page.
"""

from __future__ import annotations

import ast
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from kimik3.evidence.coverage import covering_tests, mutant_ids_in_tests, mutants, unit_of_module
from kimik3.evidence.units import ROOT, Unit

__all__ = ["dossier", "dossiers", "status", "to_markdown", "SECTIONS", "short", "undocumented_mutants"]

SECTIONS = ("Scope", "Contract", "Launch", "Numerics", "Validation", "Performance", "Unproven")
_GPU_KINDS = ("fused kernel", "probe kernel", "megakernel VM", "opcode family")
_GPU_STAGES = ("stage/fused", "stage/megakernel", "stage/graphs", "stage/compiled")


# ----------------------------------------------------------------------------------------------- contract
def _signature(fn: ast.FunctionDef) -> str:
    args = [a.arg + (f": {ast.unparse(a.annotation)}" if a.annotation is not None else "") for a in fn.args.args]
    return f"{fn.name}({', '.join(args)})"


def _kernel_signatures(path: Path) -> list[str]:
    """The ``@cute.kernel`` functions of a device module (their tensor parameters are the kernel's contract)."""
    tree = ast.parse(path.read_text())
    return [_signature(n) for n in tree.body if isinstance(n, ast.FunctionDef)
            and any(ast.unparse(d).endswith("kernel") for d in n.decorator_list)]


@lru_cache(maxsize=1)
def _sample_program() -> Any:
    from kimik3.megakernel.scheduler import build_program

    return build_program("tiny", 2, 8, max_seq_len=64)


def _opcode_operands(opcodes: tuple[str, ...]) -> dict[str, dict[str, list[str]]]:
    """Per opcode, the buffers (layer numbers folded to ℓ) its instructions read and write in the ``tiny`` program
    at batch 2: the operand declarations the hazard checker and address replay hold the device code to."""
    p = _sample_program()
    out: dict[str, dict[str, set[str]]] = {op: {"reads": set(), "writes": set()} for op in opcodes}
    for ins in p.instructions:
        if ins.op.name not in out:
            continue
        for o in ins.operands:
            name = re.sub(r"\.\d+\.", ".ℓ.", re.sub(r"L\d+", "Lℓ", p.buffers[o.buf].name))
            if o.reads:
                out[ins.op.name]["reads"].add(name)
            if o.writes:
                out[ins.op.name]["writes"].add(name)
    return {op: {k: sorted(v) for k, v in d.items()} for op, d in out.items()}


def _all_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets):
            return [e.value for e in n.value.elts if isinstance(e, ast.Constant)]
    return []


def _c_abi(path: Path) -> list[str]:
    text = path.read_text()
    body = text[text.find('extern "C" {'):]
    return re.findall(r"^[a-z][\w\s\*]*\b(mk_\w+\([^)]*\))", body, re.M)


def _contract(u: Unit) -> dict[str, Any]:
    first = ROOT / u.files[0]
    if u.kind in ("fused kernel", "probe kernel"):
        return {"kernels": _kernel_signatures(first), "source": u.files[0]}
    if u.kind == "megakernel VM":
        return {"kernels": _kernel_signatures(first), "source": u.files[0],
                "program": "the int32 instruction stream of kernels/contracts/isa.py (header, queues, words)"}
    if u.kind == "opcode family":
        return {"opcodes": _opcode_operands(u.opcodes), "source": "operand declarations of the tiny program, "
                "batch 2 (kimik3/megakernel/step.py), which the hazard checker and address replay hold the device "
                "code to"}
    if u.kind == "CPU executor":
        return {"c_abi": _c_abi(first), "source": u.files[0]}
    if u.kind == "stage":
        return {"interface": ["prefill(input_ids [B, T] int, lengths [B]) -> fp32 logits [B, V]",
                              "step(ids [B] int, positions [B]) -> fp32 logits [B, V]", "reset()"],
                "source": "kimik3/stages/base.py (Stage)"}
    return {"exports": [n for f in u.files if f.endswith(".py") for n in _all_names(ROOT / f)]}


# ----------------------------------------------------------------------------------------------- launch
@lru_cache(maxsize=1)
def _design() -> dict[str, Any]:
    from kimik3.perfmodel.data import CURRENT_DESIGN

    path = ROOT / "data" / "perf" / "designs" / f"{CURRENT_DESIGN}.json"
    return {"name": CURRENT_DESIGN, "path": path.relative_to(ROOT).as_posix(), **json.loads(path.read_text())}


def _launch(u: Unit) -> dict[str, Any]:
    d = _design()
    src = f"{d['path']} (compile reports: ptxas for sm_90a, k3-shard)"
    if u.kind in ("megakernel VM", "opcode family"):
        mk = d["megakernel"]
        return {"grid": "one CTA per SM, persistent cooperative launch", "threads": mk["threads"]["value"],
                "registers_by_batch": mk["registers"]["value"], "shared_bytes_by_batch": mk["shared_bytes"]["value"],
                "registers_mxfp4_by_batch": mk.get("registers_mxfp4", {}).get("value"), "source": src}
    if u.kind == "fused kernel":
        op = u.op or ""
        fams = {k: v for k, v in d["fused"]["families"].items() if k.split(".")[0] == op or k == op}
        return {"families": {k: [{"kernel": x["name"], "threads": x.get("threads"), "ctas": x.get("ctas"),
                                  "registers_by_batch": x.get("registers")} for x in v.get("kernels", [])]
                             for k, v in fams.items()}, "source": src} if fams else \
            {"note": f"{d['path']} records no compile report for this op"}
    if u.kind == "probe kernel":
        return {"note": "built with the device check's targets (kernels/toolchain/targets.py); its launch is the "
                        "probe's own (kernels/probes/)"}
    if u.name in ("megakernel/cpu-executor", "stage/megakernel-cpu"):
        return {"workers": "one native thread per core this process may use, pinned; counters are C++ atomics"}
    return {"note": "host code: no launch of its own"}


# ----------------------------------------------------------------------------------------------- numerics
def _numerics(u: Unit) -> dict[str, Any]:
    from kimik3.validation.metric import TOL

    if u.kind == "fused kernel":
        return {"reference": list(u.reference) or ["kernels/reference/"], "tolerance": {
            "kernel_bf16": TOL["kernel_bf16"], "kernel_state_fp32": TOL["kernel_state_fp32"]},
            "metric": "e(a, b) = ‖a − b‖₂ / ‖b‖₂ (docs/validation.md)"}
    if u.kind in ("opcode family", "megakernel VM"):
        return {"reference": list(u.reference), "tolerance": "host execution: the interpreter's opcode on the same "
                "inputs (bit-exact where the order of sums is the same, else kernel_bf16 = "
                f"{TOL['kernel_bf16']}); whole steps: bf16_stage = {TOL['bf16_stage']} against fp32 naive"}
    if u.kind in ("stage", "CPU executor"):
        return {"reference": list(u.reference) or ["kimik3/stages/naive.py"],
                "tolerance": {"fp32_stage": TOL["fp32_stage"], "bf16_stage": TOL["bf16_stage"]},
                "also": "identical greedy tokens in fp32; the naive model against transformers and the released "
                        f"K3 code's golden logits (fp32_oracle = {TOL['fp32_oracle']})"}
    if u.kind == "probe kernel":
        return {"reference": "none: a probe measures a constant; its result is a number with its spread"}
    return {"reference": "none: definitions read by host and device alike (one source of truth)"}


# ----------------------------------------------------------------------------------------------- validation
def _last(results: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The tests of one module (node ids under ``prefix``) in the results file: counts by outcome and when."""
    tests = {k: v for k, v in results.get("tests", {}).items() if k.split("::")[0] == prefix}
    if not tests:
        return {"recorded": False}
    by: dict[str, int] = {}
    for v in tests.values():
        by[v["outcome"]] = by.get(v["outcome"], 0) + 1
    runs = [results["runs"].get(v["run"], {}) for v in tests.values()]
    newest = max(runs, key=lambda r: r.get("date", ""))
    failed = sorted(k for k, v in tests.items() if v["outcome"] in ("failed", "error"))
    return {"recorded": True, "outcomes": by, "failed": failed[:10], "commit": newest.get("commit"),
            "dirty": newest.get("dirty"), "date": newest.get("date"), "_runs": runs}


def _validation(u: Unit, units: list[Unit], results: dict[str, Any]) -> dict[str, Any]:
    tests = []
    fresh_hashes = set()
    for path, how in covering_tests(u).items():
        last = _last(results, path)
        runs = last.pop("_runs", [])
        fresh_hashes |= {r.get("unit_hashes", {}).get(u.name) for r in runs}
        tests.append({"test": path, "how": how, **last})
    rows = [m for m in mutants() if m.module and u.name in unit_of_module(m.module, units)]
    muts = []
    for m in rows:
        node = m.test if m.test.startswith("tests/") else None
        rec = results.get("tests", {}).get(node) if node else None
        muts.append({"bug": m.bug, "mutant": m.mutant, "check": m.check, "test": m.test,
                     "last": rec["outcome"] if rec else "not recorded"})
    stale = bool(fresh_hashes) and u.hash not in fresh_hashes
    return {"tests": tests, "mutants": muts, "stale": stale, "source_hash": u.hash}


# ----------------------------------------------------------------------------------------------- performance
@lru_cache(maxsize=1)
def _scores() -> list[dict[str, Any]]:
    from kimik3.perfmodel.data import CURRENT_DESIGN

    return json.loads((ROOT / "data" / "perf" / f"scores-{CURRENT_DESIGN}.json").read_text())["results"]


@lru_cache(maxsize=1)
def _measurements() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for p in sorted((ROOT / "data" / "measurements").glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for r in d.get("records", []) if isinstance(d, dict) else []:
            out.append((p.relative_to(ROOT).as_posix(), {**r, "_commit": d.get("commit"), "_date": d.get("date"),
                                                         "_device": d.get("device_name") or d.get("host_cpu")}))
    return out


def _performance(u: Unit) -> dict[str, Any]:
    model, measured = [], []
    if u.kind == "opcode family":
        for s in _scores():
            if s.get("stage") != "megakernel":
                continue
            for op in u.opcodes:
                v = s.get("by_opcode", {}).get(op)
                if v:
                    model.append({"opcode": op, "batch": s["batch"], "experts": s.get("experts"), **v})
    stage = u.name.split("/", 1)[1] if u.kind == "stage" else ("megakernel-cpu" if u.kind == "CPU executor" else
                                                                 None)
    if u.kind in ("megakernel VM", "stage") and stage != "megakernel-cpu":
        for s in _scores():
            if s.get("stage") == (stage or "megakernel"):
                model.append({k: s.get(k) for k in ("preset", "batch", "experts", "predicted_ms", "roofline_ms",
                                                    "fraction_of_roofline", "label")})
    if stage:
        for path, r in _measurements():
            if r.get("stage") == stage and r.get("status", "ok") == "ok":
                measured.append({"file": path, "batch": r.get("batch"), "ms_per_token": r.get("ms_per_token"),
                                 "ms_min": r.get("ms_min"), "ms_max": r.get("ms_max"),
                                 "pct_read_bw": r.get("pct_read_bw"), "device": r.get("device"),
                                 "commit": r.get("_commit"), "date": r.get("_date")})
    return {"model": model, "model_source": "data/perf/scores-*.json (the performance model, not a measurement)",
            "measured": measured}


# ----------------------------------------------------------------------------------------------- unproven
# the index's short label of each kind of unproven entry (by the entry's first words)
SHORT = {"no test reaches": "no test", "no recorded result": "not recorded", "its source changed": "stale",
         "never run on a GPU": "no GPU run", "no modelled time": "not modelled"}


def short(item: str) -> str:
    """The short label of one Unproven entry."""
    return next((v for k, v in SHORT.items() if item.startswith(k)), item[:40])


def _unproven(u: Unit, val: dict[str, Any], perf: dict[str, Any]) -> list[str]:
    out = []
    if not val["tests"]:
        out.append("no test reaches this unit (no test imports, mutates, compiles or runs it)")
    elif not any(t.get("recorded") for t in val["tests"]):
        out.append("no recorded result: run `make test` (it writes runs/test-results.json)")
    if val["stale"]:
        out.append("its source changed since its tests last ran (stale evidence)")
    if u.kind in _GPU_KINDS or u.name in _GPU_STAGES:
        gpu = [m for m in perf["measured"] if m.get("device") == "cuda"]
        if not gpu:
            out.append("never run on a GPU: its device numerics, its timing and every hazard only real concurrency "
                       "shows are proven on the CPU only (host execution, address replay, PTX / SASS lint)")
    if u.kind == "opcode family" and not perf["model"]:
        out.append("no modelled time: the design does not score these opcodes")
    return out


# ----------------------------------------------------------------------------------------------- the dossier
def dossier(u: Unit, units: list[Unit], results: dict[str, Any]) -> dict[str, Any]:
    """Every section of ``u``'s dossier, as data."""
    from kimik3.kernels.toolchain.source import kernel_source_hash
    from kimik3.scope.gates import GATES

    gate = GATES[u.gate].describe() if u.gate else None
    val = _validation(u, units, results)
    perf = _performance(u)
    return {
        "unit": u.name, "kind": u.kind, "about": u.about,
        "Scope": {"files": [{"path": f, "lines": len((ROOT / f).read_text(errors="replace").splitlines())}
                            for f in u.files], "source_hash": u.hash,
                  "prebuilt_hash": kernel_source_hash(u.op) if u.op else None, "gate": u.gate, "gate_spec": gate},
        "Contract": _contract(u), "Launch": _launch(u), "Numerics": _numerics(u), "Validation": val,
        "Performance": perf, "Unproven": _unproven(u, val, perf),
    }


def dossiers(units: list[Unit], results: dict[str, Any]) -> list[dict[str, Any]]:
    return [dossier(u, units, results) for u in units]


def status(d: dict[str, Any]) -> str:
    """At a glance: "failing", "untested", "stale", "not recorded", "CPU-proven, GPU-unproven", "proven"."""
    v = d["Validation"]
    if any(t.get("outcomes", {}).get("failed") or t.get("outcomes", {}).get("error") for t in v["tests"]):
        return "failing"
    if not v["tests"]:
        return "untested"
    if v["stale"]:
        return "stale"
    if not any(t.get("recorded") for t in v["tests"]):
        return "not recorded"
    if d["Unproven"]:
        return "CPU-proven, GPU-unproven" if any("GPU" in x for x in d["Unproven"]) else "unproven"
    return "proven"


def undocumented_mutants() -> list[str]:
    """Mutant ids the host-execution tests plant that docs/planted-bugs.md has no row for (a deleted row)."""
    doc = (ROOT / "docs" / "planted-bugs.md").read_text()
    return sorted(mutant_ids_in_tests() - set(re.findall(r"\[([a-z0-9-]+)\]`", doc)))


def _md_value(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, ensure_ascii=False) + "`"
    return str(v)


def to_markdown(d: dict[str, Any]) -> str:
    """The dossier as one Markdown page, its sections in the anchors' order."""
    lines = [f"# {d['unit']} — {d['kind']}", "", d["about"], "", f"**Status:** {status(d)}", ""]
    for sec in SECTIONS:
        lines += [f"## {sec}", ""]
        body = d[sec]
        if sec == "Validation":
            lines += ["| test module | how | last outcomes | commit | date |", "|---|---|---|---|---|"]
            for t in body["tests"]:
                lines.append(f"| `{t['test']}` | {t['how']} | {_md_value(t.get('outcomes', 'not recorded'))} | "
                             f"{(t.get('commit') or '—')[:10]} | {t.get('date') or '—'} |")
            if not body["tests"]:
                lines.append("| — | no test reaches this unit | | | |")
            lines += ["", f"Planted mutants ({len(body['mutants'])}):", ""]
            lines += [f"- {m['bug']}: {m['mutant']} — caught by {m['check']} (`{m['test']}`, last: {m['last']})"
                      for m in body["mutants"]] or ["- none planted in this unit's files"]
            lines += ["", f"Stale: {body['stale']} (source hash {body['source_hash'][:16]})"]
        elif sec == "Unproven":
            lines += [f"- {x}" for x in body] or ["- nothing: every check this unit has ran green on its current "
                                                  "source"]
        elif isinstance(body, dict):
            lines += [f"- **{k}**: {_md_value(v)}" for k, v in body.items()]
        else:
            lines.append(_md_value(body))
        lines.append("")
    return "\n".join(lines)
