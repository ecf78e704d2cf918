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
# # 02 · Memory and rooflines: what one decode step costs
#
# One decode step of Kimi K3 gives every sequence in the batch one new token. This notebook counts what that step
# moves and computes — per layer and block, from the model's own parameter shapes (`kimik3.perf.cost`) — and puts it
# against the ceilings of real chips (`data/hardware.json`) and against published speeds (`data/published.json`).
#
# The short version: at small batch a decode step does about **one to two FLOPs per byte** it reads, while an H200
# or a GB300 can do **200–300 FLOPs per byte** of bandwidth. Decode is bandwidth-bound, so the bound on speed is
# *bytes per step ÷ bandwidth*, and the work of every later notebook is to read fewer bytes, read them faster, and
# overlap everything else with the reading.
#
# Run headless: `papermill notebooks/02_memory_and_rooflines.ipynb out.ipynb -p out_dir /tmp/run02`.

# %% tags=["parameters"]
preset = "kimi-k3"
batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
context_lens = [0, 8192, 131072]
out_dir = "runs/02"
solutions = False  # workshop: True checks the reference solutions instead of your answers (make run does)


# %%
# a bad parameter (papermill -p, or an edit above) stops here with its name, not deep inside a later cell
from kimik3.notebook.runner import check_params

check_params(dict(preset=preset, batch_sizes=batch_sizes, context_lens=context_lens), "02_memory_and_rooflines")

# %%

import pandas as pd
import plotly.graph_objects as go
from IPython.display import display

import kimik3
from kimik3.notebook.start import start_notebook
from kimik3.perf.cost import (
    batch_size_for_bytes,
    cache_bytes_per_sequence,
    decode_cost,
    expected_distinct_experts,
    parameter_counts,
)
from kimik3.perf.hardware import hardware_table, local_hardware, measure_local
from kimik3.perf.recorded import claims_vs_bound, load_published, load_recorded
from kimik3.perf.roofline import latency_roofline_figure, points_from_cost, roofline_figure, roofline_panel, save_html

