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
# # 04 · Fused kernels: one decode step from hand-written CuTe DSL kernels
#
# Notebook 03 took PyTorch as far as it goes: the absorbed step, captured as a CUDA graph or compiled. It is still a few
# hundred small kernels per token, most of them re-reading an activation the previous one just wrote. The **fused**
# stage (`kimik3/stages/fused.py`, its plan in `kimik3/fused/plan.py`) composes the step from the decode kernels in
# `kernels/fused/` (`kernels/README.md`), each one built around the only thing that matters at small batch: **streaming
# weight bytes at full bandwidth, with the cheap work done on the bytes already in registers.**
#
# One section per kernel: the idea, the code (from `kernels/`), PTX highlights compiled here for `sm_90a` (the DSL
# carries its own NVVM and ptxas, no GPU needed), the register / shared-memory report, the bytes one call moves (from
# the kernel's own shapes) and where that puts it on the roofline. Then the composed step and the ladder so far.
#
# **Status.** Everything here compiles and is checked on a CPU: the composition (each kernel replaced by its
# PyTorch reference) matches the model, and every launch matches its compiled signature
# (`tests/test_fused_stage.py`). **No kernel has run on a GPU yet**: every time below is an analytic bound unless
# it is labelled *recorded*; the GPU measurements issue 5 asks for are listed in
# `data/measurements/gpu_outstanding.json` and are taken by `bash scripts/device_check.sh` on a lent GPU.
#
# Run headless: `papermill notebooks/04_fused_kernels.ipynb out.ipynb -p compile_kernels False -p out_dir /tmp/run04`
# (`compile_kernels=False` shows PTX from a cached build if there is one, else says compilation was skipped).

# %% tags=["parameters"]
compile_kernels = True
preset = "k3-shard"
out_dir = "runs/04_fused_kernels"
batch = 1
context = 1024
solutions = False  # workshop: True checks the reference solutions instead of your answers (make run does)


# %%
# a bad parameter (papermill -p, or an edit above) stops here with its name, not deep inside a later cell
from kimik3.notebook.runner import check_params

check_params(dict(preset=preset, batch=batch, context=context), "04_fused_kernels")

# %%
import json

import pandas as pd
import plotly.graph_objects as go
import torch
from IPython.display import Markdown, display
from kimik3.kernels.toolchain.loader import dsl_available

from kimik3.fused.launch_cost import launch_bytes, launch_flops
from kimik3.fused.plan import FusedStep
from kimik3.model.config import get_preset
from kimik3.model.random_init import build_model
from kimik3.notebook.kernel_report import KernelReport, ptx_highlights, show_source
from kimik3.notebook.start import start_notebook
from kimik3.perf.hardware import get_hardware
from kimik3.perf.recorded import load_recorded, resolve_data_path
from kimik3.perf.roofline import roofline_figure, save_html

# plotly renders with no network (plotly.js embedded once, no CDN); figures go to `out`
out = start_notebook(out_dir, pandas_display={"width": 200, "max_columns": 20, "max_colwidth": 80}).out
ARCH = "sm_90a"
H200 = get_hardware("h200")
cfg = get_preset(preset)
# The step's program on a meta model: every buffer and prepared weight has its real shape, none has memory.
step = FusedStep(build_model(cfg, "meta").cast_(torch.bfloat16), batch, 4096 if preset == "k3-shard" else 256)
program = step.describe(context=context)
recorded = load_recorded("data/measurements")
outstanding = json.loads(resolve_data_path("data/measurements/gpu_outstanding.json").read_text())["outstanding"]
HAVE_DSL = dsl_available()
# every kernel section below: source, PTX highlights and ptxas resources, bytes per call, recorded measurements
report = KernelReport(step, arch=ARCH, compile_kernels=compile_kernels, batch=batch, context=context, preset=preset,
                      hardware=H200, recorded=recorded, have_dsl=HAVE_DSL)
