"""The MXFP4 tensor-core operand decode (``common.device.fp4_bf16x2``: integer placement of each E2M1 code as the bf16
E2M1 · 2^-126, one bf16x2 multiply by 2^(e - 1), a second by ``fp4_scale_hi`` for scale bytes above 128), run on
the host as the expert opcodes run it (``fp4_group_scales``, ``fp4_decode_pair``: two groups at a time, a scale byte
<= 128 next to one above, so the branch must rescale each by its own factor): every code 0..15 in every column of a
word and in both register halves, at scale bytes covering the subnormal results, the common range, 128 / 129 (the
two-factor boundary) and 254, bitwise against
``kimik3.model.quant.mxfp4_dequantize`` (the bf16 subnormal results of scale bytes 0 and 1 as the host's conversion
flushes them, ``_host_flush``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Uint32  # noqa: E402
from kimik3.kernels.common import device as C  # noqa: E402
from kimik3.kernels.common.trace import host_trace  # noqa: E402
from kimik3.kernels.verify.host_exec import _t  # noqa: E402

from kimik3.model.quant import mxfp4_dequantize  # noqa: E402

SCALES = [0, 1, 100, 127, 128, 129, 200, 254]


@cute.jit
def _decode(mW: cute.Tensor, mE: cute.Tensor, mR: cute.Tensor):
    """mW [n] code words, mE [m] scale bytes -> mR [m, n, 2, 4]: [k, i, 0] word i at scale byte k (the lane's row g),
    [k, i, 1] word n - 1 - i at scale byte k + 1 (mod m; its row g + 8), as the expert opcodes build them."""
    m, n = cute.size(mE), cute.size(mW)
    for k in cutlass.range(m):
        e, e8 = mE[k], mE[(k + 1) % m]
        scales = C.fp4_group_scales(e, e8, Uint32(0xFFFFFFFF))
        for i in cutlass.range(n):
            t, t8 = C.fp4_decode_pair(Uint32(mW[i]), Uint32(mW[n - 1 - i]), e, e8, scales)
            for s in cutlass.range_constexpr(4):
                mR[k, i, 0, s] = Int32(t[s])
                mR[k, i, 1, s] = Int32(t8[s])


def _words() -> torch.Tensor:
    """Every code in every column: word i holds code (i + c) % 16 in column c, i = 0..15, plus random words."""
    cols = (torch.arange(16)[:, None] + torch.arange(8)[None, :]) % 16
    det = (cols << (4 * torch.arange(8))).sum(-1)
    rnd = torch.randint(0, 2**32, (16,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    return torch.cat([det, rnd])


def _host_flush(v: torch.Tensor) -> torch.Tensor:
    """The host execution's f32 -> bf16 conversion (under the bf16 multiply) flushes bf16 subnormal results to a
    signed zero; the GPU's mul.rn.bf16x2 keeps them (PTX: bf16 arithmetic has no flush-to-zero mode). Only scale
    bytes 0 and 1 produce them (E2M1 · 2^(e - 127) < 2^-126)."""
    sub = (v != 0) & (v.abs() < 2.0**-126)
    return torch.where(sub, torch.copysign(torch.zeros_like(v), v), v)


def test_decode_bitwise_against_dequantisation() -> None:
    words = _words()
    scales = torch.tensor(SCALES, dtype=torch.uint8)
    m, n = len(SCALES), len(words)
    out = torch.full((m, n, 2, 4), 0x7FC07FC0, dtype=torch.int32)
    args = [words.to(torch.int32), scales, out]  # int32 bits of the uint32 words
    with host_trace():
        f = cute.compile(_decode, *[_t(a) for a in args])
    f(*[_t(a) for a in args])
    # register s, half hi = column s + 4 hi of the word
    got = out.view(torch.int16).view(torch.bfloat16).reshape(m, n, 2, 4, 2).transpose(-1, -2).reshape(m, n, 2, 8)
    packed = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], -1).to(torch.uint8).reshape(1, 4 * n)
    want = torch.stack([_host_flush(mxfp4_dequantize(packed, torch.full((1, n // 4), e, dtype=torch.uint8)))
                        .reshape(n, 8) for e in SCALES])
    for k, e in enumerate(SCALES):
        assert torch.equal(got[k, :, 0].view(torch.int16), want[k].view(torch.int16)), f"scale byte {e}"
        w8 = want[(k + 1) % m].flip(0)  # word n - 1 - i at the next scale byte
        assert torch.equal(got[k, :, 1].view(torch.int16), w8.view(torch.int16)), f"scale byte {SCALES[(k + 1) % m]}"
