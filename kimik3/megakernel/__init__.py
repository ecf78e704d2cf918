"""One decode step as a persistent-megakernel program, from instructions to executors (docs/architecture.md, map).

* :mod:`~kimik3.megakernel.instructions` — opcodes, operand declarations, the int32 program encoding;
* :mod:`~kimik3.megakernel.layout` — buffer names, packed weights, routed-expert formats (dense or MXFP4);
* :mod:`~kimik3.megakernel.step` — one decode step of the model as instructions in sequential order;
* :mod:`~kimik3.megakernel.scheduler` — hazards, costs, SM queues and waits: the program for a config (or for one
  rank of a deployment, :mod:`~kimik3.megakernel.ranks`);
* :mod:`~kimik3.megakernel.hazards` — proves a program race- and deadlock-free from its declarations;
* :mod:`~kimik3.megakernel.interpreter`, :mod:`~kimik3.megakernel.cpu`, :mod:`~kimik3.megakernel.gpu` — the program
  run by a Python interpreter under random interleavings, by native worker threads and by the GPU kernel (stages
  ``"megakernel-interp"``, ``"megakernel-cpu"``, ``"megakernel"``, imported lazily by :func:`kimik3.stages.get_stage`);
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
