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
# # 07 · Scaling to a rack: full-size K3 on GB300 NVL72 (and 16 × GB200)
#
# Everything so far ran on one GPU, with `k3-shard`: K3's widths, four layers, the 56 experts one of 16 GPUs would
# hold. The full model is 2.78 T parameters (1.4 TB with MXFP4 experts) and does not fit one GPU; it is served on a
# rack — 72 Blackwell Ultra GPUs joined by NVLink switches (GB300 NVL72), or 16 GB200s. This notebook asks what a
# decode step costs there, from the same cost model (`kimik3.perf.cost`) and the datasheet ceilings
# (`data/hardware.json`), with the modelling code in `kimik3.scale.nvl72`:
#
# 1. **bytes per GPU** — what each GPU reads from its own HBM per step, for a stated way of sharding the model;
# 2. **all-to-all exchanges** — two per MoE layer (dispatch the tokens' latent vectors to the experts' GPUs, combine
#    the outputs), 184 per step for K3's 92 MoE layers, and what they cost over NVLink;
# 3. **overlap** — how much of that communication can hide behind the local work;
# 4. **tokens/s per user** at batch 1 … 256, set against the published figures (`data/published.json`) and against
#    what a single GPU doing one layer implies.
#
# **Assumptions** (stated once, used throughout; `kimik3.scale.nvl72` docstring has the detail):
# routed experts sharded over all GPUs (expert parallelism, uniform routing — every MoE layer waits for the *busiest*
# GPU's expert reads); everything else either replicated per GPU ("DP attention": each GPU runs its own sequences'
# attention on a full copy, the layout of `kimik3.scale.expert_parallel`) or tensor-parallel over a group of `tp` GPUs;
# experts in MXFP4, everything else bf16; a collective costs a fixed latency (assumed: 10 µs per all-to-all, 5 µs per
# all-reduce — swept below) plus its bytes over one direction of the GPU's NVLink; local work bounded by HBM bandwidth
# (datasheet, 100 %). These are idealised bounds, not a simulation of a serving stack.

# %% tags=["parameters"]
batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
rank_batches = [1, 8]  # batches of the k3-rank prediction (section 6)
out_dir = "runs/07_scaling_to_nvl72"


# %%
# a bad parameter (papermill -p, or an edit above) stops here with its name, not deep inside a later cell
from kimik3.notebook.runner import check_params

check_params(dict(batch_sizes=batch_sizes, rank_batches=rank_batches), "07_scaling_to_nvl72")

# %%
import json

import pandas as pd
import plotly.graph_objects as go
from IPython.display import display
from plotly.subplots import make_subplots

import kimik3
from kimik3.notebook.start import start_notebook
from kimik3.perf.cost import decode_cost, parameter_counts
from kimik3.perf.hardware import get_hardware
from kimik3.perf.recorded import load_recorded, resolve_data_path, speed_claims
from kimik3.scale.nvl72 import (
    DEPLOYMENTS,
    CommModel,
    all_to_all_table,
    claims_vs_scaleout,
    collectives_per_step,
    comm_time,
    experts_per_gpu,
    gpu_bytes,
    per_gpu_bytes,
    per_layer_budget,
    prediction_table,
    shard_per_layer,
    step_time,
)

# plotly renders with no network (plotly.js embedded once, no CDN); figures go to `out`
out = start_notebook(out_dir, pandas_display={"width": 220, "max_columns": 30, "max_colwidth": 60}).out
cfg = kimik3.get_preset("kimi-k3")
T = 8192  # context per sequence (tokens cached incl. the new one)
COMM = CommModel()
deps = list(DEPLOYMENTS.values())
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]


def rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


print(cfg.name, {k: f"{v / 1e9:,.1f} B" for k, v in parameter_counts(cfg).items()})
display(pd.DataFrame([{"deployment": d.name, "GPUs": d.gpus, "experts over (EP)": d.ep_ranks,
                       "attention/dense TP": d.tp, "attention replicas (DP)": d.dp,
                       "HBM TB/s per GPU": get_hardware(d.hardware).hbm_bandwidth / 1e12,
                       "NVLink GB/s per direction": get_hardware(d.hardware).nvlink_bandwidth / 2e9,
                       "experts": d.expert_dtype} for d in deps]).set_index("deployment"))

