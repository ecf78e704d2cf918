"""Stage ``"megakernel-cpu"``: the megakernel's int32 program executed by native worker threads, one per core.

Where the interpreter (stage ``"megakernel-interp"``) proves the program's logic under random interleavings, this
runs the same program, scheduled for ``num_sms`` = worker threads, under real concurrency: each worker walks its
queue once per step, waiting on ``std::atomic`` counters with the GPU kernel's targets (``step·total + t``); a
bounded spin turns a hang into :class:`MegakernelCPUError` with a per-worker dump, and per-instruction stamps come
back in the GPU kernel's timing format (:func:`kimik3.megakernel.timeline.from_timings`). The executor,
``cpu_executor.cpp``, is compiled at first use (``$CXX`` or ``g++``; no compiler: a ``ValueError``) into
``$KIMIK3_CACHE`` or ``~/.cache/kimik3`` and loaded through a plain C ABI with :mod:`ctypes`; its encoding header
``mk_encoding.h`` is generated from :mod:`kimik3.megakernel.instructions`. Build and design notes:
docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from kimik3.megakernel import instructions as enc
from kimik3.megakernel.hazards import check_program, format_violations
from kimik3.megakernel.instructions import (
    EXPERT_FORMATS,
    FFN_LATENT_NORM,
    FFN_MLP,
    FFN_ROUTED,
    Kind,
    Program,
    encode_program,
)
from kimik3.megakernel.layout import expert_weight_names, program_tensors, state_views
from kimik3.megakernel.peer_memory import PeerMemory
from kimik3.megakernel.ranks import SINGLE, Shard
from kimik3.megakernel.scheduler import POLICIES, build_program
from kimik3.megakernel.stage_base import ProgramStage
from kimik3.megakernel.step import Tiling
from kimik3.megakernel.timeline import from_timings
from kimik3.model.modeling import DecodeState, KDAState, KimiForCausalLM
from kimik3.scope.gates import CPU_MAX_BATCH, MEGAKERNEL_CPU
from kimik3.stages import register_stage
from kimik3.stages.naive import NaiveStage
from kimik3.validation.metric import poison

__all__ = [
    "EXPERT_FORMATS",
    "HEADER_FIELDS",
    "PARAMS",
    "MegakernelCPUError",
    "CPUMegakernel",
    "MegakernelCPUStage",
    "encoding_header",
    "find_compiler",
    "build_library",
    "default_workers",
    "model_params",
]

SOURCE = Path(__file__).with_name("cpu_executor.cpp")
SIMD_SOURCE = Path(__file__).with_name("cpu_simd.h")  # included by SOURCE
MAX_BATCH = CPU_MAX_BATCH  # the executor's capacity (cpu_executor.cpp MAX_BATCH), its gate's batch bound
ABI_VERSION = 3
DEFAULT_TIMEOUT_S = 10.0  # a wait that spins this long is a hang: the step fails with a per-worker dump
# EXPERT_FORMATS (the program's, kernels/contracts/isa.py): option experts="dense" streams the routed experts in the
# model's dtype; "mxfp4" as MXFP4 (E2M1 codes + an E8M0 scale per 32 weights, 4.25 bits per weight, the K3 release's
# expert format): the model's held bytes, or packed once by kimik3.model.quant.mxfp4_quantize from dense experts
_EXPERT_SUFFIXES = ("experts.w1", "experts.w2", "experts.w3")

# The program header, word by word, in the order encode_program writes it.
HEADER_FIELDS = ("magic", "version", "header_words", "n", "instr_words", "s", "q", "c", "nb", "batch",
                 "max_seq_len", "layers", "policy", "off_buf", "off_ctr", "off_ins", "off_q", "off_str", "nstr",
                 "total", "max_waits", "max_operands")
# Model constants handed to the executor at run time (one build serves every model); LORA_EPS is followed by
# two values per layer (q_a / kv_a layernorm eps).
PARAMS = ("act_bf16", "eps", "situ", "situ_beta", "situ_lin", "dk", "conv", "kda_lb", "nope", "rope", "kvl", "dv",
          "mla_scale", "e", "topk", "renorm", "route_scale", "lora_eps")
_DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i64": "int64", "i32": "int32",
                "bool": "bool", "f64": "float64"}


class MegakernelCPUError(RuntimeError):
    """A step's watchdog tripped: some worker spun past the deadline on a wait. ``dump``: one dict per worker
    (state, queue position, instruction, counter, target, value seen); the message renders it."""

    def __init__(self, message: str, dump: list[dict]) -> None:
        super().__init__(message)
        self.dump = dump


# ================================================================================================ building


_SCHEDULER_FLAGS = {"FFN_ROUTED": FFN_ROUTED, "FFN_MLP": FFN_MLP, "FFN_LATENT_NORM": FFN_LATENT_NORM}


def _contract():
    """The module holding the encoding constants: the pure-Python ISA beside the device code when present
    (``kimik3.kernels.contracts.isa``, registered by importing :mod:`~kimik3.megakernel.instructions`), else the
    instructions module itself."""
    try:
        from kimik3.kernels.contracts import isa

        return isa
    except ImportError:
        return enc


def encoding_header() -> str:
    """``mk_encoding.h``: the encoding constants the C++ executor compiles against, from the Python definition."""
    src = _contract()
    lines = ["// Generated by kimik3/megakernel/cpu.py from the Python encoding definition. Do not edit.",
             "#pragma once", f"#define MK_ABI_VERSION {ABI_VERSION}"]
    for name in ("MAGIC", "VERSION", "HEADER_WORDS", "INSTR_WORDS", "BUFFER_WORDS", "COUNTER_WORDS",
                 "OPERAND_WORDS", "MAX_OPERANDS", "MAX_WAITS", "W_OP", "W_LAYER", "W_SM", "W_QPOS", "W_ARGS",
                 "W_SIGNAL", "W_AMOUNT", "W_NWAITS", "W_WAITS", "W_NOPS", "W_OPS", "FFN_ROUTED", "FFN_MLP",
                 "FFN_LATENT_NORM", "W_PEER_LO", "W_PEER_HI", "CW_TOTAL", "CW_SOURCES", "H_RANK",
                 "H_WORLD"):
        value = getattr(src, name) if hasattr(src, name) else _SCHEDULER_FLAGS[name]
        lines.append(f"#define {name} {int(value)}")
    for i, f in enumerate(HEADER_FIELDS):  # header word indices: the contract's H_* where it names them
        lines.append(f"#define H_{f.upper()} {int(getattr(src, 'H_' + f.upper(), i))}")
    codes = getattr(src, "DTYPE_CODES", None) or {str(dt).replace("torch.", ""): c for dt, c in enc._DTYPES.items()}
    for short, long in _DTYPE_NAMES.items():
        lines.append(f"#define DT_{short.upper()} {int(codes[long])}")
    for op in src.Op:
        lines.append(f"#define OP_{op.name} {int(op)}")
    for kind in src.Kind:
        lines.append(f"#define KIND_{kind.name} {int(kind)}")
    for mode in (src.Mode.READ, src.Mode.WRITE, src.Mode.PREFETCH, src.Mode.PUSH):
        lines.append(f"#define MODE_{mode.name} {int(mode)}")
    for i, p in enumerate(PARAMS):
        lines.append(f"#define P_{p.upper()} {i}")
    lines.append(f"#define P_COUNT {len(PARAMS)}")
    return "\n".join(lines) + "\n"


def find_compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``g++`` / ``c++`` on the PATH (what PyTorch's Inductor CPU backend uses)."""
    for cand in ([os.environ["CXX"]] if os.environ.get("CXX") else []) + ["g++", "c++"]:
        path = shutil.which(cand)
        if path:
            return path
    raise ValueError("stage 'megakernel-cpu' compiles its native executor at first use and needs a C++ compiler "
                     "(g++, the one PyTorch's CPU backend already requires); none was found: install g++ or set "
                     "$CXX to one")


