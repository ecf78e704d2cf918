"""The persistent decode megakernel: one CTA per SM walks its queue of the int32 program, once per decode step.

Why one launch per step: a K3 decode step is thousands of small operations (a few µs each at batch 1). As separate
kernels each pays a launch, a drain of the GPU and a ramp-up; as one persistent kernel the only synchronisation is
what the data needs — counters in global memory — and an SM that waits for its inputs can already stream the
weights of its next instruction. The program (``kimik3.megakernel.instructions``: opcodes, operand boxes, waits,
signals, per-SM queues) is built once on the host by the scheduler; this kernel is its interpreter.

The loop, per CTA (``block_idx.x`` = queue number), per queue entry ``v``:

1. **fetch**: the 128-word instruction row goes to shared memory; per operand the buffer's base address (from the
   buffer table ``bufs``) and its dims (from the program's buffer section) are cached in smem;
2. **prefetch**: the largest row-contiguous bf16 *static weight* operand the instruction declares with the
   PREFETCH flag (the only kind the hazard checker allows before the waits) is copied, whole rows, up to
   ``STAGE_BYTES``, into the shared-memory stage with ``cp.async.cg`` (which also leaves it in L2) — issued
   *before* the waits, so the copy overlaps the spin;
3. **wait**: thread 0 spins on each wait ``counter[c] ≥ step·total[c] + target`` with ``ld.acquire.gpu`` and
   ``nanosleep`` back-off; a bounded-spin **watchdog** (``ctl[1]`` spins) then sets the error word (CAS 0 → 1,
   first CTA wins) with the instruction, counter, target and value seen, and the CTA leaves; a CTA that sees the
   error word set while spinning leaves too, so a broken program ends the launch instead of hanging it;
4. **execute**: ``bar.sync`` (broadcasts the acquire to the CTA), ``%globaltimer`` start stamp, dispatch on the
   opcode to the device function below;
5. **signal**: ``bar.sync`` (every thread's writes done), then thread 0 ``red.release.gpu.add`` on the
   instruction's counter (release is cumulative over the barrier), end stamp, and the row
   ``timings[v] = (start ns, end ns, %smid)`` that ``kimik3.megakernel.timeline.from_timings`` reads.

Counters are monotonic across launches (the host zeroes them once and passes the step number in ``ctl[0]``).
Every parameter is a statically laid-out tensor, i.e. one 8-byte pointer (guide §1.3), so the op can be exported
as a prebuilt kernel: program ``[PROG_WORDS] i32``, buffer table ``[MAX_BUFS] i64`` (device address per program
buffer), counters ``[MAX_CTRS] i32``, timings ``[MAX_INSTR, 3] i64``, error ``[8] i32``, control ``[8] i32``
(step, watchdog spins, sleep ns). Capacities are static shapes; the host pads.

The CTA is 384 threads (12 warps): 512 threads cap ptxas at 128 registers and the widest opcodes spilled there;
at 384 the cap is 168 and every preset x batch (micro, tiny, k3-shard x 1, 8, 64) compiles with 126-160 registers,
0 spills, 0 stack, ~100-112 KiB of dynamic shared memory (64 KiB of it the weight stage). Every opcode is one branch
of ``_dispatch``; values live across the dispatch are kept in shared memory (``s_run``, ``s_t0``) because ptxas
allocates registers for the widest branch and anything live across all of them counts against every one.

Opcodes (first version: simple, correct-by-construction device code; see ``OPCODE_NOTES`` for each one's
performance limits). Status: compiled for sm_90a / sm_100a on a machine without a GPU; **nothing here has run on a
GPU yet** (``tests/test_megakernel_gpu.py`` is the check).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr
from cutlass.experimental.primitives import nanosleep

from . import _common as C
from ._source import kernel_source_hash
from .device_fns import (
    NT,
    NW,
    VEC,
    bf16_round,
    block_allreduce,
    exp_fast,
    gchunks,
    gflat,
    glu,
    row_dot,
    rstd_rows,
    sigmoid,
    silu,
    warp_argmax,
    warp_sum,
    weight_row_dot,
)

SOURCE_HASH = kernel_source_hash(__name__.rsplit(".", 1)[-1])

__all__ = ["MKConfig", "OPCODE_NOTES", "STAGE_BYTES", "ERROR_WORDS", "CTL_WORDS", "ERR_WATCHDOG", "ERR_BAD_PROGRAM",
           "megakernel", "compile_for", "launch", "SOURCE_HASH", "VARIANTS"]

VARIANTS = ("megakernel",)
# int32 program layout (kimik3.megakernel.instructions; duplicated here so the device code has no torch import)
MAGIC = 0x4B334D4B
INSTR_WORDS = 128
H_S, H_Q, H_OFF_BUF, H_OFF_CTR, H_OFF_INS, H_OFF_Q = 5, 6, 13, 14, 15, 16
W_OP, W_ARGS, W_SIGNAL, W_AMOUNT, W_NWAITS, W_WAITS, W_NOPS, W_OPS = 0, 4, 8, 9, 10, 11, 19, 20
OPERAND_WORDS = 8
MAX_OPERANDS = 12
BUFFER_WORDS = 8
COUNTER_WORDS = 4
MODE_PREFETCH = 4
DTYPE_BF16 = 1
# box fields of an operand: (buffer, mode, b0, b1, r0, r1, c0, c1)
B0, B1, R0, R1, C0, C1 = 0, 1, 2, 3, 4, 5

BT_MAX = 4  # batch rows per GEMV pass: 4 keeps the widest opcode near 80 registers (the kernel's cap is 128)
STAGE_BYTES = 64 * 1024  # shared-memory weight stage (whole rows of the prefetched operand)
STAGE_CHUNKS = STAGE_BYTES // 16
F32_WORDS = 4096  # per-instruction fp32 scratch (rstd, reductions, KDA vectors, router weights, arg-max partials)
I32_WORDS = 4096
F32_RED = 64  # s_f32[F32_RED : F32_RED + NW * 2 * kmax]: block reductions
F32_VEC = 1024  # s_f32[F32_VEC:]: KDA vectors / lm_head partials / router weights
ERROR_WORDS = 8  # error[0] code, [1] instruction, [2] counter, [3] target, [4] value seen, [5] CTA, [6] SM, [7] step
CTL_WORDS = 8  # ctl[0] step, [1] watchdog spins, [2] nanosleep ns per spin
ERR_WATCHDOG, ERR_BAD_PROGRAM = 1, 2
# s_run slots (launch invariants kept in shared memory)
RUN_Q, RUN_QLEN, RUN_OFF_BUF, RUN_OFF_CTR, RUN_OFF_INS, RUN_OFF_Q, RUN_STEP, RUN_SPINS, RUN_SLEEP = range(9)
OP_EMBED, OP_ATTN_RES_MIX, OP_NORM_PROJ, OP_MLP_GATE_UP, OP_KDA_STEP, OP_MLA_Q, OP_MLA_KV_APPEND = 1, 2, 3, 4, 5, 6, 7
OP_MLA_PARTIAL, OP_MLA_REDUCE, OP_O_PROJ_RESIDUAL, OP_ROUTER, OP_EXPERT_GATE_UP, OP_EXPERT_DOWN = 8, 9, 10, 11, 12, 13
OP_FFN_OUT, OP_LM_HEAD, OP_ARGMAX = 14, 15, 16
FFN_ROUTED, FFN_MLP = 1, 2

OPCODE_NOTES: dict[str, tuple[str, str]] = {
    # opcode: (what the device code does, known performance limits of this first version)
    "EMBED": ("per batch row of the tile: the token's embedding row copied with 16-byte loads/stores into "
              "stream[:, 0]", "none worth noting (B·H·2 bytes)"),
    "ATTN_RES_MIX": ("per batch row: one pass accumulates Σv² and Σv·ω for every candidate (ω = norm ⊙ proj in "
                     "fp32), one CTA reduction, softmax over depth in every thread, second pass mixes the raw "
                     "candidates in fp32 and stores bf16", "rows of a tile run one after another (2 barriers each); "
                                                           "the second pass re-reads the candidates from L1/L2"),
    "NORM_PROJ": ("rstd of every batch row (one warp per row), then one warp per weight row: 16-byte weight loads "
                  "(4 per lane in flight, 2 when 4 batch rows share them; from the smem stage for staged rows) "
                  "times γ, fp32 dot with up to 4 batch rows per pass, rstd applied after the dot (guide §3.1); fp32 "
                  "or bf16 out",
                  "CUDA-core FMAs, one CTA per SM: 12 warps keep ~24 KiB of weights in flight per SM (below what "
                  "HBM latency asks for; the smem prefetch covers the first rows only); at B = 64 the weight row "
                  "is re-read 16 times (L1) and x comes from L1/L2 for every row — FMA/L1-bound, a tensor-core "
                  "(mma) path for B ≥ 16 is future work"),
    "MLP_GATE_UP": ("as NORM_PROJ for the gate and the up row of each channel, then SiTU-GLU (or SwiGLU) in fp32",
                    "as NORM_PROJ; x is read twice per channel (once per weight)"),
    "KDA_STEP": ("per (head, sequence): threads < dk do the width-4 conv + SiLU for q/k/v (shifting the conv "
                 "history in place), the decay gate (f_a·f_b in fp32, rounded like the reference's bf16 linear) "
                 "and the output gate; one CTA reduction gives ‖q‖, ‖k‖; the dk×dk state is split "
                 "column-per-thread in KP = NT/dk row groups: pass 1 reads and decays the state for Sᵀk (smem "
                 "reduction over the groups), pass 2 re-reads it (L1), applies the delta-rule update, stores it and "
                 "accumulates Sᵀq; gated RMSNorm with a second CTA reduction",
                 "(head, sequence) pairs run one after another with ~8 barriers each; the state is read twice "
                 "(the second time from L1) to keep it out of registers; the f_a·f_b dot is a serial dk-long loop "
                 "per thread"),
    "MLA_Q": ("per batch tile: q_a rows staged in smem, their rstd, one warp per q_b row (rstd applied after the "
              "dot; the rope part goes straight to mla_q), then W_UK absorption one thread per latent column",
              "the absorption walks nope rows serially per thread (128 dependent FMAs per latent column)"),
    "MLA_KV_APPEND": ("one warp per sequence: latent RMSNorm exactly as the reference, latent and shared key "
                      "written at the sequence's position", "none worth noting"),
    "MLA_PARTIAL": ("one warp per (sequence, head): the lane holds 16 latent + 2 rope query dims (k3-shard), walks "
                    "the split's cache rows up to the sequence's position with an online softmax (exp2), writes "
                    "(o, max, sum)", "serial over positions with two warp sums per position: latency-bound for "
                                     "long contexts; a head-batched mma version is future work"),
    "MLA_REDUCE": ("per (head, batch tile): merge the splits (log-sum-exp weights) into o_lat in smem, one warp per "
                   "W_UV row, output gate σ(g) in bf16", "splits re-read per latent column"),
    "O_PROJ_RESIDUAL": ("one warp per o_proj row (column of the stream): dot over the mixer output, bf16, added "
                        "into (or starting) the block's partial sum", "as NORM_PROJ"),
    "ROUTER": ("one warp per token: sigmoid scores (+ bias to choose), k rounds of butterfly arg-max (ties to the "
               "lower id), renormalise; warp 0 compacts the chosen experts in ascending order with ballots into "
               "slots; one thread per (token, slot) writes the slot weight and use flag",
               "grouped routing (n_group > 1) is not implemented (refused on the host)"),
    "EXPERT_GATE_UP": ("per slot's expert, one warp per hidden channel: for every token that uses the slot, w1 and "
                       "w3 row dots over the latent input and SiTU-GLU", "one token at a time: the two weight rows "
                                                                         "are re-read (L1) per token; no "
                                                                         "prefetch (the expert is data-dependent)"),
    "EXPERT_DOWN": ("one warp per latent row: for every chosen expert and every token using it, the w2 row dot, "
                    "bf16, times the router weight, accumulated in fp32 per token (lane b mod 32), one bf16 cast",
                    "one token at a time, rows re-read per token; no prefetch"),
    "FFN_OUT": ("one warp per hidden column: routed part (latent RMSNorm applied after the dot) and/or the "
                "shared/dense down row, each rounded to bf16 as the reference does, added into the stream",
                "as NORM_PROJ"),
    "LM_HEAD": ("final RMSNorm + one warp per vocabulary row: bf16-rounded fp32 logits, per-warp running arg-max "
                "per token, merged across warps through smem (ties to the lowest id)", "as NORM_PROJ"),
    "ARGMAX": ("one thread per token walks the tiles' (max, arg-max) pairs, first maximum wins",
               "serial over tiles (a few hundred at most)"),
}


@dataclass(frozen=True)
class MKConfig:
    """Everything the device code needs at compile time: widths from the model config, the batch size, and the
    buffer capacities. (Box extents, tile sizes, buffer dims, the cache length and the SM count are read from
    the program at run time, so one compiled kernel serves every schedule of a config and batch size.)"""

    B: int
    H: int
    eps: float
    lora_eps: float
    situ: bool
    situ_beta: float
    situ_lin: float | None
    dk: int
    nh_kda: int
    conv: int
    kda_lb: float | None
    nh: int
    ql: int
    kvl: int
    rope: int
    nope: int
    dv: int
    mla_scale: float
    E: int
    topk: int
    dmax: int
    renorm: bool
    route_scale: float
    latent_norm: bool
    kmax: int
    prog_words: int
    max_instr: int
    max_bufs: int
    max_ctrs: int

    @property
    def bt(self) -> int:
        """Batch rows per GEMV pass (one fp32 accumulator each per warp): the largest divisor of B up to 8, so
        every tile is full and the tile loop stays a real loop (code size independent of B)."""
        return max(d for d in range(1, min(self.B, BT_MAX) + 1) if self.B % d == 0)

    @property
    def nbt(self) -> int:
        return self.B // self.bt

    @property
    def unroll(self) -> int:
        """16-byte weight loads in flight per lane: 4 while at most 2 batch rows share a weight chunk, else 2 (the
        FMAs per weight byte grow with the batch rows, and their x chunks need the registers)."""
        return 4 if self.bt <= 2 else 2

    @property
    def xb_elems(self) -> int:
        """bf16 smem scratch for MLA: q_a rows (or o_lat rows) of a batch tile, then the tile's nope queries."""
        return self.bt * (max(self.ql, self.kvl, VEC) + max(self.nope, VEC))


