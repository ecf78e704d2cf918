"""Benchmark the stages side by side in one run: ``python -m kimik3 bench``.

Prints and returns one row per (stage, batch): ms per decode step (median over repeats, with min/max), tokens/s,
achieved GB/s (cost-model bytes of the step over the measured time), % of this machine's measured read bandwidth
(decode's ceiling; unclamped: a row above 100 % is flagged as a measurement problem, not shown as a result),
and speedups vs ``naive`` and vs ``compiled`` (the strongest PyTorch-only peer) measured in the same run. For
configs transformers supports (DeepSeek-V3 and Kimi-Linear formats) transformers' own decode on the same weights
is a peer row. A benchmark, not a test: it reports what it measured, on what, with the spread.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import pandas as pd
import torch
from tqdm.auto import tqdm

import kimik3
from kimik3.decoder import check_state_fits
from kimik3.model.checks import require_memory
from kimik3.model.config import load_config
from kimik3.perf.cost import decode_cost
from kimik3.perf.hardware import measure_bandwidth, measure_local, read_ceiling_Bps
from kimik3.perf.profiling import Timing
from kimik3.perf.provenance import provenance
from kimik3.util.args import MAX_STEPS, bounded_int, output_file, positive_int, positive_int_list
from kimik3.util.clilog import compiler_output_to
from kimik3.util.files import atomic_write_text, check_writable
from kimik3.util.text import refuse
from kimik3.validation.metric import rel_error

__all__ = ["run_bench", "provenance", "write_hf_deepseek_checkpoint", "strongest_compile_options", "main"]

# torch.compile modes (torch's own list); None: strongest_compile_options for the device
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CPU_SETTLE_S = 0.05  # pause before each timed CPU sample (OpenMP spin-wait of the stage before it)


def write_hf_deepseek_checkpoint(path: str | Path, hidden: int = 512, layers: int = 4, seed: int = 0) -> Path:
    """A DeepSeek-V3-format checkpoint of about 40M parameters, written by transformers' own save_pretrained."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=16384, hidden_size=hidden, intermediate_size=2 * hidden,
                           moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=8,
                           num_key_value_heads=8, n_shared_experts=1, n_routed_experts=32, num_experts_per_tok=4,
                           n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=128,
                           qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return Path(path)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _decoder_runner(dec: kimik3.Decoder, ids: torch.Tensor) -> Callable[[int], None]:
    """n decode steps of a prefilled Decoder (feeding the last prompt token: the timing, not the text, matters)."""
    nxt = ids[:, -1]

    def run(n: int) -> None:
        for _ in range(n):
            dec.step(nxt)
    return run


