"""The megakernel's int32 instruction encoding: the one definition the host program and the device code read.

Opcode numbers, operand modes, buffer kinds, dtype codes, the header / buffer / counter / instruction word offsets,
the opcode argument flags and the launch's error and control words, shared by ``kimik3.megakernel`` (builds,
encodes, checks, interprets the program) and ``kernels/megakernel/vm.py`` (executes it). Standard library only, so
neither side needs the other's dependencies and it loads by path (``tests/test_contracts.py``); the megakernel's
source hash covers it (``kernels/toolchain/source.py``). An encoded program is, in int32 words: header, buffer
table, counter table, instructions, per-SM queues (``-1`` padded), UTF-8 names
(:func:`kimik3.megakernel.instructions.encoding_table` renders it). A wait "counter ``c`` ≥ ``t``" in step ``s``
means ``counter[c] ≥ s·total[c] + t`` (``total`` = word ``CW_TOTAL``). See docs/architecture.md (map).
"""

from __future__ import annotations

import enum

__all__ = [
    "Op", "Kind", "Mode", "NormRole", "Site",
    "MAGIC", "VERSION", "HEADER_WORDS", "MAX_WAITS", "MAX_OPERANDS", "OPERAND_WORDS", "INSTR_WORDS",
    "BUFFER_WORDS", "COUNTER_WORDS", "POLICIES", "EXPERT_FORMATS", "MXFP4_OPERANDS", "DTYPE_CODES",
    "FFN_ROUTED", "FFN_MLP", "FFN_LATENT_NORM", "DEVICE_OPS", "COLLECTIVE_OPS",
    "ERROR_WORDS", "CTL_WORDS", "ERR_WATCHDOG", "ERR_BAD_PROGRAM", "CTA_THREADS", "BT_MAX", "SMEM_CARVEOUT_PERCENT",
    "STAGE_BYTES", "STAGE_BUFFERS", "STAGE_SCRATCH_OPS", "CHUNK_BYTES", "W_STAGE_OP", "W_STAGE_ROWS",
    "W_STAGE_CHUNKS", "W_NEXT_BUF",
    "W_NEXT_ELEM_LO", "W_NEXT_ELEM_HI", "W_NEXT_CHUNKS", "H_OFF_CBASE", "PEER_TABLE", "CODE_BYTES", "CTL_LOCAL",
    "LOCAL_PROGRAM", "LOCAL_BUFFERS", "LOCAL_COUNTERS", "LOCAL_TIMINGS", "LOCAL_ERROR", "LOCAL_FIELDS", "MAX_LOCAL",
    "LOCAL_TABLE",
]


class Op(enum.IntEnum):
    """Opcodes. The number is what the int32 program stores in word 0 of an instruction."""

    NOP = 0
    EMBED = 1  # batch tile: stream[b, 0] = Emb[ids[b]]
    ATTN_RES_MIX = 2  # batch tile of one AttnRes site: softmax-over-depth mix of stream entries -> mix
    NORM_PROJ = 3  # RMSNorm(x) and a tile of output rows of one projection (KDA/MLA input, router, latent down)
    MLP_GATE_UP = 4  # RMSNorm(x), a tile of gate and up rows, SiTU -> shared-expert / dense-MLP hidden
    KDA_STEP = 5  # head tile: short conv, l2norm, decay gate, delta-rule state update, gated RMSNorm
    MLA_Q = 6  # head tile: q LoRA norm, q_b rows, absorb W_UK -> latent-space queries
    MLA_KV_APPEND = 7  # normalised latent + shared key of the new token -> compressed cache at its position
    MLA_PARTIAL = 8  # absorbed attention over one context split for a head tile -> (o, max, sum) partials
    MLA_REDUCE = 9  # head tile: merge the splits, absorb W_UV, output gate
    O_PROJ_RESIDUAL = 10  # column tile of o_proj, added into (or starting) the block's partial sum
    ROUTER = 11  # sigmoid scores + bias, top-k, renormalise; compact the distinct experts into slots
    EXPERT_GATE_UP = 12  # (slot, row) tile of the chosen experts' w1/w3 + SiTU
    EXPERT_DOWN = 13  # row tile of w2 over every chosen expert, fp32 weighted combine -> latent sum
    FFN_OUT = 14  # column tile: latent norm + up-proj (LATENT_NORM_UP), shared/dense down-proj, residual add
    LM_HEAD = 15  # final RMSNorm + a tile of vocabulary rows -> fp32 logits and the tile's (max, argmax)
    ARGMAX = 16  # reduce the per-tile (max, argmax) pairs -> next greedy token
    # the collectives of a rank program (kernels/contracts/peers.py: the mailboxes and counters they use)
    ALLREDUCE_MIX = 17  # batch tile: sum the ranks' partial sums from the mailbox in rank order into the stream,
    #                     then the AttnRes mix that follows (an ATTN_RES_MIX fused behind an all-reduce)
    ARGMAX_ALL = 18  # the next greedy token from every vocabulary shard's per-tile (max, argmax) pairs
    MOE_COMBINE = 19  # batch tile: sum the ranks' fp32 latent expert partials in rank order, cast once, latent norm


