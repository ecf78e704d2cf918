"""Megakernel device code across ranks: ALLREDUCE_MIX, MOE_COMBINE, and the VM's cross-rank half — a PUSH operand's
box copied to every peer of the instruction's range, the per-source counter words a wait polls and a signal adds to
(the protocol: ``kernels/contracts/peers.py``; design: docs/architecture.md#megakernel-across-ranks).

As in ``misc.py``, the GPU-only layer (thread indices, the copies, the system-scope atomics) wraps ``@cute.jit``
helpers that take the batch row, chunk or work item as plain integers (``allreduce_chunk``, ``combine_chunk``,
``combine_norm_chunk``, ``push_geometry``, ``push_span``, ``dtype_bytes``), which
``kernels/verify/host_exec_mk_ranks.py`` runs on the host. Compiled into a kernel built for rank programs only
(``MKConfig.ranks``); a rank's peers are other GPUs, so every cross-rank signal is a release and every poll of a
cross-rank word an acquire at system scope.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from kimik3.kernels.contracts.addr import peer_address, push_item
from kimik3.kernels.contracts.isa import (
    B0,
    B1,
    C0,
    C1,
    CODE_BYTES,
    OPERAND_WORDS,
    OW_MODE,
    R0,
    R1,
    W_ARGS,
    W_OPS,
    Mode,
)
from kimik3.kernels.megakernel.device_fns import NT, NW, VEC, block_allreduce, gchunks, gflat
from kimik3.kernels.megakernel.misc import mix_one_row
from kimik3.kernels.megakernel.operands import F32_RED, _bx, _Ctx, _eoff

MODE_READ, MODE_PUSH = int(Mode.READ), int(Mode.PUSH)
# ALLREDUCE_MIX's mix operands: the stream before the entry (1), the norm weight (3), the projection (4), the mix (5)
ALLREDUCE_MIX_OPS = (1, 3, 4, 5)


@cute.jit
def operand_mode(ctx: _Ctx, j: Int32) -> Int32:
    """Operand ``j``'s mode word (``isa.Mode`` bits)."""
    return ctx.s_ins[W_OPS + OPERAND_WORDS * j + OW_MODE]


# ---------------------------------------------------------------------------------------------- ALLREDUCE_MIX
@cute.jit
def allreduce_chunk(ctx: _Ctx, b: Int32, c: Int32, ro: cute.Tensor) -> Int64:
    """Chunk ``c`` (8 columns) of batch row ``b``: every rank's partial in the mailbox (operand 0, ``[b, R0 + r, :]``
    for the box's rows, in source rank order) summed in fp32 in that order — the interpreter's, so every rank
    computes the same bits — and added to the block's partial sum (operand 2, ``f32(entry) + sum``) when that
    operand reads; into ``ro`` as bf16. Returns the element offset of the chunk in operand 2."""
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    r0, r1 = _bx(ctx, 0, R0), _bx(ctx, 0, R1)
    rv = cute.make_rmem_tensor((VEC,), BFloat16)
    acc = cute.make_rmem_tensor((VEC,), Float32)
    first = gchunks(ctx.s_addr[0] + _eoff(ctx.s_d1[0], ctx.s_d2[0], b, r0, Int32(0)) * 2)
    cute.copy(ld, first[(c, None)], rv)
    acc.store(rv.load().to(Float32))
    for r in cutlass.range(r0 + 1, r1, unroll=1):
        part = gchunks(ctx.s_addr[0] + _eoff(ctx.s_d1[0], ctx.s_d2[0], b, r, Int32(0)) * 2)
        cute.copy(ld, part[(c, None)], rv)
        acc.store(acc.load() + rv.load().to(Float32))
    eo = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, _bx(ctx, 2, R0), Int32(0)) + Int64(c) * VEC
    if (operand_mode(ctx, Int32(2)) & MODE_READ) != 0:
        ent = gchunks(ctx.s_addr[2] + eo * 2)
        cute.copy(ld, ent[(0, None)], rv)
        acc.store(rv.load().to(Float32) + acc.load())
    ro.store(acc.load().to(BFloat16))
    return eo


@cute.jit
def op_allreduce_mix(ctx: _Ctx) -> None:
    """ALLREDUCE_MIX: per batch row, every rank's partial summed in rank order into the block's partial sum
    (``allreduce_chunk``: each thread its chunks c = tidx, tidx + NT, ...), then the AttnRes mix over the stream
    entries, the one just summed last (``misc.mix_one_row`` on operands 1, 3, 4, 5: the same thread reads back the
    chunks it stored, so no barrier between). Known limits: the partials of all W ranks are read from L2 one rank
    after another; W = 32 and a 7168-wide row is 458 KB per batch row."""
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    ro = cute.make_rmem_tensor((VEC,), BFloat16)
    nch = ctx.s_d2[2] // VEC
    for b in cutlass.range(_bx(ctx, 2, B0), _bx(ctx, 2, B1), unroll=1):
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            eo = allreduce_chunk(ctx, b, c, ro)
            cute.copy(st, ro, gchunks(ctx.s_addr[2] + eo * 2)[(0, None)])
        mix_one_row(ctx, b, ALLREDUCE_MIX_OPS)


