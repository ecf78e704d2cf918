"""The persistent decode megakernel's VM: one CTA per SM walks its queue of the int32 program, once per decode step.

The program (``kimik3.megakernel.instructions``: opcodes, operand boxes, waits, signals, per-SM queues) is built once
on the host by the scheduler; this kernel is its interpreter. Per queue position it fetches the instruction's row,
streams the next position's weight stage, waits on its counters (with a watchdog), dispatches on the opcode to its
family's device function (``megakernel/gemv.py``, ``kda.py``, ``mla.py``, ``router.py``, ``moe.py``, ``misc.py``, on
the operand access of ``operands.py``; which elements an opcode touches: ``kernels/contracts/addr.py``), and signals.
This file is that loop and the compile-time config (``MKConfig``); each opcode's docstring says what it does
and its known limits.
Design (the loop step by step, barriers, counters, the CTA size): ``docs/architecture.md`` (map; appendix: the
megakernel VM). Compiled for sm_90a / sm_100a without a GPU (``tests/test_megakernel_compile.py``); the launch is
checked on a GPU by ``tests/test_megakernel_gpu.py``.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.experimental.primitives import nanosleep
from kimik3.kernels.common import device as C
from kimik3.kernels.contracts.isa import (
    BT_MAX,
    BUFFER_WORDS,
    BW_D1,
    BW_D2,
    BW_DTYPE,
    CHUNK_BYTES,
    COUNTER_WORDS,
    CTL_LOCAL,
    CTL_WORDS,
    CW_SOURCES,
    CW_TOTAL,
    ERR_BAD_PROGRAM,
    ERR_WATCHDOG,
    ERROR_WORDS,
    EXPERT_FORMATS,
    H_EXPERT_FORMAT,
    H_INSTR_WORDS,
    H_MAGIC,
    H_OFF_BUF,
    H_OFF_CBASE,
    H_OFF_CTR,
    H_OFF_INS,
    H_OFF_Q,
    H_Q,
    H_RANK,
    H_S,
    H_VERSION,
    H_WORLD,
    INSTR_WORDS,
    LOCAL_BUFFERS,
    LOCAL_COUNTERS,
    LOCAL_ERROR,
    LOCAL_FIELDS,
    LOCAL_PROGRAM,
    LOCAL_TABLE,
    LOCAL_TIMINGS,
    MAGIC,
    MAX_LOCAL,
    MAX_OPERANDS,
    MAX_WAITS,
    OPERAND_WORDS,
    OW_BUF,
    OW_MODE,
    PEER_TABLE,
    SMEM_CARVEOUT_PERCENT,
    STAGE_BUFFERS,
    STAGE_BYTES,
    VERSION,
    W_AMOUNT,
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
    W_SIGNAL,
    W_STAGE_CHUNKS,
    W_STAGE_OP,
    W_WAITS,
    Mode,
    Op,
)
from kimik3.kernels.megakernel.collective import (
    dtype_bytes,
    op_allreduce_mix,
    op_moe_combine,
    push_operand,
    signal_peers,
)
from kimik3.kernels.megakernel.device_fns import (
    NT,
    NW,
    VEC,
    gchunks,
)
from kimik3.kernels.megakernel.gemv import op_ffn_out, op_lm_head, op_mlp_gate_up, op_norm_proj, op_o_proj_residual
from kimik3.kernels.megakernel.kda import op_kda_step
from kimik3.kernels.megakernel.misc import op_argmax, op_attn_res_mix, op_embed
from kimik3.kernels.megakernel.mla import op_mla_kv_append, op_mla_partial, op_mla_q, op_mla_reduce
from kimik3.kernels.megakernel.moe import op_expert_down, op_expert_gate_up
from kimik3.kernels.megakernel.operands import F32_RED, F32_VEC, F32_WORDS, I32_WORDS, _Ctx, _kda_groups, _pad32, _row0  # noqa: F401
from kimik3.kernels.megakernel.router import op_router
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

SOURCE_HASH = kernel_source_hash("megakernel")

__all__ = ["MKConfig", "STAGE_BYTES", "STAGE_BUFFERS", "ERROR_WORDS", "CTL_WORDS", "ERR_WATCHDOG",
           "ERR_BAD_PROGRAM", "megakernel", "compile_for", "launch", "SOURCE_HASH", "VARIANTS"]

VARIANTS = ("megakernel",)
# The int32 program layout, the opcode numbers and the launch's error / control words come from
# kernels/contracts/isa.py, the one definition the host program (kimik3.megakernel.instructions) encodes with; it
# imports no torch.
# The weight stage: STAGE_BUFFERS buffers of STAGE_BYTES (isa.py: the host sizes the staged rows with them)
STAGE_CHUNKS = STAGE_BYTES // CHUNK_BYTES
WORDS_PER_CHUNK = CHUNK_BYTES // 4
ROW_CHUNKS = INSTR_WORDS // WORDS_PER_CHUNK  # one 16-byte copy per lane of warp 0 moves an instruction row
assert ROW_CHUNKS == 32 and CHUNK_BYTES == 2 * VEC
# s_run slots (launch invariants kept in shared memory; RUN_V: the queue entry of the position about to run; a
# rank program's rank, world and counter-word table: isa.H_RANK / H_WORLD / H_OFF_CBASE)
RUN_Q, RUN_QLEN, RUN_OFF_BUF, RUN_OFF_CTR, RUN_OFF_INS, RUN_OFF_Q, RUN_STEP, RUN_SPINS, RUN_SLEEP, RUN_V = range(10)
RUN_RANK, RUN_WORLD, RUN_CBASE, RUN_LOCAL = 10, 11, 12, 13
MODE_PUSH = int(Mode.PUSH)
# opcode numbers as plain ints (the dispatch compares them with traced Int32 values)
OP_EMBED, OP_ATTN_RES_MIX, OP_NORM_PROJ, OP_MLP_GATE_UP = int(Op.EMBED), int(Op.ATTN_RES_MIX), int(Op.NORM_PROJ), \
    int(Op.MLP_GATE_UP)
OP_KDA_STEP, OP_MLA_Q, OP_MLA_KV_APPEND, OP_MLA_PARTIAL = int(Op.KDA_STEP), int(Op.MLA_Q), int(Op.MLA_KV_APPEND), \
    int(Op.MLA_PARTIAL)
OP_MLA_REDUCE, OP_O_PROJ_RESIDUAL, OP_ROUTER, OP_EXPERT_GATE_UP = int(Op.MLA_REDUCE), int(Op.O_PROJ_RESIDUAL), \
    int(Op.ROUTER), int(Op.EXPERT_GATE_UP)
OP_EXPERT_DOWN, OP_FFN_OUT, OP_LM_HEAD, OP_ARGMAX = int(Op.EXPERT_DOWN), int(Op.FFN_OUT), int(Op.LM_HEAD), \
    int(Op.ARGMAX)
OP_ALLREDUCE_MIX, OP_ARGMAX_ALL, OP_MOE_COMBINE = int(Op.ALLREDUCE_MIX), int(Op.ARGMAX_ALL), int(Op.MOE_COMBINE)


@dataclass(frozen=True)
class MKConfig:
    """Everything the device code needs at compile time: widths from the model config, the batch size, the
    buffer capacities and the target architecture. (Box extents, tile sizes, buffer dims, the cache length and the
    SM count are read from the program at run time, so one compiled kernel serves every schedule of a config and
    batch size.)"""

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
    fp4: bool  # the routed experts are MXFP4 (codes + E8M0 scales, isa.MXFP4_OPERANDS); the program must say so
    # the kernel runs one rank's program of a deployment (megakernel/collective.py: the collective opcodes, pushes,
    # per-source counter words at system scope); a kernel without it refuses a rank program (ERR_BAD_PROGRAM)
    ranks: bool = False
    # the compile target (compile_for sets it): ptxas allocates registers per architecture, so some loop widths
    # depend on it (addr.gemv_unroll, moe.gate_up_pass / down_pass); the host execution runs the default
    # unless a case names another
    arch: str = "sm_90a"

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
        if const_expr(cfg.ranks):
            if op == OP_ALLREDUCE_MIX:
                op_allreduce_mix(ctx)
            elif op == OP_ARGMAX_ALL:  # the same walk over every rank's tiles (misc.argmax_pick)
                op_argmax(ctx)
            elif op == OP_MOE_COMBINE:
                op_moe_combine(ctx)
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
@cute.jit
def _row_chunks(mProg: cute.Tensor, off_ins: Int32, v: Int32) -> Any:
    """Instruction row ``v`` of the program in global memory as ``[chunk, 4]`` int32 (16-byte chunks)."""
    addr = mProg.iterator.toint() + (Int64(off_ins) + Int64(v) * INSTR_WORDS) * 4
    ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout((ROW_CHUNKS, WORDS_PER_CHUNK), stride=(WORDS_PER_CHUNK, 1)))


@cute.jit
def _spin(mCtr: cute.Tensor, mErr: cute.Tensor, c: Int32, target: Int32, v: Int32, bidx: Int32, step: Int32,
          max_spins: Int32, sleep_ns: Int32, word: Int32, SYS: cutlass.Constexpr = False) -> Int32:
    """Spin until counter word ``word`` (counter ``c``'s) reaches ``target`` (``ld.acquire.gpu``; ``.sys`` for a
    cross-rank word, written by a peer GPU; ``nanosleep`` back-off). Returns 1 when it holds, 0 when the watchdog
    tripped (this thread sets the error word if it is the first in the launch: CAS 0 -> 1, then the instruction,
    counter, target, value seen, CTA, SM and step) or another CTA's error word was seen."""
    ok = Int32(1)
    scope = "sys" if const_expr(SYS) else "gpu"
    seen = cute.arch.load(mCtr.iterator + word, Int32, sem="acquire", scope=scope)
    spins = Int32(0)
    while (seen < target) & (ok == 1):
        nanosleep(sleep_ns)
        spins = spins + 1
        if cute.arch.load(mErr.iterator, Int32, sem="relaxed", scope="gpu") != 0:
            ok = Int32(0)  # another CTA tripped: leave instead of waiting for it
        elif spins >= max_spins:
            ok = Int32(0)
            old = cute.arch.atomic_cas(mErr.iterator, cmp=Int32(0), val=Int32(ERR_WATCHDOG), sem="relaxed",
                                       scope="gpu")
            if old == 0:  # first to trip: record where
                mErr[1] = v
                mErr[2] = c
                mErr[3] = target
                mErr[4] = seen
                mErr[5] = bidx
                mErr[6] = Int32(cute.arch.smid())
                mErr[7] = step
        if ok == 1:
            seen = cute.arch.load(mCtr.iterator + word, Int32, sem="acquire", scope=scope)
    return ok


