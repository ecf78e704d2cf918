"""The megakernel's program on the host, shared by the opcode drivers (the MoE opcodes: ``host_exec_mk_moe.py``; the
misc opcodes EMBED, ATTN_RES_MIX, ARGMAX of ``kernels/megakernel/misc.py``: below), instruction by instruction of a
real program (``kimik3.megakernel.build_program``; the cases: ``host_exec_router.py``).

The instruction's words, its operands' addresses and dims are what the VM's fetch puts in shared memory (here host
tensors holding the same words; the addresses point at CPU buffers), and the helpers the opcode calls decide which
token / chunk / thread a lane or thread handles; every store goes through ``host_exec._Writes`` into NaN-poisoned
outputs (element offsets decomposed into ``[b, r, c]`` of the operand's buffer, so a store outside the declared box is
reported too). The reference is the CPU interpreter's implementation of the opcode
(``kimik3.megakernel.interpreter``) on the same input buffers. The misc opcodes' thin layer (the CTA reduction, the
AttnRes softmax: approximate on the GPU, exact fp32 here) is replayed in Python in the kernel's order.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr
from kimik3.kernels.common.trace import host_trace
from kimik3.kernels.verify.host_exec import LANES, HostRun, _t, _Writes, warp_sum

__all__ = ["exec_misc", "exec_mix", "compare_outputs"]

_DRIVERS: dict[tuple[str, Any], Any] = {}
_COMPILED: dict[tuple[Any, ...], Any] = {}


def _launch(drive: Any, args: list[Any], consts: tuple[Any, ...] = ()) -> None:
    """Call a host driver: traced and compiled once per driver, argument shapes and constants (tracing costs far
    more than running), then called on the tensors' current contents. ``consts`` are the trailing Constexprs."""
    sig = (id(drive), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else "i32" for a in args),
           consts)
    wrapped = [_t(a) if isinstance(a, torch.Tensor) else Int32(a) for a in args]
    if sig not in _COMPILED:
        with host_trace():
            _COMPILED[sig] = cute.compile(drive, *wrapped, *consts)
    _COMPILED[sig](*wrapped)


def _ctx(M: ModuleType, cfg: Any, mIns: Any, mAddr: Any, mD1: Any, mD2: Any, mI32: Any = None, mF32: Any = None,
         mPart: Any = None) -> Any:
    """The opcode's context as the VM's fetch leaves it (instruction words, operand addresses and dims), with host
    tensors in place of shared memory (``mPart``: the stage buffer as fp32 scratch, ``s_part``); no thread indices: the
    drivers pass lanes and threads explicitly."""
    return M._Ctx(cfg=cfg, s_ins=mIns, s_addr=mAddr, s_d1=mD1, s_d2=mD2, s_i32=mI32, s_f32=mF32, s_part=mPart)


def _scratch() -> tuple[torch.Tensor, torch.Tensor]:
    """The CTA's int32 / fp32 scratch (shared memory on the GPU) as a previous instruction may leave it: poison."""
    from kimik3.kernels.megakernel import operands as mk_operands

    return (torch.full((mk_operands.I32_WORDS,), -77777, dtype=torch.int32),
            torch.full((mk_operands.F32_WORDS,), float("nan")))


_PROGRAMS: dict[tuple[Any, ...], Any] = {}