print(f"{cfg.name}, batch {batch}, context {context}: {sum(program.kind == 'kernel')} kernel launches, "
      f"{sum(program.kind == 'glue')} glue ops, {len(step.ops)} distinct compiled ops; CuTe DSL installed: {HAVE_DSL}; "
      f"compile_kernels={compile_kernels}; recorded measurements: {len(recorded)}")

# %% [markdown]
# ## The composed step
#
# Every launch of one decode step, in order. *kernel* rows are the CuTe DSL ops (several launches share one compiled
# op when their shapes agree: the KDA and MLA o-proj, the four MoE layers' routers ...); *glue* rows are the few
# PyTorch ops left between them (embedding gather, the RMSNorm that the router and expert kernels need as input,
# the MLA latent norm + cache append, the MLA output gate, residual adds). Bytes are the fewest the launch must
# move, from its own shapes (`kimik3.fused.launch_cost.launch_bytes`: routed experts counted only for the experts a
# uniform routing is expected to touch; MLA reading `context` cache rows).

# %%
view = program[["launch", "kind", "family", "bytes", "flops", "note"]].copy()
view["MB"] = view["bytes"] / 1e6
view["µs at H200 BW"] = view["bytes"] / H200.hbm_bandwidth * 1e6
display(view.drop(columns=["bytes", "flops"]).round(3))
by = program.groupby("kind")["bytes"].sum()
print(f"kernels {by.get('kernel', 0) / 1e9:.3f} GB, glue {by.get('glue', 0) / 1e6:.2f} MB per step; "
      f"bound at {H200.hbm_bandwidth / 1e12:.1f} TB/s: {program['bytes'].sum() / H200.hbm_bandwidth * 1e3:.3f} ms")
fig = go.Figure()
for kind, color in (("kernel", "#1f77b4"), ("glue", "#d62728")):
    d = program[program.kind == kind]
    fig.add_trace(go.Bar(x=d["launch"], y=d["bytes"] / 1e6, name=kind, marker_color=color,
                         hovertext=d["note"], hovertemplate="%{x}<br>%{y:.3f} MB<br>%{hovertext}<extra></extra>"))
fig.update_yaxes(type="log", title="MB moved per call (log)")
fig.update_layout(title=f"{cfg.name}: bytes per launch of one fused decode step (B={batch}, context {context})",
                  template="plotly_white", height=480, xaxis_tickangle=-60)
save_html(fig, out / "step_bytes_per_launch.html")
fig

# %% [markdown]
# ## 1 · GEMV with the RMSNorm fused in (`gemv.rmsnorm`, also `plain`, `residual`)
#
# At batch 1 a projection is a matrix-vector product: every weight byte is used for exactly one multiply-add per
# token, so the kernel is a memory copy with arithmetic hidden in it. The design (guide §2, §3.1):
#
# * **one warp per output row**; lane `l` owns the 16-byte chunks `l, l+32, ...` of the row, so one warp-wide load
#   reads 512 contiguous bytes (`ld.global.nc.v4`, the read-only path);
# * **loads in flight**: each loop step issues all `UNROLL = 7` weight loads per lane before the first FMA and keeps
#   them packed (one chunk widened to fp32 at a time) — 112 bytes per lane, 14 KiB per CTA — and the kernel is
#   compiled for 4 resident CTAs per SM (`.minnctapersm`), ~56 KiB in flight per SM;
# * **no tile padding at small batch**: each token is one fp32 accumulator per warp; up to 16 tokens share one pass
#   over the weights (larger batches are split into tiles on the fastest grid dimension, so the CTAs re-reading the
#   same rows run together and hit L2);
# * **the norm is free**: Σx² is accumulated from the very x chunks each warp loads for the dot product, and
#   rstd is applied once to the finished row sum — no separate RMSNorm kernel, no normalised copy of x. The
#   `residual` variant adds the residual stream in the epilogue (o-proj writes `p + o·Wᵀ` in place).

# %%
from kimik3.kernels.fused import gemv

report.section("L0.kda.qkv", gemv.gemv_kernel, gemv.row_dot, gemv._dot_step)