# ---------------------------------------------------------------------------------------------- MOE_COMBINE
@cute.jit
def combine_chunk(ctx: _Ctx, b: Int32, c: Int32, ro: cute.Tensor) -> Float32:
    """Chunk ``c`` (8 latent columns) of batch row ``b``: every rank's fp32 expert partial in the mailbox (operand 0,
    ``[b, R0 + r, C0 + 8c + k]`` for the box's rows, in source rank order) summed in fp32 in that order, into ``ro``
    as bf16 (the cast the single-GPU step makes once). Returns the sum of the bf16 values squared: the chunk's share
    of the latent norm's mean square."""
    r0, r1 = _bx(ctx, 0, R0), _bx(ctx, 0, R1)
    mb = gflat(Float32, ctx.s_addr[0])
    acc = cute.make_rmem_tensor((VEC,), Float32)
    acc.fill(0.0)
    for r in cutlass.range(r0, r1, unroll=1):
        row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, r, _bx(ctx, 0, C0) + c * VEC)
        for k in cutlass.range_constexpr(VEC):
            acc[k] = acc[k] + mb[row + k]
    ro.store(acc.load().to(BFloat16))
    v = ro.load().to(Float32)
    return (v * v).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)


@cute.jit
def combine_out(ctx: _Ctx, b: Int32, c: Int32, jo: Int32) -> Int64:
    """Element offset of chunk ``c`` of batch row ``b`` in MOE_COMBINE's output (operand ``jo``, the last)."""
    return _eoff(ctx.s_d1[jo], ctx.s_d2[jo], b, _bx(ctx, jo, R0), _bx(ctx, jo, C0) + c * VEC)


@cute.jit
def combine_rstd(ctx: _Ctx, sumsq: Float32, n: Int32) -> Float32:
    """The latent norm's ``rsqrt(mean(x²) + eps)`` over a row of ``n`` values whose squares sum to ``sumsq``."""
    return cute.math.rsqrt(sumsq / Float32(n) + ctx.cfg.eps, fastmath=False)


@cute.jit
def combine_norm_chunk(ctx: _Ctx, c: Int32, rstd: Float32, ro: cute.Tensor) -> None:
    """Chunk ``c`` of the summed row (in ``ro``, bf16) normalised as ``kimik3.model.modeling.rms_norm`` does it:
    ``bf16(γ · bf16(x · rstd))`` with γ the latent norm weight (operand 1)."""
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    rg = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.copy(ld, gchunks(ctx.s_addr[1])[(c, None)], rg)
    xn = (ro.load().to(Float32) * rstd).to(BFloat16)
    ro.store((rg.load().to(Float32) * xn.to(Float32)).to(BFloat16))


@cute.jit
def op_moe_combine(ctx: _Ctx) -> None:
    """MOE_COMBINE: per batch row of the output box, every rank's fp32 latent partial summed in rank order and cast
    to bf16 (``combine_chunk``: each thread its chunks c = tidx, tidx + NT, ...); with the latent norm (args 0)
    one CTA reduction of the squares, the rstd (``combine_rstd``), and each thread normalises the chunks it stored
    (``combine_norm_chunk``: it reads back its own stores, so no barrier between). Known limits: the partials are
    read with 4-byte loads, one rank after another (W = 32 ranks and a 3584-wide latent are 458 KB per row)."""
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    norm = ctx.s_ins[W_ARGS]
    jo = Int32(1) + (Int32(1) if norm != 0 else Int32(0))
    n = _bx(ctx, 0, C1) - _bx(ctx, 0, C0)
    nch = n // VEC
    ro = cute.make_rmem_tensor((VEC,), BFloat16)
    vals = cute.make_rmem_tensor((1,), Float32)
    s_red = cute.make_tensor(ctx.s_f32.iterator + F32_RED, cute.make_layout(NW))
    for b in cutlass.range(_bx(ctx, jo, B0), _bx(ctx, jo, B1), unroll=1):
        vals[0] = Float32(0.0)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            vals[0] = vals[0] + combine_chunk(ctx, b, c, ro)
            cute.copy(st, ro, gchunks(ctx.s_addr[jo] + combine_out(ctx, b, c, jo) * 2)[(0, None)])
        if norm != 0:
            block_allreduce(vals, s_red, 1)
            rstd = combine_rstd(ctx, vals[0], n)
            for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
                at = gchunks(ctx.s_addr[jo] + combine_out(ctx, b, c, jo) * 2)
                cute.copy(ld, at[(0, None)], ro)
                combine_norm_chunk(ctx, c, rstd, ro)
                cute.copy(st, ro, at[(0, None)])