# plotly renders with no network (plotly.js embedded once, no CDN); figures go to `out`
out = start_notebook(out_dir, pandas_display={"width": 200, "max_columns": 30}).out
cfg = kimik3.get_preset(preset)
HARDWARE = ["h100-sxm", "h200", "b200", "gb200", "gb300"]
T_MID = sorted(context_lens)[len(context_lens) // 2]  # the middle context of the sweep, for single-context tables
print(cfg.name, {k: f"{v / 1e9:,.2f} B" for k, v in parameter_counts(cfg).items()})

# %% [markdown]
# ## Why decode is bandwidth-bound
#
# A weight matrix of `n` parameters costs `n` multiply-adds (2n FLOPs) per token and `2n` bytes to read in bf16.
# Read once for a batch of `B` tokens, that is `B` FLOPs per byte. A routed expert is worse: it is read for the few
# tokens that chose it, and at batch 1 each of K3's 92 MoE layers reads 16 experts for one token. The KDA state
# (6.3 MB per layer per sequence, read *and* written) and the MLA cache add bytes per sequence that batching does
# not share.
#
# The ridge point of a chip — peak FLOP/s ÷ bandwidth — is where that stops mattering. Compare:

# %%
hw = hardware_table()
step1 = decode_cost(cfg, 1, T_MID)
display(hw)
print(f"{cfg.name}, batch 1, context {T_MID:,}: {step1.total_flops / 1e9:,.1f} GFLOP over "
      f"{step1.total_bytes / 1e9:,.2f} GB = {step1.arithmetic_intensity:.2f} FLOP/byte; "
      f"ridge points {hw['ridge bf16 FLOP/B'].min():.0f}-{hw['ridge bf16 FLOP/B'].max():.0f} FLOP/byte (bf16)")

# %% [markdown]
# ### Exercise: the least time a step can take
#
# A step moves `bytes` through memory at `bandwidth` bytes/s and performs `flops` at `peak_flops` FLOP/s.
# Write the lower bound on its time — the roofline in one line.

# %%
from kimik3.notebook import workshop


def step_lower_bound(bytes_, flops, bandwidth, peak_flops):
    """Least seconds for a step (bytes/s and FLOP/s ceilings)."""
    raise NotImplementedError("your code here")


# %%
workshop.check("step_lower_bound", step_lower_bound, solutions=solutions)
# workshop.reveal("step_lower_bound")  # uncomment to see a solution

# %% [markdown]
# ## What one token costs at full size
#
# Per block kind, summed over layers (batch 1). Weights dominate; the KDA recurrent state is the next item, the
# MLA cache is small at this context. Storing the routed experts in MXFP4 (4.25 bits per weight, as released)
# removes most of the routed-expert bytes; everything else stays bf16.

# %%
bf16 = decode_cost(cfg, 1, T_MID, expert_dtype="bf16")
mxfp4 = decode_cost(cfg, 1, T_MID, expert_dtype="mxfp4")
display(bf16.summary().round(4))
print(bf16)
print(mxfp4)


# %%
def bytes_bar(costs: dict) -> go.Figure:
    fig = go.Figure()
    parts = [("weights", ["weight_bytes"]), ("KDA state (r+w)", ["state_bytes_read", "state_bytes_written"]),
             ("MLA cache (r+w)", ["kv_bytes_read", "kv_bytes_written"]), ("activations", ["activation_bytes"])]
    for label, cost in costs.items():
        k = cost.by_kind()
        for part, cols in parts:
            fig.add_bar(x=[k.index.tolist(), [label] * len(k)], y=k[cols].sum(axis=1) / 1e9, name=part,
                        legendgroup=part, showlegend=label == next(iter(costs)))
    fig.update_layout(barmode="stack", template="plotly_white", height=460, yaxis_title="GB per step",
                      title=f"{cfg.name}: bytes per decode step by block (batch 1, context {T_MID:,})")
    return fig


fig_bytes = bytes_bar({"bf16 experts": bf16, "MXFP4 experts": mxfp4})
save_html(fig_bytes, out / "bytes_by_block.html")
fig_bytes

# %% [markdown]
# For the full-size K3 these reproduce the spec's §8.2 table (checked in `tests/test_cost.py` within 2 %; the
# FLOPs differ by 0.3 % because the spec counts MLA's `kv_b_proj` twice):

# %%
if cfg.name == "kimi-k3":
    t0, t8 = decode_cost(cfg, 1, 0), decode_cost(cfg, 1, 8192)
    spec = pd.DataFrame([
        ("weights read per step, bf16 [GB]", 208.40, bf16.weight_bytes / 1e9),
        ("weights read per step, MXFP4 experts [GB]", 136.99, mxfp4.weight_bytes / 1e9),
        ("of which routed experts, bf16 [GB]", 97.24, bf16.routed_expert_bytes / 1e9),
        ("of which routed experts, MXFP4 [GB]", 25.83, mxfp4.routed_expert_bytes / 1e9),
        ("KDA state traffic r+w [GB]", 0.899, t8.state_bytes / 1e9),
        ("KV read at T=8192 [GB]", 0.226, t8.by_block["kv_bytes_read"].sum() / 1e9),
        ("FLOPs per token, T->0", 2.097e11, t0.flops_per_token),
        ("FLOPs per token, T=8192", 2.508e11, t8.flops_per_token),
    ], columns=["quantity", "spec §8.2", "cost model"]).set_index("quantity")
    spec["ratio"] = spec["cost model"] / spec["spec §8.2"]
    display(spec)

# %% [markdown]
# ## Batch size: experts touched, bytes shared
#
# Dense weights are read once per step however many sequences share it, so their cost per token falls as `1/B`.
# Routed experts are read once per *distinct* expert: with uniform routing a layer touches
# `D(B) = E·(1 − (1 − k/E)^B)` experts — `k` at batch 1, all `E` at large batch. KDA state and MLA cache are per
# sequence and never shared. So bytes per step grow with `B`, bytes per *token* fall, and the step stays
# bandwidth-bound far past the batch sizes interactive serving uses.

# %%
if cfg.n_routed_experts:
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    display(pd.DataFrame({"B": batch_sizes, "D(B)": [expected_distinct_experts(E, k, b) for b in batch_sizes],
                          "share of experts read": [expected_distinct_experts(E, k, b) / E for b in batch_sizes]})
            .set_index("B").T.round(3))

rows = []
for dtype in ("bf16", "mxfp4"):
    for t in context_lens:
        for b in batch_sizes:
            c = decode_cost(cfg, b, t, expert_dtype=dtype)
            rows.append({"experts": dtype, "T": t, "B": b, "GB/step": c.total_bytes / 1e9,
                         "GB/token": c.bytes_per_token / 1e9, "weights GB": c.weight_bytes / 1e9,
                         "state+KV GB": (c.state_bytes + c.kv_bytes) / 1e9, "FLOP/B": c.arithmetic_intensity})
sweep = pd.DataFrame(rows)
fig_batch = go.Figure()
for (dtype, t), g in sweep.groupby(["experts", "T"]):
    fig_batch.add_scatter(x=g["B"], y=g["GB/step"], name=f"{dtype} experts, T={t:,}: GB/step")
    fig_batch.add_scatter(x=g["B"], y=g["GB/token"], name=f"{dtype} experts, T={t:,}: GB/token",
                          line=dict(dash="dot"))
fig_batch.update_xaxes(type="log", title="batch size")
fig_batch.update_yaxes(type="log", title="GB")
fig_batch.update_layout(template="plotly_white", height=480, title=f"{cfg.name}: bytes per step and per token")
save_html(fig_batch, out / "bytes_vs_batch.html")
fig_batch

# %% [markdown]
# ### Exercise: experts touched by a batch
#
# B tokens each pick k of the E routed experts. Expert weights are read once per distinct expert, so the bytes
# of a step follow the expected number of *distinct* experts, not B·k. Write it (uniform routing).

# %%
from kimik3.notebook import workshop


def distinct_experts(num_experts, top_k, batch_size):
    """Expected number of distinct experts read when batch_size tokens each pick top_k of num_experts."""
    raise NotImplementedError("your code here")


# %%
workshop.check("distinct_experts", distinct_experts, solutions=solutions)
# workshop.reveal("distinct_experts")  # uncomment to see a solution

# %% [markdown]
# ## Context: a fixed state and a growing cache
#
# K3 keeps a fixed 449 MB of KDA state per sequence plus 27,648 bytes per token of MLA latent cache (24 layers);
# K2, all MLA, keeps 70,272 bytes per token. K3's cache is larger at short context and smaller beyond ≈ 10.5 K
# tokens. Per step, the cache is *read* in full for every sequence, so long contexts move bytes that batching
# cannot share.

# %%
ctx = [0, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 1048576]
models = [cfg.name] + (["kimi-k2"] if cfg.name != "kimi-k2" else [])
cache = pd.DataFrame({m: [cache_bytes_per_sequence(m, t) / 1e9 for t in ctx] for m in models}, index=ctx)
cache.index.name = "context tokens"
display(cache.round(3).T)
fig_ctx = go.Figure()
for m in models:
    fig_ctx.add_scatter(x=ctx[1:], y=cache[m].iloc[1:], name=f"{m}: cache GB per sequence")
for b in (1, 64):
    fig_ctx.add_scatter(x=ctx[1:], y=[decode_cost(cfg, b, t, expert_dtype="mxfp4").bytes_per_token / 1e9
                                      for t in ctx[1:]],
                        name=f"{cfg.name}: GB moved per token, B={b}", line=dict(dash="dot"))
fig_ctx.update_xaxes(type="log", title="context tokens")
fig_ctx.update_yaxes(type="log", title="GB")
fig_ctx.update_layout(template="plotly_white", height=460, title="Decode state per sequence, and bytes per token")
save_html(fig_ctx, out / "cache_vs_context.html")
fig_ctx

# %% [markdown]
# ## Published claims against the bound
#
# Each tokens/s figure implies a sustained bandwidth: one step gives each sequence one token, so
# `bandwidth = bytes per step × steps per second`. Divided by one chip's datasheet bandwidth it says how many chips
# at 100 % it would take; with the chip count (stated, or all 72 of an NVL72 when not) it gives the utilisation.
# Figures without a batch size are read at batch 1 (the least bytes, so the least bandwidth). Figures marked
# `verified = False` could not be found in their source here and are recorded with the citation text only. None of
# this includes communication (SemiAnalysis counts over 120 all-to-all exchanges per forward pass) or
# speculative decoding (several tokens per step), so it is a floor on what the systems must do, not a model of
# them.

# %%
published = load_published()
display(published[["id", "claim", "verified", "source_title", "source_url"]])
vs = claims_vs_bound(cfg.name, expert_dtype="mxfp4", context_len=T_MID)
display(vs.round(3))

# %%
# "About 1.5 TB of HBM traffic per forward pass": at which batch size does one step move that much?
target = 1.5e12
rows = []
for dtype in ("mxfp4", "bf16"):
    for t in context_lens:
        b = batch_size_for_bytes(cfg, target, t, expert_dtype=dtype)
        rows.append({"experts": dtype, "context": t, "smallest batch with >= 1.5 TB/step": b,
                     "experts read per layer at that batch":
                         None if b is None or not cfg.n_routed_experts else
                         round(expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, b), 1)})