def _check_static(cfg: MKConfig) -> None:
    """Trace-time limits of the static scratch sizes (plain asserts: a config outside them fails to compile)."""
    assert cfg.B >= 1 and cfg.H % VEC == 0
    assert F32_RED + NW * 2 * cfg.kmax <= F32_VEC, "too many AttnRes candidates for the reduction scratch"
    if cfg.dk:
        assert cfg.dk <= NT and cfg.dk % _kda_groups(cfg.dk) == 0
        assert F32_VEC + 5 * cfg.dk + _kda_groups(cfg.dk) * cfg.dk <= F32_WORDS
    if cfg.E:
        assert F32_VEC + cfg.B * cfg.topk <= F32_WORDS
        assert 2 * _pad32(cfg.E) + cfg.B * cfg.topk <= I32_WORDS
    assert F32_VEC + NW * cfg.B <= F32_WORDS and NW * cfg.B <= I32_WORDS
    if cfg.nh:
        assert cfg.ql % VEC == 0 and cfg.kvl % VEC == 0


def _pad32(n: int) -> int:
    return -(-n // 32) * 32


def _kda_groups(dk: int) -> int:
    """Row groups of the KDA state (threads per state column): the largest power of two with groups·dk <= NT
    threads and at most dk groups, so every group has the same number of rows."""
    g = 1
    while 2 * g * dk <= NT and 2 * g <= dk:
        g *= 2
    return g


# ---------------------------------------------------------------------------------------------- operand access
class _Ctx:
    """Trace-time bundle of the kernel's tensors and per-thread indices, handed to every opcode function."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@cute.jit
def _bx(ctx: _Ctx, j: Int32, f: cutlass.Constexpr) -> Int32:
    """Box field ``f`` (B0..C1) of operand ``j`` of the current instruction."""
    return ctx.s_ins[W_OPS + OPERAND_WORDS * j + 2 + f]


@cute.jit
def _eoff(d1: Int32, d2: Int32, b: Int32, r: Int32, c: Int32) -> Int64:
    """Element offset of ``[b, r, c]`` in a ``[*, d1, d2]`` buffer (64-bit)."""
    return (Int64(b) * Int64(d1) + Int64(r)) * Int64(d2) + Int64(c)


@cute.jit
def _staged_rows(ctx: _Ctx, j: Int32) -> Int32:
    """Rows of operand ``j`` available in the smem stage (0 unless ``j`` is the prefetched operand)."""
    return ctx.s_pf[1] if ctx.s_pf[0] == j else Int32(0)


@cute.jit
def _row0(ctx: _Ctx, j: Int32) -> Int64:
    """Byte address of the first element of operand ``j``'s box (weights: its first row)."""
    return ctx.s_addr[j] + _eoff(ctx.s_d1[j], ctx.s_d2[j], _bx(ctx, j, B0), _bx(ctx, j, R0), _bx(ctx, j, C0)) * 2


# ---------------------------------------------------------------------------------------------- opcodes
@cute.jit
def op_embed(ctx: _Ctx) -> None:
    ids = gflat(Int64, ctx.s_addr[0])
    nch = ctx.s_d2[1] // VEC
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    for b in cutlass.range(_bx(ctx, 0, B0), _bx(ctx, 0, B1), unroll=1):
        tok = Int32(ids[Int64(b) * Int64(ctx.s_d1[0]) * Int64(ctx.s_d2[0])])
        src = gchunks(ctx.s_addr[1] + Int64(tok) * Int64(ctx.s_d2[1]) * 2)
        dst = gchunks(ctx.s_addr[2] + _eoff(ctx.s_d1[2], ctx.s_d2[2], b, 0, 0) * 2)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            cute.copy(ld, src[(c, None)], r)
            cute.copy(st, r, dst[(c, None)])


@cute.jit
def op_attn_res_mix(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    KM = cfg.kmax
    K = ctx.s_ins[W_ARGS + 1]
    nch = ctx.s_d2[0] // VEC
    ld_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
    ld_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128)
    st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    gn, gp = gchunks(ctx.s_addr[1]), gchunks(ctx.s_addr[2])
    rn = cute.make_rmem_tensor((VEC,), BFloat16)
    rp = cute.make_rmem_tensor((VEC,), BFloat16)
    rv = cute.make_rmem_tensor((VEC,), BFloat16)
    ro = cute.make_rmem_tensor((VEC,), BFloat16)
    acc = cute.make_rmem_tensor((VEC,), Float32)
    vals = cute.make_rmem_tensor((2 * KM,), Float32)
    s_red = cute.make_tensor(ctx.s_f32.iterator + F32_RED, cute.make_layout(NW * 2 * KM))
    inv_h = 1.0 / cfg.H
    for b in cutlass.range(_bx(ctx, 0, B0), _bx(ctx, 0, B1), unroll=1):
        sv = gchunks(ctx.s_addr[0] + _eoff(ctx.s_d1[0], ctx.s_d2[0], b, 0, 0) * 2)
        vals.fill(0.0)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            cute.copy(ld_w, gn[(c, None)], rn)
            cute.copy(ld_w, gp[(c, None)], rp)
            om = rn.load().to(Float32) * rp.load().to(Float32)
            for k in cutlass.range_constexpr(KM):
                if k < K:
                    cute.copy(ld_x, sv[(k * nch + c, None)], rv)
                    v = rv.load().to(Float32)
                    vals[k] += (v * v).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
                    vals[KM + k] += (v * om).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
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
        dst = gchunks(ctx.s_addr[3] + _eoff(ctx.s_d1[3], ctx.s_d2[3], b, 0, 0) * 2)
        for c in cutlass.range(ctx.tidx, nch, NT, unroll=1):
            acc.fill(0.0)
            for k in cutlass.range_constexpr(KM):
                if k < K:
                    cute.copy(ld_x, sv[(k * nch + c, None)], rv)
                    acc.store(acc.load() + rv.load().to(Float32) * (vals[k] * inv))
            ro.store(acc.load().to(BFloat16))
            cute.copy(st, ro, dst[(c, None)])


@cute.jit
def _gemv_prologue(ctx: _Ctx, xop: Int32, eps: cutlass.Constexpr) -> tuple[Any, Int32]:
    """x rows of operand ``xop`` as a chunk view + its batch stride in chunks; their rstd into s_f32[0:B]."""
    xaddr = _row0(ctx, xop)
    xs = ctx.s_d1[xop] * ctx.s_d2[xop] // VEC
    rstd_rows(xaddr, xs, Int32(ctx.cfg.B), ctx.s_d2[xop] // VEC, eps, ctx.s_f32)
    return gchunks(xaddr), xs


@cute.jit
def op_norm_proj(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT = cfg.bt
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    fp32 = ctx.s_ins[W_ARGS]
    n = _bx(ctx, 2, R1) - _bx(ctx, 2, R0)
    nch = ctx.s_d2[2] // VEC
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    gv = gchunks(ctx.s_addr[1])
    o0 = _bx(ctx, 3, C0)
    of = gflat(Float32, ctx.s_addr[3])
    ob = gflat(BFloat16, ctx.s_addr[3])
    acc = cute.make_rmem_tensor((BT,), Float32)
    for j in cutlass.range(ctx.warp, n, NW, unroll=1):
        for t in cutlass.range(cfg.nbt, unroll=1):
            nb = BT
            weight_row_dot(ctx.s_stage, staged, wrow0, j, nch, xv, t * BT * xs, xs, False, gv, acc, nb, cfg.unroll)
            for bb in cutlass.range_constexpr(nb):
                b = t * BT + bb
                d = warp_sum(acc[bb]) * ctx.s_f32[b]
                if ctx.lane == bb % 32:
                    off = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), o0 + j)
                    if fp32 != 0:
                        of[off] = d
                    else:
                        ob[off] = d.to(BFloat16)


@cute.jit
def op_mlp_gate_up(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT = cfg.bt
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    n = _bx(ctx, 2, R1) - _bx(ctx, 2, R0)
    nch = ctx.s_d2[2] // VEC
    wg0, wu0 = _row0(ctx, 2), _row0(ctx, 3)
    sg, su = _staged_rows(ctx, Int32(2)), _staged_rows(ctx, Int32(3))
    gv = gchunks(ctx.s_addr[1])
    o0 = _bx(ctx, 4, C0)
    ob = gflat(BFloat16, ctx.s_addr[4])
    ag = cute.make_rmem_tensor((BT,), Float32)
    au = cute.make_rmem_tensor((BT,), Float32)
    for j in cutlass.range(ctx.warp, n, NW, unroll=1):
        for t in cutlass.range(cfg.nbt, unroll=1):
            nb = BT
            weight_row_dot(ctx.s_stage, sg, wg0, j, nch, xv, t * BT * xs, xs, False, gv, ag, nb, cfg.unroll)
            weight_row_dot(ctx.s_stage, su, wu0, j, nch, xv, t * BT * xs, xs, False, gv, au, nb, cfg.unroll)
            for bb in cutlass.range_constexpr(nb):
                b = t * BT + bb
                r = ctx.s_f32[b]
                a = bf16_round(warp_sum(ag[bb]) * r)
                u = bf16_round(warp_sum(au[bb]) * r)
                h = glu(a, u, cfg.situ, cfg.situ_beta, cfg.situ_lin)
                if ctx.lane == bb % 32:
                    ob[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), o0 + j)] = h.to(BFloat16)