# the collective opcodes: one GPU's kernel implements DEVICE_OPS and refuses a program holding any other; a kernel
# built for rank programs (MKConfig.ranks) also runs these (kernels/megakernel/collective.py); the CPU executors
# run them all
COLLECTIVE_OPS = frozenset({Op.ALLREDUCE_MIX, Op.ARGMAX_ALL, Op.MOE_COMBINE})
DEVICE_OPS = tuple(op for op in Op if op != Op.NOP and op not in COLLECTIVE_OPS)


class Kind(enum.IntEnum):
    """What a buffer is (buffer-table word ``BW_KIND``); decides what the hazard checker allows."""

    INPUT = 1  # written by the host before the launch (token ids, positions); read-only inside a step
    WEIGHT = 2  # static for the whole run: the only kind that may be prefetched before a wait
    ACT = 3  # per-step scratch activations
    STATE = 4  # carried across steps (KDA state and conv history, MLA cache)
    OUTPUT = 5  # written inside the step, read by the host afterwards (logits, next token)
    MAILBOX = 6  # symmetric: every rank holds one at the same id and shape; peers PUSH into it (contracts/peers.py)


class Mode(enum.IntFlag):
    """Operand word ``OW_MODE``."""

    READ = 1
    WRITE = 2
    READ_WRITE = 3
    PREFETCH = 4  # with READ: the read may be issued before the instruction's waits are satisfied
    PUSH = 8  # with WRITE, on a MAILBOX: the box is written on every rank of the instruction's peer range


class NormRole(enum.IntEnum):
    """NORM_PROJ / MLP_GATE_UP arg 1: which projection a tile belongs to (for labels and cost attribution)."""

    KDA_IN = 0
    MLA_IN = 1
    ROUTER = 2
    LATENT_DOWN = 3
    SHARED = 4
    DENSE = 5


class Site(enum.IntEnum):
    """ATTN_RES_MIX arg 0."""

    ATTN = 0
    MLP = 1
    OUTPUT = 2


# ---------------------------------------------------------------------------------------------------- sizes
MAGIC = 0x4B334D4B  # "K3MK"
VERSION = 2  # 2: the weight stage is chosen on the host (W_STAGE_*) and streamed across instructions (W_NEXT_*)
HEADER_WORDS = 32
MAX_WAITS = 4
MAX_OPERANDS = 12
OPERAND_WORDS = 8  # buffer, mode, b0, b1, r0, r1, c0, c1
INSTR_WORDS = 128
BUFFER_WORDS = 8  # kind, dtype, d0, d1, d2, name offset, name length, 0
COUNTER_WORDS = 4  # total, name offset, name length, 0

# ---------------------------------------------------------------------------------------------------- header
H_MAGIC, H_VERSION, H_HEADER_WORDS, H_N, H_INSTR_WORDS, H_S, H_Q, H_C, H_NB = range(9)
H_BATCH, H_MAX_SEQ, H_LAYERS, H_POLICY = 9, 10, 11, 12
H_OFF_BUF, H_OFF_CTR, H_OFF_INS, H_OFF_Q, H_OFF_STR, H_NSTR, H_TOTAL = 13, 14, 15, 16, 17, 18, 19
H_MAX_WAITS, H_MAX_OPERANDS = 20, 21
H_EXPERT_FORMAT = 22
H_RANK, H_WORLD = 23, 24  # a rank program's rank and world size; world 0: a single-GPU program (words 25..31 zero)
# a rank program's counter-word table (after the names): per counter its first word in the rank's counter memory
# (kernels/contracts/peers.py counter_bases), so the device indexes a counter's words without a prefix sum;
# 0 in a single-GPU program, whose counter c is word c
H_OFF_CBASE = 25
POLICIES = ("round_robin", "critical_path", "custom")  # header word H_POLICY is an index into this
# How the routed experts are stored (header word H_EXPERT_FORMAT is an index into this): "dense" stacks w1 / w3 / w2
# in the activation dtype; "mxfp4" holds them as the K3 release does (compressed-tensors mxfp4-pack-quantized): uint8
# codes, two E2M1 values per byte (low nibble = even column), and one E8M0 uint8 scale (2^(e-127)) per 32 columns.
# A kernel is compiled for one of them and refuses a program of the other (ERR_BAD_PROGRAM).
EXPERT_FORMATS = ("dense", "mxfp4")