def cache_dir() -> Path:
    root = os.environ.get("KIMIK3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kimik3")
    return Path(root) / "megakernel-cpu"


def _host_cpu() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
                    if line.startswith(("flags", "Features")):
                        break
    except OSError:
        pass
    return platform.machine() + flags


OPT_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-pthread", "-fno-math-errno")
TSAN_FLAGS = ("-O1", "-g", "-fsanitize=thread", "-fopenmp-simd", "-std=c++17", "-pthread", "-fno-math-errno")


def _build(kind: str, flags: tuple[str, ...], sources: list[Path], out_name: str, shared: bool) -> Path:
    """Compile ``sources`` (plus the generated header) into the cache, atomically; reuse a cached build."""
    cxx = find_compiler()
    header = encoding_header()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"C++ compiler {cxx} does not run: {e}") from None
    h = hashlib.sha256()
    for part in [header, version, _host_cpu(), kind, " ".join(flags), str(shared)] + \
            [s.read_text() for s in sources]:
        h.update(part.encode())
    target = cache_dir() / h.hexdigest()[:20] / out_name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        (Path(tmp) / "mk_encoding.h").write_text(header)
        for s in sources:
            shutil.copy(s, Path(tmp) / s.name)
        out = Path(tmp) / out_name
        cmd = [cxx, *flags, *(["-shared", "-fPIC"] if shared else []), "-I", tmp,
               *[str(Path(tmp) / s.name) for s in sources[:1]], "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 and "-march=native" in flags:  # a compiler that does not know the host CPU
            cmd = [c for c in cmd if c != "-march=native"]
            res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building the megakernel CPU executor failed ({' '.join(cmd)}):\n"
                               f"{res.stderr[-4000:]}")
        os.replace(out, target)  # atomic: a concurrent build of the same key leaves one complete file
    return target


