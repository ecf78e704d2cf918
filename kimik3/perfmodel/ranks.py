"""One rank of a deployment under the performance model, and the rack-level speed it implies (a model, §8).

A rank slice preset (``ModelConfig.rank_slice``, e.g. ``k3-rank``) is scored on its rank's program of the whole
model: the local step is the program's timeline under the calibrated constants (one H200's); the wire adds each
collective's time — the assumed latency plus the bytes its producers push to the ``world − 1`` peers over one
direction of the rack's NVLink (``kimik3.scale.wire``) — as a delay on the peers' signals, so the program's own
dependencies say how much of it hides. Tokens/s per sequence = 1 ÷ that step (the rack's: batch × replicas ÷ it).
Measured and modelled parts are named in the result (``parts``). docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kimik3.perf.hardware import get_hardware
from kimik3.scale.nvl72 import CommModel, _link_bandwidth
from kimik3.scale.wire import collective_table

__all__ = ["RACK_HARDWARE", "LATENCY_RANGE", "wire_delays", "rank_extras", "measured_extras"]

RACK_HARDWARE = "gb300"  # the rack the seeds' claim is on (data/published.json: GB300 NVL72)
# the per-collective latency is an assumption (no NVL72 latency was measured here): the range halves and doubles
# the CommModel point
LATENCY_RANGE = (0.5, 2.0)


def wire_delays(program: Any, comm: CommModel, link_Bps: float) -> tuple[np.ndarray, float, float]:
    """(per-counter delay of the peers' signals in ns, serial wire ns, bytes out per step) of a rank program."""
    table = collective_table(program)
    wire = (comm.allreduce_latency_s + table["bytes_out"].to_numpy(dtype=float) / link_Bps) * 1e9
    delay = np.zeros(len(program.counters))
    delay[table["counter"].to_numpy(dtype=int)] = wire
    return delay, float(wire.sum()), float(table["bytes_out"].sum())


def rank_extras(program: Any, simulate: Any, batch: int, kernel_boundary_ns: float, local_ms: float,
                local_range_ms: tuple[float, float], step_bytes: float, comm: CommModel | None = None,
                gpus: int | None = None) -> dict[str, Any]:
    """The rank's step with the wire and the rack-level tokens/s, with ranges. ``simulate(delay)`` runs the
    program's model timeline with the peers' signals delayed (ns per counter) and returns its makespan in ns;
    ``local_ms`` / ``local_range_ms``: the step without the wire (point; optimistic, pessimistic);
    ``step_bytes``: the bytes the rank's step must move (the cost model's), for the bandwidth bound: those bytes
    at the rack GPU's datasheet HBM bandwidth plus the wire's serial bytes over its link, no latency (a real upper
    bound on tokens/s: nothing streams faster than the datasheet)."""
    from kimik3.model.config import RACK_GPUS

    comm = comm or CommModel()
    spec = get_hardware(RACK_HARDWARE)
    link = _link_bandwidth(spec, comm, None)
    gpus = gpus or RACK_GPUS
    steps = {}
    for name, f in (("point", 1.0), ("optimistic", LATENCY_RANGE[0]), ("pessimistic", LATENCY_RANGE[1])):
        c = CommModel(comm.a2a_latency_s, comm.allreduce_latency_s * f, comm.link_efficiency)
        delay, serial, out = wire_delays(program, c, link)
        steps[name] = ((simulate(delay) + kernel_boundary_ns) / 1e6, serial / 1e6, out)
    step, serial, out = steps["point"]
    exposed = step - local_ms
    lo = local_range_ms[0] + (steps["optimistic"][0] - local_ms)  # the wire's exposed share added to each end
    hi = local_range_ms[1] + (steps["pessimistic"][0] - local_ms)
    world = program.world
    bound_ms = (step_bytes / spec.hbm_bandwidth + out / link) * 1e3
    return {"rank": {"world": world, "rank": program.rank, "collectives": int(len(collective_table(program))),
                     "wire_bytes_out": out, "serial_wire_ms": round(serial, 6), "exposed_wire_ms": round(exposed, 6),
                     "hidden_share": round(1.0 - exposed / serial, 4) if serial else None,
                     "step_ms": round(step, 6), "step_ms_range": [round(lo, 6), round(hi, 6)],
                     "link_GBps": link / 1e9, "latency_us": comm.allreduce_latency_s * 1e6,
                     "latency_us_range": [comm.allreduce_latency_s * f * 1e6 for f in LATENCY_RANGE],
                     "rack": spec.name, "rack_gpus": gpus, "replicas": gpus // world,
                     "tokens_per_s_per_sequence": round(1e3 / step, 2),
                     "tokens_per_s_per_sequence_range": [round(1e3 / hi, 2), round(1e3 / lo, 2)],
                     "tokens_per_s_rack": round(batch * (gpus // world) * 1e3 / step, 2),
                     "bound_ms": round(bound_ms, 6), "bound_tokens_per_s_per_sequence": round(1e3 / bound_ms, 2),
                     "step_bytes": step_bytes,
                     "parts": {"local step": "model: the rank program on the calibrated H200 constants",
                               "wire": f"model: assumed {comm.allreduce_latency_s * 1e6:g} us per collective "
                                       f"(range x{LATENCY_RANGE[0]:g}..x{LATENCY_RANGE[1]:g}) + pushed bytes over "
                                       f"one direction of {spec.name} NVLink",
                               "bound": f"the step's bytes at {spec.name}'s datasheet HBM bandwidth plus its "
                                        "wire bytes over the link, no latency",
                               "rack": f"{gpus // world} replicas of {world} ranks on {gpus} GPUs; the rank's HBM "
                                       "time at H200 speed (a GB300 streams faster: an upper bound on the step)"}}}


def measured_extras(program: Any, timeline: Any, batch: int, step_ms: float, step_range_ms: tuple[float, float],
                    step_bytes: float, device: str, comm: CommModel | None = None) -> dict[str, Any]:
    """:func:`rank_extras` from a measured run of the rank's program alone on one GPU (its peers credited,
    ``kimik3.megakernel.gpu_ranks``): each instruction's measured busy time (``end - start`` of the device's
    timing buffer, ``timeline`` as ``kimik3.megakernel.timeline.from_timings`` gives it) replayed by the program's
    dependencies with the wire's delays on the peers' signals; ``step_ms`` / ``step_range_ms``: the measured step
    (median; min, max). The replay without the wire is matched to the measured step (the launch and whatever the
    replay misses are one constant), so only the wire is modelled."""
    from kimik3.megakernel.timeline import simulate

    busy = (timeline["end_ns"] - timeline["start_ns"]).clip(lower=0).to_numpy(dtype=float)
    zero = np.zeros(len(busy))

    def makespan(delay: np.ndarray) -> float:
        return float(simulate(program, busy, zero, prefetch=False, peer_delay_ns=delay)["end_ns"].max())

    boundary = step_ms * 1e6 - makespan(np.zeros(len(program.counters)))
    out = rank_extras(program, makespan, batch, boundary, step_ms, step_range_ms, step_bytes, comm)
    out["rank"]["parts"]["local step"] = (f"measured: the rank program alone on {device} (median of the launches; "
                                          "its peers' counter words credited, their pushes into a sink)")
    out["rank"]["measured_step_ms"] = step_ms
    out["rank"]["measured_step_ms_range"] = list(step_range_ms)
    return out
