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
# host (`kimik3.megakernel`) and interpreted on the device (`kernels/megakernel.py`). Dependencies are counters in
# global memory, not kernel boundaries, and an SM that waits for its inputs already streams its next weights.
#
# What runs where:
#
# | piece | where | status |
# | --- | --- | --- |
# | instruction set, scheduler, hazard checker, cost-model timeline | CPU, here | tested |
# | CPU interpreter (stage `megakernel-cpu`) under random interleavings | CPU, here | matches naive (below) |
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

# %%
import dataclasses
import re
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import torch
from IPython.display import display

import kimik3
import kimik3.megakernel.interpreter  # noqa: F401  (registers stage "megakernel-cpu")
from kimik3.cost import decode_cost
from kimik3.hardware import get_hardware
from kimik3.megakernel import build_program, check_program, instruction_set_table, simulate, summary
from kimik3.megakernel.hazards import format_violations
from kimik3.megakernel.instructions import Kind, Mode, Op, Program, encoding_table
from kimik3.megakernel.timeline import gantt, makespan_ns
from kimik3.recorded import load_recorded
from kimik3.roofline import points_from_cost, roofline_figure, save_html
from kimik3.tolerances import TOL, rel_error

pio.renderers.default = "plotly_mimetype+notebook_connected"
pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 20)
pd.set_option("display.max_colwidth", 120)
out = Path(out_dir)
out.mkdir(parents=True, exist_ok=True)
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
# What each opcode's device code does in this first version, and its known performance limits (from
# `kernels/megakernel.py`, `OPCODE_NOTES`):

# %%
try:
    from kimik3.kernels.device_fns import NT
    from kimik3.kernels.megakernel import OPCODE_NOTES, STAGE_BYTES

    notes = pd.DataFrame([(op, what, limits) for op, (what, limits) in OPCODE_NOTES.items()],
                         columns=["opcode", "device code", "known limits"]).set_index("opcode")
    print(f"{NT} threads per CTA, one CTA per SM; weight stage {STAGE_BYTES // 1024} KiB of shared memory")
    display(notes)
except ImportError as e:  # the CuTe DSL is optional for the CPU half of this notebook
    print(f"nvidia-cutlass-dsl not installed ({e}): device notes skipped")

# %% [markdown]
# ## A schedule, drawn
#
# The critical-path policy assigns every instruction to an SM queue (list scheduling on the cost model's durations,
# prefetch-aware), then keeps only the waits nothing else implies. The simulated timeline runs the same execution
# model the kernel does: an SM reaches an instruction, streams its weights into shared memory while it waits, runs it,
# signals. Grey bars are waits.

# %%
assert check_program(shard) == [], "the scheduler's program must be provably race- and deadlock-free"
sim = simulate(shard)
fig = gantt(sim, title=f"{SHARD}, batch 1, 132 SMs ({policy}): simulated per-SM queues")
save_html(fig, out / "schedule_k3_shard_b1.html")
rows = []
for pol in ("round_robin", "critical_path"):
    p = shard if pol == policy else build_program(SHARD, 1, 132, pol)
    rows.append({"policy": pol, "makespan µs (prefetch)": makespan_ns(simulate(p)) / 1e3,
                 "makespan µs (no prefetch)": makespan_ns(simulate(p, prefetch=False)) / 1e3})
display(pd.DataFrame(rows).set_index("policy").round(1))
print(f"bandwidth bound {bound_us:.1f} µs")
fig

# %% [markdown]
# ## The program on the CPU interpreter, under random interleavings
#
# `megakernel-cpu` decodes the int32 program with PyTorch: every SM gets a cursor into its queue, and at each tick a
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
mk = kimik3.Decoder(model, "megakernel-cpu", batch_size=batch_size, max_seq_len=max_len, policy=policy, num_sms=8)
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
# ## The timeline: where the time goes
#
# Per opcode, summed over SMs: busy time (weights that were not hidden behind a wait, plus the rest), time spent
# waiting on counters, and the SMs' idle time after their queue ran dry. The same table comes out of a measured step:
# the kernel records `(start ns, end ns, %smid)` per instruction from `%globaltimer` into a `[N, 3]` int64 buffer, and
# `kimik3.megakernel.timeline.from_timings` turns it into this format (`MegakernelStage.timeline()`).

# %%
summ = summary(sim, 132)
print(f"{SHARD}, B=1, 132 SMs: simulated makespan {summ.attrs['makespan_us']:.1f} µs")
display(summ.round(2))
fig = go.Figure()
s = summ.drop(index="(idle)")
fig.add_bar(x=s.index, y=s["busy_us"], name="busy")
fig.add_bar(x=s.index, y=s["waiting_us"], name="waiting")
fig.update_layout(barmode="stack", template="plotly_white", height=420, yaxis_title="µs summed over SMs",
                  title=f"{SHARD}, B=1: simulated SM time per instruction type")
save_html(fig, out / "time_per_opcode.html")
local = summary(simulate(program), program.num_sms)
print(f"{preset}, B={batch_size}, {program.num_sms} SMs (the interpreter's program): "
      f"simulated makespan {local.attrs['makespan_us']:.1f} µs")
display(local.round(2).head(8))
fig

# %% [markdown]
# ## The megakernel's PTX
#
# Compiled here for `sm_90a` (the DSL carries its own NVVM and ptxas: no GPU needed) for this preset and batch size.
# The lines the design stands on: the weight prefetch (`cp.async.cg`) issued before the wait, the acquire spin with
# back-off and the watchdog's error poll and first-error CAS, the two `%globaltimer` stamps, and the release that
# signals a counter. Budget: ≤ 168 registers at 384 threads per CTA, no spills, ≤ 120 KiB shared memory.

# %%
if compile_kernel:
    from kimik3.kernels import build as B
    from kimik3.kernels import registry as R

    from kimik3.megakernel.gpu import variant_name

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
# The whole step at its bandwidth bound on an H200, the megakernel's cost-model simulation (the schedule above: a
# model, not a measurement), and every recorded GPU step time in `data/measurements/` (labelled with date and
# commit). Stages without a recorded GPU time are listed as *not yet measured*.

# %%
LADDER = ["naive", "absorbed", "graphs", "compiled", "fused", "megakernel"]
recorded = load_recorded("data/measurements")
cost = decode_cost(SHARD, 1, 4096)
pts = [points_from_cost(cost, "h200", by="step", stage="bandwidth bound"),
       points_from_cost(cost, "h200", seconds=makespan_ns(sim) / 1e9, by="step",
                        stage="megakernel (cost-model simulation)")]
rows = []
for st in LADDER:
    rec = recorded[(recorded["stage"] == st) & (recorded["block"] == "step")] if not recorded.empty else recorded
    gpu = rec[rec["device"].astype(str).str.contains("H100|H200|B200|GB|NVIDIA", case=False)] if not rec.empty else rec
    rows.append({"stage": st, "GPU step times recorded": len(gpu),
                 "status": "recorded" if len(gpu) else "not yet measured"})
display(pd.DataFrame(rows).set_index("stage"))
fig = roofline_figure(pts, hardware=["h200"], compute_dtypes=("bf16",), recorded=True,
                      title=f"{SHARD}, B=1: the step on the H200 roofline")
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
