"""The tensor-core step (``kernels/megakernel/mma.py``): the host model of ``mma.sync.m16n8k16`` follows the PTX
fragment layout, the chunk layout's k permutation gives W·xᵀ exactly, and the device step compiles to two
``mma.sync`` per chunk for sm_90a."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Uint32  # noqa: E402
from kimik3.kernels.megakernel import mma as M  # noqa: E402
from kimik3.kernels.toolchain import dsl


def _chunk_regs(rows: torch.Tensor) -> torch.Tensor:
    """[R, 32] bf16 -> [R, 4 quads, 4] uint32 register bits of each quad's 16-byte chunk."""
    pairs = rows.float().reshape(rows.shape[0], 4, 4, 2)
    return M.f32_to_bf16x2(pairs)


@cute.jit
def _lane_chunks(mW: cute.Tensor, mX: cute.Tensor, lane: Any) -> tuple[Any, Any, Any]:
    """A lane's registers in the chunk layout: chunk q of weight rows g, g + 8 and of x row g (one k block)."""
    g, q = M.lane_group(lane), M.lane_quad(lane)
    wg = cute.make_rmem_tensor((4,), Uint32)
    wg8 = cute.make_rmem_tensor((4,), Uint32)
    xg = cute.make_rmem_tensor((4,), Uint32)
    for i in cutlass.range_constexpr(4):
        wg[i] = mW[g, 4 * q + i]
        wg8[i] = mW[g + 8, 4 * q + i]
        xg[i] = mX[g, 4 * q + i]
    return wg, wg8, xg


@cute.jit
def _lane_operands(mW: cute.Tensor, mX: cute.Tensor, mOut: cute.Tensor) -> None:
    """Every lane's chunk loads and ``mma_chunk``'s operand assembly, executed on the host: the operands land in
    mOut[lane] (2 mmas x (a0..a3, b0, b1)) instead of an mma."""
    for lane in cutlass.range(32):
        wg, wg8, xg = _lane_chunks(mW, mX, lane)
        acc = cute.make_rmem_tensor((4,), Float32)
        M.mma_chunk(acc, wg, wg8, xg, mOut[lane, None, None])


def _host_mma_chunk(acc: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``mma_chunk`` on the host: its operands as assembled by the device code, the mmas by the PTX-table model."""
    from cutlass.cute.runtime import from_dlpack

    wr = w.contiguous().view(torch.int32)  # [16, 16]: row r's 32 bf16 as 16 bf16x2 registers
    xr = x.contiguous().view(torch.int32)  # [8, 16]
    ops = torch.zeros(32, 2, 6, dtype=torch.int32)
    _lane_operands(from_dlpack(wr), from_dlpack(xr), from_dlpack(ops))
    ops = ops.to(torch.int64) & 0xFFFFFFFF
    for h in range(2):
        acc = M.mma_reference(ops[:, h, :4], ops[:, h, 4:], acc)
    return acc


def _matrix(frags: torch.Tensor) -> torch.Tensor:
    out = torch.empty(16, 8)
    for lane in range(32):
        for i in range(4):
            out[M.acc_row(lane, i), M.acc_col(lane, i)] = frags[lane, i]
    return out


def test_chunk_layout_gives_the_product() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=g).bfloat16()
    x = torch.randn(8, 64, generator=g).bfloat16()
    acc = torch.zeros(32, 4)
    for kb in range(2):
        acc = _host_mma_chunk(acc, w[:, 32 * kb:32 * kb + 32], x[:, 32 * kb:32 * kb + 32])
    ref = w.double() @ x.double().T
    torch.testing.assert_close(_matrix(acc).double(), ref, rtol=1e-5, atol=1e-5)


def test_reference_is_the_ptx_layout() -> None:
    """One nonzero element at a time lands where the PTX ISA's fragment tables put it."""
    a = torch.zeros(32, 4, dtype=torch.int64)
    b = torch.zeros(32, 2, dtype=torch.int64)
    one = int(M.f32_to_bf16x2(torch.tensor([1.0, 0.0])))
    a[5, 2] = one  # lane 5: g = 1, q = 1; a2 low half = (row 1, k 2q + 8 = 10)
    for lane in range(32):  # B = ones on k 10 for every column: lane (g, q=1) holds b1 = (k 10, 11)
        if lane % 4 == 1:
            b[lane, 1] = one
    d = _matrix(M.mma_reference(a, b))
    assert d[1].tolist() == [1.0] * 8 and d.abs().sum().item() == 8.0


def test_accumulator_layout_is_the_ptx_table() -> None:
    """c0..c3 of m16n8k16 with fp32 accumulators (PTX ISA): row groupID (+8 for c2, c3), column 2·(lane % 4) + (i & 1)
    — pinned to literal values, since acc_row / acc_col also drive mma_reference and every checker."""
    assert [(M.acc_row(5, i), M.acc_col(5, i)) for i in range(4)] == [(1, 2), (1, 3), (9, 2), (9, 3)]
    assert [(M.acc_row(30, i), M.acc_col(30, i)) for i in range(4)] == [(7, 4), (7, 5), (15, 4), (15, 5)]
    assert (M.lane_group(30), M.lane_quad(30)) == (7, 2)


def test_reference_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="32, 4"):
        M.mma_reference(torch.zeros(16, 4, dtype=torch.int64), torch.zeros(32, 2, dtype=torch.int64))


def test_step_compiles_to_mma_sync(tmp_path) -> None:
    @cute.kernel
    def kern(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor) -> None:
        lane = cute.arch.lane_idx()
        wg, wg8, xg = _lane_chunks(mW, mX, lane)
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        M.mma_chunk(acc, wg, wg8, xg)
        for i in cutlass.range_constexpr(4):
            mO[lane, i] = acc[i]

    @cute.jit
    def host(mW: cute.Tensor, mX: cute.Tensor, mO: cute.Tensor, stream: object) -> None:
        kern(mW, mX, mO).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    os.makedirs(tmp_path, exist_ok=True)
    with dsl.dump_dir_scope(tmp_path), dsl.arch_scope("sm_90a"):
        compiled = cute.compile(host, dsl.fake(Uint32, (16, 16)), dsl.fake(Uint32, (8, 16)), dsl.fake(Float32, (32, 4)),
                                dsl.fake_stream(), options=dsl.compile_options("sm_90a"))
        ptx = dsl.artifact_text(compiled.__ptx__)
    lines = [s.strip() for s in ptx.splitlines() if "mma.sync" in s]
    assert len(lines) == 2, lines
    assert all(s.startswith("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") for s in lines)
