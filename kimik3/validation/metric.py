"""The project's one error metric and tolerance table, transcribed from ``docs/validation.md``.

Tests, the validation matrix and the benchmarks import these; none carries numbers of its own.
"""

from __future__ import annotations

import torch

__all__ = ["rel_error", "TOL", "poison", "assert_close"]

# validation.md "Tolerances"
TOL = {
    "fp32_stage": 1e-4,  # fp32 stage vs fp32 naive, per step; plus identical greedy tokens
    "fp32_oracle": 1e-4,  # fp32 naive vs transformers / golden fixtures, per step; identical greedy tokens
    "bf16_stage": 3e-2,  # bf16 stage vs fp32 reference, teacher-forced, per step (micro/tiny)
    "kernel_bf16": 1e-2,  # one GPU kernel, bf16 in/out, fp32 accumulation, vs its fp32 reference
    "kernel_state_fp32": 1e-5,  # one GPU kernel's fp32 state (KDA S) vs fp32 reference
    "expert_parallel": 1e-4,  # expert-parallel decode (fp32) vs single process, per step
    # MXFP4 unpack/dequantise vs the §5.5 rule: bitwise equal (checked with torch.equal, no tolerance)
}


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """e(a, b) = ‖a − b‖₂ / ‖b‖₂ in float64 over the whole tensor. NaN/inf anywhere gives inf (always fails)."""
    if a.shape != b.shape:
        raise ValueError(f"rel_error: shapes differ {list(a.shape)} vs {list(b.shape)}")
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return float("inf")
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or the max value for integer buffers) before the code under test writes it."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: str | float, what: str = "") -> float:
    """Assert e(a, b) ≤ the named tolerance (or a number from TOL); returns e for reporting."""
    bound = TOL[tol] if isinstance(tol, str) else tol
    e = rel_error(a, b)
    assert e <= bound, f"{what}: relative error {e:.3e} > {bound:.0e} ({tol})"
    return e
