# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · The megakernel: one launch per decode step
#
# Notebook 04 composed a decode step from hand-written kernels: still one launch per operation, and between two
# launches the GPU drains and ramps up again. This notebook takes the last step of the ladder: **one persistent kernel
# per decode step**, one CTA per SM, each walking its own queue of *instructions* — an int32 program built once on the
# host (`kimik3.megakernel`) and interpreted on the device (`kernels/megakernel/vm.py`). Dependencies are counters in
# global memory, not kernel boundaries, and an SM that waits for its inputs already streams its next weights.
#
# What runs where:
#
# | piece | where | status |
# | --- | --- | --- |
# | instruction set, scheduler, hazard checker, cost-model timeline | CPU, here | tested |
# | CPU interpreter (stage `megakernel-interp`) under random interleavings | CPU, here | matches naive (below) |
# | native CPU executor (stage `megakernel-cpu`), a thread per core | CPU, here | matches naive, measured (below) |
# | CuTe DSL megakernel (stage `megakernel`) | compiled here for `sm_90a` / `sm_100a` | **not run on a GPU yet** |
#
# Run headless: `papermill notebooks/05_megakernel.ipynb out.ipynb -p preset micro -p compile_kernel False`.

# %% tags=["parameters"]
preset = "tiny"
batch_size = 4
steps = 4
interleavings = 5
policy = "critical_path"
out_dir = "runs/05_megakernel"
compile_kernel = True
curve_batches = [1, 2, 4, 8, 16, 32, 64]  # the model's batch curve (k3-shard)
cpu_batches = [1, 8, 32, 64]  # megakernel-cpu measured on this machine, at these batches
solutions = False  # workshop: True checks the reference solutions instead of your answers (make run does)


# %%
# a bad parameter (papermill -p, or an edit above) stops here with its name, not deep inside a later cell
from kimik3.notebook.runner import check_params

check_params(dict(preset=preset, batch_size=batch_size, steps=steps, interleavings=interleavings,
                  curve_batches=curve_batches, cpu_batches=cpu_batches), "05_megakernel")

# %%
import dataclasses
import re

import pandas as pd
import plotly.graph_objects as go
import torch
from IPython.display import display

import kimik3
import kimik3.megakernel.interp_ranks  # noqa: F401  (registers stage "megakernel-interp")
from kimik3.megakernel import build_program, check_program, instruction_set_table, simulate, summary
from kimik3.megakernel.hazards import format_violations
from kimik3.megakernel.instructions import Kind, Mode, Op, Program, encoding_table
from kimik3.megakernel.timeline import gantt, makespan_ns
from kimik3.notebook.start import start_notebook
from kimik3.perf.cost import decode_cost
from kimik3.perf.hardware import get_hardware, hardware_for_device
from kimik3.perf.recorded import load_recorded
from kimik3.perf.roofline import points_from_cost, roofline_figure, save_html
from kimik3.validation.metric import TOL, rel_error

# plotly renders with no network (plotly.js embedded once, no CDN); figures go to `out`
out = start_notebook(out_dir, pandas_display={"width": 200, "max_columns": 20, "max_colwidth": 120}).out
torch.manual_seed(0)
cfg = kimik3.get_preset(preset)
H200 = get_hardware("h200")
SHARD = "k3-shard"
print(f"preset {preset}, batch {batch_size}, {steps} steps x {interleavings} interleavings, policy {policy}")

# %% [markdown]
# ## Why one launch per step
#
# A decode step at batch 1 is bandwidth-bound: its floor is *bytes it must read ÷ HBM bandwidth*. The step is also
# long chain of dependent operations — per layer: mix, norm + projections, the mixer, output projection, mix, router,
# experts, output — and each of them, as its own kernel, pays a launch (a few µs), a tail where the last CTAs finish
# while most SMs idle, and a ramp-up. At the scale of a small model those fixed costs are most of the step.
#
# The program below is the `k3-shard` step (true K3 widths, 4 layers) for 132 SMs. Each *group* (all tiles of one
# operation: the instructions that signal the same counter) is roughly what one kernel launch would be.

# %%
shard = build_program(SHARD, 1, 132, policy)  # from the config alone: no weights
bound_us = decode_cost(SHARD, 1, 4096).total_bytes / H200.hbm_bandwidth * 1e6
groups = len({(x.layer, x.op, x.signal) for x in shard.instructions})
waits = sum(len(x.waits) for x in shard.instructions)
display(pd.DataFrame({
    "instructions": [len(shard.instructions)], "groups (~ kernel launches)": [groups],
    "counters": [len(shard.counters)], "waits": [waits],
    "bandwidth bound on H200 [µs]": [round(bound_us, 1)],
    "launch overhead at 3 µs/launch [µs]": [3 * groups]}).T.rename(columns={0: f"{SHARD}, B=1"}))

# %% [markdown]
# Even before tails and ramps, a few µs per launch is a sizeable fraction of the bound at this size. In the megakernel
# a dependency is one release-add (`red.release.gpu`) and one acquire-spin (`ld.acquire.gpu` + `nanosleep`), and only
# the SMs that actually need a result wait for it.
#
# ## The instruction set
#
# Sixteen coarse opcodes; operands are boxes of named buffers (`*`: a static weight, the only thing that may be read
# before the waits). Every instruction is one fixed-width row of 128 int32 words.

# %%
display(instruction_set_table())
display(encoding_table())

# %% [markdown]
# What each opcode's device code does, and its known performance limits (each opcode's own docstring in
# `kernels/megakernel/`):

# %%
from kimik3.notebook.kernel_report import opcode_notes