# %% [markdown]
# ## 1 · Bytes per GPU
#
# The cost model's step (all experts MXFP4, batch `B`, context 8,192) split by how sharding treats it: non-expert
# weights (KDA, MLA, router, latent projections, shared experts, dense layer, head: **111 GB** in bf16, read once per
# step by every group that has a sequence), routed-expert weights (`D(B)` distinct experts per layer, spread over the
# EP GPUs), and per-sequence KDA state + MLA cache. The table is the busiest GPU at batch 1.

# %%
rows = []
for d in deps:
    b = per_gpu_bytes(cfg, 1, T, d)
    rows.append({"deployment": d.name, **{k: b[k] / 1e9 for k in ("non_expert_weights", "expert_weights",
                                                                   "expert_weights_mean", "state_kv", "total")},
                 "all GPUs GB": b["all_gpus"] / 1e9, "cost model GB (one system)": b["model_total"] / 1e9})
display(pd.DataFrame(rows).set_index("deployment").round(3))
m1, m_max = experts_per_gpu(cfg.n_routed_experts, cfg.num_experts_per_tok, 1, 72)
print(f"batch 1 on 72 GPUs: a GPU reads {m1:.2f} experts per layer on average, the busiest ~{m_max:.2f} — and every "
      "layer waits for the busiest")
tp72 = DEPLOYMENTS["gb300-nvl72-ep72-tp72"]
for b in batch_sizes:
    s, total = gpu_bytes(cfg, b, T, tp72).sum(), decode_cost(cfg, b, T, expert_dtype="mxfp4").total_bytes
    assert abs(s / total - 1) < 1e-9, (b, s, total)
print("fully sharded (TP72): the 72 GPUs' bytes sum to the cost model's total at every batch size")

# %%
per_tok = pd.DataFrame([{"deployment": d.name, "batch": b, **{k: v / 1e9 for k, v in per_gpu_bytes(cfg, b, T, d)
                                                              .items() if k in ("total", "per_token")}}
                        for d in deps for b in batch_sizes])
fig_bytes = make_subplots(rows=1, cols=2, subplot_titles=("busiest GPU: GB per step", "busiest GPU: GB per token"))
for i, (name, g) in enumerate(per_tok.groupby("deployment", sort=False)):
    color = PALETTE[i % 5]
    fig_bytes.add_scatter(x=g["batch"], y=g["total"], name=name, line=dict(color=color), row=1, col=1)
    fig_bytes.add_scatter(x=g["batch"], y=g["per_token"], name=name, line=dict(color=color), showlegend=False,
                          row=1, col=2)
fig_bytes.update_xaxes(type="log", title="batch size")
fig_bytes.update_yaxes(type="log", title="GB")
fig_bytes.update_layout(template="plotly_white", height=460, title="Kimi K3 decode: HBM bytes on the busiest GPU")
fig_bytes.write_html(str(out / "per_gpu_bytes.html"), include_plotlyjs=True)
fig_bytes

# %% [markdown]
# ## 2 · All-to-all exchanges
#
# Per MoE layer the tokens' routed inputs go to the experts' GPUs (dispatch) and the outputs come back (combine):
# `2 × 92 = 184` all-to-alls per step, each carrying `B · k` rows (k = 16) of the LatentMoE latent width — 3,584
# values, half of the 7,168 hidden width a plain MoE would send. With tensor-parallel attention, two all-reduces of
# the hidden vector per layer come on top (186 per step). At decode batch sizes these messages are tiny (a few KB to
# a few MB per GPU), so their cost is almost all latency: the count matters more than the bytes.

# %%
a2a = all_to_all_table(cfg, batch_sizes, tp72)
display(a2a.set_index("batch")[["all_to_all_per_step", "latent_width", "hidden_width", "exchange_bytes",
                                "exchange_bytes_hidden_width", "busiest_gpu_sends_remote", "step_bytes_all_gpus"]])