def build_library() -> Path:
    """The executor as a shared library (cached)."""
    return _build("lib", OPT_FLAGS, [SOURCE, SIMD_SOURCE], "libmk_cpu.so", shared=True)


_LIB: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(build_library()))
        P, I64, I32, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
        lib.mk_last_error.restype = ctypes.c_char_p
        lib.mk_abi_version.restype = I64
        lib.mk_simd_width.restype = I64
        lib.mk_probe_gemv.argtypes = [P, I32, I64, I32, P, I32, I32, P, I64]
        lib.mk_probe_gemv.restype = I32
        lib.mk_probe_act.argtypes = [I32, P, I32, P]
        lib.mk_probe_act.restype = I32
        lib.mk_header.argtypes = [P, I64, P]
        lib.mk_header.restype = I32
        lib.mk_create.argtypes = [P, I64, P, P, P, I64, I32, P, I32, P]
        lib.mk_create.restype = P
        lib.mk_create_rank.argtypes = [P, I64, P, P, P, I64, I32, P, I32, P, I32, I32, P, P, P]
        lib.mk_create_rank.restype = P
        lib.mk_counter_words.argtypes = [P]
        lib.mk_counter_words.restype = I64
        lib.mk_set_addrs.argtypes = [P, P]
        lib.mk_reset_counters.argtypes = [P]
        lib.mk_counters.argtypes = [P, P]
        lib.mk_run_step.argtypes = [P, I64, D]
        lib.mk_run_step.restype = I32
        lib.mk_dump.argtypes = [P, P]
        lib.mk_destroy.argtypes = [P]
        if lib.mk_abi_version() != ABI_VERSION:
            raise RuntimeError("stale megakernel CPU executor in the cache (ABI version mismatch)")
        _LIB = lib
    return _LIB


def header_as_read(encoded: torch.Tensor) -> dict[str, int]:
    """The program header as the C++ executor reads it (for the test against the Python decoder)."""
    lib = load_library()
    out = torch.zeros(11, dtype=torch.int64)
    t = encoded.contiguous()
    if lib.mk_header(t.data_ptr(), t.numel(), out.data_ptr()) != 0:
        raise ValueError("the executor rejected the program header")
    keys = ("n", "s", "q", "c", "nb", "batch", "off_buf", "off_ctr", "off_ins", "off_q", "total")
    return dict(zip(keys, out.tolist()))


def simd_width() -> int:
    """The vector width in floats the executor's hot loops were built for on this machine (16: AVX-512, 8: AVX2 +
    FMA, 1: the portable loops)."""
    return int(load_library().mk_simd_width())


ACTIVATIONS = ("exp", "tanh", "sigmoid", "silu", "bf16")  # mk_probe_act's functions, in its order


def probe_gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as the executor's GEMV computes it (weight ``[rows, K]`` fp32 or bf16, x ``[batch, K]``
    fp32): the hot loop alone, for its tests."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2 or x.dim() != 2 \
            or x.dtype != torch.float32 or x.shape[1] != weight.shape[1] or not 1 <= x.shape[0] <= MAX_BATCH:
        raise ValueError(f"probe_gemv needs a [rows, K] fp32/bf16 weight and [1..{MAX_BATCH}, K] fp32 rows, got "
                         f"{tuple(weight.shape)} {weight.dtype} and {tuple(x.shape)} {x.dtype}")
    w, xs = weight.contiguous(), x.contiguous()
    y = torch.full((xs.shape[0], w.shape[0]), float("nan"))
    dt = enc._dtype_code(w.dtype)
    if load_library().mk_probe_gemv(w.data_ptr(), dt, w.shape[1], w.shape[0], xs.data_ptr(), xs.shape[0],
                                    w.shape[1], y.data_ptr(), w.shape[0]) != 0:
        raise ValueError("the executor refused the GEMV probe")
    return y