@cute.jit
def _counter_word(mProg: cute.Tensor, s_run: cute.Tensor, c: Int32) -> tuple[Int32, Int32]:
    """(first word in this rank's counter memory, sources) of counter ``c``: a rank program's table
    (``isa.H_OFF_CBASE``, ``CW_SOURCES``), else word ``c`` of a local counter."""
    base, srcs = c, Int32(0)
    if s_run[RUN_WORLD] > 0:
        base = mProg[s_run[RUN_CBASE] + c]
        srcs = mProg[s_run[RUN_OFF_CTR] + c * COUNTER_WORDS + CW_SOURCES]
    return base, srcs


@cute.jit
def _wait(mProg: cute.Tensor, mCtr: cute.Tensor, mErr: cute.Tensor, s_run: cute.Tensor, c: Int32, target: Int32,
          v: Int32, bidx: Int32, cfg: cutlass.Constexpr) -> Int32:
    """One wait of the instruction: its counter's word, or on a rank program each of a cross-rank counter's words (one
    per source rank, each written by that rank alone: ``kernels/contracts/peers.py``)."""
    ok = Int32(1)
    if const_expr(cfg.ranks):
        base, srcs = _counter_word(mProg, s_run, c)
        if srcs == 0:
            ok = _spin(mCtr, mErr, c, target, v, bidx, s_run[RUN_STEP], s_run[RUN_SPINS], s_run[RUN_SLEEP], base)
        else:
            for k in cutlass.range(srcs, unroll=1):
                if ok == 1:
                    ok = _spin(mCtr, mErr, c, target, v, bidx, s_run[RUN_STEP], s_run[RUN_SPINS], s_run[RUN_SLEEP],
                               base + k, True)
    else:
        ok = _spin(mCtr, mErr, c, target, v, bidx, s_run[RUN_STEP], s_run[RUN_SPINS], s_run[RUN_SLEEP], c)
    return ok


