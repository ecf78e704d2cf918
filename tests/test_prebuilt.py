"""Prebuilt kernels: the build command writes a manifest + artefacts (on CPU), and the loader refuses
anything stale or mismatched with a clear ValueError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kimik3.kernels.toolchain import prebuilt as P
from kimik3.kernels.toolchain import registry as R
from kimik3.kernels.toolchain.source import kernel_source_hash

NAMES = ["gemv.plain/tiny/b1", "kda/tiny/b1"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prebuilt")
    rc = P.main(["kernels", "build", "--arch", "sm_90a", "--out", str(out), "--preset", "tiny", "--batch", "1",
                 "--family", "gemv.plain", "--family", "kda"])
    assert rc == 0
    return out


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built directory that a test may tamper with."""
    dst = tmp_path / "copy"
    shutil.copytree(built, dst)
    return dst


def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / P.MANIFEST).read_text())
    fn(m)
    (d / P.MANIFEST).write_text(json.dumps(m))


def test_manifest_records_what_was_built(built: Path) -> None:
    from importlib.metadata import version

    import cutlass  # noqa: F401  (the build machine has the DSL)

    m = P.read_manifest(built)
    assert m["arch"] == "sm_90a" and m["format_version"] == P.MANIFEST_VERSION
    assert sorted(m["kernels"]) == sorted(NAMES)
    for name in NAMES:
        e = m["kernels"][name]
        v = R.get_variant(name)
        assert e["arch"] == "sm_90a"
        assert e["shapes"] == json.loads(json.dumps(v.shapes))
        assert e["source_hash"] == kernel_source_hash(v.module_name)
        assert e["dsl_version"] == version("nvidia-cutlass-dsl")
        assert e["format"] in P.FORMATS
        for kind, fname in e["files"].items():
            assert (built / fname).exists(), fname
            assert len(e["sha256"][kind]) == 64
        assert {"ptx", "cubin"} <= set(e["files"])
        assert ".target sm_90a" in (built / e["files"]["ptx"]).read_text()
        assert e["entries"] and all(x["pointer_only"] and x["block"] for x in e["entries"])
        assert e["ptxas"] and e["budget_violations"] == []
    assert m["runtime"]["library"] == P.RUNTIME_LIB and m["runtime"]["build_path"]
    assert m["kernels"]["kda/tiny/b1"]["entries"][0]["dynamic_shared_bytes"] > 0


def test_source_hash_matches_the_build_side() -> None:
    from kimik3.kernels.toolchain import dsl

    for name in ("gemv", "router", "kda", "mla_decode", "moe", "attn_res"):
        mod = __import__(f"kimik3.kernels.fused.{name}", fromlist=["x"])
        assert dsl.source_hash(mod) == kernel_source_hash(name)
    assert kernel_source_hash("router") != kernel_source_hash("gemv")  # router inlines gemv: both files count


def test_load_valid_kernel(built: Path) -> None:
    v = R.get_variant("gemv.plain/tiny/b1")
    k = P.load_prebuilt(built, v.name, arch="sm_90a", shapes=v.shapes)
    assert k.name == v.name and k.entry["function_name"] == "gemv_plain__tiny__b1"
    if k.entry["format"] == "tvm-ffi":
        import torch

        t = v.reference.make_inputs(v.variant, **v.shapes)
        with pytest.raises(ValueError, match="expected device_type=cuda"):  # loads; CPU tensors are refused
            v.module.launch(k, v.variant, t, tvm_ffi=True)
        assert isinstance(t["y"], torch.Tensor)
    else:
        assert k.cubin[:4] == b"\x7fELF"


def test_refuses_tampered_source_hash(copy: Path) -> None:
    _edit_manifest(copy, lambda m: m["kernels"]["kda/tiny/b1"].update(source_hash="0" * 64))
    with pytest.raises(ValueError, match=r"stale: source hash 000000000000.*kernels/kda\.py"):
        P.load_prebuilt(copy, "kda/tiny/b1", arch="sm_90a")


def test_refuses_wrong_arch(built: Path) -> None:
    with pytest.raises(ValueError, match=r"built for arch 'sm_90a', but 'sm_100a' was requested"):
        P.load_prebuilt(built, "kda/tiny/b1", arch="sm_100a")


def test_refuses_wrong_shapes(built: Path) -> None:
    shapes = dict(R.get_variant("gemv.plain/tiny/b1").shapes, B=8)
    with pytest.raises(ValueError, match=r"different static shapes \(B: built 1, requested 8\)"):
        P.load_prebuilt(built, "gemv.plain/tiny/b1", arch="sm_90a", shapes=shapes)


def test_refuses_tampered_artefact_and_unknown_names(copy: Path) -> None:
    e = P.read_manifest(copy)["kernels"]["gemv.plain/tiny/b1"]
    f = copy / e["files"]["cubin"]
    f.write_bytes(f.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="does not match its sha256"):
        P.load_prebuilt(copy, "gemv.plain/tiny/b1", arch="sm_90a")
    with pytest.raises(ValueError, match="not in .*available"):
        P.load_prebuilt(copy, "moe.bf16/tiny/b1", arch="sm_90a")
    with pytest.raises(ValueError, match="manifest.json is missing"):
        P.load_prebuilt(copy / "nowhere", "kda/tiny/b1")


def test_refuses_other_dsl_version(copy: Path) -> None:
    _edit_manifest(copy, lambda m: m["kernels"]["kda/tiny/b1"].update(dsl_version="0.0.1"))
    with pytest.raises(ValueError, match="built with nvidia-cutlass-dsl 0.0.1"):
        P.load_prebuilt(copy, "kda/tiny/b1", arch="sm_90a")


def test_cubin_format(tmp_path: Path) -> None:
    m = P.build_prebuilt("sm_90a", tmp_path, ["gemv.f32out/tiny/b1"], fmt="cubin", log=None)
    e = m["kernels"]["gemv.f32out/tiny/b1"]
    assert e["format"] == "cubin" and "so" not in e["files"]
    k = P.load_prebuilt(tmp_path, "gemv.f32out/tiny/b1", arch="sm_90a")
    assert k.cubin[:4] == b"\x7fELF" and k.fn is None
    with pytest.raises(NotImplementedError, match="cuda-python"):
        k()
    # a later build into the same directory extends the manifest
    P.build_prebuilt("sm_90a", tmp_path, ["gemv.plain/tiny/b1"], fmt="cubin", log=None)
    assert sorted(P.read_manifest(tmp_path)["kernels"]) == ["gemv.f32out/tiny/b1", "gemv.plain/tiny/b1"]


def test_cli_list_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert P.main(["list", "--preset", "tiny", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "moe.mxfp4/tiny/b8" in out and "kda/tiny/b8" in out
    with pytest.raises(SystemExit):
        P.main(["kernels", "build", "--arch", "sm_80", "--out", "x"])
    assert P.main(["build", "--arch", "sm_90a", "--out", "x", "--family", "nope"]) == 2
    assert "unknown kernel families" in capsys.readouterr().err


@pytest.mark.slow
def test_ship_runtime(tmp_path: Path) -> None:
    m = P.build_prebuilt("sm_90a", tmp_path, ["gemv.plain/tiny/b1"], ship_runtime=True, log=None)
    assert m["runtime"]["shipped"] == P.RUNTIME_LIB + ".xz"
    assert (tmp_path / m["runtime"]["shipped"]).stat().st_size < 43_000_000