def probe_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """One of the executor's element-wise functions (:data:`ACTIVATIONS`) over fp32 ``x``, as its hot loops
    compute it."""
    if name not in ACTIVATIONS or x.dtype != torch.float32:
        raise ValueError(f"probe_activation takes one of {ACTIVATIONS} over fp32, got {name!r}, {x.dtype}")
    xs = x.contiguous().reshape(-1)
    y = torch.full_like(xs, float("nan"))
    if load_library().mk_probe_act(ACTIVATIONS.index(name), xs.data_ptr(), xs.numel(), y.data_ptr()) != 0:
        raise ValueError("the executor refused the activation probe")
    return y.reshape(x.shape)


# ================================================================================================ the runner


def default_workers() -> int:
    """Worker threads by default: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def model_params(model: KimiForCausalLM) -> list[float]:
    """The model constants the opcodes need, in :data:`PARAMS` order."""
    cfg = model.config
    nan = float("nan")
    p = dict(act_bf16=float(model.dtype == torch.bfloat16), eps=cfg.rms_norm_eps,
             situ=float(cfg.hidden_act == "situ"), situ_beta=float(cfg.situ_beta),
             situ_lin=nan if cfg.situ_linear_beta is None else float(cfg.situ_linear_beta),
             dk=cfg.kda_head_dim if cfg.kda_layers else 0, conv=cfg.kda_conv_size,
             kda_lb=nan if cfg.kda_gate_lower_bound is None else float(cfg.kda_gate_lower_bound),
             nope=cfg.qk_nope_head_dim, rope=cfg.qk_rope_head_dim, kvl=cfg.kv_lora_rank, dv=cfg.v_head_dim,
             mla_scale=float(cfg.mla_softmax_scale) if cfg.mla_layers else 1.0, e=cfg.n_routed_experts,
             topk=cfg.num_experts_per_tok, renorm=float(bool(cfg.norm_topk_prob)),
             route_scale=float(cfg.routed_scaling_factor), lora_eps=0.0)
    vals = [float(p[k]) for k in PARAMS[:-1]]
    for layer in model.model.layers:
        a = layer.self_attn
        if layer.kind == "mla":
            vals += [float(a.q_a_layernorm.eps), float(a.kv_a_layernorm.eps)]
        else:
            vals += [0.0, 0.0]
    return vals


class CPUMegakernel:
    """Owns the program, the buffers and a native executor (its worker threads) for one model and batch size.

    ``program``: run this one instead of building it (tests plant broken programs; ``check`` decides whether the
    hazard checker may refuse it). ``pin``: pin worker ``w`` to the ``w``-th core this process may use."""

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, num_workers: int | None = None,
                 policy: str = "critical_path", tiling: Tiling | None = None, check: bool = True,
                 program: Program | None = None, pin: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 experts: str = "dense", shard: Shard = SINGLE, peer_memory: PeerMemory | None = None) -> None:
        MEGAKERNEL_CPU.check("megakernel-cpu", model, batch_size, max_seq_len, experts=experts, world=shard.world)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        if program is not None and (program.world, program.rank) != (shard.world, shard.rank):
            raise ValueError(f"{program} given with shard {shard}: build a rank program with its shard")
        if program is not None and program.expert_format != "dense":
            raise ValueError(f"the CPU executor reads programs with dense expert operands (got expert_format "
                             f"{program.expert_format!r}); MXFP4 experts stream through experts='mxfp4' instead")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        cfg = model.config
        self.num_workers = int(num_workers or default_workers())
        if self.num_workers < 1:
            raise ValueError(f"num_sms (worker threads) must be >= 1, got {self.num_workers}")
        self.model, self.cfg, self.batch = model, cfg, batch_size
        self.program = program if program is not None else build_program(
            cfg, batch_size, self.num_workers, policy, max_seq_len, tiling, act_dtype=model.dtype, shard=shard)
        self.shard = shard
        if shard.world > 1 and (peer_memory is None or peer_memory.world != shard.world):
            raise ValueError(f"rank {shard.rank} of {shard.world} needs the deployment's PeerMemory "
                             "(kimik3.megakernel.peer_memory) for its mailboxes and counters")
        self.peers = peer_memory
        if program is not None:
            self.num_workers = program.num_sms
        if check:
            bad = check_program(self.program)
            if bad:
                raise ValueError("megakernel program failed the hazard check:\n" + format_violations(bad))
        self.encoded = encode_program(self.program)
        self.timeout_s = float(timeout_s)
        # experts the model holds as MXFP4: {dense buffer name: (codes, scales)}, the model's own bytes
        self._held = self._held_experts(model)
        self.tensors: dict[str, torch.Tensor] = program_tensors(
            [b for b in self.program.buffers if b.name not in self._held and b.kind != Kind.MAILBOX], model)
        for k, spec in enumerate(self.program.buffers):  # this rank's mailboxes: its part of the shared segment
            if spec.kind == Kind.MAILBOX:
                if self.peers is None:
                    raise ValueError(f"{self.program} declares mailbox {spec.name} but has no PeerMemory")
                self.tensors[spec.name] = self.peers.mailbox(shard.rank, k)
        for spec in self.program.buffers:
            if spec.name in self.tensors:
                self._check_buffer(spec.name, self.tensors[spec.name], spec.shape, spec.dtype)
        self._scratch = [self.tensors[s.name] for s in self.program.buffers if s.kind in (Kind.ACT, Kind.OUTPUT)]
        # (a rank's mailboxes are never poisoned by the host: a peer may already be writing its next step's data)
        # routed experts as MXFP4: packed codes and scales the executor streams instead of the dense buffers
        self.experts = experts
        self._mx: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mx_addr = torch.zeros(2 * max(1, len(self.program.buffers)), dtype=torch.int64)
        if experts == "mxfp4":
            from kimik3.model.quant import mxfp4_quantize

            for k, spec in enumerate(self.program.buffers):
                if spec.kind == Kind.WEIGHT and spec.name.endswith(_EXPERT_SUFFIXES):
                    if spec.name in self._held:
                        packed, scale = self._held[spec.name]
                    else:  # ValueError: width not a multiple of 32
                        packed, scale = mxfp4_quantize(self.tensors[spec.name])
                    self._mx[spec.name] = (packed.contiguous(), scale.contiguous())
                    self._mx_addr[2 * k], self._mx_addr[2 * k + 1] = packed.data_ptr(), scale.data_ptr()
            if not self._mx:
                raise ValueError("experts='mxfp4': the program has no routed-expert weights")
        self.params = torch.tensor(model_params(model), dtype=torch.float64)
        self.n = len(self.program.instructions)
        self._timings = torch.zeros(max(1, self.n), 3, dtype=torch.int64)
        self._peer_wait = torch.zeros(max(1, self.n), dtype=torch.int64)  # ns waited on cross-rank counters
        self._addr = torch.zeros(max(1, len(self.program.buffers)), dtype=torch.int64)
        self.steps_done = 0
        self.last_step_s = float("nan")
        self.broken: str | None = None
        self._handle = None
        self._lib = load_library()
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._cpus = torch.tensor(cpus or [0], dtype=torch.int32)
        self._pin = bool(pin and cpus)
        self._bound = False

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _held_experts(model: KimiForCausalLM) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Routed experts the model holds as MXFP4, by the dense buffer name the program declares: (codes, scales)
        [E, rows, cols/2] / [E, rows, cols/32] uint8, the model's own buffers (empty for a dense model)."""
        if model.expert_storage != "mxfp4":
            return {}
        held = dict(model.named_buffers())
        out = {}
        for i in range(model.config.num_hidden_layers):
            if model.config.ffn(i) != "moe":
                continue
            mx = expert_weight_names(i, "mxfp4")
            for w, (dense,) in expert_weight_names(i, "dense").items():
                out[dense] = (held[mx[w][0]], held[mx[w][1]])
        return out

    @staticmethod
    def _check_buffer(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"buffer {name}: program declares {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"buffer {name} must be a contiguous CPU tensor")

    def bind_state(self, state: DecodeState) -> None:
        """Point the state buffers at ``state`` (updated in place by every step)."""
        for st in state.layers:
            if isinstance(st, KDAState):
                st.conv, st.S = st.conv.contiguous(), st.S.contiguous()
        self.tensors.update(state_views(self.cfg, state))
        for k, spec in enumerate(self.program.buffers):
            if spec.name in self._held:  # never dereferenced: the executor streams these from the MXFP4 table
                self._addr[k] = self._mx[spec.name][0].data_ptr()
                continue
            t = self.tensors.get(spec.name)
            if t is None:
                raise ValueError(f"state buffer {spec.name} is not bound")
            self._check_buffer(spec.name, t, spec.shape, spec.dtype)
            self._addr[k] = t.data_ptr()
        if self._handle is None:
            p = self.encoded
            peer, ctr = self.peers.addresses() if self.peers is not None else (None, None)
            h = self._lib.mk_create_rank(
                p.data_ptr(), p.numel(), self._addr.data_ptr(), self._mx_addr.data_ptr(), self.params.data_ptr(),
                self.params.numel(), int(self._pin), self._cpus.data_ptr(), self._cpus.numel(),
                self._timings.data_ptr(), self.shard.rank, self.shard.world,
                None if peer is None else peer.data_ptr(), None if ctr is None else ctr.data_ptr(),
                self._peer_wait.data_ptr())
            if not h:
                raise ValueError("the CPU megakernel refused the program: " + self._lib.mk_last_error().decode())
            self._handle = h
        else:
            self._lib.mk_set_addrs(self._handle, self._addr.data_ptr())
        self._bound = True

    def reset_counters(self) -> None:
        """Counters back to zero and the step number to 0 (after a reset of the decode state, or a watchdog)."""
        if self._handle is not None:
            self._lib.mk_reset_counters(self._handle)
        self.steps_done = 0
        self.broken = None

    def counters(self) -> list[int]:
        """This rank's counter words (one per local counter; one per source rank of a cross-rank counter)."""
        n = self._lib.mk_counter_words(self._handle)
        out = torch.zeros(max(1, n), dtype=torch.int64)
        self._lib.mk_counters(self._handle, out.data_ptr())
        return out[:n].tolist()

    def close(self) -> None:
        """Stop the worker threads (also on garbage collection)."""
        if self._handle is not None:
            self._lib.mk_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown: the library may be gone already)
            pass

    # ------------------------------------------------------------------ running
    def poison_scratch(self) -> None:
        """NaN-fill activations and outputs (max int / True for integer and bool buffers): reading anything not
        written in this step then shows up in the logits."""
        for t in self._scratch:
            t.fill_(True) if t.dtype == torch.bool else poison(t)

    @torch.no_grad()
    def run_step(self, ids: torch.Tensor, positions: torch.Tensor, poison_scratch: bool = False) -> torch.Tensor:
        """One decode step: tokens ``ids`` [B] at ``positions`` [B] → fp32 logits [B, V] (the logits buffer)."""
        if self.broken:
            raise RuntimeError(f"megakernel-cpu is unusable after: {self.broken}; call reset()")
        if not self._bound:
            raise RuntimeError("bind_state() first: the program's state buffers point nowhere")
        self.tensors["ids"][:, 0, 0] = ids
        self.tensors["pos"][:, 0, 0] = positions
        if poison_scratch:
            self.poison_scratch()
        t0 = time.perf_counter()
        rc = self._lib.mk_run_step(self._handle, self.steps_done, self.timeout_s)
        self.last_step_s = time.perf_counter() - t0  # the launch alone, wall clock
        if rc != 0:
            raise self._watchdog()
        self.steps_done += 1
        return self.tensors["logits"][:, 0, :]

    def _watchdog(self) -> MegakernelCPUError:
        p = self.program
        raw = torch.zeros(self.num_workers * 8, dtype=torch.int64)
        self._lib.mk_dump(self._handle, raw.data_ptr())
        rows = raw.view(self.num_workers, 8).tolist()
        states = {0: "finished", 1: "gave up", 2: "abandoned its wait"}
        dump, lines = [], [f"megakernel-cpu watchdog in step {self.steps_done}: a wait spun past {self.timeout_s} s"]
        for w, (state, qpos, qlen, v, c, target, seen, word) in enumerate(rows):
            d = {"worker": w, "state": states.get(state, str(state)), "position": qpos, "length": qlen,
                 "instruction": v if v >= 0 else None, "counter": c if c >= 0 else None, "target": target,
                 "seen": seen}
            if v >= 0:
                d["label"] = p.instructions[v].label()
            if c >= 0:
                d["counter_name"] = p.counters[c].name + (f" (word of rank {word})" if p.counters[c].sources else "")
            dump.append(d)
            if state == 0:
                lines.append(f"  worker {w}: finished all {qlen} instructions")
            else:
                lines.append(f"  worker {w}: {states.get(state, state)} at {qpos}/{qlen} on #{v} {d.get('label')}: "
                             f"counter {c} '{d.get('counter_name')}' needs {target}, saw {seen}")
        self.broken = lines[0]
        return MegakernelCPUError("\n".join(lines), dump)

    def peer_wait_ns(self) -> torch.Tensor:
        """The last step's ns per instruction spent waiting on cross-rank counters ``[N]`` (zero on one GPU)."""
        return self._peer_wait[: self.n].clone()

    def timings(self) -> torch.Tensor:
        """The last step's timing buffer ``[N, 3]`` int64 (start ns, end ns, worker id), the GPU kernel's format."""
        return self._timings[: self.n].clone()

    def timeline(self) -> pd.DataFrame:
        """The last step as a measured timeline table (:func:`kimik3.megakernel.timeline.from_timings`)."""
        return from_timings(self.program, self.timings())


