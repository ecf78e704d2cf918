"""What a design file (``data/perf/designs/*.json``) may hold, checked when it is read: every field the model reads is
present, of its type and in its range, every opcode is one of the ISA's, every expression parses and a constant one
is a finite number of the right sign — so a malformed design is one ``ValueError`` naming the file and the field,
never a ``KeyError``, a division by zero or a silent prediction from nonsense. Map: docs/architecture.md (appendix
"perfmodel: one instruction's time").
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from kimik3.kernels.contracts.isa import Op
from kimik3.perfmodel.expr import check, constant

__all__ = ["check_design"]

SHARED_PER_SM = 232_448  # bytes of shared memory an sm_90 SM offers one CTA at most
_TOP = {"name", "about", "expert_formats", "megakernel", "fused"}
_MK_INTS = {"threads": (1, 1024), "ctas_per_sm": (1, 32), "stage_bytes": (1, SHARED_PER_SM), "stage_buffers": (1, 8)}
_MK_EXPRS = ("fetch_round_trips_hbm", "fetch_round_trips_l2", "wait_round_trips_l2", "signal_round_trips_l2",
             "barriers")
_MK_TABLES = {"registers": (1, 255), "registers_mxfp4": (1, 255), "shared_bytes": (0, SHARED_PER_SM)}
_MK_KEYS = {*_MK_INTS, *_MK_EXPRS, *_MK_TABLES, "prefetch_ahead", "stage_wait", "stage_choice", "tiling", "opcodes"}
_OPCODE_KEYS = {"how", "streams", "rereads", "serial", "fmas", "issue_per_fma", "barriers"}
_FAMILY_KEYS = {"how", "kernels", "registers_by_variant", "rereads", "issue_per_fma", "kernels_per_op"}
_KERNEL_KEYS = {"name", "share", "threads", "loads", "load_bytes", "ctas", "registers", "registers_mxfp4", "serial",
                "how"}
_LEVELS = ("hbm", "l2", "l1", "none")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


class _Where:
    def __init__(self, p: Path) -> None:
        self.p = p

    def bad(self, where: str, why: str) -> ValueError:
        return ValueError(f"design {self.p}: {where}: {why}")


def _value(entry: Any) -> Any:
    return entry["value"] if isinstance(entry, dict) and "value" in entry else entry


def _expr(w: _Where, e: Any, where: str, positive: bool = False) -> None:
    """A number or an expression that parses; a constant one finite and >= 0 (> 0 when ``positive``)."""
    if isinstance(e, bool) or not isinstance(e, (int, float, str)):
        raise w.bad(where, f"must be a number or an expression string, got {e!r}")
    try:
        check(e)
        v = constant(e)
    except ValueError as err:
        raise w.bad(where, str(err)) from None
    if v is not None and not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
        raise w.bad(where, f"must be {'> 0' if positive else '>= 0'}, got {e!r}")


def _int(w: _Where, v: Any, where: str, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise w.bad(where, f"must be an integer in {lo}..{hi}, got {v!r}")


def _table(w: _Where, v: Any, where: str, lo: int, hi: int) -> None:
    """A per-batch table {"1": n, "8": n, ...} (or one number for every batch)."""
    if isinstance(v, dict):
        if not v:
            raise w.bad(where, "the per-batch table is empty")
        for b, n in v.items():
            if not (isinstance(b, str) and b.isdigit() and int(b) >= 1):
                raise w.bad(where, f"batch key {b!r} must be a positive integer")
            _int(w, n, f"{where}[{b}]", lo, hi)
    else:
        _int(w, v, where, lo, hi)


def _keys(w: _Where, d: Any, where: str, allowed: set[str], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(d, dict):
        raise w.bad(where, f"must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise w.bad(where, f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(sorted(allowed))})")
    missing = [k for k in required if k not in d]
    if missing:
        raise w.bad(where, f"missing {', '.join(map(repr, missing))}")
    return d


def _list(w: _Where, v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise w.bad(where, f"must be a list, got {type(v).__name__}")
    return v


def _reads(w: _Where, spec: dict, where: str) -> None:
    """The parts an opcode and a fused family share: re-reads, serial chains, issue cost."""
    for i, r in enumerate(_list(w, spec.get("rereads", []), f"{where}.rereads")):
        _keys(w, r, f"{where}.rereads[{i}]", {"what", "bytes", "footprint"}, ("bytes", "footprint"))
        _expr(w, r["bytes"], f"{where}.rereads[{i}].bytes")
        _expr(w, r["footprint"], f"{where}.rereads[{i}].footprint")
    for i, s in enumerate(_list(w, spec.get("serial", []), f"{where}.serial")):
        _keys(w, s, f"{where}.serial[{i}]", {"what", "trips", "cycles", "level"}, ("trips", "cycles", "level"))
        _expr(w, s["trips"], f"{where}.serial[{i}].trips")
        _expr(w, s["cycles"], f"{where}.serial[{i}].cycles")
        if s["level"] not in _LEVELS:
            raise w.bad(f"{where}.serial[{i}].level", f"must be one of {', '.join(_LEVELS)}, got {s['level']!r}")
    if "issue_per_fma" in spec:
        _expr(w, spec["issue_per_fma"], f"{where}.issue_per_fma", positive=True)


def _megakernel(w: _Where, mk: Any) -> None:
    _keys(w, mk, "megakernel", _MK_KEYS, ("threads", "stage_bytes", "prefetch_ahead", "stage_wait", "opcodes",
                                          *_MK_EXPRS))
    for k, (lo, hi) in _MK_INTS.items():
        if k in mk:
            _int(w, _value(mk[k]), f"megakernel.{k}", lo, hi)
    for k in _MK_EXPRS:
        _expr(w, _value(mk[k]), f"megakernel.{k}")
    for k, (lo, hi) in _MK_TABLES.items():
        if k in mk:
            _table(w, _value(mk[k]), f"megakernel.{k}", lo, hi)
    if not isinstance(_value(mk["prefetch_ahead"]), bool):
        raise w.bad("megakernel.prefetch_ahead", f"must be true or false, got {_value(mk['prefetch_ahead'])!r}")
    for k, allowed in (("stage_wait", ("all", "rows")), ("stage_choice", ("host", "device"))):
        if k in mk and _value(mk[k]) not in allowed:
            raise w.bad(f"megakernel.{k}", f"must be one of {', '.join(allowed)}, got {_value(mk[k])!r}")
    ops = sorted(o.name for o in Op)
    opcodes = _keys(w, mk["opcodes"], "megakernel.opcodes", set(mk["opcodes"]) if isinstance(mk["opcodes"], dict)
                    else set())
    unknown = sorted(k for k in opcodes if k.removesuffix(".mxfp4") not in ops)
    if unknown:
        raise w.bad("megakernel.opcodes", f"unknown opcode(s) {', '.join(map(repr, unknown))} (the ISA's: "
                    f"{', '.join(ops)}; NAME.mxfp4 for an MXFP4 expert variant)")
    for key, spec in opcodes.items():
        where = f"megakernel.opcodes.{key}"
        _keys(w, spec, where, _OPCODE_KEYS)
        for i, s in enumerate(_list(w, spec.get("streams", []), f"{where}.streams")):
            _keys(w, s, f"{where}.streams[{i}]", {"what", "bytes", "threads", "loads", "load_bytes"},
                  ("bytes", "threads", "loads", "load_bytes"))
            _expr(w, s["bytes"], f"{where}.streams[{i}].bytes")
            for f in ("threads", "loads", "load_bytes"):
                _expr(w, s[f], f"{where}.streams[{i}].{f}", positive=True)
        for f in ("fmas", "barriers"):
            if f in spec:
                _expr(w, spec[f], f"{where}.{f}")
        _reads(w, spec, where)


def _fused(w: _Where, fused: Any) -> None:
    families = _keys(w, fused, "fused", {"how", "families"}, ("families",))["families"]
    for name, spec in _keys(w, families, "fused.families", set(families)).items():
        where = f"fused.families.{name}"
        _keys(w, spec, where, _FAMILY_KEYS)
        for i, k in enumerate(_list(w, spec.get("kernels", []), f"{where}.kernels")):
            kw = f"{where}.kernels[{i}]"
            _keys(w, k, kw, _KERNEL_KEYS, ("name", "share", "threads", "loads", "load_bytes", "ctas", "registers"))
            if not (isinstance(k["name"], str) and _NAME.match(k["name"])):
                raise w.bad(f"{kw}.name", f"must be a short plain name, got {k['name']!r}")
            share = k["share"]
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise w.bad(f"{kw}.share", f"must be a number in [0, 1], got {share!r}")
            for f in ("threads", "loads", "load_bytes", "ctas"):
                _expr(w, k[f], f"{kw}.{f}", positive=True)
            for f in ("registers", "registers_mxfp4"):
                if f in k:
                    _table(w, k[f], f"{kw}.{f}", 1, 255)
            _reads(w, k, kw)
        for op, n in _keys(w, spec.get("kernels_per_op", {}), f"{where}.kernels_per_op",
                           set(spec.get("kernels_per_op", {}))).items():
            _expr(w, n, f"{where}.kernels_per_op.{op}")
        for variant, table in _keys(w, spec.get("registers_by_variant", {}), f"{where}.registers_by_variant",
                                    set(spec.get("registers_by_variant", {}))).items():
            _table(w, table, f"{where}.registers_by_variant.{variant}", 1, 255)
        _reads(w, spec, where)


def check_design(d: dict[str, Any], p: Path) -> None:
    """Refuse, naming the file and the field, a design the performance model could not read faithfully."""
    w = _Where(p)
    _keys(w, d, "the file", _TOP, ("name", "megakernel", "fused"))
    if not (isinstance(d["name"], str) and _NAME.match(d["name"])):
        raise w.bad("name", f"must be a short plain name (letters, digits, . _ + -), got {d['name']!r}")
    _megakernel(w, d["megakernel"])
    _fused(w, d["fused"])
