"""Build the megakernel program for a model config: instructions, dependencies, costs, per-SM queues, waits.

The pipeline, each step its own function so a notebook can show it:

1. :func:`build_step` lists the instructions of one decode step in *sequential* order (running them one after
   the other is the reference computation) with their operand declarations and a *group* name — the counter
   the instruction will signal ("L3.kda": every KDA_STEP tile of layer 3).
2. :func:`hazard_predecessors` derives, from the declarations alone, what must precede what: the nearest earlier
   writer of everything an instruction reads (RAW), and the earlier readers and writer of everything it overwrites
   (WAR, WAW). These edges imply every other conflict by transitivity.
3. :func:`instruction_costs` estimates bytes and FLOPs per instruction: the per-block totals come from
   :func:`kimik3.cost.decode_cost` (which reads the model's own parameter shapes), split between a block's
   instructions in proportion to their tile shapes.
4. A policy assigns instructions to per-SM queues: ``"round_robin"`` (sequential order, instruction ``i`` on SM
   ``i mod S``, blind to cost) or ``"critical_path"`` (list scheduling: whenever an SM is free it takes the ready
   instruction with the longest cost-weighted path to the end of the step, or — if nothing is ready — commits to
   the one that will be ready first and streams its weights meanwhile).
5. :func:`compute_waits` turns the dependency edges into counter waits and keeps a wait only if nothing else
   — program order on the SM, or the transitive effect of its other waits — already implies it (a transitive
   reduction), so the GPU spins as little as possible.

Waits are on whole groups: a consumer waits until a group's counter reaches the number of its members (in step
``s`` of a run, ``s·total + total``). Within a step every edge points forward in dispatch order, so no schedule
built here can deadlock (the hazard checker verifies it independently anyway).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import reduce
from itertools import product

import numpy as np
import pandas as pd
import torch

from kimik3.config import ModelConfig, get_preset
from kimik3.megakernel.instructions import (
    BufferSpec,
    Counter,
    Instruction,
    Kind,
    Mode,
    NormRole,
    Op,
    Operand,
    Program,
    Site,
)
from kimik3.megakernel.layout import (
    check_supported,
    kda_head_width,
    kda_in_rows,
    mla_in_segments,
    packed_name,
    state_name,
)
from kimik3.model import keeps_fp32

__all__ = [
    "POLICIES",
    "Tiling",
    "CostModel",
    "StepSpec",
    "build_step",
    "hazard_predecessors",
    "instruction_costs",
    "assign_round_robin",
    "assign_critical_path",
    "compute_waits",
    "build_program",
]

POLICIES = ("round_robin", "critical_path")

R, W, RW = Mode.READ, Mode.WRITE, Mode.READ_WRITE
P = Mode.READ | Mode.PREFETCH  # a static weight read, allowed before the waits


# FFN_OUT arg 0 flags: which sources the column tile sums
FFN_ROUTED, FFN_MLP, FFN_LATENT_NORM = 1, 2, 4


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
    mla_partial_heads: int  # MLA_PARTIAL heads per tile (default all: the shared latent cache is read once/split)
    mla_splits: int  # MLA_PARTIAL context splits over max_seq_len
    mla_batch_rows: int  # MLA_PARTIAL batch rows per tile (every sequence attends to its own cache)
    out_cols: int  # O_PROJ_RESIDUAL / FFN_OUT hidden columns per tile
    expert_slots: int  # EXPERT_GATE_UP expert slots per tile
    expert_rows: int  # EXPERT_GATE_UP expert hidden channels per tile
    expert_down_rows: int  # EXPERT_DOWN latent rows per tile
    lm_rows: int  # LM_HEAD vocabulary rows per tile

    @classmethod
    def auto(cls, cfg: ModelConfig, batch: int, num_sms: int, max_seq_len: int = 4096, align: int = 16) -> Tiling:
        S = max(1, num_sms)
        H = cfg.hidden_size
        nh_kda, nh_mla = max(1, cfg.kda_num_heads), max(1, cfg.num_attention_heads)
        ffn_rows = 0
        if cfg.moe_layers:
            ffn_rows = cfg.n_routed_experts + (cfg.moe_latent_size or 0) + \
                2 * cfg.moe_intermediate_size * cfg.n_shared_experts
        if any(cfg.ffn(i) == "dense" for i in range(cfg.num_hidden_layers)):
            ffn_rows = max(ffn_rows, 2 * cfg.intermediate_size)
        slots = min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok) if cfg.n_routed_experts else 1
        per_slot = max(1, S // slots)
        mla_in = sum(b - a for a, b in mla_in_segments(cfg).values()) if cfg.mla_layers else 1
        kda_heads = _ceil_div(nh_kda, min(nh_kda, S))
        kda_tiles = _ceil_div(nh_kda, kda_heads)
        kda_batch = _ceil_div(batch, min(batch, S // kda_tiles)) if 2 * kda_tiles <= S else batch
        # MLA_PARTIAL: about one tile per SM over (sequence, split); at least two splits, >= 256 tokens each
        splits = max(1, min(max_seq_len, max(2, min(_ceil_div(S, batch), _ceil_div(max_seq_len, 256)))))
        mla_batch = _ceil_div(batch, min(batch, max(1, S // splits)))
        return cls(
            batch_rows=_ceil_div(batch, min(batch, S)),
            kda_in_rows=_aligned(kda_in_rows(cfg), S, align) if cfg.kda_layers else 1,
            mla_in_rows=_aligned(mla_in, S, align),
            ffn_in_rows=max(2, _aligned(ffn_rows, S, align)),
            kda_heads=kda_heads,
            kda_batch_rows=kda_batch,
            mla_heads=_ceil_div(nh_mla, min(nh_mla, S)),
            mla_partial_heads=nh_mla,
            mla_splits=splits,
            mla_batch_rows=mla_batch,
            out_cols=_aligned(H, S, align),
            expert_slots=1,
            expert_rows=_aligned(cfg.moe_intermediate_size, per_slot, align) if cfg.moe_layers else 1,
            expert_down_rows=_aligned(cfg.moe_latent_size or 1, S, align),
            lm_rows=_aligned(cfg.vocab_size, S, align),
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

    def group_members(self) -> dict[str, list[int]]:
        m: dict[str, list[int]] = defaultdict(list)
        for i, g in enumerate(self.groups):
            m[g].append(i)
        return dict(m)


class _Builder:
    def __init__(self, cfg: ModelConfig, batch: int, max_seq_len: int, tiling: Tiling, act_dtype: torch.dtype):
        self.cfg, self.B, self.T, self.t = cfg, batch, max_seq_len, tiling
        self.act = act_dtype
        self.acc = torch.float64 if act_dtype == torch.float64 else torch.float32
        self.ab = torch.empty((), dtype=act_dtype).element_size()
        self.buffers: list[BufferSpec] = []
        self.ids: dict[str, int] = {}
        self.instructions: list[Instruction] = []
        self.groups: list[str] = []
        self.costs: list[dict] = []

    # -- buffers
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

    def shape(self, buf: int) -> tuple[int, int, int]:
        return self.buffers[buf].shape

    def full(self, buf: int) -> tuple[int, ...]:
        d = self.shape(buf)
        return (0, d[0], 0, d[1], 0, d[2])

    def op(self, buf: int, mode: Mode, box: tuple[int, ...] | None = None) -> Operand:
        box = self.full(buf) if box is None else tuple(box)
        return Operand(buf, mode, box)

    def add(self, op: Op, layer: int, args: Sequence[int], operands: list[Operand], group: str,
            cost: dict[tuple[int, str], list[float]]) -> None:
        a = tuple(args) + (0,) * (4 - len(args))
        self.instructions.append(Instruction(op, layer, a, tuple(operands)))
        self.groups.append(group)
        self.costs.append(cost)


def build_step(cfg: ModelConfig | str, batch: int, max_seq_len: int = 4096, tiling: Tiling | None = None,
               num_sms: int = 132, act_dtype: torch.dtype = torch.bfloat16, context_len: int | None = None
               ) -> StepSpec:
    """All instructions of one decode step, in sequential (reference) order."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    check_supported(cfg)
    if not 1 <= batch:
        raise ValueError(f"batch must be >= 1, got {batch}")
    t = tiling or Tiling.auto(cfg, batch, num_sms, max_seq_len)
    b = _Builder(cfg, batch, max_seq_len, t, act_dtype)
    ctx = max_seq_len if context_len is None else context_len
    B, H, L, V = batch, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    bs = cfg.attn_res_block_size
    nblocks = cfg.attn_res_slots
    ab, acc = b.ab, b.acc
    bpw = 2.0  # nominal bytes per weight for the shape-based split (decode_cost calibrates the totals)

    ids = b.buf("ids", Kind.INPUT, (B, 1, 1), torch.int64)
    pos = b.buf("pos", Kind.INPUT, (B, 1, 1), torch.int64)
    stream = b.buf("stream", Kind.ACT, (B, nblocks + 1, H), act_dtype)
    mix = b.buf("mix", Kind.ACT, (B, 1, H), act_dtype)
    widths = [kda_in_rows(cfg)] if cfg.kda_layers else []
    if cfg.mla_layers:
        widths.append(mla_in_segments(cfg)["g"][1])
    mixer_proj = b.buf("mixer_proj", Kind.ACT, (B, 1, max(widths)), act_dtype)
    attn_o = b.buf("attn_o", Kind.ACT, (B, 1, max(cfg.kda_proj_dim, cfg.num_attention_heads * cfg.v_head_dim)),
                   act_dtype)
    batch_tiles = _split(B, t.batch_rows)

    # ------------------------------------------------------------------ embedding
    emb = b.weight("model.embed_tokens.weight", (V, H))
    for b0, b1 in batch_tiles:
        n = b1 - b0
        b.add(Op.EMBED, 0, (0, 0, b0, b1),
              [b.op(ids, R, (b0, b1, 0, 1, 0, 1)), b.op(emb, P), b.op(stream, W, (b0, b1, 0, 1, 0, H))],
              "embed", {(-1, "embed"): [n * H * bpw, 0, n * H * ab + n * 8, 0]})

    def attn_res(layer: int, site: Site, K: int, norm: str, proj: str, group: str) -> None:
        nw, pw = b.weight(norm, (H,)), b.weight(proj, (1, H))
        for b0, b1 in batch_tiles:
            n = b1 - b0
            b.add(Op.ATTN_RES_MIX, layer, (int(site), K, b0, b1),
                  [b.op(stream, R, (b0, b1, 0, K, 0, H)), b.op(nw, P), b.op(pw, P), b.op(mix, W, (b0, b1, 0, 1, 0, H))],
                  group, {(layer, "attn_res"): [2 * H * bpw, 0, (K + 1) * n * H * ab, 6.0 * n * K * H]})

    def norm_proj(layer: int, role: NormRole, x: Operand, norm: str, weight: int, rows: tuple[int, int], out: int,
                  out_col0: int, tile_rows: int, group: str, block: str, fp32: bool = False) -> None:
        """NORM_PROJ tiles over weight rows ``rows``; weight row r lands in output column out_col0 + r - rows[0]."""
        nw = b.weight(norm, (H,))
        Hin = b.shape(weight)[2]
        for r0, r1 in _split(rows[1] - rows[0], tile_rows):
            n, w0, o0 = r1 - r0, rows[0] + r0, out_col0 + r0
            b.add(Op.NORM_PROJ, layer, (int(fp32), int(role), w0, w0 + n),
                  [x, b.op(nw, P), b.op(weight, P, (0, 1, w0, w0 + n, 0, Hin)),
                   b.op(out, W, (0, B, 0, 1, o0, o0 + n))],
                  group, {(layer, block): [(n * Hin + Hin) * bpw, 0, B * (Hin + n) * ab, 2.0 * B * n * Hin]})

    def gate_up(layer: int, role: NormRole, x: Operand, norm: str, gate: int, up: int, width: int, tile: int,
                out: int, group: str, block: str) -> None:
        nw = b.weight(norm, (H,))
        for r0, r1 in _split(width, tile):
            n = r1 - r0
            b.add(Op.MLP_GATE_UP, layer, (0, int(role), r0, r1),
                  [x, b.op(nw, P), b.op(gate, P, (0, 1, r0, r1, 0, H)), b.op(up, P, (0, 1, r0, r1, 0, H)),
                   b.op(out, W, (0, B, 0, 1, r0, r1))],
                  group, {(layer, block): [(2 * n * H + H) * bpw, 0, B * (H + n) * ab, 4.0 * B * n * H]})

    def out_cols(layer: int, op: Op, flags: int, entry: int, sources: list[tuple[list[Operand], int, str]],
                 group: str, accumulate: bool) -> None:
        """Column tiles of stream[:, entry] (O_PROJ_RESIDUAL, FFN_OUT). Each source is (its activation operands,
        the weight whose rows = these columns, cost block); operands are laid out source by source, weight rows
        after the source's activations, and the stream tile last."""
        for c0, c1 in _split(H, t.out_cols):
            n = c1 - c0
            ops: list[Operand] = []
            cost: dict[tuple[int, str], list[float]] = {}
            for acts, wb, block in sources:
                Hin = b.shape(wb)[2]
                ops += acts + [b.op(wb, P, (0, 1, c0, c1, 0, Hin))]
                c = cost.setdefault((layer, block), [0.0, 0.0, 0.0, 0.0])
                c[0] += n * Hin * bpw
                c[2] += B * Hin * ab
                c[3] += 2.0 * B * n * Hin
            ops.append(b.op(stream, RW if accumulate else W, (0, B, entry, entry + 1, c0, c1)))
            cost[(layer, sources[0][2])][2] += B * n * ab * (2 if accumulate else 1)
            b.add(op, layer, (flags, entry, c0, c1), ops, group, cost)

    # ------------------------------------------------------------------ layers
    for layer in range(L):
        pre = f"model.layers.{layer}."
        blk = layer // bs
        boundary = layer % bs == 0
        kind = cfg.mixer(layer)
        if layer == 0:
            x_in = b.op(stream, R, (0, B, 0, 1, 0, H))  # the attention site of layer 0 does not mix
        else:
            K = blk + 1 if boundary else blk + 2
            attn_res(layer, Site.ATTN, K, pre + "self_attention_res_norm.weight",
                     pre + "self_attention_res_proj.weight", f"L{layer}.attn_mix")
            x_in = b.op(mix, R)
        in_norm = pre + "input_layernorm.weight"
        if kind == "kda":
            nh, dk, Wc = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
            Pd = cfg.kda_proj_dim
            hw = kda_head_width(cfg)
            w_in = b.weight(packed_name(layer, "kda_in"), (kda_in_rows(cfg), H))
            norm_proj(layer, NormRole.KDA_IN, x_in, in_norm, w_in, (0, kda_in_rows(cfg)), mixer_proj, 0,
                      t.kda_in_rows, f"L{layer}.kda_in", "kda")
            conv = b.buf(state_name(layer, "conv"), Kind.STATE, (B, 3, Pd * (Wc - 1)), act_dtype)
            S = b.buf(state_name(layer, "S"), Kind.STATE, (B, nh, dk * dk), acc)
            fb = b.weight(pre + "self_attn.f_b_proj.weight", (Pd, dk))
            dt = b.weight(pre + "self_attn.dt_bias", (Pd,))
            alog = b.weight(pre + "self_attn.A_log", (nh,))
            cw = b.weight(packed_name(layer, "kda_conv"), (3, Pd * Wc))
            onorm = b.weight(pre + "self_attn.o_norm.weight", (dk,))
            for (h0, h1), (b0, b1) in product(_split(nh, t.kda_heads), _split(B, t.kda_batch_rows)):
                n, nb = h1 - h0, b1 - b0
                ops = [b.op(mixer_proj, R, (b0, b1, 0, 1, h0 * hw, h1 * hw)),
                       b.op(mixer_proj, R, (b0, b1, 0, 1, nh * hw, nh * hw + dk)),
                       b.op(conv, RW, (b0, b1, 0, 3, h0 * dk * (Wc - 1), h1 * dk * (Wc - 1))),
                       b.op(S, RW, (b0, b1, h0, h1, 0, dk * dk)),
                       b.op(fb, P, (0, 1, h0 * dk, h1 * dk, 0, dk)),
                       b.op(dt, P, (0, 1, 0, 1, h0 * dk, h1 * dk)),
                       b.op(alog, P, (0, 1, 0, 1, h0, h1)),
                       b.op(cw, P, (0, 1, 0, 3, h0 * dk * Wc, h1 * dk * Wc)),
                       b.op(onorm, P),
                       b.op(attn_o, W, (b0, b1, 0, 1, h0 * dk, h1 * dk))]
                state_bytes = 2.0 * nb * n * (dk * dk * torch.empty((), dtype=acc).element_size()
                                              + 3 * dk * (Wc - 1) * ab)
                wts = (n * dk * dk + 2 * n * dk + n + 3 * n * dk * Wc + dk) * bpw
                b.add(Op.KDA_STEP, layer, (h0, h1, b0, b1), ops, f"L{layer}.kda",
                      {(layer, "kda"): [wts, state_bytes, nb * n * (hw + dk) * ab,
                                        nb * n * (2.0 * dk * dk + 7.0 * dk * dk + 30.0 * dk)]})
            o_rows, block = Pd, "kda"
        else:
            nh = cfg.num_attention_heads
            ql, kvl, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
            nope, dv, qk = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
            seg = mla_in_segments(cfg)
            w_in = b.weight(packed_name(layer, "mla_in"), (seg["g"][1], H))
            for name, (s0, s1) in seg.items():  # one group per segment: q_a, kv_a and the gate finish separately
                if s1 > s0:
                    norm_proj(layer, NormRole.MLA_IN, x_in, in_norm, w_in, (s0, s1), mixer_proj, s0, t.mla_in_rows,
                              f"L{layer}.mla_in.{name}", "mla")
            lat = b.buf(state_name(layer, "latent"), Kind.STATE, (B, max_seq_len, kvl), act_dtype)
            kr = b.buf(state_name(layer, "k_r"), Kind.STATE, (B, max_seq_len, rope), act_dtype)
            kvn = b.weight(pre + "self_attn.kv_a_layernorm.weight", (kvl,))
            b.add(Op.MLA_KV_APPEND, layer, (), [
                b.op(mixer_proj, R, (0, B, 0, 1, *seg["kv_a"])), b.op(kvn, P), b.op(pos, R),
                b.op(lat, W), b.op(kr, W)], f"L{layer}.mla_kv",
                {(layer, "mla"): [kvl * bpw, B * (kvl + rope) * ab, B * (kvl + rope) * ab, 4.0 * B * kvl]})
            qn = b.weight(pre + "self_attn.q_a_layernorm.weight", (ql,))
            qb = b.weight(pre + "self_attn.q_b_proj.weight", (nh * qk, ql))
            wuk = b.weight(packed_name(layer, "mla_wuk"), (nh * nope, kvl))
            wuv = b.weight(packed_name(layer, "mla_wuv"), (nh * dv, kvl))
            mla_q = b.buf("mla_q", Kind.ACT, (B, nh, kvl + rope), act_dtype)
            nsplit = min(t.mla_splits, max_seq_len)
            chunk = _ceil_div(max_seq_len, nsplit)
            splits = _split(max_seq_len, chunk)
            part = b.buf("mla_part", Kind.ACT, (B, nh, len(splits) * (kvl + 2)), acc)
            for h0, h1 in _split(nh, t.mla_heads):
                n = h1 - h0
                b.add(Op.MLA_Q, layer, (h0, h1), [
                    b.op(mixer_proj, R, (0, B, 0, 1, *seg["q_a"])), b.op(qn, P),
                    b.op(qb, P, (0, 1, h0 * qk, h1 * qk, 0, ql)),
                    b.op(wuk, P, (0, 1, h0 * nope, h1 * nope, 0, kvl)), b.op(mla_q, W, (0, B, h0, h1, 0, kvl + rope))],
                    f"L{layer}.mla_q",
                    {(layer, "mla"): [(n * qk * ql + n * nope * kvl + ql) * bpw, 0,
                                      B * (ql + n * (kvl + rope)) * ab, 2.0 * B * n * (qk * ql + nope * kvl)]})
            for si, (t0, t1) in enumerate(splits):
                filled = max(0, min(ctx, t1) - t0)
                for (h0, h1), (b0, b1) in product(_split(nh, t.mla_partial_heads), _split(B, t.mla_batch_rows)):
                    n, nb = h1 - h0, b1 - b0
                    b.add(Op.MLA_PARTIAL, layer, (h0, h1, si, b0), [
                        b.op(mla_q, R, (b0, b1, h0, h1, 0, kvl + rope)), b.op(pos, R, (b0, b1, 0, 1, 0, 1)),
                        b.op(lat, R, (b0, b1, t0, t1, 0, kvl)), b.op(kr, R, (b0, b1, t0, t1, 0, rope)),
                        b.op(part, W, (b0, b1, h0, h1, si * (kvl + 2), (si + 1) * (kvl + 2)))],
                        f"L{layer}.mla_part",
                        {(layer, "mla"): [0, nb * filled * (kvl + rope) * ab,
                                          nb * n * (kvl + rope) * ab + nb * n * (kvl + 2) * 4,
                                          2.0 * nb * n * filled * (kvl + rope + kvl)]})
            gseg = seg["g"]
            for h0, h1 in _split(nh, t.mla_heads):
                n = h1 - h0
                ops = [b.op(part, R, (0, B, h0, h1, 0, len(splits) * (kvl + 2))),
                       b.op(wuv, P, (0, 1, h0 * dv, h1 * dv, 0, kvl))]
                if cfg.mla_use_output_gate:
                    ops.append(b.op(mixer_proj, R, (0, B, 0, 1, gseg[0] + h0 * dv, gseg[0] + h1 * dv)))
                ops.append(b.op(attn_o, W, (0, B, 0, 1, h0 * dv, h1 * dv)))
                b.add(Op.MLA_REDUCE, layer, (h0, h1, int(cfg.mla_use_output_gate)), ops, f"L{layer}.mla_reduce",
                      {(layer, "mla"): [n * dv * kvl * bpw, 0,
                                        B * n * (len(splits) * (kvl + 2) * 4 + 2 * dv * ab),
                                        2.0 * B * n * dv * kvl]})
            o_rows, block = nh * dv, "mla"
        # o_proj + residual into the block's partial sum
        wo = b.weight(pre + "self_attn.o_proj.weight", (H, o_rows))
        out_cols(layer, Op.O_PROJ_RESIDUAL, int(not boundary), blk + 1,
                 [([b.op(attn_o, R, (0, B, 0, 1, 0, o_rows))], wo, block)], f"L{layer}.o_proj",
                 accumulate=not boundary)
        # MLP site
        attn_res(layer, Site.MLP, blk + 2, pre + "mlp_res_norm.weight", pre + "mlp_res_proj.weight",
                 f"L{layer}.mlp_mix")
        post = pre + "post_attention_layernorm.weight"
        mlp_w = max(cfg.moe_intermediate_size * cfg.n_shared_experts,
                    cfg.intermediate_size if any(cfg.ffn(i) == "dense" for i in range(L)) else 0)
        mlp_h = b.buf("mlp_h", Kind.ACT, (B, 1, mlp_w), act_dtype)
        x_ffn = b.op(mix, R)
        rows_t = max(1, t.ffn_in_rows)
        if cfg.ffn(layer) == "dense":
            Id = cfg.intermediate_size
            g = b.weight(pre + "mlp.gate_proj.weight", (Id, H))
            u = b.weight(pre + "mlp.up_proj.weight", (Id, H))
            d = b.weight(pre + "mlp.down_proj.weight", (H, Id))
            gate_up(layer, NormRole.DENSE, x_ffn, post, g, u, Id, max(1, rows_t // 2), mlp_h, f"L{layer}.mlp_up",
                    "dense_mlp")
            out_cols(layer, Op.FFN_OUT, FFN_MLP, blk + 1, [([b.op(mlp_h, R, (0, B, 0, 1, 0, Id))], d, "dense_mlp")],
                     f"L{layer}.ffn_out", accumulate=True)
            continue
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        Dl, Ie = cfg.moe_latent_size, cfg.moe_intermediate_size
        Is = Ie * cfg.n_shared_experts
        Dmax = min(E, B * k)
        mp = pre + "block_sparse_moe."
        logits_r = b.buf("router_logits", Kind.ACT, (B, 1, E), acc)
        xl = b.buf("moe_xl", Kind.ACT, (B, 1, Dl), act_dtype)
        gw = b.weight(mp + "gate.weight", (E, H))
        norm_proj(layer, NormRole.ROUTER, x_ffn, post, gw, (0, E), logits_r, 0, rows_t, f"L{layer}.router_logits",
                  "router", fp32=True)
        dw = b.weight(mp + "routed_expert_down_proj.weight", (Dl, H))
        norm_proj(layer, NormRole.LATENT_DOWN, x_ffn, post, dw, (0, Dl), xl, 0, rows_t, f"L{layer}.latent_down",
                  "moe_latent")
        if Is:
            sg = b.weight(mp + "shared_experts.gate_proj.weight", (Is, H))
            su = b.weight(mp + "shared_experts.up_proj.weight", (Is, H))
            gate_up(layer, NormRole.SHARED, x_ffn, post, sg, su, Is, max(1, rows_t // 2), mlp_h,
                    f"L{layer}.shared_up", "shared_experts")
        bias = b.weight(mp + "gate.e_score_correction_bias", (E,))
        sel = b.buf("moe_sel", Kind.ACT, (1, 1, Dmax), torch.int64)
        mw = b.buf("moe_w", Kind.ACT, (B, 1, Dmax), acc)
        use = b.buf("moe_use", Kind.ACT, (B, 1, Dmax), torch.bool)
        b.add(Op.ROUTER, layer, (), [b.op(logits_r, R), b.op(bias, P), b.op(sel, W), b.op(mw, W), b.op(use, W)],
              f"L{layer}.router", {(layer, "router"): [E * 4.0, 0, B * E * 4 + B * Dmax * 5 + Dmax * 8,
                                                       B * E * 8.0]})
        mh = b.buf("moe_h", Kind.ACT, (B, Dmax, Ie), act_dtype)
        w1 = b.weight(mp + "experts.w1", (E, Ie, Dl))
        w3 = b.weight(mp + "experts.w3", (E, Ie, Dl))
        w2 = b.weight(mp + "experts.w2", (E, Dl, Ie))
        distinct = E * (1.0 - (1.0 - k / E) ** B)  # expected distinct experts (spec §8), for the raw split
        active = distinct / Dmax  # chance that a slot holds an expert this step
        pairs_per_slot = B * k / Dmax  # expected (token, expert) pairs per slot
        for s0, s1 in _split(Dmax, t.expert_slots):
            for r0, r1 in _split(Ie, t.expert_rows):
                ns, n = s1 - s0, r1 - r0
                b.add(Op.EXPERT_GATE_UP, layer, (s0, s1, r0, r1), [
                    b.op(xl, R), b.op(sel, R, (0, 1, 0, 1, s0, s1)), b.op(use, R, (0, B, 0, 1, s0, s1)),
                    b.op(w1, P, (0, E, r0, r1, 0, Dl)), b.op(w3, P, (0, E, r0, r1, 0, Dl)),
                    b.op(mh, W, (0, B, s0, s1, r0, r1))], f"L{layer}.expert_up",
                    {(layer, "experts"): [ns * active * 2 * n * Dl * bpw, 0,
                                          ns * pairs_per_slot * (Dl + n) * ab,
                                          ns * pairs_per_slot * 4.0 * n * Dl]})
        acc_b = b.buf("moe_acc", Kind.ACT, (B, 1, Dl), act_dtype)
        for r0, r1 in _split(Dl, t.expert_down_rows):
            n = r1 - r0
            b.add(Op.EXPERT_DOWN, layer, (0, 0, r0, r1), [
                b.op(mh, R), b.op(sel, R), b.op(use, R), b.op(mw, R), b.op(w2, P, (0, E, r0, r1, 0, Ie)),
                b.op(acc_b, W, (0, B, 0, 1, r0, r1))], f"L{layer}.expert_down",
                {(layer, "experts"): [distinct * n * Ie * bpw, 0, B * k * (Ie * ab) + B * n * ab,
                                      2.0 * B * k * n * Ie]})
        up = b.weight(mp + "routed_expert_up_proj.weight", (H, Dl))
        routed = [b.op(acc_b, R)]
        flags = FFN_ROUTED
        if cfg.moe_latent_norm:
            routed.append(b.op(b.weight(mp + "routed_expert_norm.weight", (Dl,)), P))
            flags |= FFN_LATENT_NORM
        sources = [(routed, up, "moe_latent")]
        if Is:
            sd = b.weight(mp + "shared_experts.down_proj.weight", (H, Is))
            sources.append(([b.op(mlp_h, R, (0, B, 0, 1, 0, Is))], sd, "shared_experts"))
            flags |= FFN_MLP
        out_cols(layer, Op.FFN_OUT, flags, blk + 1, sources, f"L{layer}.ffn_out", accumulate=True)

    # ------------------------------------------------------------------ model output
    attn_res(L, Site.OUTPUT, nblocks + 1, "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight",
             "out.mix")
    lm = b.weight("lm_head.weight", (V, H))
    fn = b.weight("model.norm.weight", (H,))
    tiles = _split(V, t.lm_rows)
    logits = b.buf("logits", Kind.OUTPUT, (B, 1, V), acc)
    bv = b.buf("lm_best_val", Kind.ACT, (B, 1, len(tiles)), acc)
    bi = b.buf("lm_best_idx", Kind.ACT, (B, 1, len(tiles)), torch.int64)
    nxt = b.buf("next_token", Kind.OUTPUT, (B, 1, 1), torch.int64)
    for ti, (r0, r1) in enumerate(tiles):
        n = r1 - r0
        b.add(Op.LM_HEAD, L, (ti, 0, r0, r1), [
            b.op(mix, R), b.op(fn, P), b.op(lm, P, (0, 1, r0, r1, 0, H)), b.op(logits, W, (0, B, 0, 1, r0, r1)),
            b.op(bv, W, (0, B, 0, 1, ti, ti + 1)), b.op(bi, W, (0, B, 0, 1, ti, ti + 1))], "out.lm_head",
            {(L, "lm_head"): [n * H * bpw, 0, B * (H * ab + n * 4), 2.0 * B * n * H],
             (L, "final_norm"): [H * bpw, 0, 0, 4.0 * B * H]})
    b.add(Op.ARGMAX, L, (), [b.op(bv, R), b.op(bi, R), b.op(nxt, W)], "out.argmax",
          {(L, "lm_head"): [0, 0, B * len(tiles) * 12.0, B * len(tiles) * 1.0]})
    return StepSpec(cfg, batch, max_seq_len, t, b.buffers, b.instructions, b.groups, b.costs)


# ====================================================================================================== hazards


def hazard_predecessors(buffers: Sequence[BufferSpec], instructions: Sequence[Instruction]) -> list[set[int]]:
    """For each instruction (in sequential order), the earlier instructions it conflicts with *nearest*: the last
    writer of each element it reads (RAW) or writes (WAW), and the readers since that write of each element it
    writes (WAR). Weights and inputs have no writers inside a step and are skipped.

    Each buffer is cut into cells along every box boundary used on it; a cell is the unit of "same element"."""
    n = len(instructions)
    preds: list[set[int]] = [set() for _ in range(n)]
    per_buf: dict[int, list[tuple[int, Operand]]] = defaultdict(list)
    for i, ins in enumerate(instructions):
        for o in ins.operands:
            if buffers[o.buf].kind not in (Kind.WEIGHT, Kind.INPUT):
                per_buf[o.buf].append((i, o))
    for _, acc in per_buf.items():
        cuts = [sorted({o.box[2 * d] for _, o in acc} | {o.box[2 * d + 1] for _, o in acc}) for d in range(3)]
        at = [{x: k for k, x in enumerate(c)} for c in cuts]
        shape = tuple(len(c) - 1 for c in cuts)
        last_w = np.full(shape, -1, dtype=np.int64)
        readers = np.zeros(shape, dtype=object)  # per cell: bitset (Python int) of readers since the last write
        i_prev, pending_w = -1, []
        for i, o in acc + [(n, None)]:
            if i != i_prev:  # finish the previous instruction: its writes land after all its reads
                for c in pending_w:
                    last_w[c] = i_prev
                    readers[c] = 0
                pending_w, i_prev = [], i
            if o is None:
                break
            c = tuple(slice(at[d][o.box[2 * d]], at[d][o.box[2 * d + 1]]) for d in range(3))
            lw = np.unique(last_w[c])
            if o.reads or o.writes:
                preds[i].update(int(x) for x in lw if x >= 0 and x != i)
            if o.writes:
                rd = reduce(lambda a, x: a | x, readers[c].flat, 0)
                while rd:
                    low = rd & -rd
                    r = low.bit_length() - 1
                    if r != i:
                        preds[i].add(r)
                    rd ^= low
                pending_w.append(c)
            if o.reads:
                readers[c] = readers[c] | (1 << i)
    return preds


# ====================================================================================================== costs


@dataclass(frozen=True)
class CostModel:
    """Durations from bytes and FLOPs: ``overhead + bytes / (HBM bandwidth / SMs) + flops / (peak / SMs)``.

    One instruction runs on one SM; when all SMs stream, each gets its fair share of HBM bandwidth, which is the
    regime a decode megakernel lives in. Weight bytes may stream during the instruction's waits (prefetch)."""

    hbm_bandwidth: float  # bytes/s, whole chip
    sm_count: int
    peak_flops: float  # dense bf16 FLOP/s, whole chip
    overhead_ns: float = 500.0
    name: str = ""

    @classmethod
    def for_hardware(cls, name: str = "h200", overhead_ns: float = 500.0) -> CostModel:
        from kimik3.hardware import get_hardware

        h = get_hardware(name)
        return cls(h.hbm_bandwidth, h.sm_count or 132, h.peak_flops("bf16"), overhead_ns, h.name)

    @property
    def sm_bandwidth(self) -> float:
        return self.hbm_bandwidth / self.sm_count

    @property
    def sm_flops(self) -> float:
        return self.peak_flops / self.sm_count


_CATS = ("weight_bytes", "state_bytes", "act_bytes", "flops")


def instruction_costs(spec: StepSpec, context_len: int | None = None, expert_dtype: str = "bf16",
                      weight_dtype: str = "bf16", cost_model: CostModel | None = None) -> pd.DataFrame:
    """Per instruction: weight / state+cache / activation bytes, FLOPs, blocks, and durations (ns).

    Per-block totals come from ``kimik3.cost.decode_cost`` (the model's own parameter shapes, D(B) expected
    distinct experts); each block's total is split between the instructions that carry it in proportion to their
    tile shapes. Every weight-carrying block of ``decode_cost`` must be carried by some instruction (checked)."""
    cfg, B = spec.cfg, spec.batch
    ctx = spec.max_seq_len if context_len is None else context_len
    raw = np.zeros((len(spec.instructions), 4))
    owners: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = defaultdict(list)
    for i, contrib in enumerate(spec.raw_costs):
        for key, vals in contrib.items():
            v = np.asarray(vals, dtype=float)
            owners[key].append((i, v))
    calibrated = False
    try:
        from kimik3.cost import decode_cost
    except ImportError:  # the cost model is optional: fall back to the raw shape-based numbers
        decode_cost = None
    if decode_cost is not None:
        dc = decode_cost(cfg, batch_size=B, context_len=ctx, weight_dtype=weight_dtype, expert_dtype=expert_dtype,
                         act_dtype="bf16").by_block
        calibrated = True
        for _, row in dc.iterrows():
            key = (int(row["layer"]), str(row["block"]))
            target = np.array([row["weight_bytes"],
                               row["state_bytes_read"] + row["state_bytes_written"] + row["kv_bytes_read"]
                               + row["kv_bytes_written"], row["activation_bytes"], row["flops"]], dtype=float)
            own = owners.get(key, [])
            if not own:
                if target[0] > 0:
                    raise AssertionError(f"cost model block {key} ({target[0]:.0f} weight bytes) is carried by no "
                                         "instruction")
                continue
            tot = sum(v for _, v in own)
            for c in range(4):
                for i, v in own:
                    if tot[c] > 0:
                        raw[i, c] += target[c] * v[c] / tot[c]
                    else:  # no shape-based split for this category: share it evenly
                        raw[i, c] += target[c] / len(own)
        missing = set(owners) - {(int(r["layer"]), str(r["block"])) for _, r in dc.iterrows()}
        for key in missing:  # carried by instructions but unknown to decode_cost (should not happen): keep raw
            for i, v in owners[key]:
                raw[i] += v
    else:
        for own in owners.values():
            for i, v in own:
                raw[i] += v
    cm = cost_model or CostModel.for_hardware()
    df = pd.DataFrame(raw, columns=list(_CATS))
    df.insert(0, "op", [ins.op.name for ins in spec.instructions])
    df.insert(1, "layer", [ins.layer for ins in spec.instructions])
    df.insert(2, "label", [ins.label() for ins in spec.instructions])
    df["blocks"] = [",".join(sorted({blk for _, blk in c})) for c in spec.raw_costs]
    df["prefetch_ns"] = df["weight_bytes"] / cm.sm_bandwidth * 1e9
    df["busy_ns"] = cm.overhead_ns + (df["state_bytes"] + df["act_bytes"]) / cm.sm_bandwidth * 1e9 \
        + df["flops"] / cm.sm_flops * 1e9
    df["ns"] = df["prefetch_ns"] + df["busy_ns"]
    df.attrs["calibrated_by_decode_cost"] = calibrated
    df.attrs["cost_model"] = cm
    df.index.name = "id"
    return df


# ====================================================================================================== policies


def _group_structure(spec_groups: Sequence[str], preds: Sequence[set[int]]
                     ) -> tuple[list[int], list[list[int]], list[str], list[list[int]]]:
    """Group ids per instruction, members per group, group names, and the groups each instruction depends on."""
    names: list[str] = []
    index: dict[str, int] = {}
    gid = []
    for g in spec_groups:
        if g not in index:
            index[g] = len(names)
            names.append(g)
        gid.append(index[g])
    members: list[list[int]] = [[] for _ in names]
    for i, g in enumerate(gid):
        members[g].append(i)
    gdeps = []
    for v, ps in enumerate(preds):
        gs = sorted({gid[u] for u in ps})
        if gid[v] in gs:
            raise AssertionError(f"instruction {v} depends on a member of its own group {names[gid[v]]}")
        gdeps.append(gs)
    return gid, members, names, gdeps


def assign_round_robin(n: int, num_sms: int) -> list[list[int]]:
    """Instruction ``i`` (sequential order) goes to SM ``i mod S``: the simplest policy, blind to cost."""
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    for i in range(n):
        queues[i % num_sms].append(i)
    return queues


def assign_critical_path(busy_ns: Sequence[float], prefetch_ns: Sequence[float], gid: Sequence[int],
                         members: Sequence[Sequence[int]], gdeps: Sequence[Sequence[int]], num_sms: int,
                         prefetch: bool = True) -> tuple[list[list[int]], float]:
    """Cost-balanced critical-path-first list scheduling, aware of weight prefetch.

    Priority of an instruction = its *bottom level*: its own duration plus the longest duration-weighted path
    from it to the end of the step. SMs are served in order of the time they become free. A free SM takes the
    highest-priority instruction that is ready (every group it waits on has finished); if none is ready it
    commits to the one that becomes ready first and streams that instruction's weights while it waits — the same
    execution model as :func:`kimik3.megakernel.timeline.simulate`. An instruction becomes a candidate once every
    group it waits on is fully dispatched, so dispatch order is topological and the queues cannot deadlock.
    Returns the queues (dispatch order) and the estimated makespan (ns)."""
    busy = [float(x) for x in busy_ns]
    pre = [float(x) for x in prefetch_ns]
    n = len(busy)
    ng = len(members)
    succ_best = [0.0] * ng
    bl = [0.0] * n
    for v in range(n - 1, -1, -1):  # sequential order is topological: producers precede consumers
        bl[v] = busy[v] + pre[v] + succ_best[gid[v]]
        for g in gdeps[v]:
            if bl[v] > succ_best[g]:
                succ_best[g] = bl[v]
    waiters: list[list[int]] = [[] for _ in range(ng)]
    pending = [len(gs) for gs in gdeps]
    for v, gs in enumerate(gdeps):
        for g in gs:
            waiters[g].append(v)
    left = [len(m) for m in members]
    gfinish = [0.0] * ng
    ready_at = [0.0] * n
    future = [(0.0, -bl[v], v) for v in range(n) if pending[v] == 0]  # (ready time, -priority, id)
    heapq.heapify(future)
    ready: list[tuple[float, int]] = []  # (-priority, id), ready time <= now
    sms = [(0.0, s) for s in range(num_sms)]
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    makespan = 0.0
    for _ in range(n):
        now, sm = heapq.heappop(sms)
        while future and future[0][0] <= now:
            _, nb, v = heapq.heappop(future)
            heapq.heappush(ready, (nb, v))
        if ready:
            _, v = heapq.heappop(ready)
        elif future:
            _, _, v = heapq.heappop(future)
        else:
            raise AssertionError("list scheduling stalled: dependency cycle between groups")
        start = max(now, ready_at[v])
        hidden = min(pre[v], start - now) if prefetch else 0.0
        end = start + busy[v] + pre[v] - hidden
        makespan = max(makespan, end)
        queues[sm].append(v)
        heapq.heappush(sms, (end, sm))
        g = gid[v]
        gfinish[g] = max(gfinish[g], end)
        left[g] -= 1
        if left[g] == 0:
            for w in waiters[g]:
                pending[w] -= 1
                ready_at[w] = max(ready_at[w], gfinish[g])
                if pending[w] == 0:
                    heapq.heappush(future, (ready_at[w], -bl[w], w))
    return queues, makespan


# ====================================================================================================== waits


def _topological(n: int, queues: Sequence[Sequence[int]], gid: Sequence[int], members: Sequence[Sequence[int]],
                 gdeps: Sequence[Sequence[int]]) -> list[int]:
    """An order of all instructions respecting program order on each SM and every group dependency."""
    prev = [-1] * n
    nxt = [-1] * n
    for q in queues:
        for a, b in zip(q, q[1:]):
            prev[b], nxt[a] = a, b
    waiters: list[list[int]] = [[] for _ in members]
    for v, gs in enumerate(gdeps):
        for g in gs:
            waiters[g].append(v)
    indeg = [len(gdeps[v]) + (prev[v] >= 0) for v in range(n)]
    left = [len(m) for m in members]
    stack = [v for v in range(n) if indeg[v] == 0]
    order = []
    while stack:
        v = stack.pop()
        order.append(v)
        succ = [nxt[v]] if nxt[v] >= 0 else []
        g = gid[v]
        left[g] -= 1
        if left[g] == 0:
            succ += waiters[g]
        for w in succ:
            indeg[w] -= 1
            if indeg[w] == 0:
                stack.append(w)
    if len(order) != n:
        raise AssertionError("queues and dependencies form a cycle: this schedule would deadlock")
    return order


def compute_waits(n: int, queues: Sequence[Sequence[int]], preds: Sequence[set[int]], gid: Sequence[int],
                  members: Sequence[Sequence[int]], gdeps: Sequence[Sequence[int]]) -> list[list[int]]:
    """The groups each instruction waits on: a minimal set that, with program order on its SM, orders every
    hazard predecessor before it.

    Happens-before is tracked as ancestor bitsets along a topological order. Waiting on group ``g`` (for its full
    count) orders every member of ``g`` and all their ancestors before the waiter. Candidate groups are taken
    latest-first (a late group's ancestors often include the earlier ones), then any wait whose required members
    are already covered by the others is dropped — so no remaining wait is implied by the rest."""
    order = _topological(n, queues, gid, members, gdeps)
    prev = [-1] * n
    for q in queues:
        for a, b in zip(q, q[1:]):
            prev[b] = a
    position = [0] * n
    for k, v in enumerate(order):
        position[v] = k
    anc = [0] * n
    member_bits = [sum(1 << m for m in ms) for ms in members]
    last_pos = [max(position[m] for m in ms) for ms in members]
    closure: dict[int, int] = {}

    def close(g: int) -> int:
        if g not in closure:
            closure[g] = reduce(lambda a, m: a | anc[m] | (1 << m), members[g], 0)
        return closure[g]

    waits: list[list[int]] = [[] for _ in range(n)]
    for v in order:
        p = prev[v]
        base = (anc[p] | (1 << p)) if p >= 0 else 0
        need = sum(1 << u for u in preds[v]) & ~base
        if not need:
            anc[v] = base
            continue
        cands = sorted({gid[u] for u in preds[v] if not (base >> u) & 1}, key=lambda g: -last_pos[g])
        kept, covered = [], base
        for g in cands:
            if need & member_bits[g] & ~covered:
                kept.append(g)
                covered |= close(g)
        changed = True
        while changed:
            changed = False
            for g in kept:
                others = reduce(lambda a, h: a | close(h), (h for h in kept if h != g), base)
                if not need & ~others:
                    kept.remove(g)
                    changed = True
                    break
        anc[v] = reduce(lambda a, h: a | close(h), kept, base)
        waits[v] = kept
    return waits


# ====================================================================================================== program


def build_program(cfg: ModelConfig | str, batch: int, num_sms: int, policy: str = "critical_path",
                  max_seq_len: int = 4096, tiling: Tiling | None = None, act_dtype: torch.dtype = torch.bfloat16,
                  context_len: int | None = None, cost_model: CostModel | None = None,
                  expert_dtype: str = "bf16") -> Program:
    """The whole pipeline: step instructions → hazards → costs → queues → minimal waits → :class:`Program`.

    Built once per (config, batch, SM count, tiling) and reused for every decode step: counters are monotonic
    across steps, so nothing is reset between launches. The per-instruction costs ride along as
    ``program.costs`` (not serialised)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if num_sms < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    spec = build_step(cfg, batch, max_seq_len, tiling, num_sms, act_dtype, context_len)
    n = len(spec.instructions)
    preds = hazard_predecessors(spec.buffers, spec.instructions)
    gid, members, names, gdeps = _group_structure(spec.groups, preds)
    costs = instruction_costs(spec, context_len, expert_dtype=expert_dtype, cost_model=cost_model)
    if policy == "round_robin":
        queues = assign_round_robin(n, num_sms)
    else:
        queues, _ = assign_critical_path(costs["busy_ns"].tolist(), costs["prefetch_ns"].tolist(), gid, members,
                                         gdeps, num_sms)
    waits = compute_waits(n, queues, preds, gid, members, gdeps)
    # counters: only groups somebody waits on get one (and only their members signal)
    used = sorted({g for ws in waits for g in ws})
    cid = {g: i for i, g in enumerate(used)}
    counters = [Counter(names[g], len(members[g])) for g in used]
    sm_of, qpos = [0] * n, [0] * n
    for s, q in enumerate(queues):
        for k, v in enumerate(q):
            sm_of[v], qpos[v] = s, k
    instructions = []
    for v, ins in enumerate(spec.instructions):
        g = gid[v]
        instructions.append(replace(
            ins, waits=tuple((cid[w], len(members[w])) for w in waits[v]),
            signal=cid.get(g, -1), amount=1 if g in cid else 0, sm=sm_of[v], qpos=qpos[v]))
    prog = Program(spec.buffers, instructions, [list(q) for q in queues], counters, batch, max_seq_len,
                   spec.cfg.num_hidden_layers, policy)
    prog.costs = costs
    return prog
