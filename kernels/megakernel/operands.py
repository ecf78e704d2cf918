"""The megakernel's operand access, shared by the VM (``megakernel.py``) and every opcode module: the trace-time
context, box fields, element offsets and the staged rows of the host-chosen stage operand (``W_STAGE_*``), and the
per-instruction shared-memory scratch layout."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from kimik3.kernels.contracts.addr import elem_offset
from kimik3.kernels.contracts.isa import (
    B0,
    C0,
    OPERAND_WORDS,
    OW_BOX,
    R0,
    STAGE_BYTES,
    W_OPS,
    W_STAGE_OP,
    W_STAGE_ROWS,
)
from kimik3.kernels.megakernel.device_fns import (
    NT,
)

F32_WORDS = 4096  # per-instruction fp32 scratch (rstd, reductions, KDA vectors, router weights, arg-max partials)
I32_WORDS = 4096
F32_RED = 64  # s_f32[F32_RED : F32_RED + NW * 2 * kmax]: block reductions
F32_VEC = 1024  # s_f32[F32_VEC:]: KDA vectors / lm_head partials / router weights
PART_WORDS = STAGE_BYTES // 4  # ctx.s_part: the stage buffer as fp32 scratch (isa.STAGE_SCRATCH_OPS only)

def _pad32(n: int) -> int:
    return -(-n // 32) * 32


def _kda_groups(dk: int) -> int:
    """Row groups of the KDA state (threads per state column): the largest power of two with groups·dk <= NT
    threads and at most dk groups, so every group has the same number of rows."""
    g = 1
    while 2 * g * dk <= NT and 2 * g <= dk:
        g *= 2
    return g


# ---------------------------------------------------------------------------------------------- operand access
class _Ctx:
    """Trace-time bundle of the kernel's tensors and per-thread indices, handed to every opcode function."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@cute.jit
def _bx(ctx: _Ctx, j: Int32, f: cutlass.Constexpr) -> Int32:
    """Box field ``f`` (B0..C1) of operand ``j`` of the current instruction."""
    return ctx.s_ins[W_OPS + OPERAND_WORDS * j + OW_BOX + f]


@cute.jit
def _eoff(d1: Int32, d2: Int32, b: Int32, r: Int32, c: Int32) -> Int64:
    """Element offset of ``[b, r, c]`` in a ``[*, d1, d2]`` buffer (64-bit; ``mk_addr.elem_offset``, which the
    address replay runs on the host)."""
    return elem_offset(d1, d2, b, r, c, Int64)


@cute.jit
def _staged_rows(ctx: _Ctx, j: Int32) -> Int32:
    """Rows of operand ``j`` in this instruction's stage buffer ``ctx.s_stage`` (row ``i`` of the box at chunk
    ``i·d2/8``): the host's W_STAGE_ROWS when ``j`` is its W_STAGE_OP, else 0 (read from global memory)."""
    return ctx.s_ins[W_STAGE_ROWS] if ctx.s_ins[W_STAGE_OP] == j else Int32(0)


@cute.jit
def _row0(ctx: _Ctx, j: Int32) -> Int64:
    """Byte address of the first element of operand ``j``'s box (weights: its first row)."""
    return ctx.s_addr[j] + _eoff(ctx.s_d1[j], ctx.s_d2[j], _bx(ctx, j, B0), _bx(ctx, j, R0), _bx(ctx, j, C0)) * 2