print("collectives per step:", {d.name: collectives_per_step(cfg, d) for d in deps[:3]})
ct = pd.DataFrame([{"deployment": d.name, "batch": b, **{k: v * 1e3 for k, v in comm_time(cfg, b, d, COMM).items()
                                                          if k.endswith("_s")}}
                   for d in deps for b in batch_sizes])
fig_comm = go.Figure()
for i, (name, g) in enumerate(ct.groupby("deployment", sort=False)):
    color = PALETTE[i % 5]
    fig_comm.add_scatter(x=g["batch"], y=g["total_s"], name=f"{name}: all collectives", line=dict(color=color))
    fig_comm.add_scatter(x=g["batch"], y=g["all_to_all_transfer_s"], name=f"{name}: all-to-all bytes only",
                         line=dict(color=color, dash="dot"))
fig_comm.update_xaxes(type="log", title="batch size")
fig_comm.update_yaxes(type="log", title="ms per step (collectives back to back)")
fig_comm.update_layout(template="plotly_white", height=480,
                       title=f"Communication per decode step over NVLink (latency {COMM.a2a_latency_s * 1e6:.0f} µs "
                             f"per all-to-all, {COMM.allreduce_latency_s * 1e6:.0f} µs per all-reduce)")
fig_comm.write_html(str(out / "all_to_all.html"), include_plotlyjs=True)
fig_comm

# %% [markdown]
# ## 3 · Overlap, and tokens/s per user
#
# Local work (the busiest GPU's HBM bytes ÷ 8 TB/s) and communication, combined as
# `t = t_local + t_comm − overlap · min(t_local, t_comm)`: overlap 0 runs them back to back, overlap 1 hides the
# shorter one entirely. Within one decode step the dependency chain is strict (a layer's experts need its dispatch,
# the next layer needs the combine), so what can hide behind communication is mainly work that does not depend on
# it — streaming the next weights, which is exactly what a megakernel's prefetch does. Bands: overlap 0 … 1; line:
# 0.5. Markers: the published figures (hollow = not verified in its source).

# %%
pred = prediction_table(cfg, batch_sizes, deps, COMM, overlaps=(0.0, 0.5, 1.0), context_len=T)
fig_tok = go.Figure()
for i, d in enumerate(deps):
    color = PALETTE[i % 5]
    g = {o: pred[(pred["deployment"] == d.name) & (pred["overlap"] == o)] for o in (0.0, 0.5, 1.0)}
    # the band's edges are lines of width 0 (as markers they drew stray dots in the default colours)
    fig_tok.add_scatter(x=g[1.0]["batch"], y=g[1.0]["tokens_per_s_per_user"], mode="lines", line=dict(width=0),
                        showlegend=False, hoverinfo="skip", legendgroup=d.name)
    fig_tok.add_scatter(x=g[0.0]["batch"], y=g[0.0]["tokens_per_s_per_user"], mode="lines", fill="tonexty",
                        line=dict(width=0), fillcolor=rgba(color, 0.15), showlegend=False, hoverinfo="skip",
                        legendgroup=d.name)
    fig_tok.add_scatter(x=g[0.5]["batch"], y=g[0.5]["tokens_per_s_per_user"], name=d.name, line=dict(color=color),
                        legendgroup=d.name)
speeds = speed_claims(("gb300", "gb200"))
stated = speeds[speeds["batch_size"].notna()]
for r in stated.itertuples():
    fig_tok.add_scatter(x=[r.batch_size], y=[r.per_user], mode="markers", name=r.label,
                        marker=dict(size=12, symbol="star" if r.hardware == "gb300" else "diamond",
                                    color="black" if r.hardware == "gb300" else "#d62728",
                                    line=dict(width=2, color="black"), opacity=1.0 if r.verified else 0.5))


