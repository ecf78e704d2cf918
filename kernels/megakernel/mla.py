"""The megakernel's MLA opcodes: MLA_Q, MLA_KV_APPEND, MLA_PARTIAL, MLA_REDUCE (device code; what each does, and
why its loops look the way they do, all of it about keeping loads in flight: its ``op_*`` docstring).

Each opcode is a thin GPU layer (thread / warp / lane indices, warp shuffles, shared memory, barriers, the
approximate ``ex2`` / ``rsqrt`` / ``rcp``) around ``@cute.jit`` helpers that take the warp and lane as plain integers:
which W_UK chunk column and row group a lane owns (:func:`absorb_coords`), what it loads and accumulates
(:func:`absorb_lane`, :func:`kv_append_load`, :func:`partial_load_q` / :func:`partial_load_rows` /
:func:`partial_dots` / :func:`partial_out_block`, :func:`merge_max_lane` / :func:`merge_den_lane` /
:func:`merge_lane`). The host driver ``kernels/verify/host_exec_mk_mla.py`` runs the same helpers over every warp and
lane of an instruction on CPU tensors and does the cross-lane reductions in the kernel's order."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from kimik3.kernels.common.device import LOG2E
from kimik3.kernels.common.trace import tracing_for_host
from kimik3.kernels.contracts.addr import (
    absorb_cw,  # W_UK chunk columns per absorption task: one definition, replayed on the host
)
from kimik3.kernels.contracts.isa import (
    B0,
    B1,
    C0,
    R0,
    R1,
    W_ARGS,
    W_NOPS,
)
from kimik3.kernels.megakernel.device_fns import (
    NT,
    NW,
    VEC,
    bf16_round,
    gchunks,
    gflat,
    sigmoid,
    warp_sum,
    weight_row_dot,
)
from kimik3.kernels.megakernel.operands import (
    F32_VEC,
    F32_WORDS,
    _bx,
    _Ctx,
    _eoff,
    _row0,
    _staged_rows,
)

PART_HB = 2  # MLA_PARTIAL heads per warp pass: per lane fp32 query ((kv_lora + rope) / 32) and output (kv_lora / 32)
PART_PU = 2  # MLA_PARTIAL cache rows per step (a lane's bf16 latent chunks and rope elements of each), loaded together
STAGE_UNROLL = 4  # MLA_Q: q_a elements each thread loads per iteration of the smem staging loop
MERGE_UNROLL = 8  # MLA_REDUCE: splits whose (max, o pair) loads one merge step issues together


def absorb_unroll(bt: int) -> int:
    """16-byte W_UK loads in flight per lane: 8 while at most 2 batch rows share each chunk, else 4 (the 8·bt
    accumulators need the registers)."""
    return 8 if bt <= 2 else 4


def _exp(x: Float32) -> Float32:
    """exp as ex2.approx on the GPU; exact exp2 on the host (the approximate instruction aborts there)."""
    return cute.math.exp2(x * LOG2E, approx=not tracing_for_host())


def _fmax(a: Float32, b: Float32) -> Float32:
    return cutlass.max(a, b) if tracing_for_host() else cute.arch.fmax(a, b)


@cute.jit
def norm_value(x: Float32, w: Float32, r: Float32) -> Float32:
    """RMSNorm of one element in the reference's order: bf16(x·rstd), then ·w (bf16 operands; the caller rounds the
    product to bf16 once, at the store)."""
    return w * bf16_round(x * r)


# ---------------------------------------------------------------------------------------------- MLA_Q helpers
@cute.jit
def absorb_coords(task: Int32, lane: Int32, CW: cutlass.Constexpr) -> tuple[Int32, Int32]:
    """(W_UK chunk column, nope row group) of ``lane`` in absorption task ``task`` (a warp's block of CW chunks)."""
    return task * CW + lane % CW, lane // CW


@cute.jit
def absorb_lane(wuk_addr: Int64, nchr: Int32, row0: Int32, cb: Int32, rg: Int32, qv: cute.Tensor, q0: Int32,
                acc: cute.Tensor, NOPE: cutlass.Constexpr, RG: cutlass.Constexpr, U: cutlass.Constexpr,
                BT: cutlass.Constexpr) -> None:
    """``acc[bb·8 + k] = Σ_n q[bb, n] · W_UK[row0 + n, 8·cb + k]`` over the lane's rows ``n = rg, rg + RG, ...``
    (per lane, before the row groups' butterfly). W_UK rows are ``nchr`` chunks apart from byte address
    ``wuk_addr``; ``q[bb, n]`` is ``qv[q0 + bb·NOPE + n]`` (bf16, shared memory on the GPU). U loads of 16 bytes go
    out before the first FMA."""
    wv = gchunks(wuk_addr)
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    acc.fill(0.0)
    rw = cute.make_rmem_tensor((VEC, U), BFloat16)
    for n0 in cutlass.range(rg, NOPE, RG * U, unroll=1):
        for u in cutlass.range_constexpr(U):
            if n0 + RG * u < NOPE:
                cute.copy(ld_w, wv[((row0 + n0 + RG * u) * nchr + cb, None)], rw[None, u])
        for u in cutlass.range_constexpr(U):
            n = n0 + RG * u
            if n < NOPE:
                w = rw[None, u].load().to(Float32)
                for bb in cutlass.range_constexpr(BT):
                    q = qv[q0 + bb * NOPE + n].to(Float32)
                    for k in cutlass.range_constexpr(VEC):
                        acc[bb * VEC + k] = acc[bb * VEC + k] + w[k] * q


@cute.jit
def _butterfly_from(acc: cute.Tensor, n: cutlass.Constexpr, steps: cutlass.Constexpr) -> None:
    """Sum each of ``acc[0:n]`` over the lanes that differ in the top ``steps`` lane bits (offsets 16, 8, ...)."""
    for i in cutlass.range_constexpr(n):
        v = acc[i]
        for s in cutlass.range_constexpr(steps):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> s)
        acc[i] = v


