"""Stage ``"megakernel"``: every decode step is one launch of the persistent CuTe DSL megakernel — one GPU's program
(:class:`kimik3.megakernel.gpu.MegakernelRunner`), or with ``world`` > 1 every rank of a tensor- × expert-parallel
deployment in that one launch (:class:`kimik3.megakernel.gpu_ranks.RanksRunner`, loopback on one GPU). Prefill runs
through the model's chunked forward; the decode state is then handed to the kernel, which updates it in place.
docs/architecture.md (map: how a stage runs a megakernel program; megakernel across ranks).
"""

from __future__ import annotations

from kimik3.megakernel.gpu import DEFAULT_SLEEP_NS, DEFAULT_SPINS, MegakernelRunner
from kimik3.megakernel.gpu_ranks import RanksRunner, loopback_states
from kimik3.megakernel.stage_base import ProgramStage
from kimik3.megakernel.step import Tiling
from kimik3.model.modeling import KimiForCausalLM
from kimik3.scope.gates import MEGAKERNEL
from kimik3.stages import register_stage
from kimik3.stages.naive import NaiveStage

__all__ = ["MegakernelStage"]


@register_stage
class MegakernelStage(ProgramStage):
    """Stage "megakernel": every decode step is one launch of the persistent CuTe DSL megakernel.

    Options (``Decoder(..., stage="megakernel", **options)``): ``policy`` ("critical_path" or "round_robin"),
    ``num_sms`` (default: the GPU's SM count; one CTA per SM), ``tiling``, ``check`` (hazard-check the program
    once), ``max_spins`` / ``sleep_ns`` (watchdog), ``prebuilt`` (a directory from ``python -m kimik3 kernels
    build``; default: compile with the DSL in-process), ``world`` (> 1: the rank programs of a deployment of that
    many ranks, all in the one launch on ``num_sms // world`` SMs each, their collectives through one allocation).
    A model holding its routed experts as MXFP4 runs the ``-mxfp4`` kernel variant on the held codes and scales."""

    name = "megakernel"
    support = MEGAKERNEL

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, policy: str = "critical_path",
                 num_sms: int | None = None, tiling: Tiling | None = None, check: bool = True,
                 max_spins: int = DEFAULT_SPINS, sleep_ns: int = DEFAULT_SLEEP_NS, prebuilt: str | None = None,
                 world: int = 1) -> None:
        super().__init__(model, batch_size, max_seq_len, world=world, sms=num_sms)
        self.world = world
        if world == 1:
            self.runner = MegakernelRunner(model, batch_size, max_seq_len, num_sms, policy, tiling, check,
                                           max_spins=max_spins, sleep_ns=sleep_ns, prebuilt=prebuilt)
            self.program = self.runner.program
        else:
            self.runner = RanksRunner(model, batch_size, max_seq_len, world, num_sms, policy, tiling, check,
                                      max_spins=max_spins, sleep_ns=sleep_ns, prebuilt=prebuilt)
            self.program = self.runner.programs[0]
        # the prompt through the model's chunked forward (as stage fused does): a long prompt token by token would
        # cost a naive step per token, only decode steps run on the kernel
        self.naive = NaiveStage(model, batch_size, max_seq_len, prefill="chunked")

    def _bind(self) -> None:
        if self.world == 1:
            return super()._bind()
        # rank 0 continues the prefilled state, every other rank a copy (each updates only its heads' rows)
        self.runner.bind_state(loopback_states(self.runner, self.naive.state))
        self.runner.reset_counters()