def _hf_runner(path: Path, ids: torch.Tensor, device: str, dtype: torch.dtype) -> Callable[[int], None]:
    """transformers' own decode on the same weights: prefill once, then n cached single-token steps per call."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False).to(device).eval()
    with torch.no_grad():
        out = model(ids, use_cache=True)
    state = {"cache": out.past_key_values, "nxt": out.logits[:, -1].argmax(-1, keepdim=True)}

    def run(n: int) -> None:
        with torch.no_grad():
            for _ in range(n):
                state["cache"] = model(state["nxt"], past_key_values=state["cache"], use_cache=True).past_key_values
    return run


def run_bench(preset: str = "tiny", stages: list[str] | tuple[str, ...] = ("naive", "absorbed", "compiled"),
              batches: list[int] | tuple[int, ...] = (1,), context: int = 512, device: str = "auto",
              dtype: str = "auto", steps: int = 8, repeats: int = 5, warmup: int = 2, include_hf: bool = True,
              checkpoint: str | Path | None = None, out: str | Path | None = None, progress: bool | TextIO = True,
              seed: int = 0, compile_options: dict | None = None, model: kimik3.KimiForCausalLM | None = None,
              reference: dict[tuple[int, int, int], torch.Tensor] | None = None) -> pd.DataFrame:
    """Measure every (stage, batch) in one process; returns the table (and writes JSON with provenance to out).

    ``compile_options`` go to stage "compiled"; by default the strongest PyTorch-only setting for the device
    (:func:`strongest_compile_options`), because that stage is the baseline every later stage has to beat. Each
    row also carries ``rel_err_vs_naive``: the first decode step's logits against the naive stage's, so a fast
    row that computes something else shows it. ``progress``: show a progress bar (on standard error, or on the
    stream given). ``model``: measure this model (already on ``device`` in ``dtype``) instead of building the
    preset. ``reference``: naive first-step logits by (batch, context, seed), shared across calls; given, every
    row gets ``rel_err_vs_naive`` even when ``naive`` is not among the stages (computed untimed, once, and stored
    in it), so a caller that measures one stage per call still checks each against ``naive``."""
    check_bench_args(stages, batches, context, device, dtype, steps, repeats, warmup)
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dt = {"auto": torch.bfloat16 if dev == "cuda" else torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16}[dtype]
    if model is not None:
        source = model.config.name or preset
    elif checkpoint is not None:
        model = kimik3.from_pretrained(checkpoint, dtype=dt, device=dev)
        source = Path(checkpoint).name  # the directory name (a temporary path says nothing)
    else:
        model = kimik3.from_preset(preset, seed=seed, dtype=dt, device=dev)
        source = preset
    cfg = model.config
    hf_ok = include_hf and checkpoint is not None and cfg.family in ("deepseek_v3", "kimi_k2", "kimi_linear")
    for batch in batches:  # every batch's prompt and decode state fit, or nothing is measured
        require_memory(batch * context * 8, dev, f"the prompt of batch {batch} x context {context}")
        check_state_fits(model, batch, context + steps * (repeats + warmup) + 2)
    ceiling = measure_local(device=dev, quick=True)  # STREAM-style; decode's ceiling is the read bandwidth
    read_bw = read_ceiling_Bps(ceiling)
    rows = []
    names = list(stages) + (["transformers"] if hf_ok else [])
    bar = tqdm(total=len(batches) * (len(names) + repeats), desc="bench", disable=progress is False,
               file=None if isinstance(progress, bool) else progress)
    g = torch.Generator().manual_seed(seed)
    compile_options = strongest_compile_options(dev) if compile_options is None else compile_options
    clock = "cuda-synchronized wall clock" if dev == "cuda" else "wall-clock"
    for batch in batches:
        ids = torch.randint(3, cfg.vocab_size, (batch, context), generator=g).to(dev)
        runners: dict[str, Callable[[int], None]] = {}
        batch_rows: dict[str, dict] = {}
        first_naive = None  # the naive stage's logits of the first decode step
        if reference is not None and "naive" not in names:
            key = (batch, context, seed)
            if key not in reference:  # untimed: the same prompt and first step as the naive row would see
                ref_dec = kimik3.Decoder(model, "naive", batch_size=batch, max_seq_len=context + 2, prefill="chunked")
                ref_dec.prefill(ids)
                reference[key] = ref_dec.step(ids[:, -1]).float().cpu()
                del ref_dec
            first_naive = reference[key]
        for stage in names:  # set-up: build, prefill, first step (compilation), warm-up — none of it timed
            bar.set_postfix_str(f"set up {stage} B={batch}")
            row = batch_rows[stage] = {"stage": stage, "batch": batch, "context": context,
                                       "dtype": str(dt).replace("torch.", ""), "device": dev, "model": source}
            try:
                if stage == "transformers":
                    runners[stage] = _hf_runner(Path(checkpoint), ids, dev, dt)
                else:
                    opts = {"naive": {"prefill": "chunked"}, "compiled": compile_options}.get(stage, {})
                    row["options"] = json.dumps(opts) if opts else ""
                    dec = kimik3.Decoder(model, stage, batch_size=batch,
                                         max_seq_len=context + steps * (repeats + warmup) + 2, **opts)
                    dec.prefill(ids)
                    t0 = time.perf_counter()
                    first = dec.step(ids[:, -1]).float().cpu()  # the first call compiles where a stage compiles
                    row["first_step_s"] = time.perf_counter() - t0
                    if stage == "naive":
                        first_naive = first
                    if first_naive is not None:
                        row["rel_err_vs_naive"] = rel_error(first, first_naive)
                    runners[stage] = _decoder_runner(dec, ids)
                runners[stage](steps * warmup)
            except ValueError as e:  # a stage refusing this device/dtype/batch: reported, not hidden
                row["status"] = f"not run: {e}"
                runners.pop(stage, None)
            bar.update()
        # measurement: repeats interleaved across the stages (rotating who goes first), so drift in the machine's
        # speed lands on every stage alike and the ratios of one run stay fair
        samples: dict[str, list[float]] = {s: [] for s in runners}
        order = list(runners)
        for r in range(repeats if order else 0):  # no stage set up (all refused): nothing to time
            bar.set_postfix_str(f"repeat {r + 1}/{repeats} B={batch}")
            for stage in order[r % len(order):] + order[:r % len(order)]:
                _sync(dev)
                if dev == "cpu":
                    # the previous stage's OpenMP workers spin for a while after their last parallel region; let
                    # them go to sleep so they do not compete with the next stage's threads for the cores
                    time.sleep(CPU_SETTLE_S)
                t0 = time.perf_counter()
                runners[stage](steps)
                _sync(dev)
                samples[stage].append((time.perf_counter() - t0) / steps)
            bar.update()
        cost = decode_cost(cfg, batch_size=batch, context_len=context + steps * (warmup + repeats // 2),
                           weight_dtype="bf16" if dt == torch.bfloat16 else "fp32")
        nbytes = cost.total_bytes
        ceiling_bw = read_bw
        if dev == "cpu":
            # a CPU's last-level cache can hold much of a small model's step: the ceiling for re-reading the same
            # bytes every step is measured on buffers of the step's size, and a summing read does not saturate
            # every CPU's memory system, so the best of read and triad (bytes as STREAM counts them) bounds it
            ws = measure_bandwidth("cpu", nbytes=max(int(nbytes), 2**20), repeats=5, warmup=2)
            ceiling_bw = max(read_bw, ws["read_bandwidth_Bps"], ws["triad_bandwidth_Bps"])
            ceiling.setdefault("step_working_set", {})[str(batch)] = {
                "buffer_bytes": max(int(nbytes), 2**20), "read_Bps": ws["read_bandwidth_Bps"],
                "triad_Bps": ws["triad_bandwidth_Bps"], "ceiling_Bps": ceiling_bw,
                "rule": "max(read at the default buffer, read and triad on buffers of the step's bytes)"}
        for stage, row in batch_rows.items():
            if stage in samples:
                t = Timing(clock, samples[stage])
                row.update(status="ok", ms_per_token=t.median * 1e3, ms_min=t.spread[0] * 1e3,
                           ms_max=t.spread[1] * 1e3, repeats=len(t.samples), clock=t.clock,
                           tokens_per_s=batch / t.median, tokens_per_s_per_user=1 / t.median,
                           gb_per_s=nbytes / t.median / 1e9,
                           pct_read_bw=100 * nbytes / t.median / ceiling_bw, bytes_per_step=nbytes,
                           flops_per_step=cost.total_flops)
                row.update(_roofline_columns(nbytes, cost.total_flops, t.median, ceiling_bw, ceiling, dt))
                if row["pct_read_bw"] > 100:  # unclamped, so an impossible figure shows as one
                    row["status"] = (f"measurement problem: {row['pct_read_bw']:.0f}% of the measured read bandwidth "
                                     "(above the ceiling: the cost model's bytes, the clock or the ceiling is wrong)")
            rows.append(row)
        del runners
    bar.close()
    df = pd.DataFrame(rows)
    for ref in ("naive", "compiled"):
        if "ms_per_token" in df:
            base = df[df.stage == ref].set_index("batch")["ms_per_token"]
            df[f"speedup_vs_{ref}"] = [base.get(b, float("nan")) / m if m == m else float("nan")
                                       for b, m in zip(df.batch, df.get("ms_per_token"))]
    if checkpoint is None and len(df) and df.stage.isin(["fused", "megakernel"]).any():
        # the GPU performance model (kimik3.perfmodel.CURRENT_DESIGN, H200 constants) beside the measurement: a
        # model, not a measurement; min / max: its range (the uncertain constants at their optimistic / pessimistic
        # ends)
        from kimik3.perfmodel import model_columns

        extra = [model_columns(source, s, int(b), context) for s, b in zip(df.stage, df.batch)]
        for k in ("model_ms", "model_ms_min", "model_ms_max", "model_roofline_ms", "model_note"):
            if any(k in e for e in extra):
                df[k] = [e.get(k) for e in extra]
    if out is not None:
        # the data/measurements format (kimik3.perf.recorded.load_recorded): provenance on top, one record per row
        records = []
        for r in json.loads(df.to_json(orient="records")):
            rec = {**r, "block": "step", "batch_size": r["batch"], "context_len": r["context"]}
            if r.get("ms_per_token") is not None:  # measured (ok, or flagged above its ceiling)
                rec.update(seconds=r["ms_per_token"] / 1e3, bytes=r["bytes_per_step"], flops=r["flops_per_step"])
            records.append(rec)
        record = {"kind": "bench", **provenance(dev), "preset": preset if checkpoint is None else None,
                  "source": "kimik3.bench", "bandwidth_ceiling": ceiling,
                  "config": {"model": source, "params": model.num_parameters(), "context": context,
                             "steps": steps, "repeats": repeats, "warmup": warmup, "interleaved": True},
                  "records": [r for r in records if "seconds" in r and r.get("status") == "ok"],
                  # above the ceiling: kept for diagnosis, never among the records plotted as results
                  "flagged": [r for r in records if "seconds" in r and r.get("status") != "ok"],
                  "not_run": [r for r in records if "seconds" not in r]}
        if dev != "cuda":
            record["gpu_rows"] = "not yet measured: this run had no GPU"
        if "megakernel-cpu" in names:  # which form of the native executor's hot loops these rows timed
            from kimik3.megakernel.cpu import simd_width

            try:
                record["cpu_executor_simd_width"] = simd_width()
            except (ValueError, RuntimeError, OSError) as e:  # no compiler: the stage's row says it did not run
                record["cpu_executor_simd_width"] = f"unknown: {e}"
        atomic_write_text(out, json.dumps(record, indent=1))
    return df


def _roofline_columns(nbytes: float, flops: float, seconds: float, bw: float, ceiling: dict,
                      dt: torch.dtype) -> dict:
    """The step against both measured ceilings: ``roofline_ms`` = max(bytes / read ceiling, FLOPs / the measured
    dense matmul rate of this dtype), ``bound`` which one sets it, ``pct_roofline`` the share of it this time
    reaches. Past a few batch rows a CPU step is compute-bound, where ``pct_read_bw`` alone understates it; without
    a matmul rate measured in the run's dtype the compute ceiling is unknown and only the memory one is used
    (``bound`` says so)."""
    rate = ceiling.get("matmul_flops_per_s")
    mem_s, roof, bound = nbytes / bw, nbytes / bw, "memory (no compute ceiling measured in this dtype)"
    if rate and ceiling.get("matmul_dtype") == {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dt):
        roof = max(mem_s, flops / rate)
        bound = "memory" if roof == mem_s else "compute"
    return {"roofline_ms": roof * 1e3, "bound": bound, "pct_roofline": 100 * roof / seconds}


def check_bench_args(stages: list[str] | tuple[str, ...], batches: list[int] | tuple[int, ...], context: int,
                     device: str, dtype: str, steps: int, repeats: int, warmup: int = 2) -> None:
    """Refuse, before anything is built or measured, arguments with which nothing could be measured."""
    from kimik3.stages import get_stage

    def pos_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if not stages:
        raise ValueError("no stages given (e.g. --stages naive,absorbed,compiled)")
    for s in stages:
        get_stage(s)  # unknown names: ValueError listing the known stages
    if not batches or not all(pos_int(b) for b in batches):
        raise ValueError(f"batch sizes must be positive integers, got {list(batches)}")
    for name, v in (("context", context), ("steps", steps), ("repeats", repeats)):
        if not pos_int(v):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")


COLUMNS = ["stage", "batch", "ms_per_token", "ms_min", "ms_max", "tokens_per_s", "gb_per_s", "pct_read_bw",
           "bound", "pct_roofline", "speedup_vs_naive", "speedup_vs_compiled", "rel_err_vs_naive", "model_ms",
           "model_ms_min", "model_ms_max", "model_roofline_ms", "status"]


def strongest_compile_options(device: str) -> dict:
    """The torch.compile setting the benchmark holds up as the PyTorch-only baseline: on a GPU "reduce-overhead"
    (Inductor + CUDA graphs); on a CPU Inductor freezing with autotuned GEMM templates (weights pre-packed for
    the CPU GEMM micro-kernels) and a C++ wrapper around the kernels — minutes of compilation, measured
    separately as ``first_step_s``. ``--compile-mode default --no-freeze`` measures the plain setting."""
    if device == "cuda":
        return {"mode": "reduce-overhead"}
    return {"mode": "max-autotune-no-cudagraphs", "freeze": True, "inductor_options": {"cpp_wrapper": True}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimik3 bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=kimik3.PRESET_NAMES)
    ap.add_argument("--checkpoint", default=None,
                    help="an HF checkpoint dir instead of a preset; 'hf-dsv3-40m' writes one with transformers")
    ap.add_argument("--stages", default="naive,absorbed,compiled")
    ap.add_argument("--batch", type=positive_int_list, default=(1,), help="comma-separated batch sizes")
    ap.add_argument("--context", type=positive_int, default=512)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--steps", type=bounded_int(1, MAX_STEPS, "decode steps per timed run"), default=8)
    ap.add_argument("--repeats", type=bounded_int(1, 1000, "timed runs per stage"), default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer row")
    ap.add_argument("--compile-mode", default=None, choices=COMPILE_MODES,
                    help="torch.compile mode for stage 'compiled' (default: the strongest for the device, see "
                    "strongest_compile_options)")
    ap.add_argument("--no-freeze", action="store_true", help="stage 'compiled' without Inductor freezing")
    ap.add_argument("--out", type=output_file, default=None,
                    help="JSON output path (default: runs/bench/<timestamp>.json)")
    a = ap.parse_args(argv)
    checkpoint = a.checkpoint
    tmp = None
    out = a.out or f"runs/bench/{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    try:  # every argument checked before any work, and the output's folder before a run whose result it keeps
        batches = list(a.batch)
        check_bench_args([s for s in a.stages.split(",") if s], batches, a.context, a.device, a.dtype, a.steps,
                         a.repeats)
        check_writable(out)
        if checkpoint not in (None, "hf-dsv3-40m") and not Path(checkpoint).is_dir():
            raise ValueError(f"--checkpoint {checkpoint} is not a directory")
        if checkpoint not in (None, "hf-dsv3-40m"):
            load_config(checkpoint)  # a folder without a usable config.json is refused here, not after setup
    except ValueError as e:
        return refuse("bench", e)
    if checkpoint == "hf-dsv3-40m":
        tmp = tempfile.TemporaryDirectory()
        checkpoint = write_hf_deepseek_checkpoint(Path(tmp.name) / "dsv3-40m")
    copts = None
    if a.compile_mode is not None or a.no_freeze:
        dev = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
        copts = strongest_compile_options(dev)
        if a.compile_mode is not None:
            copts["mode"] = a.compile_mode
        if a.no_freeze:
            copts.pop("freeze", None)
            copts.pop("inductor_options", None)
    log = Path(out).with_suffix(".log")
    print(f"compiler and autotune output: {log}", flush=True)
    try:
        with compiler_output_to(log) as terminal:  # the table below stays readable; the progress bar stays visible
            df = run_bench(a.preset, [s for s in a.stages.split(",") if s], batches,
                           a.context, a.device, a.dtype, a.steps, a.repeats, include_hf=not a.no_hf,
                           checkpoint=checkpoint, out=out, compile_options=copts, progress=terminal)
    except ValueError as e:  # a model that does not fit, a checkpoint refused while loading
        return refuse("bench", e)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        shown = df[[c for c in COLUMNS if c in df]].copy()
        if "status" in shown:  # a refusal's full reason is in the JSON; the table keeps its start
            shown["status"] = shown["status"].str.slice(0, 60)
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"\nwrote {out}")
    if tmp is not None:
        tmp.cleanup()
    if "ms_per_token" not in df or df["ms_per_token"].isna().all():
        reasons = "; ".join(f"{r.stage} B={r.batch}: {r.status}" for r in df.itertuples() if isinstance(r.status, str))
        print(f"bench: nothing was measured ({reasons})", file=sys.stderr)
        return 1
    return 0
