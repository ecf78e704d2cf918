"""Rooflines, the latency roofline, the widget panel, hardware ceilings, recorded measurements and published figures:
everything builds and saves headless, and the panel reacts to its controls without a frontend."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest

from kimik3.perf.cost import decode_cost
from kimik3.perf.hardware import (
    DATA_DIR,
    get_hardware,
    hardware_for_device,
    hardware_table,
    list_hardware,
    local_hardware,
    measure_local,
)
from kimik3.perf.recorded import RECORDED_COLUMNS, claims_vs_bound, load_published, load_recorded
from kimik3.perf.roofline import (
    declutter_labels,
    latency_roofline_figure,
    latency_table,
    points_from_cost,
    roofline_figure,
    roofline_panel,
    save_html,
)


@pytest.fixture(scope="module")
def k3_cost():
    return decode_cost("kimi-k3", 1, 8192, expert_dtype="mxfp4")


# ====================================================================== figures


def test_roofline_figure_builds_and_saves_html(k3_cost, tmp_path):
    pts = points_from_cost(k3_cost, "h200")
    fig = roofline_figure(pts, hardware=["h100-sxm", "h200", "gb300"], compute_dtypes=("bf16", "fp4"),
                          recorded_dir=tmp_path / "none")
    ceilings = [t for t in fig.data if t.mode == "lines"]
    assert len(ceilings) == 6 and any("fp8" in t.name for t in ceilings)  # Hopper has no fp4: falls back to fp8
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    out = save_html(fig, tmp_path / "sub" / "roofline.html")
    assert out.exists() and out.stat().st_size > 100_000 and "plotly" in out.read_text()[:5000].lower()


def test_analytic_points_lie_on_the_roofline(k3_cost):
    h200 = get_hardware("h200")
    pts = points_from_cost(k3_cost, h200, compute_dtype="bf16")
    ceiling = (pts["intensity"] * h200.hbm_bandwidth).clip(upper=h200.peak_flops("bf16"))
    assert (pts["flops_per_s"] / ceiling).sub(1).abs().max() < 1e-9
    assert set(pts["label"]) >= {"kda", "mla", "experts", "lm_head"}
    assert (pts["intensity"] < h200.ridge_point("bf16")).all()  # every block of a batch-1 step is bandwidth-bound
    step = points_from_cost(k3_cost, None, seconds=0.010, by="step")
    assert step["kind"].iloc[0] == "measured" and step["flops_per_s"].iloc[0] == pytest.approx(k3_cost.total_flops
                                                                                                / 0.010)
    # a model's time is said to be one, in the legend too; without times the kind stays analytic
    model = points_from_cost(k3_cost, None, seconds=0.010, by="step", stage="megakernel", kind="calibrated model v2")
    assert model["kind"].iloc[0] == "calibrated model v2"
    assert points_from_cost(k3_cost, "h200", kind="ignored")["kind"].eq("analytic").all()
    fig = roofline_figure(model, ["h200"], recorded=False)
    assert any(t.name == "megakernel (calibrated model v2)" for t in fig.data)


def test_latency_roofline_builds_and_bounds_behave(tmp_path):
    table = latency_table("kimi-k3", ["h200", "gb300"], [1, 8, 64, 512], [0, 131072], "mxfp4")
    assert len(table) == 2 * 4 * 2
    for _, g in table.groupby(["hardware", "context_len"]):
        g = g.sort_values("batch_size")
        assert g["ms_per_step"].is_monotonic_increasing and g["tokens_per_s_per_user"].is_monotonic_decreasing
        assert g["tokens_per_s"].is_monotonic_increasing
    assert (table.loc[table["batch_size"] == 1, "bound"] == "memory").all()
    one = latency_table("kimi-k3", ["h200"], [1], [0], "mxfp4", n_devices=1).iloc[0]
    assert one["ms_per_step"] == pytest.approx(1e3 * one["bytes"] / 4.8e12)
    fig = latency_roofline_figure("kimi-k3", ["h200", "gb300"], [1, 8, 64], [0, 8192], "mxfp4")
    assert len(fig.data) == 2 * 2 * 2  # (hardware x context) lines in each of the two panels
    assert save_html(fig, tmp_path / "latency.html").exists()


# ====================================================================== panel


def test_printed_labels_never_land_on_each_other():
    # three points within a tenth of a decade of each other and one far away: one label of the close three
    x, y = [1.0, 1.05, 1.1, 100.0], [1e12, 1.1e12, 0.95e12, 1e12]
    assert declutter_labels(x, y, ["a", "b", "c", "far"]) == ["a", "", "", "far"]
    assert declutter_labels([0.0, 2.0], [1.0, 1.0], ["zero", "two"]) == ["", "two"]  # not on a log axis
    pts = points_from_cost(decode_cost("tiny", 1, 1024), "h200")
    fig = roofline_figure(pts, ["h200"], recorded=False, label_points=True)
    shown = [(math.log10(px), math.log10(py)) for tr in fig.data if tr.mode == "markers+text"
             for px, py, t in zip(tr.x, tr.y, tr.text) if t]
    assert len(shown) >= 2
    for i, a in enumerate(shown):
        for b in shown[i + 1:]:
            assert abs(a[0] - b[0]) >= 0.18 or abs(a[1] - b[1]) >= 0.18
    for tr in fig.data:  # every block keeps its name in the hover text, printed or not
        if tr.mode and "markers" in tr.mode and tr.hovertext is not None:
            assert all(tr.hovertext)


def test_panel_builds_headless_and_reacts_to_controls():
    panel = roofline_panel("micro", "h200", batch_size=1, context_len=1024, expert_dtype="bf16")
    assert len(panel.children) == 5 and set(panel.controls) >= {"preset", "hardware", "batch_size", "context_len",
                                                                "expert_dtype", "weight_dtype", "kv_dtype"}
    names = [t.name for t in panel.figure.data]  # every trace named: a legend never says "trace 2"
    assert all(names) and not any(re.fullmatch(r"trace \d+", n) for n in names), names
    assert len(panel.figure.data[2].hovertext) == len(panel.figure.data[2].x) and all(panel.figure.data[2].hovertext)
    blocks_y = list(panel.figure.data[2].y)
    summary = panel.summary.value
    panel.controls["batch_size"].value = 64
    assert list(panel.figure.data[2].y) != blocks_y and panel.summary.value != summary
    assert panel.cost.batch_size == 64
    ceiling_y = list(panel.figure.data[0].y)
    panel.controls["hardware"].value = "gb300"
    assert list(panel.figure.data[0].y) != ceiling_y and "gb300" in panel.figure.layout.title.text
    bytes_bf16 = panel.cost.weight_bytes
    panel.controls["expert_dtype"].value = "mxfp4"
    assert panel.cost.weight_bytes < bytes_bf16


# ====================================================================== hardware


def test_hardware_entries_are_complete_and_sourced():
    keys = list_hardware()
    assert set(keys) == {"h100-sxm", "h200", "b200", "gb200", "gb300"}
    raw = json.loads((DATA_DIR / "hardware.json").read_text())["hardware"]
    for key in keys:
        h = get_hardware(key)
        assert h.hbm_bandwidth > 1e12 and h.hbm_capacity > 50e9 and h.peak_flops("bf16") > 5e14
        assert h.sm_count and h.smem_per_sm_bytes and h.nvlink_bandwidth
        assert h.source and all(isinstance(s, str) and s for s in h.source)
        assert set(h.uncertain) <= set(raw[key]) and (not h.uncertain or h.note)
    assert get_hardware("H100").key == "h100-sxm" and get_hardware("GB300 NVL72").key == "gb300"
    # a device's name as torch gives it -> its datasheet entry (whole words, the longest name first), None for the rest
    assert hardware_for_device("NVIDIA H200") == "h200" and hardware_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert hardware_for_device("NVIDIA GB200") == "gb200" and hardware_for_device("NVIDIA B200") == "b200"
    assert hardware_for_device("cpu") is None and hardware_for_device("NVIDIA H2000") is None
    with pytest.raises(ValueError, match="known"):
        get_hardware("tpu-v1")
    assert get_hardware("gb300").peak_flops("fp4") > get_hardware("gb200").peak_flops("fp4")
    assert len(hardware_table()) == 5


def test_measure_local_reports_rates_spread_and_provenance():
    m = measure_local("cpu", quick=True, repeats=3)
    for key in ("device_name", "torch_version", "date", "copy_bandwidth_Bps", "matmul_flops_per_s"):
        assert m[key]
    assert m["copy_bandwidth_spread"]["min"] <= m["copy_bandwidth_Bps"] <= m["copy_bandwidth_spread"]["max"]
    assert m["matmul_dtype"] == "fp32" and m["matmul_spread"]["max"] >= m["matmul_flops_per_s"] > 1e8
    local = local_hardware(m)
    assert local.measured and local.compute_ceiling("bf16") == (m["matmul_flops_per_s"], "fp32")
    if Path("/proc/cpuinfo").is_file():  # the CPU a timing ran on: its model and vector extensions
        text = Path("/proc/cpuinfo").read_text()
        assert m["cpu_model"] and m["cpu_model"] in text
        assert all(re.search(rf"\b{f}\b", text) for f in m["cpu_vector_flags"])
        if re.search(r"\bavx2\b", text):
            assert "avx2" in m["cpu_vector_flags"]


# ====================================================================== recorded and published


def test_load_recorded_empty_and_labelled(tmp_path, k3_cost):
    empty = load_recorded(tmp_path)
    assert empty.empty and list(empty.columns) == RECORDED_COLUMNS
    (tmp_path / "run.json").write_text(json.dumps({
        "date": "2026-11-30T10:00:00Z", "commit": "abc1234def", "device": "NVIDIA H200", "preset": "kimi-k3",
        "stage": "naive", "records": [{"block": "step", "seconds": 0.5, "flops": k3_cost.total_flops,
                                       "bytes": k3_cost.total_bytes}, {"block": "kda", "ms": 3.0}]}))
    rec = load_recorded(tmp_path)
    assert len(rec) == 2 and (rec["label"] == "recorded 2026-11-30 abc1234def").all()
    assert rec["seconds"].tolist() == [0.5, 0.003]
    fig = roofline_figure(points_from_cost(k3_cost, "h200"), ["h200"], recorded_dir=tmp_path)
    assert any(t.name == "naive · recorded 2026-11-30 abc1234def" for t in fig.data)  # its stage, then its run
    # a recording goes under the ceilings of the kind of machine it ran on, and a figure says what it left out
    (tmp_path / "cpu.json").write_text(json.dumps({
        "date": "2026-11-29T10:00:00Z", "commit": "fedcba98", "device": "cpu", "preset": "tiny", "stage": "compiled",
        "records": [{"block": "step", "seconds": 0.01, "flops": 1e8, "bytes": 1e8}]}))
    fig = roofline_figure(points_from_cost(k3_cost, "h200"), ["h200"], recorded_dir=tmp_path)
    assert not any("fedcba98" in str(t.name) for t in fig.data)
    assert any("1 recorded point(s) from machines not drawn here" in a.text for a in fig.layout.annotations)
    local = dataclasses.replace(get_hardware("h200"), key="local", name="local", measured=True)
    fig = roofline_figure(points_from_cost(k3_cost, "h200"), ["h200", local], recorded_dir=tmp_path)
    assert any("fedcba98" in str(t.name) for t in fig.data) and any("abc1234def" in str(t.name) for t in fig.data)
    (tmp_path / "cpu.json").unlink()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_recorded(tmp_path)


def test_repository_measurements_load():
    assert isinstance(load_recorded(), pd.DataFrame)  # data/measurements may be empty; it must still load


def test_published_figures_carry_sources():
    claims = json.loads((DATA_DIR / "published.json").read_text())["claims"]
    assert {c["id"] for c in claims} >= {"vllm-gb300-batch1", "semianalysis-gb300-per-user",
                                         "semianalysis-hbm-traffic", "inferact-gb200-batch1",
                                         "inferact-tpu-v7-batch1"}
    for c in claims:
        assert isinstance(c["verified"], bool) and c["source"]["title"] and c["claim"]
        assert c["verified"] == bool(c["source"]["url"])  # verified figures point at what was read
    values = {c["id"]: c["value"] for c in claims}
    assert (values["vllm-gb300-batch1"], values["semianalysis-gb300-per-user"], values["inferact-gb200-batch1"],
            values["inferact-tpu-v7-batch1"]) == (840, 423, 127, 249)


def test_claims_vs_bound_arithmetic():
    vs = claims_vs_bound("kimi-k3", expert_dtype="mxfp4", context_len=8192).set_index("id")
    step = decode_cost("kimi-k3", 1, 8192, expert_dtype="mxfp4")
    inferact = vs.loc["inferact-gb200-batch1"]
    assert inferact["implied_TBps"] == pytest.approx(step.total_bytes * 127 / 1e12)  # bytes/step x steps/s
    assert inferact["bandwidth_utilisation"] == pytest.approx(step.total_bytes * 127 / (16 * 8e12))
    vllm = vs.loc["vllm-gb300-batch1"]
    assert vllm["devices"] == 72 and vllm["devices_assumed"] and not vllm["verified"]
    assert vllm["devices_at_full_bandwidth"] == pytest.approx(step.total_bytes * 840 / 8e12)
    assert vs.loc["semianalysis-gb300-per-user", "batch_assumed"]
    assert vs.loc["inferact-batch-sweep:gb200:B8", "tokens_per_s_per_user"] == pytest.approx(636 / 8)
    assert len(load_published()) >= 8


def test_panel_drives_a_figure_widget():
    """anywidget is a dependency, so the panel's figure is a live plotly FigureWidget."""
    import plotly.graph_objects as go

    from kimik3.perf.roofline import roofline_panel

    panel = roofline_panel()
    assert isinstance(panel.figure, go.FigureWidget)