display(opcode_notes())
try:
    from kimik3.kernels.megakernel.device_fns import NT
    from kimik3.kernels.megakernel.vm import STAGE_BUFFERS, STAGE_BYTES

    print(f"{NT} threads per CTA, one CTA per SM; weight stage {STAGE_BUFFERS} x {STAGE_BYTES // 1024} KiB of "
          "shared memory (the next instruction's rows land in one buffer while this one reads the other)")
except ImportError as e:  # the CuTe DSL is optional for the CPU half of this notebook
    print(f"nvidia-cutlass-dsl not installed ({e}): device notes skipped")

# %% [markdown]
# ## A schedule, drawn
#
# The critical-path policy assigns every instruction to an SM queue (list scheduling on the scheduler's simple cost
# model: every SM at its full share of HBM bandwidth), then keeps only the waits nothing else implies. The Gantt chart
# is drawn from the **calibrated model** (`kimik3.perfmodel`, the current design, below): an SM reaches an
# instruction whose first 48 KiB of weights were already copied into shared memory while the previous instruction ran
# (the host decided which rows, in the instruction words), waits for its inputs, runs it, signals — with the bandwidth
# the device code's loads in flight allow. A model, not a measurement. Grey bars are waits.

# %%
assert check_program(shard) == [], "the scheduler's program must be provably race- and deadlock-free"
from kimik3.perfmodel import CURRENT_DESIGN, megakernel_model

sim = simulate(shard)  # the scheduler's simple cost model
times_b1, cal_b1 = megakernel_model(SHARD, 1, CURRENT_DESIGN, program=shard)
fig = gantt(cal_b1, title=f"{SHARD}, batch 1, 132 SMs ({policy}): calibrated model {CURRENT_DESIGN} (a model, not a "
                          "measurement)")
save_html(fig, out / "schedule_k3_shard_b1.html")
rows = []
for pol in ("round_robin", "critical_path"):
    p = shard if pol == policy else build_program(SHARD, 1, 132, pol)
    rows.append({"policy": pol, "simple model µs (prefetch)": makespan_ns(simulate(p)) / 1e3,
                 "simple model µs (no prefetch)": makespan_ns(simulate(p, prefetch=False)) / 1e3,
                 f"calibrated model {CURRENT_DESIGN} µs": makespan_ns(megakernel_model(SHARD, 1, CURRENT_DESIGN,
                                                                                        program=p)[1]) / 1e3})
display(pd.DataFrame(rows).set_index("policy").round(1))
print(f"bandwidth bound {bound_us:.1f} µs")
fig

# %% [markdown]
# ## The program on the CPU interpreter, under random interleavings
#
# `megakernel-interp` decodes the int32 program with PyTorch: every SM gets a cursor into its queue, and at each tick a
# random SM whose head instruction's waits are met runs it — only the declared waits constrain the order. Scratch
# buffers are poisoned with NaN before every step, and every instruction only sees the boxes it declares, so a missing
# wait or declaration shows up as a wrong answer. Teacher-forced against the naive stage (fp32), each interleaving
# must reproduce naive within the fp32 stage tolerance and every interleaving must agree bit for bit.

# %%
model = kimik3.from_preset(preset, seed=0)
g = torch.Generator().manual_seed(1)
lengths = [6 - (b % 3) for b in range(batch_size)]
ids = torch.randint(0, cfg.vocab_size, (batch_size, max(lengths)), generator=g)
max_len = max(lengths) + steps + 2
ref = kimik3.Decoder(model, "naive", batch_size=batch_size, max_seq_len=max_len)
logits = ref.prefill(ids, lengths)
fed, want = [], []
for _ in range(steps):
    fed.append(logits.argmax(-1))
    logits = ref.step(fed[-1])
    want.append(logits)
mk = kimik3.Decoder(model, "megakernel-interp", batch_size=batch_size, max_seq_len=max_len, policy=policy, num_sms=8)
mk.prefill(ids, lengths)
start = mk.stage.snapshot()
program = mk.stage.program
rows, first = [], None
for seed in range(interleavings):
    mk.stage.restore(start, seed=seed)
    mk.lengths = torch.tensor(lengths)
    got = [mk.step(t) for t in fed]
    errs = [rel_error(a, b) for a, b in zip(got, want)]
    first = got if first is None else first
    rows.append({"seed": seed, "max rel. error vs naive": max(errs),
                 "bitwise equal to seed 0": all(torch.equal(a, b) for a, b in zip(got, first)),
                 "same greedy tokens": all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, want))})
table = pd.DataFrame(rows).set_index("seed")
display(table)
print(f"{program}; tolerance {TOL['fp32_stage']:.0e}")
assert (table["max rel. error vs naive"] <= TOL["fp32_stage"]).all() and table["bitwise equal to seed 0"].all()


# %% [markdown]
# ## The hazard checker, catching planted bugs
#
# `check_program` proves a program race- and deadlock-free from its declarations alone (no execution): it recomputes
# every conflict between operand boxes, simulates the counters to find deadlocks, and requires a wait or program order
# between every conflicting pair. Two classic megakernel bugs, planted in the program above:
#
# 1. **a removed wait** — a consumer no longer waits for its producer's counter;
# 2. **an activation prefetch** — an activation read marked as prefetchable, i.e. issued before the waits (only static
#    weights may be read early: nobody writes them during a step).

# %%
def with_instruction(p: Program, i: int, **changes) -> Program:
    ins = list(p.instructions)
    ins[i] = dataclasses.replace(ins[i], **changes)
    return Program(p.buffers, ins, [list(q) for q in p.queues], list(p.counters), p.batch, p.max_seq_len,
                   p.num_layers, p.policy)


