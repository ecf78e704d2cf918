"""The performance model's ranges (uncertain constants at their optimistic / pessimistic ends) and measured
constants laid over data/perf/constants.json: the committed point scores stay what they are, the interval orders
and widens as its constants do, a measured file moves the score the right way and a malformed one is refused."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from kimik3.perfmodel import PERF_DIR, load_constants, load_design, predict
from kimik3.perfmodel import scores as score_table
from kimik3.perfmodel.data import SLOWER_WHEN_LARGER
from kimik3.perfmodel.measured import SWEEP, apply_measured, load_measured, measured_constants

C = load_constants()
UNCERTAIN = ("hbm_latency_ns", "hbm_read_efficiency", "inflight_occupancy", "signal_acquire_ns", "l1_free_fraction")
FUSED = ("k3-shard", "fused", 1, "v2", 4096)  # cheap: a sum over kernels
MK = ("micro", "megakernel", 2, "v2", 16)  # cheap: a small megakernel program


def _only(k: str, lo: float | None = None, hi: float | None = None) -> object:
    r = C.ranges[k]
    return replace(C, ranges={k: (r[0] if lo is None else lo, r[1] if hi is None else hi)})


def _measured_file(tmp_path: Path, constants: dict, sweeps: dict | None = None, **top) -> Path:
    data = {"hardware": "h200", "date": "2026-12-01T10:00:00+00:00", "commit": "0123456789abcdef0123",
            "device": "NVIDIA H200", "source": "scripts/device_check.py phase constants", "constants": constants}
    if sweeps is not None:
        data["sweeps"] = sweeps
    data.update(top)
    p = tmp_path / "constants-h200.json"
    p.write_text(json.dumps(data))
    return p


def _entry(value: float, unit: str = "ns", spread: list | None = None) -> dict:
    return {"value": value, "unit": unit, "method": "synthetic", "samples": 5,
            "spread": spread if spread is not None else [value * 0.95, value * 1.05]}


def test_ranges_are_data_beside_the_point_values():
    raw = json.loads((PERF_DIR / "constants.json").read_text())["constants"]
    for k in UNCERTAIN:
        lo, hi = raw[k]["range"]
        assert lo <= raw[k]["value"] <= hi and lo < hi, k
        assert raw[k]["range_source"].strip(), k
        assert C.ranges[k] == (lo, hi)
    assert set(C.ranges) <= set(SLOWER_WHEN_LARGER)


def test_committed_point_scores_unchanged():
    """The score table (point values only, no range fields) is identical to the committed one, entry by entry,
    and predict's point with its ranges computed is the committed point."""
    for design in ("v1", "v2"):
        committed = json.loads((PERF_DIR / f"scores-{design}.json").read_text())
        new = score_table(design, batches=(1,))
        assert {k: v for k, v in new.items() if k != "results"} == \
            {k: v for k, v in committed.items() if k != "results"}
        for r in new["results"]:
            want = next(x for x in committed["results"] if x["stage"] == r["stage"] and x["batch"] == 1
                        and x.get("experts", "bf16") == r["experts"])
            # scores-v1.json predates the "experts" field (bf16 only); every field it has must be identical
            assert set(r) - set(want) <= {"experts"}, set(r) - set(want)
            assert {k: r[k] for k in want} == want, f"scores-{design}.json {r['stage']} {r['experts']}: changed"
    committed = json.loads((PERF_DIR / "scores-v2.json").read_text())["results"]
    for b in (1, 8, 64):
        r = predict("k3-shard", "fused", b, "v2")
        want = next(x for x in committed if x["stage"] == "fused" and x["batch"] == b and x["experts"] == "bf16")
        assert (r["predicted_ms"], r["fraction_of_roofline"]) == (want["predicted_ms"], want["fraction_of_roofline"])


@pytest.mark.parametrize("case", [FUSED, MK, ("k3-shard", "fused", 64, "v1", 4096)])
def test_pessimistic_point_optimistic_are_ordered(case):
    r = predict(*case)
    opt, pess = r["predicted_ms_range"]
    assert opt <= r["predicted_ms"] <= pess and opt < pess
    lo, hi = r["fraction_of_roofline_range"]
    assert lo <= r["fraction_of_roofline"] <= hi
    assert lo == pytest.approx(r["roofline_ms"] / pess, abs=1e-4)  # of the point's roofline
    for k in UNCERTAIN:  # the slow end of each range is the pessimistic one
        lo, hi = C.ranges[k]
        want = (hi, lo) if SLOWER_WHEN_LARGER[k] else (lo, hi)
        assert (r["range_constants"][k]["pessimistic"], r["range_constants"][k]["optimistic"]) == want, k
    assert predict(*case, ranges=False).keys() < r.keys()


