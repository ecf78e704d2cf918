"""One GPU's megakernel runner: one decode step = one launch of the persistent CuTe DSL megakernel
(``kernels/megakernel/vm.py``; the stage ``"megakernel"``: :mod:`kimik3.megakernel.gpu_stage`).

The kernel is an interpreter, so everything that is not arithmetic happens here, once, on the host: build the
program for this GPU's SM count, prove it race-free, check it against what the device code assumes
(:func:`check_device_contract`), pack the weights, allocate the buffers and write the device address table. A step
writes the token ids and positions, sets ``ctl[0] = step``, launches ``num_sms`` co-resident CTAs and reads the
error word. Refusals are ``ValueError`` with the reason, never a fallback; a tripped watchdog raises
:class:`MegakernelError` naming the instruction and counter, and the stage refuses further steps until ``reset()``.
Routed experts run as the model holds them (dense bf16 or MXFP4, variant ``megakernel/{preset}/b{B}-mxfp4``).
Details: docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from kimik3.kernels.contracts.isa import DEVICE_OPS, LOCAL_TABLE, PEER_TABLE
from kimik3.kernels.contracts.meta import SUPPORTED_ARCHS as ARCHS  # the architectures kernels are built for
from kimik3.kernels.contracts.peers import counter_words
from kimik3.kernels.toolchain.loader import (
    default_prebuilt_dir,
    dsl_available,
    jit_compiled,
    load_prebuilt_kernel,
    norm_shapes,
)
from kimik3.megakernel.hazards import check_program, format_violations
from kimik3.megakernel.instructions import (
    CTA_THREADS,
    CTL_WORDS,
    ERR_BAD_PROGRAM,
    ERR_WATCHDOG,
    ERROR_WORDS,
    FFN_LATENT_NORM,
    FFN_MLP,
    FFN_ROUTED,
    MXFP4_OPERANDS,
    Op,
    Program,
    encode_program,
)
from kimik3.megakernel.kernel_shapes import (
    MAX_BUFS,
    MAX_CTRS,
    MAX_INSTR,
    PROG_WORDS,
    static_shapes,
    variant_name,
)
from kimik3.megakernel.layout import program_tensors, state_views
from kimik3.megakernel.scheduler import POLICIES, build_program
from kimik3.megakernel.step import Tiling
from kimik3.megakernel.timeline import from_timings
from kimik3.model.config import ModelConfig
from kimik3.model.modeling import DecodeState, KDAState, KimiForCausalLM
from kimik3.scope.gates import MEGAKERNEL

__all__ = [
    "PROG_WORDS",
    "MAX_INSTR",
    "MAX_BUFS",
    "MAX_CTRS",
    "ARCHS",
    "MegakernelError",
    "MegakernelRunner",
    "static_shapes",
    "check_device_contract",
    "variant_name",
    "ERR_WATCHDOG",
    "ERR_BAD_PROGRAM",
]

_ARCH_OF_CC = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
DEFAULT_SPINS = 1 << 22  # watchdog: spins before a wait gives up (each spin sleeps ~sleep_ns)
DEFAULT_SLEEP_NS = 64


# ================================================================================================ device contract


def program_counter_words(program: Program) -> int:
    """Words of counter memory a program's counters take (one per local counter, one per source of a cross-rank
    one: ``kernels/contracts/peers.py``)."""
    return sum(counter_words(c.sources) for c in program.counters)

_F32, _BF16, _I64, _BOOL, _U8 = torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8


def _expected_dtypes(op: Op, args: tuple[int, ...], n: int, fp4: bool = False, world: int = 1
                     ) -> list[torch.dtype] | None:
    """The dtype the device code assumes for each operand of an instruction (None: opcode not known); ``fp4``: the
    kernel reads the routed experts as MXFP4 (uint8 codes where the dense weights were, uint8 scales appended);
    ``world`` > 1: a rank's program (EXPERT_DOWN stores an fp32 partial into the latent mailbox)."""
    if fp4 and op in MXFP4_OPERANDS:
        dense = _expected_dtypes(op, args, n, world=world)
        pairs = MXFP4_OPERANDS[op]
        out = dense + [_U8] * len(pairs)
        for j, js in pairs:
            out[j] = out[js] = _U8
        return out
    table: dict[Op, list[torch.dtype]] = {
        Op.EMBED: [_I64, _BF16, _BF16],
        Op.ATTN_RES_MIX: [_BF16] * 4,
        Op.NORM_PROJ: [_BF16, _BF16, _BF16, _F32 if args[0] else _BF16],
        Op.MLP_GATE_UP: [_BF16] * 5,
        Op.KDA_STEP: [_BF16, _BF16, _BF16, _F32, _BF16, _F32, _F32, _F32, _F32, _BF16],
        Op.MLA_Q: [_BF16] * 5,
        Op.MLA_KV_APPEND: [_BF16, _BF16, _I64, _BF16, _BF16],
        Op.MLA_PARTIAL: [_BF16, _I64, _BF16, _BF16, _F32],
        Op.MLA_REDUCE: [_F32, _BF16] + [_BF16] * (n - 2),
        Op.O_PROJ_RESIDUAL: [_BF16] * 3,
        Op.ROUTER: [_F32, _F32, _I64, _F32, _BOOL],
        Op.EXPERT_GATE_UP: [_BF16, _I64, _BOOL, _BF16, _BF16, _BF16],
        Op.EXPERT_DOWN: [_BF16, _I64, _BOOL, _F32, _BF16, _F32 if world > 1 else _BF16],
        Op.FFN_OUT: [_BF16] * n,
        Op.LM_HEAD: [_BF16, _BF16, _BF16, _F32, _F32, _I64],
        Op.ARGMAX: [_F32, _I64, _I64],
        Op.ALLREDUCE_MIX: [_BF16] * 6,
        Op.ARGMAX_ALL: [_F32, _I64, _I64],
        Op.MOE_COMBINE: [_F32, _BF16, _BF16] if args[0] else [_F32, _BF16],
    }
    return table.get(op)