i = next(k for k, x in enumerate(program.instructions) if x.waits and x.op == Op.NORM_PROJ and x.layer > 0)
no_wait = with_instruction(program, i, waits=program.instructions[i].waits[1:])
print("1. removed wait:", program.instructions[i].label(), "no longer waits on",
      program.counters[program.instructions[i].waits[0][0]].name)
print(format_violations(check_program(no_wait), limit=3))
j = next(k for k, x in enumerate(program.instructions)
         if x.op == Op.O_PROJ_RESIDUAL and any(program.buffers[o.buf].kind == Kind.ACT and o.reads for o in x.operands))
ops = tuple(dataclasses.replace(o, mode=o.mode | Mode.PREFETCH) if program.buffers[o.buf].kind == Kind.ACT and o.reads
            and not o.writes else o for o in program.instructions[j].operands)
early = with_instruction(program, j, operands=ops)
print("\n2. activation prefetch:", program.instructions[j].label())
print(format_violations(check_program(early), limit=3))

# %% [markdown]
# ### Exercise: find a planted race
#
# The check plants a race in a fresh program (one instruction loses one of its waits) and calls your function.
# Use `check_program` to return the racing pair (producer, consumer): the earlier writer or reader, and the
# instruction that is no longer ordered after it.

# %%
from kimik3.notebook import workshop


def find_race(program):
    """(producer, consumer) instruction indices of a race in ``program``."""
    raise NotImplementedError("your code here")


# %%
workshop.check("find_planted_race", find_race, solutions=solutions)
# workshop.reveal("find_planted_race")  # uncomment to see a solution

# %% [markdown]
# ## The timeline: where the time goes
#
# Per opcode, summed over SMs: busy time (weights that were not hidden behind a wait, plus the rest), time spent
# waiting on counters, and the SMs' idle time after their queue ran dry. The same table comes out of a measured step:
# the kernel records `(start ns, end ns, %smid)` per instruction from `%globaltimer` into a `[N, 3]` int64 buffer, and
# `kimik3.megakernel.timeline.from_timings` turns it into this format (`MegakernelStage.timeline()`).

# %%
summ = summary(cal_b1, 132)
print(f"{SHARD}, B=1, 132 SMs: calibrated model {CURRENT_DESIGN} makespan {summ.attrs['makespan_us']:.1f} µs "
      f"(a model, not a measurement; the scheduler's simple cost model says {makespan_ns(sim) / 1e3:.1f} µs)")
display(summ.round(2))
fig = go.Figure()
s = summ.drop(index="(idle)")
fig.add_bar(x=s.index, y=s["busy_us"], name="busy")
fig.add_bar(x=s.index, y=s["waiting_us"], name="waiting")
fig.update_layout(barmode="stack", template="plotly_white", height=420, yaxis_title="µs summed over SMs",
                  title=f"{SHARD}, B=1: SM time per instruction type (calibrated model {CURRENT_DESIGN})")
save_html(fig, out / "time_per_opcode.html")
local = summary(simulate(program), program.num_sms)
print(f"{preset}, B={batch_size}, {program.num_sms} SMs (the interpreter's program): "
      f"simulated makespan {local.attrs['makespan_us']:.1f} µs")
display(local.round(2).head(8))
fig

# %% [markdown]
# ## Measured on this CPU: the same program on native worker threads
#
# Stage `megakernel-cpu` runs the program with one C++ worker thread per core (pinned where the OS allows), each
# walking its own queue and spinning on `std::atomic` counters (acquire loads, release adds, the GPU's monotonic
# `step·total + t` targets) — one call per decode step. The scheduler builds the program for as many queues as there
# are workers. Every worker stamps each instruction's start and end into the GPU kernel's `[N, 3]` timing buffer, so
# the same `from_timings` / `summary` / `gantt` give a *measured* timeline: busy (computing or streaming weights),
# waiting (spinning on a counter) and idle (queue ran dry) per opcode. Beside it, the cost model's simulation of the
# very same program (H200 per-SM bandwidth: the shapes of the two charts compare, not their time axes). On a shared
# machine the measured bars include whatever the OS did to the workers.

# %%
from kimik3.megakernel.timeline import from_timings

try:
    native = kimik3.Decoder(model, "megakernel-cpu", batch_size=batch_size, max_seq_len=max_len, policy=policy)
except ValueError as e:  # no C++ compiler on this machine: the stage says so
    native = None
    print(f"megakernel-cpu not run here: {e}")
if native is not None:
    native.prefill(ids, lengths)
    got = [native.step(t) for t in fed]
    errs = [rel_error(a, b) for a, b in zip(got, want)]
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, want))
    nprog = native.stage.program
    print(f"{nprog}: max rel. error vs naive {max(errs):.1e} (tolerance {TOL['fp32_stage']:.0e}), "
          f"greedy tokens {'identical' if same else 'DIFFER'}")
    assert max(errs) <= TOL["fp32_stage"] and same
    measured = from_timings(nprog, native.stage.timings)  # the last step
    msum = summary(measured, nprog.num_sms)
    print(f"measured makespan of the last step: {msum.attrs['makespan_us']:.0f} µs on {nprog.num_sms} workers")
    display(msum.round(1))
    save_html(gantt(measured, title=f"{preset}, B={batch_size}: measured per-worker timeline (this CPU)",
                    unit="CPU worker"),
              out / "cpu_measured_gantt.html")
    fig = gantt(measured, title=f"{preset}, B={batch_size}, {nprog.num_sms} workers: measured on this CPU",
                unit="CPU worker")
    display(fig)
    fig = gantt(simulate(nprog), title=f"{preset}, B={batch_size}, same program: cost-model simulation (H200 SMs)")
    fig