# ---------------------------------------------------------------------------------------------- pushes
@cute.jit
def dtype_bytes(code: Int32) -> Int32:
    """Bytes per element of buffer-table dtype ``code`` (``isa.CODE_BYTES``)."""
    out = Int32(0)
    for k, v in CODE_BYTES.items():
        if code == k:
            out = Int32(v)
    return out


@cute.jit
def push_geometry(ctx: _Ctx, j: Int32, esz: Int32) -> tuple[Int32, Int32, Int32]:
    """(unit bytes, units per box row, box rows) of PUSH operand ``j``: 16-byte units when every row of the box starts
    and ends on 16 bytes (the hidden and latent tiles), else 4 (an arg-max best), else 2, else 1."""
    rowb = (_bx(ctx, j, C1) - _bx(ctx, j, C0)) * esz
    startb = _bx(ctx, j, C0) * esz
    strideb = ctx.s_d2[j] * esz
    unit = Int32(1)
    for u in cutlass.range_constexpr(3):
        w = (2, 4, 16)[u]
        if (rowb % w == 0) & (startb % w == 0) & (strideb % w == 0):
            unit = Int32(w)
    rows = (_bx(ctx, j, B1) - _bx(ctx, j, B0)) * (_bx(ctx, j, R1) - _bx(ctx, j, R0))
    return unit, rowb // unit, rows


@cute.jit
def push_span(ctx: _Ctx, j: Int32, esz: Int32, unit: Int32, per: Int32, k: Int32) -> Int64:
    """Byte offset, from operand ``j``'s buffer base, of work item ``k`` of its push (``contracts.addr.push_item``:
    box row k // per, unit k % per)."""
    db, dr, u = push_item(_bx(ctx, j, R1) - _bx(ctx, j, R0), per, k)
    return _eoff(ctx.s_d1[j], ctx.s_d2[j], _bx(ctx, j, B0) + db, _bx(ctx, j, R0) + dr, _bx(ctx, j, C0)) * Int64(
        esz) + Int64(u) * Int64(unit)


@cute.jit
def _copy_unit(src: Int64, dst: Int64, unit: Int32) -> None:
    if unit == 16:
        rv = cute.make_rmem_tensor((VEC,), BFloat16)
        cute.copy(cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128),
                  gchunks(src)[(0, None)], rv)
        cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128), rv,
                  gchunks(dst)[(0, None)])
    elif unit == 4:
        gflat(Int32, dst)[0] = gflat(Int32, src)[0]
    elif unit == 2:
        gflat(BFloat16, dst)[0] = gflat(BFloat16, src)[0]
    else:
        gflat(Uint8, dst)[0] = gflat(Uint8, src)[0]


@cute.jit
def push_operand(ctx: _Ctx, j: Int32, esz: Int32, rank: Int32, lo: Int32, hi: Int32, mPeer: cute.Tensor) -> None:
    """Operand ``j``'s box (written by this instruction into this rank's copy of the mailbox) stored into the copy of
    every other rank of ``[lo, hi)``, the CTA's threads over its units (``push_span``). The caller's barriers order
    it after the body's stores and before the release that publishes it."""
    unit, per, rows = push_geometry(ctx, j, esz)
    me = mPeer[rank]
    for k in cutlass.range(ctx.tidx, rows * per, NT, unroll=1):
        src = ctx.s_addr[j] + push_span(ctx, j, esz, unit, per, k)
        for p in cutlass.range(lo, hi, unroll=1):
            if p != rank:
                _copy_unit(src, peer_address(src, me, mPeer[p]), unit)


# ---------------------------------------------------------------------------------------------- counter words
@cute.jit
def signal_peers(word: Int64, amount: Int32, rank: Int32, lo: Int32, hi: Int32, mPeer: cute.Tensor) -> None:
    """This rank's word of a cross-rank counter (byte address ``word`` in this rank's counter memory) incremented on
    every rank of ``[lo, hi)`` (its own included): a release at system scope each, the peers being other GPUs."""
    me = mPeer[rank]
    for p in cutlass.range(lo, hi, unroll=1):
        ptr = cute.make_ptr(Int32, peer_address(word, me, mPeer[p]), cute.AddressSpace.gmem, assumed_align=4)
        cute.arch.red(ptr, amount, op="add", dtype=Int32, sem="release", scope="sys")