def _vector_operands(op: Op, n: int) -> list[int]:
    """Operands the device code reads (or writes) as rows of 16-byte chunks: their rows must start 16-byte
    aligned (innermost extent and first column multiples of 8 elements; 16 for uint8). MXFP4 codes sit where the
    dense expert weights do (``MXFP4_OPERANDS``), so they are checked the same way; the scales are read byte by
    byte."""
    return {
        Op.EMBED: [1, 2], Op.ATTN_RES_MIX: [0, 1, 2, 3], Op.NORM_PROJ: [0, 1, 2], Op.MLP_GATE_UP: [0, 1, 2, 3],
        Op.O_PROJ_RESIDUAL: [0, 1], Op.FFN_OUT: list(range(n - 1)), Op.LM_HEAD: [0, 1, 2], Op.MLA_Q: [1, 2, 3],
        Op.MLA_PARTIAL: [0, 2], Op.MLA_REDUCE: [1], Op.EXPERT_GATE_UP: [0, 3, 4], Op.EXPERT_DOWN: [0, 4],
        Op.ALLREDUCE_MIX: [0, 1, 2, 3, 4, 5], Op.MOE_COMBINE: list(range(1, n)),
    }.get(op, [])


def check_device_contract(program: Program, cfg: ModelConfig, batch: int, shapes: dict[str, Any] | None = None
                          ) -> list[str]:
    """Everything the device code takes for granted about a program, checked on the host (CPU-testable): the
    kernel would silently compute garbage otherwise. Returns readable problems (empty: the program fits)."""
    shapes = shapes or static_shapes(cfg, batch, expert_format=program.expert_format)
    out: list[str] = []
    if program.batch != batch:
        out.append(f"program built for batch {program.batch}, kernel for {batch}")
    other = sorted({i.op.name for i in program.instructions if i.op not in DEVICE_OPS})
    if program.world > 1 and not shapes.get("ranks", False):
        out.append(f"a rank program of {program.world}: the kernel is built for one GPU's program (MKConfig.ranks "
                   "off: no collective opcodes, pushes or cross-rank counter words)")
    elif other and program.world == 1:
        out.append(f"opcodes {', '.join(other)} outside the device's {len(DEVICE_OPS)} in one GPU's program")
    fp4 = bool(shapes.get("fp4", False))
    if (program.expert_format == "mxfp4") != fp4:
        out.append(f"program carries {program.expert_format} routed experts, the kernel is compiled for "
                   f"{'mxfp4' if fp4 else 'dense'} (fp4={fp4}): the device refuses it (ERR_BAD_PROGRAM)")
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        out.append("grouped routing (n_group > 1) is not implemented in the megakernel's ROUTER")
    if cfg.kda_layers and cfg.kda_head_dim > CTA_THREADS:
        out.append(f"KDA head dim {cfg.kda_head_dim} > {CTA_THREADS} threads per CTA")
    n = len(program.instructions)
    words = encode_program(program).numel()
    caps = [("program words", words, shapes["prog_words"]), ("instructions", n, shapes["max_instr"]),
            ("buffers", len(program.buffers), shapes["max_bufs"]), ("counter words", program_counter_words(program),
                                                                     shapes["max_ctrs"])]
    out += [f"{what}: {have} > capacity {cap}" for what, have, cap in caps if have > cap]
    bufs = program.buffers
    for i, ins in enumerate(program.instructions):
        want = _expected_dtypes(ins.op, ins.args, len(ins.operands), fp4, program.world)
        if want is None:
            if ins.op != Op.NOP:
                out.append(f"#{i} {ins.label()}: opcode without device code")
            continue
        if len(want) != len(ins.operands):
            out.append(f"#{i} {ins.label()}: {len(ins.operands)} operands, device code expects {len(want)}")
            continue
        for j, (o, dt) in enumerate(zip(ins.operands, want)):
            if bufs[o.buf].dtype != dt:
                out.append(f"#{i} {ins.label()}: operand {j} ({bufs[o.buf].name}) is {bufs[o.buf].dtype}, device "
                           f"code reads {dt}")
        for j in _vector_operands(ins.op, len(ins.operands)):
            o = ins.operands[j]
            d2, per = bufs[o.buf].shape[2], 16 if bufs[o.buf].dtype == _U8 else 8  # 16 bytes of codes / 8 bf16
            if d2 % per or o.box[4] % per:
                out.append(f"#{i} {ins.label()}: operand {j} ({bufs[o.buf].name}) rows of {d2} elements from column "
                           f"{o.box[4]} are not 16-byte aligned (vector loads)")
        if ins.op == Op.ATTN_RES_MIX and ins.args[1] > shapes["kmax"]:
            out.append(f"#{i} {ins.label()}: {ins.args[1]} candidates > kmax {shapes['kmax']}")
        if ins.op == Op.FFN_OUT:
            flags = ins.args[0]
            if bool(flags & FFN_ROUTED) and bool(flags & FFN_LATENT_NORM) != shapes["latent_norm"]:
                out.append(f"#{i} {ins.label()}: latent-norm flag differs from the compiled config")
            if not flags & (FFN_ROUTED | FFN_MLP):
                out.append(f"#{i} {ins.label()}: FFN_OUT with neither source")
        if ins.op == Op.KDA_STEP and ins.operands[0].box[4] != ins.args[0] * (4 * cfg.kda_head_dim + 1):
            out.append(f"#{i} {ins.label()}: packed KDA input columns do not start at the head's block")
    return out


