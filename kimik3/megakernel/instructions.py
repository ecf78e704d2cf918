"""The megakernel's instruction set, its operand declarations and the int32 encoding both interpreters read.

Why an instruction set at all: a persistent megakernel launches one CTA per SM, once, and every CTA walks its own
queue of *instructions* — coarse units of work such as "RMSNorm + rows 256..511 of a projection" — instead of the
host launching one kernel per operation. Dependencies between instructions are not kernel boundaries any more but
*counters* in global memory: a producer adds to a counter when its writes are complete, a consumer spins until
the counter reaches a target. This module defines

* the opcodes (:class:`Op`) — 16 coarse instruction types that together compute one K3 decode step;
* the declarations every instruction carries (:class:`Operand`): which buffer, which element box, read or write,
  and whether it may be *prefetched* before the instruction's waits (only static weights may);
* the program container (:class:`Program`) and its fixed-width int32 encoding (:func:`encode_program`,
  :func:`decode_program`), which is what the CPU interpreter executes and what the CuTe DSL kernel will read.

Everything the hazard checker proves is proved from these declarations alone, so they must be complete: an
instruction touches nothing it does not declare (the CPU interpreter enforces this by handing each instruction
only the views of its declared boxes).

Regions. Every buffer is seen as a 3-D array ``[D0, D1, D2]`` — for activations, states and caches ``D0`` is the
batch; for 2-D weights ``[1, out, in]``; for stacked experts ``[E, rows, cols]``. An operand declares a box
``[b0:b1, r0:r1, c0:c1]`` of that view. Data-dependent accesses are declared as a superset (the MLA cache row a
new token lands in depends on its position, so the append declares every row; an expert tile reads "whichever
experts the router chose", declared as all experts). Routed-expert scratch buffers are declared in a *logical*
index space ``[batch, slot, ...]`` (slot = the s-th distinct expert chosen this step); a GPU kernel stores only the
used (row, slot) pairs, which is an injective packing, so boxes disjoint in the logical space stay disjoint in memory.

Counters are monotonic across decode steps and never reset: counter ``c`` receives ``total[c]`` per step, and a
wait "``c`` ≥ ``t``" in step ``s`` (0-based) means ``counter[c] ≥ s·total[c] + t``. One launch is one decode step,
so the launch boundary orders a step's accesses after the previous step's.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field

import pandas as pd
import torch

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
    "encode_program",
    "decode_program",
    "instruction_set_table",
    "encoding_table",
    "MAX_WAITS",
    "MAX_OPERANDS",
    "INSTR_WORDS",
    "MAGIC",
    "VERSION",
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


class Kind(enum.IntEnum):
    """What a buffer is; decides what the hazard checker allows."""

    INPUT = 1  # written by the host before the launch (token ids, positions); read-only inside a step
    WEIGHT = 2  # static for the whole run: the only kind that may be prefetched before a wait
    ACT = 3  # per-step scratch activations
    STATE = 4  # carried across steps (KDA state and conv history, MLA cache)
    OUTPUT = 5  # written inside the step, read by the host afterwards (logits, next token)


class Mode(enum.IntFlag):
    READ = 1
    WRITE = 2
    READ_WRITE = 3
    PREFETCH = 4  # with READ: the read may be issued before the instruction's waits are satisfied


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


# ---------------------------------------------------------------------------------------------------- encoding

MAGIC = 0x4B334D4B  # "K3MK"
VERSION = 1
HEADER_WORDS = 32
MAX_WAITS = 4
MAX_OPERANDS = 12
OPERAND_WORDS = 8  # buffer, mode, b0, b1, r0, r1, c0, c1
INSTR_WORDS = 128
BUFFER_WORDS = 8  # kind, dtype, d0, d1, d2, name offset, name length, 0
COUNTER_WORDS = 4  # total, name offset, name length, 0
# word offsets inside one instruction row
W_OP, W_LAYER, W_SM, W_QPOS = 0, 1, 2, 3
W_ARGS = 4  # 4 words
W_SIGNAL, W_AMOUNT, W_NWAITS = 8, 9, 10
W_WAITS = 11  # MAX_WAITS x (counter, target)
W_NOPS = W_WAITS + 2 * MAX_WAITS  # 19
W_OPS = W_NOPS + 1  # 20 .. 20 + 12*8 = 116; words 116..127 reserved (zero)
assert W_OPS + MAX_OPERANDS * OPERAND_WORDS <= INSTR_WORDS

POLICIES = ("round_robin", "critical_path", "custom")

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int64: 3, torch.int32: 4, torch.bool: 5,
           torch.float64: 6}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}


def _dtype_code(dt: torch.dtype) -> int:
    try:
        return _DTYPES[dt]
    except KeyError:
        raise ValueError(f"buffer dtype {dt} has no encoding (known: {list(_DTYPES)})") from None


# ---------------------------------------------------------------------------------------------------- containers


@dataclass(frozen=True)
class BufferSpec:
    """A named global-memory buffer, seen as a 3-D array ``shape``."""

    name: str
    kind: Kind
    shape: tuple[int, int, int]
    dtype: torch.dtype

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
    per-SM queues."""

    op: Op
    layer: int
    args: tuple[int, int, int, int] = (0, 0, 0, 0)
    operands: tuple[Operand, ...] = ()
    waits: tuple[tuple[int, int], ...] = ()
    signal: int = -1
    amount: int = 0
    sm: int = -1
    qpos: int = -1

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
        elif self.op == Op.ATTN_RES_MIX:
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
    total: int  # sum of the amounts signalled to it in one step


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
    costs: pd.DataFrame | None = field(default=None, repr=False)  # not serialised

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
                self.num_layers, self.policy) == (other.buffers, other.instructions, other.queues, other.counters,
                                                  other.batch, other.max_seq_len, other.num_layers, other.policy)

    def __repr__(self) -> str:
        return (f"Program({len(self.instructions)} instructions on {self.num_sms} SMs, {len(self.counters)} counters,"
                f" {len(self.buffers)} buffers, batch {self.batch}, policy {self.policy})")

    def table(self) -> pd.DataFrame:
        """One row per instruction: id, SM, queue position, opcode, layer, label, waits, signal."""
        rows = []
        for i, ins in enumerate(self.instructions):
            rows.append({"id": i, "sm": ins.sm, "qpos": ins.qpos, "op": ins.op.name, "layer": ins.layer,
                         "label": ins.label(),
                         "waits": ", ".join(f"{self.counters[c].name}>={t}" for c, t in ins.waits),
                         "signal": self.counters[ins.signal].name if ins.signal >= 0 else "",
                         "reads": ", ".join(self.describe_operand(o) for o in ins.operands if o.reads),
                         "writes": ", ".join(self.describe_operand(o) for o in ins.operands if o.writes)})
        return pd.DataFrame(rows).set_index("id")

    def describe_operand(self, o: Operand) -> str:
        b0, b1, r0, r1, c0, c1 = o.box
        spec = self.buffers[o.buf]
        tag = "*" if o.prefetch else ""
        return f"{tag}{spec.name}[{b0}:{b1},{r0}:{r1},{c0}:{c1}]"


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
    total = off_str + len(words)
    t = torch.zeros(total, dtype=torch.int32)
    hdr = [MAGIC, VERSION, HEADER_WORDS, N, INSTR_WORDS, S, Q, C, NB, p.batch, p.max_seq_len, p.num_layers,
           POLICIES.index(p.policy), off_buf, off_ctr, off_ins, off_q, off_str, len(words), total, MAX_WAITS,
           MAX_OPERANDS]
    t[: len(hdr)] = torch.tensor(hdr, dtype=torch.int64).to(torch.int32)
    if NB:
        bt = torch.zeros(NB, BUFFER_WORDS, dtype=torch.int32)
        for i, b in enumerate(p.buffers):
            bt[i] = torch.tensor([int(b.kind), _dtype_code(b.dtype), *b.shape, *where[i], 0])
        t[off_buf:off_ctr] = bt.flatten()
    if C:
        ct = torch.zeros(C, COUNTER_WORDS, dtype=torch.int32)
        for i, c in enumerate(p.counters):
            ct[i] = torch.tensor([c.total, *where[NB + i], 0])
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
            r[base : base + OPERAND_WORDS] = [o.buf, int(o.mode), *o.box]
        rows.append(r)
    if N:
        t[off_ins:off_q] = torch.tensor(rows, dtype=torch.int32).flatten()
    if S * Q:
        qt = torch.full((S, Q), -1, dtype=torch.int32)
        for s, q in enumerate(p.queues):
            qt[s, : len(q)] = torch.tensor(q, dtype=torch.int32)
        t[off_q:off_str] = qt.flatten()
    if words:
        t[off_str:] = torch.tensor(words, dtype=torch.int32)
    return t


