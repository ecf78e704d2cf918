"""Replay of the megakernel's addresses over a decoded int32 program (host verification, never shipped).

Walks every instruction, evaluating the device's address functions (``kernels/contracts/addr.py``) on Python ints,
and checks each access against the instruction's declared operand boxes: ``bounds`` (every run inside its box, never
crossing a row), ``write_once`` (every WRITE element stored once per declaring instruction), ``prefetch`` (only
static weights staged or prefetched) and ``stage`` (staged rows inside the declared box, next-stage descriptors equal
to the next instruction's own stage). Each opcode's loop structure is restated in :func:`_accesses`; a change to an
opcode's loops must be mirrored there. Data-dependent addresses are replayed at every value the buffer allows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kimik3.kernels.contracts import addr as device_addr  # the address functions the opcodes call
from kimik3.kernels.contracts.addr import (
    FP4_GROUP,
    FP4_GROUP_BYTES,
    VEC,
    absorb_cw,
    fp4_row_offsets,
    gemv_batch_tile,
    gemv_group_passes,
    gemv_group_row,
    gemv_groups,
    gemv_item,
    gemv_mma,
    gemv_tile_rows,
    gemv_tiles,
    lm_head_tile_rows,
)
from kimik3.kernels.contracts.isa import BT_MAX, CHUNK_BYTES, STAGE_BYTES, Kind, Mode, Op

__all__ = ["Finding", "ReplayReport", "replay", "shapes_for"]


# ------------------------------------------------------------------------------------------- per-opcode accesses
@dataclass(frozen=True)
class _Acc:
    """``count`` runs of ``length`` contiguous elements of operand ``j``, run ``k`` starting at element offset
    ``start + k * stride`` (the loops of the device code over batch rows / tile rows, whose offsets step by a
    fixed stride)."""

    j: int
    start: int
    length: int
    how: str  # "r" read, "w" store, "rw" read-modify-write, "w?" data-dependent store (bounds only)
    count: int = 1
    stride: int = 0


@dataclass
class _Shapes:
    """What the device code takes from the compile-time config (``MKConfig``): the widths it loops over."""

    B: int
    bt: int
    gbt: int  # batch rows per pass of the GEMV opcodes (gemv_batch_tile)
    dk: int
    conv: int
    kvl: int
    rope: int
    nope: int
    dv: int
    ql: int
    dmax: int
    latent_norm: bool
    fp4: bool = False  # the routed experts are MXFP4 (codes + scales operands)
    ranks: bool = False  # a rank program (MKConfig.ranks): mailbox rows for LM_HEAD's bests and EXPERT_DOWN's sum

    @property
    def nbt(self) -> int:
        return self.B // self.bt

    @property
    def gnbt(self) -> int:
        return self.B // self.gbt


def shapes_for(cfg: Any, batch: int, expert_format: str = "dense", world: int = 1) -> _Shapes:
    """The device config's loop widths for a model config, batch size and expert format (as
    ``kimik3.megakernel.gpu``); ``world`` > 1: one rank's program (its slots hold only its experts)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    held = E // world if E else 0
    bt = max(d for d in range(1, min(batch, BT_MAX) + 1) if batch % d == 0)
    return _Shapes(B=batch, bt=bt, gbt=gemv_batch_tile(batch), dk=cfg.kda_head_dim if cfg.kda_layers else 0,
                   conv=cfg.kda_conv_size,
                   kvl=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim, nope=cfg.qk_nope_head_dim, dv=cfg.v_head_dim,
                   ql=int(cfg.q_lora_rank or 0), dmax=min(held, batch * k) if E else 0,
                   latent_norm=bool(cfg.moe_latent_norm) and world == 1, fp4=expert_format == "mxfp4", ranks=world > 1)


