"""The GPU device check's CPU side: the dry run (provenance + plan, exit 0), the refusal of a real run without
CUDA, the on-device model initialiser, the budget, and the measurement file it writes for data/measurements."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from device_check_script import load_script

import kimik3
from kimik3.model.random_init import device_model
from kimik3.perf.provenance import commit_info

REPO = Path(__file__).resolve().parents[1]


dc = load_script()


def test_dry_run_writes_provenance_and_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert dc.main(["--out", str(out), "--dry-run", "--prebuilt", str(tmp_path / "none")]) == 0
    prov = json.loads((out / dc.FILES["provenance"]).read_text())
    plan = json.loads((out / dc.FILES["plan"]).read_text())
    assert prov["date"] and prov["torch"] == torch.__version__ and "kernel_source_hashes" in prov
    assert set(prov["kernel_source_hashes"]) == {"gemv", "router", "kda", "mla_decode", "moe", "attn_res",
                                                      "megakernel"}
    assert "commit" in prov and prov["commit_source"]
    # the budget: every phase has one, and together they leave a quarter of the window as slack; the window fits
    # the device tool's 10 minutes per command
    assert sum(plan["phase_budgets_s"].values()) <= dc.TOTAL_BUDGET_S <= 0.75 * dc.DEVICE_WINDOW_S
    assert dc.DEVICE_WINDOW_S <= 600 - 60
    assert set(plan["phase_budgets_s"]) == {"preflight", "smoke", "megakernel_tests", "copy_bandwidth", "constants",
                                            "tests", "kernels", "bench", "megakernel_mxfp4", "megakernel", "ranks"}
    assert list(dc.PHASES)[:3] == ["preflight", "smoke", "megakernel_tests"]
    assert list(dc.PHASES)[-2:] == ["megakernel", "ranks"]  # the single-GPU items first, the rank programs last
    # the rank items: the loopback of tiny over 2 against naive, then k3-rank alone at batch 1 and 8 (quick: 1)
    ranks = plan["ranks"]["items"]
    assert [(i["kind"], i["preset"], i["batch"]) for i in ranks] == [
        ("loopback", "tiny", 1), ("alone", "k3-rank", 1), ("alone", "k3-rank", 8)]
    assert ranks[0]["world"] == 2 and ranks[0]["variant"] == "megakernel/tiny-rank/b1"
    assert [i["batch"] for i in dc.plan(None, quick=True)["ranks"]["items"]] == [1, 1]
    assert {i["variant"] for i in plan["preflight"]["items"]} >= {i["variant"] for i in ranks}
    assert not any("rank" in i["variant"] for i in plan["smoke"]["items"] + plan["megakernel_mxfp4"]["items"])
    # a smoke program per opcode family of the tiny batch-1 megakernel (MXFP4: the family its format changes)
    smoke = {(i["variant"], i["family"]) for i in plan["smoke"]["items"]}
    assert {f for v, f in smoke if v == "megakernel/tiny/b1"} == {"embed", "attn_res", "norm_proj", "mlp", "kda",
                                                                   "o_proj", "mla", "moe", "lm_head"}
    assert {f for v, f in smoke if v == "megakernel/tiny/b1-mxfp4"} == {"moe"}
    files = [t["file"] for t in plan["tests"]]
    assert "tests/test_fused_stage.py" in files and "tests/test_kernels_gpu.py" in files
    assert plan["megakernel_tests"] == {"file": "tests/test_megakernel_gpu.py", "run": True}
    assert plan["bench"]["order"][0] == ["fused", 1] and ["naive", 8] == plan["bench"]["order"][-1]
    assert not any(s == "megakernel" for s, _ in plan["bench"]["order"])  # its rows run last, in a child
    bench_items = [i for i in plan["megakernel"]["items"] if i["kind"] == "bench"]
    assert bench_items[0]["name"] == "megakernel bench b1 ctx512"
    assert {i["batch"] for i in bench_items} == {1, 8, 64} and {i["context"] for i in bench_items} == {512, 4096}
    assert [i["batch"] for i in plan["megakernel"]["items"] if i["kind"] == "opcodes"] == [1, 8]
    assert plan["preflight"]["items"][0]["variant"] == "megakernel/k3-shard/b1"
    assert {"megakernel/k3-shard/b1", "megakernel/k3-shard/b8", "megakernel/k3-shard/b1-mxfp4",
            "megakernel/tiny/b1-mxfp4"} <= set(plan["prebuilt"]["missing"])
    # the MXFP4 megakernel items: k3-shard first (the run's model, quantised in place), the timing buffer read
    # there; tiny with the interpreter
    items = plan["megakernel_mxfp4"]["items"]
    assert [i["variant"] for i in items] == ["megakernel/k3-shard/b1-mxfp4", "megakernel/k3-shard/b8-mxfp4",
                                            "megakernel/tiny/b1-mxfp4"]
    assert [(i["interp"], i["timings"]) for i in items] == [(False, True), (False, True), (True, False)]
    assert [i["batch"] for i in dc.plan(None, quick=True)["megakernel_mxfp4"]["items"]] == [1, 1]
    assert plan["kernels"]["ops"] and all(o["name"].startswith("fused/") for o in plan["kernels"]["ops"])
    pb = plan["prebuilt"]
    assert not pb["ready"] and pb["distinct_ops"] == len(pb["missing"]) > 50
    assert "missing" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted([dc.FILES["provenance"], dc.FILES["plan"]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_real_run_refuses_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dc.main(["--out", str(tmp_path), "--prebuilt", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--dry-run" in err
    assert not (tmp_path / dc.FILES["summary"]).exists()


def test_out_is_required() -> None:
    with pytest.raises(SystemExit):
        dc.main(["--dry-run"])


def test_prebuilt_status_flags_stale_kernels(tmp_path: Path) -> None:
    from kimik3.fused.plan import fused_ops

    op = fused_ops("tiny", 1)[0]
    manifest = {"arch": "sm_90a", "kernels": {op.name: {"module": op.module_name, "variant": op.variant,
                                                        "arch": "sm_90a", "shapes": op.shapes,
                                                        "source_hash": "0" * 64}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    st = dc._prebuilt_status(tmp_path)
    assert st["manifest_found"] and op.name in st["stale"] and op.name not in st["missing"] and not st["ready"]


def test_commit_comes_from_env_then_build_info(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIMIK3_COMMIT", "abc123")
    assert commit_info(tmp_path)[:2] == ("abc123", "env KIMIK3_COMMIT")
    monkeypatch.delenv("KIMIK3_COMMIT")
    (tmp_path / "BUILD_INFO.json").write_text(json.dumps({"commit": "def456", "dirty": True}))
    commit, source, dirty = commit_info(tmp_path)
    assert commit == "def456" and source.endswith("BUILD_INFO.json") and dirty is True


def test_build_prebuilt_records_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls, mk = [], []
    import kimik3.kernels.toolchain.prebuilt as pb

    import kimik3.fused.loading as fused

    monkeypatch.setattr(fused, "build_prebuilt_kernels", lambda arch, out, targets, **kw: calls.append(targets))
    monkeypatch.setattr(pb, "build_prebuilt", lambda arch, out, variants, **kw: mk.append([v.name for v in variants]))
    assert dc.main(["--build-prebuilt", str(tmp_path), "--presets", "tiny", "--batches", "1,8"]) == 0
    assert calls == [[("tiny", 1, "bf16"), ("tiny", 8, "bf16"), ("tiny", 8, "mxfp4")]]
    from kimik3.kernels.toolchain.targets import probe_variants

    # the probe kernels, then the megakernel for both expert formats
    assert mk == [probe_variants(), ["megakernel/tiny/b1", "megakernel/tiny/b1-mxfp4"]]
    info = json.loads((tmp_path / "BUILD_INFO.json").read_text())
    assert info["arch"] == "sm_90a" and info["targets"] == [list(t) for t in calls[0]] and "commit" in info
    assert info["megakernel_variants"] == mk[1]


def test_device_model_reproduces_from_preset_on_cpu() -> None:
    """The on-device initialiser runs kimik3.model.random_init's own rules; with a CPU generator it is from_preset
    exactly."""
    a = device_model("micro", seed=3, dtype=torch.bfloat16, device="cpu")
    b = kimik3.from_preset("micro", seed=3, dtype=torch.bfloat16)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.model.layers[0].self_attn.A_log.dtype == torch.float32  # fp32 parameters stay fp32
    import kimik3.model.random_init as init

    assert init.torch is torch  # restored


def test_judge_and_speedups() -> None:
    big = dc._judge(100e6, 100e6 / (0.9 * 4e12), 4e12, 3e-6)
    assert big["judged_against"] == "80% of copy bandwidth" and big["verdict"] == "meets"
    assert abs(big["pct_copy_bw"] - 90) < 1e-6
    slow = dc._judge(100e6, 100e6 / (0.5 * 4e12), 4e12, 3e-6)
    assert slow["verdict"] == "below"
    small = dc._judge(1e5, 5e-6, 4e12, 3e-6)
    assert small["judged_against"] == "launch-latency floor" and small["verdict"] == "within 2x of the floor"
    rows = [{"stage": "naive", "batch": 1, "ms_per_token": 50.0}, {"stage": "compiled", "batch": 1,
            "ms_per_token": 10.0}, {"stage": "fused", "batch": 1, "ms_per_token": 5.0},
            {"stage": "fused", "batch": 8, "ms_per_token": 6.0}]
    dc._speedups(rows)
    assert rows[2]["speedup_vs_naive"] == 10 and rows[2]["speedup_vs_compiled"] == 2
    assert rows[3]["speedup_vs_naive"] is None


def test_measurements_file_loads_with_load_recorded(tmp_path: Path) -> None:
    """What the check writes for data/measurements/ is in the format kimik3.perf.recorded reads."""
    from kimik3.perf.recorded import load_recorded

    dc._write(tmp_path, "bench", {"context": 512, "steps": 8, "rows": [
        {"stage": "fused", "batch": 1, "status": "ok", "ms_per_token": 3.0, "ms_min": 2.9, "ms_max": 3.2,
         "pct_copy_bw": 80.0}, {"stage": "naive", "batch": 8, "status": "not run: x"}]})
    dc._write(tmp_path, "kernels", {"kernels": [
        {"batch": 1, "launch": "L0.kda.qkv", "op": "fused/gemv.rmsnorm/k3-shard/b1/K7168-N36864",
         "source_hash": "abc", "seconds": 1e-4, "bytes": 5.3e8, "flops": 5.3e8, "pct_copy_bw": 90.0,
         "verdict": "meets"}], "mxfp4_vs_bf16": [{"batch": 1, "bf16_s": 2e-4, "mxfp4_s": 1e-4, "bf16_bytes": 1e9,
                                                  "mxfp4_bytes": 2.7e8, "time_ratio_mxfp4_over_bf16": 0.5}]})
    data = dc._measurements(tmp_path, {"date": "2026-12-01T00:00:00+00:00", "commit": "abc1234", "gpu": "NVIDIA H200",
                                       "torch": "2.11.0"})
    assert data is not None and len(data["records"]) == 4
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "m.json").write_text((tmp_path / dc.FILES["measurements"]).read_text())
    df = load_recorded(folder)
    assert len(df) == 4 and set(df.block) == {"step", "kernel:L0.kda.qkv", "experts:bf16", "experts:mxfp4"}
    assert (df.label.str.startswith("recorded 2026-12-01 abc1234")).all()


def test_outstanding_file_is_loadable_and_lists_no_numbers() -> None:
    """data/measurements/gpu_outstanding.json: a list of what is still to be measured on a GPU, no values, and it
    does not break load_recorded (no records)."""
    from kimik3.perf.recorded import load_recorded

    data = json.loads((REPO / "data" / "measurements" / "gpu_outstanding.json").read_text())
    assert data["records"] == [] and data["outstanding"]
    for item in data["outstanding"]:
        assert item["status"] == "not yet measured" and item["reason"] == "no GPU lent to this task"
        assert not any(k in item for k in ("seconds", "ms", "value"))
    load_recorded(REPO / "data" / "measurements")


def test_wrapper_script_runs_the_documented_command() -> None:
    script = REPO / "scripts" / "device_check.sh"
    text = script.read_text()
    assert os.stat(script).st_mode & stat.S_IXUSR
    assert "python3 scripts/device_check.py --out \"$OUT\" --prebuilt" in text
    assert "--build-prebuilt prebuilt" in text and "carry" in text


def _args(tmp_path: Path, seconds: float, quick: bool = True) -> object:
    import argparse
    import time

    return argparse.Namespace(out=str(tmp_path), prebuilt=None, quick=quick, deadline=str(time.time() + seconds))


def test_phase_tests_runs_each_gpu_file_and_reports_skips(tmp_path: Path) -> None:
    """On a CPU every GPU test skips ("no CUDA device"): the phase says so rather than 'passed'; a file that needs
    the DSL is run only where the DSL is installed."""
    dc._phase_tests(tmp_path, _args(tmp_path, 120))
    res = {r["file"]: r for r in json.loads((tmp_path / dc.FILES["tests"]).read_text())["results"]}
    fused = res["tests/test_fused_stage.py"]
    if torch.cuda.is_available():
        pytest.skip("GPU machine: the statuses differ")
    assert fused["status"] == "all skipped" and "skipped" in fused["summary"] and fused["returncode"] == 0


def test_phase_bench_writes_rows_as_it_goes_and_skips_past_the_budget(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import pandas as pd

    import kimik3.bench as bench
    from kimik3.stages import STAGES
    from kimik3.stages.fused import FusedStage

    monkeypatch.setattr(kimik3, "from_preset", kimik3.from_preset)  # restored after the phase patches them
    monkeypatch.setattr(bench, "measure_local", bench.measure_local)
    monkeypatch.setitem(STAGES, "fused", FusedStage)
    calls = []

    def fake_run_bench(preset, stages, batches, context, **kw):
        calls.append((stages[0], batches[0]))
        assert preset == "k3-shard" and kw["device"] == "cuda" and kw["dtype"] == "bfloat16"
        if stages[0] == "graphs":
            raise RuntimeError("boom")
        ms = {"naive": 40.0, "fused": 4.0}.get(stages[0], 10.0)
        return pd.DataFrame([{"stage": stages[0], "batch": batches[0], "status": "ok", "ms_per_token": ms}])

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    from devcheck import plan as plan_mod

    monkeypatch.setattr(plan_mod, "BENCH_RESERVE_DEFAULT_S", 0.0)
    monkeypatch.setitem(dc.BENCH_RESERVE_S, "naive", 1e6)  # never enough time for naive
    dc._phase_bench(tmp_path, _args(tmp_path, 60))
    rec = json.loads((tmp_path / dc.FILES["bench"]).read_text())
    assert calls == [("fused", 1), ("graphs", 1), ("absorbed", 1), ("fused", 8)]
    rows = {(r["stage"], r["batch"]): r for r in rec["rows"]}
    assert rows[("graphs", 1)]["status"].startswith("error: RuntimeError: boom")
    assert rows[("fused", 1)]["ms_per_token"] == 4.0 and rows[("fused", 1)]["speedup_vs_naive"] is None
    assert [(s["stage"], s["batch"]) for s in rec["skipped"]] == [("naive", 1)]
    assert "of the phase's budget left" in rec["skipped"][0]["reason"]


def test_everything_run_on_the_gpu_has_a_cpu_counterpart() -> None:
    """Every fused kernel family and every megakernel opcode the device check can run on a GPU is host-executed on
    the CPU by a CI case of a tests/test_host_exec*.py module (the same device helpers, every block / warp / lane)."""
    import importlib.util

    from kimik3.kernels.contracts.isa import DEVICE_OPS, MXFP4_OPERANDS

    # the opcodes that read MXFP4 experts count once more: the MXFP4 variants run their own device code
    from kimik3.kernels.toolchain.registry import FAMILIES, PROBES

    want = set(FAMILIES) | {op.name for op in DEVICE_OPS} | {f"{op.name}.mxfp4" for op in MXFP4_OPERANDS}
    want |= set(PROBES)
    assert set(dc.CPU_COUNTERPARTS) == want, sorted(want ^ set(dc.CPU_COUNTERPARTS))
    cases: dict[str, list[dict]] = {}
    for name, (module, key, value) in sorted(dc.CPU_COUNTERPARTS.items()):
        if module not in cases:
            path = REPO / module
            spec = importlib.util.spec_from_file_location(f"_counterpart_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            cases[module] = mod._cases_ci()
        assert any(c.get(key) == value for c in cases[module]), f"{name}: no CI case with {key} = {value!r} in {module}"
    assert dc.plan(None, quick=True)["cpu_counterparts"]["KDA_STEP"].startswith("tests/test_host_exec_kda.py")


def test_bench_leaves_the_later_phases_their_budget(tmp_path: Path) -> None:
    """Bench takes what is left of the 5 minutes, less the budgets of the phases after it (the MXFP4 megakernel)."""
    import argparse
    import time

    seen: dict[str, float] = {}

    def record(name: str):
        return lambda out, args: seen.__setitem__(name, float(args.deadline) - time.time())

    dc._write(tmp_path, "plan", dc.plan(None, quick=False))
    args = argparse.Namespace(out=str(tmp_path), prebuilt=None, quick=False, dry_run=False)
    dc.run_phases(tmp_path, args, ["bench", "megakernel_mxfp4"], table={p: record(p) for p in dc.PHASES})
    later = dc.PHASE_BUDGETS["megakernel_mxfp4"]
    assert dc.TOTAL_BUDGET_S - later - 5 < seen["bench"] <= dc.TOTAL_BUDGET_S - later
    assert later - 5 < seen["megakernel_mxfp4"] <= later


def test_judge_mxfp4_names_every_failure() -> None:
    ok = {"max_error": 1e-3, "tolerance": 0.03, "mode": "teacher-forced"}
    items = [{"variant": f"megakernel/{p}/b{b}-mxfp4", "preset": p, "batch": b, "interp": p == "tiny",
              "timings": p != "tiny"} for p, b in (("k3-shard", 1), ("k3-shard", 8), ("tiny", 1), ("tiny", 8))]
    res = [{**items[0], "status": "ok", "megakernel_vs_naive": {**ok, "max_error": float("nan")},
            "opcodes": {"error": "x"}},
           {**items[2], "status": "ok", "megakernel_vs_naive": ok, "interp_vs_naive": ok,
            "megakernel_vs_interp": {**ok, "max_error": 0.5}},
           {**items[3], "status": "error: RuntimeError: boom"}]
    rec = {"items": items, "results": res, "skipped": [{"variant": items[1]["variant"], "reason": "skipped: 2 s"}]}
    f = dc.judge_mxfp4(rec)
    assert len(f) == 4, f  # (the opcode report's error is not judged)
    assert "k3-shard/b1-mxfp4: megakernel vs naive rel err nan" in f[0]
    assert f[1].endswith("k3-shard/b8-mxfp4: skipped: 2 s")
    assert "tiny/b1-mxfp4: megakernel vs interp rel err 0.5" in f[2] and "boom" in f[3]
    res[0]["megakernel_vs_naive"], res[1]["megakernel_vs_interp"] = ok, ok
    del res[1]["interp_vs_naive"]
    assert dc.judge_mxfp4({**rec, "results": res[:2], "skipped": []}) == [
        "megakernel_mxfp4 megakernel/k3-shard/b8-mxfp4: not run", "megakernel_mxfp4 megakernel/tiny/b1-mxfp4: no "
        "interp vs naive", "megakernel_mxfp4 megakernel/tiny/b8-mxfp4: not run"]
    dry = {"dry_run": True, "items": [items[2]], "results": [{**items[2], "status": "ok", "interp_vs_naive": {
        **ok, "mode": "greedy", "tokens_equal": False}}]}
    assert dc.judge_mxfp4(dry) == ["megakernel_mxfp4 megakernel/tiny/b1-mxfp4: interp vs naive: greedy tokens differ"]
    assert dc.judge_mxfp4(None) == ["megakernel_mxfp4: no result file (the phase did not run)"]


def test_judge_ranks_names_every_failure() -> None:
    from devcheck.judge import judge_ranks

    ok = {"max_error": 1e-3, "tolerance": 0.03, "mode": "teacher-forced"}
    items = [{"name": "ranks loopback tiny w2 b1", "kind": "loopback"}, {"name": "ranks alone k3-rank b1",
                                                                          "kind": "alone"},
             {"name": "ranks alone k3-rank b8", "kind": "alone"}]
    good = [{**items[0], "status": "ok", "vs_naive": ok},
            {**items[1], "status": "ok", "step_ms": {"median": 11.0}, "nvl72": {"tokens_per_s_per_sequence": 80.0}},
            {**items[2], "status": "ok", "step_ms": {"median": 13.0}, "nvl72": {"tokens_per_s_per_sequence": 70.0}}]
    assert judge_ranks({"items": items, "results": good}) == []
    bad = [{**good[0], "vs_naive": {**ok, "max_error": float("nan")}}, {**good[1], "nvl72": {}},
           {**items[2], "status": "hang: no result after 90 s"}]
    assert judge_ranks({"items": items, "results": bad}) == [
        "ranks alone k3-rank b8: hang: no result after 90 s", "ranks loopback tiny w2 b1: vs naive rel err nan > 0.03",
        "ranks alone k3-rank b1: no step time or NVL72 prediction"]
    greedy = {**good[0], "vs_naive": {**ok, "mode": "greedy", "tokens_equal": False}}
    assert judge_ranks({"items": items[:1], "results": [greedy]}) == [
        "ranks loopback tiny w2 b1: vs naive: greedy tokens differ"]
    assert judge_ranks(None) == ["ranks: no result file (the phase did not run)"]