@pytest.mark.parametrize("k, case", [("hbm_latency_ns", FUSED), ("hbm_read_efficiency", FUSED),
                                     ("inflight_occupancy", FUSED), ("signal_acquire_ns", MK),
                                     ("hbm_latency_ns", MK)])
def test_widening_a_range_widens_the_interval(k, case):
    lo, hi = C.ranges[k]
    v = C.values[k]
    narrow = predict(*case, constants=_only(k, lo=v - (v - lo) / 4, hi=v + (hi - v) / 4))["predicted_ms_range"]
    wide = predict(*case, constants=_only(k))["predicted_ms_range"]
    assert wide[0] <= narrow[0] and wide[1] >= narrow[1] and (wide[0] < narrow[0] or wide[1] > narrow[1]), \
        (k, narrow, wide)
    point = replace(C, ranges={})
    none = predict(*case, constants=point)
    assert none["predicted_ms_range"] == [none["predicted_ms"]] * 2  # no range, no interval


def test_l1_range_moves_re_reads_to_l2(tmp_path):
    """A re-read whose footprint fits in the L1 beside the shared memory only at the optimistic end of
    ``l1_free_fraction`` makes the interval wider when that range widens."""
    d = copy.deepcopy(load_design("v2"))
    smem = max(d["megakernel"]["shared_bytes"]["value"].values())
    free = C.l1_capacity_bytes - smem
    d["megakernel"]["opcodes"]["NORM_PROJ"]["rereads"] = [
        {"what": "probe", "bytes": "64 * rows * B * row_bytes", "footprint": 0.5 * free}]
    p = tmp_path / "probe.json"
    p.write_text(json.dumps({**d, "name": "probe"}))
    narrow = predict("micro", "megakernel", 2, str(p), 16, constants=_only("l1_free_fraction", lo=0.6))
    wide = predict("micro", "megakernel", 2, str(p), 16, constants=_only("l1_free_fraction", lo=0.25))
    assert narrow["predicted_ms_range"][1] == narrow["predicted_ms"]  # still fits at 0.6
    assert wide["predicted_ms_range"][1] > narrow["predicted_ms_range"][1]


def test_loader_refuses_a_bad_range(tmp_path):
    raw = json.loads((PERF_DIR / "constants.json").read_text())
    for bad, msg in (({"range": [700.0, 900.0]}, "around the value"), ({"range": [1, float("nan")]}, "range must"),
                     ({"range_source": ""}, "range_source")):
        r = copy.deepcopy(raw)
        r["constants"]["hbm_latency_ns"].update(bad)
        p = tmp_path / "c.json"
        p.write_text(json.dumps(r))
        with pytest.raises(ValueError, match=msg) as e:
            load_constants(p)
        assert str(p) in str(e.value) and "hbm_latency_ns" in str(e.value)
    r = copy.deepcopy(raw)
    r["constants"]["sm_count"].update(range=[100, 140], range_source="x")
    p.write_text(json.dumps(r))
    with pytest.raises(ValueError, match="only understood on"):
        load_constants(p)


