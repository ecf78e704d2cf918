"""The library code the notebooks call instead of carrying it in cells: the shared set-up
(`kimik3.notebook.start.start_notebook`) and the per-kernel report of notebook 04 (`kimik3.notebook.kernel_report`)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from kimik3.fused.launch_cost import launch_bytes
from kimik3.notebook.kernel_report import (
    PTX_FEATURES,
    KernelReport,
    get_build,
    hot_loop_excerpt,
    measured_rows,
    ptx_highlights,
)
from kimik3.notebook.start import OFFLINE_RENDERER, start_notebook


def test_start_notebook_creates_out_dir_and_resolves_device(tmp_path):
    import plotly.io as pio

    target = tmp_path / "a" / "b"
    try:
        out, dev, dtype = start_notebook(target, "cpu", pandas_display={"width": 211, "max_colwidth": 77})
        assert out == target and out.is_dir()
        assert (dev, dtype) == ("cpu", torch.float32)
        assert pd.get_option("display.width") == 211 and pd.get_option("display.max_colwidth") == 77
        assert pio.renderers.default == OFFLINE_RENDERER
        env = start_notebook(str(target))  # an existing folder is fine; "auto" picks what this machine has
        assert env.device == ("cuda" if torch.cuda.is_available() else "cpu")
        assert env.dtype == (torch.bfloat16 if env.device == "cuda" else torch.float32)
    finally:
        pd.reset_option("display.width")
        pd.reset_option("display.max_colwidth")


@pytest.mark.parametrize("kwargs, match", [({"device": "gpu0"}, "device"), ({"device": ""}, "device"),
                                           ({"pandas_display": {"no_such_option": 1}}, "no_such_option")])
def test_start_notebook_refuses_bad_input_before_creating_anything(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        start_notebook(tmp_path / "never", **kwargs)
    assert not (tmp_path / "never").exists()


PTX = "\n".join([
    ".target sm_90a",
    "mov.u32 %r1, 0;",
    '.pragma "nounroll";',
    "ld.global.nc.v4.u32 {%r2, %r3, %r4, %r5}, [%rd1];",
    "ld.global.nc.v4.u32 {%r6, %r7, %r8, %r9}, [%rd2];",
    "ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd3];",
    "fma.rn.f32 %f5, %f1, %f2, %f3;",
    "shfl.sync.bfly.b32 %r10, %r2, 16, 31, -1;",
])


def test_ptx_highlights_counts_features_and_always_reports_local():
    t = ptx_highlights(PTX).set_index("instruction")["count"]
    assert t["ld.global.nc.v4"] == 2 and t["ld.global.v4"] == 1 and t["fma.rn.f32"] == 1 and t["shfl.sync.bfly"] == 1
    assert t[".local"] == 0  # shown even at 0: its absence is the point
    assert "tanh.approx" not in t.index and set(t.index) <= set(PTX_FEATURES)
    assert ptx_highlights(PTX + "\nld.local.u32 %r1, [%rd9];").set_index("instruction")["count"][".local"] == 1


def test_hot_loop_excerpt_counts_loads_before_first_arithmetic():
    text = hot_loop_excerpt(PTX, n=3)
    assert text.startswith("3 global loads issued before the first arithmetic instruction")
    assert text.splitlines()[1:] == PTX.splitlines()[1:6]  # two lines of context, the load, n - 1 more
    assert hot_loop_excerpt("add.f32 %f1, %f2, %f3;") == "(no 16-byte global load found)"
    with pytest.raises(ValueError, match="n must be"):
        hot_loop_excerpt(PTX, n=0)


def test_measured_rows_and_build_without_dsl():
    rec = pd.DataFrame({"block": ["kernel:a", "kernel:a", "kernel:b", "step"], "batch_size": [1, 8, 1, 1]})
    assert measured_rows(rec, "a", 1).index.tolist() == [0]
    assert measured_rows(rec.iloc[:0], "a", 1).empty
    assert get_build(object(), "sm_90a", compile_kernels=True, have_dsl=False) == (
        None, "the CuTe DSL is not installed here: no PTX")


@pytest.fixture(scope="module")
def tiny_step():
    from kimik3.fused.plan import FusedStep
    from kimik3.model.config import get_preset
    from kimik3.model.random_init import build_model

    return FusedStep(build_model(get_preset("tiny"), "meta").cast_(torch.bfloat16), 1, 256)


def _report(step, recorded: pd.DataFrame) -> KernelReport:
    from kimik3.perf.hardware import get_hardware

    return KernelReport(step, arch="sm_90a", compile_kernels=False, batch=1, context=64, preset="tiny",
                        hardware=get_hardware("h200"), recorded=recorded, have_dsl=False)


def _shown(monkeypatch, report: KernelReport, name: str) -> str:
    import IPython.display

    shown: list[str] = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs: shown.extend(getattr(o, "data", str(o))
                                                                                 for o in objs))
    report.section(name, ptx_highlights)
    return "\n".join(shown)


def test_section_reports_bytes_and_outstanding_measurement(monkeypatch, tiny_step):
    report = _report(tiny_step, pd.DataFrame())
    ln = report.launch("L0.kda.qkv")
    text = _shown(monkeypatch, report, "L0.kda.qkv")
    assert f"**{launch_bytes(ln, context=64) / 1e6:,.2f} MB**" in text
    assert "def ptx_highlights" in text  # the source shown is the function's own
    assert "no PTX" in text and "GPU measurement outstanding" in text and "kernel-bandwidth-tiny-b1" in text


def test_section_flags_a_measurement_of_an_older_kernel_source(monkeypatch, tiny_step):
    from kimik3.kernels.toolchain.source import kernel_source_hash

    op = _report(tiny_step, pd.DataFrame()).launch("L0.kda.qkv").op
    now = kernel_source_hash(op.module_name)[:16]
    rec = pd.DataFrame({"block": ["kernel:L0.kda.qkv"] * 2, "batch_size": [1, 1], "label": ["old", "new"],
                        "device": ["h200"] * 2, "seconds": [1e-5, 1e-5], "bytes": [1e6, 1e6],
                        "source_hash": ["0" * 16, now], "date": ["2026-01-01", "2026-01-01"]})
    lines = _shown(monkeypatch, _report(tiny_step, rec), "L0.kda.qkv").splitlines()
    old = next(x for x in lines if x.startswith("*Measured* (old"))
    new = next(x for x in lines if x.startswith("*Measured* (new"))
    assert "stale" in old and "stale" not in new and "100 GB/s" in new


def test_section_refuses_glue_and_unknown_launches(tiny_step):
    report = _report(tiny_step, pd.DataFrame())
    with pytest.raises(ValueError, match="glue op"):
        report.launch("embed")
    with pytest.raises(ValueError, match="not a launch"):
        report.launch("L99.nothing")
    with pytest.raises(ValueError, match="batch"):
        KernelReport(tiny_step, arch="sm_90a", compile_kernels=False, batch=0, context=64, preset="tiny",
                     hardware=report.hardware, recorded=pd.DataFrame(), have_dsl=False)
