"""The device check's child processes name what went wrong in them: a planted hang is killed at its item's limit,
a planted fault (SIGSEGV) and a refused launch are named by item, a wrong result reaches the record — and the items
after each still run, in a fresh child where the last one died. The preflight reads each cubin's registers as the
compile report has them and names a mismatch."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from devcheck.child import classify  # noqa: E402
from devcheck.cubin import CubinError, kernel_attributes  # noqa: E402
from devcheck.isolate import LaunchRefused, parse_plants, planted, run_items  # noqa: E402


def test_every_planted_failure_is_named_and_the_rest_still_run(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    items = [{"name": f"item {c}", "payload": i + 1} for i, c in enumerate("abcdef")]
    monkeypatch.setenv("KIMIK3_DEVCHECK_PLANT", "hang:item b;fault:item d;refuse:item e;wrong:item f")
    t0 = time.time()
    recs = run_items(tmp_path, "echo", items, context={}, deadline=time.time() + 120, item_timeout_s=4.0,
                     startup_s=90.0)
    by = {r["name"]: r for r in recs}
    assert [r["name"] for r in recs] == [i["name"] for i in items]
    assert by["item a"]["status"] == "ok" and by["item a"]["payload"] == 1
    assert by["item b"]["status"].startswith("hang: no result after") and "limit 4 s" in by["item b"]["status"]
    assert by["item c"]["status"] == "ok" and by["item c"]["payload"] == 3  # after the hang, in a fresh child
    assert by["item d"]["status"] == "fault: the child died by SIGSEGV during this item"
    assert "planted fault in item d" in by["item d"]["child_output_tail"]
    assert by["item e"]["status"].startswith("refused: LaunchRefused: planted") and by["item e"]["planted"] == "refuse"
    assert by["item f"]["status"] == "ok" and by["item f"]["payload"] == -6  # the wrong result reaches the record
    assert len(list((tmp_path / "children").glob("echo.*.spec.json"))) == 3  # one child per death
    assert time.time() - t0 < 100


def test_a_budget_that_runs_out_skips_the_rest_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIMIK3_DEVCHECK_PLANT", "hang:first")
    recs = run_items(tmp_path, "echo", [{"name": "first"}, {"name": "second"}], context={},
                     deadline=time.time() + 6.0, item_timeout_s=60.0, startup_s=90.0)
    assert recs[0]["status"].startswith("hang: still running when the phase's budget ran out")
    assert recs[1]["status"].startswith("skipped: the phase's budget ran out")


def test_plants_parse_and_bad_ones_are_refused() -> None:
    plants = parse_plants("hang:megakernel bench*; preflight:preflight megakernel/tiny/b1")
    assert planted("megakernel bench b1 ctx16", plants) == "hang"
    assert planted("preflight megakernel/tiny/b1", plants) == "preflight"
    assert planted("preflight megakernel/tiny/b1-mxfp4", plants) is None
    for bad in ("explode:x", "hang", "hang:"):
        with pytest.raises(ValueError, match="bad planted failure"):
            parse_plants(bad)


def test_dry_run_children_run_torch_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside CI's other test worker, a child's spinning OpenMP threads slowed a CPU item ten-fold (a false hang);
    the dry run's children get one thread unless the caller chose, the GPU run's keep torch's default."""
    import argparse

    from devcheck.phases import _child_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = argparse.Namespace(prebuilt=None, plant=None, dry_run=True)
    assert _child_env(args)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in _child_env(argparse.Namespace(prebuilt=None, plant=None, dry_run=False))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _child_env(args)["OMP_NUM_THREADS"] == "3"


def test_errors_are_classified_by_what_they_mean() -> None:
    assert classify(LaunchRefused("grid"))[0].startswith("refused:")
    assert classify(RuntimeError("CUDA error: too many resources requested for launch")) == (
        "refused: RuntimeError: CUDA error: too many resources requested for launch", False)
    status, poisoned = classify(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert status.startswith("fault:") and poisoned
    assert classify(ValueError("shape"))[0] == "error: ValueError: shape"


def test_cubin_attributes_match_the_compile_report(tiny_prebuilt: Path) -> None:
    manifest = json.loads((tiny_prebuilt / "manifest.json").read_text())
    seen = 0
    for name, e in manifest["kernels"].items():
        attrs = kernel_attributes((tiny_prebuilt / e["files"]["cubin"]).read_bytes())
        for k in e["ptxas"]:
            assert attrs[k["name"]]["registers"] == k["registers"], (name, k["name"])
            seen += 1
        for ent in e["entries"]:
            if ent.get("block"):
                assert attrs[ent["name"]]["reqntid"] == ent["block"], name
    assert seen > 20


def test_a_malformed_cubin_is_refused() -> None:
    with pytest.raises(CubinError, match="not a 64-bit"):
        kernel_attributes(b"\x7fELF" + b"\0" * 10)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", hdr, 0x28, 10**9)
    struct.pack_into("<HHH", hdr, 0x3A, 64, 3, 1)
    with pytest.raises(CubinError, match="out of bounds"):
        kernel_attributes(bytes(hdr))


def test_preflight_passes_the_shipped_megakernel_and_names_a_planted_mismatch(tiny_prebuilt: Path) -> None:
    from devcheck.preflight import preflight

    ok = preflight(tiny_prebuilt, "megakernel/tiny/b1", dry=True)
    assert ok["status"] == "ok", [c for c in ok["checks"] if not c["ok"]]
    assert ok["driver"].startswith("left out in the dry run")
    assert {c["check"] for c in ok["checks"]} >= {"registers: cubin = compile report", "block: cubin = launch",
                                                   "one CTA per SM: shared memory"}
    assert ok["carveout"]["l1_left_bytes"] + ok["carveout"]["chosen_bytes"] == 256 * 1024
    bad = preflight(tiny_prebuilt, "megakernel/tiny/b1", dry=True, plant="preflight")
    assert bad["status"] == "preflight mismatch: registers: cubin = compile report", bad["status"]