def test_measured_constants_move_the_score_and_are_named(tmp_path, capsys):
    base = predict(*FUSED)
    slower = {"hbm_read_efficiency": _entry(0.8, "fraction of hbm_peak_Bps", [0.78, 0.82]),
              "hbm_loaded_latency_ns": _entry(900.0), "kernel_boundary_ns": _entry(4000.0)}
    for name, e in slower.items():  # each alone moves the step the way it should
        r = predict(*FUSED, constants=measured_constants(_measured_file(tmp_path, {name: e})))
        assert r["predicted_ms"] > base["predicted_ms"], name
        target = "hbm_latency_ns" if name == "hbm_loaded_latency_ns" else name
        assert set(r["constants_measured"]) == {target} and target not in r["constants_recalled"]
        assert sorted(r["range_constants"][target].values()) == e["spread"]  # the spread is its range
    faster = predict(*FUSED, constants=measured_constants(_measured_file(
        tmp_path, {"hbm_loaded_latency_ns": _entry(500.0), "kernel_boundary_ns": _entry(1500.0)})))
    assert faster["predicted_ms"] < base["predicted_ms"]
    eff = predict(*FUSED, constants=measured_constants(_measured_file(tmp_path, {"hbm_read_efficiency": slower[
        "hbm_read_efficiency"]})))
    assert eff["roofline_ms"] > base["roofline_ms"]  # the ceiling is the measured achievable bandwidth
    mk0 = predict(*MK)
    mk = predict(*MK, constants=measured_constants(_measured_file(tmp_path, {"signal_acquire_ns": _entry(900.0)})))
    assert mk["predicted_ms"] > mk0["predicted_ms"] and "signal_acquire_ns" in mk["constants_measured"]
    assert base["constants_measured"] == {} and "signal_acquire_ns" in base["constants_recalled"]

    from kimik3.__main__ import main

    p = _measured_file(tmp_path, slower)
    assert main(["predict", "--stage", "fused", "--batch", "1", "--measured", str(p)]) == 0
    out = capsys.readouterr().out
    for name in ("hbm_read_efficiency", "hbm_latency_ns", "kernel_boundary_ns"):
        assert f"measured {name}: measured" in out and p.name in out
    assert "still datasheet / recalled" in out and "(" in out.splitlines()[0]
    assert main(["predict", "--stage", "fused", "--batch", "1", "--measured", str(p), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["predicted_ms"] == pytest.approx(predict(*FUSED, constants=measured_constants(p))["predicted_ms"])
    assert set(j["constants_measured"]) == {"hbm_read_efficiency", "hbm_latency_ns", "kernel_boundary_ns"}


def test_default_scoring_ignores_a_measured_file_with_a_note(tmp_path, monkeypatch, capsys):
    from kimik3 import __main__ as entry
    from kimik3.perfmodel import measured

    monkeypatch.setattr(measured, "MEASUREMENTS_DIR", tmp_path)
    _measured_file(tmp_path, {"kernel_boundary_ns": _entry(9000.0)})
    assert entry.main(["predict", "--stage", "fused", "--batch", "1", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["predicted_ms"] == predict(*FUSED)["predicted_ms"]
    assert "constants-h200.json exists" in cap.err and "--measured" in cap.err


def test_unloaded_latency_only_raises_the_low_bound(tmp_path):
    c = measured_constants(_measured_file(tmp_path, {"hbm_latency_ns": _entry(520.0, spread=[510.0, 530.0])}))
    assert c.values["hbm_latency_ns"] == C.values["hbm_latency_ns"]
    assert c.ranges["hbm_latency_ns"] == (520.0, C.ranges["hbm_latency_ns"][1])
    assert "low bound" in c.measured["hbm_latency_ns"]
    high = measured_constants(_measured_file(tmp_path, {"hbm_latency_ns": _entry(700.0, spread=[690.0, 710.0])}))
    assert high.values["hbm_latency_ns"] == 700.0  # the latency under load is at least the unloaded one
    both = measured_constants(_measured_file(tmp_path, {"hbm_latency_ns": _entry(520.0),
                                                        "hbm_loaded_latency_ns": _entry(800.0, spread=[750.0, 850.])}))
    assert both.values["hbm_latency_ns"] == 800.0 and both.ranges["hbm_latency_ns"] == (750.0, 850.0)


def test_sweep_replaces_littles_law(tmp_path):
    pts = [{"bytes_in_flight_per_sm": 16384, "Bps": 1.0e12}, {"bytes_in_flight_per_sm": 65536, "Bps": 3.0e12},
           {"bytes_in_flight_per_sm": 32768, "Bps": 2.0e12}, {"bytes_in_flight_per_sm": 131072, "Bps": 2.9e12}]
    c = measured_constants(_measured_file(tmp_path, {}, {SWEEP: pts}))
    S = C.sm_count
    assert c.rate_Bps(32768, 600.0) == pytest.approx(2.0e12 / S)
    assert c.rate_Bps(49152, 600.0) == pytest.approx(2.5e12 / S)  # linear between points
    assert c.rate_Bps(8192, 600.0) == pytest.approx(0.5e12 / S)  # through zero below the first
    assert c.rate_Bps(1 << 20, 600.0) == pytest.approx(3.0e12 / S)  # never less for more in flight
    assert c.rate_Bps(16384, 600.0, ctas=2) == pytest.approx(2.0e12 / S / 2)
    assert C.rate_Bps(12288, 600.0) == 12288 / (600.0 * 1e-9)  # Little's law without a sweep
    assert SWEEP in c.measured and "Little's law" in c.measured[SWEEP]
    slow = [{"bytes_in_flight_per_sm": 1 << 20, "Bps": 1.0e12}]  # well below Little's law at these in-flight sizes
    r = predict(*FUSED, constants=measured_constants(_measured_file(tmp_path, {}, {SWEEP: slow})))
    assert r["predicted_ms"] > predict(*FUSED)["predicted_ms"]


_GOOD = {"signal_acquire_ns": _entry(500.0)}


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d["constants"]["signal_acquire_ns"].update(value="500"), "constants.signal_acquire_ns.value"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(value=float("nan")), "constants.signal_acquire_ns.value"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(value=-5.0), "constants.signal_acquire_ns.value"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(value=True), "constants.signal_acquire_ns.value"),
    (lambda d: d["constants"]["signal_acquire_ns"].pop("spread"), "spread"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(spread=[600.0, 700.0]), "constants.signal_acquire_ns.spread"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(spread=[float("nan"), 700.0]), "spread"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(samples=0), "constants.signal_acquire_ns.samples"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(samples=2.5), "constants.signal_acquire_ns.samples"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(unit="us"), "constants.signal_acquire_ns.unit"),
    (lambda d: d["constants"]["signal_acquire_ns"].update(method=""), "constants.signal_acquire_ns.method"),
    (lambda d: d["constants"].update(hbm_read_efficiency=_entry(1.2, "fraction", [1.1, 1.3])), "hbm_read_efficiency"),
    (lambda d: d["constants"].update(l2_latency_ns=_entry(200.0)), "constants.l2_latency_ns"),
    (lambda d: d["constants"].update(signal_acquire_ns=[500.0]), "constants.signal_acquire_ns"),
    (lambda d: d.update(constants=[]), "constants"),
    (lambda d: d.update(hardware="b200"), "hardware"),
    (lambda d: d.pop("date"), "'date'"),
    (lambda d: d.pop("commit"), "'commit'"),
    (lambda d: d.update(date="yesterday"), "date"),
    (lambda d: d.update(device=""), "device"),
    (lambda d: d.update(sweeps={"bw": []}), "sweeps.bw"),
    (lambda d: d.update(sweeps={SWEEP: [{"bytes_in_flight_per_sm": 0, "Bps": 1e12}]}),
     f"sweeps.{SWEEP}[0].bytes_in_flight_per_sm"),
    (lambda d: d.update(sweeps={SWEEP: [{"bytes_in_flight_per_sm": 4096, "Bps": float("inf")}]}),
     f"sweeps.{SWEEP}[0].Bps"),
    (lambda d: d.update(sweeps={SWEEP: [{"bytes_in_flight_per_sm": 4096}]}), f"sweeps.{SWEEP}[0]"),
    (lambda d: d.update(sweeps={SWEEP: []}), f"sweeps.{SWEEP}"),
])
def test_malformed_measured_files_are_refused(tmp_path, mutate, key):
    p = _measured_file(tmp_path, copy.deepcopy(_GOOD))
    load_measured(p)  # the unmutated file is fine
    d = json.loads(p.read_text())
    mutate(d)
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        load_measured(p)
    assert str(p) in str(e.value) and key in str(e.value), str(e.value)


def test_malformed_file_on_the_command_line(tmp_path, capsys):
    from kimik3.__main__ import main

    p = _measured_file(tmp_path, {"signal_acquire_ns": {**_entry(500.0), "value": float("nan")}})
    assert main(["predict", "--stage", "fused", "--measured", str(p)]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "signal_acquire_ns.value" in err
    assert main(["predict", "--stage", "fused", "--measured", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "measured-constants file" in err and "nope.json does not exist" in err
    other = tmp_path / "constants-b200.json"
    other.write_text(p.read_text().replace('"h200"', '"b200"'))
    with pytest.raises(ValueError, match="unknown to the model"):
        load_measured(other)
    with pytest.raises(ValueError, match="hardware"):
        apply_measured(replace(C, hardware="b200"), load_measured(_measured_file(tmp_path, _GOOD)))


def test_bench_model_columns_carry_the_range():
    from kimik3.perfmodel import model_columns

    mk = model_columns("micro", "megakernel", 2, 16)
    assert mk["model_ms_min"] <= mk["model_ms"] <= mk["model_ms_max"] and mk["model_ms_min"] < mk["model_ms_max"]
    assert mk["model_ms"] == predict(*MK)["predicted_ms"]


def test_a_measured_file_with_empty_records_loads_here_and_in_load_recorded(tmp_path):
    """``load_recorded`` reads every ``*.json`` of data/measurements; with ``"records": []`` beside the contract's
    keys it skips the file, and the perfmodel loader ignores the extra key."""
    from kimik3.perf.recorded import load_recorded

    p = _measured_file(tmp_path, _GOOD, records=[])
    assert load_measured(p).constants["signal_acquire_ns"]["value"] == 500.0
    assert load_recorded(tmp_path).empty
