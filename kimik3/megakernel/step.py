"""One Kimi K3 decode step as megakernel instructions: the model-specific half of building a program (§1.2).

:func:`build_step` lists the instructions of one decode step in *sequential* order — running them one after the
other is the reference computation — with their operand declarations, a *group* name (the counter the instruction
signals: "L3.kda" is every KDA_STEP tile of layer 3) and shape-based cost contributions; :class:`Tiling` says how
finely each phase is cut. Everything after that knows nothing of the model (:mod:`kimik3.megakernel.scheduler`).
The builder has one method per block, called in the model's order (embedding; per layer the attention-site mix,
KDA or MLA mixer, output projection, MLP-site mix, dense MLP or MoE; the output head). Buffer ids are handed out
in declaration order, so the order of the ``buf`` / ``weight`` calls is part of the program.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product

import torch

from kimik3.kernels.contracts.peers import AR_SLOTS, MOE_SLOTS, mailbox_row
from kimik3.megakernel.instructions import (
    FFN_LATENT_NORM,
    FFN_MLP,
    FFN_ROUTED,
    BufferSpec,
    Instruction,
    Kind,
    Mode,
    NormRole,
    Op,
    Operand,
    Site,
)
from kimik3.megakernel.layout import (
    check_expert_format,
    check_supported,
    expert_weight_names,
    kda_head_width,
    kda_in_rows,
    localize,
    mla_in_segments,
    packed_name,
    state_name,
)
from kimik3.megakernel.ranks import SINGLE, Shard
from kimik3.model.config import ModelConfig, get_preset
from kimik3.model.modeling import keeps_fp32
from kimik3.model.quant import MXFP4_GROUP

__all__ = ["Tiling", "StepSpec", "build_step"]

R, W, RW = Mode.READ, Mode.WRITE, Mode.READ_WRITE
P = Mode.READ | Mode.PREFETCH  # a static weight read, allowed before the waits

# nominal bytes per weight for the shape-based split of a block's cost between its instructions; the totals are
# calibrated by kimik3.perf.cost.decode_cost, so only the ratios between tiles matter
_BPW = 2.0

# one instruction's raw cost contributions: {(layer, cost block): [weight, state+cache, activation bytes, flops]}
CostContrib = dict[tuple[int, str], list[float]]


# MLA_PARTIAL's smallest head tile when heads are split over SMs: the device code gives each of its 12 warps a pair of
# heads per pass (kernels/megakernel/mla.py PART_HB = 2), so fewer heads per tile would leave warps idle
MLA_PARTIAL_MIN_HEADS = 24


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _aligned(total: int, tiles: int, align: int) -> int:
    """Tile size giving about ``tiles`` tiles of ``total``, rounded up to ``align`` (never above ``total``)."""
    size = _ceil_div(total, max(1, tiles))
    if total > align:
        size = _ceil_div(size, align) * align
    return max(1, min(size, total))


def _split(total: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, total)) for a in range(0, total, size)]


def _span(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """Tiles of ``size`` over ``[lo, hi)`` (a rank's share of a dimension)."""
    return [(lo + a, lo + b) for a, b in _split(hi - lo, size)]


def _has_dense_ffn(cfg: ModelConfig) -> bool:
    return any(cfg.ffn(i) == "dense" for i in range(cfg.num_hidden_layers))


# ====================================================================================================== tiling


@dataclass(frozen=True)
class Tiling:
    """Tile sizes. ``Tiling.auto`` aims at about one tile per SM in every wide phase."""

    batch_rows: int  # EMBED / ATTN_RES_MIX: batch rows per tile
    kda_in_rows: int  # NORM_PROJ rows per tile, KDA input projections (packed)
    mla_in_rows: int  # NORM_PROJ rows per tile, MLA input projections
    ffn_in_rows: int  # NORM_PROJ / MLP_GATE_UP weight rows per tile in the FFN input phase (gate+up count twice)
    kda_heads: int  # KDA_STEP heads per tile
    kda_batch_rows: int  # KDA_STEP batch rows per tile (the recurrent state is per sequence)
    mla_heads: int  # MLA_Q / MLA_REDUCE heads per tile
    mla_partial_heads: int  # MLA_PARTIAL heads per tile (all of them when the (sequence, split) tiles fill the SMs)
    mla_splits: int  # MLA_PARTIAL context splits over max_seq_len
    mla_batch_rows: int  # MLA_PARTIAL batch rows per tile (every sequence attends to its own cache)
    out_cols: int  # O_PROJ_RESIDUAL / FFN_OUT hidden columns per tile
    expert_slots: int  # EXPERT_GATE_UP expert slots per tile
    expert_rows: int  # EXPERT_GATE_UP expert hidden channels per tile
    expert_down_rows: int  # EXPERT_DOWN latent rows per tile
    lm_rows: int  # LM_HEAD vocabulary rows per tile

    @classmethod
    def auto(cls, cfg: ModelConfig, batch: int, num_sms: int, max_seq_len: int = 4096, align: int = 16) -> Tiling:
        """``cfg`` a rank slice (``ModelConfig.rank_slice``): the tiles cut the rank's shares, not the whole model's
        dimensions, so a rank's phases also spread over every SM."""
        S = max(1, num_sms)
        H = cfg.hidden_size
        nh_kda, nh_mla = max(1, cfg.held("kda_heads")), max(1, cfg.held("mla_heads"))
        sized = cfg.whole().replace(kda_num_heads=nh_kda if cfg.kda_layers else cfg.kda_num_heads,
                                    num_attention_heads=nh_mla if cfg.mla_layers else cfg.num_attention_heads)
        ffn_rows = 0
        if cfg.moe_layers:  # the router and the latent down-projection are whole on every rank
            ffn_rows = cfg.n_routed_experts + (cfg.moe_latent_size or 0) + 2 * cfg.held("shared")
        if _has_dense_ffn(cfg):
            ffn_rows = max(ffn_rows, 2 * cfg.held("dense"))
        slots = min(cfg.held("experts"), batch * cfg.num_experts_per_tok) if cfg.n_routed_experts else 1
        per_slot = max(1, S // slots)
        mla_in = sum(b - a for a, b in mla_in_segments(sized).values()) if cfg.mla_layers else 1
        kda_heads = _ceil_div(nh_kda, min(nh_kda, S))
        kda_tiles = _ceil_div(nh_kda, kda_heads)
        kda_batch = _ceil_div(batch, min(batch, S // kda_tiles)) if 2 * kda_tiles <= S else batch
        # MLA_PARTIAL: about one tile per SM over (sequence, split); at least two splits, >= 256 tokens each
        splits = max(1, min(max_seq_len, max(2, min(_ceil_div(S, batch), _ceil_div(max_seq_len, 256)))))
        mla_batch = _ceil_div(batch, min(batch, max(1, S // splits)))
        # MLA_PARTIAL heads: all of them while (sequence, split) tiles alone fill the SMs (the latent cache is then
        # read once per split); with SMs to spare the heads are cut into tiles of at least MLA_PARTIAL_MIN_HEADS
        # (one head pair per warp of the device code), so one MLA layer's attention is not a few SMs' serial work
        mla_free = max(1, S // (splits * _ceil_div(batch, mla_batch)))
        mla_part_heads = max(min(nh_mla, MLA_PARTIAL_MIN_HEADS), _ceil_div(nh_mla, mla_free))
        return cls(
            batch_rows=_ceil_div(batch, min(batch, S)),
            kda_in_rows=_aligned(kda_in_rows(sized), S, align) if cfg.kda_layers else 1,
            mla_in_rows=_aligned(mla_in, S, align),
            ffn_in_rows=max(2, _aligned(ffn_rows, S, align)),
            kda_heads=kda_heads,
            kda_batch_rows=kda_batch,
            mla_heads=_ceil_div(nh_mla, min(nh_mla, S)),
            mla_partial_heads=mla_part_heads,
            mla_splits=splits,
            mla_batch_rows=mla_batch,
            out_cols=_aligned(H, S, align),
            expert_slots=1,
            expert_rows=_aligned(cfg.moe_intermediate_size, per_slot, align) if cfg.moe_layers else 1,
            expert_down_rows=_aligned(cfg.moe_latent_size or 1, S, align),
            lm_rows=_aligned(cfg.held("vocab"), S, align),
        )


# ====================================================================================================== the step


@dataclass
class StepSpec:
    """What :func:`build_step` returns: buffers, instructions (no waits yet) in sequential order, their groups and
    raw cost contributions ``{(layer, block): [weight, state+cache, activation bytes, flops]}``."""

    cfg: ModelConfig
    batch: int
    max_seq_len: int
    tiling: Tiling
    buffers: list[BufferSpec]
    instructions: list[Instruction]
    groups: list[str]
    raw_costs: list[dict[tuple[int, str], list[float]]] = field(repr=False)
    expert_format: str = "dense"  # how the routed experts are stored (kimik3.megakernel.layout.EXPERT_FORMATS)
    shard: Shard = SINGLE  # the rank this step is built for (kimik3.megakernel.ranks)

    def group_members(self) -> dict[str, list[int]]:
        m: dict[str, list[int]] = defaultdict(list)
        for i, g in enumerate(self.groups):
            m[g].append(i)
        return dict(m)


class _StepBuilder:
    """Declares buffers and appends instructions for one decode step, one method per block of the model."""

    def __init__(self, cfg: ModelConfig, batch: int, max_seq_len: int, tiling: Tiling, act_dtype: torch.dtype,
                 context_len: int, expert_format: str = "dense", shard: Shard = SINGLE):
        self.cfg, self.B, self.max_seq_len, self.t = cfg, batch, max_seq_len, tiling
        self.shard, self.world = shard, shard.world
        self.n_reduce = 0  # all-reduces so far: the mailbox slot of the next is n_reduce % AR_SLOTS
        self.ctx = context_len
        self.expert_format = expert_format
        self.H = cfg.hidden_size
        self.act = act_dtype
        self.acc = torch.float64 if act_dtype == torch.float64 else torch.float32
        self.ab = torch.empty((), dtype=act_dtype).element_size()
        self.buffers: list[BufferSpec] = []
        self.ids: dict[str, int] = {}
        self.instructions: list[Instruction] = []
        self.groups: list[str] = []
        self.costs: list[CostContrib] = []
        self._declare_activations()

    # ------------------------------------------------------------------------------------------------ primitives

    def buf(self, name: str, kind: Kind, shape: Sequence[int], dtype: torch.dtype) -> int:
        shape = tuple(int(s) for s in shape)
        if name in self.ids:
            spec = self.buffers[self.ids[name]]
            if spec.shape != shape:
                raise AssertionError(f"buffer {name} declared with two shapes {spec.shape} / {shape}")
            return self.ids[name]
        self.ids[name] = len(self.buffers)
        self.buffers.append(BufferSpec(name, kind, shape, dtype))
        return self.ids[name]

    def weight(self, name: str, shape: Sequence[int]) -> int:
        shape = tuple(shape)
        shape3 = (1, 1, shape[0]) if len(shape) == 1 else (1, *shape) if len(shape) == 2 else shape
        fp32 = (keeps_fp32(name) or name.endswith("kda_conv")) and self.act != torch.float64
        return self.buf(name, Kind.WEIGHT, shape3, torch.float32 if fp32 else self.act)

    def expert_weight(self, layer: int, name: str, E: int, rows: int, cols: int) -> tuple[int, ...]:
        """Buffer ids of one routed-expert weight ``[E, rows, cols]`` of ``layer``: ``(dense,)``, or for MXFP4
        ``(codes [E, rows, cols/2], scales [E, rows, cols/32])``, uint8, named as the model holds them."""
        names = expert_weight_names(layer, self.expert_format)[name]
        if self.expert_format == "dense":
            return (self.weight(names[0], (E, rows, cols)),)
        return (self.buf(names[0], Kind.WEIGHT, (E, rows, cols // 2), torch.uint8),
                self.buf(names[1], Kind.WEIGHT, (E, rows, cols // MXFP4_GROUP), torch.uint8))

    def expert_rows(self, bufs: tuple[int, ...], r0: int, r1: int) -> tuple[Operand, list[Operand]]:
        """Rows ``r0:r1`` of every expert of this rank of one weight from :meth:`expert_weight`: the (dense or codes)
        operand and the scales operands to append (none for dense). Whole rows: an expert tile reads full widths."""
        e0, e1 = self.part(self.cfg.n_routed_experts, "n_routed_experts")
        ops = [self.op(b, P, (e0, e1, r0, r1, 0, self.shape(b)[2])) for b in bufs]
        return ops[0], ops[1:]

    def shape(self, buf: int) -> tuple[int, int, int]:
        return self.buffers[buf].shape

    def full(self, buf: int) -> tuple[int, ...]:
        d = self.shape(buf)
        return (0, d[0], 0, d[1], 0, d[2])

    def op(self, buf: int, mode: Mode, box: tuple[int, ...] | None = None) -> Operand:
        box = self.full(buf) if box is None else tuple(box)
        return Operand(buf, mode, box)

    def add(self, op: Op, layer: int, args: Sequence[int], operands: list[Operand], group: str,
            cost: CostContrib) -> None:
        a = tuple(args) + (0,) * (4 - len(args))
        push = any(o.mode & Mode.PUSH for o in operands)  # a push reaches, and signals, every rank
        self.instructions.append(Instruction(op, layer, a, tuple(operands), peers=(0, self.world) if push else (0, 0)))
        self.groups.append(group)
        self.costs.append(cost)

    def spec(self) -> StepSpec:
        buffers, instructions = self.buffers, self.instructions
        if self.world > 1:  # the rank's weights as it holds them (its shares), boxes moved onto them
            buffers, instructions = localize(buffers, instructions)
        return StepSpec(self.cfg, self.B, self.max_seq_len, self.t, buffers, instructions, self.groups,
                        self.costs, self.expert_format, self.shard)

    # ------------------------------------------------------------------------------------ across ranks

    def part(self, total: int, what: str) -> tuple[int, int]:
        return self.shard.part(total, what)

    def push_partial(self, c0: int, c1: int) -> Operand:
        """The rank's partial sum of hidden columns ``c0:c1``, pushed into the next all-reduce's mailbox slot."""
        row = mailbox_row(self.n_reduce % AR_SLOTS, self.shard.rank, self.world)
        return self.op(self.ar_mbox, W | Mode.PUSH, (0, self.B, row, row + 1, c0, c1))

    def reduce_operands(self, b0: int, b1: int, K: int, start: bool) -> list[Operand]:
        """ALLREDUCE_MIX's leading operands: every rank's partial of batch rows ``b0:b1`` (the current slot), the
        stream entries before the block's partial, and that partial (started or accumulated)."""
        slot = self.n_reduce % AR_SLOTS
        H = self.H
        return [self.op(self.ar_mbox, R, (b0, b1, slot * self.world, (slot + 1) * self.world, 0, H)),
                self.op(self.stream, R, (b0, b1, 0, K - 1, 0, H)),
                self.op(self.stream, W if start else RW, (b0, b1, K - 1, K, 0, H))]

    # ------------------------------------------------------------------------------------ shared activations

    def _declare_activations(self) -> None:
        """The step's inputs and the activations every layer reuses (declared first: they get the lowest ids)."""
        cfg, B, H, act = self.cfg, self.B, self.H, self.act
        self.ids_in = self.buf("ids", Kind.INPUT, (B, 1, 1), torch.int64)
        self.pos = self.buf("pos", Kind.INPUT, (B, 1, 1), torch.int64)
        # the Attention Residuals stream: one entry per finished block, the current block's partial sum last
        self.stream = self.buf("stream", Kind.ACT, (B, cfg.attn_res_slots + 1, H), act)
        self.mix = self.buf("mix", Kind.ACT, (B, 1, H), act)
        widths = [kda_in_rows(cfg)] if cfg.kda_layers else []
        if cfg.mla_layers:
            widths.append(mla_in_segments(cfg)["g"][1])
        self.mixer_proj = self.buf("mixer_proj", Kind.ACT, (B, 1, max(widths)), act)
        self.attn_o = self.buf("attn_o", Kind.ACT,
                               (B, 1, max(cfg.kda_proj_dim, cfg.num_attention_heads * cfg.v_head_dim)), act)
        self.batch_tiles = _split(B, self.t.batch_rows)
        if self.world > 1:  # the mailboxes peers push into: [batch, slot·world + source rank, columns] (a row of
            # them addressed as a stream entry is: the producers' stores need no other form)
            self.ar_mbox = self.buf("mbox.allreduce", Kind.MAILBOX, (B, AR_SLOTS * self.world, H), act)
            if cfg.moe_layers:
                self.moe_mbox = self.buf("mbox.latent_sum", Kind.MAILBOX, (B, MOE_SLOTS * self.world,
                                                                           cfg.moe_latent_size), self.acc)

    # ------------------------------------------------------------------------------------ tiled building blocks

    def attn_res(self, layer: int, site: Site, K: int, norm: str, proj: str, group: str,
                 start: bool | None = None) -> None:
        """ATTN_RES_MIX tiles over the batch: the mix of the first ``K`` stream entries into ``mix``. On a rank of
        several, ``start`` (the block's partial sum starts here, else accumulates) makes each tile an
        ALLREDUCE_MIX that first sums every rank's partial from the mailbox into stream entry ``K - 1``."""
        H, ab = self.H, self.ab
        nw, pw = self.weight(norm, (H,)), self.weight(proj, (1, H))
        reduce = self.world > 1 and start is not None
        for b0, b1 in self.batch_tiles:
            n = b1 - b0
            cost = {(layer, "attn_res"): [2 * H * _BPW, 0, (K + 1) * n * H * ab, 6.0 * n * K * H]}
            if reduce:
                cost[(layer, "collective")] = [0, 0, (self.world + 2) * n * H * ab, float(self.world * n * H)]
                self.add(Op.ALLREDUCE_MIX, layer, (int(site), K, b0, b1),
                         [*self.reduce_operands(b0, b1, K, start), self.op(nw, P), self.op(pw, P),
                          self.op(self.mix, W, (b0, b1, 0, 1, 0, H))], group, cost)
            else:
                self.add(Op.ATTN_RES_MIX, layer, (int(site), K, b0, b1),
                         [self.op(self.stream, R, (b0, b1, 0, K, 0, H)), self.op(nw, P), self.op(pw, P),
                          self.op(self.mix, W, (b0, b1, 0, 1, 0, H))], group, cost)
        if reduce:
            self.n_reduce += 1

    def norm_proj(self, layer: int, role: NormRole, x: Operand, norm: str, weight: int, rows: tuple[int, int],
                  out: int, out_col0: int, tile_rows: int, group: str, block: str, fp32: bool = False) -> None:
        """NORM_PROJ tiles over weight rows ``rows``; weight row r lands in output column out_col0 + r - rows[0]."""
        B, ab = self.B, self.ab
        nw = self.weight(norm, (self.H,))
        Hin = self.shape(weight)[2]
        for r0, r1 in _split(rows[1] - rows[0], tile_rows):
            n, w0, o0 = r1 - r0, rows[0] + r0, out_col0 + r0
            self.add(Op.NORM_PROJ, layer, (int(fp32), int(role), w0, w0 + n),
                     [x, self.op(nw, P), self.op(weight, P, (0, 1, w0, w0 + n, 0, Hin)),
                      self.op(out, W, (0, B, 0, 1, o0, o0 + n))],
                     group, {(layer, block): [(n * Hin + Hin) * _BPW, 0, B * (Hin + n) * ab, 2.0 * B * n * Hin]})

    def gate_up(self, layer: int, role: NormRole, x: Operand, norm: str, gate: int, up: int, rows: tuple[int, int],
                tile: int, out: int, group: str, block: str) -> None:
        """MLP_GATE_UP tiles over hidden channels ``rows``: norm, gate and up rows, SiLU(gate)·up into ``out``."""
        B, H, ab = self.B, self.H, self.ab
        nw = self.weight(norm, (H,))
        for r0, r1 in _span(*rows, tile):
            n = r1 - r0
            self.add(Op.MLP_GATE_UP, layer, (0, int(role), r0, r1),
                     [x, self.op(nw, P), self.op(gate, P, (0, 1, r0, r1, 0, H)), self.op(up, P, (0, 1, r0, r1, 0, H)),
                      self.op(out, W, (0, B, 0, 1, r0, r1))],
                     group, {(layer, block): [(2 * n * H + H) * _BPW, 0, B * (H + n) * ab, 4.0 * B * n * H]})

    def out_cols(self, layer: int, op: Op, flags: int, entry: int,
                 sources: list[tuple[list[Operand], int, tuple[int, int], str]], group: str, accumulate: bool) -> None:
        """Column tiles of stream[:, entry] (O_PROJ_RESIDUAL, FFN_OUT). Each source is (its activation operands,
        the weight whose rows = these columns, the weight's input columns, cost block); operands are laid out
        source by source, weight rows after the source's activations, and the output tile last: the stream, or on
        a rank of several the rank's partial sum pushed to every rank (summed by the ALLREDUCE_MIX that follows)."""
        B, ab = self.B, self.ab
        partial = self.world > 1
        for c0, c1 in _split(self.H, self.t.out_cols):
            n = c1 - c0
            ops: list[Operand] = []
            cost: CostContrib = {}
            for acts, wb, (k0, k1), block in sources:
                Hin = k1 - k0
                ops += acts + [self.op(wb, P, (0, 1, c0, c1, k0, k1))]
                c = cost.setdefault((layer, block), [0.0, 0.0, 0.0, 0.0])
                c[0] += n * Hin * _BPW
                c[2] += B * Hin * ab
                c[3] += 2.0 * B * n * Hin
            if partial:
                ops.append(self.push_partial(c0, c1))
                cost[(layer, "collective")] = [0, 0, self.world * B * n * ab, 0.0]
            else:
                ops.append(self.op(self.stream, RW if accumulate else W, (0, B, entry, entry + 1, c0, c1)))
            cost[(layer, sources[0][3])][2] += B * n * ab * (2 if accumulate and not partial else 1)
            self.add(op, layer, (flags, entry, c0, c1), ops, group, cost)

    # ------------------------------------------------------------------------------------------------ the model

    def embedding(self) -> None:
        """EMBED tiles over the batch: token rows into the stream's first entry."""
        H, V, ab = self.H, self.cfg.vocab_size, self.ab
        emb = self.weight("model.embed_tokens.weight", (V, H))
        for b0, b1 in self.batch_tiles:
            n = b1 - b0
            self.add(Op.EMBED, 0, (0, 0, b0, b1),
                     [self.op(self.ids_in, R, (b0, b1, 0, 1, 0, 1)), self.op(emb, P),
                      self.op(self.stream, W, (b0, b1, 0, 1, 0, H))],
                     "embed", {(-1, "embed"): [n * H * _BPW, 0, n * H * ab + n * 8, 0]})

    def layer(self, layer: int) -> None:
        """One decoder layer: attention-site mix, mixer, o_proj into the block's partial sum, MLP-site mix, FFN."""
        cfg, B, H = self.cfg, self.B, self.H
        pre = f"model.layers.{layer}."
        bs = cfg.attn_res_block_size
        blk = layer // bs
        boundary = layer % bs == 0
        if layer == 0:
            x_in = self.op(self.stream, R, (0, B, 0, 1, 0, H))  # the attention site of layer 0 does not mix
        else:  # (across ranks: the previous FFN's all-reduce, accumulated into the block's partial, comes first)
            K = blk + 1 if boundary else blk + 2
            self.attn_res(layer, Site.ATTN, K, pre + "self_attention_res_norm.weight",
                          pre + "self_attention_res_proj.weight", f"L{layer}.attn_mix", start=False)
            x_in = self.op(self.mix, R)
        if cfg.mixer(layer) == "kda":
            o_rows, o_cols, block = self.kda_mixer(layer, x_in)
        else:
            o_rows, o_cols, block = self.mla_mixer(layer, x_in)
        # o_proj + residual into the block's partial sum (a block's first layer starts it, the others accumulate);
        # across ranks each rank's heads give a partial o_proj, summed by the ALLREDUCE_MIX of the MLP site
        wo = self.weight(pre + "self_attn.o_proj.weight", (H, o_rows))
        one = self.world == 1
        self.out_cols(layer, Op.O_PROJ_RESIDUAL, int(not boundary and one), blk + 1,
                      [([self.op(self.attn_o, R, (0, B, 0, 1, *o_cols))], wo, o_cols, block)], f"L{layer}.o_proj",
                      accumulate=not boundary)
        self.attn_res(layer, Site.MLP, blk + 2, pre + "mlp_res_norm.weight", pre + "mlp_res_proj.weight",
                      f"L{layer}.mlp_mix", start=boundary)
        mlp_w = max(cfg.moe_intermediate_size * cfg.n_shared_experts,
                    cfg.intermediate_size if _has_dense_ffn(cfg) else 0)
        mlp_h = self.buf("mlp_h", Kind.ACT, (B, 1, mlp_w), self.act)
        if cfg.ffn(layer) == "dense":
            self.dense_ffn(layer, blk, mlp_h)
        else:
            self.moe_ffn(layer, blk, mlp_h)

    def kda_mixer(self, layer: int, x_in: Operand) -> tuple[int, str]:
        """KDA: packed input projections, then KDA_STEP tiles over (heads, batch) updating conv and recurrent
        state. Returns the o_proj input width and the cost block."""
        cfg, B, H, ab, acc, t = self.cfg, self.B, self.H, self.ab, self.acc, self.t
        pre = f"model.layers.{layer}."
        nh, dk, Wc = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        Pd = cfg.kda_proj_dim
        hw = kda_head_width(cfg)
        mixer_proj = self.mixer_proj
        hr0, hr1 = self.part(nh, "kda_num_heads")  # this rank's heads
        w_in = self.weight(packed_name(layer, "kda_in"), (kda_in_rows(cfg), H))
        # the heads' packed rows, then the decay input f_a (shared by every head: each rank computes it)
        for rows in ((0, kda_in_rows(cfg)),) if self.world == 1 else ((hr0 * hw, hr1 * hw), (nh * hw, nh * hw + dk)):
            self.norm_proj(layer, NormRole.KDA_IN, x_in, pre + "input_layernorm.weight", w_in, rows, mixer_proj,
                           rows[0], t.kda_in_rows, f"L{layer}.kda_in", "kda")
        conv = self.buf(state_name(layer, "conv"), Kind.STATE, (B, 3, Pd * (Wc - 1)), self.act)
        S = self.buf(state_name(layer, "S"), Kind.STATE, (B, nh, dk * dk), acc)
        fb = self.weight(pre + "self_attn.f_b_proj.weight", (Pd, dk))
        dt = self.weight(pre + "self_attn.dt_bias", (Pd,))
        alog = self.weight(pre + "self_attn.A_log", (nh,))
        cw = self.weight(packed_name(layer, "kda_conv"), (3, Pd * Wc))
        onorm = self.weight(pre + "self_attn.o_norm.weight", (dk,))
        for (h0, h1), (b0, b1) in product(_span(hr0, hr1, t.kda_heads), _split(B, t.kda_batch_rows)):
            n, nb = h1 - h0, b1 - b0
            ops = [self.op(mixer_proj, R, (b0, b1, 0, 1, h0 * hw, h1 * hw)),
                   self.op(mixer_proj, R, (b0, b1, 0, 1, nh * hw, nh * hw + dk)),
                   self.op(conv, RW, (b0, b1, 0, 3, h0 * dk * (Wc - 1), h1 * dk * (Wc - 1))),
                   self.op(S, RW, (b0, b1, h0, h1, 0, dk * dk)),
                   self.op(fb, P, (0, 1, h0 * dk, h1 * dk, 0, dk)),
                   self.op(dt, P, (0, 1, 0, 1, h0 * dk, h1 * dk)),
                   self.op(alog, P, (0, 1, 0, 1, h0, h1)),
                   self.op(cw, P, (0, 1, 0, 3, h0 * dk * Wc, h1 * dk * Wc)),
                   self.op(onorm, P),
                   self.op(self.attn_o, W, (b0, b1, 0, 1, h0 * dk, h1 * dk))]
            state_bytes = 2.0 * nb * n * (dk * dk * torch.empty((), dtype=acc).element_size()
                                          + 3 * dk * (Wc - 1) * ab)
            wts = (n * dk * dk + 2 * n * dk + n + 3 * n * dk * Wc + dk) * _BPW
            self.add(Op.KDA_STEP, layer, (h0, h1, b0, b1), ops, f"L{layer}.kda",
                     {(layer, "kda"): [wts, state_bytes, nb * n * (hw + dk) * ab,
                                       nb * n * (2.0 * dk * dk + 7.0 * dk * dk + 30.0 * dk)]})
        return Pd, (hr0 * dk, hr1 * dk), "kda"

    def mla_mixer(self, layer: int, x_in: Operand) -> tuple[int, str]:
        """MLA (absorbed): input projections per segment, the latent-cache append, absorbed queries, split-context
        partial attention and the reduce with the value up-projection. Returns the o_proj input width and the
        cost block. Across ranks each rank computes the shared q / kv LoRA projections and cache append, and only
        its own heads' queries, attention and gate."""
        cfg, B, H, ab, acc, t = self.cfg, self.B, self.H, self.ab, self.acc, self.t
        T, ctx = self.max_seq_len, self.ctx
        pre = f"model.layers.{layer}."
        mixer_proj = self.mixer_proj
        nh = cfg.num_attention_heads
        ql, kvl, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        nope, dv, qk = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
        seg = mla_in_segments(cfg)
        hr0, hr1 = self.part(nh, "num_attention_heads")  # this rank's heads
        w_in = self.weight(packed_name(layer, "mla_in"), (seg["g"][1], H))
        rank_seg = dict(seg, g=(seg["g"][0] + hr0 * dv, seg["g"][0] + hr1 * dv) if seg["g"][1] > seg["g"][0]
                        else seg["g"])
        for name, (s0, s1) in rank_seg.items():  # one group per segment: q_a, kv_a and the gate finish separately
            if s1 > s0:
                self.norm_proj(layer, NormRole.MLA_IN, x_in, pre + "input_layernorm.weight", w_in, (s0, s1),
                               mixer_proj, s0, t.mla_in_rows, f"L{layer}.mla_in.{name}", "mla")
        lat = self.buf(state_name(layer, "latent"), Kind.STATE, (B, T, kvl), self.act)
        kr = self.buf(state_name(layer, "k_r"), Kind.STATE, (B, T, rope), self.act)
        kvn = self.weight(pre + "self_attn.kv_a_layernorm.weight", (kvl,))
        self.add(Op.MLA_KV_APPEND, layer, (), [
            self.op(mixer_proj, R, (0, B, 0, 1, *seg["kv_a"])), self.op(kvn, P), self.op(self.pos, R),
            self.op(lat, W), self.op(kr, W)], f"L{layer}.mla_kv",
            {(layer, "mla"): [kvl * _BPW, B * (kvl + rope) * ab, B * (kvl + rope) * ab, 4.0 * B * kvl]})
        qn = self.weight(pre + "self_attn.q_a_layernorm.weight", (ql,))
        qb = self.weight(pre + "self_attn.q_b_proj.weight", (nh * qk, ql))
        wuk = self.weight(packed_name(layer, "mla_wuk"), (nh * nope, kvl))
        wuv = self.weight(packed_name(layer, "mla_wuv"), (nh * dv, kvl))
        mla_q = self.buf("mla_q", Kind.ACT, (B, nh, kvl + rope), self.act)
        nsplit = min(t.mla_splits, T)
        chunk = _ceil_div(T, nsplit)
        splits = _split(T, chunk)
        part = self.buf("mla_part", Kind.ACT, (B, nh, len(splits) * (kvl + 2)), acc)
        for h0, h1 in _span(hr0, hr1, t.mla_heads):
            n = h1 - h0
            self.add(Op.MLA_Q, layer, (h0, h1), [
                self.op(mixer_proj, R, (0, B, 0, 1, *seg["q_a"])), self.op(qn, P),
                self.op(qb, P, (0, 1, h0 * qk, h1 * qk, 0, ql)),
                self.op(wuk, P, (0, 1, h0 * nope, h1 * nope, 0, kvl)),
                self.op(mla_q, W, (0, B, h0, h1, 0, kvl + rope))],
                f"L{layer}.mla_q",
                {(layer, "mla"): [(n * qk * ql + n * nope * kvl + ql) * _BPW, 0,
                                  B * (ql + n * (kvl + rope)) * ab, 2.0 * B * n * (qk * ql + nope * kvl)]})
        for si, (t0, t1) in enumerate(splits):
            filled = max(0, min(ctx, t1) - t0)
            for (h0, h1), (b0, b1) in product(_span(hr0, hr1, t.mla_partial_heads), _split(B, t.mla_batch_rows)):
                n, nb = h1 - h0, b1 - b0
                self.add(Op.MLA_PARTIAL, layer, (h0, h1, si, b0), [
                    self.op(mla_q, R, (b0, b1, h0, h1, 0, kvl + rope)), self.op(self.pos, R, (b0, b1, 0, 1, 0, 1)),
                    self.op(lat, R, (b0, b1, t0, t1, 0, kvl)), self.op(kr, R, (b0, b1, t0, t1, 0, rope)),
                    self.op(part, W, (b0, b1, h0, h1, si * (kvl + 2), (si + 1) * (kvl + 2)))],
                    f"L{layer}.mla_part",
                    {(layer, "mla"): [0, nb * filled * (kvl + rope) * ab,
                                      nb * n * (kvl + rope) * ab + nb * n * (kvl + 2) * 4,
                                      2.0 * nb * n * filled * (kvl + rope + kvl)]})
        gseg = seg["g"]
        for h0, h1 in _span(hr0, hr1, t.mla_heads):
            n = h1 - h0
            ops = [self.op(part, R, (0, B, h0, h1, 0, len(splits) * (kvl + 2))),
                   self.op(wuv, P, (0, 1, h0 * dv, h1 * dv, 0, kvl))]
            if cfg.mla_use_output_gate:
                ops.append(self.op(mixer_proj, R, (0, B, 0, 1, gseg[0] + h0 * dv, gseg[0] + h1 * dv)))
            ops.append(self.op(self.attn_o, W, (0, B, 0, 1, h0 * dv, h1 * dv)))
            self.add(Op.MLA_REDUCE, layer, (h0, h1, int(cfg.mla_use_output_gate)), ops, f"L{layer}.mla_reduce",
                     {(layer, "mla"): [n * dv * kvl * _BPW, 0,
                                       B * n * (len(splits) * (kvl + 2) * 4 + 2 * dv * ab),
                                       2.0 * B * n * dv * kvl]})
        return nh * dv, (hr0 * dv, hr1 * dv), "mla"

    def dense_ffn(self, layer: int, blk: int, mlp_h: int) -> None:
        """Dense MLP: gate/up tiles into ``mlp_h``, then down-projection column tiles added to the stream."""
        cfg, B, H = self.cfg, self.B, self.H
        pre = f"model.layers.{layer}."
        x_ffn = self.op(self.mix, R)
        rows_t = max(1, self.t.ffn_in_rows)
        Id = cfg.intermediate_size
        g = self.weight(pre + "mlp.gate_proj.weight", (Id, H))
        u = self.weight(pre + "mlp.up_proj.weight", (Id, H))
        d = self.weight(pre + "mlp.down_proj.weight", (H, Id))
        ir = self.part(Id, "intermediate_size")  # this rank's hidden channels: its down-projection is a partial
        self.gate_up(layer, NormRole.DENSE, x_ffn, pre + "post_attention_layernorm.weight", g, u, ir,
                     max(1, rows_t // 2), mlp_h, f"L{layer}.mlp_up", "dense_mlp")
        self.out_cols(layer, Op.FFN_OUT, FFN_MLP, blk + 1,
                      [([self.op(mlp_h, R, (0, B, 0, 1, *ir))], d, ir, "dense_mlp")], f"L{layer}.ffn_out",
                      accumulate=True)

    def moe_ffn(self, layer: int, blk: int, mlp_h: int) -> None:
        """Latent MoE: router logits, latent down-projection and shared-expert gate/up (all from the same normed
        input), routing, routed experts over the selected slots in the latent space, and one FFN_OUT that sums
        the latent up-projection and the shared experts' down-projection into the stream. Across ranks every rank
        routes every token (the router and latent down-projection are replicated, so the experts need no
        dispatch), runs its own experts into an fp32 latent partial pushed to every rank, and MOE_COMBINE sums the
        partials in rank order and applies the latent norm once per batch tile; its share of the latent
        up-projection's inputs and of the shared experts' channels makes FFN_OUT's output a partial for the next
        all-reduce."""
        cfg, B, H, ab, acc, t = self.cfg, self.B, self.H, self.ab, self.acc, self.t
        pre = f"model.layers.{layer}."
        post = pre + "post_attention_layernorm.weight"
        x_ffn = self.op(self.mix, R)
        rows_t = max(1, t.ffn_in_rows)
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        Dl, Ie = cfg.moe_latent_size, cfg.moe_intermediate_size
        Is = Ie * cfg.n_shared_experts
        e0, e1 = self.part(E, "n_routed_experts")  # this rank's experts
        Dmax = min(e1 - e0, B * k)
        mp = pre + "block_sparse_moe."
        logits_r = self.buf("router_logits", Kind.ACT, (B, 1, E), acc)
        xl = self.buf("moe_xl", Kind.ACT, (B, 1, Dl), self.act)
        gw = self.weight(mp + "gate.weight", (E, H))
        self.norm_proj(layer, NormRole.ROUTER, x_ffn, post, gw, (0, E), logits_r, 0, rows_t,
                       f"L{layer}.router_logits", "router", fp32=True)
        dw = self.weight(mp + "routed_expert_down_proj.weight", (Dl, H))
        self.norm_proj(layer, NormRole.LATENT_DOWN, x_ffn, post, dw, (0, Dl), xl, 0, rows_t, f"L{layer}.latent_down",
                       "moe_latent")
        if Is:
            sg = self.weight(mp + "shared_experts.gate_proj.weight", (Is, H))
            su = self.weight(mp + "shared_experts.up_proj.weight", (Is, H))
            self.gate_up(layer, NormRole.SHARED, x_ffn, post, sg, su, self.part(Is, "shared expert channels"),
                         max(1, rows_t // 2), mlp_h, f"L{layer}.shared_up", "shared_experts")
        bias = self.weight(mp + "gate.e_score_correction_bias", (E,))
        sel = self.buf("moe_sel", Kind.ACT, (1, 1, Dmax), torch.int64)
        mw = self.buf("moe_w", Kind.ACT, (B, 1, Dmax), acc)
        use = self.buf("moe_use", Kind.ACT, (B, 1, Dmax), torch.bool)
        self.add(Op.ROUTER, layer, (e0, e1) if self.world > 1 else (),
                 [self.op(logits_r, R), self.op(bias, P), self.op(sel, W), self.op(mw, W), self.op(use, W)],
                 f"L{layer}.router", {(layer, "router"): [E * 4.0, 0, B * E * 4 + B * Dmax * 5 + Dmax * 8,
                                                          B * E * 8.0]})
        mh = self.buf("moe_h", Kind.ACT, (B, Dmax, Ie), self.act)
        # the expert weights: dense stacks, or MXFP4 codes with their scales appended after the dense operand list
        # (operand roles: kimik3.kernels.contracts.isa.MXFP4_OPERANDS)
        w1, w3, w2 = (self.expert_weight(layer, w, E, rows, cols)
                      for w, rows, cols in (("w1", Ie, Dl), ("w3", Ie, Dl), ("w2", Dl, Ie)))
        distinct = E * (1.0 - (1.0 - k / E) ** B) / self.world  # expected distinct experts (spec §8) of this rank
        active = distinct / Dmax  # chance that a slot holds an expert this step
        pairs_per_slot = B * k / Dmax  # expected (token, expert) pairs per slot
        for s0, s1 in _split(Dmax, t.expert_slots):
            for r0, r1 in _split(Ie, t.expert_rows):
                ns, n = s1 - s0, r1 - r0
                w1c, w1s = self.expert_rows(w1, r0, r1)
                w3c, w3s = self.expert_rows(w3, r0, r1)
                self.add(Op.EXPERT_GATE_UP, layer, (s0, s1, r0, r1), [
                    self.op(xl, R), self.op(sel, R, (0, 1, 0, 1, s0, s1)), self.op(use, R, (0, B, 0, 1, s0, s1)),
                    w1c, w3c, self.op(mh, W, (0, B, s0, s1, r0, r1)), *w1s, *w3s], f"L{layer}.expert_up",
                    {(layer, "experts"): [ns * active * 2 * n * Dl * _BPW, 0,
                                          ns * pairs_per_slot * (Dl + n) * ab,
                                          ns * pairs_per_slot * 4.0 * n * Dl]})
        one = self.world == 1
        acc_b = self.buf("moe_acc", Kind.ACT, (B, 1, Dl), self.act)
        row = mailbox_row(0, self.shard.rank, self.world)  # (MOE_SLOTS = 1: the slot is rewritten a layer later)
        for r0, r1 in _split(Dl, t.expert_down_rows):
            n = r1 - r0
            w2c, w2s = self.expert_rows(w2, r0, r1)
            out = self.op(acc_b, W, (0, B, 0, 1, r0, r1)) if one else \
                self.op(self.moe_mbox, W | Mode.PUSH, (0, B, row, row + 1, r0, r1))
            self.add(Op.EXPERT_DOWN, layer, (0, 0, r0, r1), [
                self.op(mh, R), self.op(sel, R), self.op(use, R), self.op(mw, R), w2c, out, *w2s],
                f"L{layer}.expert_down",
                {(layer, "experts"): [distinct * n * Ie * _BPW, 0, B * k * (Ie * ab) + B * n * ab,
                                      2.0 * B * k * n * Ie]})
        up = self.weight(mp + "routed_expert_up_proj.weight", (H, Dl))
        flags = FFN_ROUTED
        norm = self.weight(mp + "routed_expert_norm.weight", (Dl,)) if cfg.moe_latent_norm else None
        lr = self.part(Dl, "moe_latent_size")  # this rank's latent channels: the up-projection's input columns
        if one:
            routed = [self.op(acc_b, R)]
            if norm is not None:
                routed.append(self.op(norm, P))
                flags |= FFN_LATENT_NORM
        else:  # every rank's partial summed once per batch tile (rank order, fp32), cast, normed: the latent
            for b0, b1 in self.batch_tiles:
                nb = b1 - b0
                ops = [self.op(self.moe_mbox, R, (b0, b1, 0, self.world, 0, Dl))]
                ops += [self.op(norm, P)] if norm is not None else []
                self.add(Op.MOE_COMBINE, layer, (int(norm is not None),), ops + [
                    self.op(acc_b, W, (b0, b1, 0, 1, 0, Dl))], f"L{layer}.moe_combine",
                    {(layer, "moe_latent"): [0, 0, nb * Dl * (self.world * 4 + 2 * ab), nb * Dl * (self.world + 4.0)]})
            routed = [self.op(acc_b, R, (0, B, 0, 1, *lr))]
        sources = [(routed, up, lr, "moe_latent")]
        if Is:
            sd = self.weight(mp + "shared_experts.down_proj.weight", (H, Is))
            sr = self.part(Is, "shared expert channels")
            sources.append(([self.op(mlp_h, R, (0, B, 0, 1, *sr))], sd, sr, "shared_experts"))
            flags |= FFN_MLP
        self.out_cols(layer, Op.FFN_OUT, flags, blk + 1, sources, f"L{layer}.ffn_out", accumulate=True)

    def head(self) -> None:
        """Model output: the output mix over every block, final norm + LM_HEAD vocabulary tiles (each keeping its
        best logit), and ARGMAX over the tiles' bests."""
        cfg, B, H, L, V, acc = self.cfg, self.B, self.H, self.cfg.num_hidden_layers, self.cfg.vocab_size, self.acc
        nblocks = cfg.attn_res_slots
        self.attn_res(L, Site.OUTPUT, nblocks + 1, "model.output_attn_res_norm.weight",
                      "model.output_attn_res_proj.weight", "out.mix", start=False)
        lm = self.weight("lm_head.weight", (V, H))
        fn = self.weight("model.norm.weight", (H,))
        v0, v1 = self.part(V, "vocab_size")  # this rank's vocabulary rows (its logits columns)
        tiles = _span(v0, v1, self.t.lm_rows)
        logits = self.buf("logits", Kind.OUTPUT, (B, 1, V), acc)
        one = self.world == 1
        if one:  # the tiles' bests, or on a rank of several pushed to every rank: [batch, source rank, tile]
            bv = self.buf("lm_best_val", Kind.ACT, (B, 1, len(tiles)), acc)
            bi = self.buf("lm_best_idx", Kind.ACT, (B, 1, len(tiles)), torch.int64)
        else:
            bv = self.buf("mbox.lm_best_val", Kind.MAILBOX, (B, self.world, len(tiles)), acc)
            bi = self.buf("mbox.lm_best_idx", Kind.MAILBOX, (B, self.world, len(tiles)), torch.int64)
        nxt = self.buf("next_token", Kind.OUTPUT, (B, 1, 1), torch.int64)
        me = self.shard.rank
        for ti, (r0, r1) in enumerate(tiles):
            n = r1 - r0
            best = [self.op(bv, W, (0, B, 0, 1, ti, ti + 1)), self.op(bi, W, (0, B, 0, 1, ti, ti + 1))] if one else \
                [self.op(b, W | Mode.PUSH, (0, B, me, me + 1, ti, ti + 1)) for b in (bv, bi)]
            self.add(Op.LM_HEAD, L, (ti, 0, r0, r1), [
                self.op(self.mix, R), self.op(fn, P), self.op(lm, P, (0, 1, r0, r1, 0, H)),
                self.op(logits, W, (0, B, 0, 1, r0, r1)), *best], "out.lm_head",
                {(L, "lm_head"): [n * H * _BPW, 0, B * (H * self.ab + n * 4), 2.0 * B * n * H],
                 (L, "final_norm"): [H * _BPW, 0, 0, 4.0 * B * H]})
        nt = len(tiles) * self.world
        if one:
            self.add(Op.ARGMAX, L, (), [self.op(bv, R), self.op(bi, R), self.op(nxt, W)], "out.argmax",
                     {(L, "lm_head"): [0, 0, B * nt * 12.0, B * nt * 1.0]})
        else:
            self.add(Op.ARGMAX_ALL, L, (), [self.op(bv, R), self.op(bi, R), self.op(nxt, W)], "out.argmax",
                     {(L, "lm_head"): [0, 0, B * nt * 12.0, B * nt * 1.0]})


def build_step(cfg: ModelConfig | str, batch: int, max_seq_len: int = 4096, tiling: Tiling | None = None,
               num_sms: int = 132, act_dtype: torch.dtype = torch.bfloat16, context_len: int | None = None,
               expert_format: str = "dense", shard: Shard = SINGLE) -> StepSpec:
    """All instructions of one decode step, in sequential (reference) order. ``expert_format``: how the routed
    experts are stored (``"dense"`` or ``"mxfp4"``, :mod:`kimik3.megakernel.layout`); ``shard``: the rank of a
    deployment to build for (:mod:`kimik3.megakernel.ranks`; default one GPU)."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    check_supported(cfg)
    check_expert_format(cfg, expert_format)
    if not isinstance(shard, Shard):
        raise ValueError(f"shard must be a kimik3.megakernel.ranks.Shard, got {type(shard).__name__}")
    shard.check(cfg)
    if not 1 <= batch:
        raise ValueError(f"batch must be >= 1, got {batch}")
    t = tiling or Tiling.auto(shard.slice_of(cfg), batch, num_sms, max_seq_len)
    b = _StepBuilder(cfg, batch, max_seq_len, t, act_dtype, max_seq_len if context_len is None else context_len,
                     expert_format, shard)
    b.embedding()
    for layer in range(cfg.num_hidden_layers):
        b.layer(layer)
    b.head()
    return b.spec()