# %% [markdown]
# ### Exercise: a GEMV tile's index arithmetic
#
# In `gemv`, a CTA of 4 warps computes 4 output rows, one per warp; each loop step a lane issues 4 unrolled
# 16-byte loads (8 bf16 each). Which element (row, k) of W does thread (cta, warp, lane) load at step `step`,
# unrolled load `u`, vector element `v`? The check enumerates every thread: each element read exactly once, one row
# per warp, and every warp-wide load contiguous (coalesced).

# %%
from kimik3.notebook import workshop


def gemv_element(cta, warp, lane, step, u, v):
    """(row, k) of W loaded by this thread; 4 warps per CTA, 4 loads per step, 8 elements per load, 32 lanes."""
    raise NotImplementedError("your code here")


# %%
workshop.check("gemv_tile_index", gemv_element, solutions=solutions)
# workshop.reveal("gemv_tile_index")  # uncomment to see a solution

# %% [markdown]
# ## 2 · Final norm + lm_head + arg-max (`gemv.lm_head`)
#
# The largest single weight of a k3-shard step (163,840 × 7,168 bf16 = 2.35 GB). Each warp walks 8 vocabulary rows,
# the RMSNorm scale is computed once per warp, fp32 logits are written (the stage returns them), and a per-CTA
# arg-max goes through 256 bytes of shared memory with one barrier; a second tiny kernel reduces the per-CTA partials
# (ties → lowest token id, deterministic, no atomics).

# %%
report.section("lm_head", gemv.lm_head_kernel, gemv.argmax_kernel)

# %% [markdown]
# ## 3 · Router: sigmoid scores, biased top-k, on the device (`router`)
#
# The gate GEMV with a sigmoid epilogue, then one warp per token keeps ⌈E/32⌉ scores per lane and runs k rounds of
# "local arg-max, butterfly arg-max across the warp, the owner retires the winner" (guide §4). The expert ids and
# renormalised weights never leave the GPU: the MoE kernel reads them directly, so there is no host sync and the
# step stays capturable as one CUDA graph.

# %%
from kimik3.kernels.fused import router

report.section("L0.moe.router", router.topk_kernel)

# %% [markdown]
# ## 4 · KDA decode step (`kda`)
#
# Everything of one KDA head for one token in one 256-thread CTA: the short conv over the projection history
# (shifted in place), SiLU, the per-channel decay gate, l2 norms, the gated delta rule on the fp32 state and the
# gated RMSNorm of the output. The state (dk × dv × 4 bytes per head, 64 KiB at K3 widths) is the cost: each thread
# loads its 16 × 4 block with back-to-back `ld.global.v4.f32`, decays it, updates it and stores it once. The read of
# the updated state needs no second pass: o = p + (q·k̂)·δ.

# %%
from kimik3.kernels.fused import kda

report.section("L0.kda.step", kda.kda_kernel)

# %% [markdown]
# ## 5 · MLA in the latent space: flash-decoding split + combine (`mla`), absorption as a per-head GEMV
#
# With the weights absorbed (spec §4.4) all 96 heads attend over one shared cache row per token of
# `kv_lora + rope = 576` values (1,152 bytes), so the cache is read once for all heads. The split kernel gives each
# CTA a slice of the sequence and 2 heads per warp, loads 4 cache rows before any math, and keeps an online softmax
# in the log2 domain (`ex2.approx`); the combine kernel merges the per-split (m, l, o) partials.
#
# The absorption itself, q_lat = W_UKᵀ q_nope and o = W_UV o_lat, is a GEMV whose weight differs per head. It reuses the
# MoE expert kernel with a constant routing (head h = expert h; `kernels/fused/moe.py: head_gemv`). The W_UK weight is
# augmented with an identity block for the 64 rope dimensions, so one launch writes the complete MLA query `[q_lat ;
# q_rope]` (8.6 MB more weight read per MLA layer, no copy kernel).

# %%
from kimik3.kernels.fused import mla_decode, moe

report.section("L3.mla.attn", mla_decode.mla_split_kernel, mla_decode.mla_combine_kernel)
report.section("L3.mla.w_uk", moe.head_gemv)