# %% [markdown]
# ## The calibrated model: predicted vs roofline (a model, not a measurement)
#
# The timeline above uses the scheduler's simple cost model: every SM streams at its full share of HBM bandwidth
# and all of an instruction's weights may arrive while it waits. `kimik3.perfmodel` charges what the device code
# actually does instead — bytes in flight per SM (Little's law against the HBM latency), the shared-memory stage
# actually allocated and when it is filled, the global round trips counted per instruction, serial loops at the
# latency each trip waits on — against the *achievable* HBM read bandwidth. Its constants
# (`data/perf/constants.json`) each carry a source and are the same for every design. Four designs are committed:
# `v1`, the kernels before the redesign (one 64 KiB stage filled for the *current* instruction after its fetch, every
# thread stalled on `cp.async.wait_group 0`, 24 KiB of weight loads in flight per SM, a scalar-load MLA absorption),
# `v2`, the redesigned kernels (`data/perf/designs/v2.json`; scores in `data/perf/scores-v2.json`), `v3`: v2 with the
# GEMV opcodes' tensor-core tiles over groups of batch passes from batch 8 (`data/perf/designs/v3.json`,
# `scores-v3.json`), and `v4`, today's kernels: v3 with the dense routed experts on tensor cores from batch 8 over
# groups of 16 of each expert's tokens, and EXPERT_DOWN's combine in shared memory (`v4.json`, `scores-v4.json`; the
# same as v3 at batch 1). Each design is scored on the program
# it was built for (v1's MLA_PARTIAL took all 96 heads of a split; today's program cuts them into tiles when SMs are
# left over), and `v2` to `v4` also with the routed experts stored as MXFP4 (the K3 release's format: the program
# carries the codes and scales, its expert opcodes decode them; the roofline then moves MXFP4 bytes). Same
# command-line view: `python -m kimik3 predict --preset k3-shard --stage megakernel --batch 1 --json` (`--experts
# mxfp4`, `--design v1` for the record).
#
# Every score of today's design also comes with a range — the same step with the constants the model is least sure
# of (HBM latency under load, the share of the design's loads really in flight, the read efficiency, the
# signal-to-acquire latency, the L1 left beside the shared memory: each `range` in `data/perf/constants.json` says
# why its bounds) all at their optimistic ends, then all at their pessimistic ends, against the same roofline: the
# two range columns below and the bars on the ladder plot at the end; a device check's measured
# `data/measurements/constants-h200.json` (`predict --measured`) replaces the recalled values and their ranges.

# %%
import json

from kimik3.perfmodel import PERF_DIR, load_constants, predict
from kimik3.perfmodel import roofline_ms as model_roofline_ms

PC = load_constants()
# the committed scores of both designs (tests/test_perfmodel.py recomputes them and fails when they are stale)
scores = pd.concat([pd.DataFrame([{"design": d, "stage": r["stage"], "batch": r["batch"],
                                   "experts": r.get("experts", "bf16"), "model ms": r["predicted_ms"],
                                   "roofline ms": r["roofline_ms"], "% of roofline": 100 * r["fraction_of_roofline"]}
                                  for r in json.loads((PERF_DIR / f"scores-{d}.json").read_text())["results"]
                                  if r["preset"] == SHARD]) for d in ("v1", CURRENT_DESIGN)])
scores = scores.set_index(["stage", "batch", "experts", "design"]).sort_index()
scores_now = scores.xs((CURRENT_DESIGN, "bf16"), level=("design", "experts"))
rec = load_recorded("data/measurements")
meas = rec[(rec["block"] == "step") & (rec["preset"] == SHARD)
           & (rec["device"].astype(str).map(hardware_for_device) == "h200")] if not rec.empty else rec


def measured_ms(st: str, b: int) -> float:
    m = meas[(meas["stage"] == st) & (meas["batch_size"] == b)] if len(meas) else meas
    return float(m["seconds"].min() * 1e3) if len(m) else float("nan")


scores["measured ms"] = [measured_ms(st, b) if d == CURRENT_DESIGN and e == "bf16" else float("nan")
                         for st, b, e, d in scores.index]
# the range of today's design (bf16 experts), computed on the fly: the committed files hold the point scores only
ranged = {(st, b): predict(SHARD, st, b, CURRENT_DESIGN, constants=PC) for st in ("megakernel", "fused")
          for b in (1, 8, 64)}
for i, col in enumerate(("% of roofline, pessimistic", "% of roofline, optimistic")):
    scores[col] = [100 * ranged[(st, b)]["fraction_of_roofline_range"][i]
                   if d == CURRENT_DESIGN and e == "bf16" and (st, b) in ranged else float("nan")
                   for st, b, e, d in scores.index]
print(f"roofline = step bytes / achievable HBM read bandwidth ({PC.achievable_Bps / 1e12:.2f} TB/s); "
      f"measured ({CURRENT_DESIGN}, today's kernels): NaN until a GPU run records it")
display(scores.round(3))

# %% [markdown]
# Per opcode, the mean of each part of an instruction in the calibrated model (k3-shard, batch 1; the Gantt chart
# above is this timeline): fetch round trips, the 64 KiB stage, the body and its serial loops, and what limits the
# body: the HBM stream (bytes in flight), re-reads from L1/L2, CUDA-core FMA issue, or serial loops.

# %%
display(times_b1.groupby("op").agg(count=("op", "size"), fetch_us=("fetch_ns", "mean"), stage_us=("stage_ns", "mean"),
                                   body_us=("body_ns", "mean"), serial_us=("serial_ns", "mean"),
                                   limited_by=("limited_by", lambda v: v.mode().iloc[0]))
        .assign(fetch_us=lambda d: d.fetch_us / 1e3, stage_us=lambda d: d.stage_us / 1e3,
                body_us=lambda d: d.body_us / 1e3, serial_us=lambda d: d.serial_us / 1e3).round(2))