def published_line(fig: go.Figure, claim, xs: list[float]) -> None:
    """A published speed as a named dashed line across ``xs`` (a line trace: an hline's annotation on a log axis is
    placed at 10^value, and several of them print on top of each other)."""
    fig.add_scatter(x=[min(xs), max(xs)], y=[claim.per_user] * 2, mode="lines", name=f"published: {claim.label}",
                    line=dict(dash="dash", color="gray", width=1),
                    hovertemplate=f"{claim.label}: {claim.per_user:,.0f} tokens/s/user<extra>published</extra>")


for r in speeds[speeds["batch_size"].isna()].itertuples():  # a figure for no stated batch: a line across
    published_line(fig_tok, r, batch_sizes)
fig_tok.update_xaxes(type="log", title="batch size (sequences per step)")
fig_tok.update_yaxes(type="log", title="tokens / s / user")
fig_tok.update_layout(template="plotly_white", height=560, legend=dict(font=dict(size=10)),
                      title="Predicted decode speed per user, full K3, MXFP4 experts, context 8,192")
fig_tok.write_html(str(out / "tokens_per_user.html"), include_plotlyjs=True)
fig_tok

# %%
table = pred.pivot_table(index=["deployment", "overlap"], columns="batch", values="tokens_per_s_per_user",
                         sort=False).round(1)
display(table)
agg = pred[pred["overlap"] == 0.5].pivot_table(index="deployment", columns="batch", values="tokens_per_s_aggregate",
                                               sort=False).round(0)
print("aggregate tokens/s (overlap 0.5):")
display(agg)
print("where the time goes at batch 1 (overlap 0):")
display(pred[(pred["batch"] == 1) & (pred["overlap"] == 0.0)].set_index("deployment")[
    ["gpu_GB_per_step", "t_memory_ms", "t_all_to_all_ms", "t_all_reduce_ms", "t_step_ms", "tokens_per_s_per_user",
     "comm_share"]].round(3))

# %% [markdown]
# ### Sensitivity to the collective latency
#
# The assumed 10 µs per all-to-all is the largest single unknown. At batch 1 the step is 184 (or 370 with TP) of
# them; the curve shows tokens/s per user as that latency goes from 1 to 20 µs (all-reduces at half of it), with the
# published figures as horizontal lines.

# %%
alphas = [1, 2, 3, 5, 7.5, 10, 15, 20]
sens = pd.DataFrame([{"deployment": d.name, "alpha_us": a, "overlap": o,
                      "tok_s_user": step_time(cfg, 1, T, d, CommModel(a * 1e-6, a * 0.5e-6), o)[
                          "tokens_per_s_per_user"]}
                     for d in deps if d.tp > 1 for a in alphas for o in (0.0, 1.0)])
fig_sens = go.Figure()
for (name, o), g in sens.groupby(["deployment", "overlap"], sort=False):
    fig_sens.add_scatter(x=g["alpha_us"], y=g["tok_s_user"], name=f"{name}, overlap {o:g}",
                         line=dict(dash="solid" if o else "dot"))
batch1 = speeds[speeds["batch_size"].isna() | (speeds["batch_size"] == 1)]
for r in batch1.itertuples():
    published_line(fig_sens, r, alphas)
fig_sens.update_xaxes(type="log", title="latency per all-to-all, µs (all-reduce: half)")
fig_sens.update_yaxes(type="log", title="tokens / s / user at batch 1")
fig_sens.update_layout(template="plotly_white", height=480, title="Batch-1 speed against the collective latency")
fig_sens.write_html(str(out / "latency_sensitivity.html"), include_plotlyjs=True)
fig_sens

# %% [markdown]
# ## 4 · What the published figures imply
#
# Each claim as a step time, next to each matching deployment: the memory-bound time of the busiest GPU
# (`memory_over_claim > 1`: impossible on that layout even with free communication), the predicted step without and
# with full overlap, and the latency per collective the claim leaves room for (serial: all collectives after the
# local work; overlapped: all hidden behind it).

