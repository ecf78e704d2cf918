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
# # 06 · Validation: the whole space, every stage, one oracle
#
# Every notebook so far made one change to the decode step — absorb the MLA weights, capture a CUDA graph, compile,
# fuse kernels, schedule one persistent megakernel, spread the experts over processes — and checked it on a few
# inputs. That is not enough, for three reasons:
#
# * **Isolate each change.** Each stage sits behind the same `Decoder` API and is compared with the *same* reference:
#   stage `naive`, the obvious code, run in **float64** on the same weights (for bf16 cells, on the bf16-rounded
#   weights). If a cell fails, the change that broke it is the stage's own, not an accumulation of earlier ones.
# * **Bound what a stage claims.** Each stage declares what it supports (`StageSupport`: dtypes, batch range,
#   devices, archs, whether it is deterministic). Inside that space every cell must pass; outside it the stage must
#   *refuse* with a clear error — the suite builds the decoder there anyway and requires the `ValueError` (fail
#   closed), so a silent fallback or an accepted-but-wrong configuration is a failure, not a skipped cell.
# * **Check across the whole space.** Bugs live in corners: batch 33 (not a power of two, not a tile multiple),
#   right-padded prompts of mixed lengths, contexts longer than a kernel's tile, bf16, a second seed. The matrix is
#   stage × preset × dtype × batch (1, 2, 8, 33, 64) × context (short, longer than any internal chunk, long) × seed,
#   with the metric and tolerances of `docs/validation.md` (`e = ‖a − b‖₂ / ‖b‖₂` per step; fp32 ≤ 1e-4 and
#   identical greedy tokens; bf16 teacher-forced ≤ 3e-2 with the top-1 agreement reported).
#
# On top: decode state is **poisoned** (NaN) before each stage's prefill, so state a stage reads without writing
# shows up; any NaN/inf fails; stages that say they are deterministic run twice and must agree **bitwise**; the
# megakernel **hazard checker** runs over the programs of every batch size; expert parallelism runs on real
# process groups; and the **bf16 drift with depth** of K3's 93-layer pattern is drawn, not bounded.
#
# The same suite is the command line `python -m kimik3 validate [--quick] [--presets micro,tiny]` (exit code 0 only
# if every cell that ran passed). Run headless:
# `papermill notebooks/06_validation.ipynb out.ipynb -p quick True -p out_dir /tmp/run06`. On a CPU the full matrix
# with `tiny` takes hours; `quick=True` is the CI subset (micro, one seed, 2 steps, short + long context).

# %% tags=["parameters"]
presets = ["micro"]  # add "tiny" for its matrix (hours on a CPU; minutes on a GPU)
quick = False
batch_sizes = None  # None: the matrix's own (1, 2, 8, 33, 64); a list runs only those
out_dir = "runs/06_validation"


# %%
# a bad parameter (papermill -p, or an edit above) stops here with its name, not deep inside a later cell
from kimik3.notebook.runner import check_params

check_params(dict(presets=presets, **({} if batch_sizes is None else {"batch_sizes": batch_sizes})), "06_validation")

# %%
from IPython.display import HTML, display

from kimik3.notebook.start import start_notebook
from kimik3.validation import (
    CHUNK_TOKENS,
    default_config,
    error_figure,
    only_batches,
    quick_config,
    run_validation,
    support_table,
)
from kimik3.validation.metric import TOL

# plotly renders with no network (plotly.js embedded once, no CDN); figures go to `out`
out = start_notebook(out_dir, pandas_display={"width": 220, "max_columns": 30, "max_colwidth": 140}).out
config = quick_config() if quick else default_config(presets)
if batch_sizes is not None:
    config = only_batches(config, batch_sizes)
if quick and list(presets) != ["micro"]:
    print(f"quick=True runs micro only; {[p for p in presets if p != 'micro']} listed as not run")
print({k: v for k, v in config.as_dict().items() if k in ("presets", "dtypes", "batch_sizes", "contexts", "steps",
                                                            "seeds", "device", "quick")})
