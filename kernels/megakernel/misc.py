"""Megakernel opcodes that are not tiled GEMVs: EMBED, ATTN_RES_MIX, ARGMAX and ARGMAX_ALL (device code; each
opcode's docstring says what it does).

As in ``megakernel/moe.py``, each ``op_*`` is a thin GPU-only layer (thread indices, the 16-byte copies' stores, the
CTA reduction and the approximate softmax) around ``@cute.jit`` helpers that take the token and thread as plain
integers (``embed_row``, ``mix_row``, ``mix_partials``, ``mix_chunk``, ``mix_out``, ``argmax_pick``), which
``kernels/verify/host_exec_mk.py`` runs on the host."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from kimik3.kernels.contracts.isa import (
    B0,
    B1,
    W_ARGS,
)
from kimik3.kernels.megakernel.device_fns import (
    NT,
    NW,
    VEC,
    block_allreduce,
    exp_fast,
    gchunks,
    gflat,
)
from kimik3.kernels.megakernel.operands import (
    F32_RED,
    _bx,
    _Ctx,
    _eoff,
)


@cute.jit
def embed_row(ctx: _Ctx, b: Int32) -> tuple[Int64, Int64]:
    """Token b's embedding row: element offsets of the table row of its id (operand 1) and of the output row
    [b, 0, 0] (operand 2); the id is read from the ids (operand 0) at [b, 0, 0]."""
    ids = gflat(Int64, ctx.s_addr[0])
    tok = Int32(ids[Int64(b) * Int64(ctx.s_d1[0]) * Int64(ctx.s_d2[0])])
    return Int64(tok) * Int64(ctx.s_d2[1]), _eoff(ctx.s_d1[2], ctx.s_d2[2], b, 0, 0)


@cute.jit
def op_embed(ctx: _Ctx) -> None:
    """EMBED: per batch row of the tile, the token's embedding row (``embed_row``) copied with 16-byte loads and stores
    into the stream. Known limits: none worth noting (B·H·2 bytes)."""
    nch = ctx.s_d2[1] // VEC
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    for b in cutlass.range(_bx(ctx, 0, B0), _bx(ctx, 0, B1), unroll=1):
        so, do = embed_row(ctx, b)
        src = gchunks(ctx.s_addr[1] + so * 2)
        dst = gchunks(ctx.s_addr[2] + do * 2)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            cute.copy(ld, src[(c, None)], r)
            cute.copy(st, r, dst[(c, None)])


# ATTN_RES_MIX's operands (stream, norm weight, projection, output); ALLREDUCE_MIX mixes with its own
# (``megakernel/collective.py``: the stream before the entry it sums into, then the same three)
MIX_OPS = (0, 1, 2, 3)


@cute.jit
def mix_row(ctx: _Ctx, b: Int32, js: cutlass.Constexpr = 0) -> Any:
    """Token b's candidates (operand ``js``, [b, k, :] for k < K) as 16-byte chunks: candidate k's chunk c at
    k·nch + c."""
    return gchunks(ctx.s_addr[js] + _eoff(ctx.s_d1[js], ctx.s_d2[js], b, 0, 0) * 2)


@cute.jit
def mix_partials(ctx: _Ctx, sv: Any, K: Int32, nch: Int32, tidx: Int32, vals: cute.Tensor, jn: cutlass.Constexpr = 1,
                 jp: cutlass.Constexpr = 2) -> None:
    """Thread tidx's partial sums over its chunks c = tidx, tidx + NT, ...: vals[k] = Σ v_k², vals[KM + k] =
    Σ v_k·ω with ω = norm weight (operand ``jn``) × projection (operand ``jp``), for each candidate k < K (nch
    chunks each)."""
    KM = ctx.cfg.kmax
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    gn, gp = gchunks(ctx.s_addr[jn]), gchunks(ctx.s_addr[jp])
    rn = cute.make_rmem_tensor((VEC,), BFloat16)
    rp = cute.make_rmem_tensor((VEC,), BFloat16)
    rv = cute.make_rmem_tensor((VEC,), BFloat16)
    vals.fill(0.0)
    for c in cutlass.range(tidx, nch, NT, unroll=1):
        cute.copy(ld_w, gn[(c, None)], rn)
        cute.copy(ld_w, gp[(c, None)], rp)
        om = rn.load().to(Float32) * rp.load().to(Float32)
        for k in cutlass.range_constexpr(KM):
            if k < K:
                cute.copy(ld_x, sv[(k * nch + c, None)], rv)
                v = rv.load().to(Float32)
                vals[k] += (v * v).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
                vals[KM + k] += (v * om).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)


@cute.jit
def mix_chunk(ctx: _Ctx, sv: Any, K: Int32, nch: Int32, vals: cute.Tensor, inv: Float32, c: Int32, ro: cute.Tensor
              ) -> None:
    """Chunk c of the mix Σ_k (vals[k]·inv)·v_k (vals[k]·inv: candidate k's softmax weight) in fp32, into ``ro``
    as bf16."""
    KM = ctx.cfg.kmax
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    rv = cute.make_rmem_tensor((VEC,), BFloat16)
    acc = cute.make_rmem_tensor((VEC,), Float32)
    acc.fill(0.0)
    for k in cutlass.range_constexpr(KM):
        if k < K:
            cute.copy(ld_x, sv[(k * nch + c, None)], rv)
            acc.store(acc.load() + rv.load().to(Float32) * (vals[k] * inv))
    ro.store(acc.load().to(BFloat16))


@cute.jit
def mix_out(ctx: _Ctx, b: Int32, jo: cutlass.Constexpr = 3) -> Int64:
    """Element offset of the output row [b, 0, 0] (operand ``jo``)."""
    return _eoff(ctx.s_d1[jo], ctx.s_d2[jo], b, 0, 0)


@cute.jit
def op_attn_res_mix(ctx: _Ctx) -> None:
    """ATTN_RES_MIX: per batch row, one pass accumulates Σv² and Σv·ω for every depth candidate (``mix_partials``), one
    CTA reduction, the softmax over depth in every thread, then a second pass mixes the raw candidates in fp32 and
    stores bf16 (``mix_chunk``). Known limits: the rows of a tile run one after another (2 barriers each); the second
    pass re-reads the candidates from L1/L2."""
    for b in cutlass.range(_bx(ctx, 0, B0), _bx(ctx, 0, B1), unroll=1):
        mix_one_row(ctx, b, MIX_OPS)


@cute.jit
def mix_one_row(ctx: _Ctx, b: Int32, ops: cutlass.Constexpr) -> None:
    """The AttnRes mix of batch row b over operands ``ops`` = (stream, norm weight, projection, output)."""
    cfg = ctx.cfg
    KM = cfg.kmax
    K = ctx.s_ins[W_ARGS + 1]
    js, jn, jp, jo = ops
    nch = ctx.s_d2[js] // VEC
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    ro = cute.make_rmem_tensor((VEC,), BFloat16)
    vals = cute.make_rmem_tensor((2 * KM,), Float32)
    s_red = cute.make_tensor(ctx.s_f32.iterator + F32_RED, cute.make_layout(NW * 2 * KM))
    inv_h = 1.0 / cfg.H
    sv = mix_row(ctx, b, js)
    mix_partials(ctx, sv, K, nch, ctx.tidx, vals, jn, jp)
    block_allreduce(vals, s_red, 2 * KM)
    m = -Float32.inf
    for k in cutlass.range_constexpr(KM):
        lg = vals[KM + k] * cute.math.rsqrt(vals[k] * inv_h + cfg.eps, fastmath=True)
        vals[KM + k] = lg if k < K else -Float32.inf
        m = cute.arch.fmax(m, vals[KM + k])
    den = Float32(0.0)
    for k in cutlass.range_constexpr(KM):
        vals[k] = exp_fast(vals[KM + k] - m)  # exp(-inf) = 0 for k >= K
        den = den + vals[k]
    inv = 1.0 / den
    dst = gchunks(ctx.s_addr[jo] + mix_out(ctx, b, jo) * 2)
    for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
        mix_chunk(ctx, sv, K, nch, vals, inv, c, ro)
        cute.copy(st, ro, dst[(c, None)])


ARGMAX_LOADS = 4  # tiles read per iteration of the ARGMAX walk (independent loads in flight)


@cute.jit
def argmax_pick(ctx: _Ctx, b: Int32) -> tuple[Int64, Int64]:
    """Token b's next token: the tile of the largest per-tile maximum (operand 0: token b's row [b, :, :] read flat,
    its d1·d2 tiles in order — ARGMAX's [b, 0, t]; ARGMAX_ALL's [b, rank, t] rank-major, every shard's tiles in
    ascending vocabulary order), the first of equal maxima (the lowest tile holds the lowest vocabulary id);
    returns the element offsets of that tile's arg-max (operand 1, laid out alike) and of the output [b, 0, 0]
    (operand 2)."""
    row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0))
    bv = gflat(Float32, ctx.s_addr[0] + row * 4)
    T = ctx.s_d1[0] * ctx.s_d2[0]
    best, bt = -Float32.inf, Int32(0)
    # ARGMAX_LOADS independent loads per iteration (a dependent chain of single loads is latency-bound), then the
    # comparisons in tile order; tiles past the last read as -inf and are never taken
    vals = cute.make_rmem_tensor((ARGMAX_LOADS,), Float32)
    for t0 in cutlass.range(0, T, ARGMAX_LOADS, unroll=1):
        for k in cutlass.range_constexpr(ARGMAX_LOADS):
            t = t0 + k
            vals[k] = bv[t if t < T else T - 1]
        for k in cutlass.range_constexpr(ARGMAX_LOADS):
            t = t0 + k
            v = vals[k] if t < T else -Float32.inf
            take = v > best  # first maximum = lowest tile = lowest vocabulary id
            best, bt = (v, t) if take else (best, bt)
    return (_eoff(ctx.s_d1[1], ctx.s_d2[1], b, Int32(0), Int32(0)) + Int64(bt),
            _eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), Int32(0)))


@cute.jit
def op_argmax(ctx: _Ctx) -> None:
    """ARGMAX: one thread per token walks the tiles' (max, arg-max) pairs, the first maximum winning (``argmax_pick``;
    ARGMAX_ALL runs it over every rank's tiles). Known limits: serial over tiles (a few hundred at most; W times that
    across ranks)."""
    bi = gflat(Int64, ctx.s_addr[1])
    nxt = gflat(Int64, ctx.s_addr[2])
    if ctx.tidx < ctx.cfg.B:
        src, dst = argmax_pick(ctx, ctx.tidx)
        nxt[dst] = bi[src]