# %%
cv = claims_vs_scaleout(cfg, COMM, T, deps)
display(cv.drop(columns=["system"]).round(3))
best = cv.loc[cv.groupby("claim")["best_predicted_tok_s_user"].idxmax()].set_index("claim")
for cid, r in best.iterrows():
    print(f"- {cid}{' (batch assumed 1)' if r['batch_assumed'] else ''}: {r['claimed_tok_s_user']:.0f} tok/s/user = "
          f"{r['claimed_ms_per_step']:.2f} ms per step; best modelled layout '{r['deployment']}' gives "
          f"{r['best_predicted_tok_s_user']:.0f} tok/s/user with full overlap (claim / model = "
          f"{r['claim_over_best']:.2f}); it leaves {r['collective_budget_us_overlapped']:.1f} µs per collective "
          f"if all communication hides, {r['collective_budget_us_serial']:.1f} µs if none does")

# %% [markdown]
# Reading the numbers (the lines printed above are the ones to quote; the prose rounds them):
#
# * **Replicated attention cannot serve K3 fast at small batch.** One GPU reading K3's 111 GB of non-expert weights
#   needs ~14 ms per step at 8 TB/s (≈ 70 tok/s/user at best). The 16 × GB200 baseline's *measured* batch-1 speed
#   (`inferact-gb200-batch1`, above 70) therefore already implies that its attention is split across GPUs
#   (`memory_over_claim` > 1 for the DP layout).
# * **The 16 × GB200 measurement is roughly a third to a half of the modelled TP16 bound** (full overlap … none):
#   consistent with a real stack's kernel gaps, expert imbalance and collective latencies.
# * **The vLLM GB300 NVL72 batch-1 figure (`vllm-gb300-batch1`) is a step of about a millisecond.** HBM bandwidth is not
#   the obstacle once attention is split over all 72 GPUs (the busiest reads a few GB, ~0.6 ms); with attention split
#   over only 8 GPUs the busiest GPU's reads alone exceed the step. Communication is the obstacle: 184 all-to-alls plus
#   the TP all-reduces must fit in what remains — a few µs each at most, several times below the assumed 10 µs. The
#   claim implies far cheaper collectives (one-sided NVLink writes fused into the compute kernels, as megakernels and
#   DeepEP-style low-latency kernels do), fewer of them (the layouts here pay 186 TP all-reduces on top of the 184
#   all-to-alls), or more than one token per step (speculative decoding / multi-token prediction, which the citation
#   does not rule out; published.json records the figure as unverified).
# * **The SemiAnalysis estimate (`semianalysis-gb300-per-user`, batch not stated, read at batch 1)** fits the
#   modelled TP layouts with a few µs per collective and good overlap.

# %% [markdown]
# ## 5 · What a single GPU per layer implies
#
# `k3-shard` is one full K3 layer's worth of work per token on one GPU (3 KDA + 1 MLA layer at K3 widths, 16 of 56
# experts = one layer's expert reads at batch 1). Its measured time per layer on a GPU would say how far from the
# bound a real kernel is; scaled to 93 layers it is the speed of running each layer on a single GPU. GPU
# measurements are recorded in `data/measurements/` when a session had a GPU.

# %%
recorded = load_recorded()
outstanding = resolve_data_path("data/measurements/gpu_outstanding.json")
shard = shard_per_layer(recorded)
if recorded.empty or not (recorded["preset"] == "k3-shard").any():
    items = json.loads(outstanding.read_text())["outstanding"] if outstanding.exists() else []
    print(f"No k3-shard GPU measurement is recorded yet ({len(items)} GPU measurements outstanding, e.g. "
          f"{', '.join(i['id'] for i in items[:3])}); using the cost-model bound per layer instead.")
display(shard.round(4))
for v, label in zip(batch1["per_user"], batch1["label"]):
    budget = per_layer_budget(v, cfg)
    one = shard["ms_per_layer"].min() / 1e3
    print(f"{label}: {budget * 1e6:.1f} µs per layer; one GPU needs ≥ {one * 1e6:.0f} µs for a layer at its bound -> "
          f"each layer's bytes must be split over ≥ {one / budget:.0f} GPUs")

