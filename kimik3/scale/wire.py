"""What a rank program puts on the wire, and how much of it its own weight stream hides (the program as built).

Read from the rank program itself (:func:`kimik3.megakernel.scheduler.build_program` with a ``Shard``): every
cross-rank counter is one collective per step; its bytes are the boxes its producers PUSH, to each of the other
``world − 1`` ranks (:func:`collective_table`). A collective costs ``latency + bytes out / link`` (the
:class:`~kimik3.scale.nvl72.CommModel` latencies, one direction of the datasheet NVLink); :func:`rank_step` runs
the program's cost-model timeline (:func:`kimik3.megakernel.timeline.simulate`) twice — its peers' signals landing
at once, then that much later — so what the schedule hides behind the weight stream and what it exposes come out
of the program's own dependencies. Modelled, not measured: the latencies are assumptions, the local durations the
scheduler's shape-based costs. See docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kimik3.megakernel.instructions import Kind, Mode, Program
from kimik3.megakernel.timeline import makespan_ns, simulate
from kimik3.perf.hardware import get_hardware
from kimik3.scale.nvl72 import CommModel, _link_bandwidth  # one direction of one GPU's NVLink, as the rack model

__all__ = ["collective_table", "weight_bytes", "rank_step"]


def collective_table(program: Program) -> pd.DataFrame:
    """One row per collective of a rank program (a cross-rank counter): its name, producer and consumer opcodes,
    producer tiles, bytes pushed to each peer per step and bytes leaving the rank per step."""
    p = program
    prods: dict[int, list] = {c: [] for c, ctr in enumerate(p.counters) if ctr.sources}
    cons: dict[int, set[str]] = {c: set() for c in prods}
    for x in p.instructions:  # one pass: the producers and consumers of every cross-rank counter
        if x.signal in prods:
            prods[x.signal].append(x)
        for w, _ in x.waits:
            if w in cons:
                cons[w].add(x.op.name)
    rows = []
    for c, ctr in enumerate(p.counters):
        if c not in prods:
            continue
        pushed = sum(o.numel * p.buffers[o.buf].element_size for x in prods[c] for o in x.operands
                     if o.mode & Mode.PUSH)
        consumers = sorted(cons[c])
        first = prods[c][0].op.name if prods[c] else ""
        rows.append({"collective": ctr.name, "producer": first, "tiles": len(prods[c]),
                     "consumers": ", ".join(consumers), "bytes_per_peer": pushed,
                     "bytes_out": pushed * (p.world - 1), "counter": c})
    return pd.DataFrame(rows, columns=["collective", "producer", "tiles", "consumers", "bytes_per_peer", "bytes_out",
                                       "counter"])


def weight_bytes(program: Program) -> float:
    """Weight bytes the rank may read per step: every distinct WEIGHT box its instructions declare (the routed
    experts' boxes cover all of the rank's experts: which are read is data; the cost model's expected share is
    ``program.costs["weight_bytes"]``)."""
    seen = set()
    for x in program.instructions:
        for o in x.operands:
            if program.buffers[o.buf].kind == Kind.WEIGHT:
                seen.add((o.buf, o.box))
    return float(sum(program.buffers[b].element_size * (box[1] - box[0]) * (box[3] - box[2]) * (box[5] - box[4])
                     for b, box in seen))


def rank_step(program: Program, hardware: str = "gb300", comm: CommModel | None = None,
              link_bandwidth: float | None = None) -> dict[str, Any]:
    """The rank's step under the cost model, its peers' signals landing at once and then after each collective's
    wire time: the local makespan, the makespan with the wire, the exposed and the serial wire time, the share
    hidden, and the bytes on the wire and from HBM per step (``comm``: default :class:`CommModel`)."""
    if program.costs is None:
        raise ValueError("rank_step: the program carries no costs (build it with build_program)")
    comm = comm or CommModel()
    link = _link_bandwidth(get_hardware(hardware), comm, link_bandwidth)
    table = collective_table(program)
    delay = np.zeros(len(program.counters))
    wire_ns = (comm.allreduce_latency_s + table["bytes_out"].to_numpy(dtype=float) / link) * 1e9
    delay[table["counter"].to_numpy(dtype=int)] = wire_ns
    local = makespan_ns(simulate(program))
    with_wire = makespan_ns(simulate(program, peer_delay_ns=delay))
    serial = float(wire_ns.sum())
    exposed = with_wire - local
    return {"world": program.world, "rank": program.rank, "batch": program.batch, "collectives": len(table),
            "wire_bytes_out": float(table["bytes_out"].sum()),
            "weight_bytes_expected": float(program.costs["weight_bytes"].sum()),
            "local_ms": local / 1e6, "step_ms": with_wire / 1e6, "exposed_wire_ms": exposed / 1e6,
            "serial_wire_ms": serial / 1e6, "hidden_share": 1.0 - exposed / serial if serial else float("nan"),
            "link_GBps": link / 1e9, "latency_us": comm.allreduce_latency_s * 1e6,
            "cost_model": str(program.costs.attrs.get("cost_model", ""))}
