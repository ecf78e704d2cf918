"""One decode step as a persistent-megakernel program: instruction set, scheduler, hazard checker, CPU
interpreter and timelines.

* :mod:`~kimik3.megakernel.instructions` — opcodes, operand declarations, the int32 program encoding;
* :mod:`~kimik3.megakernel.layout` — buffer names, the packed weight layout and the routed experts' formats
  (:data:`EXPERT_FORMATS`: dense, or MXFP4 codes + scales as the K3 release ships them);
* :mod:`~kimik3.megakernel.step` — one decode step of the model as instructions in sequential order (tiling,
  operand declarations, groups);
* :mod:`~kimik3.megakernel.scheduler` — the generic rest: hazards, costs, SM queues, waits, the program for a
  config, batch size and SM count;
* :mod:`~kimik3.megakernel.hazards` — proves a program race- and deadlock-free from its declarations;
* :mod:`~kimik3.megakernel.interpreter` — runs the int32 program on the CPU under random interleavings
  (stage ``"megakernel-interp"``, imported lazily by :func:`kimik3.stages.get_stage`);
* :mod:`~kimik3.megakernel.cpu` — the same program executed by native worker threads, one per core (stage
  ``"megakernel-cpu"``), with measured per-instruction timings;
* :mod:`~kimik3.megakernel.timeline` — cost-model or measured timelines, Gantt chart, summaries.
"""

from kimik3.megakernel.hazards import Violation, check_program, redundant_waits
from kimik3.megakernel.instructions import (
    EXPERT_FORMATS,
    Op,
    Program,
    decode_program,
    encode_program,
    instruction_set_table,
)
from kimik3.megakernel.scheduler import POLICIES, CostModel, build_program, instruction_costs
from kimik3.megakernel.step import StepSpec, Tiling, build_step
from kimik3.megakernel.timeline import gantt, simulate, summary

__all__ = [
    "EXPERT_FORMATS",
    "POLICIES",
    "CostModel",
    "Op",
    "Program",
    "StepSpec",
    "Tiling",
    "Violation",
    "build_program",
    "build_step",
    "check_program",
    "decode_program",
    "encode_program",
    "gantt",
    "instruction_costs",
    "instruction_set_table",
    "redundant_waits",
    "simulate",
    "summary",
]
