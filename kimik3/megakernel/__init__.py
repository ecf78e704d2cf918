"""One decode step as a persistent-megakernel program: instruction set, scheduler, hazard checker, CPU
interpreter and timelines.

* :mod:`~kimik3.megakernel.instructions` — opcodes, operand declarations, the int32 program encoding;
* :mod:`~kimik3.megakernel.layout` — buffer names and the packed weight layout;
* :mod:`~kimik3.megakernel.scheduler` — builds the program for a config, batch size and SM count;
* :mod:`~kimik3.megakernel.hazards` — proves a program race- and deadlock-free from its declarations;
* :mod:`~kimik3.megakernel.interpreter` — runs the int32 program on the CPU under random interleavings
  (stage ``"megakernel-cpu"``, imported lazily by :func:`kimik3.stages.get_stage`);
* :mod:`~kimik3.megakernel.timeline` — cost-model or measured timelines, Gantt chart, summaries.
"""

from kimik3.megakernel.hazards import Violation, check_program, redundant_waits
from kimik3.megakernel.instructions import Op, Program, decode_program, encode_program, instruction_set_table
from kimik3.megakernel.scheduler import POLICIES, CostModel, Tiling, build_program
from kimik3.megakernel.timeline import gantt, simulate, summary

__all__ = [
    "POLICIES",
    "CostModel",
    "Op",
    "Program",
    "Tiling",
    "Violation",
    "build_program",
    "check_program",
    "decode_program",
    "encode_program",
    "gantt",
    "instruction_set_table",
    "redundant_waits",
    "simulate",
    "summary",
]
