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
# # 01 · Naive decode: the Kimi K3 architecture, one block at a time
#
# This is the first rung of the ladder. We load a model (the `tiny` preset by default: every K3 feature at small
# widths, ~84M parameters), walk through its blocks with their real shapes and cache sizes, run one decode step
# with hooks on every block, and count how many operators (kernel launches, on a GPU) one token costs when the
# decode step is written the obvious way — the `naive` stage that every later stage is checked against.
#
# Section numbers (§) refer to `docs/architecture.md`.

# %% tags=["parameters"]
preset = "tiny"        # any kimik3 preset small enough for the device ("micro" for a quick look)
device = "auto"        # "auto": the GPU when one is present, else the CPU
batch_size = 2
prompt_len = 16
new_tokens = 8
seed = 0
out_dir = "runs/01_naive_decode"
solutions = False  # workshop: True checks the reference solutions instead of your answers (make run does)


# %%
# a bad parameter (papermill -p, or an edit above) stops here with its name, not deep inside a later cell
from kimik3.notebook.runner import check_params

check_params(dict(preset=preset, device=device, batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
                  seed=seed), "01_naive_decode")

# %%

import plotly.express as px
import torch

import kimik3
from kimik3.model.anatomy import block_table, cache_bytes_per_sequence, layer_map, layer_map_figure, trace_step
from kimik3.notebook.start import start_notebook
from kimik3.perf.profiling import count_ops, time_per_call

# plotly renders with no network (plotly.js embedded once, no CDN); figures go to `out`;
# `dev`: the GPU when one is present, else the CPU; `dtype`: bf16 on a GPU, fp32 on a CPU
out, dev, dtype = start_notebook(out_dir, device)
model = kimik3.from_preset(preset, seed=seed, dtype=dtype, device=dev)
cfg = model.config
print(f"{preset}: {model.num_parameters() / 1e6:.1f}M parameters on {dev} in {dtype}")

# %% [markdown]
# ## The layer pattern
#
# K3 has 93 layers: 69 **KDA** (Kimi Delta Attention, a gated linear-attention recurrence with a fixed-size state)
# and 24 **MLA** (multi-head latent attention without positional encoding, with a compressed latent KV cache),
# in a 3:1 pattern that ends in MLA (§1.1). Layer 0 has a dense MLP; every other layer a **LatentMoE**
# (896 experts, top-16, computed in a 3584-wide latent space, §5.3). The residual stream is replaced by
# **Attention Residuals** (§2): each layer mixes, with a softmax over depth, the sums of completed blocks of
# layers. The presets keep the same pattern in proportion.

# %%
fig = layer_map_figure(cfg)
fig.write_html(out / "layer_map.html")
fig.show()
layer_map(cfg).set_index("layer").T

# %% [markdown]
# ## Parameters per block
#
# Every table here is read off the model's own modules. The routed experts dominate the parameter count, but a
# decode step only reads the experts its tokens select — the theme of notebook 02.

# %%
table = block_table(model)
per_block = table.groupby("block")[["params", "bytes"]].sum().sort_values("params", ascending=False)
per_block["share %"] = 100 * per_block["params"] / per_block["params"].sum()
fig = px.bar(per_block.reset_index(), x="block", y="params", title=f"{preset}: parameters per block")
fig.write_html(out / "params_per_block.html")
fig.show()
per_block

# %%
# one KDA layer, one MLA layer and one MoE layer, tensor by tensor (fp32 tensors per spec: A_log, dt_bias, conv, o_norm)
kda_layer, mla_layer = cfg.kda_layers[1], cfg.mla_layers[0]
block_table(model, layer=kda_layer).query("block in ['kda']")[["parameter", "shape", "dtype", "params"]]

# %%
mla_blocks = ["mla", "router", "latent down/up/norm", "routed experts", "shared experts"]
block_table(model, layer=mla_layer).query("block in @mla_blocks")[["block", "parameter", "shape", "dtype", "params"]]

# %% [markdown]
# ## What a sequence carries between steps
#
# A KDA layer keeps a fixed-size fp32 state per head (`dk × dv`) plus the last three raw projections for its
# short convolution; an MLA layer caches one latent vector (`kv_lora_rank`) and one shared key part
# (`qk_rope_head_dim`) per token (§4.3). AttnRes carries nothing across steps. Below: this preset, and the full
# K3 (instantiated on the `meta` device: shapes without memory).

# %%
import pandas as pd

