"""The warp-level tensor-core step of the megakernel's weight-streaming opcodes: ``mma.sync.aligned.m16n8k16``,
bf16 inputs, fp32 accumulators, and its fragment layout written down once for the device code and the host.

Lane ``l`` is (group ``g = l // 4``, quad ``q = l % 4``); per 32-element k block it loads chunk ``q`` of weight rows
``g``, ``g + 8`` and of x row ``g`` as ``CHUNK_REGS`` bf16x2 registers each, so every lane loads whole 16-byte
chunks of row-major weights. Device side: :func:`mma_bf16`, :func:`mma_chunk`; layout: :func:`lane_group`,
:func:`lane_quad`, :func:`acc_row`, :func:`acc_col`; host side: :func:`mma_reference` evaluates the PTX fragment
layout exactly (an ``mma.sync`` aborts a host execution), with :func:`bf16x2_to_f32` / :func:`f32_to_bf16x2`.
Design: why mma at batch 8, the k bijection and the PTX fragment layout:
docs/architecture.md#appendix-design-notes-by-room (``kernels/megakernel/mma.py``).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

__all__ = ["MMA_ROWS", "MMA_COLS", "MMA_K", "CHUNK_K", "CHUNK_REGS", "lane_group", "lane_quad", "acc_row",
           "acc_col", "mma_bf16", "mma_chunk", "mma_reference", "bf16x2_to_f32", "f32_to_bf16x2"]

MMA_ROWS = 16  # weight rows per mma (M)
MMA_COLS = 8  # batch columns per mma (N)
MMA_K = 16  # k per mma
CHUNK_K = 32  # k per lane-quad chunk step: 4 lanes x 8 bf16
CHUNK_REGS = 4  # bf16x2 registers in one 16-byte chunk

_MMA_PTX = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


def lane_group(lane: Any) -> Any:
    """Row (of A and C) and batch column (of B) group of a lane: lane // 4."""
    return lane // 4


def lane_quad(lane: Any) -> Any:
    """Quad index of a lane (its k pair in A / B, its column pair in C): lane % 4."""
    return lane % 4


def acc_row(lane: Any, i: int) -> Any:
    """Tile row of accumulator register ``i`` (0..3) of ``lane``."""
    return lane // 4 + 8 * (i // 2)


def acc_col(lane: Any, i: int) -> Any:
    """Batch column of accumulator register ``i`` (0..3) of ``lane``."""
    return 2 * (lane % 4) + i % 2


@dsl_user_op
def _mma_16816(a0: Any, a1: Any, a2: Any, a3: Any, b0: Any, b1: Any, c0: Any, c1: Any, c2: Any, c3: Any, *,
               loc: Any = None, ip: Any = None) -> tuple[Float32, Float32, Float32, Float32]:
    args = [Uint32(v).ir_value(loc=loc, ip=ip) for v in (a0, a1, a2, a3, b0, b1)]
    args += [Float32(v).ir_value(loc=loc, ip=ip) for v in (c0, c1, c2, c3)]
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * 4), args, _MMA_PTX,
                          "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@cute.jit
def mma_bf16(acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor) -> None:
    """``acc += A·B`` for one m16n8k16 tile: ``acc`` (4,) fp32 registers (c0..c3), ``a`` (4,) uint32 bf16x2
    registers (a0..a3), ``b`` (2,) uint32 (b0, b1). Warp-collective and device-only."""
    d = _mma_16816(a[0], a[1], a[2], a[3], b[0], b[1], acc[0], acc[1], acc[2], acc[3])
    for i in cutlass.range_constexpr(4):
        acc[i] = d[i]