print("tolerances:", {k: TOL[k] for k in ("fp32_stage", "bf16_stage", "expert_parallel")},
      f"| longest internal chunk of any stage: {CHUNK_TOKENS} tokens")

# %% [markdown]
# ## What each stage claims
#
# The space the matrix walks, as the stages declare it. `graphs` and `fused` need CUDA; `fused` also only bf16 and
# sm_90a / sm_100a; `megakernel-interp` and `megakernel-cpu` stop at batch 64 (their program is built per batch);
# `expert-parallel` runs as one rank of a process group and is checked on local gloo processes instead of in this
# process.

# %%
display(support_table())

# %% [markdown]
# ## The matrix
#
# One fp64 reference run per (preset, seed, dtype, batch, context) serves every stage (the comparison loop is
# `compare_to_reference`'s; a harness row checks that both give bit-identical errors). Progress is shown cell by
# cell; on a CPU the work is spread over two single-threaded processes.

# %%
report = run_validation(config, out_dir=out / "report")
print(f"{report.seconds:.0f} s; parts: {report.environment['seconds_by_part']}")
display(report.summary())

# %% [markdown]
# ### Accuracy, per stage and dtype
#
# Worst per-step error over every batch, context and seed of a (stage, dtype), against its tolerance. fp32 stages
# sit orders of magnitude inside 1e-4 of the fp64 oracle: they compute the same function, only the summation order
# differs. bf16 errors are ~1e-2: bf16 rounds every activation to 8 bits of mantissa, and the tolerance of 3e-2 on
# `micro`/`tiny` leaves about a factor of two.

# %%
display(report.accuracy_summary())
fig_err = error_figure(report)
fig_err.write_html(str(out / "errors_vs_tolerance.html"), include_plotlyjs=True)
fig_err

# %% [markdown]
# ### Failures, and the bf16 routing caveat
#
# A known issue on these random-weight presets: bf16 rounding moves the router's scores by ~1e-2, enough to flip
# near-tied top-k expert choices, and a flipped expert changes a token's FFN output completely. Such a cell can
# exceed 3e-2 although every stage is right. It is reported as it is — failed, with the measured error, the top-1
# agreement and `router_flips`, the share of router calls whose top-k set differs from the fp64 reference in the
# `naive` stage's run of the same prompts (so the cause is measured, not assumed). The tolerance is not loosened; the
# preset initialisation is being addressed separately.

# %%
fails = report.failures()
if fails.empty:
    print("no cell that ran failed")
else:
    display(fails[["check", "preset", "stage", "dtype", "batch", "context", "seed", "max_error", "top1_agreement",
                   "router_flips", "reason"]])
t = report.table()
bf = t[(t["check"] == "accuracy") & (t["dtype"] == "bfloat16") & (t["status"] != "not-run")]
if not bf.empty:
    print(f"bf16 cells: {len(bf)}, failed {int((bf['status'] == 'failed').sum())}; worst e = "
          f"{bf['max_error'].max():.3e} (tolerance {TOL['bf16_stage']:.0e}); min top-1 agreement "
          f"{bf['top1_agreement'].min():.1%}; router top-k sets differing from fp64: "
          f"{bf['router_flips'].min():.1%}..{bf['router_flips'].max():.1%} of routings")

# %% [markdown]
# ### What was not run, and why
#
# Cells outside a stage's declared support carry the refusal message the suite provoked; cells the run mode left out
# say so.

# %%
display(report.not_run())

# %% [markdown]
# ### Determinism and poisoned state
#
# Every stage that declares itself deterministic ran the short-context cell twice with fresh decoders and identical
# inputs; the outputs must be bitwise equal (`torch.equal`). `poisoned` counts the decode-state tensors filled with
# NaN before the stage's prefill (stages that allocate their state at prefill have none to poison).