# ---------------------------------------------------------------------------------------------------- tables
BW_KIND, BW_DTYPE, BW_D0, BW_D1, BW_D2, BW_NAME_OFF, BW_NAME_LEN = range(7)  # a buffer-table row
# a counter-table row: per-step total, its name, and its sources (0: a local counter of one word; n: a cross-rank
# counter of n words, one per source rank, each signalled by that rank alone: kernels/contracts/peers.py)
CW_TOTAL, CW_NAME_OFF, CW_NAME_LEN, CW_SOURCES = range(4)
# buffer-table word BW_DTYPE (names as torch spells them; the host maps them to torch dtypes)
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int64": 3, "int32": 4, "bool": 5, "float64": 6,
               "uint8": 7}
DTYPE_F32, DTYPE_BF16, DTYPE_U8 = DTYPE_CODES["float32"], DTYPE_CODES["bfloat16"], DTYPE_CODES["uint8"]
# bytes per element of each code (a PUSH copies a box of any dtype)
CODE_BYTES = {0: 4, 1: 2, 2: 2, 3: 8, 4: 4, 5: 1, 6: 8, 7: 1}

# ---------------------------------------------------------------------------------------------------- instruction
# word offsets inside one instruction row
W_OP, W_LAYER, W_SM, W_QPOS = 0, 1, 2, 3
W_ARGS = 4  # 4 words: opcode arguments a0..a3
W_SIGNAL, W_AMOUNT, W_NWAITS = 8, 9, 10
W_WAITS = 11  # MAX_WAITS x (counter, target)
W_NOPS = W_WAITS + 2 * MAX_WAITS  # 19
W_OPS = W_NOPS + 1  # 20 .. 20 + 12*8 = 116
assert W_OPS + MAX_OPERANDS * OPERAND_WORDS <= INSTR_WORDS
# The weight stage (words 116..122; 123..127 reserved, zero). Each CTA holds STAGE_BUFFERS shared-memory stage
# buffers of STAGE_BYTES, used in turn by queue position parity. The host decides what is staged, so the device
# can copy it with no choice loop and, for the next instruction, before it has even waited for the current one:
# * W_STAGE_OP / _ROWS / _CHUNKS: operand j of THIS instruction whose leading whole rows (from its box's r0) sit in
#   this instruction's stage buffer (-1, 0, 0: nothing staged). Only a bf16 WEIGHT operand with Mode.PREFETCH and
#   a one-slice, full-width box (b1 - b0 == 1, c0 == 0, c1 == d2, d2 % 8 == 0) qualifies, rows <= r1 - r0 and
#   rows * d2 * 2 <= STAGE_BYTES; chunks = rows * d2 / 8 (16-byte chunks). EMBED never stages (its rows are data).
# * W_NEXT_BUF / _ELEM_LO / _ELEM_HI / _CHUNKS: the stage of the NEXT instruction of the same queue, as the device
#   copies it while this one starts (before this one's waits): buffer index, element offset of the first staged
#   element (b0*d1 + r0)*d2 as an int64 split in two words (low word: the unsigned low 32 bits stored as int32),
#   16-byte chunks. (-1, 0, 0, 0): the next instruction stages nothing, or this is the last one of its queue.
#   Issued before this instruction's waits, so it is legal only for WEIGHT buffers (static for the run); the host
#   fills it from the next instruction's own W_STAGE_* and the hazard checker proves the two agree.
W_STAGE_OP, W_STAGE_ROWS, W_STAGE_CHUNKS = 116, 117, 118
W_NEXT_BUF, W_NEXT_ELEM_LO, W_NEXT_ELEM_HI, W_NEXT_CHUNKS = 119, 120, 121, 122
# The peer range (words 123, 124; 125..127 reserved, zero): ranks [lo, hi) that this instruction's PUSH operands are
# written on and whose copy of its signal counter it adds to (at the word of its own rank). (0, 0): local only.
W_PEER_LO, W_PEER_HI = 123, 124
assert W_OPS + MAX_OPERANDS * OPERAND_WORDS <= W_STAGE_OP and W_PEER_HI < INSTR_WORDS
STAGE_BYTES = 48 * 1024  # bytes per shared-memory stage buffer
STAGE_BUFFERS = 2  # ping-pong: this instruction reads one while the next one's weights land in the other
CHUNK_BYTES = 16  # one cp.async copy (8 bf16 elements): the unit of W_STAGE_CHUNKS / W_NEXT_CHUNKS
# Opcodes whose own stage buffer is their shared-memory scratch (EXPERT_DOWN: the warps' combine partials): the host
# never stages them (W_STAGE_OP = -1, so no copy lands in that buffer while they run) and refuses a program that does.
STAGE_SCRATCH_OPS = (Op.EXPERT_DOWN,)
# word offsets inside one operand (OPERAND_WORDS each, from W_OPS); the box is [b0:b1, r0:r1, c0:c1]
OW_BUF, OW_MODE, OW_BOX = 0, 1, 2
B0, B1, R0, R1, C0, C1 = range(6)  # box fields, relative to OW_BOX

