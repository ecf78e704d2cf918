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
# # 08 · Design and evidence at a glance
#
# Code written faster than people can review it line by line stays honest when each change is isolated, its scope
# bounded and its validation systematic: a reviewer then judges the *design and the evidence*, starting from a
# high-level view. This notebook is that view for kimik3 (`kimik3.evidence`, `kimik3.scope`;
# docs/architecture.md §13):
#
# 1. **scope gates** — what each fast path supports, declared as data; every reason a request is refused, at once;
# 2. **units** — every fused kernel, megakernel opcode family, the VM, each stage, the CPU executor and each
#    contract, derived from the code with its files and source hash;
# 3. **dossiers** — per unit: Scope, Contract, Launch, Numerics, Validation, Performance, and what is *Unproven*;
# 4. **a bounded review** — the units a change touches, whose evidence it leaves stale, exactly their checks.
#
# Validation results come from `runs/test-results.json`, which `make test` writes: run it first to see them here.

# %% tags=["parameters"]
focus = "megakernel/moe"  # the unit whose dossier section 3 shows
since = "HEAD"  # the revision section 4 reviews the working tree against
out_dir = "runs/08_evidence"

# %%
from kimik3.notebook.runner import check_params

check_params(dict(focus=focus, since=since), "08_evidence")

# %%
import pandas as pd
import plotly.graph_objects as go
import torch
from IPython.display import Markdown, display

import kimik3
from kimik3.evidence.cli import build
from kimik3.evidence.dossier import status, to_markdown
from kimik3.evidence.page import COLOURS
from kimik3.notebook.start import start_notebook
from kimik3.scope import Request, config_features
from kimik3.scope.gates import GATES

out = start_notebook(out_dir, pandas_display={"width": 220, "max_columns": 30, "max_colwidth": 90}).out

# %% [markdown]
# ## 1 · Scope gates
#
# A config's **features** are read from its fields, one readable value each; every `ModelConfig` field is reviewed
# once in `kimik3/scope/features.py`, and a field nobody reviewed refuses everywhere (fail closed). Each fast path's
# gate (`kimik3/scope/gates.py`) lists the values it implements. Below: K3, DeepSeek-V3 and Kimi-Linear through
# every gate, as a bf16 batch-8 request on an H200-class GPU (`megakernel-cpu` and `megakernel-interp` are asked on
# the CPU).

# %%
presets = ["kimi-k3", "deepseek-v3", "kimi-linear-48b-a3b"]
display(pd.DataFrame({p: config_features(kimik3.get_preset(p)) for p in presets}))
rows = []
for p in presets:
    cfg = kimik3.get_preset(p)
    for name in ("fused", "megakernel", "megakernel-cpu", "megakernel-interp"):
        dev = "cpu" if name in ("megakernel-cpu", "megakernel-interp") else "cuda"
        req = Request(dtype=torch.bfloat16, device=dev, batch=8, context=4096,
                      arch="sm_90a" if dev == "cuda" else None, sms=132 if dev == "cuda" else None)
        reasons = GATES[name].refuse(cfg, req)
        rows.append({"model": p, "fast path": name, "verdict": "runs" if not reasons else f"{len(reasons)} reason(s)",
                     "reasons": "; ".join(reasons)})
display(pd.DataFrame(rows))

# %% [markdown]
# What a user sees is the same text: the stage builds only through its gate, and the error lists every reason.

# %%
try:
    kimik3.Decoder(kimik3.from_preset("micro", seed=0, dtype=torch.bfloat16), stage="megakernel-cpu", batch_size=65,
                   max_seq_len=16, experts="fp8")
except ValueError as e:
    print(e)

# %% [markdown]
# ## 2 · Units and their status
#
# Each row is one unit; its status says at a glance whether its checks ran green on its current source, whether
# they are stale (the source changed since), and what only a GPU can still show. The page of the same table, each
# row linking to its dossier, is written beside this notebook (`evidence/index.html`).

# %%
ds, notes, meta = build(out / "evidence")
table = pd.DataFrame([{"unit": d["unit"], "kind": d["kind"], "status": status(d),
                       "lines": sum(f["lines"] for f in d["Scope"]["files"]),
                       "test modules": len(d["Validation"]["tests"]),
                       "planted mutants": len(d["Validation"]["mutants"]), "unproven": len(d["Unproven"])}
                      for d in ds])
display(table)
print(f"commit {meta['commit']}, {meta['recorded_tests']} recorded test results; notes: {notes or 'none'}")

# %%
kinds = list(dict.fromkeys(table["kind"]))
fig = go.Figure()
for st, colour in COLOURS.items():
    counts = [int(((table["kind"] == k) & (table["status"] == st)).sum()) for k in kinds]
    if any(counts):
        fig.add_bar(name=st, x=kinds, y=counts, marker_color=colour, marker_line_color="#555", marker_line_width=1)
fig.update_layout(barmode="stack", title="Units by kind and status", xaxis_title="kind of unit",
                  yaxis_title="units", height=420, legend_title="status")
fig.write_html(out / "units_by_status.html", include_plotlyjs=True)
fig.show()

# %% [markdown]
# ## 3 · One dossier
#
# The sections every unit has: what it is and may touch (Scope, with its gate), the tensors in and out (Contract,
# read from the code), its launch shape from the compile reports, the reference and tolerance it is held to, every
# test, host-execution case and planted mutant behind it with its last result, the modelled and measured
# performance, and what is still unproven — never silently empty.

# %%
one = next((d for d in ds if d["unit"] == focus), None)
if one is None:
    raise ValueError(f"focus {focus!r} is not a unit; units: {', '.join(d['unit'] for d in ds)}")
display(Markdown(to_markdown(one)))

# %% [markdown]
# ## 4 · A bounded review
#
# `python -m kimik3 evidence --since REV` lists the units a diff touches, which of their evidence is stale, and the
# exact checks to run (`--run` runs them); a change that reaches past the scope it declares (`--scope`, or an
# `Evidence-Scope:` trailer in its commits) is flagged. Here: the working tree against `since`.

# %%
from kimik3.evidence.review import review

rv = review(since)
for line in rv.lines():
    print(line)