@functools.cache
def _pass_runs(item: Callable[[int, int, int], tuple[int, int]], n: int, groups: tuple[tuple[int, ...], ...],
               tr: int = 1, tiles: Callable[[int, int], int] | None = None) -> tuple[tuple[int, int, int], ...]:
    """The tile rows a GEMV opcode computes for each batch row, as ``(batch row, first tile row, rows)`` runs: the
    work items ``k < tiles(n, tr)·len(groups)`` (``tiles``: the device's ``gemv_tiles``) mapped to (tile of ``tr``
    rows, pass or pass group ``t``) by ``item`` (the device's ``gemv_item``), the tile's rows below ``n`` stored for
    the batch rows ``groups[t]`` (a CUDA-core pass's rows, or the rows of a tensor-core pass group below the batch).
    A correct mapping gives one run ``[0, n)`` per batch row; a row twice in a pass is a second run (a double
    store), a missing one a gap (an element never stored)."""
    rows: dict[int, list[int]] = {}
    nt = (tiles or gemv_tiles)(n, tr)
    for k in range(nt * len(groups)):
        jt, t = item(k, nt, len(groups))
        rows.setdefault(t, []).extend(j for j in range(jt * tr, jt * tr + tr) if j < n)
    runs = []
    for t, js in sorted(rows.items()):
        js.sort()
        i = 0
        while i < len(js):
            m = 1
            while i + m < len(js) and js[i + m] == js[i] + m:
                m += 1
            runs += [(b, js[i], m) for b in groups[t]]
            i += m
    return tuple(runs)


def _gemv_groups(s: _Shapes, helpers: Any, mma: bool, sources: int) -> tuple[tuple[int, ...], ...]:
    """The batch rows of each pass (CUDA cores: ``gemv_batch_tile`` rows) or pass group (tensor cores: the rows
    ``gemv_group_row`` gives below the batch) of a GEMV opcode's items."""
    if not mma:
        return tuple(tuple(range(t * s.gbt, t * s.gbt + s.gbt)) for t in range(s.gnbt))
    row = getattr(helpers, "gemv_group_row", gemv_group_row)
    P = getattr(helpers, "gemv_group_passes", gemv_group_passes)(s.B, sources)
    ng = getattr(helpers, "gemv_groups", gemv_groups)(s.B, sources)
    return tuple(tuple(b for p in range(P) for c in range(8) if (b := row(t, p, c, P)) < s.B) for t in range(ng))