# ---------------------------------------------------------------------------------------------------- arguments
# FFN_OUT arg 0 flags: which sources the column tile sums (and whether the routed one is latent-normed)
FFN_ROUTED, FFN_MLP, FFN_LATENT_NORM = 1, 2, 4

# ---------------------------------------------------------------------------------------------------- operands
# The expert opcodes of an "mxfp4" program: (codes operand, its scales operand) per weight. Operands 0..5 are the
# dense layout with uint8 codes where the dense weights were; the scales follow:
#   EXPERT_GATE_UP  0 latent x R | 1 slot experts R | 2 slot use R | 3 w1 codes* (0,E, r0,r1, 0,Dl/2) | 4 w3 codes*
#                   | 5 expert hidden W | 6 w1 scales* (0,E, r0,r1, 0,Dl/32) | 7 w3 scales*
#   EXPERT_DOWN     0 expert hidden R | 1 slot experts R | 2 slot use R | 3 slot weights R | 4 w2 codes*
#                   (0,E, r0,r1, 0,Ie/2) | 5 latent sum W | 6 w2 scales* (0,E, r0,r1, 0,Ie/32)
MXFP4_OPERANDS = {Op.EXPERT_GATE_UP: ((3, 6), (4, 7)), Op.EXPERT_DOWN: ((4, 6),)}

# ---------------------------------------------------------------------------------------------------- launch
ERROR_WORDS = 8  # error[0] code, [1] instruction, [2] counter, [3] target, [4] value seen, [5] CTA, [6] SM, [7] step
CTL_WORDS = 8  # ctl[0] step, [1] watchdog spins, [2] nanosleep ns per spin, [CTL_LOCAL] local ranks
# One launch of a kernel built for rank programs may run L > 1 ranks of a deployment on one GPU (loopback): ctl[3] =
# L, CTA c runs local rank c // (grid / L) as its CTA c % (grid / L), on that rank's tensors, whose base addresses
# are entries LOCAL_FIELDS·l + k of the launch's local table (k: LOCAL_PROGRAM .. LOCAL_ERROR); L of 0 or 1: the
# launch runs the tensors it is given. The ranks' counter memories and mailboxes are then one allocation, and the
# peer table names every local rank's part of it.
CTL_LOCAL = 3
LOCAL_PROGRAM, LOCAL_BUFFERS, LOCAL_COUNTERS, LOCAL_TIMINGS, LOCAL_ERROR = range(5)
LOCAL_FIELDS, MAX_LOCAL = 5, 8
LOCAL_TABLE = LOCAL_FIELDS * MAX_LOCAL
ERR_WATCHDOG, ERR_BAD_PROGRAM = 1, 2  # error[0]
# the launch's peer table: per rank of the world, the device address of that rank's counter memory, its peer
# segment (the MAILBOX buffers follow the counter words at the same offsets on every rank: a push to rank p writes
# own address - peers[rank] + peers[p]); as many entries as a world may hold (kernels/contracts/peers.py MAX_WORLD)
PEER_TABLE = 128
# threads per CTA (one CTA per SM): 12 warps x 32 lanes x 64 B keep ~24 KiB of weight loads in flight per SM, and
# the 168-register cap (65536 / 384) leaves room for the widest opcode; 512 threads (cap 128) spill. The host
# refuses a program whose per-thread work assumes more (e.g. a KDA head wider than the CTA).
CTA_THREADS = 384
# the shared-memory carveout the launcher asks for, in percent of the SM's most: 0 prefers L1, so the driver takes
# the smallest carveout that holds the CTA's shared memory and leaves the rest of the SM's L1/shared array as L1
# (the MXFP4 expert opcodes' prefetch and the performance model count on that L1; the default may leave little)
SMEM_CARVEOUT_PERCENT = 0
BT_MAX = 4  # batch rows per GEMV pass of the device code (cap of MKConfig.bt): keeps the widest opcode's registers
# low
