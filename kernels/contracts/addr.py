"""The megakernel's address arithmetic as plain integer functions: one definition, two executions.

The device opcodes (``kernels/megakernel/``) call these on traced DSL integers (``wide=Int64``) to compute which
rows, columns and elements an instruction touches; the host's address replay (``kernels/verify/addr_replay.py``)
calls them on Python ints. They use nothing but ``+ - *`` (``// %`` by a positive divisor) and a ``wide`` cast, and
import only the standard library, ``contracts/isa.py`` and ``contracts/meta.py``. Design: ``docs/architecture.md``
(map, megakernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kimik3.kernels.contracts.meta import ROW_LOOP_FROM

__all__ = ["GEMV_BT", "GEMV_UNROLL", "GEMV_UNROLL_X_UNROLLED", "GEMV_MMA_ROWS", "LM_HEAD_MMA", "GEMV_MMA_FROM",
           "GEMV_GROUP_PASSES", "GEMV_GROUP_UNROLL", "GEMV_GROUP_UNROLL_FROM",
           "gemv_unroll", "gemv_mma_unroll", "gemv_batch_tile",
           "gemv_tile_rows", "lm_head_tile_rows", "gemv_tiles", "gemv_item", "gemv_mma", "gemv_mma_passes",
           "gemv_groups", "gemv_group_passes", "gemv_group_row", "EXPERT_GROUP_PASSES", "EXPERT_MMA_BLOCKS",
           "expert_mma", "expert_group_passes", "expert_groups", "elem_offset", "tile_rows", "expert_row_offset",
           "FP4_GROUP", "FP4_GROUP_BYTES", "fp4_row_offsets", "absorb_cw", "peer_address", "push_item", "VEC"]

VEC = 8  # bf16 elements per 16-byte chunk (the device code's VEC)
# MXFP4 experts (an "mxfp4" program): one E8M0 scale byte per FP4_GROUP columns, whose codes (two per byte) are one
# 16-byte load
FP4_GROUP = 32
FP4_GROUP_BYTES = FP4_GROUP // 2


# The megakernel's GEMV opcodes (NORM_PROJ, MLP_GATE_UP, O_PROJ_RESIDUAL, FFN_OUT, LM_HEAD) walk the batch in
# passes of up to GEMV_BT rows: every weight chunk a lane loads is used for all the pass's rows, so at batch <= 8
# each weight row is read from memory once for the whole batch (bigger batches: once per pass). 8 accumulators per
# lane fit next to 8 weight chunks in flight under the 168-register cap because device_fns._dot_step walks the
# pass's rows in a loop (one row's x chunks live at a time). The (row, pass) pairs are one flat loop of work items
# (gemv_item; why: kernels/megakernel/gemv.py).
GEMV_BT = 8
GEMV_UNROLL = 8  # 16-byte weight loads in flight per lane per step: 12 warps x 32 lanes x 8 x 16 B = 48 KiB per SM
# Passes below meta.ROW_LOOP_FROM rows load each weight chunk's x chunks next to it (4 registers each). With 8 weight
# chunks per step, ptxas (sm_90a, under the 168-register cap) issued 6 weight + 6 x loads, consumed the first pair,
# then issued the last 2: two load latencies per step, about 4 chunks in flight on average. With 6 every load of the
# step is in flight before the first is consumed (the SASS audit, kernels/verify/sass_audit.py): 36 KiB per SM for
# one latency per step.
GEMV_UNROLL_X_UNROLLED = 6
# sm_100a's ptxas spills the whole megakernel with 8 or 4 (it allocates the widest branch differently); 2 there
GEMV_UNROLL_BY_ARCH = {"sm_100a": 2}


def gemv_unroll(arch: str, bt: int = GEMV_BT) -> int:
    """16-byte weight loads in flight per lane per step of the GEMV opcodes for the compile target ``arch``
    (``MKConfig.arch``) and a batch pass of ``bt`` rows."""
    if arch in GEMV_UNROLL_BY_ARCH:
        return GEMV_UNROLL_BY_ARCH[arch]
    return GEMV_UNROLL if bt >= ROW_LOOP_FROM else GEMV_UNROLL_X_UNROLLED


# A batch pass of GEMV_BT = 8 rows is the N of the tensor-core step (kernels/megakernel/mma.py, mma.sync m16n8k16):
# its work items are 16-row weight tiles (GEMV_MMA_ROWS, mma.MMA_ROWS) instead of single rows, each lane streaming
# GEMV_UNROLL / 2 k blocks of 32 elements per step (2 weight chunks each: the same 16-byte loads in flight).
GEMV_MMA_ROWS = 16


def gemv_tile_rows(batch: int) -> int:
    """Weight rows per GEMV work item at ``batch``: a 16-row mma tile on the tensor-core path (:func:`gemv_mma`),
    else one row (the CUDA-core path)."""
    return GEMV_MMA_ROWS if gemv_mma(batch) else 1


def gemv_tiles(n: Any, rows: int) -> Any:
    """Work-item tiles of ``rows`` weight rows covering ``n`` rows (the last one may run past ``n``: its rows from
    ``n`` on are read clamped and never stored)."""
    return (n + (rows - 1)) // rows


# LM_HEAD on the tensor-core path like the other GEMV opcodes (True), or one vocabulary row per item on CUDA cores at
# every batch (False: above batch 8 it reads the vocabulary once per pass of gemv_batch_tile rows). Off: with it on,
# the k3-shard megakernels compile without spills for sm_90a at batch 8 to 64 (164-166 registers), but the tiny and
# micro ones spill at every batch from 8 (16-60 spill stores; their other opcodes leave fewer registers), also with
# LM_HEAD's k blocks per step lowered to 2. The tensor-core LM_HEAD stays in the code and is host-executed
# (kernels/verify/host_exec_mk_gemv.py); the device code, the address replay and the model's LM_HEAD entry read the
# switch.
LM_HEAD_MMA = False


def lm_head_tile_rows(batch: int) -> int:
    """Weight rows per LM_HEAD work item at ``batch``: :func:`gemv_tile_rows` when :data:`LM_HEAD_MMA`, else 1 (the
    CUDA-core path)."""
    return gemv_tile_rows(batch) if LM_HEAD_MMA else 1


def gemv_mma_unroll(arch: str, normed: bool = False, passes: int = 1) -> int:
    """32-element k blocks in flight per lane per step of the tensor-core GEMV path for an item of ``passes`` passes
    (:func:`gemv_group_passes`): each is two 16-byte weight loads, so :func:`gemv_unroll` / 2 keeps the CUDA-core
    path's bytes in flight (sm_90a: 4 blocks, 12 warps x 32 lanes x 4 x 32 B = 48 KiB per SM). An x normalised as
    loaded (``normed``) also holds a γ chunk per block: one block fewer there (36 KiB per SM) keeps the megakernel
    under the register cap without spills. From :data:`GEMV_GROUP_UNROLL_FROM` passes: at most
    :data:`GEMV_GROUP_UNROLL` blocks (the passes' accumulators take the registers)."""
    u = max(1, gemv_unroll(arch) // 2 - (1 if normed else 0))
    return min(u, GEMV_GROUP_UNROLL) if passes >= GEMV_GROUP_UNROLL_FROM else u


def gemv_batch_tile(batch: int) -> int:
    """Batch rows per pass of the GEMV opcodes: the largest divisor of ``batch`` up to :data:`GEMV_BT`, so every
    pass is full and the work-item loop stays a real loop (code size independent of the batch)."""
    if batch < 1:
        raise ValueError(f"gemv_batch_tile: batch must be >= 1, got {batch}")
    return max(d for d in range(1, min(batch, GEMV_BT) + 1) if batch % d == 0)



# From batch GEMV_MMA_FROM (the mma's 8 columns) every GEMV opcode but a CUDA-core LM_HEAD runs on tensor cores, and a
# work item is a 16-row weight tile x a *group* of passes of 8 batch rows: each k block's weight chunks are loaded
# once and used for every pass of the group (one mma pair per pass), so the tile streams from memory once per group,
# not once per pass. A group holds GEMV_GROUP_PASSES[sources] passes, sources being the weights an item accumulates
# at once (MLP_GATE_UP's gate and up, FFN_OUT's routed and mlp rows): 4 fp32 accumulators per lane per pass and
# source live across the whole k loop, under the 168-register cap. The last pass of a batch that is not a multiple
# of 8 reads its missing x rows at row B - 1 and stores none of them (gemv_group_row).
GEMV_MMA_FROM = 8
GEMV_GROUP_PASSES = {1: 4, 2: 2}
# k blocks per step of an item of GEMV_GROUP_UNROLL_FROM passes or more: with the one-pass 3 (normalised x) or 4 the
# batch-64 megakernel spilled there (ptxas, sm_90a, 168-register cap); with 8 passes per group it spilled even at 2
GEMV_GROUP_UNROLL = 2
GEMV_GROUP_UNROLL_FROM = 4


def gemv_mma(batch: int) -> bool:
    """Whether the GEMV opcodes run on tensor cores at ``batch`` (a CUDA-core LM_HEAD aside: :data:`LM_HEAD_MMA`)."""
    return batch >= GEMV_MMA_FROM


def gemv_mma_passes(batch: int) -> int:
    """Passes of 8 batch rows on the tensor-core path (the last one partial when 8 does not divide ``batch``)."""
    return (batch + (GEMV_BT - 1)) // GEMV_BT


def gemv_groups(batch: int, sources: int = 1) -> int:
    """Pass groups of a tensor-core GEMV item loop at ``batch`` for an opcode accumulating ``sources`` weights at
    once: as few as :data:`GEMV_GROUP_PASSES` allows (each group is one more read of every weight tile)."""
    cap = GEMV_GROUP_PASSES[sources]
    return (gemv_mma_passes(batch) + (cap - 1)) // cap


def gemv_group_passes(batch: int, sources: int = 1) -> int:
    """Passes per group (the groups balanced: ``cdiv(passes, groups)``; the last group's extra passes, if any,
    lie wholly past the batch and store nothing)."""
    ng = gemv_groups(batch, sources)
    return (gemv_mma_passes(batch) + (ng - 1)) // ng


def gemv_group_row(group: Any, p: int, col: Any, passes: int) -> Any:
    """Batch row of column ``col`` (0..7) of pass ``p`` of pass group ``group`` (groups of ``passes`` passes): the
    rows a tensor-core GEMV item reads and stores (a row at or past the batch is read clamped, never stored)."""
    return (group * passes + p) * GEMV_BT + col


# The routed experts on tensor cores: MXFP4 at every batch (a pass of 8 list positions per item), dense bf16 from
# GEMV_MMA_FROM. A dense work item is a 16-row tile of one expert's weight x a group of passes of 8 positions of that
# expert's token list, the positions gemv_group_row names (list positions instead of batch rows; one at or past the
# list's end is read at the list's last token and never stored), so a tile streams once per group of the expert's
# tokens. Passes per group: EXPERT_GROUP_PASSES per opcode (EXPERT_GATE_UP's two weights run one after the other
# with both accumulator sets live), under the 168-register cap as each variant's build report records.
EXPERT_GROUP_PASSES = {"gate_up": 2, "down": 2}
# k blocks of a dense tile's two rows a lane prefetches into L1 per step (4: 128 bytes per lane, 48 KiB per 12-warp
# CTA in flight), then loads block by block (moe.dense_mma_tile)
EXPERT_MMA_BLOCKS = 4


def expert_mma(batch: int, fp4: bool = False) -> bool:
    """Whether the routed-expert opcodes run on tensor cores: always for MXFP4 experts, from :data:`GEMV_MMA_FROM`
    for dense ones."""
    return fp4 or gemv_mma(batch)


def expert_group_passes(batch: int, op: str, fp4: bool = False) -> int:
    """Passes of 8 list positions per tensor-core work item of expert opcode ``op`` ("gate_up", "down"): 1 for MXFP4;
    for dense experts :data:`EXPERT_GROUP_PASSES`, at most the passes a list of ``batch`` tokens can need."""
    if op not in EXPERT_GROUP_PASSES:
        raise ValueError(f"expert_group_passes: op must be one of {sorted(EXPERT_GROUP_PASSES)}, got {op!r}")
    return 1 if fp4 else min(EXPERT_GROUP_PASSES[op], gemv_mma_passes(batch))


def expert_groups(n: Any, passes: int) -> Any:
    """Pass groups over an expert's token list of ``n`` tokens (groups of ``passes`` passes of 8)."""
    return (n + (passes * GEMV_BT - 1)) // (passes * GEMV_BT)


def gemv_item(k: Any, n: Any, nbt: int) -> tuple[Any, Any]:
    """(weight row or tile, batch pass) of work item ``k`` of a GEMV opcode over ``n`` weight rows (tiles of
    :func:`gemv_tile_rows` rows: ``n`` = :func:`gemv_tiles`) in ``nbt`` passes (batch // the batch tile): item
    ``t·n + j`` is pass ``t`` of row (tile) ``j``. Warp ``w`` takes items ``w, w + NW, ...``: the
    warps sweep one pass (its x rows) at a time, and within a pass a warp's rows ascend (LM_HEAD's running arg-max
    relies on it). With one pass the item is the row and the pass a constant 0: batch <= 8 has no pass arithmetic."""
    if nbt == 1:
        return k, 0
    return k % n, k // n


def _ident(v: Any) -> Any:
    return v


# ------------------------------------------------------------------------------------------- shared arithmetic
def elem_offset(d1: Any, d2: Any, b: Any, r: Any, c: Any, wide: Callable[[Any], Any] = _ident) -> Any:
    """Element offset of ``[b, r, c]`` in a ``[*, d1, d2]`` buffer (``wide``: the device's 64-bit cast)."""
    return (wide(b) * wide(d1) + wide(r)) * wide(d2) + wide(c)


def tile_rows(r0: Any, r1: Any) -> Any:
    """Rows of a tiled GEMV instruction's weight box ``[r0, r1)``: warp ``w`` computes rows ``w, w + NW, ...`` below
    it, row ``j`` of the box producing output column ``c0 + j`` of the instruction's output box."""
    return r1 - r0


def expert_row_offset(d1: Any, d2: Any, e: Any, r: Any, wide: Callable[[Any], Any] = _ident) -> Any:
    """Element offset of row ``r`` of expert ``e`` in an ``[E, d1, d2]`` expert weight (expert stride d1·d2)."""
    return elem_offset(d1, d2, e, r, 0, wide)


def fp4_row_offsets(d1: Any, d2: Any, sd1: Any, sd2: Any, e: Any, r: Any, wide: Callable[[Any], Any] = _ident
                    ) -> tuple[Any, Any]:
    """Byte offsets of row ``r`` of expert ``e`` of an MXFP4 expert weight: in its ``[E, d1, d2]`` uint8 codes (``d2``
    = columns / 2) and in its ``[E, sd1, sd2]`` uint8 scales (``sd2`` = columns / FP4_GROUP). Both are one byte per
    element, so the element offsets are the byte offsets."""
    return expert_row_offset(d1, d2, e, r, wide), expert_row_offset(sd1, sd2, e, r, wide)


def peer_address(own: Any, base_me: Any, base_p: Any) -> Any:
    """Rank p's copy of the byte at ``own`` in this rank's peer segment: every rank's segment has the same layout
    (its counter words, then its MAILBOX buffers), so a push or a signal to rank p moves by the segments' distance
    (``isa.PEER_TABLE``: ``base_me`` = this rank's entry, ``base_p`` = p's)."""
    return own - base_me + base_p


def push_item(rows_r: Any, per: Any, k: Any) -> tuple[Any, Any, Any]:
    """Work item ``k`` of a PUSH copy of a box whose rows are (batch row, mailbox row) pairs, ``rows_r`` mailbox rows
    per batch row and ``per`` copy units per row: (batch row offset, mailbox row offset, unit) in the box."""
    row = k // per
    return row // rows_r, row % rows_r, k % per


def absorb_cw(kvl: int) -> int:
    """MLA_Q's W_UK absorption (``op_mla_q`` in ``kernels/megakernel/mla.py``): 16-byte column chunks per warp task,
    the largest power of two up to 8 dividing the kvl/8 chunks; task ``i`` owns columns ``[8·CW·i, 8·CW·(i + 1))`` of
    every nope row of the head, its 32/CW lane row groups split the rows. A trace-time constant on the device (plain
    ints)."""
    nc = kvl // VEC
    cw = 8
    while nc % cw:
        cw //= 2
    return cw
