"""The megakernel's instruction set, its operand declarations and the int32 encoding both interpreters read.

A persistent megakernel runs one CTA per SM, each walking its own queue of coarse *instructions* ("RMSNorm + rows
256..511 of a projection"); dependencies are counters in global memory, not kernel boundaries. This module holds
the opcodes (:class:`Op`), the operand declarations every instruction carries (:class:`Operand`: buffer, element
box, read or write, may it be prefetched), the program (:class:`Program`) and its encoding (:func:`encode_program`,
:func:`decode_program`), and the weight stages and next-stage prefetch descriptors (:func:`assign_stages`). The
encoding's numbers are defined once in ``kernels/contracts/isa.py`` and re-exported here. The hazard checker proves
everything from these declarations, so an instruction touches nothing it does not declare. Regions, boxes and
counters: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import pandas as pd
import torch

from kimik3.kernels.contracts.addr import elem_offset  # the [b, r, c] offset the device computes

# the encoding contract lives beside the device code that reads it
from kimik3.kernels.contracts.isa import (
    BUFFER_WORDS,
    BW_D0,
    BW_D1,
    BW_D2,
    BW_DTYPE,
    BW_KIND,
    BW_NAME_LEN,
    BW_NAME_OFF,
    CHUNK_BYTES,
    COUNTER_WORDS,
    CTA_THREADS,
    CTL_WORDS,
    CW_NAME_LEN,
    CW_NAME_OFF,
    CW_SOURCES,
    CW_TOTAL,
    DTYPE_CODES,
    ERR_BAD_PROGRAM,
    ERR_WATCHDOG,
    ERROR_WORDS,
    EXPERT_FORMATS,
    FFN_LATENT_NORM,
    FFN_MLP,
    FFN_ROUTED,
    H_BATCH,
    H_C,
    H_EXPERT_FORMAT,
    H_HEADER_WORDS,
    H_INSTR_WORDS,
    H_LAYERS,
    H_MAGIC,
    H_MAX_OPERANDS,
    H_MAX_SEQ,
    H_MAX_WAITS,
    H_N,
    H_NB,
    H_NSTR,
    H_OFF_BUF,
    H_OFF_CBASE,
    H_OFF_CTR,
    H_OFF_INS,
    H_OFF_Q,
    H_OFF_STR,
    H_POLICY,
    H_Q,
    H_RANK,
    H_S,
    H_TOTAL,
    H_VERSION,
    H_WORLD,
    HEADER_WORDS,
    INSTR_WORDS,
    MAGIC,
    MAX_OPERANDS,
    MAX_WAITS,
    MXFP4_OPERANDS,
    OPERAND_WORDS,
    OW_BOX,
    OW_BUF,
    OW_MODE,
    POLICIES,
    STAGE_BUFFERS,
    STAGE_BYTES,
    STAGE_SCRATCH_OPS,
    VERSION,
    W_AMOUNT,
    W_ARGS,
    W_LAYER,
    W_NEXT_BUF,
    W_NEXT_CHUNKS,
    W_NEXT_ELEM_HI,
    W_NEXT_ELEM_LO,
    W_NOPS,
    W_NWAITS,
    W_OP,
    W_OPS,
    W_PEER_HI,
    W_PEER_LO,
    W_QPOS,
    W_SIGNAL,
    W_SM,
    W_STAGE_CHUNKS,
    W_STAGE_OP,
    W_STAGE_ROWS,
    W_WAITS,
    Kind,
    Mode,
    NormRole,
    Op,
    Site,
)
from kimik3.kernels.contracts.peers import MAX_WORLD, counter_bases

__all__ = [
    "Op",
    "Kind",
    "Mode",
    "NormRole",
    "Site",
    "BufferSpec",
    "Operand",
    "Instruction",
    "Counter",
    "Program",
    "NO_STAGE",
    "stage_choice",
    "stage_descriptor",
    "assign_stages",
    "encode_program",
    "decode_program",
    "instruction_set_table",
    "encoding_table",
    "MAX_WAITS",
    "MAX_OPERANDS",
    "INSTR_WORDS",
    "MAGIC",
    "VERSION",
    "FFN_ROUTED",
    "FFN_MLP",
    "FFN_LATENT_NORM",
    "EXPERT_FORMATS",
    "MXFP4_OPERANDS",
    "ERROR_WORDS",
    "CTL_WORDS",
    "ERR_WATCHDOG",
    "ERR_BAD_PROGRAM",
    "CTA_THREADS",
    "STAGE_BYTES",
    "STAGE_BUFFERS",
    "CHUNK_BYTES",
]

# The opcodes, modes, kinds, word offsets and dtype codes are defined once, in ``kernels/contracts/isa.py`` (imported
# above and re-exported): the persistent kernel reads the same file, so the two sides cannot drift apart.
_DTYPES = {getattr(torch, name): code for name, code in DTYPE_CODES.items()}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}


def _dtype_code(dt: torch.dtype) -> int:
    try:
        return _DTYPES[dt]
    except KeyError:
        raise ValueError(f"buffer dtype {dt} has no encoding (known: {list(_DTYPES)})") from None


# ---------------------------------------------------------------------------------------------------- containers


@dataclass(frozen=True)
class BufferSpec:
    """A named global-memory buffer, seen as a 3-D array ``shape``. A rank program's weight that the rank holds a
    share of (:func:`kimik3.megakernel.layout.localize`) also says of what: ``whole``, the model's shape, and
    ``spans``, per axis the whole ranges the share concatenates (empty: the whole axis)."""

    name: str
    kind: Kind
    shape: tuple[int, int, int]
    dtype: torch.dtype
    whole: tuple[int, int, int] | None = field(default=None, compare=False)
    spans: tuple[tuple[tuple[int, int], ...], ...] = field(default=(), compare=False)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Operand:
    """One declared access: ``mode`` (a :class:`Mode` combination, stored as a plain int) on the box
    ``[b0:b1, r0:r1, c0:c1]`` of buffer number ``buf``."""

    buf: int
    mode: int
    box: tuple[int, int, int, int, int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", int(self.mode))  # plain ints: enum flag arithmetic is slow in hot loops

    @property
    def reads(self) -> bool:
        return bool(self.mode & 1)

    @property
    def writes(self) -> bool:
        return bool(self.mode & 2)

    @property
    def prefetch(self) -> bool:
        return bool(self.mode & 4)

    @property
    def numel(self) -> int:
        b0, b1, r0, r1, c0, c1 = self.box
        return (b1 - b0) * (r1 - r0) * (c1 - c0)

    def overlaps(self, other: Operand) -> bool:
        a, b = self.box, other.box
        return self.buf == other.buf and all(a[2 * i] < b[2 * i + 1] and b[2 * i] < a[2 * i + 1] for i in range(3))

    def slices(self) -> tuple[slice, slice, slice]:
        b0, b1, r0, r1, c0, c1 = self.box
        return slice(b0, b1), slice(r0, r1), slice(c0, c1)


@dataclass(frozen=True)
class Instruction:
    """One unit of work. ``waits`` are (counter, per-step target) pairs; ``signal`` is the counter it adds
    ``amount`` to after all its writes are complete (-1: signals nothing). ``sm``/``qpos``: its place in the
    per-SM queues.

    ``stage`` = (operand j, rows, 16-byte chunks): the leading whole rows of operand ``j`` that sit in this
    instruction's shared-memory stage (words ``W_STAGE_*``); ``next_stage`` = (buffer, element offset, chunks):
    what the device copies, while this instruction starts, into the stage of the next instruction of the same
    queue (words ``W_NEXT_*``). Both :data:`NO_STAGE` unless :func:`assign_stages` filled them. ``peers`` = [lo,
    hi): the ranks its PUSH operands are written on and its signal is added on (words ``W_PEER_*``; (0, 0):
    local only)."""

    op: Op
    layer: int
    args: tuple[int, int, int, int] = (0, 0, 0, 0)
    operands: tuple[Operand, ...] = ()
    waits: tuple[tuple[int, int], ...] = ()
    signal: int = -1
    amount: int = 0
    sm: int = -1
    qpos: int = -1
    stage: tuple[int, int, int] = (-1, 0, 0)
    next_stage: tuple[int, int, int] = (-1, 0, 0)
    peers: tuple[int, int] = (0, 0)

    def label(self) -> str:
        """Short human-readable description, e.g. ``KDA_STEP L2 h0:2``."""
        a = self.args
        extra = ""
        if self.op in (Op.MLA_Q, Op.MLA_REDUCE):
            extra = f" h{a[0]}:{a[1]}"
        elif self.op == Op.KDA_STEP:
            extra = f" h{a[0]}:{a[1]} b{a[2]}:{a[3]}"
        elif self.op == Op.MLA_PARTIAL:
            extra = f" h{a[0]}:{a[1]} split{a[2]} b{a[3]}:"
        elif self.op in (Op.NORM_PROJ, Op.MLP_GATE_UP):
            extra = f" {NormRole(a[1]).name.lower()} r{a[2]}:{a[3]}"
        elif self.op in (Op.ATTN_RES_MIX, Op.ALLREDUCE_MIX):
            extra = f" {Site(a[0]).name.lower()} K={a[1]} b{a[2]}:{a[3]}"
        elif self.op in (Op.O_PROJ_RESIDUAL, Op.FFN_OUT):
            extra = f" c{a[2]}:{a[3]}"
        elif self.op == Op.EXPERT_GATE_UP:
            extra = f" s{a[0]}:{a[1]} r{a[2]}:{a[3]}"
        elif self.op in (Op.EXPERT_DOWN, Op.LM_HEAD):
            extra = f" r{a[2]}:{a[3]}"
        elif self.op == Op.EMBED:
            extra = f" b{a[2]}:{a[3]}"
        return f"{self.op.name} L{self.layer}{extra}"


@dataclass(frozen=True)
class Counter:
    name: str
    total: int  # sum of the amounts signalled to it in one step (per source rank, for a cross-rank counter)
    sources: int = 0  # 0: a local counter; n: one word per source rank 0..n-1 (kernels/contracts/peers.py)


@dataclass(eq=False)
class Program:
    """A complete decode-step program: buffers, instructions in *sequential* order (the order in which running
    them one by one is the reference computation — the hazard checker's notion of "the write that produces a
    read"), per-SM queues of instruction ids, and counters."""

    buffers: list[BufferSpec]
    instructions: list[Instruction]
    queues: list[list[int]]
    counters: list[Counter]
    batch: int
    max_seq_len: int
    num_layers: int
    policy: str = "custom"
    expert_format: str = "dense"  # how the routed-expert weights are stored (EXPERT_FORMATS)
    rank: int = 0  # this program's rank in a deployment of ``world`` ranks (world 1: a single-GPU program)
    world: int = 1
    costs: pd.DataFrame | None = field(default=None, repr=False)  # not serialised

    def __post_init__(self) -> None:
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert_format {self.expert_format!r}; known: {', '.join(EXPERT_FORMATS)}")
        if not 1 <= self.world <= MAX_WORLD or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of world {self.world}: need 1 <= world <= {MAX_WORLD} and "
                             "0 <= rank < world")

    @property
    def num_sms(self) -> int:
        return len(self.queues)

    def buffer_id(self, name: str) -> int:
        for i, b in enumerate(self.buffers):
            if b.name == name:
                return i
        raise KeyError(f"no buffer named {name!r}")

    def tensor(self) -> torch.Tensor:
        return encode_program(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        return (self.buffers, self.instructions, self.queues, self.counters, self.batch, self.max_seq_len,
                self.num_layers, self.policy, self.expert_format, self.rank, self.world) == (
                    other.buffers, other.instructions, other.queues, other.counters, other.batch, other.max_seq_len,
                    other.num_layers, other.policy, other.expert_format, other.rank, other.world)

    def __repr__(self) -> str:
        return (f"Program({len(self.instructions)} instructions on {self.num_sms} SMs, {len(self.counters)} counters,"
                f" {len(self.buffers)} buffers, batch {self.batch}, policy {self.policy}"
                + (f", {self.expert_format} experts" if self.expert_format != "dense" else "")
                + (f", rank {self.rank} of {self.world}" if self.world > 1 else "") + ")")

    def table(self) -> pd.DataFrame:
        """One row per instruction: id, SM, queue position, opcode, layer, label, waits, signal."""
        rows = []
        for i, ins in enumerate(self.instructions):
            rows.append({"id": i, "sm": ins.sm, "qpos": ins.qpos, "op": ins.op.name, "layer": ins.layer,
                         "label": ins.label(),
                         "waits": ", ".join(f"{self.counters[c].name}>={t}" for c, t in ins.waits),
                         "signal": self.counters[ins.signal].name if ins.signal >= 0 else "",
                         "reads": ", ".join(self.describe_operand(o) for o in ins.operands if o.reads),
                         "writes": ", ".join(self.describe_operand(o) for o in ins.operands if o.writes),
                         "staged": self.describe_stage(ins)})
        return pd.DataFrame(rows).set_index("id")

    def describe_stage(self, ins: Instruction) -> str:
        """``name rows r0:r0+n`` of the staged operand, or ``""``."""
        j, n, _ = ins.stage
        if not 0 <= j < len(ins.operands):
            return ""
        o = ins.operands[j]
        return f"{self.buffers[o.buf].name} rows {o.box[2]}:{o.box[2] + n}"

    def describe_operand(self, o: Operand) -> str:
        b0, b1, r0, r1, c0, c1 = o.box
        spec = self.buffers[o.buf]
        tag = "*" if o.prefetch else ""
        return f"{tag}{spec.name}[{b0}:{b1},{r0}:{r1},{c0}:{c1}]"


# ---------------------------------------------------------------------------------------------------- the stage

NO_STAGE = (-1, 0, 0)  # Instruction.stage / next_stage: nothing staged


def stage_choice(ins: Instruction, buffers: list[BufferSpec]) -> tuple[int, int, int]:
    """The stage of one instruction, ``(operand j, rows, 16-byte chunks)`` or :data:`NO_STAGE`: the largest
    row-contiguous bf16 static weight it declares PREFETCH (one ``D0`` slice, full width, ``d2 % 8 == 0``), whole
    rows from its box's ``r0`` up to ``STAGE_BYTES``. EMBED stages nothing: its table rows are the token ids.

    Why on the host: the device then copies the rows with no choice loop, and — because the choice is written into
    the *previous* instruction's words too (:func:`assign_stages`) — before it has waited for anything."""
    if ins.op == Op.EMBED or ins.op in STAGE_SCRATCH_OPS:
        return NO_STAGE
    best, best_el = -1, 0
    for j, o in enumerate(ins.operands):
        spec = buffers[o.buf]
        b0, b1, r0, r1, c0, c1 = o.box
        d2 = spec.shape[2]
        el = (r1 - r0) * d2
        if (o.prefetch and o.reads and not o.writes and spec.kind == Kind.WEIGHT and spec.dtype == torch.bfloat16
                and b1 - b0 == 1 and c0 == 0 and c1 == d2 and d2 % 8 == 0 and el > best_el):
            best, best_el = j, el
    if best < 0:
        return NO_STAGE
    d2 = buffers[ins.operands[best].buf].shape[2]
    rows = min(best_el // d2, STAGE_BYTES // (2 * d2))
    if rows < 1:  # a single row wider than the stage: stream it from global memory instead
        return NO_STAGE
    return best, rows, rows * d2 * 2 // CHUNK_BYTES


def stage_descriptor(ins: Instruction, buffers: list[BufferSpec]) -> tuple[int, int, int]:
    """``(buffer, element offset, chunks)`` of the rows ``ins.stage`` names — what the previous instruction of
    the queue puts in its ``W_NEXT_*`` words — or :data:`NO_STAGE`."""
    j, _, chunks = ins.stage
    if j < 0:
        return NO_STAGE
    o = ins.operands[j]
    _, d1, d2 = buffers[o.buf].shape
    return o.buf, elem_offset(d1, d2, o.box[0], o.box[2], o.box[4]), chunks  # its first element, as the device's


def assign_stages(p: Program) -> Program:
    """A copy of ``p`` whose instructions carry their stage (:func:`stage_choice`) and, per queue position, the
    stage of the next instruction of the same queue as ``next_stage`` (the last of a queue: :data:`NO_STAGE`).

    The one place both are decided: the scheduler calls it once the queues are final. A change of queues or
    operands afterwards must call it again (the hazard checker reports stale descriptors)."""
    bad = [v for q in p.queues for v in q if not 0 <= v < len(p.instructions)]
    if bad:
        raise ValueError(f"assign_stages: the queues hold instruction ids {bad[:5]} outside the program's "
                         f"{len(p.instructions)}")
    staged = [replace(ins, stage=stage_choice(ins, p.buffers), next_stage=NO_STAGE) for ins in p.instructions]
    for q in p.queues:
        for a, b in zip(q, q[1:]):
            staged[a] = replace(staged[a], next_stage=stage_descriptor(staged[b], p.buffers))
    out = Program(p.buffers, staged, [list(q) for q in p.queues], list(p.counters), p.batch, p.max_seq_len,
                  p.num_layers, p.policy, p.expert_format, p.rank, p.world)
    out.costs = p.costs
    return out


def _pack_strings(strings: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
    blob = bytearray()
    where = []
    for s in strings:
        raw = s.encode()
        where.append((len(blob), len(raw)))
        blob += raw
    blob += b"\0" * (-len(blob) % 4)
    words = torch.frombuffer(blob, dtype=torch.int32).tolist() if blob else []
    return words, where


def encode_program(p: Program) -> torch.Tensor:
    """The fixed-width int32 encoding (layout: :func:`encoding_table`)."""
    N, S, C, NB = len(p.instructions), p.num_sms, len(p.counters), len(p.buffers)
    Q = max((len(q) for q in p.queues), default=0)
    words, where = _pack_strings([b.name for b in p.buffers] + [c.name for c in p.counters])
    off_buf = HEADER_WORDS
    off_ctr = off_buf + NB * BUFFER_WORDS
    off_ins = off_ctr + C * COUNTER_WORDS
    off_q = off_ins + N * INSTR_WORDS
    off_str = off_q + S * Q
    ranks = p.world > 1
    off_cbase = off_str + len(words) if ranks else 0  # a rank program's counter-word table (isa.H_OFF_CBASE)
    total = off_str + len(words) + (C if ranks else 0)
    t = torch.zeros(total, dtype=torch.int32)
    hdr = [0] * HEADER_WORDS
    hdr[H_MAGIC], hdr[H_VERSION], hdr[H_HEADER_WORDS], hdr[H_N], hdr[H_INSTR_WORDS] = (MAGIC, VERSION, HEADER_WORDS,
                                                                                      N, INSTR_WORDS)
    hdr[H_S], hdr[H_Q], hdr[H_C], hdr[H_NB] = S, Q, C, NB
    hdr[H_BATCH], hdr[H_MAX_SEQ], hdr[H_LAYERS], hdr[H_POLICY] = (p.batch, p.max_seq_len, p.num_layers,
                                                                  POLICIES.index(p.policy))
    hdr[H_OFF_BUF], hdr[H_OFF_CTR], hdr[H_OFF_INS], hdr[H_OFF_Q], hdr[H_OFF_STR] = off_buf, off_ctr, off_ins, off_q, \
        off_str
    hdr[H_NSTR], hdr[H_TOTAL], hdr[H_MAX_WAITS], hdr[H_MAX_OPERANDS] = len(words), total, MAX_WAITS, MAX_OPERANDS
    hdr[H_EXPERT_FORMAT] = EXPERT_FORMATS.index(p.expert_format)
    hdr[H_RANK], hdr[H_WORLD] = (p.rank, p.world) if p.world > 1 else (0, 0)
    hdr[H_OFF_CBASE] = off_cbase
    t[:HEADER_WORDS] = torch.tensor(hdr, dtype=torch.int64).to(torch.int32)
    if NB:
        bt = torch.zeros(NB, BUFFER_WORDS, dtype=torch.int32)
        for i, b in enumerate(p.buffers):
            row = [0] * BUFFER_WORDS
            row[BW_KIND], row[BW_DTYPE] = int(b.kind), _dtype_code(b.dtype)
            row[BW_D0], row[BW_D1], row[BW_D2] = b.shape
            row[BW_NAME_OFF], row[BW_NAME_LEN] = where[i]
            bt[i] = torch.tensor(row)
        t[off_buf:off_ctr] = bt.flatten()
    if C:
        ct = torch.zeros(C, COUNTER_WORDS, dtype=torch.int32)
        for i, c in enumerate(p.counters):
            row = [0] * COUNTER_WORDS
            row[CW_TOTAL], row[CW_SOURCES] = c.total, c.sources
            row[CW_NAME_OFF], row[CW_NAME_LEN] = where[NB + i]
            ct[i] = torch.tensor(row)
        t[off_ctr:off_ins] = ct.flatten()
    rows = []
    for i, ins in enumerate(p.instructions):
        if len(ins.waits) > MAX_WAITS:
            raise ValueError(f"instruction {i} ({ins.label()}) has {len(ins.waits)} waits > MAX_WAITS={MAX_WAITS}")
        if len(ins.operands) > MAX_OPERANDS:
            raise ValueError(f"instruction {i} ({ins.label()}) has {len(ins.operands)} operands > {MAX_OPERANDS}")
        r = [0] * INSTR_WORDS
        r[W_OP], r[W_LAYER], r[W_SM], r[W_QPOS] = int(ins.op), ins.layer, ins.sm, ins.qpos
        r[W_ARGS : W_ARGS + 4] = list(ins.args)
        r[W_SIGNAL], r[W_AMOUNT], r[W_NWAITS] = ins.signal, ins.amount, len(ins.waits)
        for j, (c, tgt) in enumerate(ins.waits):
            r[W_WAITS + 2 * j], r[W_WAITS + 2 * j + 1] = c, tgt
        r[W_NOPS] = len(ins.operands)
        for j, o in enumerate(ins.operands):
            base = W_OPS + OPERAND_WORDS * j
            r[base + OW_BUF], r[base + OW_MODE] = o.buf, int(o.mode)
            r[base + OW_BOX : base + OW_BOX + 6] = o.box
        if ins.op in STAGE_SCRATCH_OPS and ins.stage != NO_STAGE:
            raise ValueError(f"instruction {i} ({ins.label()}): {ins.op.name} uses its stage buffer as scratch, so "
                             f"it cannot stage operand rows (stage {ins.stage})")
        r[W_STAGE_OP], r[W_STAGE_ROWS], r[W_STAGE_CHUNKS] = ins.stage
        nbuf, elem, nch = ins.next_stage
        if elem < 0 or elem >= 1 << 63:
            raise ValueError(f"instruction {i} ({ins.label()}): next-stage element offset {elem} outside int64")
        lo = elem & 0xFFFFFFFF
        r[W_NEXT_BUF], r[W_NEXT_ELEM_LO], r[W_NEXT_ELEM_HI], r[W_NEXT_CHUNKS] = (
            nbuf, lo - (1 << 32) if lo >= 1 << 31 else lo, elem >> 32, nch)
        r[W_PEER_LO], r[W_PEER_HI] = ins.peers
        rows.append(r)
    if N:
        t[off_ins:off_q] = torch.tensor(rows, dtype=torch.int32).flatten()
    if S * Q:
        qt = torch.full((S, Q), -1, dtype=torch.int32)
        for s, q in enumerate(p.queues):
            qt[s, : len(q)] = torch.tensor(q, dtype=torch.int32)
        t[off_q:off_str] = qt.flatten()
    if words:
        t[off_str:off_str + len(words)] = torch.tensor(words, dtype=torch.int32)
    if ranks and C:
        t[off_cbase:] = torch.tensor(counter_bases([c.sources for c in p.counters]), dtype=torch.int32)
    return t


def decode_program(t: torch.Tensor) -> Program:
    """Inverse of :func:`encode_program`; validates the header."""
    if t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"a program is a 1-D int32 tensor, got {t.dtype} {list(t.shape)}")
    h = t[:HEADER_WORDS].tolist()
    if h[H_MAGIC] != MAGIC or h[H_VERSION] != VERSION:
        raise ValueError(f"not a megakernel program (magic {h[H_MAGIC]:#x}, version {h[H_VERSION]})")
    N, W, S, Q, C, NB = h[H_N], h[H_INSTR_WORDS], h[H_S], h[H_Q], h[H_C], h[H_NB]
    batch, max_len, layers, policy = h[H_BATCH], h[H_MAX_SEQ], h[H_LAYERS], POLICIES[h[H_POLICY]]
    if not 0 <= h[H_EXPERT_FORMAT] < len(EXPERT_FORMATS):
        raise ValueError(f"program header word {H_EXPERT_FORMAT} (expert format) is {h[H_EXPERT_FORMAT]}, not an "
                         f"index into {EXPERT_FORMATS}")
    off_buf, off_ctr, off_ins, off_q, off_str = h[H_OFF_BUF], h[H_OFF_CTR], h[H_OFF_INS], h[H_OFF_Q], h[H_OFF_STR]
    nstr, total = h[H_NSTR], h[H_TOTAL]
    if W != INSTR_WORDS or total != t.numel():
        raise ValueError(f"program width {W} / length {total} do not match (expected {INSTR_WORDS} / {t.numel()})")
    blob = t[off_str : off_str + nstr].numpy().tobytes()

    def string(o: int, n: int) -> str:
        return blob[o : o + n].decode()

    bt = t[off_buf:off_ctr].view(NB, BUFFER_WORDS).tolist() if NB else []
    unknown = sorted({r[BW_DTYPE] for r in bt} - set(_DTYPE_OF))
    if unknown:
        raise ValueError(f"program buffer table holds dtype codes {unknown} outside {DTYPE_CODES}")
    buffers = [BufferSpec(string(r[BW_NAME_OFF], r[BW_NAME_LEN]), Kind(r[BW_KIND]), (r[BW_D0], r[BW_D1], r[BW_D2]),
                          _DTYPE_OF[r[BW_DTYPE]]) for r in bt]
    ct = t[off_ctr:off_ins].view(C, COUNTER_WORDS).tolist() if C else []
    counters = [Counter(string(r[CW_NAME_OFF], r[CW_NAME_LEN]), r[CW_TOTAL], r[CW_SOURCES]) for r in ct]
    instructions = []
    for r in t[off_ins:off_q].view(N, INSTR_WORDS).tolist() if N else []:
        waits = tuple((r[W_WAITS + 2 * j], r[W_WAITS + 2 * j + 1]) for j in range(r[W_NWAITS]))
        ops = []
        for j in range(r[W_NOPS]):
            base = W_OPS + OPERAND_WORDS * j
            ops.append(Operand(r[base + OW_BUF], r[base + OW_MODE], tuple(r[base + OW_BOX : base + OW_BOX + 6])))
        stage = (r[W_STAGE_OP], r[W_STAGE_ROWS], r[W_STAGE_CHUNKS])
        nxt = (r[W_NEXT_BUF], (r[W_NEXT_ELEM_HI] << 32) | (r[W_NEXT_ELEM_LO] & 0xFFFFFFFF), r[W_NEXT_CHUNKS])
        instructions.append(Instruction(Op(r[W_OP]), r[W_LAYER], tuple(r[W_ARGS : W_ARGS + 4]), tuple(ops), waits,
                                        r[W_SIGNAL], r[W_AMOUNT], r[W_SM], r[W_QPOS], stage, nxt,
                                        (r[W_PEER_LO], r[W_PEER_HI])))
    queues = [[i for i in row if i >= 0] for row in t[off_q:off_str].view(S, Q).tolist()] if S * Q else \
        [[] for _ in range(S)]
    world = h[H_WORLD] or 1
    if world > 1:  # the device indexes counter words through this table: it must be the protocol's layout
        cb = t[h[H_OFF_CBASE]:h[H_OFF_CBASE] + C].tolist() if h[H_OFF_CBASE] else []
        if cb != counter_bases([c.sources for c in counters]):
            raise ValueError("rank program's counter-word table (header word H_OFF_CBASE) is not the counters' "
                             "layout (kernels/contracts/peers.py counter_bases)")
    return Program(buffers, instructions, queues, counters, batch, max_len, layers, policy,
                   EXPERT_FORMATS[h[H_EXPERT_FORMAT]], h[H_RANK], world)


# ---------------------------------------------------------------------------------------------------- docs

_OPERANDS = {
    Op.EMBED: "ids R | embed_tokens* | stream[:,0] W",
    Op.ATTN_RES_MIX: "stream[:,0:K] R | res_norm* | res_proj* | mix W",
    Op.NORM_PROJ: "x R (mix or stream[:,0]) | norm weight* | weight rows* | out cols W",
    Op.MLP_GATE_UP: "x R | norm weight* | gate rows* | up rows* | hidden cols W",
    Op.KDA_STEP: "packed q,k,v,g,b of its heads R | f_a R | conv history RW | S RW | f_b rows* | dt_bias* | "
                 "A_log* | conv weights* | o_norm* | attn_o cols W",
    Op.MLA_Q: "q_a cols R | q_a_layernorm* | q_b rows* | W_UK rows* | mla_q heads W",
    Op.MLA_KV_APPEND: "kv_a cols R | kv_a_layernorm* | pos R | cache latent W | cache k_r W",
    Op.MLA_PARTIAL: "mla_q heads R | pos R | cache latent rows R | cache k_r rows R | partial (heads, split) W",
    Op.MLA_REDUCE: "partials heads R | W_UV rows* | gate cols R | attn_o cols W",
    Op.O_PROJ_RESIDUAL: "attn_o R | o_proj rows* | stream[:, j] cols W or RW",
    Op.ROUTER: "router logits R | correction bias* | slot experts W | slot weights W | slot use W",
    Op.EXPERT_GATE_UP: "latent x R | slot experts R | slot use R | w1 rows* | w3 rows* | expert hidden W; MXFP4 "
                       "experts: w1 / w3 rows are uint8 codes, then w1 scales* | w3 scales*",
    Op.EXPERT_DOWN: "expert hidden R | slot experts R | slot use R | slot weights R | w2 rows* | latent sum cols W; "
                    "MXFP4 experts: w2 rows are uint8 codes, then w2 scales*",
    Op.FFN_OUT: "[latent sum R | latent norm* | up rows*] (flag 1, norm flag 4) | [mlp hidden R | down rows*] "
                "(flag 2) | stream[:, j] cols RW (a rank: its partial, pushed)",
    Op.LM_HEAD: "mix R | final norm* | lm_head rows* | logits cols W | tile max W | tile argmax W",
    Op.ARGMAX: "tile max R | tile argmax R | next token W",
    Op.ALLREDUCE_MIX: "partial-sum mailbox (slot, every source) R | stream[:,0:K] R, stream[:,K-1] W (start) or RW "
                      "| res_norm* | res_proj* | mix W",
    Op.ARGMAX_ALL: "tile max mailbox (every source) R | tile argmax mailbox R | next token W",
    Op.MOE_COMBINE: "latent partial mailbox (every source, fp32) R | latent norm* (norm flag) | latent W",
}
_TILES = {
    Op.EMBED: "batch rows",
    Op.ATTN_RES_MIX: "batch rows (one site)",
    Op.NORM_PROJ: "output rows of one weight",
    Op.MLP_GATE_UP: "hidden channels",
    Op.KDA_STEP: "heads x batch rows",
    Op.MLA_Q: "heads",
    Op.MLA_KV_APPEND: "one per layer",
    Op.MLA_PARTIAL: "context split x heads x batch rows",
    Op.MLA_REDUCE: "heads",
    Op.O_PROJ_RESIDUAL: "hidden columns",
    Op.ROUTER: "one per layer",
    Op.EXPERT_GATE_UP: "expert slots x hidden channels",
    Op.EXPERT_DOWN: "latent rows",
    Op.FFN_OUT: "hidden columns",
    Op.LM_HEAD: "vocabulary rows",
    Op.ARGMAX: "one per step",
    Op.ALLREDUCE_MIX: "batch rows (one site)",
    Op.ARGMAX_ALL: "one per step",
    Op.MOE_COMBINE: "batch rows",
}
_DOC_ORDER = [op for op in Op if op != Op.NOP]


def instruction_set_table() -> pd.DataFrame:
    """The instruction set as a table (opcode, what it computes, how it is tiled, its operands; ``*`` marks a
    static weight that may be prefetched before the waits)."""
    doc = {}  # the comment after each opcode in the Op enum is its one-line description
    for line in inspect.getsource(Op).splitlines():
        s = line.strip()
        if "=" in s and "#" in s:
            doc[s.split("=")[0].strip()] = s.split("#", 1)[1].strip()
    rows = [{"opcode": int(op), "name": op.name, "computes": doc.get(op.name, ""), "tiled over": _TILES[op],
             "operands": _OPERANDS[op]} for op in _DOC_ORDER]
    return pd.DataFrame(rows).set_index("opcode")


def encoding_table() -> pd.DataFrame:
    """The int32 layout, section by section and word by word (rendered from the constants of
    ``kernels/contracts/isa.py``)."""
    kinds = ", ".join(f"{int(k)} {k.name.lower()}" for k in Kind)
    dtypes = ", ".join(f"{c} {n}" for n, c in DTYPE_CODES.items())
    ops_end = W_OPS + MAX_OPERANDS * OPERAND_WORDS
    rows = [
        ("header", f"0..{HEADER_WORDS - 1}", f"magic 0x{MAGIC:08X}, version, header words, #instructions N, "
                                             f"words/instruction ({INSTR_WORDS}), #SMs S, max queue length Q, "
                                             "#counters C, #buffers NB, batch, max_seq_len, layers, policy, section "
                                             "offsets (buffers, counters, instructions, queues, strings), string "
                                             "words, total words, MAX_WAITS, MAX_OPERANDS, expert format (index "
                                             f"into {EXPERT_FORMATS}), rank, world (0: one GPU); the rest zero"),
        ("buffers", f"NB x {BUFFER_WORDS}", f"kind ({kinds}), dtype ({dtypes}), d0, d1, d2, name offset, name "
                                            "length, 0"),
        ("counters", f"C x {COUNTER_WORDS}", "per-step total (per source), name offset, name length, sources (0: "
                                             "local, one word; n: one word per source rank)"),
        ("instructions", f"N x {INSTR_WORDS}", "row i = instruction i in sequential order (see below)"),
        ("queues", "S x Q", "instruction ids per SM in execution order, -1 padded"),
        ("strings", "...", "UTF-8 names of buffers and counters, 4 bytes per word"),
        (f"instr word {W_OP}-{W_QPOS}", "", "opcode, layer, SM, queue position"),
        (f"instr word {W_ARGS}-{W_ARGS + 3}", "", "opcode arguments a0..a3 (heads, split, site, role, tile range, "
                                                  "flags)"),
        (f"instr word {W_SIGNAL}-{W_NWAITS}", "", "signal counter (-1 none), signal amount, number of waits"),
        (f"instr word {W_WAITS}-{W_NOPS - 1}", "", f"{MAX_WAITS} waits x (counter, per-step target): wait for "
                                                   "counter >= step*total + target"),
        (f"instr word {W_NOPS}", "", "number of operands"),
        (f"instr word {W_OPS}-{ops_end - 1}", "", f"{MAX_OPERANDS} operands x (buffer, mode 1 R / 2 W / 3 RW / +4 "
                                                  "prefetch / +8 push, b0, b1, r0, r1, c0, c1)"),
        (f"instr word {W_STAGE_OP}-{W_STAGE_CHUNKS}", "", "this instruction's stage: operand j (-1 none), whole "
                                                           f"rows from its box's r0, {CHUNK_BYTES}-byte chunks "
                                                           f"(at most {STAGE_BYTES} bytes)"),
        (f"instr word {W_NEXT_BUF}-{W_NEXT_CHUNKS}", "", "the NEXT instruction of this queue's stage, copied while "
                                                         "this one starts (before its waits; static weights only): "
                                                         "buffer (-1 none), element offset low word (unsigned "
                                                         "bits), high word, chunks; stage buffer = queue position "
                                                         f"mod {STAGE_BUFFERS}"),
        (f"instr word {W_PEER_LO}-{W_PEER_HI}", "", "peer range [lo, hi): ranks its PUSH operands are written on "
                                                    "and its signal is added on (0, 0: local)"),
        (f"instr word {W_PEER_HI + 1}-{INSTR_WORDS - 1}", "", "reserved, zero"),
    ]
    return pd.DataFrame(rows, columns=["section", "size", "contents"])
