"""Stages ``megakernel`` and ``fused`` from a bare copy of the repository (no install, as on the GPU machine) with
the CuTe DSL compiler absent (``cutlass`` blocked by a meta-path finder): each constructed first in a fresh
process, its construction and its kernel loader get as far as the CUDA device and fail only for want of it, never
on an import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import importlib.machinery, json, sys, traceback

    class NoCutlass(importlib.machinery.PathFinder):
        # the path finder, blind to the CuTe DSL: cutlass is absent, as on the GPU machine
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name == "cutlass" or name.startswith("cutlass."):
                return None
            return super().find_spec(name, path, target)

    # the editable install maps kimik3 and kimik3.kernels onto the checkout: a bare copy has no such mapping
    sys.meta_path[:] = [NoCutlass if f is importlib.machinery.PathFinder else f for f in sys.meta_path
                        if "__editable__" not in getattr(f, "__module__", "")]
    assert NoCutlass in sys.meta_path
    BARE, STAGE, PREBUILT = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path.insert(0, BARE)

    import torch
    import kimik3
    assert kimik3.__file__.startswith(BARE), kimik3.__file__
    from kimik3.fused.loading import dsl_available
    assert not dsl_available()

    out = {"kimik3": kimik3.__file__}
    model = kimik3.from_preset("tiny", seed=0, dtype=torch.bfloat16)
    try:  # the stage first, in a fresh process: nothing else has imported kimik3.kernels before it
        kimik3.Decoder(model, STAGE, batch_size=1, max_seq_len=16)
        out["construct"] = "constructed"
    except Exception as e:
        out["construct"] = f"{type(e).__name__}: {e}"
        out["construct_trace"] = traceback.format_exc()
    try:  # the stage class itself, past the Decoder's device check
        from kimik3.stages import get_stage
        get_stage(STAGE)(model, 1, 16)
        out["stage_init"] = "constructed"
    except Exception as e:
        out["stage_init"] = f"{type(e).__name__}: {e}"
        out["construct_trace"] = out.get("construct_trace", "") + traceback.format_exc()
    try:  # the stage's kernel loader, on the prebuilt directory it would use on the GPU
        if STAGE == "megakernel":
            import kimik3.megakernel.gpu as G
            k = G._compile("sm_90a", G.static_shapes("tiny", 1), PREBUILT, G.variant_name("tiny", 1))
        else:
            from kimik3.fused.loading import load_kernels
            from kimik3.fused.plan import fused_ops
            ops = [o for o in fused_ops("tiny", 1) if o.family == "gemv.rmsnorm"][:1]
            k = load_kernels(ops, "sm_90a", "prebuilt", PREBUILT)
        out["load"] = f"loaded {type(k).__name__}"
    except Exception as e:
        out["load"] = f"{type(e).__name__}: {e}"
        out["load_trace"] = traceback.format_exc()
    out["kernels_module"] = getattr(sys.modules.get("kimik3.kernels"), "__file__", None)
    out["cutlass_imported"] = any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
    print("RESULT " + json.dumps(out))
""")


def _bare_copy(dst: Path) -> Path:
    """kimik3/ and kernels/ as a copy of the checkout without an install or .git."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o")
    for d in ("kimik3", "kernels"):
        shutil.copytree(REPO / d, dst / d, ignore=ignore)
    return dst


def _fake_prebuilt(dst: Path) -> Path:
    """A prebuilt directory whose manifest is valid JSON but holds no kernels: the loader must get to read it."""
    dst.mkdir()
    (dst / "manifest.json").write_text(json.dumps({"arch": "sm_90a", "kernels": {}, "runtime": {}}))
    return dst


@pytest.mark.parametrize("stage", ["megakernel", "fused"])
def test_stage_from_bare_copy_without_dsl_reaches_the_cuda_call(stage: str, tmp_path: Path) -> None:
    bare = _bare_copy(tmp_path / "bare")
    prebuilt = _fake_prebuilt(tmp_path / "prebuilt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KIMIK3_PREBUILT")}
    r = subprocess.run([sys.executable, "-c", CHILD, str(bare), stage, str(prebuilt)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["kimik3"].startswith(str(bare)) and out["kernels_module"].startswith(str(bare / "kernels"))
    # construction: refused only because this machine has no CUDA device
    for key in ("construct", "stage_init"):
        assert out[key].startswith("ValueError") and "cuda" in out[key].lower(), out
    assert "ModuleNotFoundError" not in out.get("construct_trace", "") and "ImportError" not in out.get(
        "construct_trace", ""), out["construct_trace"]
    # the kernel loader: resolves kimik3.kernels and reads the prebuilt manifest (which has no such kernel)
    assert out["load"].startswith("ValueError") and "ImportError" not in out["load"], out
    assert "ModuleNotFoundError" not in out.get("load_trace", ""), out["load_trace"]
    assert ("not in" in out["load"] or "not built for sm_90a" in out["load"]), out["load"]
    assert not out["cutlass_imported"]