# %%
det = t[t["check"] == "determinism"]
display(det.groupby(["stage", "dtype", "status"]).size().unstack(fill_value=0))
acc = t[(t["check"] == "accuracy") & (t["status"] != "not-run")]
display(acc.groupby("stage")[["poisoned", "nonfinite"]].max())

# %% [markdown]
# ## bf16 drift with depth
#
# `micro` and `tiny` have 8 and 12 layers; K3 has 93. `k3-deep-tiny` keeps K3's full layer pattern (KDA ×3 + MLA,
# the last layer MLA) and AttnRes block size 12 at `tiny` widths. The same prompt runs through the bf16 model and
# through an fp32 model holding exactly the bf16-rounded weights; the curve is `e` of every layer's output (the
# residual-stream partial sum it hands on), bf16 vs fp32, and the logits at the end. validation.md: reported, not
# bounded. Within an AttnRes block the partial sum accumulates rounding; at each block start (dotted lines) it
# restarts from the layer's own output, so the curve is a saw-tooth. Whether the error compounds *across* blocks —
# the question depth asks — shows in the per-block table under the figure (first, largest and last `e` of each
# block) and in the logits' error and top-1 agreement at the end.

# %%
drift = report.drift
if drift is not None:
    fig_drift = report.drift_fig
    fig_drift.write_html(str(out / "drift_with_depth.html"), include_plotlyjs=True)
    layers = drift[drift["mixer"] != "logits"]
    print(f"{drift.attrs['preset']}: {len(layers)} layers, {drift.attrs['tokens']} tokens; e per layer "
          f"{layers['error'].min():.2e}..{layers['error'].max():.2e}; logits e = {drift['error'].iloc[-1]:.2e}, "
          f"top-1 agreement {drift['top1_agreement'].iloc[-1]:.1%}")
    display(layers.groupby("block")["error"].agg(["first", "max", "last"]).T.round(4))
    display(fig_drift)

# %% [markdown]
# ## The megakernel hazard checker, every batch size
#
# The megakernel program is rebuilt per batch size (tiles, queues and waits change), so each is checked: operand
# declarations, exactly-once queue membership, and that every read-after-write / write-after-read / write-after-write
# pair is ordered by a counter wait. The CPU interpreter's 8 queues and an H100/H200's 132 SMs, for the presets run
# here and for `k3-shard` (the single-GPU benchmark target).

# %%
hz = report.hazards
if not hz.empty:
    display(hz.pivot_table(index=["preset", "num_sms", "policy"], columns="batch", values="violations",
                           aggfunc="sum"))
    display(hz.pivot_table(index=["preset", "num_sms", "policy"], columns="batch", values="instructions",
                           aggfunc="sum"))
    print(f"{len(hz)} programs, {int(hz['violations'].fillna(1).sum())} violations")

# %% [markdown]
# ## Expert parallelism
#
# `kimik3.scale.expert_parallel` on real `torch.distributed` gloo process groups (spawned locally), fp32, against the
# single-process `naive` decoder: `e ≤ 1e-4` per step and identical greedy tokens on every rank. Per step, two
# all-to-alls per MoE layer (dispatch and combine) — measured, and equal to the traffic model's count — carrying the
# LatentMoE latent width, half the hidden width (the point of LatentMoE for expert parallelism).

# %%
ep = report.expert_parallel
if not ep.empty:
    display(ep.T)

# %%
print("report:", report.files["report"])
display(HTML(f"<a href='{report.files['report']}'>validation report (self-contained HTML)</a>"))
print(sorted(p.name for p in out.glob("*.html")))

# %% [markdown]
# **Reading the report.** A green run means: inside every stage's declared space, on these presets and seeds, every
# cell is within validation.md's bounds of the fp64 oracle, deterministic stages are bitwise repeatable, refusals
# happen where they are declared, and the megakernel programs are hazard-free. It does not mean: the GPU stages were
# checked (on a CPU they are refusals — their rows say "needs CUDA"), or that real-weight models behave like random
# ones (routing margins are larger with trained routers).