@cute.jit
def _push(ctx: _Ctx, mProg: cute.Tensor, s_run: cute.Tensor, mPeer: cute.Tensor) -> None:
    """After the body: every PUSH operand's box copied to the other ranks of the instruction's peer range
    (``collective.push_operand``), between a barrier that orders every thread's stores before any copy and the
    VM's barrier before the release that publishes them. CTA-uniform: the peer range is the instruction's."""
    lo, hi = ctx.s_ins[W_PEER_LO], ctx.s_ins[W_PEER_HI]
    if hi > lo:
        cute.arch.sync_threads()
        for j in cutlass.range(ctx.s_ins[W_NOPS], unroll=1):
            if (ctx.s_ins[W_OPS + OPERAND_WORDS * j + OW_MODE] & MODE_PUSH) != 0:
                buf = ctx.s_ins[W_OPS + OPERAND_WORDS * j + OW_BUF]
                esz = dtype_bytes(mProg[s_run[RUN_OFF_BUF] + buf * BUFFER_WORDS + BW_DTYPE])
                push_operand(ctx, j, esz, s_run[RUN_RANK], lo, hi, mPeer)


@cute.jit
def _local_rank(mCtl: cute.Tensor, bidx: Int32, grid: Int32) -> tuple[Int32, Int32, Int32]:
    """(local ranks L of the launch, this CTA's local rank, its CTA index within that rank): ``isa.CTL_LOCAL``; L of
    0 or 1, or one the grid does not split into, runs the launch's own tensors as one rank."""
    nloc = mCtl[CTL_LOCAL]
    split = (nloc > 1) & (nloc <= MAX_LOCAL)
    cpr = grid // nloc if split else grid
    split = split & (cpr * nloc == grid)
    lr = bidx // cpr if split else Int32(0)
    return (nloc if split else Int32(1)), lr, (bidx - lr * cpr if split else bidx)