# %% [markdown]
# ## 6 · The per-rank program: the step's collectives inside the launch
#
# Everything above prices communication with a term of its own. The megakernel can instead be built as **one rank's
# program** of a deployment (`build_program(..., shard=Shard(tp, ep, rank))`, docs/architecture.md, "megakernel
# across ranks"): attention heads and routed experts split over the same ranks, activations replicated, and the
# step's collectives as opcodes — two all-reduces per layer fused with the AttnRes mix that follows
# (`ALLREDUCE_MIX`), the LatentMoE's latent-space sum fused into `FFN_OUT`, the vocabulary arg-max (`ARGMAX_ALL`).
# A producer pushes its share into every peer's mailbox and adds to its own word of the peer's counter; nothing is
# ever reset. First it runs: `tiny` on two processes of this machine (the native executor, mailboxes in shared
# memory), the per-rank timelines of one measured step side by side, the time each instruction spun on a peer in
# red.

# %%
from plotly.colors import qualitative

from kimik3.megakernel.cpu_ranks import run_ranks

ranks = run_ranks(2, preset="tiny", batch=1, steps=8, workers=1, pin=False)
print(f"tokens identical to naive over {ranks[0]['steps']} steps: {ranks[0]['tokens_match']}; "
      f"max error {max(ranks[0]['errors']):.1e}")
fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=[f"rank {r['rank']}" for r in ranks])
ops = sorted({op for r in ranks for op in r["timeline"]["op"]})
colour = {op: qualitative.Dark24[k % 24] for k, op in enumerate(ops)}
t0 = min(min(r["timeline"]["start_ns"]) for r in ranks)
for r in ranks:
    tl = pd.DataFrame(r["timeline"])
    for op, g in tl.groupby("op"):
        fig.add_trace(go.Bar(x=(g["end_ns"] - g["start_ns"]) / 1e3, base=(g["start_ns"] - t0) / 1e3, y=[0] * len(g),
                             orientation="h", marker_color=colour[op], name=op, legendgroup=op,
                             showlegend=r["rank"] == 0, hovertext=g["label"]), row=r["rank"] + 1, col=1)
    w = tl[tl["peer_wait_ns"] > 0]
    fig.add_trace(go.Bar(x=w["peer_wait_ns"] / 1e3, base=(w["start_ns"] - w["peer_wait_ns"] - t0) / 1e3,
                         y=[0.4] * len(w), orientation="h", marker_color="red", name="waiting on a peer",
                         legendgroup="wait", showlegend=r["rank"] == 0, hovertext=w["label"], width=0.25),
                  row=r["rank"] + 1, col=1)
fig.update_layout(barmode="overlay", height=420, title="tiny, 2 ranks x 1 worker: one measured step (µs)")
fig.update_yaxes(showticklabels=False)
fig.write_html(out / "ranks_timeline.html", include_plotlyjs=True)
fig.show()
for r in ranks:
    tl = pd.DataFrame(r["timeline"])
    span = tl["end_ns"].max() - tl["start_ns"].min()
    print(f"rank {r['rank']}: step {span / 1e3:.0f} µs, {tl['peer_wait_ns'].sum() / span:.0%} of it waiting on the "
          "peer (measured, last step)")

# %% [markdown]
# The benchmark (`python -m kimik3.megakernel.cpu_ranks`, committed under `data/measurements/` with its provenance)
# sets two ranks of one worker each against one process of two workers on the same weights. On one small CPU the
# ranks cannot win: each repeats the replicated work (router, latent down-projection, AttnRes mixes, the MLA cache
# append) and pays the pushes; the point of the measurement is that the protocol works at memory speed and what
# the waits cost.

# %%
rec = load_recorded()
bench_ranks = rec[rec["block"] == "step:ranks"] if "block" in rec else rec.iloc[:0]
if bench_ranks.empty:
    print("no ranks benchmark recorded yet (python -m kimik3.megakernel.cpu_ranks --out data/measurements/...)")
else:
    display(bench_ranks[["label", "preset", "batch_size", "world", "workers", "seconds", "p10_s", "p90_s"]])