# %% [markdown]
# ## 6 · Routed experts: grouped GEMV over the selected experts only (`moe.bf16`, `moe.mxfp4`)
#
# Four kernels in one op: *align* (one warp sorts the B·k (token, slot) pairs by expert with `match.any.sync`, no
# atomics), *gate/up* (a warp owns row i of w1 and w3 of one active expert and walks that expert's tokens in tiles:
# each expert's weights are streamed once per tile, never once per token; SiTU-GLU in fp32), *down*, and the fp32
# *combine*. Grid slots past the number of active experts exit at once: at batch 1 only the 16 selected experts of
# 56 are read.
#
# MXFP4 (`expert_format="mxfp4"`, packed once at stage construction): one 16-byte load is exactly one 32-column scale
# group; the E2M1 codes are expanded in registers by masking them into fp16 (`(c & 7) << 9`, exact) and the group
# scale (a power of two: exact) is folded into the expanded weights — 4.25 bits per weight read instead of 16. Dense
# MLPs and the shared experts run through the same kernel as a one-expert MoE that every token picks with weight 1.

# %%
report.section("L0.moe.experts", moe.expert_gemv_kernel, moe._bf16_step)

# %%
from dataclasses import replace

from kimik3.kernels.common import (
    device as _common,  # the MXFP4 decode helpers the fused MoE kernel shares with the megakernel
)

ln16 = report.launch("L0.moe.experts")
op4 = replace(ln16.op, family="moe.mxfp4")
res4, how4 = report.build(op4)
display(Markdown(f"**MXFP4 variant** `{op4.name}` — *PTX / ptxas*: {how4}"))
show_source(_common.fp4_expand, moe._fp4_step)
if res4 is not None:
    display(ptx_highlights(res4["ptx"]))
    display(pd.DataFrame(res4["kernels"])[["name", "registers", "spill_stores", "stack", "shared_bytes"]])
E, k = ln16.op.shapes["E"], ln16.op.shapes["topk"]
w16 = sum(ln16.args[n].numel() * 2 for n in ("w1", "w3", "w2")) / E
print(f"per expert: {w16 / 1e6:.1f} MB in bf16, {w16 * 4.25 / 16 / 1e6:.1f} MB in MXFP4 "
      f"(bytes ratio {4.25 / 16:.3f} by construction; the time ratio is a GPU measurement, outstanding unless "
      "recorded)")
rec4 = recorded[recorded["block"].isin(["experts:bf16", "experts:mxfp4"])] if not recorded.empty else recorded
display(rec4 if not rec4.empty else Markdown("*MXFP4 vs bf16 expert time*: **GPU measurement outstanding**."))

# %% [markdown]
# ## 7 · Attention Residuals mix (`attn_res`)
#
# K3 replaces the additive residual with a softmax over depth of the block sums (spec §2.2). One CTA per token: all
# candidates' chunks are loaded up front and kept in registers (≤ 4 candidates), Σv² and Σv·ω are reduced with one
# barrier, the softmax over the few candidates is recomputed per thread, and the mix reuses the registers: every
# candidate byte is read once. In the fused step the candidates live in one `[slots + 1, B, H]` buffer, so every mix
# reads a contiguous prefix and a block boundary needs no copy.

# %%
from kimik3.kernels.fused import attn_res

report.section("L0.attn_res.mlp", attn_res.attn_res_kernel)

# %% [markdown]
# ## Roofline position of every kernel
#
# Each distinct op of the step at its analytic bound on an H200 (bytes ÷ datasheet bandwidth, or FLOPs ÷ peak if
# larger): all of them sit far left of the ridge point, i.e. bandwidth-bound, which is why bytes per call is the
# number every section reports. Recorded kernel measurements (if any) are added as diamonds, labelled with their
# date and commit.

# %%
pts = []
for key, op in step.ops.items():
    ln = next(x for x in step.program if x.op is not None and x.op.key == key)
    b, f = launch_bytes(ln, context=context), launch_flops(ln, context=context)
    if b > 0 and f > 0:
        t = max(b / H200.hbm_bandwidth, f / H200.compute_ceiling("bf16")[0])
        pts.append({"label": ln.name, "block": op.family, "stage": "fused kernels", "kind": "analytic", "flops": f,
                    "bytes": b, "seconds": t, "hardware": H200.name})