@cute.jit
def _mine(cfg: cutlass.Constexpr, s_run: cute.Tensor, mLocal: cute.Tensor, k: cutlass.Constexpr,
          t: cute.Tensor) -> Any:
    """Launch argument ``t`` (field ``k`` of ``isa.LOCAL_PROGRAM`` .. ``LOCAL_ERROR``) as this CTA's rank has it:
    ``t`` itself on one GPU's kernel or a launch of one rank, else its layout on the local rank's table entry
    (``s_run[RUN_LOCAL]``). Called at each use: a base read from the table is not kept live in registers across
    the opcode bodies (a kernel argument costs none)."""
    if const_expr(cfg.ranks):
        at = s_run[RUN_LOCAL]
        addr = t.iterator.toint() if at < 0 else mLocal[cutlass.max(at, 0) + k]
        t = cute.make_tensor(cute.make_ptr(t.element_type, addr, cute.AddressSpace.gmem, assumed_align=16),
                             t.layout)
    return t


@cute.kernel
def megakernel_kernel(mProg: cute.Tensor, mBufs: cute.Tensor, mCtr: cute.Tensor, mTime: cute.Tensor,
                      mErr: cute.Tensor, mCtl: cute.Tensor, mPeer: cute.Tensor, mLocal: cute.Tensor,
                      cfg: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    alloc = cutlass.memory.SmemAllocator()
    s_ins = C.smem_tensor(alloc, Int32, (INSTR_WORDS,), "megakernel")
    # the next instruction's row lands here (cp.async, warp 0) while this one runs; warp 0 moves it into s_ins
    s_nxt = C.smem_tensor(alloc, Int32, (INSTR_WORDS,), "megakernel")
    s_nxt4 = cute.make_tensor(s_nxt.iterator, cute.make_layout((ROW_CHUNKS, WORDS_PER_CHUNK),
                                                               stride=(WORDS_PER_CHUNK, 1)))
    s_addr = C.smem_tensor(alloc, Int64, (MAX_OPERANDS,), "megakernel")
    s_d1 = C.smem_tensor(alloc, Int32, (MAX_OPERANDS,), "megakernel")
    s_d2 = C.smem_tensor(alloc, Int32, (MAX_OPERANDS,), "megakernel")
    s_wok = C.smem_tensor(alloc, Int32, (MAX_WAITS,), "megakernel")  # per wait: 1 = satisfied, 0 = watchdog/error
    s_tw = C.smem_tensor(alloc, Int64, (MAX_WAITS,), "megakernel")  # per wait: %globaltimer when it was satisfied
    stage = C.smem_tensor(alloc, BFloat16, (STAGE_BUFFERS * STAGE_CHUNKS * VEC,), "megakernel", align=128)
    stages = cute.make_tensor(stage.iterator, cute.make_layout((STAGE_CHUNKS, VEC, STAGE_BUFFERS),
                                                               stride=(VEC, 1, STAGE_CHUNKS * VEC)))
    s_f32 = C.smem_tensor(alloc, Float32, (F32_WORDS,), "megakernel")
    s_i32 = C.smem_tensor(alloc, Int32, (I32_WORDS,), "megakernel")
    xb_chunks = -(-cfg.xb_elems // VEC)
    s_xbf = C.smem_tensor(alloc, BFloat16, (xb_chunks * VEC,), "megakernel", align=128)
    s_xb = cute.make_tensor(s_xbf.iterator, cute.make_layout((xb_chunks, VEC), stride=(VEC, 1)))
    cp_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)
    cp_row = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), Int32,
                                 num_bits_per_copy=128)

    # Launch-invariant values live in smem, not registers: the opcode bodies need every register they can get
    # (ptxas allocates for the worst branch, and whatever is live across the dispatch counts against all of them).
    s_run = C.smem_tensor(alloc, Int32, (16,), "megakernel")
    if const_expr(cfg.ranks):
        # several ranks in this one launch (isa.CTL_LOCAL): this CTA's rank and its entries of the local table
        grid, _, _ = cute.arch.grid_dim()
        nloc, lr, bidx = _local_rank(mCtl, bidx, grid)
        if tidx == 0:
            s_run[RUN_LOCAL] = Int32(-1) if nloc == 1 else lr * LOCAL_FIELDS
        cute.arch.sync_threads()
    lProg = _mine(cfg, s_run, mLocal, LOCAL_PROGRAM, mProg)
    lCtr = _mine(cfg, s_run, mLocal, LOCAL_COUNTERS, mCtr)
    lErr = _mine(cfg, s_run, mLocal, LOCAL_ERROR, mErr)
    if tidx == 0:
        good = (lProg[H_MAGIC] == MAGIC) & (lProg[H_VERSION] == VERSION) & (lProg[H_INSTR_WORDS] == INSTR_WORDS)
        good = good & (lProg[H_OFF_INS] % WORDS_PER_CHUNK == 0)  # rows are copied 16 bytes at a time
        # the expert opcodes read the routed experts in the one format the kernel was compiled for
        good = good & (lProg[H_EXPERT_FORMAT] == EXPERT_FORMATS.index("mxfp4" if cfg.fp4 else "dense"))
        world = lProg[H_WORLD]
        if const_expr(cfg.ranks):
            # a rank program: its rank inside the world, and its own peer-table entry this launch's counter memory
            # (a push or signal to rank p moves by the entries' distance: a wrong table writes another's memory)
            rk = lProg[H_RANK]
            inside = (rk >= 0) & (rk < world) & (world <= PEER_TABLE)
            good = good & ((world == 0) | (inside & (mPeer[rk if inside else 0] == lCtr.iterator.toint())))
            s_run[RUN_RANK], s_run[RUN_WORLD], s_run[RUN_CBASE] = rk, world, lProg[H_OFF_CBASE]
        else:
            good = good & (world == 0)  # a kernel built for one GPU refuses a rank program
        nq = lProg[H_Q] if good & (bidx < lProg[H_S]) else Int32(0)
        s_run[RUN_Q] = nq
        s_run[RUN_QLEN] = lProg[H_Q]
        s_run[RUN_OFF_BUF], s_run[RUN_OFF_CTR] = lProg[H_OFF_BUF], lProg[H_OFF_CTR]
        s_run[RUN_OFF_INS], s_run[RUN_OFF_Q] = lProg[H_OFF_INS], lProg[H_OFF_Q]
        s_run[RUN_STEP], s_run[RUN_SPINS], s_run[RUN_SLEEP] = mCtl[0], mCtl[1], mCtl[2]
        v0 = Int32(-1)
        if nq > 0:
            v0 = lProg[lProg[H_OFF_Q] + bidx * lProg[H_Q]]
        s_run[RUN_V] = v0
        if (good == False) & (bidx == 0):  # noqa: E712  (a DSL Boolean, not a Python bool)
            lErr[0] = ERR_BAD_PROGRAM
    cute.arch.sync_threads()
    ahead = Int32(0)  # 1 when the previous queue position ran: it has issued this one's row and stage copies
    aborted = Int32(0)
    for q in cutlass.range(s_run[RUN_Q], unroll=1):
        v = s_run[RUN_V]
        pProg = _mine(cfg, s_run, mLocal, LOCAL_PROGRAM, mProg)
        pBufs = _mine(cfg, s_run, mLocal, LOCAL_BUFFERS, mBufs)
        pCtr = _mine(cfg, s_run, mLocal, LOCAL_COUNTERS, mCtr)
        pErr = _mine(cfg, s_run, mLocal, LOCAL_ERROR, mErr)
        par = q % STAGE_BUFFERS
        s_stage = stages[(None, None, par)]  # this instruction's stage buffer (the next one fills the other)
        # the same buffer as fp32 scratch, for the opcodes that stage nothing (isa.STAGE_SCRATCH_OPS)
        s_part = cute.make_tensor(cute.recast_ptr(s_stage.iterator, dtype=Float32), cute.make_layout(STAGE_BYTES // 4))
        ctx = _Ctx(cfg=cfg, tidx=tidx, warp=warp, lane=lane, s_ins=s_ins, s_addr=s_addr, s_d1=s_d1, s_d2=s_d2,
                   s_stage=s_stage, s_part=s_part, s_f32=s_f32, s_i32=s_i32, s_xbf=s_xbf, s_xb=s_xb)
        if (v >= 0) & (aborted == 0):
            # ---- fetch: warp 0 moves the row (prefetched by the previous position, else copied now) into s_ins
            if warp == 0:
                if ahead == 0:
                    cute.copy(cp_row, _row_chunks(pProg, s_run[RUN_OFF_INS], v)[(lane, None)], s_nxt4[(lane, None)])
                    cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)  # warp 0's groups hold only rows: this is the row landing
                for k in cutlass.range_constexpr(WORDS_PER_CHUNK):
                    s_ins[lane * WORDS_PER_CHUNK + k] = s_nxt[lane * WORDS_PER_CHUNK + k]
            cute.arch.sync_threads()
            # per operand its buffer's address and dims (warp 1, one lane per operand, all in flight at once)
            nops = s_ins[W_NOPS]
            if (warp == 1) & (lane < nops):
                buf = s_ins[W_OPS + OPERAND_WORDS * lane + OW_BUF]
                s_addr[lane] = pBufs[buf]
                s_d1[lane] = pProg[s_run[RUN_OFF_BUF] + buf * BUFFER_WORDS + BW_D1]
                s_d2[lane] = pProg[s_run[RUN_OFF_BUF] + buf * BUFFER_WORDS + BW_D2]
            # ---- stage copies (warps 1..): static weights only, so they may precede the waits
            if ahead == 0:  # first position (or after a gap): this instruction's own stage, from W_STAGE_*
                cute.arch.sync_threads()  # _row0 reads the operand table
                sj = s_ins[W_STAGE_OP]
                if (sj >= 0) & (warp > 0):
                    src = gchunks(_row0(ctx, sj))
                    for c in cutlass.range(tidx - 32, s_ins[W_STAGE_CHUNKS], NT - 32, unroll=1):
                        cute.copy(cp_atom, src[(c, None)], s_stage[(c, None)])
                cute.arch.cp_async_commit_group()
            nbuf = s_ins[W_NEXT_BUF]
            if (nbuf >= 0) & (warp > 0):  # the next position's stage, into the other buffer
                elem = (Int64(s_ins[W_NEXT_ELEM_HI]) << 32) | (Int64(s_ins[W_NEXT_ELEM_LO]) & Int64(0xFFFFFFFF))
                src = gchunks(pBufs[nbuf] + elem * 2)
                dst = stages[(None, None, 1 - par)]
                for c in cutlass.range(tidx - 32, s_ins[W_NEXT_CHUNKS], NT - 32, unroll=1):
                    cute.copy(cp_atom, src[(c, None)], dst[(c, None)])
            cute.arch.cp_async_commit_group()  # an empty group when nothing is staged: one group per position
            # ---- wait: lane w of warp 0 spins on wait w (all waits in flight at once)
            nw = s_ins[W_NWAITS]
            if warp == 0:
                # the next position's queue entry (static program data), loaded with the waits' first round trip
                vn = Int32(-1)
                if q + 1 < s_run[RUN_Q]:
                    vn = pProg[s_run[RUN_OFF_Q] + bidx * s_run[RUN_QLEN] + q + 1]
                if lane < nw:
                    c = s_ins[W_WAITS + 2 * lane]
                    target = s_run[RUN_STEP] * pProg[s_run[RUN_OFF_CTR] + c * COUNTER_WORDS + CW_TOTAL] + \
                        s_ins[W_WAITS + 2 * lane + 1]
                    s_wok[lane] = _wait(pProg, pCtr, pErr, s_run, c, target, v, bidx, cfg)
                if (lane < nw) | (lane == 0):
                    s_tw[lane] = cute.arch.globaltimer()
                # the next position's row (one 16-byte chunk per lane), in flight during this body
                if vn >= 0:
                    cute.copy(cp_row, _row_chunks(pProg, s_run[RUN_OFF_INS], vn)[(lane, None)], s_nxt4[(lane, None)])
                cute.arch.cp_async_commit_group()
                if lane == 0:
                    s_run[RUN_V] = vn
            cute.arch.cp_async_wait_group(1)  # own stage landed; the most recent group (next stage / row) in flight
            cute.arch.sync_threads()  # broadcasts the waits' acquires, the operand table and the stage to the CTA
            go = Int32(1)
            for w in cutlass.range_constexpr(MAX_WAITS):
                if w < nw:
                    go = go & s_wok[w]
            if go != 0:
                _dispatch(ctx, s_ins[W_OP])
                if const_expr(cfg.ranks):
                    _push(ctx, _mine(cfg, s_run, mLocal, LOCAL_PROGRAM, mProg), s_run, mPeer)
            else:
                aborted = Int32(1)
            # read before the barrier: warp 0 refills s_ins right after it (the next position's fetch)
            signal, amount = s_ins[W_SIGNAL], s_ins[W_AMOUNT]
            peer_lo, peer_hi = s_ins[W_PEER_LO], s_ins[W_PEER_HI]
            t0 = s_tw[0]
            for w in cutlass.range_constexpr(1, MAX_WAITS):
                if w < s_ins[W_NWAITS]:
                    t0 = t0 if t0 > s_tw[w] else s_tw[w]
            cute.arch.sync_threads()  # every thread's writes are done before the release
            aProg = _mine(cfg, s_run, mLocal, LOCAL_PROGRAM, mProg)
            aCtr = _mine(cfg, s_run, mLocal, LOCAL_COUNTERS, mCtr)
            aTime = _mine(cfg, s_run, mLocal, LOCAL_TIMINGS, mTime)
            if (tidx == 0) & (go != 0):
                if signal >= 0:
                    if const_expr(cfg.ranks):
                        base, srcs = _counter_word(aProg, s_run, signal)
                        if srcs == 0:
                            cute.arch.red(aCtr.iterator + base, amount, op="add", dtype=Int32, sem="release",
                                          scope="gpu")
                        else:  # this rank's word of the counter, on every rank of the peer range
                            signal_peers(aCtr.iterator.toint() + Int64(base + s_run[RUN_RANK]) * 4, amount,
                                         s_run[RUN_RANK], peer_lo, peer_hi, mPeer)
                    else:
                        cute.arch.red(aCtr.iterator + signal, amount, op="add", dtype=Int32, sem="release",
                                      scope="gpu")
                aTime[v, 0] = t0
                aTime[v, 1] = cute.arch.globaltimer()
                aTime[v, 2] = Int64(cute.arch.smid())
            ahead = Int32(1)
        else:  # a gap in the queue, or the launch is aborting: nothing was staged for the next position
            cute.arch.cp_async_wait_group(0)  # no copy of an earlier position may land in a buffer reused after it
            cute.arch.sync_threads()  # every thread has read RUN_V
            if tidx == 0:
                vn = Int32(-1)
                if q + 1 < s_run[RUN_Q]:
                    vn = pProg[s_run[RUN_OFF_Q] + bidx * s_run[RUN_QLEN] + q + 1]
                s_run[RUN_V] = vn
            cute.arch.sync_threads()
            ahead = Int32(0)
    cute.arch.cp_async_wait_group(0)  # an aborted CTA leaves no copy in flight into its shared memory



@cute.jit
def megakernel(mProg: cute.Tensor, mBufs: cute.Tensor, mCtr: cute.Tensor, mTime: cute.Tensor, mErr: cute.Tensor,
               mCtl: cute.Tensor, mPeer: cute.Tensor, mLocal: cute.Tensor, num_ctas: Int32, stream: Any,
               cfg: cutlass.Constexpr):
    """Launch ``num_ctas`` persistent CTAs (one per SM, all co-resident: a cooperative launch, so a grid the GPU
    cannot hold at once is refused by the driver instead of deadlocking)."""
    _check_static(cfg)
    megakernel_kernel(mProg, mBufs, mCtr, mTime, mErr, mCtl, mPeer, mLocal, cfg).launch(
        grid=[num_ctas, 1, 1], block=[NT, 1, 1], stream=stream, cooperative=True,
        min_blocks_per_mp=1,  # .minnctapersm 1: without it ptxas may aim at 2 CTAs/SM and spill
        preferred_smem_carveout=SMEM_CARVEOUT_PERCENT)  # set, not left to the driver's default (isa.py)


# ---------------------------------------------------------------------------------------------- host side
def _specs(cfg: MKConfig) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """name -> (dtype, static shape) of every tensor parameter, in call order."""
    return {"program": (Int32, (cfg.prog_words,)), "buffers": (Int64, (cfg.max_bufs,)),
            "counters": (Int32, (cfg.max_ctrs,)), "timings": (Int64, (cfg.max_instr, 3)),
            "error": (Int32, (ERROR_WORDS,)), "ctl": (Int32, (CTL_WORDS,)), "peers": (Int64, (PEER_TABLE,)),
            "local": (Int64, (LOCAL_TABLE,))}


def config_from_shapes(**shapes: Any) -> MKConfig:
    """The ``MKConfig`` of static shapes (``kimik3.megakernel.gpu.static_shapes``): every field without a default
    is required; ``arch`` is optional (default sm_90a, the figures the host execution runs)."""
    names = {f.name for f in fields(MKConfig)}
    required = {f.name for f in fields(MKConfig) if f.default is MISSING and f.default_factory is MISSING}
    unknown = set(shapes) - names
    missing = required - set(shapes)
    if unknown or missing:
        raise ValueError(f"megakernel shapes: unknown {sorted(unknown)}, missing {sorted(missing)}")
    if "arch" in shapes and shapes["arch"] not in dsl.SUPPORTED_ARCHS:
        raise ValueError(f"megakernel shapes: unsupported arch {shapes['arch']!r}; expected one of "
                         f"{dsl.SUPPORTED_ARCHS}")
    return MKConfig(**shapes)


def compile_for(arch: str, *, variant: str = "megakernel", tvm_ffi: bool = False, remark_file: str | None = None,
                **shapes: Any) -> Any:
    """Compile the megakernel for the static shapes of one config + batch (``kimik3.megakernel.gpu.static_shapes``);
    fake tensors, so no GPU is needed."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown megakernel variant {variant!r}; expected one of {VARIANTS}")
    cfg = replace(config_from_shapes(**shapes), arch=arch)  # the loop widths follow the target (MKConfig.arch)
    fakes = [dsl.fake(dt, shp) for dt, shp in _specs(cfg).values()]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(megakernel, *fakes, Int32(1), dsl.fake_stream(tvm_ffi), cfg, options=opts)


def launch(compiled: Any, t: dict[str, Any], num_ctas: int, tvm_ffi: bool = True) -> None:
    """Run a compiled megakernel on CUDA tensors ``t`` (keys of ``_specs``) with ``num_ctas`` CTAs."""
    args = [t[k] for k in ("program", "buffers", "counters", "timings", "error", "ctl", "peers", "local")]
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
