"""Every kernel variant on a real GPU vs its PyTorch reference (skipped without CUDA).

tiny and k3-shard shapes, batch 1 / 8 / 64 (the registry's full matrix). Outputs are poisoned with
NaN (or -1) before the launch, so an element the kernel does not write fails. Metric (validation.md):
e = ‖a − b‖₂ / ‖b‖₂ in float64, e ≤ 1e-2 for bf16 outputs with fp32 accumulation, e ≤ 1e-5 for the
fp32 KDA state. Every kernel here is deterministic (no atomics), so a second launch on the same
inputs must reproduce the outputs bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kimik3.kernels.toolchain import registry as R  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 1e-2
TOL_STATE = 1e-5
_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def _arch() -> str:
    cc = torch.cuda.get_device_capability()
    if cc not in _ARCHS:
        pytest.skip(f"no kernels built for compute capability {cc}")
    return _ARCHS[cc]


def _tvm_ffi() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "NaN/inf (or an unwritten, poisoned element) in the kernel output"
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def _exact_torch_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the references are fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
    torch.cuda.empty_cache()


def _run(v: R.KernelVariant, compiled: Any, t: dict[str, Any], tvm_ffi: bool) -> dict[str, Any]:
    """Launch on a copy of the inputs (the KDA state is updated in place); return the copy."""
    run = {k: x.clone() if isinstance(x, torch.Tensor) else x for k, x in t.items()}
    v.module.launch(compiled, v.variant, run, tvm_ffi=tvm_ffi)
    torch.cuda.synchronize()
    return run


def _routing_matrix(ids: torch.Tensor, w: torch.Tensor, E: int) -> torch.Tensor:
    dense = torch.zeros(ids.shape[0], E, dtype=torch.float64, device=ids.device)
    return dense.scatter_(1, ids.long(), w.double())


def _compare(v: R.KernelVariant, out: dict[str, Any], ref: dict[str, torch.Tensor], t: dict[str, Any]) -> None:
    fam = v.family
    if fam == "router":
        E = v.shapes["E"]
        ids = out["ids"]
        assert ((ids >= 0) & (ids < E)).all(), "expert id out of range"
        assert all(len(set(row.tolist())) == ids.shape[1] for row in ids.cpu()), "duplicate expert ids"
        assert err(out["scores"], ref["scores"]) <= TOL
        assert err(_routing_matrix(ids, out["weights"], E), _routing_matrix(ref["ids"], ref["weights"], E)) <= TOL
    elif fam == "gemv.lm_head":
        assert err(out["logits"], ref["logits"]) <= TOL
        assert torch.equal(out["token"].long(), out["logits"].argmax(-1)), "token is not the arg-max of its logits"
        picked = ref["logits"].gather(1, out["token"].long()[:, None])[:, 0]
        gap = ref["logits"].max(-1).values - picked  # a different token only within a near-tie
        assert (gap <= 1e-2 * ref["logits"].abs().max(-1).values).all()
    elif fam == "kda":
        assert err(out["out"], ref["out"]) <= TOL
        assert err(out["S"], ref["S"]) <= TOL_STATE
        assert torch.equal(out["conv"], ref["conv"].to(out["conv"].dtype))
    else:
        for name in v.module.OUTPUTS[v.variant]:
            assert err(out[name], ref[name]) <= TOL, name


@pytest.mark.parametrize("v", R.all_variants(), ids=lambda v: v.name)
def test_kernel_matches_reference(v: R.KernelVariant) -> None:
    arch = _arch()
    if arch not in v.archs:
        pytest.skip(f"{v.name} does not support {arch}")
    tvm_ffi = _tvm_ffi()
    compiled = v.compile(arch, tvm_ffi=tvm_ffi)
    t = v.reference.make_inputs(v.variant, **v.shapes, **v.runtime, device="cuda", seed=v.batch)
    ref = v.reference.reference(v.variant, {k: x.clone() if isinstance(x, torch.Tensor) else x for k, x in t.items()},
                                **v.shapes, **v.runtime)
    out = _run(v, compiled, t, tvm_ffi)
    _compare(v, out, ref, t)
    again = _run(v, compiled, t, tvm_ffi)  # deterministic: bitwise identical on a second launch
    for name in v.module.OUTPUTS[v.variant]:
        assert torch.equal(out[name], again[name]), f"{name} differs between two launches"