# %% [markdown]
# ### v1 → v2, opcode by opcode
#
# What the redesign changed, each item a change in the device code that the design file records with where it was
# read: the next instruction's first 48 KiB of weights are copied into a second shared-memory stage *while the current
# instruction waits and runs* (which rows is decided on the host and stored in the instruction words `W_NEXT_*`; the
# hazard checker allows it only for static weights); the instruction row of the next queue entry is prefetched too,
# and all waits are checked in one round trip; the GEMV opcodes keep 8 × 16-byte loads per lane in flight (48 KiB per
# SM) and walk up to 8 batch rows per pass, so at batch 8 every weight row is read once — on tensor cores at batch
# passes of 8 (16-row `mma.sync` tiles, next section); the MLA absorption reads W_UK with 16-byte loads, and the
# partial attention spreads heads over the warps. The same program, the same constants; per opcode the SM time summed
# over instructions under each design:

# %%
from kimik3.perfmodel import compare_designs, megakernel_model, roofline_ms


def _pess_fraction(design: dict) -> float:
    """Fraction of the roofline of a design given as data (k3-shard, batch 8)."""
    _, tl = megakernel_model(SHARD, 8, design, PC)
    return roofline_ms(SHARD, 8, constants=PC) / ((tl["end_ns"].max() + PC.kernel_boundary_ns) / 1e6)


for b in (1, 8):
    cmp = compare_designs(SHARD, b, ("v1", CURRENT_DESIGN), constants=PC)
    print(", ".join(f"{d}: {v['predicted_ms']:.3f} ms = {100 * v['fraction_of_roofline']:.1f}% of the roofline"
                    for d, v in cmp.attrs["summary"].items()) + f"  (k3-shard, batch {b}; a model)")
    display(cmp.round(1))
cmp1 = compare_designs(SHARD, 1, ("v1", CURRENT_DESIGN), constants=PC)
fig = go.Figure([go.Bar(x=cmp1.index, y=cmp1[(d, "total_us")], name=d) for d in ("v1", CURRENT_DESIGN)])
fig.update_layout(barmode="group", template="plotly_white", height=420, yaxis_title="µs summed over SMs",
                  title=f"{SHARD}, B=1: SM time per opcode, v1 vs {CURRENT_DESIGN} (calibrated model, not a "
                        "measurement)")
save_html(fig, out / "designs_by_opcode.html")
# how much rests on one assumption: at batch 8 one pass of x (8 rows x 14 KiB) only just fits in the L1 left next to
# the 142 KiB of shared memory; if the weight stream evicted it, every x re-read would come from L2
import copy

from kimik3.perfmodel import load_design, predict

pessimist = copy.deepcopy(load_design(CURRENT_DESIGN))
for spec in pessimist["megakernel"]["opcodes"].values():
    for r in spec.get("rereads", []):
        if "gbt * row_bytes" in str(r["footprint"]):
            r["footprint"] = "1e30"  # never fits: served by L2
point8 = predict(SHARD, "megakernel", 8, CURRENT_DESIGN, constants=PC, ranges=False)["fraction_of_roofline"]
print("batch 8 with every GEMV x re-read from L2:", f"{100 * point8:.1f}% ->",
      f"{100 * _pess_fraction(pessimist):.1f}% of the roofline")
fig

# %% [markdown]
# ### MXFP4 experts, and the tensor cores
#
# Stored as MXFP4 the routed experts cost 4.25 bits per weight instead of 16, so the step's bytes (and the roofline)
# shrink — and each byte now carries almost four weights to expand. On the CUDA cores (the first MXFP4 opcodes) that
# was about 2.8 instructions per weight and pass plus 2.7 per weight and token, counted in their PTX: issue-bound at
# batch 1 already. Today's expert opcodes decode each weight once, straight into bf16 fragments, and hand 16 rows × 8
# tokens × 16 columns to one `mma.sync` (`kernels/megakernel/mma.py`); the tokens of an expert are the instruction's 8
# columns, so the decode is paid once per weight whatever the batch. At batch 8 the other GEMVs (projections, the
# shared experts, the LM head) had the same problem with bf16 weights — 8 FMAs and converts per weight, and every x
# row re-read per weight row — so they take the tensor cores too at batch passes of 8: one x chunk per 16 weight
# rows, a handful of instructions per k block. The table gives the model's fractions of the roofline; the second
# (mean µs per instruction) shows which part sets each expert opcode's pace.

# %%
rows, parts = [], []
for b in (1, 8):
    for e in ("bf16", "mxfp4"):
        r = predict(SHARD, "megakernel", b, CURRENT_DESIGN, constants=PC, experts=e, ranges=False)
        rows.append({"batch": b, "experts": e, "model ms": r["predicted_ms"], "roofline ms": r["roofline_ms"],
                     "% of roofline": 100 * r["fraction_of_roofline"]})
        t, _ = megakernel_model(SHARD, b, CURRENT_DESIGN, PC, experts=e)
        t = t[t["op"].str.startswith("EXPERT")]
        g = t.groupby("op").agg(hbm_us=("hbm_ns", "mean"), fma_issue_us=("fma_ns", "mean"),
                                rereads_us=("reread_ns", "mean"), serial_us=("serial_ns", "mean"),
                                limited_by=("limited_by", lambda v: v.mode().iloc[0]))
        for c in ("hbm_us", "fma_issue_us", "rereads_us", "serial_us"):
            g[c] = g[c] / 1e3
        parts.append(g.assign(batch=b, experts=e).reset_index().set_index(["batch", "op", "experts"]))