@cute.jit
def op_o_proj_residual(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT = cfg.bt
    accumulate = ctx.s_ins[W_ARGS]
    xaddr = _row0(ctx, 0)
    xs = ctx.s_d1[0] * ctx.s_d2[0] // VEC
    xv = gchunks(xaddr)
    n = _bx(ctx, 1, R1) - _bx(ctx, 1, R0)
    nch = ctx.s_d2[1] // VEC
    wrow0 = _row0(ctx, 1)
    staged = _staged_rows(ctx, Int32(1))
    entry, c0 = _bx(ctx, 2, R0), _bx(ctx, 2, C0)
    sb = gflat(BFloat16, ctx.s_addr[2])
    acc = cute.make_rmem_tensor((BT,), Float32)
    for j in cutlass.range(ctx.warp, n, NW, unroll=1):
        for t in cutlass.range(cfg.nbt, unroll=1):
            nb = BT
            weight_row_dot(ctx.s_stage, staged, wrow0, j, nch, xv, t * BT * xs, xs, False, None, acc, nb, cfg.unroll)
            for bb in cutlass.range_constexpr(nb):
                b = t * BT + bb
                y = bf16_round(warp_sum(acc[bb]))
                if ctx.lane == bb % 32:
                    off = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, entry, c0 + j)
                    if accumulate != 0:
                        y = sb[off].to(Float32) + y
                    sb[off] = y.to(BFloat16)


