"""The MXFP4 expert opcodes' tensor-core operands (``common.device.fp4_bf16x2``, ``common.device.x_pair_bf16x2``):
one 16-row x 8-token x 128-column k block built lane by lane on the host the way
``megakernel.moe.fp4_mma_tile`` lays it out (lane (g, q): group q of rows g and g + 8, x of column g), evaluated with
``megakernel.mma.mma_reference``, equals the dequantised product; and the compiled MXFP4 megakernel issues its expert
dots as ``mma.sync``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from kimik3.kernels.common import device as C  # noqa: E402
from kimik3.kernels.common.trace import host_trace  # noqa: E402
from kimik3.kernels.megakernel import mma as MM  # noqa: E402
from kimik3.kernels.verify.host_exec import _t  # noqa: E402
from kimik3.kernels.verify.host_exec_mk_moe import _mma_steps  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@cute.jit
def _lanes(mC: cute.Tensor, mS: cute.Tensor, mX: cute.Tensor, mR: cute.Tensor):
    """mC [16 rows, 4 groups, 4 words] codes, mS [16, 4] scale bytes, mX [8 tokens, 4 groups, 4 chunks, 8] bf16;
    mR [32 lanes, 4 steps, 2, 6]: the operands ``mma_chunk`` assembles from each lane's (wg, wg8, xg) registers per
    code word of its group."""
    for lane in cutlass.range(32):
        g, q = MM.lane_group(lane), MM.lane_quad(lane)
        for j in cutlass.range_constexpr(4):
            wg = C.fp4_bf16x2(mC[g, q, j], C.fp4_bf16_scale(mS[g, q]))
            wg8 = C.fp4_bf16x2(mC[g + 8, q, j], C.fp4_bf16_scale(mS[g + 8, q]))
            xg = C.x_pair_bf16x2(mX[g, q, j, None], j)
            MM.mma_chunk(None, wg, wg8, xg, mR[lane, j, None, None])


def _dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R, G, 16] code bytes (low nibble = even column), [R, G] E8M0 -> [R, 32 G] fp64."""
    b = codes.to(torch.int64)
    nib = torch.stack([b & 15, b >> 4], dim=-1).reshape(*codes.shape[:2], 32)
    v = E2M1[nib & 7].double() * torch.where(nib >= 8, -1.0, 1.0)
    return (v * torch.exp2(scales.double() - 127)[..., None]).reshape(codes.shape[0], -1)


def test_block_operands_give_the_product() -> None:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (16, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 124, (16, 4), generator=g, dtype=torch.uint8)
    x = torch.randn(8, 128, generator=g).bfloat16()
    rec = torch.full((32, 4, 2, 6), -1, dtype=torch.int32)
    args = [codes.view(torch.int32).reshape(16, 4, 4).contiguous(), scales, x.reshape(8, 4, 4, 8).contiguous(), rec]
    with host_trace():
        f = cute.compile(_lanes, *[_t(a) for a in args])
    f(*[_t(a) for a in args])
    (acc,) = _mma_steps(rec, 1)
    got = torch.empty(16, 8, dtype=torch.float64)
    for lane in range(32):
        for i in range(4):
            got[MM.acc_row(lane, i), MM.acc_col(lane, i)] = float(acc[lane, i])
    want = _dequant(codes, scales) @ x.double().T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mxfp4_megakernel_issues_mma_sync() -> None:
    """tiny B=1 with MXFP4 experts (the build the compile tests make, cached by source hash): 16 mma.sync per k block
    in EXPERT_GATE_UP (4 words x 2 weights x 2), 8 in EXPERT_DOWN, no spills."""
    from kimik3.kernels.toolchain import build as B
    from kimik3.kernels.toolchain import registry as R

    res = B.build(R.get_variant("megakernel/tiny/b1-mxfp4"), "sm_90a")
    lines = [s.strip() for s in res.ptx.splitlines() if "mma.sync" in s]
    assert len(lines) == 24 and all(s.startswith("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") for s in lines)
    assert res.resources["spill_stores"] == 0 and res.resources["spill_loads"] == 0