display(pd.DataFrame(rows).set_index(["batch", "experts"]).round(3))
display(pd.concat(parts).sort_index().round(1))

# %% [markdown]
# ### Batch 1 to 64: where the design stops scaling
#
# Decode is served at many batch sizes, not at batch 1 alone. The model, its constants unchanged, scores each committed
# design against the batch (`k3-shard`, context 4096, bf16 experts): the fraction of the roofline (the step's bytes over
# the achievable HBM read bandwidth) and the tokens per second it implies, beside the roofline's own tokens per second.
# The bytes barely grow with the batch, so a design that reads every weight once per step keeps its step time, and its
# throughput grows with the batch. v2's GEMV opcodes read each weight row once per *pass of 8 batch rows*
# (`mk_addr.gemv_batch_tile`), so past batch 8 its step grows linearly with the batch and the throughput stops. v3
# reads a GEMV weight tile once per *group* of passes (`mk_addr.gemv_groups`: 32 batch rows for one weight, 16 for
# MLP_GATE_UP's and FFN_OUT's two, the accumulators' register budget), but its dense routed experts still read each
# row once per 2 of the expert's tokens on CUDA cores. v4 (today's) puts them on tensor cores: a 16-row tile of an
# expert's weight streams once per 16 of that expert's tokens (`mk_addr.expert_group_passes`), so at batch 64 (about 18
# tokens per expert on `k3-shard`) the experts' share of the step falls from about 31 ms to about 4. What is left
# between v4 and the roofline past batch 8 is the next design: LM_HEAD still reads the vocabulary once per pass of 8
# rows on CUDA cores (on tensor cores it fits the k3-shard megakernel's registers but the tiny and micro ones spill a
# few registers), and MLA_PARTIAL's FMA issue grows with the batch. On the right, the same program measured on this CPU
# (`megakernel-cpu`, one worker thread per core), against its roofline: the larger of the step's bytes over the measured
# read bandwidth and its FLOPs over the measured fp32 matmul rate (past a few batch rows a CPU step is compute-bound,
# where the read bandwidth alone understates it; both fractions are drawn).

# %%
curve_designs = [d for d in ("v1", "v2", "v3", "v4") if (PERF_DIR / "designs" / f"{d}.json").exists()]
crow = []
for st, designs in (("megakernel", curve_designs), ("fused", [CURRENT_DESIGN])):
    for d in designs:
        for b in curve_batches:
            r = predict(SHARD, st, b, d, constants=PC, ranges=False)
            crow.append({"stage": st, "design": d, "batch": b, "model ms": r["predicted_ms"],
                         "roofline ms": r["roofline_ms"], "fraction of roofline": r["fraction_of_roofline"],
                         "tokens/s": 1e3 * b / r["predicted_ms"], "roofline tokens/s": 1e3 * b / r["roofline_ms"]})
curve = pd.DataFrame(crow)
display(curve.set_index(["stage", "design", "batch"]).round(3))

from kimik3.bench import run_bench

native_curve = None
try:
    native_curve = run_bench(preset, stages=["megakernel-cpu"], batches=cpu_batches, context=64, steps=steps,
                             repeats=3, warmup=1, include_hf=False, progress=False, reference={})
except (ValueError, RuntimeError) as e:  # no C++ compiler here, or the batch does not fit: the stage says so
    print(f"megakernel-cpu not measured here: {e}")
if native_curve is not None:
    assert (native_curve["rel_err_vs_naive"] <= TOL["fp32_stage"]).all(), "megakernel-cpu differs from naive"
    shown = native_curve[["batch", "ms_per_token", "ms_min", "ms_max", "tokens_per_s", "gb_per_s", "pct_read_bw",
                          "roofline_ms", "bound", "pct_roofline"]]
    display(shown.assign(rel_err_vs_naive=native_curve["rel_err_vs_naive"].map("{:.1e}".format))
            .set_index("batch").round(3))

from plotly.subplots import make_subplots

fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14,
                    subplot_titles=(f"model: {SHARD}, H200", f"measured: {preset}, this CPU"))
dash = {"v1": "dot", "v2": "solid", "v3": "dash", "v4": "longdash"}
for (st, d), g in curve.groupby(["stage", "design"], sort=False):
    name = f"{st} {d}"
    fig.add_trace(go.Scatter(x=g["batch"], y=g["fraction of roofline"], mode="lines+markers", name=name,
                             line=dict(dash=dash.get(d, "solid")), customdata=g[["model ms", "tokens/s"]],
                             hovertemplate="B=%{x}: %{y:.3f} of the roofline<br>%{customdata[0]:.2f} ms, "
                                           "%{customdata[1]:,.0f} tokens/s<extra>" + name + "</extra>"),
                  row=1, col=1)
if native_curve is not None:
    for col, name, sym in (("pct_roofline", "megakernel-cpu: of its roofline", "diamond"),
                           ("pct_read_bw", "megakernel-cpu: of the read bandwidth", "circle-open")):
        fig.add_trace(go.Scatter(x=native_curve["batch"], y=native_curve[col] / 100, mode="lines+markers",
                                 name=name, marker=dict(symbol=sym, size=9),
                                 customdata=native_curve[["ms_per_token", "tokens_per_s", "bound"]],
                                 hovertemplate="B=%{x}: %{y:.2f}<br>%{customdata[0]:.2f} ms, %{customdata[1]:,.0f} "
                                               "tokens/s, %{customdata[2]}-bound<extra>measured</extra>"),
                      row=1, col=2)