@cute.jit
def op_ffn_out(ctx: _Ctx) -> None:
    """Operand order (scheduler ``out_cols``): [latent sum, (latent norm), up rows] if routed, [mlp hidden,
    down rows] if mlp, stream column tile last."""
    cfg = ctx.cfg
    BT = cfg.bt
    flags = ctx.s_ins[W_ARGS]
    routed = (flags & FFN_ROUTED) != 0
    mlp = (flags & FFN_MLP) != 0
    ln = 1 if cfg.latent_norm else 0
    ia = Int32(0)
    iu = Int32(1 + ln)
    ih = Int32(0)
    if routed:
        ih = Int32(2 + ln)
    idn = ih + 1
    io = ih + 2 if mlp else ih
    # routed source (its x is the fp32-combined latent sum, cast to bf16 by EXPERT_DOWN)
    xa = _row0(ctx, ia)
    xas = ctx.s_d1[ia] * ctx.s_d2[ia] // VEC
    if const_expr(cfg.latent_norm):
        if routed:
            rstd_rows(xa, xas, Int32(cfg.B), ctx.s_d2[ia] // VEC, cfg.eps, ctx.s_f32)
    av = gchunks(xa)
    gv = gchunks(ctx.s_addr[1]) if const_expr(cfg.latent_norm) else None
    nch_u = ctx.s_d2[iu] // VEC
    wu0 = _row0(ctx, iu)
    su = _staged_rows(ctx, iu)
    # mlp source
    xh = _row0(ctx, ih)
    xhs = ctx.s_d1[ih] * ctx.s_d2[ih] // VEC
    hv = gchunks(xh)
    nch_d = ctx.s_d2[idn] // VEC
    wd0 = _row0(ctx, idn)
    sd = _staged_rows(ctx, idn)
    n = _bx(ctx, io, C1) - _bx(ctx, io, C0)
    entry, c0 = _bx(ctx, io, R0), _bx(ctx, io, C0)
    sb = gflat(BFloat16, ctx.s_addr[io])
    ar = cute.make_rmem_tensor((BT,), Float32)
    am = cute.make_rmem_tensor((BT,), Float32)
    for j in cutlass.range(ctx.warp, n, NW, unroll=1):
        for t in cutlass.range(cfg.nbt, unroll=1):
            nb = BT
            ar.fill(0.0)
            am.fill(0.0)
            if routed:
                weight_row_dot(ctx.s_stage, su, wu0, j, nch_u, av, t * BT * xas, xas, False, gv, ar, nb, cfg.unroll)
            if mlp:
                weight_row_dot(ctx.s_stage, sd, wd0, j, nch_d, hv, t * BT * xhs, xhs, False, None, am, nb, cfg.unroll)
            for bb in cutlass.range_constexpr(nb):
                b = t * BT + bb
                yr = warp_sum(ar[bb])
                ym = warp_sum(am[bb])
                out = Float32(0.0)
                if routed:
                    if const_expr(cfg.latent_norm):
                        yr = yr * ctx.s_f32[b]
                    out = bf16_round(yr)
                if mlp:
                    out = bf16_round(out + bf16_round(ym))
                if ctx.lane == bb % 32:
                    off = _eoff(ctx.s_d1[io], ctx.s_d2[io], b, entry, c0 + j)
                    sb[off] = (sb[off].to(Float32) + out).to(BFloat16)


@cute.jit
def op_lm_head(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT = cfg.bt
    xv, xs = _gemv_prologue(ctx, Int32(0), cfg.eps)
    ti, r0 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 2]
    n = ctx.s_ins[W_ARGS + 3] - r0
    nch = ctx.s_d2[2] // VEC
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    gv = gchunks(ctx.s_addr[1])
    logits = gflat(Float32, ctx.s_addr[3])
    # per-(warp, token) running arg-max in smem; slot (w, b) is only ever touched by lane b % BT of warp w (the
    # lane that stores token b's results below), so no intra-warp synchronisation is needed
    s_bv = cute.make_tensor(ctx.s_f32.iterator + F32_VEC, cute.make_layout(NW * cfg.B))
    s_bi = ctx.s_i32
    if ctx.lane < BT:
        for b in cutlass.range(ctx.lane, cfg.B, BT, unroll=1):
            s_bv[ctx.warp * cfg.B + b] = -Float32.inf
            s_bi[ctx.warp * cfg.B + b] = 2**31 - 1
    acc = cute.make_rmem_tensor((BT,), Float32)
    for j in cutlass.range(ctx.warp, n, NW, unroll=1):
        for t in cutlass.range(cfg.nbt, unroll=1):
            weight_row_dot(ctx.s_stage, staged, wrow0, j, nch, xv, t * BT * xs, xs, False, gv, acc, BT, cfg.unroll)
            for bb in cutlass.range_constexpr(BT):
                b = t * BT + bb
                d = bf16_round(warp_sum(acc[bb]) * ctx.s_f32[b])  # the reference's bf16 linear, then fp32
                if ctx.lane == bb % 32:
                    logits[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), r0 + j)] = d
                    slot = ctx.warp * cfg.B + b
                    if d > s_bv[slot]:  # a warp's rows ascend: strict > keeps the lowest id
                        s_bv[slot] = d
                        s_bi[slot] = j
    cute.arch.sync_threads()
    best_v = gflat(Float32, ctx.s_addr[4])
    best_i = gflat(Int64, ctx.s_addr[5])
    if ctx.tidx < cfg.B:
        b = ctx.tidx
        v, i = s_bv[b], s_bi[b]
        for w in cutlass.range_constexpr(1, NW):
            ov, oi = s_bv[w * cfg.B + b], s_bi[w * cfg.B + b]
            take = (ov > v) | ((ov == v) & (oi < i))
            v, i = (ov, oi) if take else (v, i)
        best_v[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), ti)] = v
        best_i[_eoff(ctx.s_d1[5], ctx.s_d2[5], b, Int32(0), ti)] = Int64(r0 + i)


@cute.jit
def op_argmax(ctx: _Ctx) -> None:
    bv = gflat(Float32, ctx.s_addr[0])
    bi = gflat(Int64, ctx.s_addr[1])
    nxt = gflat(Int64, ctx.s_addr[2])
    if ctx.tidx < ctx.cfg.B:
        b = ctx.tidx
        T = ctx.s_d2[0]
        best, bt = -Float32.inf, Int32(0)
        for t in cutlass.range(T, unroll=1):
            v = bv[_eoff(ctx.s_d1[0], T, b, Int32(0), t)]
            take = v > best  # first maximum = lowest tile = lowest vocabulary id
            best, bt = (v, t) if take else (best, bt)
        tok = bi[_eoff(ctx.s_d1[1], ctx.s_d2[1], b, Int32(0), bt)]
        nxt[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), Int32(0))] = tok


@cute.jit
def _precise_sigmoid(x: Float32) -> Float32:
    """Full-precision σ for the router: approximate scores could reorder near-ties and pick another expert."""
    return 1.0 / (1.0 + cute.math.exp(-x))


@cute.jit
def op_router(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    E, K, B = cfg.E, cfg.topk, cfg.B
    EPL = -(-E // 32)
    EP = _pad32(E)
    lg = gflat(Float32, ctx.s_addr[0])
    bias = gflat(Float32, ctx.s_addr[1])
    sel = gflat(Int64, ctx.s_addr[2])
    mw = gflat(Float32, ctx.s_addr[3])
    use = gflat(Uint8, ctx.s_addr[4])
    s_used, s_slot, s_sel = ctx.s_i32, ctx.s_i32, ctx.s_i32  # [0, EP) used, [EP, 2EP) slot, [2EP, ..) choices
    s_w = ctx.s_f32  # [F32_VEC, F32_VEC + B*K): weights
    for e in cutlass.range(ctx.tidx, EP, NT, unroll=1):
        s_used[e] = 0
    cute.arch.sync_threads()
    ch = cute.make_rmem_tensor((EPL,), Float32)
    ix = cute.make_rmem_tensor((EPL,), Int32)
    for b in cutlass.range(ctx.warp, B, NW, unroll=1):
        row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0))
        for m in cutlass.range_constexpr(EPL):
            e = ctx.lane + 32 * m
            ix[m] = e
            ch[m] = -Float32.inf
            if e < E:
                ch[m] = _precise_sigmoid(lg[row + e]) + bias[e]
        wsum = Float32(0.0)
        for r in cutlass.range_constexpr(K):
            v, i = ch[0], ix[0]
            for m in cutlass.range_constexpr(1, EPL):  # ascending ids: strict > keeps the lower id on ties
                take = ch[m] > v
                v, i = (ch[m], ix[m]) if take else (v, i)
            v, i = warp_argmax(v, i)
            for m in cutlass.range_constexpr(EPL):
                ch[m] = -Float32.inf if ix[m] == i else ch[m]
            w = _precise_sigmoid(lg[row + i])  # the weight comes from the unbiased score
            wsum = wsum + w
            if ctx.lane == 0:
                s_sel[2 * EP + b * K + r] = i
                s_w[F32_VEC + b * K + r] = w
                s_used[i] = 1
        if ctx.lane == 0:
            scale = Float32(cfg.route_scale)
            if const_expr(cfg.renorm and K > 1):
                scale = scale / (wsum + 1e-20)
            for r in cutlass.range_constexpr(K):
                s_w[F32_VEC + b * K + r] = s_w[F32_VEC + b * K + r] * scale
    cute.arch.sync_threads()
    if ctx.warp == 0:  # compact the chosen experts, ascending, into slots
        base = Int32(0)
        for m in cutlass.range_constexpr(EPL):
            e = ctx.lane + 32 * m
            u = s_used[e] != 0  # [E, EP) was zeroed too
            bal = cute.arch.vote_ballot_sync(u)
            slot = base + cute.arch.popc(bal & cute.arch.lanemask_lt())
            if u:
                s_slot[EP + e] = slot
                sel[slot] = Int64(e)
            base = base + cute.arch.popc(bal)
        for j in cutlass.range(base + ctx.lane, cfg.dmax, 32, unroll=1):
            sel[j] = Int64(-1)
    cute.arch.sync_threads()
    for idx in cutlass.range(ctx.tidx, B * cfg.dmax, NT, unroll=1):
        b, j = idx // cfg.dmax, idx % cfg.dmax
        w = Float32(0.0)
        u = Int32(0)
        for r in cutlass.range_constexpr(K):
            hit = s_slot[EP + s_sel[2 * EP + b * K + r]] == j
            w = w + (s_w[F32_VEC + b * K + r] if hit else Float32(0.0))
            u = Int32(1) if hit else u
        mw[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), j)] = w
        use[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, Int32(0), j)] = Uint8(u)


