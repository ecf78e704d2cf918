"""The native executor's hot loops alone (``kimik3/megakernel/cpu_simd.h``), in the form this machine's build has
(AVX-512, AVX2 + FMA or the portable loops: ``cpu.simd_width``).

Expectation sources:

* GEMV: float64 ``x @ W.T`` on fresh random inputs, within the dot-product error bound ``K·eps·(|x| @ |W|.T)``,
  for fp32 and bf16 weights, every tail of the vector width (K from 1 to 2 widths + 1), row counts around the
  register blocks, batches 1–9, 33 and 64; outputs start as NaN, so an element the kernel skips fails;
* the kernels' own claim, bit for bit: a row's result does not depend on how many other weight rows or batch rows
  share the call;
* activations: float64 torch (exp, tanh, sigmoid, silu) within a few fp32 ulps, over the denormal, overflow and
  NaN ranges; bf16 rounding equal to torch's ``.to(torch.bfloat16)`` bit for bit (ties, NaN, inf included).
"""

from __future__ import annotations

import pytest
import torch

from kimik3.megakernel import cpu

try:
    cpu.find_compiler()
    HAVE_CXX = True
except ValueError:
    HAVE_CXX = False
pytestmark = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler on this machine (the stage refuses, tested)")

EPS32 = torch.finfo(torch.float32).eps


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_the_build_uses_the_widest_vectors_the_cpu_has():
    width, flags = cpu.simd_width(), _cpu_flags()
    assert width in (1, 8, 16)
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        assert width == 16
    elif {"avx2", "fma"} <= flags:
        assert width == 8


def _check_gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = cpu.probe_gemv(w, x)
    ref = x.double() @ w.double().T
    bound = w.shape[1] * EPS32 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert not torch.isnan(y).any(), "an output element was never written"
    assert ((y.double() - ref).abs() <= bound).all(), (w.shape, x.shape, ((y.double() - ref).abs() / bound).max())
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_every_tail_and_block_edge(dtype):
    g = torch.Generator().manual_seed(5)
    W = max(8, cpu.simd_width())
    for K in sorted({1, 3, W - 1, W, W + 1, 2 * W + 1, 100, 384}):
        for rows in (1, 3, 9, 17):
            for nb in (1, 2, 3, 4, 5, 8, 9):
                w = torch.randn(rows, K, generator=g).to(dtype)
                _check_gemv(w, torch.randn(nb, K, generator=g))


@pytest.mark.parametrize("nb", [33, 64])
def test_gemv_full_batches(nb):
    g = torch.Generator().manual_seed(nb)
    for dtype in (torch.float32, torch.bfloat16):
        _check_gemv(torch.randn(21, 200, generator=g).to(dtype), torch.randn(nb, 200, generator=g))


def test_a_rows_result_does_not_depend_on_what_shares_the_call():
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        w, x = torch.randn(19, 133, generator=g).to(dtype), torch.randn(9, 133, generator=g)
        full = cpu.probe_gemv(w, x)
        for b in (0, 4, 8):
            assert torch.equal(cpu.probe_gemv(w, x[b:b + 1])[0], full[b])
        for r in (0, 8, 18):
            assert torch.equal(cpu.probe_gemv(w[r:r + 1], x)[:, 0], full[:, r])


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    wide = torch.cat([torch.linspace(-110, 95, 4001), torch.randn(2000, generator=g) * 4,
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.6249, 0.625, 0.6251, -0.625, 87.0, 88.7, 89.0,
                                    -87.0, -103.9, -104.0, float("inf"), float("-inf"), float("nan")])])
    return wide[torch.randperm(len(wide), generator=g)]  # every position of a vector sees every kind of value


# Below about -88.7, 1 + exp(-x) overflows fp32 in x / (1 + exp(-x)) (the executor's form and the scalar libm one
# alike) while the true sigmoid / silu is under 1e-37: an absolute floor there; exp's own denormals are held to two
# of their ulps.
@pytest.mark.parametrize("name,ref,floor", [
    ("exp", torch.exp, 2 * 2.0**-149), ("tanh", torch.tanh, 2 * 2.0**-149),
    ("sigmoid", torch.sigmoid, 1e-36), ("silu", torch.nn.functional.silu, 1e-35)])
def test_activations_within_a_few_ulps(name, ref, floor):
    x = _inputs()
    for n in (len(x), 1, 7, 9, 17):  # and the tails
        y, want = cpu.probe_activation(name, x[:n]), ref(x[:n].double())
        assert torch.equal(torch.isnan(y), torch.isnan(want.float())), name
        ok = ~torch.isnan(want)
        got, w = y[ok].double(), want[ok]
        err = (got - w).abs()
        bound = 4 * EPS32 * w.abs() + floor
        inf = torch.isinf(w) | (w.abs() > torch.finfo(torch.float32).max)
        assert torch.equal(got[inf], w[inf].float().double()), name
        assert (err[~inf] <= bound[~inf]).all(), (name, (err / bound)[~inf].max(), x[:n][ok][~inf][
            (err / bound)[~inf].argmax()])


def test_bf16_rounding_is_torchs_bit_for_bit():
    g = torch.Generator().manual_seed(9)
    bits = torch.randint(-2**31, 2**31 - 1, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**15, (2000,), generator=g, dtype=torch.int32) << 16) | 0x8000  # exact halves
    x = torch.cat([bits, ties]).view(torch.float32)
    x = torch.cat([x, torch.tensor([float("inf"), float("-inf"), float("nan"), 3.3895e38, -0.0])])
    for n in (len(x), 5, 13):
        y, want = cpu.probe_activation("bf16", x[:n]), x[:n].to(torch.bfloat16).float()
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(y), nan)
        assert torch.equal(y[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_probes_refuse_what_they_do_not_take():
    with pytest.raises(ValueError, match="probe_gemv"):
        cpu.probe_gemv(torch.zeros(2, 3, dtype=torch.float16), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="probe_gemv"):
        cpu.probe_gemv(torch.zeros(2, 3), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="probe_activation"):
        cpu.probe_activation("gelu", torch.zeros(3))


def test_an_installed_package_carries_every_source_the_build_reads():
    """The executor compiles at first use from files shipped beside it: each must match the package data that a
    (non-editable) install copies."""
    import fnmatch
    import re
    from pathlib import Path

    from kimik3.megakernel import cpu_tsan

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()  # (no tomllib before Python 3.11)
    section = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    patterns = re.findall(r'"([^"]+)"', re.search(r'^"kimik3\.megakernel"\s*=\s*\[(.*)\]', section, re.M).group(1))
    for src in (cpu.SOURCE, cpu.SIMD_SOURCE, cpu_tsan.DRIVER):
        assert src.is_file() and any(fnmatch.fnmatch(src.name, p) for p in patterns), (src.name, patterns)