display(pd.DataFrame(rows))
print(f"All weights at rest (every expert): {mxfp4.resident_weight_bytes / 1e9:,.3f} GB with MXFP4 experts, "
      f"{bf16.resident_weight_bytes / 1e9:,.3f} GB in bf16")

# %% [markdown]
# ## Rooflines
#
# Each block of the step at batch 1 and batch 64, timed at its own lower bound on an H200 and a GB300 (so the points
# sit on those rooflines), with this machine's measured read bandwidth and matmul rate as a third set of ceilings.
# The read bandwidth (STREAM-style: a `sum` over a buffer far larger than any cache, warm, on all of torch's threads)
# is decode's ceiling, because a step reads weights and cache and writes almost nothing; a measured point above
# its ceiling is drawn apart, as a measurement problem.
# Recorded GPU measurements in `data/measurements/` appear as "recorded <date> <commit>" points when present.

# %%
local = local_hardware(measure_local(quick=True))
m = local.provenance
print(local.name, f"read {m['read_bandwidth_Bps'] / 1e9:.1f} GB/s (min {m['read_bandwidth_spread']['min'] / 1e9:.1f},"
      f" max {m['read_bandwidth_spread']['max'] / 1e9:.1f}), copy {m['copy_bandwidth_Bps'] / 1e9:.1f}, triad "
      f"{m['triad_bandwidth_Bps'] / 1e9:.1f} GB/s; {local.compute_ceiling('fp32')[0] / 1e9:.1f} GFLOP/s fp32 matmul")