@cute.jit
def op_expert_gate_up(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    s0, s1, r0, r1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    xv = gchunks(ctx.s_addr[0])
    xs = ctx.s_d1[0] * ctx.s_d2[0] // VEC
    nch = ctx.s_d2[3] // VEC
    sel = gflat(Int64, ctx.s_addr[1])
    use = gflat(Uint8, ctx.s_addr[2])
    out = gflat(BFloat16, ctx.s_addr[5])
    ag = cute.make_rmem_tensor((1,), Float32)
    au = cute.make_rmem_tensor((1,), Float32)
    for j in cutlass.range(s0, s1, unroll=1):
        e = Int32(sel[_eoff(ctx.s_d1[1], ctx.s_d2[1], Int32(0), Int32(0), j)])
        if e >= 0:
            for r in cutlass.range(r0 + ctx.warp, r1, NW, unroll=1):
                wg = gchunks(ctx.s_addr[3] + _eoff(ctx.s_d1[3], ctx.s_d2[3], e, r, Int32(0)) * 2)
                wu = gchunks(ctx.s_addr[4] + _eoff(ctx.s_d1[4], ctx.s_d2[4], e, r, Int32(0)) * 2)
                for b in cutlass.range(cfg.B, unroll=1):
                    if use[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), j)] != Uint8(0):
                        ag.fill(0.0)
                        au.fill(0.0)
                        row_dot(wg, Int32(0), False, xv, b * xs, xs, False, None, nch, ag, 1)
                        row_dot(wu, Int32(0), False, xv, b * xs, xs, False, None, nch, au, 1)
                        h = glu(bf16_round(warp_sum(ag[0])), bf16_round(warp_sum(au[0])), cfg.situ, cfg.situ_beta,
                                cfg.situ_lin)
                        if ctx.lane == 0:
                            out[_eoff(ctx.s_d1[5], ctx.s_d2[5], b, j, r)] = h.to(BFloat16)


@cute.jit
def op_expert_down(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    APL = -(-cfg.B // 32)
    r0, r1 = ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    hv = gchunks(ctx.s_addr[0])
    hs = ctx.s_d2[0] // VEC  # chunks per (token, slot) row of the expert hidden buffer
    nch = ctx.s_d2[4] // VEC
    sel = gflat(Int64, ctx.s_addr[1])
    use = gflat(Uint8, ctx.s_addr[2])
    mw = gflat(Float32, ctx.s_addr[3])
    out = gflat(BFloat16, ctx.s_addr[5])
    a1 = cute.make_rmem_tensor((1,), Float32)
    acc = cute.make_rmem_tensor((APL,), Float32)
    for r in cutlass.range(r0 + ctx.warp, r1, NW, unroll=1):
        acc.fill(0.0)
        for j in cutlass.range(cfg.dmax, unroll=1):
            e = Int32(sel[_eoff(ctx.s_d1[1], ctx.s_d2[1], Int32(0), Int32(0), j)])
            if e >= 0:
                wv = gchunks(ctx.s_addr[4] + _eoff(ctx.s_d1[4], ctx.s_d2[4], e, r, Int32(0)) * 2)
                for b in cutlass.range(cfg.B, unroll=1):
                    if use[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), j)] != Uint8(0):
                        a1.fill(0.0)
                        row_dot(wv, Int32(0), False, hv, (b * ctx.s_d1[0] + j) * hs, hs, False, None, nch, a1, 1)
                        y = bf16_round(warp_sum(a1[0])) * mw[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, Int32(0), j)]
                        for m in cutlass.range_constexpr(APL):
                            acc[m] = acc[m] + (y if ctx.lane + 32 * m == b else Float32(0.0))
        for m in cutlass.range_constexpr(APL):
            b = ctx.lane + 32 * m
            if b < cfg.B:
                out[_eoff(ctx.s_d1[5], ctx.s_d2[5], b, Int32(0), r)] = acc[m].to(BFloat16)


@cute.jit
def op_kda_step(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    dk, W = cfg.dk, cfg.conv
    hw = 4 * dk + 1
    KP = _kda_groups(dk)  # row groups of the state (threads per state column)
    R = dk // KP  # state rows per thread
    h0, h1, b0, b1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1], ctx.s_ins[W_ARGS + 2], ctx.s_ins[W_ARGS + 3]
    mp = gflat(BFloat16, ctx.s_addr[0])
    fa0 = _bx(ctx, 1, C0)
    conv = gflat(BFloat16, ctx.s_addr[2])
    S = gflat(Float32, ctx.s_addr[3])
    fb = gflat(BFloat16, ctx.s_addr[4])
    dt = gflat(Float32, ctx.s_addr[5])
    alog = gflat(Float32, ctx.s_addr[6])
    cw = gflat(Float32, ctx.s_addr[7])
    onorm = gflat(Float32, ctx.s_addr[8])
    out = gflat(BFloat16, ctx.s_addr[9])
    s_red = cute.make_tensor(ctx.s_f32.iterator + F32_RED, cute.make_layout(NW * 2))
    base = F32_VEC
    sq, sk, sv, sdec, sgt, sred = base, base + dk, base + 2 * dk, base + 3 * dk, base + 4 * dk, base + 5 * dk
    sf = ctx.s_f32
    vals = cute.make_rmem_tensor((2,), Float32)
    i = ctx.tidx
    vcol, p = ctx.tidx % dk, ctx.tidx // dk
    for h in cutlass.range(h0, h1, unroll=1):
        for b in cutlass.range(b0, b1, unroll=1):
            row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), Int32(0))
            beta = sigmoid(mp[row + h * hw + 4 * dk].to(Float32))
            vals.fill(0.0)
            if i < dk:
                c = h * dk + i
                z = [Float32(0.0), Float32(0.0), Float32(0.0)]
                for jj in cutlass.range_constexpr(3):
                    raw = mp[row + h * hw + jj * dk + i].to(Float32)
                    hist = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(jj), c * (W - 1))
                    wrow = _eoff(Int32(1), ctx.s_d2[7], Int32(0), Int32(jj), c * W)
                    win = [conv[hist + t].to(Float32) for t in range(W - 1)] + [raw]  # oldest first
                    a = Float32(0.0)
                    for t in cutlass.range_constexpr(W):
                        a = a + win[t] * cw[wrow + t]
                    for t in cutlass.range_constexpr(W - 1):  # shift the history (this channel is ours alone)
                        conv[hist + t] = win[t + 1].to(BFloat16)
                    z[jj] = bf16_round(silu(a))
                u = Float32(0.0)
                frow = _eoff(Int32(1), ctx.s_d2[4], Int32(0), c, Int32(0))
                for jj in cutlass.range(dk, unroll=1):
                    u = u + mp[row + fa0 + jj].to(Float32) * fb[frow + jj].to(Float32)
                u = bf16_round(u) + dt[c]  # F.linear in bf16 rounds, then fp32 + dt_bias
                lam = cute.math.exp(alog[h])
                g = Float32(0.0)
                if const_expr(cfg.kda_lb is not None):
                    g = cfg.kda_lb * sigmoid(lam * u)
                else:
                    sp = u if u > 20.0 else cute.math.log(1.0 + cute.math.exp(u))
                    g = -lam * sp
                sf[sq + i] = z[0]
                sf[sk + i] = z[1]
                sf[sv + i] = z[2]
                sf[sdec + i] = cute.math.exp(g)
                sf[sgt + i] = mp[row + h * hw + 3 * dk + i].to(Float32)
                vals[0] = z[0] * z[0]
                vals[1] = z[1] * z[1]
            block_allreduce(vals, s_red, 2)
            rq = cute.math.rsqrt(vals[0] + 1e-6) * (dk**-0.5)  # l2norm (eps inside the root), q scaled by dk^-½
            rk = cute.math.rsqrt(vals[1] + 1e-6)
            srow = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, h, Int32(0))
            part = Float32(0.0)
            if p < KP:
                for r in cutlass.range(R, unroll=8):
                    ii = p * R + r
                    s = S[srow + ii * dk + vcol] * sf[sdec + ii]  # decay the key rows first
                    part = part + s * (sf[sk + ii] * rk)
                sf[sred + p * dk + vcol] = part
            cute.arch.sync_threads()
            rv = Float32(0.0)
            if p < KP:
                for pp in cutlass.range_constexpr(KP):
                    rv = rv + sf[sred + pp * dk + vcol]
            cute.arch.sync_threads()
            if p < KP:
                delta = beta * (sf[sv + vcol] - rv)
                po = Float32(0.0)
                for r in cutlass.range(R, unroll=8):
                    ii = p * R + r
                    s = S[srow + ii * dk + vcol] * sf[sdec + ii] + (sf[sk + ii] * rk) * delta
                    S[srow + ii * dk + vcol] = s
                    po = po + s * (sf[sq + ii] * rq)  # read with the updated state
                sf[sred + p * dk + vcol] = po
            cute.arch.sync_threads()
            o = Float32(0.0)
            vals.fill(0.0)
            if i < dk:
                for pp in cutlass.range_constexpr(KP):
                    o = o + sf[sred + pp * dk + i]
                o = bf16_round(o)  # cast to bf16 before the gated norm (pitfall 4)
                vals[0] = o * o
            block_allreduce(vals, s_red, 1)
            if i < dk:
                y = o * cute.math.rsqrt(vals[0] * (1.0 / dk) + cfg.eps, fastmath=True) * onorm[i] * sigmoid(sf[sgt + i])
                out[_eoff(ctx.s_d1[9], ctx.s_d2[9], b, Int32(0), h * dk + i)] = y.to(BFloat16)