fig.update_xaxes(type="log", title="batch (sequences)", tickvals=sorted(set(curve_batches) | set(cpu_batches)))
fig.update_yaxes(title="fraction of the roofline (model)", range=[0, 1.05], row=1, col=1)
fig.update_yaxes(title="fraction of the measured ceiling", range=[0, 1.05], row=1, col=2)
fig.update_layout(template="plotly_white", height=420, legend=dict(font=dict(size=10)),
                  title="Step time against batch: a fraction of the roofline that falls is a weight read again")
save_html(fig, out / "batch_curve.html")
fig


# %% [markdown]
# ### Against the review's estimate, opcode by opcode
#
# A review of the device code estimated 52–64 % of the roofline at batch 1 and about 30 % at batch 8. The model's
# batch-1 figure is close to that range; at batch 8 it is more than 15 points above the review's (see the summary
# lines below the tables). The review gives no per-opcode breakdown, so its arithmetic cannot be matched term by
# term; what follows is the model's account, opcode by opcode. The tables give, per opcode, the SM time summed over
# instructions (start stamp to end stamp, what the kernel's timing buffer records), the time the same bytes would take
# streamed at the SM's share of the achievable bandwidth, the excess, and the modelled limit.
#
# * **MLA_Q** (W_UK absorption: one scalar 2-byte load per iteration, 2 × 128 dependent iterations per head and batch
#   tile) and **MLA_PARTIAL** (8 heads per warp one after another, one position per iteration) are serial-loop bound,
#   as the review says, and their per-instruction times are of the review's order (0.15–0.25 ms; ~0.6 ms at context
#   4096). But they run on 96 SMs side by side and only layer 3 is MLA, so they lengthen the critical path once, while
#   the other SMs keep streaming the FFN weights; the model charges them as SM time, not as step time.
# * The **GEMV opcodes** (NORM_PROJ, O_PROJ_RESIDUAL, FFN_OUT, LM_HEAD, MLP_GATE_UP) keep 24 KiB in flight per SM at
#   batch 1 and 12 KiB from batch 3 on (4 batch rows share a weight chunk, 2 loads per lane): with the 600 ns latency
#   of the constants that is ~41 GB/s and ~20 GB/s per SM against a share of ~33 GB/s, so at batch 1 they stream at
#   the share and at batch 8 at ~60 % of it. Their fixed cost (1 HBM + 3 + nops L2 round trips, the unhidden part of
#   the 64 KiB stage) is a few µs per instruction. At batch 8 the weight row is read twice (one pass per 4 batch rows),
#   the second time from L2, which is where O_PROJ_RESIDUAL and FFN_OUT's excess comes from.
# * **EXPERT_GATE_UP / EXPERT_DOWN** walk one token at a time and re-read their rows per token; the model puts those
#   re-reads in L2 (the 12 warps' rows do not fit in the L1 left next to 112 KiB of shared memory), plus a dependent
#   load of the use flag per (row, token). If the re-reads went to HBM instead (an L2 that the weight stream evicts),
#   batch 8 would be far slower — the review's figure may assume that; the model does not.
# * The review's "~12 KiB in flight per SM" for MXFP4 experts concerns the *fused* MXFP4 kernel; v1's megakernel had
#   no MXFP4 path and is scored with bf16 experts only.
#
# The least certain constant is the HBM latency under load (Little's law divides by it). The last table varies it —
# a sensitivity check, not a fit: even at twice the constant the model stays above the review's batch-8 figure, so
# the difference lies in the re-read and overlap assumptions listed above. The first GPU run decides: the device check
# writes model vs measured per opcode (`kimik3.perfmodel.device`).

# %%
def excess_table(batch: int) -> pd.DataFrame:
    t, tl = megakernel_model(SHARD, batch, "v1", PC)
    t = t.assign(model_us=(tl["end_ns"] - tl["start_ns"]) / 1e3,
                 stream_us=(t["weight_bytes"] + t["state_bytes"]) / PC.sm_share_Bps * 1e6)
    g = t.groupby("op").agg(count=("op", "size"), model_us=("model_us", "sum"), stream_us=("stream_us", "sum"),
                            limited_by=("limited_by", lambda s: s.mode().iloc[0]))
    g["excess_us"] = g["model_us"] - g["stream_us"]
    g["share_of_excess"] = g["excess_us"] / g["excess_us"].sum()
    span = (tl["end_ns"].max() + PC.kernel_boundary_ns) / 1e6
    g.attrs["summary"] = (f"batch {batch}: model {span:.3f} ms, roofline {model_roofline_ms(SHARD, batch):.3f} ms "
                          f"({100 * model_roofline_ms(SHARD, batch) / span:.0f}% of roofline)")
    return g.sort_values("excess_us", ascending=False)


for b in (1, 8):
    tab = excess_table(b)
    print(tab.attrs["summary"])
    display(tab.round(1))

# %%
from kimik3.perfmodel import Constants, predict

sens = []
for lat in (450.0, 600.0, 1200.0):  # HBM latency under load, ns (the constant is 600)
    c = Constants({**PC.values, "hbm_latency_ns": lat}, PC.sources, PC.hardware)
    sens.append({"HBM latency ns": lat, "batch 8: % of roofline": 100 * predict(SHARD, "megakernel", 8, "v1",
                                                                                 constants=c)["fraction_of_roofline"]})
display(pd.DataFrame(sens).set_index("HBM latency ns").round(1))

# %% [markdown]
# ## The megakernel's PTX
#
# Compiled here for `sm_90a` (the DSL carries its own NVVM and ptxas: no GPU needed) for this preset and batch size.
# The lines the design stands on: the weight prefetch (`cp.async.cg`) issued before the wait, the acquire spin with
# back-off and the watchdog's error poll and first-error CAS, the two `%globaltimer` stamps, and the release that
# signals a counter. Budget: ≤ 168 registers at 384 threads per CTA, no spills, ≤ 120 KiB shared memory.