def _accesses(op: Op, args: tuple[int, ...], box: list[tuple[int, ...]], dims: list[tuple[int, int, int]],
              s: _Shapes, helpers: Any, modes: tuple[int, ...] = ()) -> Iterator[_Acc]:
    """Every run of elements the device code of ``op`` touches, per operand (see the module docstring); ``modes``:
    the operands' mode words (a rank program's PUSH operands are also read back, their box copied to the peers)."""
    for j, m in enumerate(modes):  # collective.push_operand: the box, row by row, read for the copies
        if m & int(Mode.PUSH):
            b0, b1, r0, r1, c0, c1 = box[j]
            for b in range(b0, b1):
                for r in range(r0, r1):
                    yield _Acc(j, helpers.elem_offset(dims[j][1], dims[j][2], b, r, c0), c1 - c0, "r")
    E, T, X = helpers.elem_offset, helpers.tile_rows, helpers.expert_row_offset
    G = getattr(helpers, "gemv_item", gemv_item)
    MMA = getattr(helpers, "gemv_mma", gemv_mma)(s.B)  # the GEMV opcodes on tensor cores
    TR = getattr(helpers, "gemv_tile_rows", gemv_tile_rows)(s.B)  # weight rows per GEMV work item
    NT = getattr(helpers, "gemv_tiles", gemv_tiles)
    B = s.B

    def d1(j: int) -> int:
        return dims[j][1]

    def d2(j: int) -> int:
        return dims[j][2]

    def row0(j: int) -> int:  # _row0: the first element of operand j's box
        return E(d1(j), d2(j), box[j][0], box[j][2], box[j][4])

    def chunked(n: int) -> int:  # elements of n // VEC 16-byte chunks
        return (n // VEC) * VEC

    def fp4_cols(jc: int) -> int:  # columns of the whole 16-byte code groups of an MXFP4 codes operand's rows
        return d2(jc) // FP4_GROUP_BYTES * FP4_GROUP

    def fp4_row(jc: int, js: int, e: int, r: int) -> Iterator[_Acc]:
        """Row r of expert e of an MXFP4 weight: its whole 16-byte code groups (operand jc) and their scale bytes
        (operand js)."""
        co, so = getattr(helpers, "fp4_row_offsets", fp4_row_offsets)(d1(jc), d2(jc), d1(js), d2(js), e, r)
        ng = d2(jc) // FP4_GROUP_BYTES
        yield _Acc(jc, co, ng * FP4_GROUP_BYTES, "r")
        yield _Acc(js, so, ng, "r")

    def gemv(xj: int, wjs: tuple[int, ...], gj: int | None, oj: int | None, rstd: bool, n: int, o_how: str,
             o_entry: int = 0, o_c0: int | None = None, tr: int = TR, sources: int = 1) -> Iterator[_Acc]:
        """A tiled GEMV: rstd of x rows (when normed), every batch row (CUDA cores: every pass's; tensor cores: every
        group's, rows past the batch read at its last) against the box's rows [0, n)."""
        L = chunked(d2(wjs[0]))
        xs = d1(xj) * d2(xj)  # batch stride of x (elements), from _row0 of the x operand
        if rstd:
            yield _Acc(xj, row0(xj), chunked(d2(xj)), "r", B, xs)
        yield _Acc(xj, row0(xj), L, "r", B, xs)
        if gj is not None:
            yield _Acc(gj, 0, L, "r")
        for wj in wjs:
            yield _Acc(wj, row0(wj), L, "r", n, L)  # rows j < n of the box (a tile past n: read at row n - 1)
        if oj is not None:
            c0 = box[oj][4] if o_c0 is None else o_c0
            for b, j0, m in _pass_runs(G, n, _gemv_groups(s, helpers, tr > 1, sources), tr, NT):
                yield _Acc(oj, E(d1(oj), d2(oj), b, o_entry, c0 + j0), m, o_how)  # tile row j -> column c0 + j

    if op == Op.EMBED:
        L = chunked(d2(1))
        for b in range(box[0][0], box[0][1]):
            yield _Acc(0, E(d1(0), d2(0), b, 0, 0), 1, "r")
            for tok in (0, dims[1][0] * d1(1) - 1):  # the token id is data: both extremes of the table
                yield _Acc(1, tok * d2(1), L, "r")
            yield _Acc(2, E(d1(2), d2(2), b, 0, 0), L, "w")
    elif op == Op.ATTN_RES_MIX:
        K, L = args[1], chunked(d2(0))
        yield _Acc(1, 0, L, "r")
        yield _Acc(2, 0, L, "r")
        for b in range(box[0][0], box[0][1]):
            for k in range(K):
                yield _Acc(0, E(d1(0), d2(0), b, 0, 0) + k * L, L, "r")
            yield _Acc(3, E(d1(3), d2(3), b, 0, 0), L, "w")
    elif op == Op.NORM_PROJ:
        yield from gemv(0, (2,), 1, 3, True, T(box[2][2], box[2][3]), "w")
    elif op == Op.MLP_GATE_UP:
        yield from gemv(0, (2, 3), 1, 4, True, T(box[2][2], box[2][3]), "w", sources=2)
    elif op == Op.O_PROJ_RESIDUAL:
        yield from gemv(0, (1,), None, 2, False, T(box[1][2], box[1][3]), "rw" if args[0] else "w",
                        o_entry=box[2][2])
    elif op == Op.FFN_OUT:
        routed, mlp = bool(args[0] & 1), bool(args[0] & 2)
        ln = 1 if s.latent_norm else 0
        ia, iu = 0, 1 + ln
        ih = 2 + ln if routed else 0
        idn = ih + 1
        io = ih + 2 if mlp else ih
        n = T(box[io][4], box[io][5])
        if routed:
            yield from gemv(ia, (iu,), 1 if ln else None, None, bool(ln), n, "")
        if mlp:
            yield from gemv(ih, (idn,), None, None, False, n, "")
        for b, j0, m in _pass_runs(G, n, _gemv_groups(s, helpers, MMA, 2), TR, NT):
            yield _Acc(io, E(d1(io), d2(io), b, box[io][2], box[io][4] + j0), m, "rw")
    elif op == Op.LM_HEAD:
        ti, r0 = args[0], args[2]
        yield from gemv(0, (2,), 1, 3, True, T(r0, args[3]), "w", o_c0=r0,
                        tr=getattr(helpers, "lm_head_tile_rows", lm_head_tile_rows)(s.B))
        row = box[4][2] if s.ranks else 0  # a rank's bests: its row of the mailbox
        yield _Acc(4, E(d1(4), d2(4), 0, row, ti), 1, "w", B, d1(4) * d2(4))
        yield _Acc(5, E(d1(5), d2(5), 0, row, ti), 1, "w", B, d1(5) * d2(5))
    elif op == Op.ARGMAX_ALL:  # misc.argmax_pick over a token's whole [rank, tile] row
        for b in range(B):
            for r in range(d1(0)):
                yield _Acc(0, E(d1(0), d2(0), b, r, 0), d2(0), "r")
                yield _Acc(1, E(d1(1), d2(1), b, r, 0), d2(1), "r")  # the arg-max tile is data: any of them
            yield _Acc(2, E(d1(2), d2(2), b, 0, 0), 1, "w")
    elif op == Op.ALLREDUCE_MIX:  # collective.allreduce_chunk, then misc.mix_one_row on operands 1, 3, 4, 5
        K, L = args[1], chunked(d2(2))
        reads_entry = bool(modes and modes[2] & int(Mode.READ))
        yield _Acc(3, 0, L, "r")
        yield _Acc(4, 0, L, "r")
        for b in range(box[2][0], box[2][1]):
            for r in range(box[0][2], box[0][3]):  # every source's partial
                yield _Acc(0, E(d1(0), d2(0), b, r, 0), L, "r")
            yield _Acc(2, E(d1(2), d2(2), b, box[2][2], 0), L, "rw" if reads_entry else "w")
            for k in range(K - 1):  # the candidates before the entry (the entry itself: read back above)
                yield _Acc(1, E(d1(1), d2(1), b, 0, 0) + k * L, L, "r")
            yield _Acc(5, E(d1(5), d2(5), b, 0, 0), L, "w")
    elif op == Op.MOE_COMBINE:  # collective.combine_chunk over every source's row, then (args 0) the norm pass
        jo = 2 if args[0] else 1
        L = box[0][5] - box[0][4]
        if args[0]:
            yield _Acc(1, 0, L, "r")
        for b in range(box[jo][0], box[jo][1]):
            for r in range(box[0][2], box[0][3]):  # every source's fp32 partial
                yield _Acc(0, E(d1(0), d2(0), b, r, box[0][4]), L, "r")
            yield _Acc(jo, E(d1(jo), d2(jo), b, box[jo][2], box[jo][4]), L, "rw" if args[0] else "w")
    elif op == Op.ARGMAX:
        Tn = d2(0)
        for b in range(B):
            yield _Acc(0, E(d1(0), Tn, b, 0, 0), Tn, "r")
            yield _Acc(1, E(d1(1), d2(1), b, 0, 0), d2(1), "r")  # the arg-max tile is data: any of them
            yield _Acc(2, E(d1(2), d2(2), b, 0, 0), 1, "w")
    elif op == Op.ROUTER:
        nE = dims[1][2]  # the bias has one entry per expert
        yield _Acc(1, 0, nE, "r")
        yield _Acc(2, 0, s.dmax, "w")  # compacted slots, then -1 past them: each slot once
        for b in range(B):
            yield _Acc(0, E(d1(0), d2(0), b, 0, 0), nE, "r")
            yield _Acc(3, E(d1(3), d2(3), b, 0, 0), s.dmax, "w")  # one thread per (token, slot j)
            yield _Acc(4, E(d1(4), d2(4), b, 0, 0), s.dmax, "w")
    elif op == Op.EXPERT_GATE_UP:
        s0, s1, r0, r1 = args
        L = fp4_cols(3) if s.fp4 else chunked(d2(3))
        xs = d1(0) * d2(0)
        yield _Acc(0, 0, L, "r", B, xs)
        for e in range(box[3][0], box[3][1]):  # the slot's expert is data: every expert of the box (a rank: its own)
            for r in (r0, r1 - 1):
                if s.fp4:
                    yield from fp4_row(3, 6, e, r)
                    yield from fp4_row(4, 7, e, r)
                else:
                    yield _Acc(3, X(d1(3), d2(3), e, r), L, "r")
                    yield _Acc(4, X(d1(4), d2(4), e, r), L, "r")
        for j in range(s0, s1):
            yield _Acc(1, E(d1(1), d2(1), 0, 0, j), 1, "r")
            yield _Acc(2, E(d1(2), d2(2), 0, 0, j), 1, "r", B, d1(2) * d2(2))
            for b in range(B):  # stored only where the slot is used
                yield _Acc(5, E(d1(5), d2(5), b, j, r0), r1 - r0, "w?")
    elif op == Op.EXPERT_DOWN:
        r0, r1 = args[2], args[3]
        L = fp4_cols(4) if s.fp4 else chunked(d2(4))
        for e in range(box[4][0], box[4][1]):  # the slot's expert is data: every expert of the box (a rank: its own)
            for r in (r0, r1 - 1):  # (MXFP4: a warp takes rows in pairs r, r + 1; the same rows in all)
                if s.fp4:
                    yield from fp4_row(4, 6, e, r)
                else:
                    yield _Acc(4, X(d1(4), d2(4), e, r), L, "r")
        yield _Acc(1, 0, s.dmax, "r")
        for b in range(B):
            yield _Acc(2, E(d1(2), d2(2), b, 0, 0), s.dmax, "r")
            yield _Acc(3, E(d1(3), d2(3), b, 0, 0), s.dmax, "r")
            yield _Acc(0, E(d1(0), d2(0), b, 0, 0), L, "r", s.dmax, d2(0))  # (token b, slot j) rows
            yield _Acc(5, E(d1(5), d2(5), b, box[5][2] if s.ranks else 0, r0), r1 - r0, "w")  # row r -> lane b's col r
    elif op == Op.KDA_STEP:
        h0, h1, b0, b1 = args
        dk, W = s.dk, s.conv
        hw = 4 * dk + 1
        for h in range(h0, h1):
            hw_ = h - h0 + box[6][4]  # the head's place in the head weights (A_log's box: h on one GPU)
            yield _Acc(5, hw_ * dk, dk, "r")  # dt_bias[c]
            yield _Acc(6, hw_, 1, "r")  # A_log[h]
            yield _Acc(8, 0, dk, "r")  # o_norm
            yield _Acc(4, E(1, d2(4), 0, hw_ * dk, 0), dk, "r", dk, d2(4))  # f_b rows of the head's channels
            for jj in range(3):
                yield _Acc(7, E(1, d2(7), 0, jj, hw_ * dk * W), dk * W, "r")
            for b in range(b0, b1):
                row = E(d1(0), d2(0), b, 0, 0)
                yield _Acc(0, row + h * hw, hw, "r")
                yield _Acc(1, row + box[1][4], dk, "r")
                for jj in range(3):
                    yield _Acc(2, E(d1(2), d2(2), b, jj, h * dk * (W - 1)), dk * (W - 1), "rw")
                yield _Acc(3, E(d1(3), d2(3), b, h, 0), dk * dk, "rw")
                yield _Acc(9, E(d1(9), d2(9), b, 0, h * dk), dk, "w")
    elif op == Op.MLA_Q:
        h0, h1 = args[0], args[1]
        qk, ql, kvl = s.nope + s.rope, s.ql, s.kvl
        yield _Acc(1, 0, ql, "r")
        for b in range(B):
            yield _Acc(0, E(d1(0), d2(0), b, 0, box[0][4]), ql, "r")
        for h in range(h0, h1):
            yield _Acc(2, row0(2) + (h - h0) * qk * ql, ql, "r", qk, ql)  # q_b rows (h - h0)·qk + j
            cw = getattr(helpers, "absorb_cw", absorb_cw)(kvl) * VEC  # W_UK columns per absorption task
            for i in range(kvl // cw):  # task i: its column block of W_UK rows (from its box) + nn, of mla_q's latent
                yield _Acc(3, E(1, d2(3), 0, (h - h0) * s.nope + box[3][2], i * cw), cw, "r", s.nope, d2(3))
                for b in range(B):
                    yield _Acc(4, E(d1(4), d2(4), b, h, i * cw), cw, "w")
            for b in range(B):
                yield _Acc(4, E(d1(4), d2(4), b, h, kvl), s.rope, "w")
    elif op == Op.MLA_KV_APPEND:
        kvl, rope = s.kvl, s.rope
        yield _Acc(1, 0, kvl, "r")
        for b in range(B):
            yield _Acc(2, E(d1(2), d2(2), b, 0, 0), 1, "r")
            yield _Acc(0, E(d1(0), d2(0), b, 0, box[0][4]), kvl + rope, "r")
            for p in (0, d1(3) - 1):  # the position is data: both ends of the cache
                yield _Acc(3, E(d1(3), d2(3), b, p, 0), kvl, "w?")
                yield _Acc(4, E(d1(4), d2(4), b, p, 0), rope, "w?")
    elif op == Op.MLA_PARTIAL:
        h0, h1 = args[0], args[1]
        kvl, rope = s.kvl, s.rope
        t0, t1 = box[2][2], box[2][3]  # causal: rows up to the sequence's position, never past t1
        for b in range(box[0][0], box[0][1]):
            yield _Acc(1, E(d1(1), d2(1), b, 0, 0), 1, "r")
            for t in (t0, t1 - 1):
                yield _Acc(2, E(d1(2), d2(2), b, t, 0), kvl, "r")
                yield _Acc(3, E(d1(3), d2(3), b, t, 0), rope, "r")
            for h in range(h0, h1):
                yield _Acc(0, E(d1(0), d2(0), b, h, 0), kvl + rope, "r")
                yield _Acc(4, E(d1(4), d2(4), b, h, box[4][4]), kvl + 2, "w")
    elif op == Op.MLA_REDUCE:
        h0, h1, gate = args[0], args[1], args[2]
        kvl, dv = s.kvl, s.dv
        io = len(box) - 1
        ns = d2(0) // (kvl + 2)
        for h in range(h0, h1):
            yield _Acc(1, row0(1) + (h - h0) * dv * kvl, kvl, "r", dv, kvl)  # W_UV rows (h - h0)·dv + d
            for b in range(B):
                yield _Acc(0, E(d1(0), d2(0), b, h, 0), ns * (kvl + 2), "r")
                if gate:
                    yield _Acc(2, E(d1(2), d2(2), b, 0, box[2][4] + (h - h0) * dv), dv, "r")
                yield _Acc(io, E(d1(io), d2(io), b, 0, h * dv), dv, "w")
    elif op == Op.NOP:
        return
    else:
        raise ValueError(f"replay: no address model for opcode {op!r}")


# ------------------------------------------------------------------------------------------- the replay
@dataclass(frozen=True)
class Finding:
    rule: str  # "bounds", "write_once", "prefetch", "stage"
    instruction: int
    message: str


@dataclass
class ReplayReport:
    findings: list[Finding] = field(default_factory=list)
    instructions: int = 0
    runs: int = 0
    elements_counted: int = 0
    stage_copies: int = 0  # stage copies replayed (own stages and next-stage descriptors)
    elements_staged: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self, limit: int = 10) -> str:
        head = [f"{f.rule} #{f.instruction}: {f.message}" for f in self.findings[:limit]]
        more = len(self.findings) - limit
        return "\n".join(head + ([f"... and {more} more"] if more > 0 else []))


def _decompose(off: int, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    _, d1, d2 = dims
    return off // (d1 * d2), (off // d2) % d1, off % d2


def _staged_in_box(start: int, n: int, dims: tuple[int, int, int], box: tuple[int, ...]) -> bool:
    """Whether the ``n`` contiguous elements from ``start`` (one stage copy) all lie in ``box``: both ends do, and
    where the copy crosses a row (a ``D0`` slice) the box spans whole rows (slices)."""
    b0, b1, r0, r1, c0, c1 = box
    first, last = _decompose(start, dims), _decompose(start + n - 1, dims)
    ends = all(b0 <= q[0] < b1 and r0 <= q[1] < r1 and c0 <= q[2] < c1 for q in (first, last))
    return ends and (first[:2] == last[:2] or (c0 == 0 and c1 == dims[2])) and (
        first[0] == last[0] or (r0 == 0 and r1 == dims[1]))


def replay(program: Any, cfg: Any, *, instructions: list[int] | None = None, helpers: Any = None,
           check_writes: bool = True, declared_from_all: bool = False, max_findings: int = 50) -> ReplayReport:
    """Replay the address arithmetic of every instruction (or those listed) of a decoded ``program`` for the model
    config ``cfg``; ``helpers`` is the module whose ``elem_offset`` / ``tile_rows`` / ``expert_row_offset`` (and
    ``gemv_item``, ...) run: the device's own, ``kernels/contracts/addr.py``, unless given (a mutated copy in the
    tests). Returns the findings (empty when clean).

    ``check_writes`` counts every stored element of the activation / state / output buffers against the declared
    writes of the replayed instructions (of every instruction with ``declared_from_all``: then a subset of
    instructions shows what the others leave unwritten)."""
    import torch

    helpers = helpers if helpers is not None else device_addr
    missing = [n for n in ("elem_offset", "tile_rows", "expert_row_offset") if not callable(getattr(helpers, n, None))]
    if missing:
        raise ValueError(f"replay: helpers module lacks {', '.join(missing)}")
    n_ins = len(program.instructions)
    if instructions is not None and any(not 0 <= i < n_ins for i in instructions):
        raise ValueError(f"replay: instruction indices outside the program's {n_ins}")
    s = shapes_for(cfg, program.batch, getattr(program, "expert_format", "dense"), getattr(program, "world", 1))
    rep = ReplayReport()
    bufs = program.buffers
    idx = range(len(program.instructions)) if instructions is None else instructions
    written = (Kind.ACT, Kind.OUTPUT, Kind.STATE)
    counted = {i for i, bs in enumerate(bufs) if bs.kind in written} if check_writes else set()
    seen: dict[int, list[torch.Tensor]] = {}  # device stores, per buffer
    want: dict[int, list[torch.Tensor]] = {}  # declared writes, per buffer

    per_rule: dict[str, int] = {}

    def add(rule: str, i: int, msg: str) -> None:
        per_rule[rule] = per_rule.get(rule, 0) + 1
        if per_rule[rule] <= max_findings:  # capped per rule, so one rule's flood does not hide another's
            rep.findings.append(Finding(rule, i, msg))

    def count(store: dict[int, list[torch.Tensor]], buf: int, at: torch.Tensor) -> None:
        store.setdefault(buf, []).append(at)  # element offsets, counted once at the end (bincount)

    def declare(ins: Any) -> None:
        """The elements an instruction declares written (WRITE or READ_WRITE), once each."""
        if not counted or ins.op not in _COUNTED_OPS:
            return
        for o in ins.operands:
            if o.buf in counted and (o.mode & int(Mode.WRITE)):
                b0, b1, r0, r1, c0, c1 = o.box
                _, d1, d2 = bufs[o.buf].shape
                br = (torch.arange(b0, b1)[:, None] * d1 + torch.arange(r0, r1)).reshape(-1)
                count(want, o.buf, (br[:, None] * d2 + torch.arange(c0, c1)).reshape(-1))

    succ = {u: w for q in program.queues for u, w in zip(q, q[1:])}

    def staged_range(i: int, what: str, buf: int, start: int, chunks: int, inside: list[tuple[int, ...]]) -> None:
        """One stage copy of ``chunks`` 16-byte chunks from element ``start`` of buffer ``buf``: a static weight,
        within the stage, every element inside one of the boxes ``inside``."""
        spec = bufs[buf]
        rep.stage_copies += 1
        if spec.kind != Kind.WEIGHT:
            add("prefetch", i, f"{what} reads {spec.name} ({spec.kind.name}) before the waits: not a static weight")
        esize = spec.element_size
        n = chunks * CHUNK_BYTES // esize
        if chunks < 1 or chunks * CHUNK_BYTES % esize or chunks * CHUNK_BYTES > STAGE_BYTES or start < 0 or \
                start + n > math.prod(spec.shape):
            add("stage", i, f"{what}: {chunks} chunks from element {start} of {spec.name} {list(spec.shape)} "
                            f"do not fit the buffer or the {STAGE_BYTES}-byte stage")
            return
        rep.elements_staged += n
        if not any(_staged_in_box(start, n, spec.shape, b) for b in inside):
            first, last = _decompose(start, spec.shape), _decompose(start + n - 1, spec.shape)
            add("stage", i, f"{what} copies {spec.name} {list(first)}..{list(last)} ({n} elements), outside the "
                            f"declared box{'es' if len(inside) != 1 else ''} {inside}")

    def own_start(ins: Any) -> tuple[int, int] | None:
        """(buffer, first element) of an instruction's own stage as the device addresses it (the operand's first
        element, _row0), or None when it stages nothing valid."""
        j = ins.stage[0]
        if not 0 <= j < len(ins.operands):
            return None
        o = ins.operands[j]
        _, d1, d2 = bufs[o.buf].shape
        return o.buf, helpers.elem_offset(d1, d2, o.box[0], o.box[2], o.box[4])

    def stage_copies(i: int, ins: Any) -> None:
        j, rows, chunks = ins.stage
        if j != -1:
            at = own_start(ins)
            if at is None:
                add("stage", i, f"{ins.op.name} stages operand {j} of {len(ins.operands)}")
            else:
                o = ins.operands[j]
                spec = bufs[o.buf]
                if rows * spec.shape[2] * spec.element_size != chunks * CHUNK_BYTES:
                    add("stage", i, f"{ins.op.name} stages {rows} rows of {spec.name} in {chunks} chunks")
                staged_range(i, f"{ins.op.name}'s own stage", at[0], at[1], chunks, [tuple(o.box)])
        buf, elem, chunks = ins.next_stage
        w = succ.get(i)
        want = None if w is None else own_start(program.instructions[w])
        want = want and (*want, program.instructions[w].stage[2])
        if buf == -1:
            if want is not None:
                add("stage", i, f"{ins.op.name} streams no next stage, but the next instruction #{w} stages {want}")
            return
        if w is None or not 0 <= buf < len(bufs):
            add("stage", i, f"{ins.op.name} streams buffer {buf} for a next instruction (next: {w})")
            return
        nxt = program.instructions[w]
        staged_range(i, f"{ins.op.name}'s next-stage copy for #{w} {nxt.op.name}", buf, elem, chunks,
                     [tuple(o.box) for o in nxt.operands if o.buf == buf and o.mode & int(Mode.PREFETCH)])
        if (buf, elem, chunks) != want:
            add("stage", i, f"{ins.op.name} streams (buffer, element, chunks) {(buf, elem, chunks)} for #{w}, which "
                            f"stages {want}")

    for i in idx:
        ins = program.instructions[i]
        rep.instructions += 1
        ops = ins.operands
        dims = [tuple(bufs[o.buf].shape) for o in ops]
        boxes = [tuple(o.box) for o in ops]
        for j, o in enumerate(ops):
            if (o.mode & int(Mode.PREFETCH)) and bufs[o.buf].kind != Kind.WEIGHT:
                add("prefetch", i, f"{ins.op.name} operand {j} ({bufs[o.buf].name}, {bufs[o.buf].kind.name}) "
                                   "is marked PREFETCH")
        stage_copies(i, ins)
        for a in _accesses(ins.op, tuple(ins.args), [tuple(b) for b in boxes], dims, s, helpers,
                           tuple(int(o.mode) for o in ops)):
            rep.runs += 1
            if not 0 <= a.j < len(ops):
                add("bounds", i, f"{ins.op.name} addresses operand {a.j} of {len(ops)}")
                continue
            dm, (b0, b1, r0, r1, c0, c1) = dims[a.j], boxes[a.j]
            bad = a.length < 1 or a.count < 1
            for k in {0, a.count - 1}:  # the first and the last run of the group: its corners
                lo = a.start + k * a.stride
                first, last = _decompose(lo, dm), _decompose(lo + a.length - 1, dm)
                inside = all(b0 <= q[0] < b1 and r0 <= q[1] < r1 and c0 <= q[2] < c1 for q in (first, last))
                if bad or lo < 0 or first[:2] != last[:2] or not inside:
                    add("bounds", i, f"{ins.op.name} L{ins.layer} operand {a.j} ({bufs[ops[a.j].buf].name}) "
                                     f"{'writes' if 'w' in a.how else 'reads'} {list(first)}..{list(last)} "
                                     f"({a.length} elements) outside its box b[{b0}:{b1}] r[{r0}:{r1}] c[{c0}:{c1}]")
                    bad = True
                    break
            buf = ops[a.j].buf
            if buf in counted and a.how in ("w", "rw") and a.length > 0 and a.count > 0:
                # stores outside the box are counted too (where inside the buffer): they land on another
                # instruction's elements, which are then stored twice
                run = torch.arange(a.length)
                if a.count > 1:
                    run = (torch.arange(a.count)[:, None] * a.stride + run).reshape(-1)
                run = a.start + run
                hi = a.start + max(0, (a.count - 1) * a.stride) + a.length
                if a.start < 0 or hi > math.prod(bufs[buf].shape) or a.stride < 0:
                    run = run[(run >= 0) & (run < math.prod(bufs[buf].shape))]
                count(seen, buf, run)
                rep.elements_counted += len(run)
        if not declared_from_all:
            declare(ins)
    if declared_from_all:
        for ins in program.instructions:
            declare(ins)
    for buf in sorted(set(seen) | set(want)):
        n = math.prod(bufs[buf].shape)
        got, exp = (torch.bincount(torch.cat(st[buf]), minlength=n) if buf in st else torch.zeros(n, dtype=torch.int64)
                    for st in (seen, want))
        bad = (got != exp).nonzero()
        if len(bad):
            k = int(bad[0, 0])
            add("write_once", -1, f"{bufs[buf].name}: {len(bad)} element(s) stored a different number of times "
                                  f"than declared, first {_decompose(k, tuple(bufs[buf].shape))} stored "
                                  f"{int(got[k])}x, declared {int(exp[k])}x")
    return rep


# every opcode whose stores are all replayed as counted runs ("w" / "rw"); the others' declared write boxes are
# left out of the count (their data-dependent stores are checked for bounds only)
_COUNTED_OPS = frozenset(Op) - {Op.EXPERT_GATE_UP, Op.MLA_KV_APPEND}