# ================================================================================================ the runner


def check_gpu_model(model: KimiForCausalLM, batch_size: int, max_seq_len: int | None = None, *, world: int | None = 1,
                    num_sms: int | None = None) -> torch.device:
    """The device of a model the megakernel may run at this batch: through its scope gate
    (:data:`kimik3.scope.gates.MEGAKERNEL`: bf16 on a CUDA GPU it is built for, the K3 feature set, ...), every
    reason in one ``ValueError``. ``world``: the ranks the launch holds."""
    MEGAKERNEL.check("megakernel", model, batch_size, max_seq_len, world=world, sms=num_sms)
    return model.device


def check_buffer(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A tensor the kernel may take for a program buffer: the declared shape and dtype, contiguous on ``device``,
    16-byte aligned (``ValueError`` naming the buffer otherwise)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"buffer {name}: program declares {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
    if t.device != device or not t.is_contiguous():
        raise ValueError(f"buffer {name} must be a contiguous tensor on {device}")
    if t.data_ptr() % 16:
        raise ValueError(f"buffer {name} is not 16-byte aligned (the kernel reads rows with 128-bit loads)")


def address_table(program: Program, tensors: dict[str, torch.Tensor], cfg: ModelConfig, state: DecodeState,
                  device: torch.device, capacity: int) -> torch.Tensor:
    """The program's device address table (int64 ``[capacity]``, on the CPU) with its state buffers pointed at
    ``state``, which ``tensors`` then holds views of (updated in place by every step); every buffer checked."""
    for i, st in enumerate(state.layers):
        if isinstance(st, KDAState) and not (st.conv.is_contiguous() and st.S.is_contiguous()):
            raise ValueError(f"layer {i}: KDA state must be contiguous (it is updated in place)")
    tensors.update(state_views(cfg, state))
    addr = torch.zeros(capacity, dtype=torch.int64)
    for k, spec in enumerate(program.buffers):
        t = tensors.get(spec.name)
        if t is None:
            raise ValueError(f"state buffer {spec.name} is not bound")
        check_buffer(spec.name, t, spec.shape, spec.dtype, device)
        addr[k] = t.data_ptr()
    return addr


class MegakernelError(RuntimeError):
    """The watchdog tripped (or the program header was rejected) during a step. ``code``: 1 watchdog, 2 bad
    program; ``instruction`` / ``counter`` / ``target`` / ``seen``: the wait that gave up; ``cta`` / ``sm``: where."""

    def __init__(self, message: str, words: list[int]) -> None:
        super().__init__(message)
        self.code, self.instruction, self.counter, self.target, self.seen, self.cta, self.sm, self.step = words


def _device_arch(device: torch.device) -> str:
    cc = torch.cuda.get_device_capability(device)
    if cc not in _ARCH_OF_CC:
        raise ValueError(f"the megakernel is built for {', '.join(ARCHS)}; this GPU is sm_{cc[0]}{cc[1]}")
    return _ARCH_OF_CC[cc]


def _compile(arch: str, shapes: dict[str, Any], prebuilt: str | None, name: str) -> Any:
    """The kernel as a TVM-FFI callable: a verified prebuilt artefact when ``prebuilt`` is given (shapes and source
    hash must match), else compiled in-process with the DSL (cached per process)."""
    # a GPU image usually has no DSL compiler: then the prebuilt directory is the way in
    if prebuilt is None and not dsl_available():
        found = default_prebuilt_dir()
        if found is None:
            raise ValueError("the megakernel needs nvidia-cutlass-dsl to compile, or a prebuilt export: "
                             "`python -m kimik3 kernels build --family megakernel --preset <preset> --batch <B> "
                             "--arch sm_90a --out prebuilt --ship-runtime` on a machine with the DSL, then "
                             "set $KIMIK3_PREBUILT or pass prebuilt=DIR")
        prebuilt = str(found)
    if prebuilt is not None:
        return load_prebuilt_kernel(prebuilt, name, arch, shapes)  # ValueError naming what does not match

    def compile_megakernel() -> Any:
        try:
            from kimik3.kernels.megakernel import vm as mk
        except ImportError as e:
            raise ValueError("the megakernel needs nvidia-cutlass-dsl to compile (or pass prebuilt=DIR with an "
                             f"exported kernel): {e}") from None
        return mk.compile_for(arch, tvm_ffi=True, **shapes)

    return jit_compiled((arch, "megakernel", "megakernel", norm_shapes(shapes)), compile_megakernel)


@dataclass
class _Buffers:
    program: torch.Tensor
    buffers: torch.Tensor
    counters: torch.Tensor
    timings: torch.Tensor
    error: torch.Tensor
    ctl: torch.Tensor
    peers: torch.Tensor  # isa.PEER_TABLE: one GPU's program has itself as rank 0 (the table is read by rank kernels)
    local: torch.Tensor  # isa.LOCAL_TABLE: the local ranks' tensors when one launch runs several (unused: zeros)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(program=self.program, buffers=self.buffers, counters=self.counters, timings=self.timings,
                    error=self.error, ctl=self.ctl, peers=self.peers, local=self.local)

    def args(self) -> list[torch.Tensor]:
        """The kernel's tensor arguments, in its order."""
        return [self.program, self.buffers, self.counters, self.timings, self.error, self.ctl, self.peers,
                self.local]