# %%
if compile_kernel:
    from kimik3.kernels.toolchain import build as B
    from kimik3.kernels.toolchain import registry as R

    from kimik3.megakernel.kernel_shapes import variant_name

    v = R.get_variant(variant_name(cfg, batch_size))
    r = B.build(v, "sm_90a")
    display(pd.DataFrame([r.resources | {"compile s": r.compile_seconds, "cached": r.cached,
                                         "budget": "ok" if not B.check_budget(r, v.budget) else
                                         "; ".join(B.check_budget(r, v.budget))}], index=[v.name]))
    lines = r.ptx.splitlines()
    pats = ["cp.async.cg", "cp.async.commit_group", "ld.acquire.gpu", "nanosleep", "ld.relaxed.gpu",
            "atom.global.cas", "cp.async.wait_group", "%globaltimer", "red.release.gpu", "%smid"]
    shown = []
    for k, line in enumerate(lines):
        if any(p in line for p in pats):
            shown.append(f"{k:6d}  {line.strip()}")
    print(f"{len(lines)} PTX lines; .target {B.ptx_target(r.ptx)}; synchronisation and timing lines:")
    print("\n".join(shown))
    print("\nthe entry:", re.search(r"\.entry[^(]*\(", r.ptx).group(0)[:90], "... 6 x .b8[8] (pointers)")
else:
    print("compile_kernel=False: PTX section skipped (CI); tests/test_megakernel_compile.py checks these lines.")

# %% [markdown]
# ## The ladder on the roofline
#
# The whole step at its bandwidth bound on an H200, the megakernel's simple cost-model simulation and the calibrated
# model's prediction for the fused and megakernel stages (models, not measurements; the bars span each prediction's
# range, optimistic to pessimistic constants), and every recorded GPU step time in `data/measurements/` (labelled with
# date and commit). Stages without a recorded GPU time are listed as *not yet measured*.

# %%
LADDER = ["naive", "absorbed", "graphs", "compiled", "fused", "megakernel"]
recorded = load_recorded("data/measurements")
cost = decode_cost(SHARD, 1, 4096)
pts = [points_from_cost(cost, "h200", by="step", stage="bandwidth bound"),
       points_from_cost(cost, "h200", seconds=makespan_ns(sim) / 1e9, by="step", stage="megakernel",
                        kind="simple cost model"),
       points_from_cost(cost, "h200", seconds=scores_now.loc[("megakernel", 1), "model ms"] / 1e3, by="step",
                        stage="megakernel", kind=f"calibrated model {CURRENT_DESIGN}"),
       points_from_cost(cost, "h200", seconds=scores_now.loc[("fused", 1), "model ms"] / 1e3, by="step",
                        stage="fused", kind=f"calibrated model {CURRENT_DESIGN}")]
rows = []
for st in LADDER:
    rec = recorded[(recorded["stage"] == st) & (recorded["block"] == "step")] if not recorded.empty else recorded
    gpu = rec[rec["device"].astype(str).str.contains("H100|H200|B200|GB|NVIDIA", case=False)] if not rec.empty else rec
    rows.append({"stage": st, "GPU step times recorded": len(gpu),
                 "status": "recorded" if len(gpu) else "not yet measured"})
display(pd.DataFrame(rows).set_index("stage"))
fig = roofline_figure(pts, hardware=["h200"], compute_dtypes=("bf16",), recorded=True,
                      title=f"{SHARD}, B=1: the step on the H200 roofline")
for k, st in enumerate(("megakernel", "fused")):  # the model's range: same FLOPs, optimistic .. pessimistic time
    fast_ms, slow_ms = ranged[(st, 1)]["predicted_ms_range"]
    y = cost.total_flops / (ranged[(st, 1)]["predicted_ms"] / 1e3)
    x = cost.total_flops / cost.total_bytes * (1.04 if k else 1 / 1.04)  # side by side: both share one intensity
    fig.add_trace(go.Scatter(x=[x], y=[y], mode="markers", marker=dict(size=5, color="gray"),
                             error_y=dict(type="data", symmetric=False, array=[cost.total_flops / (fast_ms / 1e3) - y],
                                          arrayminus=[y - cost.total_flops / (slow_ms / 1e3)]),
                             name=f"{st} (calibrated model {CURRENT_DESIGN}): range", hovertemplate=(
                                 f"{st}: {fast_ms:.3f}–{slow_ms:.3f} ms (model range)<extra></extra>")))
save_html(fig, out / "roofline_ladder.html")
print(sorted(p.name for p in out.glob("*.html")))
fig

# %% [markdown]
# ## Running it on a GPU
#
# ```python
# import kimik3, kimik3.megakernel.gpu  # registers stage "megakernel"
# model = kimik3.from_preset("tiny", dtype=torch.bfloat16, device="cuda")
# dec = kimik3.Decoder(model, "megakernel", batch_size=8, max_seq_len=1024)   # bf16, batch 1..64, sm_90a / sm_100a
# dec.prefill(ids); logits = dec.step(next_ids)
# dec.stage.timeline()                                                        # the last step, measured
# ```
# The stage builds the program for the GPU's SM count, checks it (hazards and the device contract), compiles the
# kernel in-process (or loads a prebuilt one: `prebuilt=DIR` from `python -m kimik3 kernels build --family
# megakernel`), and launches one cooperative grid per step. A wait that cannot be met ends the launch through the
# watchdog with the instruction and counter named (`MegakernelError`) instead of hanging.
# `tests/test_megakernel_gpu.py` compares it with naive for tiny and k3-shard at batch 1, 8 and 64 — outstanding
# until a GPU session runs it.
