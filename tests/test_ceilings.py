"""Honest ceilings: STREAM-style bandwidth into preallocated buffers, unclamped fractions of the ceiling, and
points or bench rows above their ceiling flagged as measurement problems rather than shown as results."""

from __future__ import annotations

import json

import pytest
import torch

import kimik3.bench as bench
from kimik3.perf.cost import decode_cost
from kimik3.perf.hardware import STREAM_KERNELS, local_hardware, measure_bandwidth, read_ceiling_Bps
from kimik3.perf.roofline import check_ceilings, points_from_cost, roofline_figure


def test_measure_bandwidth_reports_every_kernel_with_spread_and_restores_threads():
    before = torch.get_num_threads()
    m = measure_bandwidth("cpu", nbytes=8 * 2**20, repeats=3, warmup=1, threads=1)
    assert torch.get_num_threads() == before
    assert m["bandwidth_threads"] == 1 and m["bandwidth_buffer_bytes"] == 8 * 2**20
    for k in STREAM_KERNELS:
        s = m[f"{k}_bandwidth_spread"]
        assert s["n"] == 3 and s["min"] <= m[f"{k}_bandwidth_Bps"] == s["median"] <= s["max"]
        assert 1e8 < m[f"{k}_bandwidth_Bps"] < 1e13  # bytes/s: a unit slip of 1e3 either way would leave this
    for bad in ({"nbytes": 100}, {"repeats": 0}, {"threads": 0}):
        with pytest.raises(ValueError):
            measure_bandwidth("cpu", **{"nbytes": 2**20, **bad})


def test_local_hardware_ceiling_is_the_read_bandwidth():
    m = {"device_name": "cpu x", "date": "2026-12-01T00:00:00", "torch_version": "t", "matmul_dtype": "fp32",
         "matmul_flops_per_s": 1e11, "read_bandwidth_Bps": 40e9, "copy_bandwidth_Bps": 20e9}
    assert read_ceiling_Bps(m) == 40e9 and local_hardware(m).hbm_bandwidth == 40e9
    old = {k: v for k, v in m.items() if k != "read_bandwidth_Bps"}  # a record from before the read kernel
    assert local_hardware(old).hbm_bandwidth == 20e9 and "copy" in local_hardware(old).name


def _points():
    cost = decode_cost("tiny", 1, 512, weight_dtype="fp32", expert_dtype="fp32", kv_dtype="fp32", act_dtype="fp32")
    m = {"device_name": "test cpu", "date": "2026-12-01T00:00:00", "torch_version": "t", "matmul_dtype": "fp32",
         "matmul_flops_per_s": 1e15, "read_bandwidth_Bps": 10e9}
    local = local_hardware(m)
    at_bound = cost.total_bytes / local.hbm_bandwidth
    fast = points_from_cost(cost, local, seconds=at_bound / 2, by="step", stage="too-fast")
    slow = points_from_cost(cost, local, seconds=at_bound * 4, by="step", stage="slow")
    analytic = points_from_cost(cost, local, by="kind")
    return local, fast, slow, analytic


def test_check_ceilings_is_unclamped_and_flags_only_what_exceeds_its_roof():
    local, fast, slow, analytic = _points()
    pts = check_ceilings([fast, slow, analytic], [local])
    by_stage = pts.set_index("stage")
    assert by_stage.loc["too-fast", "pct_of_ceiling"] == pytest.approx(200)
    assert by_stage.loc["slow", "pct_of_ceiling"] == pytest.approx(25)
    assert bool(by_stage.loc["too-fast", "above_ceiling"]) and not bool(by_stage.loc["slow", "above_ceiling"])
    assert not pts[pts["kind"] == "analytic"]["above_ceiling"].any()


def test_roofline_figure_never_shows_a_point_above_its_ceiling_as_a_result():
    local, fast, slow, _ = _points()
    fig = roofline_figure([fast, slow], [local], compute_dtypes=("fp32",), recorded=False)
    names = [t.name for t in fig.data]
    flagged = [t for t in fig.data if t.name.startswith("above its ceiling")]
    assert len(flagged) == 1 and list(flagged[0].text) == ["step B=1 · too-fast"]
    assert not any("too-fast" in n for n in names)  # not among the result traces
    assert any("read bandwidth" in a.text for a in fig.layout.annotations)


@pytest.mark.parametrize("ceiling_Bps, flagged", [(1.0, True), (1e18, False)])
def test_bench_row_above_its_ceiling_is_flagged_not_recorded(tmp_path, monkeypatch, ceiling_Bps, flagged):
    monkeypatch.setattr(bench, "measure_local", lambda **kw: {"read_bandwidth_Bps": ceiling_Bps})
    # the CPU ceiling at the step's working-set size (read and triad): the same planted value
    monkeypatch.setattr(bench, "measure_bandwidth", lambda *a, **kw: {"read_bandwidth_Bps": ceiling_Bps,
                                                                       "triad_bandwidth_Bps": ceiling_Bps})
    out = tmp_path / "b.json"
    df = bench.run_bench("micro", ["absorbed"], [1], context=8, steps=1, repeats=1, warmup=1, include_hf=False,
                         out=out, progress=False)
    row = df.iloc[0]
    assert row["pct_read_bw"] == pytest.approx(100 * row["bytes_per_step"] / (row["ms_per_token"] / 1e3)
                                               / ceiling_Bps)  # unclamped
    rec = json.loads(out.read_text())
    if flagged:
        assert row["status"].startswith("measurement problem") and row["pct_read_bw"] > 100
        assert rec["records"] == [] and len(rec["flagged"]) == 1
    else:
        assert row["status"] == "ok" and len(rec["records"]) == 1 and rec["flagged"] == []


def test_a_cpu_bench_record_is_placed_against_its_working_set_ceiling():
    from kimik3.perf.roofline import _record_ceiling

    ceiling = {"read_bandwidth_Bps": 2e10, "step_working_set": {"8": {"ceiling_Bps": 3e10}}}
    assert _record_ceiling({"bandwidth_ceiling": ceiling, "batch_size": 8}) == 3e10
    assert _record_ceiling({"bandwidth_ceiling": ceiling, "batch_size": 1}) == 2e10  # no entry: the read ceiling


def test_a_bench_row_meets_the_higher_of_its_two_ceilings():
    import torch

    # 1 GB at 10 GB/s is 100 ms of reading; 1 TFLOP at 5 TFLOP/s is 200 ms of compute: compute-bound, 200 ms
    ceiling = {"matmul_flops_per_s": 5e12, "matmul_dtype": "fp32"}
    r = bench._roofline_columns(1e9, 1e12, 0.4, 1e10, ceiling, torch.float32)
    assert r["bound"] == "compute" and r["roofline_ms"] == pytest.approx(200) and r["pct_roofline"] == pytest.approx(50)
    r = bench._roofline_columns(1e9, 1e11, 0.2, 1e10, ceiling, torch.float32)  # 20 ms of compute: memory-bound
    assert r["bound"] == "memory" and r["roofline_ms"] == pytest.approx(100) and r["pct_roofline"] == pytest.approx(50)
    # a matmul rate measured in another dtype is no ceiling for this one: the memory ceiling alone, said so
    r = bench._roofline_columns(1e9, 1e12, 0.4, 1e10, ceiling, torch.bfloat16)
    assert r["bound"].startswith("memory (no compute ceiling") and r["roofline_ms"] == pytest.approx(100)