@cute.jit
def mma_chunk(acc: cute.Tensor, wg: cute.Tensor, wg8: cute.Tensor, xg: cute.Tensor, sink: Any = None) -> None:
    """One 32-element k block in the chunk layout (module docstring): ``wg``, ``wg8``, ``xg`` are the lane's (4,)
    uint32 registers of its chunk of weight rows g and g + 8 and of x row g. Two ``mma.sync``.

    ``sink`` (host execution only): a (2, 6) uint32 tensor that receives each mma's operands (a0..a3, b0, b1) instead
    of issuing it, so a host run evaluates exactly the registers assembled here with :func:`mma_reference`."""
    for h in cutlass.range_constexpr(2):
        a = cute.make_rmem_tensor((4,), Uint32)
        b = cute.make_rmem_tensor((2,), Uint32)
        a[0] = wg[2 * h]
        a[1] = wg8[2 * h]
        a[2] = wg[2 * h + 1]
        a[3] = wg8[2 * h + 1]
        b[0] = xg[2 * h]
        b[1] = xg[2 * h + 1]
        if cutlass.const_expr(sink is None):
            mma_bf16(acc, a, b)
        else:
            for i in cutlass.range_constexpr(4):
                sink[h, i] = a[i]
            for i in cutlass.range_constexpr(2):
                sink[h, 4 + i] = b[i]


# --------------------------------------------------------------------------------------------- host side
def bf16x2_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """uint32 bf16x2 register bits (any integer dtype holding them) -> [..., 2] fp32 (low half first)."""
    v = bits.to(torch.int64) & 0xFFFFFFFF
    lo = ((v & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    hi = (((v >> 16) & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    return torch.stack([lo, hi], dim=-1)


def f32_to_bf16x2(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] values -> the int64 bits of their bf16x2 register (round to nearest even), low half first."""
    h = pairs.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return h[..., 0] | (h[..., 1] << 16)


def mma_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """Host evaluation of ``mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`` on register fragments.

    ``a`` [..., 32, 4] and ``b`` [..., 32, 2]: the lanes' uint32 bf16x2 registers (as integers); ``c`` [..., 32, 4]
    fp32 or None (zeros). Returns D [..., 32, 4] fp32 in the C layout. Products of bf16 are exact in fp32; the
    sum is taken in fp64 and rounded once (the hardware's order inside one mma is unspecified)."""
    if a.shape[-2:] != (32, 4) or b.shape[-2:] != (32, 2):
        raise ValueError(f"mma_reference: a must be [..., 32, 4] and b [..., 32, 2], got {list(a.shape)}, "
                         f"{list(b.shape)}")
    lead = a.shape[:-2]
    A = torch.zeros(*lead, MMA_ROWS, MMA_K, dtype=torch.float64)
    Bm = torch.zeros(*lead, MMA_K, MMA_COLS, dtype=torch.float64)
    av = bf16x2_to_f32(a).to(torch.float64)  # [..., 32, 4, 2]
    bv = bf16x2_to_f32(b).to(torch.float64)  # [..., 32, 2, 2]
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for r, (row, k0) in enumerate(((g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8))):
            A[..., row, k0:k0 + 2] = av[..., lane, r, :]
        for r, k0 in enumerate((2 * q, 2 * q + 8)):
            Bm[..., k0:k0 + 2, g] = bv[..., lane, r, :]
    D = A @ Bm
    if c is not None:
        D = D + _c_matrix(c)
    out = torch.empty(*lead, 32, 4, dtype=torch.float32)
    for lane in range(32):
        for i in range(4):
            out[..., lane, i] = D[..., acc_row(lane, i), acc_col(lane, i)].to(torch.float32)
    return out


def _c_matrix(c: torch.Tensor) -> torch.Tensor:
    """C fragments [..., 32, 4] -> the [..., 16, 8] fp64 matrix."""
    M = torch.zeros(*c.shape[:-2], MMA_ROWS, MMA_COLS, dtype=torch.float64)
    for lane in range(32):
        for i in range(4):
            M[..., acc_row(lane, i), acc_col(lane, i)] = c[..., lane, i].to(torch.float64)
    return M