pts = pd.DataFrame(pts)
pts["intensity"] = pts["flops"] / pts["bytes"]
pts["flops_per_s"] = pts["flops"] / pts["seconds"]
kern_rec = recorded[recorded["block"].astype(str).str.startswith("kernel:")] if not recorded.empty else recorded
if not kern_rec.empty:
    kr = kern_rec.dropna(subset=["flops", "bytes", "seconds"])
    pts = pd.concat([pts, pd.DataFrame({"label": kr["label"] + " " + kr["block"], "block": kr["block"],
                                        "stage": "fused kernels", "kind": "recorded", "flops": kr["flops"],
                                        "bytes": kr["bytes"], "seconds": kr["seconds"],
                                        "hardware": kr["device"]})], ignore_index=True)
    pts["intensity"] = pts["flops"] / pts["bytes"]
    pts["flops_per_s"] = pts["flops"] / pts["seconds"]
fig = roofline_figure(pts, hardware=("h200",), recorded=False, label_points=False,
                      title=f"{cfg.name} fused kernels at their bound on an H200 (B={batch}, context {context})")
save_html(fig, out / "kernels_roofline.html")
fig

# %% [markdown]
# ## The ladder so far
#
# Recorded whole-step times (`data/measurements/*.json`, block `step`) for this preset, next to the analytic bound of
# the step. Stage `fused` is the row this notebook is about; `compiled` is the strongest PyTorch-only peer.

# %%
from kimik3.perf.cost import decode_cost

steps = recorded[(recorded["block"] == "step") & (recorded["preset"] == cfg.name)] if not recorded.empty else recorded
bound = {b: decode_cost(cfg, b, context).total_bytes / H200.hbm_bandwidth * 1e3 for b in (1, 8)}
print("analytic bound (bytes / H200 datasheet bandwidth): " + ", ".join(f"B={b}: {v:.3f} ms" for b, v in bound.items()))
if steps.empty:
    display(Markdown("**No recorded GPU step times yet.** Outstanding (`data/measurements/gpu_outstanding.json`):"))
    display(pd.DataFrame(outstanding)[["id", "status", "reason", "what"]])
else:
    ladder = steps.pivot_table(index="stage", columns="batch_size", values="seconds", aggfunc="median") * 1e3
    order = [s for s in ("naive", "absorbed", "graphs", "compiled", "fused") if s in ladder.index]
    display(ladder.loc[order].round(3).rename(columns=lambda b: f"ms/token B={b}"))
    display(steps[["label", "device", "stage", "batch_size", "seconds"]])
    fig = go.Figure()
    for b in sorted(steps["batch_size"].unique()):
        d = steps[steps["batch_size"] == b]
        fig.add_trace(go.Bar(x=d["stage"], y=d["seconds"] * 1e3, name=f"B={b}", text=d["label"]))
    fig.update_layout(title=f"{cfg.name}: recorded ms per token", template="plotly_white", yaxis_title="ms")
    save_html(fig, out / "ladder.html")
    display(fig)

# %% [markdown]
# ## Running it on a GPU
#
# ```python
# model = kimik3.from_preset("k3-shard", dtype=torch.bfloat16, device="cuda")
# dec = kimik3.Decoder(model, "fused", batch_size=1, max_seq_len=1024)            # or expert_format="mxfp4"
# ```
# Kernels come from the CuTe DSL JIT when it is installed next to the GPU, else from a prebuilt directory
# (`prebuilt=DIR` or `$KIMIK3_PREBUILT`, built on a CPU machine with
# `python scripts/device_check.py --build-prebuilt prebuilt`). On a CPU, for a shape without a kernel (`micro`'s
# head dim 16) or without a usable prebuilt kernel for the GPU's architecture, the stage refuses with a ValueError
# that says why. The measurements issue 5 asks for come from one device-tool call: `bash scripts/device_check.sh`
# (its header has the exact command and the carry list).
