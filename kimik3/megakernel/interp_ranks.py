"""Run the W rank programs of a deployment in one process, under random interleavings across ranks and SMs.

Each rank gets its own :class:`~kimik3.megakernel.interpreter.CPUInterpreter` — its own buffers, mailboxes, counter
memory and decode state — and the interpreters are linked as peers, so a PUSH operand lands in every rank's
mailbox and a signal in every rank's copy of a cross-rank counter (``kernels/contracts/peers.py``). At each tick
one ready (rank, SM) pair, chosen at random, runs its head instruction to completion; only the declared waits
constrain the order, so a missing cross-rank wait shows up as a wrong answer (the mailboxes are poisoned each
step) or a deadlock. The logits are put together from each rank's vocabulary shard; every rank must agree on the
next token. See docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

import copy
import random

import torch

from kimik3.megakernel.hazards import check_program, format_violations
from kimik3.megakernel.hazards_ranks import check_deployment
from kimik3.megakernel.instructions import Program, decode_program
from kimik3.megakernel.interpreter import CPUInterpreter, DeadlockError
from kimik3.megakernel.layout import carry_held
from kimik3.megakernel.ranks import Shard
from kimik3.megakernel.scheduler import POLICIES, build_program
from kimik3.megakernel.step import Tiling
from kimik3.model.config import ModelConfig
from kimik3.model.modeling import DecodeState, KimiForCausalLM
from kimik3.scope.gates import MEGAKERNEL_INTERP
from kimik3.stages import register_stage
from kimik3.stages.base import Stage
from kimik3.stages.naive import NaiveStage

__all__ = ["rank_programs", "RanksInterpreter", "MegakernelInterpStage"]


def rank_programs(cfg: ModelConfig | str, batch: int, num_sms: int, world: int, **kwargs) -> list[Program]:
    """The programs of ranks ``0..world-1`` of the tensor- × expert-parallel layout (``kwargs``: the rest of
    :func:`~kimik3.megakernel.scheduler.build_program`'s arguments)."""
    return [build_program(cfg, batch, num_sms, shard=Shard(world, world, r), **kwargs) for r in range(world)]


class RanksInterpreter:
    """The interpreters of a deployment's ranks, linked as peers; one :meth:`run_step` runs them all."""

    def __init__(self, programs: list[Program], model: KimiForCausalLM) -> None:
        world = len(programs)
        if not world:
            raise ValueError("no rank programs given")
        for r, p in enumerate(programs):
            if p.world != world or p.rank != r:
                raise ValueError(f"program {r} is rank {p.rank} of {p.world}, but {world} programs were given: "
                                 "pass ranks 0..world-1 in order")
        self.programs = programs
        self.ranks = [CPUInterpreter(p, model) for p in programs]
        for it in self.ranks:
            it.peers = self.ranks
        V = model.config.vocab_size
        self.vocab = [Shard(world, world, r).part(V, "vocab_size") if world > 1 else (0, V) for r in range(world)]
        self.ticks: list[tuple[int, int]] = []  # (rank, instruction) in execution order, last step

    @property
    def world(self) -> int:
        return len(self.ranks)

    def bind_state(self, states: list[DecodeState]) -> None:
        """One decode state per rank (each holds the full tensors; a rank updates only its own heads' part)."""
        if len(states) != self.world:
            raise ValueError(f"{len(states)} decode states for {self.world} ranks")
        for it, st in zip(self.ranks, states):
            it.bind_state(st)

    @torch.no_grad()
    def run_step(self, ids: torch.Tensor, positions: torch.Tensor, seed: int = 0, poison_scratch: bool = True
                 ) -> torch.Tensor:
        """One decode step on every rank: fp32 logits [B, V], each rank's vocabulary columns from that rank."""
        for it in self.ranks:
            it.begin_step(ids, positions, poison_scratch)
        rng = random.Random(seed)
        self.ticks = []
        while any(it.remaining for it in self.ranks):
            ready = [(r, sm) for r, it in enumerate(self.ranks) for sm in it.ready()]
            if not ready:
                raise self._deadlock()
            r, sm = ready[rng.randrange(len(ready))]
            it = self.ranks[r]
            self.ticks.append((r, it.program.queues[sm][it.head[sm]]))
            it.run_head(sm)
        logits = [it.end_step() for it in self.ranks]
        tokens = [it.tensors["next_token"][:, 0, 0] for it in self.ranks]
        for r, t in enumerate(tokens[1:], 1):
            if not torch.equal(t, tokens[0]):
                raise AssertionError(f"rank {r} chose next tokens {t.tolist()}, rank 0 {tokens[0].tolist()}: the "
                                     "ranks' streams diverged")
        out = torch.empty_like(logits[0])
        for (v0, v1), lg in zip(self.vocab, logits):
            out[:, v0:v1] = lg[:, v0:v1]
        return out

    def _deadlock(self) -> DeadlockError:
        parts, dump = [], []
        for r, it in enumerate(self.ranks):
            e = it._deadlock(it.steps_done, it.head, it.base)
            parts.append(f"rank {r}: " + str(e).replace("\n", f"\n  rank {r}:"))
            dump.append(e.dump)
        return DeadlockError("deadlock across ranks: no (rank, SM) can proceed\n" + "\n".join(parts), dump)


# ============================================================================================== the stage


@register_stage
class MegakernelInterpStage(Stage):
    """Stage "megakernel-interp": every decode step runs the megakernel program in the CPU interpreter (the
    randomised-interleaving checker; the native parallel executor is stage "megakernel-cpu").

    Options (``Decoder(..., stage="megakernel-interp", **options)``): ``policy`` ("critical_path" or
    "round_robin"), ``num_sms`` (queues to schedule for), ``seed`` (step ``i`` uses interleaving seed
    ``seed·1000003 + i``), ``tiling`` (a :class:`~kimik3.megakernel.step.Tiling`), ``check`` (run the hazard
    checker on the program once, at construction — across ranks too), ``poison`` (NaN-fill scratch buffers and
    mailboxes before each step) and ``world`` (run the rank programs of a tensor- × expert-parallel deployment of
    that many ranks, each with its own buffers and decode state, interleaved across ranks and SMs).
    Deterministic: every element is computed by one instruction in a fixed order whatever the interleaving."""

    name = "megakernel-interp"
    support = MEGAKERNEL_INTERP

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, policy: str = "critical_path",
                 num_sms: int = 8, seed: int = 0, tiling: Tiling | None = None, check: bool = True,
                 poison: bool = True, world: int = 1) -> None:
        super().__init__(model, batch_size, max_seq_len, world=world)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        # the program carries the routed experts as the model holds them (dense, or the MXFP4 bytes as they are)
        self.programs = rank_programs(model.config, batch_size, num_sms, world, policy=policy,
                                      max_seq_len=max_seq_len, tiling=tiling, act_dtype=model.dtype,
                                      expert_format=model.expert_storage)
        self.program = self.programs[0]
        if check:
            bad = [v for p in self.programs for v in check_program(p)]
            if world > 1 and not bad:
                bad = check_deployment(self.programs)
            if bad:
                raise ValueError("megakernel program failed the hazard check:\n" + format_violations(bad))
        self.encoded = [p.tensor() for p in self.programs]
        if world == 1:
            self.interpreter = CPUInterpreter(self.encoded[0], model)
            self.ranks = None
        else:
            # the decoded programs, with what the device does not need: which share of a whole weight each holds
            self.ranks = RanksInterpreter([carry_held(decode_program(t), p) for t, p in zip(self.encoded,
                                                                                          self.programs)], model)
            self.interpreter = self.ranks.ranks[0]
        self.naive = NaiveStage(model, batch_size, max_seq_len)
        self.seed, self.poison = seed, poison
        self.steps = 0

    def _bind(self) -> None:
        if self.ranks is None:
            self.interpreter.bind_state(self.naive.state)
        else:  # rank 0 continues the naive state; every other rank decodes from its own copy
            self.ranks.bind_state([self.naive.state] + [copy.deepcopy(self.naive.state)
                                                        for _ in range(self.ranks.world - 1)])

    def reset(self) -> None:
        self.naive.reset()
        self._bind()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        logits = self.naive.prefill(input_ids, lengths)  # token by token through the reference path
        self._bind()
        return logits

    def snapshot(self) -> DecodeState:
        """A copy of the decode state (rank 0's; e.g. right after prefill), for :meth:`restore`."""
        return copy.deepcopy(self.naive.state)

    def restore(self, state: DecodeState, seed: int | None = None) -> None:
        """Continue from a copy of ``state`` (on every rank), optionally under another interleaving seed (step
        counter reset) — to replay the same decode steps under different interleavings. Counters keep growing:
        they never reset."""
        self.naive.state = copy.deepcopy(state)
        self._bind()
        if seed is not None:
            self.seed, self.steps = seed, 0

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        run = self.interpreter.run_step if self.ranks is None else self.ranks.run_step
        logits = run(ids, positions, seed=self.seed * 1000003 + self.steps, poison_scratch=self.poison)
        self.steps += 1
        return logits.clone()