# %% [markdown]
# **One rank of the rack, from its program: `k3-rank`.** The preset is rank 0 of full-depth K3 laid out as built
# (heads and experts over the same ranks), derived from `kimi-k3` and the rack: the most ranks of the 72 that split
# every dimension evenly, **32** (96 heads, 896 experts), so the rack holds two replicas. Its modules hold only the
# rank's share, so it instantiates on one H200 (MXFP4 experts) and on `meta` for the cost model. First where its
# bytes go: every rank holds the router, the latent down-projection and MLA's `q_a` / `kv_a` whole.

# %%
from kimik3.perf.cost import decode_cost
from kimik3.perfmodel import predict

rank_cfg = kimik3.get_preset("k3-rank")
W = rank_cfg.slice_world
rc = decode_cost("k3-rank", 1, 4096, expert_dtype="mxfp4").by_block
whole_rank = {"router", "moe_latent", "embed", "attn_res", "final_norm"}
by = rc.groupby("block")["weight_bytes"].sum().sort_values(ascending=False) / 1e9
display(by.rename("GB read per step, batch 1").round(3).to_frame())
held = {k: rank_cfg.held(k) for k in rank_cfg.split_dims()}
print(f"k3-rank (rank 0 of {W}; holds {held}): {rc['weight_bytes'].sum() / 1e9:.2f} GB of weights per step at "
      f"batch 1, of which the router and the latent projections (moe_latent: the down-projection whole, "
      f"the up-projection split) take {by[['router', 'moe_latent']].sum():.2f} GB")

# %% [markdown]
# Then its step under the performance model (the calibrated H200 constants, `python -m kimik3 predict --preset
# k3-rank --stage megakernel --batch 1,8` prints the same): the rank program's timeline, then the same timeline with
# each collective's wire time (assumed latency + pushed bytes over one direction of GB300 NVLink) delaying the peers'
# signals; tokens/s per sequence is one over that step. The **bandwidth bound** is the rank's bytes at the GB300's
# datasheet HBM bandwidth plus its wire bytes, no latency — a real ceiling. Context 4096 (the model's cache
# capacity). Which parts are measured: the local step only where a device check has run `k3-rank` alone on a GPU
# (`scripts/device_check.py`, phase `ranks`: the rank's program at batch 1 and 8, its peers' counter words credited
# and their pushes into a sink) — its recorded run then shows beside the model, its wire still modelled.

# %%
preds = [predict("k3-rank", "megakernel", b, context_len=4096) for b in rank_batches]
rows = []
for r in preds:
    k = r["rank"]
    rows.append({"batch": r["batch"], "local ms (model)": r["predicted_ms"],
                 "local range": "{:.2f}–{:.2f}".format(*r["predicted_ms_range"]),
                 "roofline ms (H200)": r["roofline_ms"], "serial wire ms": k["serial_wire_ms"],
                 "exposed wire ms": k["exposed_wire_ms"], "step ms": k["step_ms"],
                 "tok/s per sequence": k["tokens_per_s_per_sequence"],
                 "range": "{:.0f}–{:.0f}".format(*k["tokens_per_s_per_sequence_range"]),
                 "bound tok/s per sequence": k["bound_tokens_per_s_per_sequence"],
                 "rack tok/s": k["tokens_per_s_rack"]})
display(pd.DataFrame(rows).set_index("batch").round(3))
for part, how in preds[0]["rank"]["parts"].items():
    print(f"{part}: {how}")
measured = load_recorded()
measured = measured[(measured["block"] == "rank_step") & (measured.get("preset") == "k3-rank")] \
    if "preset" in measured else measured.iloc[:0]
if measured.empty:
    print("recorded k3-rank device runs: none yet (every figure above is modelled)")
else:  # the recorded local step (measured) with the wire added by the same model
    display(pd.DataFrame({"batch": measured["batch_size"], "device": measured["device"],
                          "local ms (measured)": measured["seconds"] * 1e3, "step ms (+ wire model)":
                          measured["nvl72_step_ms"], "tok/s per sequence": measured["nvl72_tokens_per_s_per_sequence"],
                          "commit": measured["commit"]}).set_index("batch"))