@cute.jit
def op_mla_q(ctx: _Ctx) -> None:
    """MLA_Q: per batch tile, the q_a rows staged in shared memory and RMS-normalised in place, one warp per q_b row
    (the rope part straight to mla_q), then the absorption. The W_UK absorption ``q_lat[b, c] = Σ_n q_nope[b, n] ·
    W_UK[h·nope + n, c]`` is a GEMV over the *rows* of W_UK: a warp task owns CW = ``contracts.addr.absorb_cw(kvl)``
    16-byte column chunks, its lanes split the nope rows in 32 / CW groups, each lane issues ``absorb_unroll`` 16-byte
    W_UK loads before its first FMA and keeps 8 columns x BT batch rows of fp32 accumulators; the row groups are summed
    with a partial butterfly (offsets 16 .. CW). Known limits: kvl/(8·CW) absorption tasks per head (8 at k3-shard)
    leave 4 of 12 warps idle during the absorption; the q_b rows and W_UK are re-read per batch tile (B > 4)."""
    cfg = ctx.cfg
    BT = cfg.bt
    ql, kvl, nope, rope = cfg.ql, cfg.kvl, cfg.nope, cfg.rope
    qk = nope + rope
    CW = absorb_cw(kvl)
    RG = 32 // CW
    steps = {1: 5, 2: 4, 4: 3, 8: 2}[CW]
    ntask = kvl // VEC // CW
    h0, h1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1]
    mp = gflat(BFloat16, ctx.s_addr[0])
    qa0 = _bx(ctx, 0, C0)
    qn = gflat(BFloat16, ctx.s_addr[1])
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    nchr = ctx.s_d2[3] // VEC
    mq = gflat(BFloat16, ctx.s_addr[4])
    xq0 = BT * ql  # s_xb: [0, BT*ql) q_a rows, [BT*ql, BT*ql + BT*nope) the tile's nope queries
    s_xbf, s_f32 = ctx.s_xbf, ctx.s_f32
    acc = cute.make_rmem_tensor((BT,), Float32)
    accw = cute.make_rmem_tensor((VEC * BT,), Float32)
    for t in cutlass.range(cfg.nbt, unroll=1):
        nb = BT
        # the packed projection's row stride need not be a multiple of 8: stage q_a rows in smem (aligned), several
        # independent loads per thread per iteration
        for i0 in cutlass.range(ctx.tidx, nb * ql, NT * STAGE_UNROLL, unroll=1):
            xs = cute.make_rmem_tensor((STAGE_UNROLL,), BFloat16)
            for u in cutlass.range_constexpr(STAGE_UNROLL):
                idx = i0 + NT * u
                if idx < nb * ql:
                    xs[u] = mp[_eoff(ctx.s_d1[0], ctx.s_d2[0], t * BT + idx // ql, Int32(0), qa0 + idx % ql)]
            for u in cutlass.range_constexpr(STAGE_UNROLL):
                idx = i0 + NT * u
                if idx < nb * ql:
                    s_xbf[idx] = xs[u]
        cute.arch.sync_threads()
        for bb in cutlass.range(ctx.warp, nb, NW, unroll=1):
            part = Float32(0.0)
            for cc in cutlass.range(ctx.lane, ql, 32, unroll=1):
                x = s_xbf[bb * ql + cc].to(Float32)
                part = part + x * x
            tot = warp_sum(part)
            if ctx.lane == 0:
                s_f32[bb] = cute.math.rsqrt(tot * (1.0 / ql) + cfg.lora_eps, fastmath=True)
        cute.arch.sync_threads()
        # the normalised rows in place, exactly as the reference's RMSNorm (bf16(x·rstd), then ·γ in bf16): the
        # q_b rows then need no γ stream and no rstd after the dot (fewer registers next to the weight loads)
        for i0 in cutlass.range(ctx.tidx, nb * ql, NT * STAGE_UNROLL, unroll=1):
            gs = cute.make_rmem_tensor((STAGE_UNROLL,), BFloat16)
            for u in cutlass.range_constexpr(STAGE_UNROLL):
                if i0 + NT * u < nb * ql:
                    gs[u] = qn[(i0 + NT * u) % ql]
            for u in cutlass.range_constexpr(STAGE_UNROLL):
                idx = i0 + NT * u
                if idx < nb * ql:
                    v = norm_value(s_xbf[idx].to(Float32), gs[u].to(Float32), s_f32[idx // ql])
                    s_xbf[idx] = v.to(BFloat16)
        cute.arch.sync_threads()
        for h in cutlass.range(h0, h1, unroll=1):
            for j in cutlass.range(ctx.warp, qk, NW, unroll=1):
                weight_row_dot(ctx.s_stage, staged, wrow0, (h - h0) * qk + j, Int32(ql // VEC), ctx.s_xb, Int32(0),
                               Int32(ql // VEC), True, None, acc, nb, cfg.unroll)
                for bb in cutlass.range_constexpr(nb):
                    d = bf16_round(warp_sum(acc[bb]))
                    if ctx.lane == bb % 32:
                        if j < nope:
                            s_xbf[xq0 + bb * nope + j] = d.to(BFloat16)
                        else:
                            mq[_eoff(ctx.s_d1[4], ctx.s_d2[4], t * BT + bb, h, kvl + j - nope)] = d.to(BFloat16)
            cute.arch.sync_threads()
            for task in cutlass.range(ctx.warp, ntask, NW, unroll=1):  # absorb W_UK: q_lat = q_nope · W_UK[h]
                cb, rg = absorb_coords(task, ctx.lane, CW)
                # W_UK's rows of head h from its box (h · nope on one GPU; a rank holds only its heads' rows)
                absorb_lane(ctx.s_addr[3], nchr, (h - h0) * nope + _bx(ctx, 3, R0), cb, rg, s_xbf, Int32(xq0),
                            accw, nope, RG, absorb_unroll(BT), nb)
                _butterfly_from(accw, VEC * nb, steps)
                for bb in cutlass.range_constexpr(nb):
                    if bb % RG == rg:  # every row group holds the sums: lane group bb mod RG stores row bb
                        row = _eoff(ctx.s_d1[4], ctx.s_d2[4], t * BT + bb, h, cb * VEC)
                        for k in cutlass.range_constexpr(VEC):
                            mq[row + k] = accw[bb * VEC + k].to(BFloat16)
            cute.arch.sync_threads()


# ---------------------------------------------------------------------------------------------- MLA_KV_APPEND
@cute.jit
def kv_append_load(mp: cute.Tensor, row: Int64, kvn: cute.Tensor, lane: Int32, xv: cute.Tensor, wv: cute.Tensor,
                   rv: cute.Tensor, KVL: cutlass.Constexpr, ROPE: cutlass.Constexpr) -> Float32:
    """Lane ``lane``'s latent elements ``lane + 32 m`` of the kv_a row at ``row`` (fp32, in ``xv``), their norm
    weights (``wv``) and its rope elements (bf16, ``rv``), all loads issued at once; returns the lane's Σ x²."""
    for m in cutlass.range_constexpr(-(-KVL // 32)):
        li = lane + 32 * m
        xv[m] = Float32(0.0)
        wv[m] = Float32(0.0)
        if li < KVL:
            xv[m] = mp[row + li].to(Float32)
            wv[m] = kvn[li].to(Float32)
    for m in cutlass.range_constexpr(-(-ROPE // 32)):
        ri = lane + 32 * m
        if ri < ROPE:
            rv[m] = mp[row + KVL + ri]
    part = Float32(0.0)
    for m in cutlass.range_constexpr(-(-KVL // 32)):
        part = part + xv[m] * xv[m]
    return part


@cute.jit
def op_mla_kv_append(ctx: _Ctx) -> None:
    """MLA_KV_APPEND: one warp per sequence, each lane loading all its latent / rope elements at once (one round trip).
    The latent RMSNorm as the reference, latent and shared key written at the sequence's position. Known limits: none
    worth noting (scalar 2-byte loads, but all of a lane's in one round trip)."""
    cfg = ctx.cfg
    kvl, rope = cfg.kvl, cfg.rope
    LPL, RPL = -(-kvl // 32), -(-rope // 32)
    mp = gflat(BFloat16, ctx.s_addr[0])
    c0 = _bx(ctx, 0, C0)
    kvn = gflat(BFloat16, ctx.s_addr[1])
    pos = gflat(Int64, ctx.s_addr[2])
    lat = gflat(BFloat16, ctx.s_addr[3])
    kr = gflat(BFloat16, ctx.s_addr[4])
    xv = cute.make_rmem_tensor((LPL,), Float32)
    wv = cute.make_rmem_tensor((LPL,), Float32)
    rv = cute.make_rmem_tensor((RPL,), BFloat16)
    for b in cutlass.range(ctx.warp, cfg.B, NW, unroll=1):
        p = Int32(pos[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), Int32(0))])
        row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), c0)
        part = kv_append_load(mp, row, kvn, ctx.lane, xv, wv, rv, kvl, rope)
        r = cute.math.rsqrt(warp_sum(part) * (1.0 / kvl) + cfg.lora_eps, fastmath=True)
        for m in cutlass.range_constexpr(LPL):
            li = ctx.lane + 32 * m
            if li < kvl:
                lat[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, p, li)] = norm_value(xv[m], wv[m], r).to(BFloat16)
        for m in cutlass.range_constexpr(RPL):  # NoPE: the shared key part is cached raw
            ri = ctx.lane + 32 * m
            if ri < rope:
                kr[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, p, ri)] = rv[m]


# ---------------------------------------------------------------------------------------------- MLA_PARTIAL helpers
@cute.jit
def partial_load_q(mq_addr: Int64, qrow: Int64, h: Int32, h1: Int32, hb: cutlass.Constexpr, lane: Int32,
                   qf: cute.Tensor, qr: cute.Tensor, KVL: cutlass.Constexpr, ROPE: cutlass.Constexpr) -> None:
    """Head ``h``'s query (row at element ``qrow`` of mla_q) as fp32: latent chunks ``lane + 32 m`` (16-byte loads)
    into ``qf[:, hb, m]``, rope elements ``lane + 32 m`` into ``qr[m, hb]``; zero for a head past ``h1`` or past
    the end."""
    NCL = KVL // VEC
    LPC, RPL = -(-NCL // 32), -(-ROPE // 32)
    qv = gchunks(mq_addr + qrow * 2)
    qe = gflat(BFloat16, mq_addr + qrow * 2)
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    rq = cute.make_rmem_tensor((VEC, LPC), BFloat16)
    for m in cutlass.range_constexpr(LPC):
        for k in cutlass.range_constexpr(VEC):
            qf[k, hb, m] = Float32(0.0)
        if (lane + 32 * m < NCL) & (h < h1):
            cute.copy(ld, qv[(lane + 32 * m, None)], rq[None, m])
            x = rq[None, m].load().to(Float32)
            for k in cutlass.range_constexpr(VEC):
                qf[k, hb, m] = x[k]
    for m in cutlass.range_constexpr(RPL):
        qr[m, hb] = Float32(0.0)
        if (lane + 32 * m < ROPE) & (h < h1):
            qr[m, hb] = qe[KVL + lane + 32 * m].to(Float32)


@cute.jit
def partial_load_rows(lat_addr: Int64, crow: Int64, kr_addr: Int64, krow: Int64, nvalid: Int32, lane: Int32,
                      rc: cute.Tensor, rr: cute.Tensor, KVL: cutlass.Constexpr, ROPE: cutlass.Constexpr,
                      PU: cutlass.Constexpr) -> None:
    """Rows ``u < min(PU, nvalid)`` of the latent cache (row 0 at element ``crow``, rows KVL apart: the lane's
    16-byte chunks into ``rc[:, u, m]``) and of the rope keys (``krow``, ROPE apart: the lane's elements into
    ``rr[m, u]``), every load of the step issued before any use."""
    NCL = KVL // VEC
    LPC, RPL = -(-NCL // 32), -(-ROPE // 32)
    cv = gchunks(lat_addr + crow * 2)
    kv = gflat(BFloat16, kr_addr + krow * 2)
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    for u in cutlass.range_constexpr(PU):
        if u < nvalid:
            for m in cutlass.range_constexpr(LPC):
                if lane + 32 * m < NCL:
                    cute.copy(ld, cv[(u * NCL + lane + 32 * m, None)], rc[None, u, m])
            for m in cutlass.range_constexpr(RPL):
                if lane + 32 * m < ROPE:
                    rr[m, u] = kv[u * ROPE + lane + 32 * m]


@cute.jit
def partial_dots(qf: cute.Tensor, qr: cute.Tensor, rc: cute.Tensor, rr: cute.Tensor, nvalid: Int32, lane: Int32,
                 sl: cute.Tensor, sr: cute.Tensor, KVL: cutlass.Constexpr, ROPE: cutlass.Constexpr,
                 HB: cutlass.Constexpr, PU: cutlass.Constexpr) -> None:
    """The lane's partial scores of the step: ``sl[hb, u]`` (latent) and ``sr[hb, u]`` (rope) for each head and
    valid row (the reference's two einsums, summed over the warp afterwards)."""
    NCL = KVL // VEC
    LPC, RPL = -(-NCL // 32), -(-ROPE // 32)
    for u in cutlass.range_constexpr(PU):
        for hb in cutlass.range_constexpr(HB):
            sl[hb, u] = Float32(0.0)
            sr[hb, u] = Float32(0.0)
        if u < nvalid:
            for m in cutlass.range_constexpr(LPC):
                if lane + 32 * m < NCL:
                    c = rc[None, u, m].load().to(Float32)
                    for hb in cutlass.range_constexpr(HB):
                        a = sl[hb, u]
                        for k in cutlass.range_constexpr(VEC):
                            a = a + qf[k, hb, m] * c[k]
                        sl[hb, u] = a
            for m in cutlass.range_constexpr(RPL):
                if lane + 32 * m < ROPE:
                    c = rr[m, u].to(Float32)
                    for hb in cutlass.range_constexpr(HB):
                        sr[hb, u] = sr[hb, u] + qr[m, hb] * c


@cute.jit
def partial_out_block(o: cute.Tensor, rc: cute.Tensor, p: cute.Tensor, corr: cute.Tensor, nvalid: Int32,
                      lane: Int32, KVL: cutlass.Constexpr, HB: cutlass.Constexpr, PU: cutlass.Constexpr) -> None:
    """The online-softmax output update of one step: ``o[:, hb, m] = o·corr[hb] + Σ_u p[hb, u] · c_u`` over the
    lane's latent chunks, rows in order."""
    NCL = KVL // VEC
    LPC = -(-NCL // 32)
    for hb in cutlass.range_constexpr(HB):
        if corr[hb] != 1.0:  # the running max grew (rare after the first rows): rescale; else o·1 = o, skipped
            for m in cutlass.range_constexpr(LPC):
                for k in cutlass.range_constexpr(VEC):
                    o[k, hb, m] = o[k, hb, m] * corr[hb]
    for u in cutlass.range_constexpr(PU):
        if u < nvalid:
            for m in cutlass.range_constexpr(LPC):
                if lane + 32 * m < NCL:
                    c = rc[None, u, m].load().to(Float32)
                    for hb in cutlass.range_constexpr(HB):
                        for k in cutlass.range_constexpr(VEC):
                            o[k, hb, m] = o[k, hb, m] + p[hb, u] * c[k]


@cute.jit
def partial_col(lane: Int32, m: cutlass.Constexpr) -> Int32:
    """First latent column of the lane's chunk ``m`` (queries, cache rows and the stored partial output)."""
    return (lane + 32 * m) * VEC


@cute.jit
def _score_sum(sl: Float32, sr: Float32, lane: Int32) -> Float32:
    """bf16(bf16(Σ_lanes sl) + bf16(Σ_lanes sr)): the reference's two bf16 einsums and their bf16 sum, with one
    shuffle chain for both sums: the first step swaps halves (lanes < 16 keep the latent partial, the others the
    rope one), the chain of offsets 8..1 then sums each half; every lane's sums are bit-identical to two full
    butterflies (``warp_sum``: the same pairs in the same order), at 6 shuffles and 6 adds instead of 10 and 10."""
    hi = (lane & 16) != 0
    keep = sr if hi else sl
    send = sl if hi else sr
    v = keep + cute.arch.shuffle_sync_bfly(send, offset=16)
    for off in cutlass.range_constexpr(4):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=8 >> off)
    other = cute.arch.shuffle_sync_bfly(v, offset=16)
    return bf16_round(bf16_round(v) + bf16_round(other))


@cute.jit
def op_mla_partial(ctx: _Ctx) -> None:
    """MLA_PARTIAL: a warp takes ``PART_HB`` heads at once (their queries in fp32 registers, the lane owning 16-byte
    latent chunks ``lane + 32 m`` and rope elements ``lane + 32 m``) and walks the cache ``PART_PU`` rows per step, all
    rows' loads issued together; each row is loaded once for the warp's heads (and from L1 for the other warps); one
    shuffle chain sums both partial scores (``_score_sum``); the online softmax rescales once per step, and only when
    the running max grows; heads are spread over the 12 warps. Writes the split's (o, max, sum). Known limits: CUDA-core
    FMAs: per (head, row) and lane 34 FMAs, 6 shuffles and the bf16 converts, issue-bound above the FMA floor; a
    tensor-core (mma) version, or fewer heads per instruction, is what would cut it."""
    cfg = ctx.cfg
    kvl, rope = cfg.kvl, cfg.rope
    HB, PU = PART_HB, PART_PU
    NCL = kvl // VEC
    LPC, RPL = -(-NCL // 32), -(-rope // 32)
    h0, h1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1]
    b0, b1 = _bx(ctx, 0, B0), _bx(ctx, 0, B1)
    t0, t1 = _bx(ctx, 2, R0), _bx(ctx, 2, R1)
    col0 = _bx(ctx, 4, C0)
    pos = gflat(Int64, ctx.s_addr[1])
    part = gflat(Float32, ctx.s_addr[4])
    qf = cute.make_rmem_tensor((VEC, HB, LPC), Float32)
    qr = cute.make_rmem_tensor((RPL, HB), Float32)
    rc = cute.make_rmem_tensor((VEC, PU, LPC), BFloat16)
    rr = cute.make_rmem_tensor((RPL, PU), BFloat16)
    o = cute.make_rmem_tensor((VEC, HB, LPC), Float32)
    sl = cute.make_rmem_tensor((HB, PU), Float32)
    sr = cute.make_rmem_tensor((HB, PU), Float32)
    p = cute.make_rmem_tensor((HB, PU), Float32)
    corr = cute.make_rmem_tensor((HB,), Float32)
    mrun = cute.make_rmem_tensor((HB,), Float32)
    lrun = cute.make_rmem_tensor((HB,), Float32)
    npair = (h1 - h0 + HB - 1) // HB
    for b in cutlass.range(b0, b1, unroll=1):
        last = Int32(pos[_eoff(ctx.s_d1[1], ctx.s_d2[1], b, Int32(0), Int32(0))])
        tend = t1 if t1 < last + 1 else last + 1  # causal: the sequence's own cache up to its position
        for g in cutlass.range(ctx.warp, npair, NW, unroll=1):  # heads spread over the warps, HB per warp pass
            for hb in cutlass.range_constexpr(HB):
                h = h0 + g * HB + hb
                partial_load_q(ctx.s_addr[0], _eoff(ctx.s_d1[0], ctx.s_d2[0], b, h, Int32(0)), h, h1, hb, ctx.lane,
                               qf, qr, kvl, rope)
                mrun[hb] = -Float32.inf
                lrun[hb] = Float32(0.0)
            o.fill(0.0)
            for tb in cutlass.range(t0, tend, PU, unroll=1):
                nvalid = tend - tb
                partial_load_rows(ctx.s_addr[2], _eoff(ctx.s_d1[2], ctx.s_d2[2], b, tb, Int32(0)), ctx.s_addr[3],
                                  _eoff(ctx.s_d1[3], ctx.s_d2[3], b, tb, Int32(0)), nvalid, ctx.lane, rc, rr,
                                  kvl, rope, PU)
                partial_dots(qf, qr, rc, rr, nvalid, ctx.lane, sl, sr, kvl, rope, HB, PU)
                for hb in cutlass.range_constexpr(HB):
                    mb = -Float32.inf
                    for u in cutlass.range_constexpr(PU):
                        # the reference's two bf16 einsums, their bf16 sum, then fp32 · scale
                        s = -Float32.inf
                        if u < nvalid:  # warp-uniform
                            s = _score_sum(sl[hb, u], sr[hb, u], ctx.lane) * cfg.mla_scale
                        p[hb, u] = s
                        mb = cute.arch.fmax(mb, s)
                    mnew = cute.arch.fmax(mrun[hb], mb)
                    corr[hb] = _exp(mrun[hb] - mnew)  # -inf on the first step: 0
                    lsum = lrun[hb] * corr[hb]
                    for u in cutlass.range_constexpr(PU):
                        pu = _exp(p[hb, u] - mnew)  # rows past the end: exp(-inf) = 0
                        p[hb, u] = pu
                        lsum = lsum + pu
                    lrun[hb] = lsum
                    mrun[hb] = mnew
                partial_out_block(o, rc, p, corr, nvalid, ctx.lane, kvl, HB, PU)
            for hb in cutlass.range_constexpr(HB):
                h = h0 + g * HB + hb
                if h < h1:
                    prow = _eoff(ctx.s_d1[4], ctx.s_d2[4], b, h, col0)
                    for m in cutlass.range_constexpr(LPC):
                        if ctx.lane + 32 * m < NCL:
                            c = partial_col(ctx.lane, m)
                            for k in cutlass.range_constexpr(VEC):
                                part[prow + c + k] = o[k, hb, m]
                    if ctx.lane == 0:
                        part[prow + kvl] = mrun[hb]
                        part[prow + kvl + 1] = lrun[hb]


# ---------------------------------------------------------------------------------------------- MLA_REDUCE helpers
@cute.jit
def merge_max_lane(part: cute.Tensor, prow: Int64, ns: Int32, lane: Int32, KVL: cutlass.Constexpr) -> Float32:
    """The largest split max among the lane's splits ``lane, lane + 32, ...`` (two loads per iteration)."""
    mx = -Float32.inf
    for s in cutlass.range(lane, ns, 64, unroll=1):
        a = part[prow + s * (KVL + 2) + KVL]
        b = -Float32.inf
        if s + 32 < ns:
            b = part[prow + (s + 32) * (KVL + 2) + KVL]
        mx = _fmax(mx, _fmax(a, b))
    return mx


@cute.jit
def merge_den_lane(part: cute.Tensor, prow: Int64, ns: Int32, lane: Int32, mx: Float32, KVL: cutlass.Constexpr
                   ) -> Float32:
    """The lane's part of the merged denominator Σ_s exp(m_s - mx) · l_s (empty splits: exp(-inf) = 0)."""
    den = Float32(0.0)
    for s in cutlass.range(lane, ns, 32, unroll=1):
        m = part[prow + s * (KVL + 2) + KVL]
        ls = part[prow + s * (KVL + 2) + KVL + 1]
        den = den + _exp(m - mx) * ls
    return den


@cute.jit
def merge_lane(part: cute.Tensor, prow: Int64, ns: Int32, col: Int32, mx: Float32, KVL: cutlass.Constexpr,
               SU: cutlass.Constexpr) -> tuple[Float32, Float32]:
    """Σ_s exp(m_s - mx) · o_s[col], o_s[col + 1] over the splits, SU splits' loads (max and the column pair) issued
    together per step."""
    n0, n1 = Float32(0.0), Float32(0.0)
    mv = cute.make_rmem_tensor((SU,), Float32)
    ov = cute.make_rmem_tensor((2 * SU,), Float32)
    for s0 in cutlass.range(0, ns, SU, unroll=1):
        for u in cutlass.range_constexpr(SU):
            mv[u] = -Float32.inf
            ov[2 * u] = Float32(0.0)
            ov[2 * u + 1] = Float32(0.0)
            if s0 + u < ns:
                r = prow + (s0 + u) * (KVL + 2)
                mv[u] = part[r + KVL]
                ov[2 * u] = part[r + col]
                ov[2 * u + 1] = part[r + col + 1]
        for u in cutlass.range_constexpr(SU):
            a = _exp(mv[u] - mx)
            n0 = n0 + a * ov[2 * u]
            n1 = n1 + a * ov[2 * u + 1]
    return n0, n1


@cute.jit
def op_mla_reduce(ctx: _Ctx) -> None:
    """MLA_REDUCE: one warp per batch row computes the splits' common max and denominator (lanes over splits), then
    every thread merges two latent columns with all splits' loads of an unrolled step in flight. The merged latent goes
    to shared memory (bf16), then one warp per W_UV row, the output gate applied. Known limits: each merging thread
    re-reads the splits' max (L1 hits) and evaluates its own exp per split."""
    cfg = ctx.cfg
    BT = cfg.bt
    kvl, dv = cfg.kvl, cfg.dv
    h0, h1, gate = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2]
    io = ctx.s_ins[W_NOPS] - 1
    part = gflat(Float32, ctx.s_addr[0])
    ns = ctx.s_d2[0] // (kvl + 2)
    wrow0 = _row0(ctx, 1)
    staged = _staged_rows(ctx, Int32(1))
    mp = gflat(BFloat16, ctx.s_addr[2])
    g0 = Int32(0)
    if gate != 0:
        g0 = _bx(ctx, 2, C0) - h0 * dv
    out = gflat(BFloat16, ctx.s_addr[io])
    s_xbf, s_f32 = ctx.s_xbf, ctx.s_f32
    assert F32_VEC + BT * dv <= F32_WORDS and 2 * BT <= F32_VEC, "MLA_REDUCE's gate / split scratch"
    acc = cute.make_rmem_tensor((BT,), Float32)
    for t in cutlass.range(cfg.nbt, unroll=1):
        nb = BT
        for h in cutlass.range(h0, h1, unroll=1):
            for bb in cutlass.range(ctx.warp, nb, NW, unroll=1):  # the splits' common max and denominator
                prow = _eoff(ctx.s_d1[0], ctx.s_d2[0], t * BT + bb, h, Int32(0))
                mx = merge_max_lane(part, prow, ns, ctx.lane, kvl)
                for off in cutlass.range_constexpr(5):
                    mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=16 >> off))
                den = warp_sum(merge_den_lane(part, prow, ns, ctx.lane, mx, kvl))
                if ctx.lane == 0:
                    s_f32[2 * bb] = mx
                    s_f32[2 * bb + 1] = den
            if gate != 0:  # the tile's gate factors bf16(σ(g)) in smem, loads in flight together, off the row loop
                for i0 in cutlass.range(ctx.tidx, nb * dv, NT * STAGE_UNROLL, unroll=1):
                    gs = cute.make_rmem_tensor((STAGE_UNROLL,), BFloat16)
                    for u in cutlass.range_constexpr(STAGE_UNROLL):
                        idx = i0 + NT * u
                        if idx < nb * dv:
                            gs[u] = mp[_eoff(ctx.s_d1[2], ctx.s_d2[2], t * BT + idx // dv, Int32(0),
                                             g0 + h * dv + idx % dv)]
                    for u in cutlass.range_constexpr(STAGE_UNROLL):
                        idx = i0 + NT * u
                        if idx < nb * dv:
                            s_f32[F32_VEC + idx] = bf16_round(sigmoid(gs[u].to(Float32)))
            cute.arch.sync_threads()
            for idx in cutlass.range(ctx.tidx, nb * (kvl // 2), NT, unroll=1):  # merge: o_lat in smem (bf16)
                bb, col = idx // (kvl // 2), 2 * (idx % (kvl // 2))
                prow = _eoff(ctx.s_d1[0], ctx.s_d2[0], t * BT + bb, h, Int32(0))
                n0, n1 = merge_lane(part, prow, ns, col, s_f32[2 * bb], kvl, MERGE_UNROLL)
                rden = 1.0 / s_f32[2 * bb + 1]
                s_xbf[bb * kvl + col] = (n0 * rden).to(BFloat16)
                s_xbf[bb * kvl + col + 1] = (n1 * rden).to(BFloat16)
            cute.arch.sync_threads()
            for d in cutlass.range(ctx.warp, dv, NW, unroll=1):  # absorb W_UV, output gate
                weight_row_dot(ctx.s_stage, staged, wrow0, (h - h0) * dv + d, Int32(kvl // VEC), ctx.s_xb, Int32(0),
                               Int32(kvl // VEC), True, None, acc, nb, cfg.unroll)
                for bb in cutlass.range_constexpr(nb):
                    y = bf16_round(warp_sum(acc[bb]))
                    if ctx.lane == bb % 32:
                        if gate != 0:
                            y = bf16_round(y * s_f32[F32_VEC + bb * dv + d])
                        out[_eoff(ctx.s_d1[io], ctx.s_d2[io], t * BT + bb, Int32(0), h * dv + d)] = y.to(BFloat16)
            cute.arch.sync_threads()