# ================================================================================================ the stage


@register_stage
class MegakernelCPUStage(ProgramStage):
    """Stage "megakernel-cpu": every decode step is one call into the native executor.

    Options (``Decoder(..., stage="megakernel-cpu", **options)``): ``num_sms`` (worker threads = queues; default
    the cores this process may use), ``policy`` ("critical_path" or "round_robin"), ``tiling``, ``check``
    (hazard-check the program once), ``pin`` (pin workers to cores), ``timeout_s`` (watchdog), ``poison``
    (NaN-fill scratch before each step, for tests), ``experts`` ("dense", or "mxfp4": the routed experts stream
    as MXFP4 — exact for a model whose experts came from an MXFP4 checkpoint, a quantisation otherwise; a model
    holding its experts as MXFP4 needs "mxfp4", and its held bytes stream as they are), ``world`` (this process is
    one rank of a tensor- × expert-parallel deployment of that many processes, in an initialised
    ``torch.distributed`` group: its program's collectives run through a shared segment every rank maps; the
    returned logits are put together from the ranks' vocabulary shards by a host all-gather after the step, outside
    the timed launch). Prefill
    runs through the naive path token by token; the decode state is then shared with the executor, which updates
    it in place. Deterministic: every element is computed by one instruction in a fixed order, whatever the
    timing."""

    name = "megakernel-cpu"
    support = MEGAKERNEL_CPU

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, num_sms: int | None = None,
                 policy: str = "critical_path", tiling: Tiling | None = None, check: bool = True, pin: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S, poison: bool = False, experts: str = "dense",
                 world: int = 1) -> None:
        super().__init__(model, batch_size, max_seq_len, experts=experts, world=world)
        self.world, shard, peers, program = world, SINGLE, None, None
        if world > 1:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_world_size() != world:
                raise ValueError(f"megakernel-cpu with world={world} runs one rank per process: it needs an "
                                 f"initialised torch.distributed group of {world} ranks (kimik3.scale.launch)")
            shard = Shard(world, world, dist.get_rank())
            workers = int(num_sms or default_workers())
            program = build_program(model.config, batch_size, workers, policy, max_seq_len, tiling,
                                    act_dtype=model.dtype, shard=shard)
            peers = PeerMemory.rendezvous(program)
            self.vocab = shard.part(model.config.vocab_size, "vocab_size")
        self.runner = CPUMegakernel(model, batch_size, max_seq_len, num_sms, policy, tiling, check, pin=pin,
                                    timeout_s=timeout_s, experts=experts, program=program, shard=shard,
                                    peer_memory=peers)
        self.program = self.runner.program
        self.naive = NaiveStage(model, batch_size, max_seq_len)
        self.poison = poison

    def _bind(self) -> None:
        super()._bind()
        if self.world > 1:  # no rank signals a peer's freshly reset counters before that peer has reset them
            import torch.distributed as dist

            dist.barrier()

    def _run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.runner.run_step(ids, positions, poison_scratch=self.poison)
        if self.world == 1:
            return logits
        import torch.distributed as dist

        v0, v1 = self.vocab
        parts = [torch.empty_like(logits[:, v0:v1]) for _ in range(self.world)]
        dist.all_gather(parts, logits[:, v0:v1].contiguous())
        return torch.cat(parts, 1)
