"""Benchmark the stages side by side in one run: ``python -m kimik3 bench``.

Prints and returns one row per (stage, batch): ms per decode step (median over repeats, with min/max), tokens/s,
achieved GB/s (cost-model bytes of the step over the measured time), % of this machine's measured copy bandwidth,
and speedups vs ``naive`` and vs ``compiled`` (the strongest PyTorch-only peer) measured in the same run. For
configs transformers supports (DeepSeek-V3 and Kimi-Linear formats) transformers' own decode on the same weights
is a peer row. A benchmark, not a test: it reports what it measured, on what, with the spread.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

import kimik3
from kimik3.cost import decode_cost
from kimik3.hardware import measure_local
from kimik3.profiling import Timing

__all__ = ["run_bench", "provenance", "write_hf_deepseek_checkpoint", "main"]


def provenance(device: str) -> dict:
    """Where and with what a measurement was taken (commit, device, versions, date)."""
    commit = os.environ.get("KIMIK3_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                    cwd=Path(__file__).resolve().parent).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    info = {
        "commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "kimik3": kimik3.__version__,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        try:
            q = "clocks.sm,clocks.mem,clocks.max.sm,driver_version"
            out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout.strip()
            info["nvidia_smi"] = out
        except (OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = None
    return info


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


def _time_steps(dec: kimik3.Decoder, ids: torch.Tensor, steps: int, repeats: int, device: str) -> Timing:
    """Seconds per decode step: each sample times ``steps`` steps (CUDA events on a GPU, wall clock on a CPU)."""
    nxt = ids[:, -1]
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step(nxt)
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / steps)
    return Timing("cuda-synchronized wall clock" if device == "cuda" else "wall-clock", samples)


def _hf_decode_timing(path: Path, ids: torch.Tensor, steps: int, repeats: int, warmup: int, device: str,
                      dtype: torch.dtype) -> Timing:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False).to(device).eval()
    samples = []
    with torch.no_grad():
        for r in range(warmup + repeats):
            out = model(ids, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(nxt, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
            if device == "cuda":
                torch.cuda.synchronize()
            if r >= warmup:
                samples.append((time.perf_counter() - t0) / steps)
    return Timing("wall-clock", samples)


def run_bench(preset: str = "tiny", stages: list[str] | tuple[str, ...] = ("naive", "absorbed", "compiled"),
              batches: list[int] | tuple[int, ...] = (1,), context: int = 512, device: str = "auto",
              dtype: str = "auto", steps: int = 8, repeats: int = 5, warmup: int = 2, include_hf: bool = True,
              checkpoint: str | Path | None = None, out: str | Path | None = None, progress: bool = True,
              seed: int = 0) -> pd.DataFrame:
    """Measure every (stage, batch) in one process; returns the table (and writes JSON with provenance to out)."""
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    dt = {"auto": torch.bfloat16 if dev == "cuda" else torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16}[dtype]
    if checkpoint is not None:
        model = kimik3.from_pretrained(checkpoint, dtype=dt, device=dev)
        source = str(checkpoint)
    else:
        model = kimik3.from_preset(preset, seed=seed, dtype=dt, device=dev)
        source = preset
    cfg = model.config
    hf_ok = include_hf and checkpoint is not None and cfg.family in ("deepseek_v3", "kimi_k2", "kimi_linear")
    copy_bw = measure_local(device=dev, quick=True)
    rows = []
    todo = [(b, s) for b in batches for s in stages] + ([(b, "transformers") for b in batches] if hf_ok else [])
    bar = tqdm(todo, desc="bench", disable=not progress)
    g = torch.Generator().manual_seed(seed)
    for batch, stage in bar:
        bar.set_postfix_str(f"{stage} B={batch}")
        ids = torch.randint(3, cfg.vocab_size, (batch, context), generator=g).to(dev)
        row = {"stage": stage, "batch": batch, "context": context, "dtype": str(dt).replace("torch.", ""),
               "device": dev, "model": source}
        try:
            if stage == "transformers":
                t = _hf_decode_timing(Path(checkpoint), ids, steps, repeats, warmup, dev, dt)
            else:
                opts = {"prefill": "chunked"} if stage == "naive" else {}
                dec = kimik3.Decoder(model, stage, batch_size=batch,
                                     max_seq_len=context + steps * (repeats + warmup) + 1, **opts)
                dec.prefill(ids)
                _time_steps(dec, ids, steps, warmup, dev)  # warm-up (and compilation) excluded
                t = _time_steps(dec, ids, steps, repeats, dev)
        except ValueError as e:  # a stage refusing this device/dtype/batch: reported, not hidden
            row.update(status=f"not run: {e}")
            rows.append(row)
            continue
        mid = context + steps
        nbytes = decode_cost(cfg, batch_size=batch, context_len=mid,
                             weight_dtype="bf16" if dt == torch.bfloat16 else "fp32").total_bytes
        row.update(status="ok", ms_per_token=t.median * 1e3, ms_min=t.spread[0] * 1e3, ms_max=t.spread[1] * 1e3,
                   repeats=len(t.samples), clock=t.clock, tokens_per_s=batch / t.median,
                   tokens_per_s_per_user=1 / t.median, gb_per_s=nbytes / t.median / 1e9,
                   pct_copy_bw=100 * nbytes / t.median / copy_bw["copy_bandwidth_Bps"], bytes_per_step=nbytes)
        rows.append(row)
    df = pd.DataFrame(rows)
    for ref in ("naive", "compiled"):
        if "ms_per_token" in df:
            base = df[df.stage == ref].set_index("batch")["ms_per_token"]
            df[f"speedup_vs_{ref}"] = [base.get(b, float("nan")) / m if m == m else float("nan")
                                       for b, m in zip(df.batch, df.get("ms_per_token"))]
    if out is not None:
        record = {"kind": "bench", "provenance": provenance(dev), "copy_bandwidth": copy_bw,
                  "config": {"source": source, "preset": preset if checkpoint is None else None,
                             "params": model.num_parameters(), "context": context, "steps": steps,
                             "repeats": repeats, "warmup": warmup},
                  "rows": json.loads(df.to_json(orient="records"))}
        if dev != "cuda":
            record["gpu_rows"] = "not yet measured: this run had no GPU"
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1))
    return df


COLUMNS = ["stage", "batch", "ms_per_token", "ms_min", "ms_max", "tokens_per_s", "gb_per_s", "pct_copy_bw",
           "speedup_vs_naive", "speedup_vs_compiled", "status"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimik3 bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=kimik3.PRESET_NAMES)
    ap.add_argument("--checkpoint", default=None,
                    help="an HF checkpoint dir instead of a preset; 'hf-dsv3-40m' writes one with transformers")
    ap.add_argument("--stages", default="naive,absorbed,compiled")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer row")
    ap.add_argument("--out", default=None, help="JSON output path (default: runs/bench/<timestamp>.json)")
    a = ap.parse_args(argv)
    checkpoint = a.checkpoint
    tmp = None
    if checkpoint == "hf-dsv3-40m":
        tmp = tempfile.TemporaryDirectory()
        checkpoint = write_hf_deepseek_checkpoint(Path(tmp.name) / "dsv3-40m")
    out = a.out or f"runs/bench/{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    df = run_bench(a.preset, [s for s in a.stages.split(",") if s], [int(b) for b in a.batch.split(",")],
                   a.context, a.device, a.dtype, a.steps, a.repeats, include_hf=not a.no_hf, checkpoint=checkpoint,
                   out=out)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df[[c for c in COLUMNS if c in df]].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"\nwrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 0