points = pd.concat([
    points_from_cost(decode_cost(cfg, b, T_MID, expert_dtype="mxfp4"), h, stage=f"B={b} on {h}")
    for b in (1, 64) for h in ("h200", "gb300")], ignore_index=True)
fig_roof = roofline_figure(points, hardware=["h200", "gb300", local], compute_dtypes=("bf16", "fp4"))
save_html(fig_roof, out / "roofline.html")
print(f"recorded measurements: {len(load_recorded())}")
fig_roof

# %% [markdown]
# ## Latency roofline
#
# The same bound as a user sees it: least milliseconds per step and most tokens per second per sequence, against
# batch size, for each chip (as many of them as it takes to hold the MXFP4 weights and the largest batch's cache;
# perfect parallelism, no communication) and each context length.

# %%
fig_lat = latency_roofline_figure(cfg, ["h200", "b200", "gb300"], batch_sizes, context_lens, "mxfp4")
save_html(fig_lat, out / "latency_roofline.html")
fig_lat

# %% [markdown]
# ## Explore
#
# Change the preset, chip, batch, context and storage dtypes; the figure shows every block of the step at its bound
# on the chosen chip, and the line above it the step's totals. (With `anywidget` installed the figure is a live
# `FigureWidget`; without it the panel redraws a plain figure.)

# %%
panel = roofline_panel(cfg.name, "gb300", batch_size=1, context_len=T_MID, expert_dtype="mxfp4")
display(panel)
print(sorted(p.name for p in out.glob("*.html")))

# %% [markdown]
# **Caveats.** Uniform routing (real routing is skewed; pass `routing=` ids for exact counts), no communication,
# perfect overlap, datasheet peaks (several entries carry a `note` where a figure is not from a datasheet), and
# activation traffic counted as one read and one write per block. Measured stages in later notebooks are placed
# against these bounds.