def decode_program(t: torch.Tensor) -> Program:
    """Inverse of :func:`encode_program`; validates the header."""
    if t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"a program is a 1-D int32 tensor, got {t.dtype} {list(t.shape)}")
    h = t[:HEADER_WORDS].tolist()
    if h[0] != MAGIC or h[1] != VERSION:
        raise ValueError(f"not a megakernel program (magic {h[0]:#x}, version {h[1]})")
    N, W, S, Q, C, NB = h[3], h[4], h[5], h[6], h[7], h[8]
    batch, max_len, layers, policy = h[9], h[10], h[11], POLICIES[h[12]]
    off_buf, off_ctr, off_ins, off_q, off_str, nstr, total = h[13:20]
    if W != INSTR_WORDS or total != t.numel():
        raise ValueError(f"program width {W} / length {total} do not match (expected {INSTR_WORDS} / {t.numel()})")
    blob = t[off_str : off_str + nstr].numpy().tobytes()

    def string(o: int, n: int) -> str:
        return blob[o : o + n].decode()

    bt = t[off_buf:off_ctr].view(NB, BUFFER_WORDS).tolist() if NB else []
    buffers = [BufferSpec(string(r[5], r[6]), Kind(r[0]), (r[2], r[3], r[4]), _DTYPE_OF[r[1]]) for r in bt]
    ct = t[off_ctr:off_ins].view(C, COUNTER_WORDS).tolist() if C else []
    counters = [Counter(string(r[1], r[2]), r[0]) for r in ct]
    instructions = []
    for r in t[off_ins:off_q].view(N, INSTR_WORDS).tolist() if N else []:
        waits = tuple((r[W_WAITS + 2 * j], r[W_WAITS + 2 * j + 1]) for j in range(r[W_NWAITS]))
        ops = []
        for j in range(r[W_NOPS]):
            base = W_OPS + OPERAND_WORDS * j
            w = r[base : base + OPERAND_WORDS]
            ops.append(Operand(w[0], w[1], tuple(w[2:8])))
        instructions.append(Instruction(Op(r[W_OP]), r[W_LAYER], tuple(r[W_ARGS : W_ARGS + 4]), tuple(ops), waits,
                                        r[W_SIGNAL], r[W_AMOUNT], r[W_SM], r[W_QPOS]))
    queues = [[i for i in row if i >= 0] for row in t[off_q:off_str].view(S, Q).tolist()] if S * Q else \
        [[] for _ in range(S)]
    return Program(buffers, instructions, queues, counters, batch, max_len, layers, policy)


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
    Op.EXPERT_GATE_UP: "latent x R | slot experts R | slot use R | w1 rows* | w3 rows* | expert hidden W",
    Op.EXPERT_DOWN: "expert hidden R | slot experts R | slot use R | slot weights R | w2 rows* | latent sum cols W",
    Op.FFN_OUT: "[latent sum R | latent norm* | up rows*] (flag 1, norm flag 4) | [mlp hidden R | down rows*] "
                "(flag 2) | stream[:, j] cols RW",
    Op.LM_HEAD: "mix R | final norm* | lm_head rows* | logits cols W | tile max W | tile argmax W",
    Op.ARGMAX: "tile max R | tile argmax R | next token W",
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
    """The int32 layout, section by section and word by word."""
    rows = [
        ("header", "0..31", "magic 0x4B334D4B, version, header words, #instructions N, words/instruction (128), "
                            "#SMs S, max queue length Q, #counters C, #buffers NB, batch, max_seq_len, layers, "
                            "policy, section offsets (buffers, counters, instructions, queues, strings), string "
                            "words, total words, MAX_WAITS, MAX_OPERANDS"),
        ("buffers", "NB x 8", "kind (1 input, 2 weight, 3 act, 4 state, 5 output), dtype (0 f32, 1 bf16, 2 f16, "
                              "3 i64, 4 i32, 5 bool, 6 f64), d0, d1, d2, name offset, name length, 0"),
        ("counters", "C x 4", "per-step total, name offset, name length, 0"),
        ("instructions", "N x 128", "row i = instruction i in sequential order (see below)"),
        ("queues", "S x Q", "instruction ids per SM in execution order, -1 padded"),
        ("strings", "...", "UTF-8 names of buffers and counters, 4 bytes per word"),
        ("instr word 0-3", "", "opcode, layer, SM, queue position"),
        ("instr word 4-7", "", "opcode arguments a0..a3 (heads, split, site, role, tile range, flags)"),
        ("instr word 8-10", "", "signal counter (-1 none), signal amount, number of waits"),
        ("instr word 11-18", "", "4 waits x (counter, per-step target): wait for counter >= step*total + target"),
        ("instr word 19", "", "number of operands"),
        ("instr word 20-115", "", "12 operands x (buffer, mode 1 R / 2 W / 3 RW / +4 prefetch, b0, b1, r0, r1, c0, "
                                  "c1)"),
        ("instr word 116-127", "", "reserved, zero"),
    ]
    return pd.DataFrame(rows, columns=["section", "size", "contents"])