class MegakernelRunner:
    """Owns the program, the device buffers and the compiled kernel for one model, batch size and cache length.

    ``program``: use this one instead of building it (tests plant broken programs; ``check`` then decides whether
    the hazard checker may refuse it)."""

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, num_sms: int | None = None,
                 policy: str = "critical_path", tiling: Tiling | None = None, check: bool = True,
                 program: Program | None = None, max_spins: int = DEFAULT_SPINS, sleep_ns: int = DEFAULT_SLEEP_NS,
                 prebuilt: str | None = None) -> None:
        dev = check_gpu_model(model, batch_size, max_seq_len, num_sms=num_sms)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        cfg = model.config
        self.arch = _device_arch(dev)
        self.model, self.cfg, self.batch, self.device = model, cfg, batch_size, dev
        self.num_sms = int(num_sms or torch.cuda.get_device_properties(dev).multi_processor_count)
        # the kernel is compiled for the experts as the model holds them (its buffers are what gets uploaded)
        self.expert_format = model.expert_storage
        self.program = program if program is not None else build_program(
            cfg, batch_size, self.num_sms, policy, max_seq_len, tiling, act_dtype=torch.bfloat16,
            expert_format=self.expert_format)
        if self.program.expert_format != self.expert_format:
            raise ValueError(f"program carries {self.program.expert_format} routed experts, but the model holds them "
                             f"{self.expert_format} (the kernel is compiled for the model's: "
                             f"{variant_name(cfg, batch_size, self.expert_format)})")
        if self.program.num_sms > self.num_sms:
            raise ValueError(f"program has {self.program.num_sms} queues but the launch has {self.num_sms} CTAs")
        if check:
            bad = check_program(self.program)
            if bad:
                raise ValueError("megakernel program failed the hazard check:\n" + format_violations(bad))
        encoded = encode_program(self.program)
        caps = dict(prog_words=PROG_WORDS, max_instr=MAX_INSTR, max_bufs=MAX_BUFS, max_ctrs=MAX_CTRS)
        for key, need in (("prog_words", encoded.numel()), ("max_instr", len(self.program.instructions)),
                          ("max_bufs", len(self.program.buffers)),
                          ("max_ctrs", max(1, program_counter_words(self.program)))):
            while caps[key] < need:  # grow (and compile in-process): never truncate a program
                caps[key] *= 2
        self.shapes = static_shapes(cfg, batch_size, **caps, expert_format=self.expert_format)
        problems = check_device_contract(self.program, cfg, batch_size, self.shapes)
        if problems:
            raise ValueError("megakernel program does not fit the device code:\n  " + "\n  ".join(problems[:20]))
        self.name = variant_name(cfg, batch_size, self.expert_format)
        self.fn = _compile(self.arch, self.shapes, prebuilt if caps == dict(
            prog_words=PROG_WORDS, max_instr=MAX_INSTR, max_bufs=MAX_BUFS, max_ctrs=MAX_CTRS) else None, self.name)
        self.max_spins, self.sleep_ns = int(max_spins), int(sleep_ns)
        # ---- tensors: weights (views of the model's parameters and MXFP4 expert buffers + packed copies), scratch,
        # the address table
        self.tensors: dict[str, torch.Tensor] = program_tensors(self.program.buffers, model, dev)
        for spec in self.program.buffers:
            if spec.name in self.tensors:
                self._check_buffer(spec.name, self.tensors[spec.name], spec.shape, spec.dtype)
        n = len(self.program.instructions)
        prog = torch.zeros(self.shapes["prog_words"], dtype=torch.int32)
        prog[: encoded.numel()] = encoded
        counters = torch.zeros(self.shapes["max_ctrs"], dtype=torch.int32, device=dev)
        peers = torch.zeros(PEER_TABLE, dtype=torch.int64)
        peers[0] = counters.data_ptr()
        self.bufs = _Buffers(
            program=prog.to(dev), buffers=torch.zeros(self.shapes["max_bufs"], dtype=torch.int64, device=dev),
            counters=counters, timings=torch.zeros(self.shapes["max_instr"], 3, dtype=torch.int64, device=dev),
            error=torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev),
            ctl=torch.zeros(CTL_WORDS, dtype=torch.int32, device=dev), peers=peers.to(dev),
            local=torch.zeros(LOCAL_TABLE, dtype=torch.int64, device=dev))
        self.n = n
        self.steps_done = 0
        self.broken: str | None = None
        self._bound = False

    # ------------------------------------------------------------------ buffers
    def _check_buffer(self, name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        check_buffer(name, t, shape, dtype, self.device)

    def bind_state(self, state: DecodeState) -> None:
        """Point the state buffers at ``state`` (updated in place by every step) and write the address table."""
        self.bufs.buffers.copy_(address_table(self.program, self.tensors, self.cfg, state, self.device,
                                              self.shapes["max_bufs"]))
        self._bound = True

    def reset_counters(self) -> None:
        """Counters back to zero and the step number to 0 (after a reset of the decode state, or a watchdog)."""
        self.bufs.counters.zero_()
        self.bufs.error.zero_()
        self.steps_done = 0
        self.broken = None

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def run_step(self, ids: torch.Tensor, positions: torch.Tensor, check_error: bool = True) -> torch.Tensor:
        """One decode step: tokens ``ids`` [B] at ``positions`` [B] → fp32 logits [B, V] (the kernel's buffer)."""
        if self.broken:
            raise RuntimeError(f"megakernel stage is unusable after: {self.broken}; call reset()")
        if not self._bound:
            raise RuntimeError("bind_state() first: the program's state buffers point nowhere")
        self.tensors["ids"][:, 0, 0] = ids.to(self.device, torch.int64)
        self.tensors["pos"][:, 0, 0] = positions.to(self.device, torch.int64)
        self.bufs.ctl.copy_(torch.tensor([self.steps_done, self.max_spins, self.sleep_ns, 0, 0, 0, 0, 0],
                                         dtype=torch.int32))
        self.fn(*self.bufs.args(), self.num_sms)
        self.steps_done += 1
        if check_error:
            self.check_error()
        return self.tensors["logits"][:, 0, :]

    def check_error(self) -> None:
        """Raise :class:`MegakernelError` if the last launch tripped the watchdog (synchronises)."""
        words = self.bufs.error.cpu().tolist()
        if words[0] == 0:
            return
        if words[0] == ERR_BAD_PROGRAM:
            msg = "megakernel rejected the program header (magic / instruction width / expert format)"
        else:
            v, c = words[1], words[2]
            label = self.program.instructions[v].label() if 0 <= v < self.n else "?"
            cname = self.program.counters[c].name if 0 <= c < len(self.program.counters) else "?"
            msg = (f"megakernel watchdog: instruction #{v} ({label}) on CTA {words[5]} (SM {words[6]}) gave up waiting "
                   f"in step {words[7]} for counter {c} '{cname}' >= {words[3]} (it was {words[4]}) after "
                   f"{self.max_spins} spins")
        self.broken = msg
        raise MegakernelError(msg, words)

    def timings(self) -> torch.Tensor:
        """The last step's timing buffer ``[N, 3]`` int64 (start ns, end ns, SM id) on the CPU."""
        return self.bufs.timings[: self.n].cpu()

    def timeline(self) -> pd.DataFrame:
        """The last step as a timeline table (:func:`kimik3.megakernel.timeline.from_timings`)."""
        return from_timings(self.program, self.timings())