# %%
claims = speed_claims(("gb300",))
b1 = next((r for r in preds if r["batch"] == 1), preds[0])
k = b1["rank"]
lo, hi = k["tokens_per_s_per_sequence_range"]
point = k["tokens_per_s_per_sequence"]
names = [f"published: {c['label']}" for _, c in claims.iterrows()] + [
    f"k3-rank bandwidth bound (GB300 HBM + wire bytes, batch {b1['batch']})",
    f"k3-rank predicted (model: H200-speed rank + NVL72 wire, batch {b1['batch']})"]
values = list(claims["per_user"]) + [k["bound_tokens_per_s_per_sequence"], point]
colours = ["#7f7f7f"] * len(claims) + ["#2ca02c", "#1f77b4"]
above = [0.0] * (len(values) - 1) + [hi - point]  # the prediction's range; the others are single figures
below = [0.0] * (len(values) - 1) + [point - lo]
m1 = measured[measured["batch_size"] == b1["batch"]].tail(1)
if not m1.empty:  # the latest recorded run at that batch: measured rank + modelled wire, with its range
    rec = m1.iloc[0]
    mlo, mhi = rec["nvl72_tokens_per_s_per_sequence_range"]
    names.append(f"k3-rank predicted (measured rank on {rec['device']} + NVL72 wire model, batch {b1['batch']})")
    values.append(rec["nvl72_tokens_per_s_per_sequence"])
    colours.append("#d62728")
    above.append(mhi - values[-1])
    below.append(values[-1] - mlo)
fig = go.Figure(go.Bar(x=values, y=names, orientation="h", marker_color=colours,
                       error_x=dict(type="data", symmetric=False, array=above, arrayminus=below)))
fig.update_layout(title=f"K3 on GB300 NVL72, tokens/s per sequence: rank 0 of {W} from its own program",
                  xaxis_title="tokens/s per sequence", height=360, margin=dict(l=440))
fig.write_html(out / "k3_rank_prediction.html", include_plotlyjs=True)
fig.show()
published = float(claims["per_user"].max())
bound = k["bound_tokens_per_s_per_sequence"]
print(f"bound {bound:.0f} tok/s per sequence vs the published {published:.0f}: "
      + ("below it — with the router and the latent down-projection whole on every rank this layout cannot reach "
         "the claim at any schedule" if bound < published else "above it")
      + f"; the predicted step ({k['step_ms']:.2f} ms) is the schedule's, {k['step_ms'] / k['bound_ms']:.1f}x that "
      "bound")

# %% [markdown]
# The K3 rank program's collectives, as the wire model reads them off the program (one row each):

# %%
from kimik3.perfmodel import scored_program
from kimik3.scale.wire import collective_table

display(collective_table(scored_program("k3-rank", rank_batches[0])).drop(columns="counter").head(6))

# %% [markdown]
# The program needs no all-to-all: after each all-reduce every rank holds every token, so the experts need no
# dispatch and the combine is a latent-width sum. What is left on the wire per collective is one row per sequence
# per peer (a hidden vector in bf16, or the latent sum in fp32) — latency, not bandwidth, which is why the
# collectives live inside the launch, and why the local schedule (here far from its bandwidth bound) decides how
# much of it hides.

# %%
print(sorted(p.name for p in out.glob("*.html")))

# %% [markdown]
# **Caveats.** Uniform routing (trained routers are skewed; expert-load balancing and redundant experts change the
# busiest GPU), datasheet bandwidths at 100 %, assumed collective latencies (swept above), no speculative decoding,
# no prefill interference, TP of 96 heads over 72 GPUs treated as an even split, and the per-layer all-reduce /
# all-to-all counts of the stated layouts (other layouts, e.g. attention TP within a tray and DP across trays, sit
# between the curves shown). The single-GPU numbers are the cost-model bound until the GPU measurements listed in
# `data/measurements/gpu_outstanding.json` are taken.