class _MkSetup:
    """A megakernel program and CPU buffers for the opcodes under test: instruction words as the device reads
    them, every referenced buffer allocated at its declared shape (weights untouched until needed: the experts'
    rows are filled per instruction, so k3-shard expert tensors cost only the rows an instruction reads), inputs
    random, and the interpreter's opcode bodies run in program order so each instruction reads what its
    producers wrote."""

    def __init__(self, preset: str, batch: int, *, policy: str = "critical_path", sms: int | None = None,
                 seed: int = 0, expert_format: str = "dense", tiling: dict[str, int] | None = None,
                 arch: str = "sm_90a", world: int = 1, rank: int = 0) -> None:
        from kimik3.kernels.contracts import isa
        from kimik3.kernels.megakernel.vm import config_from_shapes

        from kimik3.megakernel import build_program, encode_program
        from kimik3.megakernel.gpu import static_shapes
        from kimik3.megakernel.ranks import Shard
        from kimik3.model.config import get_preset

        self.cfg = get_preset(preset)
        shard = Shard(world, world, rank)  # world > 1: one rank's program (its kernel: MKConfig.ranks)
        sms = sms or (132 if preset == "k3-shard" else 8)
        key = (preset, batch, sms, policy, expert_format, tuple(sorted((tiling or {}).items())), world, rank)
        if key not in _PROGRAMS:  # cases of one process share the (slow to build at k3-shard) program
            tiles = None
            if tiling:  # some tile sizes other than the automatic ones (e.g. odd EXPERT_DOWN row tiles)
                import dataclasses

                from kimik3.megakernel.step import Tiling

                tiles = dataclasses.replace(Tiling.auto(self.cfg, batch, sms), **tiling)
            prog = build_program(preset, batch, sms, policy=policy, tiling=tiles, expert_format=expert_format,
                                 shard=shard)
            _PROGRAMS[key] = (prog, encode_program(prog))
        self.p, self.enc = _PROGRAMS[key]
        # arch: the compile target whose loop widths the opcodes take (MKConfig.arch)
        self.mk = config_from_shapes(**static_shapes(shard.slice_of(self.cfg), batch, expert_format=expert_format),
                                     arch=arch)
        self.B = batch
        self.isa = isa
        self.g = torch.Generator().manual_seed(seed)
        self.bufs: dict[int, torch.Tensor] = {}
        self.ties = False
        self.crowd = False

    # -- instruction words as the fetch leaves them
    def words(self, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        A = self.isa
        e = self.enc
        off_ins, off_buf = int(e[A.H_OFF_INS]), int(e[A.H_OFF_BUF])
        ins = e[off_ins + v * A.INSTR_WORDS: off_ins + (v + 1) * A.INSTR_WORDS].clone()
        addr = torch.zeros(A.MAX_OPERANDS, dtype=torch.int64)
        d1 = torch.zeros(A.MAX_OPERANDS, dtype=torch.int32)
        d2 = torch.zeros(A.MAX_OPERANDS, dtype=torch.int32)
        for j, o in enumerate(self.p.instructions[v].operands):
            addr[j] = self.buf(o.buf).data_ptr()
            d1[j] = e[off_buf + o.buf * A.BUFFER_WORDS + A.BW_D1]
            d2[j] = e[off_buf + o.buf * A.BUFFER_WORDS + A.BW_D2]
        return ins, addr, d1, d2

    def buf(self, k: int) -> torch.Tensor:
        if k not in self.bufs:
            spec = self.p.buffers[k]
            n = spec.shape[0] * spec.shape[1] * spec.shape[2]
            if spec.kind.name == "WEIGHT" and n > 1 << 22:  # expert / embedding tables: zero until rows are filled
                t = torch.zeros(spec.shape, dtype=spec.dtype)
            else:
                t = self._rand(spec.name, spec.shape, spec.dtype)
            self.bufs[k] = t
        return self.bufs[k]

    def _rand(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        g = self.g
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) < 0.5
        if dtype == torch.int64:
            hi = self.cfg.vocab_size if name == "ids" else max(2, shape[-1])
            return torch.randint(0, hi, shape, generator=g)
        if dtype == torch.bfloat16:
            return (torch.randn(shape, generator=g) * shape[-1] ** -0.25).to(dtype)
        if dtype == torch.uint8:  # MXFP4 experts: any code byte; E8M0 scales around the dense weights' magnitude
            if name.endswith("_scale"):
                e0 = _scale_exponent(shape[-1] * 32)
                return torch.randint(e0 - 1, e0 + 2, shape, generator=g, dtype=torch.uint8)
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        scale = 0.05 if "bias" in name else 1.0
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) * scale

    def fill_rows(self, k: int, first: list[int], r0: int, r1: int) -> None:
        """Random rows [r0, r1) of slices ``first`` of a lazily allocated weight (once; the rest stays zero, so a
        read of a row nobody filled gives a wrong value)."""
        t = self.buf(k)
        if t.numel() <= 1 << 22:
            return
        for e in first:
            if not t[e, r0:r1].any():
                if t.dtype == torch.uint8:  # MXFP4 codes / scales
                    t[e, r0:r1] = self._rand(self.p.buffers[k].name, (r1 - r0, t.shape[2]), t.dtype)
                else:
                    t[e, r0:r1] = (torch.randn(r1 - r0, t.shape[2], generator=self.g) * t.shape[2] ** -0.5).to(
                        t.dtype)

    def extent(self, op: Any) -> tuple[int, int]:
        """(most slots, most work items of a warp) over the program's instructions of ``op`` (items of
        ``megakernel.moe.row_tile`` rows)."""
        from kimik3.kernels.megakernel.device_fns import NW
        from kimik3.kernels.megakernel.moe import row_tile

        per = NW * row_tile(self.mk)
        ins = [i for i in self.p.instructions if i.op == op]
        return (max(max(i.args[1] - i.args[0], 1) for i in ins),
                max(-(-(i.args[3] - i.args[2]) // per) for i in ins))

    def views(self, v: int) -> list[torch.Tensor]:
        return [self.buf(o.buf)[o.slices()] for o in self.p.instructions[v].operands]


def _scale_exponent(fan_in: int) -> int:
    """The E8M0 byte whose scale makes MXFP4 weights (|E2M1| ~ 2 on average) ~ fan_in^-0.5, as the dense ones."""
    return 127 - round(math.log2(2.0 * fan_in**0.5))


def _decompose(off: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d1, d2 = shape[1], shape[2]
    off = off.long()
    return off // (d1 * d2), (off // d2) % d1, off % d2


def _box_mask(shape: tuple[int, ...], box: tuple[int, ...]) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.bool)
    b0, b1, r0, r1, c0, c1 = box
    m[b0:b1, r0:r1, c0:c1] = True
    return m


def _store(wr: _Writes, shape: tuple[int, ...], box: tuple[int, ...], off: torch.Tensor, values: torch.Tensor,
           who: str) -> None:
    """Store at flat element offsets of a [d0, d1, d2] buffer; offsets outside the declared box are reported."""
    b, r, c = _decompose(off, shape)
    inside = (off >= 0) & (off < shape[0] * shape[1] * shape[2])
    b0, b1, r0, r1, c0, c1 = box
    inbox = inside & (b >= b0) & (b < b1) & (r >= r0) & (r < r1) & (c >= c0) & (c < c1)
    if not inbox.all():
        k = int((~inbox).nonzero()[0, 0])
        wr.problems.append(f"{wr.name}: {who} stores element {int(off.reshape(-1)[k])} = [{int(b.reshape(-1)[k])}, "
                           f"{int(r.reshape(-1)[k])}, {int(c.reshape(-1)[k])}] outside the declared box {box}")
    wr.store((b, r, c), values, who)


def _prepare(S: _MkSetup, v: int) -> None:
    """Inputs of instruction v that the random setup does not make meaningful: the rows of lazily allocated
    weights it reads; in ``ties`` mode the router logits on a coarse grid with no bias (equal choice scores: the
    tie-break decides); in ``crowd`` mode expert 0's selection bias so high that every token picks it (one expert with
    the whole batch, others with none: checked at the experts); the arg-max's per-tile maxima on a coarse grid (equal
    maxima: the first must win)."""
    ins = S.p.instructions[v]
    op = ins.op.name
    if op == "ROUTER" and S.ties:
        lg, bias = S.buf(ins.operands[0].buf), S.buf(ins.operands[1].buf)
        lg.copy_(torch.round(lg * 2) / 2)
        bias.zero_()
    elif op == "ROUTER" and S.crowd:
        S.buf(ins.operands[1].buf).view(-1)[0] = 1e4
    elif op in ("EXPERT_GATE_UP", "EXPERT_DOWN"):
        if S.crowd and op == "EXPERT_DOWN" and not S.views(v)[2].bool().all(0).any():  # (it sees every slot)
            raise ValueError(f"crowd: no slot of {ins.label()} holds every token (the router bias did not steer it)")
        sel = S.views(v)[1].reshape(-1)
        experts = [int(e) for e in sel if int(e) >= 0]
        weights = (3, 4) if op == "EXPERT_GATE_UP" else (4,)
        if S.p.expert_format == "mxfp4":  # the codes and their scales
            weights = tuple(j for pair in S.isa.MXFP4_OPERANDS[ins.op] for j in pair)
        for j in weights:
            S.fill_rows(ins.operands[j].buf, experts, ins.args[2], ins.args[3])
    elif op == "EMBED":
        tb = S.buf(ins.operands[1].buf)
        if tb.numel() > 1 << 22:  # a lazily allocated table: fill the rows the ids name
            for t in S.views(v)[0][:, 0, 0].tolist():
                if not tb[0, t].any():
                    tb[0, t] = (torch.randn(tb.shape[2], generator=S.g) * 0.1).to(tb.dtype)
    elif op in ("ARGMAX", "ARGMAX_ALL"):  # (every rank's tiles for ARGMAX_ALL)
        bv = S.buf(ins.operands[0].buf)
        bv.copy_(torch.round(bv * 2) / 2)


def _interpret(S: _MkSetup, v: int) -> None:
    """The interpreter's body of instruction v on the shared buffers (what later instructions read)."""
    import types

    from kimik3.megakernel.interpreter import _OPS

    ins = S.p.instructions[v]
    _OPS[ins.op](types.SimpleNamespace(cfg=S.cfg, dtype=torch.bfloat16, program=S.p), ins, S.views(v))


def _corners(S: _MkSetup, picked: list[int]) -> list[int]:
    """The tile corners of each layer's MoE instructions: EXPERT_GATE_UP at the first and last slot x the first and
    last row tile, EXPERT_DOWN at the first and last row tile; every other opcode's instructions all."""
    out = []
    by: dict[tuple[int, str], list[int]] = {}
    for v in picked:
        by.setdefault((S.p.instructions[v].layer, S.p.instructions[v].op.name), []).append(v)
    for (_, op), vs in by.items():
        args = [S.p.instructions[v].args for v in vs]
        if op == "EXPERT_GATE_UP":
            js, rs = {a[0] for a in args}, {a[2] for a in args}
            keep = [v for v, a in zip(vs, args) if a[0] in (min(js), max(js)) and a[2] in (min(rs), max(rs))]
        elif op == "EXPERT_DOWN":
            rs = {a[2] for a in args}
            keep = [v for v, a in zip(vs, args) if a[2] in (min(rs), max(rs))]
        else:
            keep = vs
        out += keep
    return sorted(out)


class _Instr:
    """One instruction under host execution: its words as the fetch leaves them (``_MkSetup.words``), its operands'
    buffer shapes and declared boxes, and the poisoned copies of the outputs the host stores into (:meth:`out`)."""

    def __init__(self, S: _MkSetup, v: int, run: HostRun) -> None:
        self.S, self.v, self.run = S, v, run
        self.ins = S.p.instructions[v]
        self.op = self.ins.op.name
        self.words = list(S.words(v))
        self.shapes = [tuple(S.p.buffers[o.buf].shape) for o in self.ins.operands]
        self.boxes = [tuple(o.box) for o in self.ins.operands]
        self.cfg, self.B = S.mk, S.B
        self.outs: dict[int, torch.Tensor] = {}  # operand -> host-executed output buffer (poisoned)
        self.tag = f"#{v} {self.op} L{self.ins.layer}"

    def out(self, j: int) -> tuple[torch.Tensor, _Writes]:
        """A poisoned buffer of operand j's shape for the host's stores, and its write counter."""
        spec = self.S.p.buffers[self.ins.operands[j].buf]
        t = torch.full(spec.shape, -7 if not spec.dtype.is_floating_point else float("nan"),
                       dtype=torch.int64 if spec.dtype == torch.bool else spec.dtype)
        self.outs[j] = t
        return t, _Writes(f"{self.tag} {spec.name}", t, self.run.problems)


# ---------------------------------------------------------------------------------------------- misc opcodes
def _mk_misc_host(X: ModuleType, which: str) -> Any:
    """EMBED: every token of the box, its table-row and output offsets. ARGMAX: every thread tidx < B, the offsets
    of its pick. ATTN_RES_MIX: phase 0 every thread's partial sums; phase 1 every thread's chunks of the mix."""
    key = ("mk_misc", which, X)
    if key in _DRIVERS:
        return _DRIVERS[key]
    from kimik3.kernels.megakernel import operands as mk_operands

    NT, VEC, W_ARGS, B0, B1 = X.NT, X.VEC, X.W_ARGS, X.B0, X.B1

    if which == "embed":
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mRec: cute.Tensor,
                  cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            for b in cutlass.range(X._bx(ctx, 0, B0), X._bx(ctx, 0, B1)):
                so, do = X.embed_row(ctx, b)
                mRec[b, 0] = so
                mRec[b, 1] = do
    elif which == "argmax":
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mRec: cute.Tensor,
                  cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            for tidx in cutlass.range(NT):
                if tidx < cfg.B:
                    src, dst = X.argmax_pick(ctx, tidx)
                    mRec[tidx, 0] = src
                    mRec[tidx, 1] = dst
    else:
        @cute.jit
        def drive(mIns: cute.Tensor, mAddr: cute.Tensor, mD1: cute.Tensor, mD2: cute.Tensor, mVals: cute.Tensor,
                  mOut: cute.Tensor, mOff: cute.Tensor, PHASE: cutlass.Constexpr, OPS: cutlass.Constexpr,
                  cfg: cutlass.Constexpr):
            ctx = _ctx(mk_operands, cfg, mIns, mAddr, mD1, mD2)
            js, jn, jp, jo = OPS
            K = mIns[W_ARGS + 1]
            nch = mD2[js] // VEC
            vals = cute.make_rmem_tensor((2 * cfg.kmax,), Float32)
            ro = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            for b in cutlass.range(X._bx(ctx, jo, B0), X._bx(ctx, jo, B1)):
                sv = X.mix_row(ctx, b, js)
                mOff[b] = X.mix_out(ctx, b, jo)
                for tidx in cutlass.range(NT):
                    if const_expr(PHASE == 0):
                        X.mix_partials(ctx, sv, K, nch, tidx, vals, jn, jp)
                        for i in cutlass.range_constexpr(2 * cfg.kmax):
                            mVals[b, tidx, i] = vals[i]
                    else:
                        for i in cutlass.range_constexpr(cfg.kmax):  # the softmax weights (the thin layer's)
                            vals[i] = mVals[b, 0, i]
                        for c in cutlass.range(tidx, nch, NT):
                            X.mix_chunk(ctx, sv, K, nch, vals, Float32(1.0), c, ro)
                            for v in cutlass.range_constexpr(VEC):
                                mOut[b, c, v] = ro[v]

    _DRIVERS[key] = drive
    return drive


def exec_misc(x: _Instr, X: ModuleType) -> dict[int, torch.Tensor]:
    """Host-execute an EMBED, ARGMAX or ATTN_RES_MIX instruction ``x`` with the helpers of ``X``
    (``megakernel.misc`` or a mutated copy); returns the elements each output must hold."""
    S, ins, words, shapes, boxes, cfg, B, out, run = (x.S, x.ins, x.words, x.shapes, x.boxes, x.cfg, x.B, x.out,
                                                      x.run)
    op = x.op
    if op == "EMBED":
        rec = torch.full((B, 2), -1, dtype=torch.int64)
        _launch(_mk_misc_host(X, "embed"), [*words, rec], (cfg,))
        emb, we = out(2)
        table = S.buf(ins.operands[1].buf).view(-1)
        b0, b1 = boxes[0][0], boxes[0][1]
        nch = shapes[1][2] // X.VEC
        for b in range(b0, b1):  # thread tidx copies chunks tidx, tidx + NT, ...
            for tidx in range(min(X.NT, nch)):
                cs = torch.arange(tidx, nch, X.NT)
                el = (cs[:, None] * X.VEC + torch.arange(X.VEC)).reshape(-1)
                _store(we, shapes[2], boxes[2], rec[b, 1] + el, table[rec[b, 0] + el], "embed")
        expect = {2: _box_mask(shapes[2], boxes[2])}
        we.check(expect[2])
        run.lanes_run += (b1 - b0) * X.NT
    elif op in ("ARGMAX", "ARGMAX_ALL"):  # one helper walks one rank's tiles or every rank's
        rec = torch.full((X.NT, 2), -1, dtype=torch.int64)
        _launch(_mk_misc_host(X, "argmax"), [*words, rec], (cfg,))
        nxt, wn = out(2)
        bi = S.buf(ins.operands[1].buf).view(-1)
        live = rec[:, 1] >= 0
        _store(wn, shapes[2], boxes[2], rec[live, 1], bi[rec[live, 0]], "argmax")
        expect = {2: _box_mask(shapes[2], boxes[2])}
        wn.check(expect[2])
        run.lanes_run += B
    elif op == "ATTN_RES_MIX":
        expect = exec_mix(x, X, X.MIX_OPS)
    else:
        raise ValueError(f"host execution of opcode {op} is not a misc opcode")
    return expect


def exec_mix(x: _Instr, X: ModuleType, ops: tuple[int, int, int, int]) -> dict[int, torch.Tensor]:
    """The AttnRes mix of instruction ``x`` over operands ``ops`` = (stream, norm, projection, output) with the
    helpers of ``X`` (``megakernel.misc``): every thread's partial sums, the block reduction and softmax replayed
    (exact fp32), every thread's chunks of the mix; returns the elements the output must hold."""
    ins, words, shapes, boxes, cfg, B, out, run = x.ins, x.words, x.shapes, x.boxes, x.cfg, x.B, x.out, x.run
    js, _, _, jo = ops
    K = ins.args[1]
    KM, NT, VEC = cfg.kmax, X.NT, X.VEC
    b0, b1 = boxes[jo][0], boxes[jo][1]
    H = shapes[js][2]
    vals = torch.full((B, NT, 2 * KM), float("nan"))
    mix = torch.full((B, H // VEC, VEC), float("nan"), dtype=torch.bfloat16)
    moff = torch.full((B,), -1, dtype=torch.int64)
    _launch(_mk_misc_host(X, "mix"), [*words, vals, mix, moff], (0, tuple(ops), cfg))
    nw = NT // LANES
    tot = warp_sum(vals[b0:b1].view(b1 - b0, nw, LANES, 2 * KM), 2)  # block_allreduce: per warp, then
    red = torch.zeros(b1 - b0, 2 * KM)  # the NW partials re-added in warp order from 0
    for w in range(nw):
        red = red + tot[:, w]
    score = red[:, KM:] * torch.rsqrt(red[:, :KM] * (1.0 / cfg.H) + cfg.eps)
    score[:, K:] = float("-inf")
    alpha = torch.zeros(B, NT, 2 * KM)
    alpha[b0:b1, 0, :KM] = torch.softmax(score, dim=-1)
    _launch(_mk_misc_host(X, "mix"), [*words, alpha, mix, moff], (1, tuple(ops), cfg))
    o, wo = out(jo)
    el = torch.arange(H)
    for b in range(b0, b1):
        _store(wo, shapes[jo], boxes[jo], moff[b] + el, mix[b].reshape(-1), "mix")
    expect = {jo: _box_mask(shapes[jo], boxes[jo])}
    wo.check(expect[jo])
    run.lanes_run += (b1 - b0) * NT
    return expect


def compare_outputs(S: _MkSetup, x: _Instr, expect: dict[int, torch.Tensor], run: HostRun,
                    errors: dict[str, float]) -> None:
    """The host-executed outputs of ``x`` (its poisoned copies, at the elements ``expect`` names) against what the
    interpreter's body stored in the shared buffers: the worst relative error per float output into ``errors``,
    any integer mismatch into ``run.problems``."""
    from kimik3.validation.metric import rel_error

    for j, t in x.outs.items():
        ref = S.buf(x.ins.operands[j].buf)
        m = expect[j]
        got, want = t[m], ref[m]
        name = f"{x.op}.{S.p.buffers[x.ins.operands[j].buf].name}"
        if want.dtype.is_floating_point:
            errors[name] = max(errors.get(name, 0.0), rel_error(got.float(), want.float()))
        elif not torch.equal(got.long(), want.long()):
            k = int((got.long() != want.long()).nonzero()[0, 0])
            run.problems.append(f"{x.tag} {name}: {int((got.long() != want.long()).sum())} element(s) differ from "
                                f"the interpreter, first {int(got[k])} vs {int(want[k])}")
