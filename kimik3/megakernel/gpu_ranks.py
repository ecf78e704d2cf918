"""Rank programs on one GPU: every rank of a deployment in one launch (loopback), or one rank alone with a sink.

:class:`RanksRunner` takes a whole model and ``world``: ranks 0..W-1 of its tensor- × expert-parallel layout run in
one cooperative launch, rank r on CTAs [r·S, (r+1)·S) with S = SMs // W (``isa.CTL_LOCAL``: each CTA finds its
rank's program, address table, counters, timings and error words in the launch's local table); every rank's
counter memory and mailboxes are one allocation laid out as :func:`kimik3.megakernel.peer_memory.segment_layout`
with the kernel's 4-byte words, the peer table naming each rank's part — symmetric memory on one GPU. Given a rank's
slice (``ModelConfig.rank_slice``, e.g. ``k3-rank``) it runs that rank alone on every SM: its pushes to peers land
in a sink part and its peers' counter words are credited up front, so the rank's own step is timed (its peers'
partials are zeros: the numbers are checked by the loopback, not here). docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pandas as pd
import torch

from kimik3.kernels.contracts.isa import (
    CTL_LOCAL,
    CTL_WORDS,
    ERR_BAD_PROGRAM,
    ERROR_WORDS,
    LOCAL_BUFFERS,
    LOCAL_COUNTERS,
    LOCAL_ERROR,
    LOCAL_FIELDS,
    LOCAL_PROGRAM,
    LOCAL_TABLE,
    LOCAL_TIMINGS,
    MAX_LOCAL,
    PEER_TABLE,
)
from kimik3.kernels.contracts.peers import counter_bases
from kimik3.megakernel.gpu import (
    DEFAULT_SLEEP_NS,
    DEFAULT_SPINS,
    MegakernelError,
    _compile,
    _device_arch,
    address_table,
    check_device_contract,
    check_gpu_model,
)
from kimik3.megakernel.hazards import check_program, format_violations
from kimik3.megakernel.hazards_ranks import check_deployment
from kimik3.megakernel.instructions import Kind, Program, encode_program
from kimik3.megakernel.kernel_shapes import static_shapes, variant_name
from kimik3.megakernel.layout import program_tensors
from kimik3.megakernel.peer_memory import segment_layout
from kimik3.megakernel.ranks import Shard, of_slice
from kimik3.megakernel.scheduler import POLICIES, build_program
from kimik3.megakernel.step import Tiling
from kimik3.megakernel.timeline import from_timings
from kimik3.model.config import PRESET_NAMES, ModelConfig, get_preset
from kimik3.model.modeling import DecodeState, KimiForCausalLM
from kimik3.scope.gates import MEGAKERNEL
from kimik3.scope.spec import Request

__all__ = ["RanksRunner", "LaunchPlan", "launch_plan", "rank_state", "rank_kernel_name", "loopback_states",
           "CREDIT"]

CREDIT = 1 << 30  # a peer's counter word credited up front (a rank run alone): above any target of a long run


def rank_kernel_name(whole: ModelConfig, world: int, batch: int, expert_format: str) -> str:
    """The registry / prebuilt name of the kernel every rank of ``whole`` over ``world`` ranks runs: the preset that
    is that slice (``tiny-rank``, ``k3-rank``), else ``megakernel/<name>-w<world>/b<batch>`` (compiled here only)."""
    for name in PRESET_NAMES:
        c = get_preset(name)
        if c.rank_slice and c.rank_slice[0] == world and c.whole().replace(name=whole.name) == whole:
            return variant_name(c, batch, expert_format)
    return variant_name(whole.replace(name=f"{whole.name}-w{world}"), batch, expert_format)


def rank_state(model: KimiForCausalLM, batch: int, max_len: int) -> DecodeState:
    """A rank's decode state at the whole model's shapes (its program updates only its heads' rows), zeroed, on the
    model's device — for a rank's slice too, whose reference forward does not exist."""
    dev, dt = model.device, model.dtype
    states = [layer.self_attn.new_state(batch, dev, dt) if layer.kind == "kda"
              else layer.self_attn.new_cache(batch, max_len, dev, dt) for layer in model.model.layers]
    return DecodeState(states, max_len)


@dataclass(frozen=True)
class LaunchPlan:
    """What one launch of rank programs runs, decided on the host (CPU-testable: the device check's dry run checks
    it): the whole model, the world, the ranks' programs, the kernel's shapes and registry name, the CTAs per rank
    and whether the rank runs alone (its peers a sink)."""

    whole: ModelConfig
    world: int
    alone: bool
    programs: list[Program]
    shapes: dict
    kernel: str
    num_sms: int
    ctas_per_rank: int


def launch_plan(cfg: ModelConfig, batch: int, max_seq_len: int, world: int | None, num_sms: int,
                policy: str = "critical_path", tiling: Tiling | None = None, expert_format: str = "dense",
                check: bool = True) -> LaunchPlan:
    """The rank programs of one launch on a GPU of ``num_sms`` SMs: every rank of ``cfg`` over ``world`` (loopback,
    ``cfg`` whole) or, for a rank's slice (``world`` None), that rank alone; built, hazard-checked (``check``:
    each program, and the deployment in loopback) and fitted to the ranks kernel's device contract. ``ValueError``
    names whatever does not hold."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    whole, shard = of_slice(cfg)
    alone = bool(cfg.rank_slice)
    if alone and world is not None and world != shard.world:
        raise ValueError(f"model {cfg.name!r} is rank {shard.rank} of {shard.world}: world={world} differs")
    if not alone and (isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= MAX_LOCAL):
        raise ValueError(f"world must be an int in 2..{MAX_LOCAL} (the ranks one launch holds), got {world!r}")
    # the gate sees the ranks this launch holds: a rank's slice alone is one
    reasons = MEGAKERNEL.refuse(whole, Request(dtype=torch.bfloat16, device="cuda", batch=batch, context=max_seq_len,
                                               storage=expert_format, sms=num_sms, world=1 if alone else world))
    if reasons:
        raise ValueError("stage 'megakernel' " + "; ".join(reasons))
    world, ranks = (shard.world, [shard.rank]) if alone else (world, list(range(world)))
    per = num_sms if alone else num_sms // world
    programs = [build_program(whole, batch, per, policy, max_seq_len, tiling, act_dtype=torch.bfloat16,
                              expert_format=expert_format, shard=Shard(world, world, r)) for r in ranks]
    if check:
        bad = [v for p in programs for v in check_program(p)]
        if not bad and not alone:
            bad = check_deployment(programs)
        if bad:
            raise ValueError("rank programs failed the hazard check:\n" + format_violations(bad))
    shapes = static_shapes(whole.replace(rank_slice=(world, 0)), batch, expert_format=expert_format)
    for p in programs:
        problems = check_device_contract(p, whole, batch, shapes)
        if problems:
            raise ValueError(f"rank {p.rank}'s program does not fit the device code:\n  " + "\n  ".join(problems[:20]))
    layouts = [segment_layout(p, word_bytes=4, capacity=shapes["max_ctrs"]) for p in programs]
    if any(lay != layouts[0] for lay in layouts[1:]):
        raise ValueError("the ranks' programs lay out their counters and mailboxes differently")
    return LaunchPlan(whole, world, alone, programs, shapes, rank_kernel_name(whole, world, batch, expert_format),
                      num_sms, per)