contexts = [1, 1024, 8192, 32768, 131072]
k3 = kimik3.build_model("kimi-k3", "meta")
rows = []
for name, m in ((preset, model), ("kimi-k3", k3)):
    for T in contexts:
        for _, r in cache_bytes_per_sequence(m, T).iterrows():
            rows.append({"model": name, "context": T, "state": r["state"], "MB": r["MB"]})
caches = pd.DataFrame(rows)
fig = px.line(caches, x="context", y="MB", color="state", facet_col="model", log_x=True, markers=True,
              title="decode state per sequence")
fig.update_yaxes(matches=None)
fig.write_html(out / "cache_sizes.html")
fig.show()
caches.pivot_table(index=["model", "state"], columns="context", values="MB").round(2)

# %% [markdown]
# ## One decode step, traced
#
# Prefill a batch of random prompts (right-padded to different lengths: padding never touches a cache), then run
# one `step` with a forward hook on every block. The table lists each block call in execution order with its input
# and output shapes: `[B, 1, H]` activations through every layer, the MoE flattened to `[B, H]` tokens.

# %%
g = torch.Generator().manual_seed(seed)
ids = torch.randint(0, cfg.vocab_size, (batch_size, prompt_len), generator=g).to(dev)
lengths = [prompt_len - i % 3 for i in range(batch_size)]
dec = kimik3.Decoder(model, stage="naive", batch_size=batch_size, max_seq_len=prompt_len + 2 * new_tokens + 4)
logits = dec.prefill(ids, lengths=lengths)
nxt = logits.argmax(-1)
trace = trace_step(model, lambda: dec.step(nxt))
print(f"{len(trace)} block calls in one step")
trace.head(24)

# %%
tokens = dec.generate(ids, max_new_tokens=new_tokens, lengths=lengths)
for b in range(batch_size):
    n = lengths[b]
    print(f"sequence {b}: prompt {ids[b, :n].tolist()[-6:]} ... -> {tokens[b, n:n + new_tokens].tolist()}")

# %% [markdown]
# ### Exercise: attention over the cache
#
# Each MLA head of one decode step is a single query against every cached position: scores q·k, scaled by
# 1/√d, a softmax over the positions, and a weighted sum of the values. Write it for one step (all heads at once);
# the check runs it on random tensors and names the usual mistakes.

# %%
from kimik3.notebook import workshop


def attend(q, k, v):
    """q [H, d], k [T, H, d], v [T, H, dv] -> [H, dv]."""
    raise NotImplementedError("your code here")


# %%
workshop.check("decode_attention", attend, solutions=solutions)
# workshop.reveal("decode_attention")  # uncomment to see a solution

# %% [markdown]
# ## Operators (kernel launches) per token
#
# `torch.profiler` counts the top-level ATen operators of each decode step (on a GPU it counts the CUDA kernels
# themselves). Each one is a separate kernel launch in eager mode: this is the overhead the later stages remove —
# first with CUDA graphs and `torch.compile`, then with fused kernels, finally with one launch per step.
# The Chrome/Perfetto trace is written to the run folder (open it in `chrome://tracing` or ui.perfetto.dev).

# %%
dec.prefill(ids, lengths=lengths)
state_ids = logits.argmax(-1)
ops = count_ops(lambda: dec.step(state_ids), calls=min(new_tokens, 4), trace_path=out / "naive_decode_trace.json",
                warmup=1)
t = time_per_call(lambda: dec.step(state_ids), repeats=3, warmup=1, device=dev)
print(f"backend: {ops.backend}; {ops.operators_per_call:.0f} operators and {ops.launches_per_call:.0f} "
      f"{'CUDA kernels' if ops.backend == 'torch-cuda' else 'top-level operators'} per decode step "
      f"({cfg.num_hidden_layers} layers, batch {batch_size})")
print(f"trace: {ops.trace_path}")
if t is not None:
    print(f"time per step: {t}")
fig = px.bar(ops.by_name.head(20), x="operator", y="count", title="most frequent operators over the profiled steps")
fig.write_html(out / "naive_operators.html")
fig.show()

# %% [markdown]
# ## What we have
#
# A faithful, slow reference: it matches transformers' DeepSeek-V3 and Kimi-Linear models and the logits of
# Moonshot's released K3 code (see `tests/`), and it costs hundreds of operator launches per token. Notebook 02
# asks what a step *must* cost (bytes and FLOPs), notebook 03 starts removing what it need not.