@cute.jit
def op_mla_q(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    BT = cfg.bt
    ql, kvl, nope, rope = cfg.ql, cfg.kvl, cfg.nope, cfg.rope
    qk = nope + rope
    h0, h1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1]
    mp = gflat(BFloat16, ctx.s_addr[0])
    qa0 = _bx(ctx, 0, C0)
    gv = gchunks(ctx.s_addr[1])
    wrow0 = _row0(ctx, 2)
    staged = _staged_rows(ctx, Int32(2))
    wuk = gflat(BFloat16, ctx.s_addr[3])
    mq = gflat(BFloat16, ctx.s_addr[4])
    xq0 = BT * ql  # s_xb: [0, BT*ql) q_a rows, [BT*ql, BT*ql + BT*nope) the tile's nope queries
    s_xbf, s_f32 = ctx.s_xbf, ctx.s_f32
    acc = cute.make_rmem_tensor((BT,), Float32)
    for t in cutlass.range(cfg.nbt, unroll=1):
        nb = BT
        # the packed projection's row stride need not be a multiple of 8: stage q_a rows in smem (aligned)
        for idx in cutlass.range(ctx.tidx, nb * ql, NT, unroll=1):
            bb, cc = idx // ql, idx % ql
            s_xbf[idx] = mp[_eoff(ctx.s_d1[0], ctx.s_d2[0], t * BT + bb, Int32(0), qa0 + cc)]
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
        for h in cutlass.range(h0, h1, unroll=1):
            for j in cutlass.range(ctx.warp, qk, NW, unroll=1):
                weight_row_dot(ctx.s_stage, staged, wrow0, (h - h0) * qk + j, Int32(ql // VEC), ctx.s_xb, Int32(0),
                               Int32(ql // VEC), True, gv, acc, nb, cfg.unroll)
                for bb in cutlass.range_constexpr(nb):
                    d = bf16_round(warp_sum(acc[bb]) * s_f32[bb])
                    if ctx.lane == bb % 32:
                        if j < nope:
                            s_xbf[xq0 + bb * nope + j] = d.to(BFloat16)
                        else:
                            mq[_eoff(ctx.s_d1[4], ctx.s_d2[4], t * BT + bb, h, kvl + j - nope)] = d.to(BFloat16)
            cute.arch.sync_threads()
            for col in cutlass.range(ctx.tidx, kvl, NT, unroll=1):  # absorb W_UK: q_lat = q_nope · W_UK[h]
                acc.fill(0.0)
                for nn in cutlass.range(nope, unroll=1):
                    w = wuk[_eoff(Int32(1), ctx.s_d2[3], Int32(0), h * nope + nn, col)].to(Float32)
                    for bb in cutlass.range_constexpr(nb):
                        acc[bb] += s_xbf[xq0 + bb * nope + nn].to(Float32) * w
                for bb in cutlass.range_constexpr(nb):
                    mq[_eoff(ctx.s_d1[4], ctx.s_d2[4], t * BT + bb, h, col)] = acc[bb].to(BFloat16)
            cute.arch.sync_threads()


@cute.jit
def op_mla_kv_append(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    kvl, rope = cfg.kvl, cfg.rope
    mp = gflat(BFloat16, ctx.s_addr[0])
    c0 = _bx(ctx, 0, C0)
    kvn = gflat(BFloat16, ctx.s_addr[1])
    pos = gflat(Int64, ctx.s_addr[2])
    lat = gflat(BFloat16, ctx.s_addr[3])
    kr = gflat(BFloat16, ctx.s_addr[4])
    for b in cutlass.range(ctx.warp, cfg.B, NW, unroll=1):
        p = Int32(pos[_eoff(ctx.s_d1[2], ctx.s_d2[2], b, Int32(0), Int32(0))])
        row = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, Int32(0), c0)
        part = Float32(0.0)
        for li in cutlass.range(ctx.lane, kvl, 32, unroll=1):
            x = mp[row + li].to(Float32)
            part = part + x * x
        r = cute.math.rsqrt(warp_sum(part) * (1.0 / kvl) + cfg.lora_eps, fastmath=True)
        for li in cutlass.range(ctx.lane, kvl, 32, unroll=1):  # the reference's order: bf16(x·rstd), then ·w in bf16
            xh = bf16_round(mp[row + li].to(Float32) * r)
            lat[_eoff(ctx.s_d1[3], ctx.s_d2[3], b, p, li)] = (kvn[li].to(Float32) * xh).to(BFloat16)
        for li in cutlass.range(ctx.lane, rope, 32, unroll=1):  # NoPE: the shared key part is cached raw
            kr[_eoff(ctx.s_d1[4], ctx.s_d2[4], b, p, li)] = mp[row + kvl + li]


@cute.jit
def op_mla_partial(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    kvl, rope = cfg.kvl, cfg.rope
    LPL, RPL = -(-kvl // 32), -(-rope // 32)
    h0, h1 = ctx.s_ins[W_ARGS], ctx.s_ins[W_ARGS + 1]
    b0, b1 = _bx(ctx, 0, B0), _bx(ctx, 0, B1)
    t0, t1 = _bx(ctx, 2, R0), _bx(ctx, 2, R1)
    col0 = _bx(ctx, 4, C0)
    mq = gflat(BFloat16, ctx.s_addr[0])
    pos = gflat(Int64, ctx.s_addr[1])
    cc = gflat(BFloat16, ctx.s_addr[2])
    kr = gflat(BFloat16, ctx.s_addr[3])
    part = gflat(Float32, ctx.s_addr[4])
    qv = cute.make_rmem_tensor((LPL,), Float32)
    qr = cute.make_rmem_tensor((RPL,), Float32)
    o = cute.make_rmem_tensor((LPL,), Float32)
    for b in cutlass.range(b0, b1, unroll=1):
        last = Int32(pos[_eoff(ctx.s_d1[1], ctx.s_d2[1], b, Int32(0), Int32(0))])
        tend = t1 if t1 < last + 1 else last + 1  # causal: the sequence's own cache up to its position
        for h in cutlass.range(h0 + ctx.warp, h1, NW, unroll=1):
            qrow = _eoff(ctx.s_d1[0], ctx.s_d2[0], b, h, Int32(0))
            for m in cutlass.range_constexpr(LPL):
                lidx = ctx.lane + 32 * m
                qv[m] = mq[qrow + lidx].to(Float32) if lidx < kvl else Float32(0.0)
            for m in cutlass.range_constexpr(RPL):
                ridx = ctx.lane + 32 * m
                qr[m] = mq[qrow + kvl + ridx].to(Float32) if ridx < rope else Float32(0.0)
            o.fill(0.0)
            mrun, lrun = -Float32.inf, Float32(0.0)
            for t in cutlass.range(t0, tend, unroll=1):
                crow = _eoff(ctx.s_d1[2], ctx.s_d2[2], b, t, Int32(0))
                krow = _eoff(ctx.s_d1[3], ctx.s_d2[3], b, t, Int32(0))
                sl, srp = Float32(0.0), Float32(0.0)
                for m in cutlass.range_constexpr(LPL):
                    lidx = ctx.lane + 32 * m
                    if lidx < kvl:
                        sl = sl + qv[m] * cc[crow + lidx].to(Float32)
                for m in cutlass.range_constexpr(RPL):
                    ridx = ctx.lane + 32 * m
                    if ridx < rope:
                        srp = srp + qr[m] * kr[krow + ridx].to(Float32)
                # the reference's two bf16 einsums, their bf16 sum, then fp32 · scale
                s = bf16_round(bf16_round(warp_sum(sl)) + bf16_round(warp_sum(srp))) * cfg.mla_scale
                mnew = cute.arch.fmax(mrun, s)
                corr = exp_fast(mrun - mnew)
                pw = exp_fast(s - mnew)
                lrun = lrun * corr + pw
                for m in cutlass.range_constexpr(LPL):  # the cache row again (an L1 hit), instead of 16 registers
                    lidx = ctx.lane + 32 * m
                    if lidx < kvl:
                        o[m] = o[m] * corr + pw * cc[crow + lidx].to(Float32)
                mrun = mnew
            prow = _eoff(ctx.s_d1[4], ctx.s_d2[4], b, h, col0)
            for m in cutlass.range_constexpr(LPL):
                lidx = ctx.lane + 32 * m
                if lidx < kvl:
                    part[prow + lidx] = o[m]
            if ctx.lane == 0:
                part[prow + kvl] = mrun
                part[prow + kvl + 1] = lrun


@cute.jit
def op_mla_reduce(ctx: _Ctx) -> None:
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
    s_xbf = ctx.s_xbf
    acc = cute.make_rmem_tensor((BT,), Float32)
    for t in cutlass.range(cfg.nbt, unroll=1):
        nb = BT
        for h in cutlass.range(h0, h1, unroll=1):
            for idx in cutlass.range(ctx.tidx, nb * kvl, NT, unroll=1):  # merge the splits: o_lat in smem (bf16)
                bb, lidx = idx // kvl, idx % kvl
                prow = _eoff(ctx.s_d1[0], ctx.s_d2[0], t * BT + bb, h, Int32(0))
                mx = -Float32.inf
                for s in cutlass.range(ns, unroll=1):
                    mx = cute.arch.fmax(mx, part[prow + s * (kvl + 2) + kvl])
                num, den = Float32(0.0), Float32(0.0)
                for s in cutlass.range(ns, unroll=1):
                    a = exp_fast(part[prow + s * (kvl + 2) + kvl] - mx)  # empty splits: exp(-inf) = 0
                    num = num + a * part[prow + s * (kvl + 2) + lidx]
                    den = den + a * part[prow + s * (kvl + 2) + kvl + 1]
                s_xbf[idx] = (num / den).to(BFloat16)
            cute.arch.sync_threads()
            for d in cutlass.range(ctx.warp, dv, NW, unroll=1):  # absorb W_UV, output gate
                weight_row_dot(ctx.s_stage, staged, wrow0, (h - h0) * dv + d, Int32(kvl // VEC), ctx.s_xb, Int32(0),
                               Int32(kvl // VEC), True, None, acc, nb, cfg.unroll)
                for bb in cutlass.range_constexpr(nb):
                    y = bf16_round(warp_sum(acc[bb]))
                    if ctx.lane == bb % 32:
                        if gate != 0:
                            gr = mp[_eoff(ctx.s_d1[2], ctx.s_d2[2], t * BT + bb, Int32(0), g0 + h * dv + d)]
                            y = bf16_round(y * bf16_round(sigmoid(gr.to(Float32))))
                        out[_eoff(ctx.s_d1[io], ctx.s_d2[io], t * BT + bb, Int32(0), h * dv + d)] = y.to(BFloat16)
            cute.arch.sync_threads()


@cute.jit
def _dispatch(ctx: _Ctx, op: Int32) -> None:
    """One branch per opcode (all threads of the CTA take the same one, so barriers inside are legal). Families
    absent from the config (no KDA / MLA / MoE layers) compile to nothing."""
    cfg = ctx.cfg
    if op == OP_EMBED:
        op_embed(ctx)
    elif op == OP_ATTN_RES_MIX:
        op_attn_res_mix(ctx)
    elif op == OP_NORM_PROJ:
        op_norm_proj(ctx)
    elif op == OP_MLP_GATE_UP:
        op_mlp_gate_up(ctx)
    elif op == OP_O_PROJ_RESIDUAL:
        op_o_proj_residual(ctx)
    elif op == OP_FFN_OUT:
        op_ffn_out(ctx)
    elif op == OP_LM_HEAD:
        op_lm_head(ctx)
    elif op == OP_ARGMAX:
        op_argmax(ctx)
    else:
        if const_expr(cfg.dk > 0):
            if op == OP_KDA_STEP:
                op_kda_step(ctx)
        if const_expr(cfg.nh > 0):
            if op == OP_MLA_Q:
                op_mla_q(ctx)
            elif op == OP_MLA_KV_APPEND:
                op_mla_kv_append(ctx)
            elif op == OP_MLA_PARTIAL:
                op_mla_partial(ctx)
            elif op == OP_MLA_REDUCE:
                op_mla_reduce(ctx)
        if const_expr(cfg.E > 0):
            if op == OP_ROUTER:
                op_router(ctx)
            elif op == OP_EXPERT_GATE_UP:
                op_expert_gate_up(ctx)
            elif op == OP_EXPERT_DOWN:
                op_expert_down(ctx)


# ---------------------------------------------------------------------------------------------- the kernel
@cute.kernel
def megakernel_kernel(mProg: cute.Tensor, mBufs: cute.Tensor, mCtr: cute.Tensor, mTime: cute.Tensor,
                      mErr: cute.Tensor, mCtl: cute.Tensor, cfg: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    alloc = cutlass.memory.SmemAllocator()
    s_ins = C.smem_tensor(alloc, Int32, (INSTR_WORDS,), "megakernel")
    s_addr = C.smem_tensor(alloc, Int64, (MAX_OPERANDS,), "megakernel")
    s_d1 = C.smem_tensor(alloc, Int32, (MAX_OPERANDS,), "megakernel")
    s_d2 = C.smem_tensor(alloc, Int32, (MAX_OPERANDS,), "megakernel")
    s_pf = C.smem_tensor(alloc, Int32, (8,), "megakernel")
    stage = C.smem_tensor(alloc, BFloat16, (STAGE_CHUNKS * VEC,), "megakernel", align=128)
    s_stage = cute.make_tensor(stage.iterator, cute.make_layout((STAGE_CHUNKS, VEC), stride=(VEC, 1)))
    s_f32 = C.smem_tensor(alloc, Float32, (F32_WORDS,), "megakernel")
    s_i32 = C.smem_tensor(alloc, Int32, (I32_WORDS,), "megakernel")
    xb_chunks = -(-cfg.xb_elems // VEC)
    s_xbf = C.smem_tensor(alloc, BFloat16, (xb_chunks * VEC,), "megakernel", align=128)
    s_xb = cute.make_tensor(s_xbf.iterator, cute.make_layout((xb_chunks, VEC), stride=(VEC, 1)))
    ctx = _Ctx(cfg=cfg, tidx=tidx, warp=warp, lane=lane, s_ins=s_ins, s_addr=s_addr, s_d1=s_d1, s_d2=s_d2,
               s_pf=s_pf, s_stage=s_stage, s_f32=s_f32, s_i32=s_i32, s_xbf=s_xbf, s_xb=s_xb)
    cp_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)

    # Launch-invariant values live in smem, not registers: the opcode bodies need every register they can get
    # (ptxas allocates for the worst branch, and whatever is live across the dispatch counts against all of them).
    s_run = C.smem_tensor(alloc, Int32, (16,), "megakernel")
    s_t0 = C.smem_tensor(alloc, Int64, (1,), "megakernel")
    if tidx == 0:
        good = (mProg[0] == MAGIC) & (mProg[4] == INSTR_WORDS)
        s_run[RUN_Q] = mProg[H_Q] if good & (bidx < mProg[H_S]) else Int32(0)
        s_run[RUN_QLEN] = mProg[H_Q]
        s_run[RUN_OFF_BUF], s_run[RUN_OFF_CTR] = mProg[H_OFF_BUF], mProg[H_OFF_CTR]
        s_run[RUN_OFF_INS], s_run[RUN_OFF_Q] = mProg[H_OFF_INS], mProg[H_OFF_Q]
        s_run[RUN_STEP], s_run[RUN_SPINS], s_run[RUN_SLEEP] = mCtl[0], mCtl[1], mCtl[2]
        if (good == False) & (bidx == 0):  # noqa: E712  (a DSL Boolean, not a Python bool)
            mErr[0] = ERR_BAD_PROGRAM
    cute.arch.sync_threads()
    aborted = Int32(0)
    for q in cutlass.range(s_run[RUN_Q], unroll=1):
        v = mProg[s_run[RUN_OFF_Q] + bidx * s_run[RUN_QLEN] + q]
        if (v >= 0) & (aborted == 0):
            # ---- fetch: the instruction row, and per operand its buffer's address and dims
            if tidx < INSTR_WORDS:
                s_ins[tidx] = mProg[s_run[RUN_OFF_INS] + v * INSTR_WORDS + tidx]
            cute.arch.sync_threads()
            nops = s_ins[W_NOPS]
            if tidx < nops:
                buf = s_ins[W_OPS + OPERAND_WORDS * tidx]
                s_addr[tidx] = mBufs[buf]
                s_d1[tidx] = mProg[s_run[RUN_OFF_BUF] + buf * BUFFER_WORDS + 3]
                s_d2[tidx] = mProg[s_run[RUN_OFF_BUF] + buf * BUFFER_WORDS + 4]
            if tidx == 0:  # prefetch choice: the largest row-contiguous bf16 static weight marked PREFETCH
                off_buf = s_run[RUN_OFF_BUF]
                best, best_el = Int32(-1), Int32(0)
                for j in cutlass.range(nops, unroll=1):
                    o = W_OPS + OPERAND_WORDS * j
                    buf = s_ins[o]
                    d2 = mProg[off_buf + buf * BUFFER_WORDS + 4]
                    el = (s_ins[o + 2 + R1] - s_ins[o + 2 + R0]) * d2
                    ok = ((s_ins[o + 1] & MODE_PREFETCH) != 0) & (mProg[off_buf + buf * BUFFER_WORDS + 1] == DTYPE_BF16)
                    ok = ok & (s_ins[o + 2 + B1] - s_ins[o + 2 + B0] == 1) & (s_ins[o + 2 + C0] == 0)
                    ok = ok & (s_ins[o + 2 + C1] == d2) & (d2 % VEC == 0) & (el > best_el)
                    best, best_el = (j, el) if ok else (best, best_el)
                rows = Int32(0)
                if (best >= 0) & (s_ins[W_OP] != OP_EMBED):  # EMBED's table rows are data-dependent: no prefetch
                    d2 = mProg[off_buf + s_ins[W_OPS + OPERAND_WORDS * best] * BUFFER_WORDS + 4]
                    rows = best_el // d2
                    rows = rows if rows < (STAGE_CHUNKS * VEC) // d2 else (STAGE_CHUNKS * VEC) // d2
                    s_pf[2] = rows * (d2 // VEC)
                s_pf[0] = best if rows > 0 else Int32(-1)
                s_pf[1] = rows
            cute.arch.sync_threads()
            # ---- prefetch (before the waits: static weights only, so it cannot race with any writer)
            if s_pf[0] >= 0:
                src = gchunks(_row0(ctx, s_pf[0]))
                for c in cutlass.range(tidx, s_pf[2], NT, unroll=1):
                    cute.copy(cp_atom, src[(c, None)], s_stage[(c, None)])
            cute.arch.cp_async_commit_group()
            # ---- wait: counter[c] >= step * total[c] + target, bounded spin
            if tidx == 0:
                ok = Int32(1)
                for w in cutlass.range(s_ins[W_NWAITS], unroll=1):
                    c = s_ins[W_WAITS + 2 * w]
                    total = mProg[s_run[RUN_OFF_CTR] + c * COUNTER_WORDS]
                    target = s_run[RUN_STEP] * total + s_ins[W_WAITS + 2 * w + 1]
                    seen = cute.arch.load(mCtr.iterator + c, Int32, sem="acquire", scope="gpu")
                    spins = Int32(0)
                    while (seen < target) & (ok == 1):
                        nanosleep(s_run[RUN_SLEEP])
                        spins = spins + 1
                        if cute.arch.load(mErr.iterator, Int32, sem="relaxed", scope="gpu") != 0:
                            ok = Int32(0)  # another CTA tripped: leave instead of waiting for it
                        elif spins >= s_run[RUN_SPINS]:
                            ok = Int32(0)
                            old = cute.arch.atomic_cas(mErr.iterator, cmp=Int32(0), val=Int32(ERR_WATCHDOG),
                                                       sem="relaxed", scope="gpu")
                            if old == 0:  # first to trip: record where
                                mErr[1] = v
                                mErr[2] = c
                                mErr[3] = target
                                mErr[4] = seen
                                mErr[5] = bidx
                                mErr[6] = Int32(cute.arch.smid())
                                mErr[7] = s_run[RUN_STEP]
                        if ok == 1:
                            seen = cute.arch.load(mCtr.iterator + c, Int32, sem="acquire", scope="gpu")
                s_pf[3] = ok
                s_t0[0] = cute.arch.globaltimer()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # broadcasts thread 0's acquire (and the staged weights) to the CTA
            go = s_pf[3]
            if go != 0:
                _dispatch(ctx, s_ins[W_OP])
            else:
                aborted = Int32(1)
            signal, amount = s_ins[W_SIGNAL], s_ins[W_AMOUNT]  # read before the barrier: s_ins is refilled after it
            cute.arch.sync_threads()  # every thread's writes are done before the release
            if (tidx == 0) & (go != 0):
                if signal >= 0:
                    cute.arch.red(mCtr.iterator + signal, amount, op="add", dtype=Int32, sem="release", scope="gpu")
                mTime[v, 0] = s_t0[0]
                mTime[v, 1] = cute.arch.globaltimer()
                mTime[v, 2] = Int64(cute.arch.smid())


@cute.jit
def megakernel(mProg: cute.Tensor, mBufs: cute.Tensor, mCtr: cute.Tensor, mTime: cute.Tensor, mErr: cute.Tensor,
               mCtl: cute.Tensor, num_ctas: Int32, stream: Any, cfg: cutlass.Constexpr):
    """Launch ``num_ctas`` persistent CTAs (one per SM, all co-resident: a cooperative launch, so a grid the GPU
    cannot hold at once is refused by the driver instead of deadlocking)."""
    _check_static(cfg)
    megakernel_kernel(mProg, mBufs, mCtr, mTime, mErr, mCtl, cfg).launch(
        grid=[num_ctas, 1, 1], block=[NT, 1, 1], stream=stream, cooperative=True,
        min_blocks_per_mp=1)  # .minnctapersm 1: without it ptxas may aim at 2 CTAs/SM and spill at 64 registers


# ---------------------------------------------------------------------------------------------- host side
def _specs(cfg: MKConfig) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """name -> (dtype, static shape) of every tensor parameter, in call order."""
    return {"program": (Int32, (cfg.prog_words,)), "buffers": (Int64, (cfg.max_bufs,)),
            "counters": (Int32, (cfg.max_ctrs,)), "timings": (Int64, (cfg.max_instr, 3)),
            "error": (Int32, (ERROR_WORDS,)), "ctl": (Int32, (CTL_WORDS,))}


def config_from_shapes(**shapes: Any) -> MKConfig:
    names = {f.name for f in fields(MKConfig)}
    unknown = set(shapes) - names
    missing = names - set(shapes)
    if unknown or missing:
        raise ValueError(f"megakernel shapes: unknown {sorted(unknown)}, missing {sorted(missing)}")
    return MKConfig(**shapes)


def compile_for(arch: str, *, variant: str = "megakernel", tvm_ffi: bool = False, remark_file: str | None = None,
                **shapes: Any) -> Any:
    """Compile the megakernel for the static shapes of one config + batch (``kimik3.megakernel.gpu.static_shapes``);
    fake tensors, so no GPU is needed."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown megakernel variant {variant!r}; expected one of {VARIANTS}")
    cfg = config_from_shapes(**shapes)
    fakes = [C.fake(dt, shp) for dt, shp in _specs(cfg).values()]
    opts = C.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with C.arch_scope(arch):
        return cute.compile(megakernel, *fakes, Int32(1), C.fake_stream(tvm_ffi), cfg, options=opts)


def launch(compiled: Any, t: dict[str, Any], num_ctas: int, tvm_ffi: bool = True) -> None:
    """Run a compiled megakernel on CUDA tensors ``t`` (keys of ``_specs``) with ``num_ctas`` CTAs."""
    args = [t[k] for k in ("program", "buffers", "counters", "timings", "error", "ctl")]
    if tvm_ffi:
        compiled(*args, num_ctas)
        return
    import torch
    from cuda.bindings.driver import CUstream
    from cutlass.cute.runtime import from_dlpack

    wrapped = [from_dlpack(a, assumed_align=16) for a in args]
    compiled(*wrapped, Int32(num_ctas), CUstream(torch.cuda.current_stream().cuda_stream))


def shapes_of(cfg: MKConfig) -> dict[str, Any]:
    return asdict(cfg)