@dataclass
class _Rank:
    """One rank of the launch: its program and the device tensors the kernel reads as that rank's."""

    program: Program
    tensors: dict[str, torch.Tensor]
    prog: torch.Tensor
    addr: torch.Tensor
    counters: torch.Tensor
    timings: torch.Tensor
    error: torch.Tensor
    bound: bool = False


class RanksRunner:
    """The rank programs of one deployment on one CUDA device, one step per launch.

    ``model``: a whole model and ``world`` (2..``isa.MAX_LOCAL``): loopback, every rank's weights cut from it; or a
    rank's slice (``world`` None): that rank alone. ``num_sms``: CTAs of the launch (default: the GPU's SMs; a
    loopback rank gets ``num_sms // world``). Refusals are ``ValueError`` with the reason; a tripped watchdog raises
    :class:`~kimik3.megakernel.gpu.MegakernelError` naming the rank."""

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, world: int | None = None,
                 num_sms: int | None = None, policy: str = "critical_path", tiling: Tiling | None = None,
                 check: bool = True, max_spins: int = DEFAULT_SPINS, sleep_ns: int = DEFAULT_SLEEP_NS,
                 prebuilt: str | None = None) -> None:
        dev = check_gpu_model(model, batch_size, max_seq_len, world=1 if model.config.rank_slice else world,
                              num_sms=num_sms)
        self.arch = _device_arch(dev)
        self.plan = launch_plan(model.config, batch_size, max_seq_len, world,
                                int(num_sms or torch.cuda.get_device_properties(dev).multi_processor_count), policy,
                                tiling, model.expert_storage, check)
        pl = self.plan
        self.model, self.cfg, self.whole, self.batch, self.device = model, model.config, pl.whole, batch_size, dev
        self.alone, self.world, self.num_sms, self.ctas_per_rank = pl.alone, pl.world, pl.num_sms, pl.ctas_per_rank
        self.shapes, self.name = pl.shapes, pl.kernel
        programs = pl.programs
        shard = Shard(self.world, self.world, programs[0].rank)
        self.fn = _compile(self.arch, self.shapes, prebuilt, self.name)
        self.max_spins, self.sleep_ns = int(max_spins), int(sleep_ns)
        # one allocation: every rank's part (alone: its own and the sink its peers stand for)
        _, self.part_bytes, offsets = segment_layout(programs[0], word_bytes=4,
                                                              capacity=self.shapes["max_ctrs"])
        parts = 2 if self.alone else self.world
        self.segment = torch.zeros(parts * self.part_bytes, dtype=torch.uint8, device=dev)
        self.ranks = [self._rank(p, i, offsets) for i, p in enumerate(programs)]
        peers = torch.zeros(PEER_TABLE, dtype=torch.int64)
        base = self.segment.data_ptr()
        if self.alone:
            peers[: self.world] = base + self.part_bytes  # every peer: the sink
            peers[shard.rank] = base
        else:
            peers[: self.world] = torch.arange(self.world, dtype=torch.int64) * self.part_bytes + base
        local = torch.zeros(LOCAL_TABLE, dtype=torch.int64)
        if not self.alone:
            for i, rk in enumerate(self.ranks):
                for k, t in ((LOCAL_PROGRAM, rk.prog), (LOCAL_BUFFERS, rk.addr), (LOCAL_COUNTERS, rk.counters),
                             (LOCAL_TIMINGS, rk.timings), (LOCAL_ERROR, rk.error)):
                    local[i * LOCAL_FIELDS + k] = t.data_ptr()
        self.peers, self.local = peers.to(dev), local.to(dev)
        self.ctl = torch.zeros(CTL_WORDS, dtype=torch.int32, device=dev)
        self.vocab = [Shard(self.world, self.world, p.rank).part(self.whole.vocab_size, "vocab_size") for p in programs]
        self.steps_done = 0
        self.broken: str | None = None
        self.reset_counters()

    # ------------------------------------------------------------------ tensors
    def _rank(self, p: Program, part: int, offsets: dict[int, int]) -> _Rank:
        dev = self.device
        tensors = program_tensors([b for b in p.buffers if b.kind != Kind.MAILBOX], self.model, dev)
        lo = part * self.part_bytes
        for k, off in offsets.items():
            spec = p.buffers[k]
            n = spec.shape[0] * spec.shape[1] * spec.shape[2] * spec.element_size
            tensors[spec.name] = self.segment[lo + off: lo + off + n].view(spec.dtype).view(spec.shape)
        encoded = encode_program(p)
        prog = torch.zeros(self.shapes["prog_words"], dtype=torch.int32)
        prog[: encoded.numel()] = encoded
        counters = self.segment[lo: lo + 4 * self.shapes["max_ctrs"]].view(torch.int32)
        return _Rank(p, tensors, prog.to(dev), torch.zeros(self.shapes["max_bufs"], dtype=torch.int64, device=dev),
                     counters, torch.zeros(self.shapes["max_instr"], 3, dtype=torch.int64, device=dev),
                     torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev))

    @property
    def programs(self) -> list[Program]:
        return [r.program for r in self.ranks]

    def new_states(self) -> list[DecodeState]:
        """One zeroed decode state per launched rank (at the whole model's shapes)."""
        return [rank_state(self.model, self.batch, self.ranks[0].program.max_seq_len) for _ in self.ranks]

    def bind_state(self, states: list[DecodeState]) -> None:
        """Point each rank's state buffers at its own decode state (updated in place by every step)."""
        if len(states) != len(self.ranks):
            raise ValueError(f"{len(states)} decode states for {len(self.ranks)} ranks")
        for rk, state in zip(self.ranks, states):
            try:
                addr = address_table(rk.program, rk.tensors, self.whole, state, self.device, self.shapes["max_bufs"])
            except ValueError as e:
                raise ValueError(f"rank {rk.program.rank}: {e}") from None
            rk.addr.copy_(addr)
            rk.bound = True

    def reset_counters(self) -> None:
        """Counters (and mailboxes) back to zero and the step number to 0; a rank run alone has its peers' counter
        words credited again."""
        self.segment.zero_()
        for rk in self.ranks:
            rk.error.zero_()
        if self.alone:
            rk = self.ranks[0]
            bases = counter_bases([c.sources for c in rk.program.counters])
            words = [b + k for b, c in zip(bases, rk.program.counters) if c.sources
                     for k in range(c.sources) if k != rk.program.rank]
            if words:
                rk.counters[torch.tensor(words, device=self.device)] = CREDIT
        self.steps_done = 0
        self.broken = None

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def run_step(self, ids: torch.Tensor, positions: torch.Tensor, check_error: bool = True) -> torch.Tensor:
        """One decode step of every launched rank: fp32 logits ``[B, V]`` gathered from the ranks' vocabulary
        shards (a rank alone: its own shard's columns, ``[B, V / world]``)."""
        if self.broken:
            raise RuntimeError(f"the rank launch is unusable after: {self.broken}; call reset_counters()")
        if not all(rk.bound for rk in self.ranks):
            raise RuntimeError("bind_state() first: the programs' state buffers point nowhere")
        for rk in self.ranks:
            rk.tensors["ids"][:, 0, 0] = ids.to(self.device, torch.int64)
            rk.tensors["pos"][:, 0, 0] = positions.to(self.device, torch.int64)
        self.ctl.copy_(torch.tensor([self.steps_done, self.max_spins, self.sleep_ns, 0, 0, 0, 0, 0],
                                    dtype=torch.int32))
        self.ctl[CTL_LOCAL] = 0 if self.alone else self.world
        r0 = self.ranks[0]
        self.fn(r0.prog, r0.addr, r0.counters, r0.timings, r0.error, self.ctl, self.peers, self.local,
                self.ctas_per_rank * len(self.ranks))
        self.steps_done += 1
        if check_error:
            self.check_error()
        if self.alone:
            v0, v1 = self.vocab[0]
            return r0.tensors["logits"][:, 0, v0:v1]
        out = torch.empty(self.batch, self.whole.vocab_size, dtype=torch.float32, device=self.device)
        for rk, (v0, v1) in zip(self.ranks, self.vocab):
            out[:, v0:v1] = rk.tensors["logits"][:, 0, v0:v1]
        return out

    def next_tokens(self) -> torch.Tensor:
        """The step's greedy tokens, which every rank's ARGMAX_ALL computes alike (checked)."""
        toks = [rk.tensors["next_token"][:, 0, 0].cpu() for rk in self.ranks]
        if any(not torch.equal(t, toks[0]) for t in toks[1:]):
            raise RuntimeError(f"the ranks' next tokens differ (their arg-max reads the same mailbox rows): "
                               f"{[t.tolist() for t in toks]}")
        return toks[0]

    def check_error(self) -> None:
        """Raise :class:`MegakernelError` naming the rank whose watchdog tripped (synchronises)."""
        for rk in self.ranks:
            words = rk.error.cpu().tolist()
            if words[0] == 0:
                continue
            p = rk.program
            if words[0] == ERR_BAD_PROGRAM:
                msg = f"rank {p.rank}: the kernel rejected the program header (magic, width, format, rank or peers)"
            else:
                v, c = words[1], words[2]
                label = p.instructions[v].label() if 0 <= v < len(p.instructions) else "?"
                cname = p.counters[c].name if 0 <= c < len(p.counters) else "?"
                msg = (f"rank {p.rank}: watchdog: instruction #{v} ({label}) on CTA {words[5]} (SM {words[6]}) gave "
                       f"up in step {words[7]} waiting for counter {c} '{cname}' >= {words[3]} (it was {words[4]})")
            self.broken = msg
            raise MegakernelError(msg, words)

    def timings(self, rank: int = 0) -> torch.Tensor:
        """Launched rank ``rank``'s (position in the launch) timing buffer of the last step, ``[N, 3]`` on the CPU."""
        rk = self.ranks[rank]
        return rk.timings[: len(rk.program.instructions)].cpu()

    def timeline(self, rank: int = 0) -> pd.DataFrame:
        return from_timings(self.ranks[rank].program, self.timings(rank))


def loopback_states(runner: RanksRunner, state: DecodeState) -> list[DecodeState]:
    """Every loopback rank's decode state from one (e.g. the naive path's after prefill): rank 0 continues
    ``state`` itself, every other rank a copy."""
    return [state] + [copy.deepcopy(state) for _ in runner.ranks[1:]]
