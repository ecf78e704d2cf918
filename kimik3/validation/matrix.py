"""Running the correctness matrix (:func:`run_validation`): every stage × preset × dtype × batch × context × seed
against the fp64 oracle, plus the support, determinism, harness, hazard, expert-parallel and drift checks; the
units of work run in this process or on a spawn-started process pool. What each check means and why a matrix:
the :mod:`kimik3.validation` package docstring and ``docs/validation.md``."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kimik3.decoder import Decoder
from kimik3.model.config import ModelConfig, get_preset
from kimik3.model.modeling import KimiForCausalLM
from kimik3.model.random_init import build_model, from_preset
from kimik3.perf.provenance import provenance
from kimik3.stages import STAGES, get_stage
from kimik3.stages.base import Stage
from kimik3.validation.compare import (
    ReferenceTrace,
    StageComparison,
    _Refused,
    compare_to_reference,
    compare_with_trace,
    mixed_lengths,
    reference_trace,
    run_stage,
)
from kimik3.validation.config import _DTYPES, _SHORT, ValidationConfig, default_config
from kimik3.validation.metric import TOL, rel_error
from kimik3.validation.report import Cell, ValidationReport, drift_figure

__all__ = [
    "drift_with_depth",
    "hazard_table",
    "known_stages",
    "run_validation",
    "support_refusal",
    "support_table",
]


# ====================================================================== stages and their declared support


def known_stages() -> tuple[list[str], dict[str, str]]:
    """Every stage the Decoder API knows, in ladder order (registered ones, then the lazily imported ones), and
    for stages whose module failed to import, the error (reported as not-run)."""
    from kimik3 import stages as st

    names = list(STAGES)
    broken: dict[str, str] = {}
    for name in getattr(st, "_LAZY_STAGES", {}):
        try:
            get_stage(name)
        except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
            broken[name] = f"{type(e).__name__}: {e}"
        if name not in names:
            names.append(name)
    names += [n for n in STAGES if n not in names]
    return names, broken


def support_table() -> pd.DataFrame:
    """What every stage declares it supports (its ``StageSupport``), one row per stage: the space the matrix walks
    and the edge of it the suite checks the stage refuses."""
    names, broken = known_stages()
    rows = []
    for n in names:
        if n in broken:
            rows.append({"stage": n, "note": f"import failed: {broken[n]}"})
            continue
        s = get_stage(n).support
        rows.append({"stage": n, "dtypes": ", ".join(str(d).replace("torch.", "") for d in s.dtypes),
                     "batch": f"{s.min_batch}..{s.max_batch if s.max_batch is not None else '∞'}",
                     "devices": ", ".join(s.devices), "deterministic": s.deterministic,
                     "archs": ", ".join(s.archs) if s.archs else "any", "note": ""})
    return pd.DataFrame(rows).set_index("stage")


def _short_reason(stage: str, cls: type[Stage], model: KimiForCausalLM, batch: int) -> str:
    """A short "why not" from the stage's declared support (the refusal message follows it)."""
    s = cls.support
    dev = model.device.type
    if dev not in s.devices:
        return f"{stage}: needs {'/'.join(d.upper() if d == 'cuda' else d for d in s.devices)}"
    if model.dtype not in s.dtypes:
        return f"{stage}: {_SHORT.get(str(model.dtype)[6:], model.dtype)} not supported " \
               f"(supports {', '.join(str(d)[6:] for d in s.dtypes)})"
    if s.max_batch is not None and batch > s.max_batch:
        return f"{stage}: batch {batch} > stage max {s.max_batch}"
    if batch < s.min_batch:
        return f"{stage}: batch {batch} < stage min {s.min_batch}"
    return f"{stage}: outside declared support"


def support_refusal(stage: str, model: KimiForCausalLM, batch: int, max_seq_len: int = 16
                    ) -> tuple[str, str] | None:
    """None when ``stage`` declares support for (model device, dtype, ``batch``) and builds there. Otherwise
    (status, reason). Outside the declared support the suite builds the decoder anyway and requires a
    ``ValueError`` — ``("not-run", "<why> — refused: <message>")`` when it refuses, ``("failed", ...)`` when it
    accepts or fails some other way (fail closed). Inside it, a ``ValueError`` from the constructor (a
    precondition such as a process group or a kernel shape) is a not-run cell with the message."""
    cls = get_stage(stage)
    try:
        cls.support.check(stage, model, batch)
    except ValueError as e:
        declared = str(e)
        short = _short_reason(stage, cls, model, batch)
        try:
            Decoder(model, stage, batch_size=batch, max_seq_len=max_seq_len)
        except ValueError as e2:
            return "not-run", f"{short} — refused: {e2}"
        except Exception as e2:  # noqa: BLE001 - the wrong kind of refusal is itself a finding
            return "failed", f"{short}, but the decoder raised {type(e2).__name__} instead of ValueError: {e2}"
        return "failed", f"{short} ({declared}), but the decoder was built anyway: the stage does not fail closed"
    ep_hint = " (expert parallelism is checked on local gloo process groups: see the expert-parallel rows)"
    if stage == "expert-parallel":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # building it would shard this model in place
            return "not-run", "expert-parallel: not run in-process while a process group is initialised" + ep_hint
    try:
        Decoder(model, stage, batch_size=batch, max_seq_len=max_seq_len)
    except ValueError as e:
        return "not-run", f"{stage}: refused at construction: {e}" + (ep_hint if stage == "expert-parallel" else "")
    except Exception as e:  # noqa: BLE001
        return "failed", f"{stage}: building the decoder raised {type(e).__name__}: {e}"
    return None


# ====================================================================== one accuracy cell's verdict


def _route_flips(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> float | None:
    """Fraction of router calls' rows whose top-k expert *set* differs between two runs of the same path."""
    if not a or not b or len(a) != len(b):
        return None
    rows = diff = 0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return None
        rows += x.shape[0]
        diff += int((x != y).any(-1).sum())
    return diff / rows if rows else None


def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _accuracy_reason(res: StageComparison, nonfinite: int, flips: float | None) -> str:
    if nonfinite:
        return f"non-finite output: {nonfinite} NaN/inf logits (e = inf)"
    worst = max(range(len(res.errors)), key=lambda i: res.errors[i]) if res.errors else 0
    parts = []
    if res.max_error > res.tolerance:
        parts.append(f"e = {res.max_error:.2e} > {res.tolerance:.0e} (step {worst})")
    if res.mode == "greedy" and not res.tokens_equal:
        parts.append(f"greedy tokens diverged at step {len(res.errors) - 1}")
    parts.append(f"top-1 agreement {_fmt_pct(res.top1_agreement)}")
    if flips is not None:
        parts.append(f"router top-k sets differing from fp64: {_fmt_pct(flips)} of routings")
    return "; ".join(parts)


# ====================================================================== hazards, expert parallelism, drift


def hazard_table(presets: Sequence[str], batch_sizes: Sequence[int], num_sms: Sequence[int],
                 policies: Sequence[str], max_seq_len: int = 4096, extra: Sequence[tuple[str, int]] = (),
                 on_done: Callable[[], None] | None = None) -> pd.DataFrame:
    """Build the megakernel program for every (preset, SM count, policy, batch) and run the hazard checker on it.
    ``extra``: further (preset, SM count) pairs checked with the first policy. One row per program."""
    from kimik3.megakernel import build_program, check_program
    from kimik3.megakernel.hazards import format_violations

    combos = [(p, s, pol) for p in presets for s in num_sms for pol in policies]
    combos += [(p, s, policies[0]) for p, s in extra]
    rows = []
    for preset, sms, policy in combos:
        for b in batch_sizes:
            t0 = time.perf_counter()
            try:
                prog = build_program(preset, b, sms, policy, max_seq_len)
                bad = check_program(prog)
                rows.append({"preset": preset, "num_sms": sms, "policy": policy, "batch": b,
                             "instructions": len(prog.instructions), "counters": len(prog.counters),
                             "violations": len(bad), "status": "failed" if bad else "passed",
                             "reason": format_violations(bad)[:2000] if bad else "",
                             "seconds": time.perf_counter() - t0})
            except Exception as e:  # noqa: BLE001 - a program that cannot be built is a failed cell
                rows.append({"preset": preset, "num_sms": sms, "policy": policy, "batch": b, "instructions": None,
                             "counters": None, "violations": None, "status": "failed",
                             "reason": f"build_program raised {type(e).__name__}: {e}",
                             "seconds": time.perf_counter() - t0})
            if on_done:
                on_done()
    return pd.DataFrame(rows)


def _expert_parallel(preset: str, world: int, batch: int, steps: int, prompt_len: int, seed: int) -> dict[str, Any]:
    """One expert-parallel run on ``world`` local gloo processes against a single process (fp32)."""
    from kimik3.scale.expert_parallel import run_local, traffic_model

    lengths = mixed_lengths(batch, prompt_len, seed)
    res = run_local(world, preset=preset, batch=batch, steps=steps, seed=seed, prompt_len=prompt_len,
                    lengths=lengths)
    r0 = res[0]
    s = r0["summary_step"]
    tm = traffic_model(preset, batch, world, 4)
    calls = s["calls_per_step"]
    tokens_equal = all(torch.equal(r["tokens"], r0["tokens"]) for r in res)
    return {"preset": preset, "world": world, "batch": batch, "steps": steps, "seed": seed,
            "max_error": r0["max_error"], "tokens_match_single_process": r0["tokens_match"],
            "ranks_agree": tokens_equal, "ok": bool(r0["ok"] and tokens_equal),
            "all_to_all_per_step": calls.get("all_to_all", 0), "moe_layers": s["moe_layers"],
            "dispatch_bytes_per_step": s["dispatch_bytes_per_step"],
            "hidden_width_bytes_per_step": s["hidden_dispatch_bytes_per_step"],
            "dispatch_saving": s["dispatch_saving"],
            "model_all_to_all_per_step": tm["all_to_all_calls_per_step"],
            "seconds_ep": r0["seconds_ep"]}


@contextlib.contextmanager
def _capture_layer_outputs(model: KimiForCausalLM) -> Iterator[list[torch.Tensor]]:
    """Record each decoder layer's output (the residual-stream partial sum ``p`` it hands on) during a forward."""
    out: list[torch.Tensor] = []
    layers = list(model.model.layers)
    for layer in layers:
        orig = layer.residual

        def rec(p, R, mixer, ffn, _orig=orig):
            res = _orig(p, R, mixer, ffn)
            out.append(res[0].detach().to(torch.float64).cpu())
            return res

        layer.residual = rec  # instance attribute shadows the method for this forward only
    try:
        yield out
    finally:
        for layer in layers:
            del layer.residual


@torch.no_grad()
def drift_with_depth(preset: str | ModelConfig = "k3-deep-tiny", tokens: int = 16, batch: int = 1, seed: int = 0,
                     device: str = "cpu") -> pd.DataFrame:
    """bf16 drift with depth (validation.md: reported, not bounded): the same ``tokens``-token prompt through the
    bf16 model and through an fp32 model holding exactly the bf16-rounded weights (the model's own full-sequence
    forward, so both see the same tokens), and ``e`` of every layer's output, bf16 vs fp32. One row per layer plus
    a final ``logits`` row (with the top-1 agreement)."""
    cfg = get_preset(preset)
    low = from_preset(cfg, seed=seed, dtype=torch.bfloat16, device=device)
    ref = copy.deepcopy(low).cast_(torch.float32)
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g).to(device)
    with _capture_layer_outputs(low) as h_low:
        y_low = low(ids)
    with _capture_layer_outputs(ref) as h_ref:
        y_ref = ref(ids)
    del low, ref
    bs = cfg.attn_res_block_size
    rows = []
    for i, (a, b) in enumerate(zip(h_low, h_ref)):
        rows.append({"layer": i, "mixer": cfg.mixer(i), "ffn": cfg.ffn(i), "block": i // bs if bs else 0,
                     "block_start": bool(bs) and i % bs == 0, "error": rel_error(a, b),
                     "rms_fp32": float(b.pow(2).mean().sqrt())})
    top1 = (y_low.float().argmax(-1) == y_ref.argmax(-1)).float().mean().item()
    rows.append({"layer": cfg.num_hidden_layers, "mixer": "logits", "ffn": "", "block": None, "block_start": False,
                 "error": rel_error(y_low, y_ref), "rms_fp32": float(y_ref.double().pow(2).mean().sqrt()),
                 "top1_agreement": top1})
    df = pd.DataFrame(rows)
    df.attrs.update(preset=cfg.name, tokens=tokens, batch=batch, seed=seed)
    return df


# ====================================================================== the run


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _environment(device: str) -> dict[str, Any]:
    env = provenance(device)
    env["threads"] = torch.get_num_threads()
    return env


def _fits(cfg: ModelConfig, device: str) -> str | None:
    """None when the preset fits the device for this suite (fp32 + fp64 + bf16 + two fp64-rounded copies ≈ 26
    bytes per parameter), else the reason."""
    params = build_model(cfg, "meta").num_parameters()
    need = 26 * params
    if device.startswith("cuda"):
        free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = float("inf")
    if need > free:
        return f"{cfg.name} too large for {device}: needs ~{need / 1e9:.1f} GB for the fp32/bf16/fp64 copies, " \
               f"{free / 1e9:.1f} GB free"
    return None


class _Progress:
    """tqdm when asked for (notebooks get the widget version), else a no-op. In worker processes the same
    interface forwards (n, label) events to the parent through a queue."""

    def __init__(self, total: int, enabled: bool, queue: Any = None) -> None:
        self.bar, self.queue = None, queue
        if enabled and queue is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="validate", unit="cell", dynamic_ncols=True)

    def label(self, text: str) -> None:
        if self.queue is not None:
            self.queue.put((0, text))
        elif self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)

    def step(self, n: int = 1) -> None:
        if self.queue is not None:
            self.queue.put((n, None))
        elif self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _models_for(model32: KimiForCausalLM, dtype: torch.dtype) -> tuple[KimiForCausalLM, KimiForCausalLM]:
    """(model under test, fp64 oracle on exactly its weights): for bf16, the oracle holds the bf16-rounded weights."""
    if dtype == torch.float32:
        return model32, copy.deepcopy(model32).cast_(torch.float64)
    low = copy.deepcopy(model32).cast_(dtype)
    return low, copy.deepcopy(low).cast_(torch.float64)


def _harness_cells(model: KimiForCausalLM, ref64: KimiForCausalLM, preset: str) -> list[Cell]:
    """Self-checks of the harness itself: a planted NaN and inf are caught, and the stored-reference loop gives
    bit-identical errors to :func:`compare_to_reference` with ``reference=`` the fp64 model."""
    cells = []
    x = torch.randn(4, 32, dtype=torch.float64)
    for what, val in (("NaN", float("nan")), ("inf", float("inf"))):
        y = x.clone()
        y[1, 3] = val
        e = rel_error(y, x)
        ok = math.isinf(e) and not e <= TOL["fp32_stage"]
        cells.append(Cell("harness", preset, f"planted {what}", "-", "-", "-", "passed" if ok else "failed",
                          "" if ok else f"a planted {what} gave e = {e}", max_error=e))
    t0 = time.perf_counter()
    stage, batch, plen, steps, seed = "naive", 2, 5, 2, 12345
    try:
        direct = compare_to_reference(model, stage, batch, plen, steps, seed=seed, reference=ref64)
        stored = compare_with_trace(model, stage, reference_trace(ref64, batch, plen, steps, seed))
        same = direct.errors == stored.errors and direct.tokens_equal == stored.tokens_equal \
            and direct.reference == stored.reference == "naive float64"
        reason = "" if same else f"compare_to_reference errors {direct.errors} ({direct.reference}) vs stored " \
                                 f"reference {stored.errors} ({stored.reference})"
        cells.append(Cell("harness", preset, "reference path", "float32", batch, "-", "passed" if same else "failed",
                          reason, prompt_len=plen, steps=steps, seed=seed, max_error=direct.max_error,
                          reference=direct.reference, seconds=time.perf_counter() - t0))
    except Exception as e:  # noqa: BLE001
        cells.append(Cell("harness", preset, "reference path", "float32", batch, "-", "failed",
                          f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0))
    return cells


# -- units of work (each runs in the main process, or in a worker process when ``workers > 1``)

_WORKER_QUEUE: Any = None


def _init_worker(queue: Any) -> None:
    global _WORKER_QUEUE
    _WORKER_QUEUE = queue


def _unit_size(config: ValidationConfig, stages: list[str], seed_index: int) -> int:
    """Progress events one matrix unit (preset, seed, dtype) emits."""
    n = len(config.batch_sizes) * len(stages)
    return n * len(config.contexts) + (n if config.determinism and seed_index == 0 else 0)


def _run_task(task: tuple, config: ValidationConfig, stages: list[str], bar: _Progress | None = None) -> Any:
    """One unit: ("matrix", preset, seed index, dtype name) -> cells; ("hazards", presets, extra) -> DataFrame;
    ("drift",) -> DataFrame."""
    bar = bar or _Progress(0, False, _WORKER_QUEUE)
    with _threads(config.threads):
        kind = task[0]
        if kind == "matrix":
            return _matrix_unit(config, task[1], task[2], task[3], stages, bar)
        if kind == "hazards":
            bar.label("hazard checker")
            return hazard_table(task[1], config.batch_sizes, config.hazard_sms, config.hazard_policies,
                                config.hazard_max_seq_len, task[2], on_done=bar.step)
        if kind == "drift":
            bar.label(f"drift with depth ({config.drift_preset})")
            d = drift_with_depth(config.drift_preset, config.drift_tokens, config.drift_batch, device=config.device)
            bar.step()
            return d
    raise ValueError(f"unknown task {task!r}")


def run_validation(config: ValidationConfig | None = None, out_dir: str | Path | None = None,
                   progress: bool = True, workers: int | None = None) -> ValidationReport:
    """Run the whole matrix described by ``config`` (default: :func:`default_config`); write the report into
    ``out_dir`` when given. Never raises for a failing cell: failures are cells.

    ``workers``: processes for the matrix units (preset × seed × dtype), the hazard checker and the drift curve
    (default: up to 2 on a CPU — each runs single-threaded, which is what these small models like — and 1 on a
    GPU). Stages registered at run time only in this process (tests' fake stages) need ``workers=1``."""
    config = config or default_config()
    if workers is None:
        workers = 1 if config.device.startswith("cuda") else max(1, min(2, os.cpu_count() or 1))
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    with _threads(config.threads):
        env = _environment(config.device)
        env["workers"] = workers
        all_stages, broken = known_stages()
        wanted = list(config.stages) if config.stages is not None else all_stages
        unknown = [s for s in wanted if s not in all_stages and s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known: {', '.join(all_stages)}")
        cells: list[Cell] = [Cell("scope", "*", what, "*", "*", "*", "not-run", why) for what, why in config.not_run]
        for name, err in broken.items():
            if name in wanted:
                cells.append(Cell("accuracy", "*", name, "*", "*", "*", "not-run", f"{name}: import failed: {err}"))
        stages = [s for s in wanted if s not in broken]
        presets = []
        for p in config.presets:
            why = _fits(get_preset(p), config.device)
            if why:
                cells.append(Cell("accuracy", p, "*", "*", "*", "*", "not-run", why))
            else:
                presets.append(p)
        # longest first (bf16 runs a little longer than fp32 on a CPU), so two workers finish together
        order = sorted(config.dtypes, key=lambda d: d != "bfloat16")
        tasks: list[tuple] = [("matrix", p, si, d) for p in presets for si in range(len(config.seeds)) for d in order]
        sizes = [_unit_size(config, stages, t[2]) for t in tasks]
        hz_extra = [(p, max(config.hazard_sms)) for p in config.hazard_presets if p not in presets]
        if config.drift_tokens:
            tasks.append(("drift",))
            sizes.append(1)
        else:
            cells.append(Cell("drift", config.drift_preset, "naive", "bfloat16", "*", "*", "not-run",
                              "bf16 drift with depth disabled (--drift-tokens 0)"))
        if config.hazards:
            tasks.append(("hazards", presets, hz_extra))
            sizes.append((len(presets) * len(config.hazard_sms) * len(config.hazard_policies) + len(hz_extra))
                         * len(config.batch_sizes))
        else:
            cells.append(Cell("hazards", "*", "*", "-", "*", "*", "not-run",
                              "hazard checker disabled (--no-hazards)"))
        if not config.ep_runs:
            cells.append(Cell("expert-parallel", "*", "expert-parallel", "float32", "*", "*", "not-run",
                              "expert-parallel check disabled (--no-ep)"))
        bar = _Progress(sum(sizes) + len(config.ep_runs), progress)
        results: dict[int, Any] = {}
        ep_rows: list[dict[str, Any]] = []
        try:
            if workers <= 1:
                for i, task in enumerate(tasks):
                    t0 = time.perf_counter()
                    results[i] = _run_task(task, config, stages, bar)
                    timings[_task_name(task)] = time.perf_counter() - t0
                t0 = time.perf_counter()
                ep_rows = _ep_rows(config, cells, bar)
                timings["expert-parallel"] = time.perf_counter() - t0
            else:
                results, ep_rows = _run_parallel(tasks, config, stages, bar, workers, cells, timings)
        finally:
            bar.close()
        hazards, drift = pd.DataFrame(), None

        def config_order(it: tuple[int, tuple]) -> tuple:
            t = it[1]
            return (0, presets.index(t[1]), t[2], config.dtypes.index(t[3])) if t[0] == "matrix" else (1, it[0])

        for i, task in sorted(enumerate(tasks), key=config_order):
            if task[0] == "matrix":
                cells += results[i]
            elif task[0] == "hazards":
                hazards = results[i]
                for r in hazards.to_dict("records"):
                    cells.append(Cell("hazards", r["preset"], f"megakernel program ({r['policy']}, {r['num_sms']} SMs)",
                                      "-", r["batch"], f"max_seq_len {config.hazard_max_seq_len}", r["status"],
                                      r["reason"], seconds=r["seconds"]))
            elif task[0] == "drift":
                drift = results[i]
        fig = drift_figure(drift) if drift is not None else None
    env["seconds_by_part"] = {k: round(v, 1) for k, v in timings.items()}
    report = ValidationReport(config, _ordered(cells), hazards, pd.DataFrame(ep_rows), drift, env,
                              time.perf_counter() - t_start, drift_fig=fig)
    if out_dir is not None:
        report.write(out_dir)
    return report


_CHECK_ORDER = {c: i for i, c in enumerate(("scope", "harness", "support", "accuracy", "determinism", "hazards",
                                            "expert-parallel", "drift"))}


def _ordered(cells: list[Cell]) -> list[Cell]:
    return sorted(cells, key=lambda c: _CHECK_ORDER.get(c.check, 99))  # stable: run order within a check


def _task_name(task: tuple) -> str:
    return task[0] if task[0] != "matrix" else f"matrix {task[1]} seed#{task[2]} {task[3]}"


def _ep_rows(config: ValidationConfig, cells: list[Cell], bar: _Progress) -> list[dict[str, Any]]:
    rows = []
    with _threads(config.threads):
        for world, batch in config.ep_runs:
            bar.label(f"expert-parallel world {world} batch {batch}")
            rows.append(_ep_cell(config, world, batch, cells))
            bar.step()
    return rows


def _run_parallel(tasks: list[tuple], config: ValidationConfig, stages: list[str], bar: _Progress, workers: int,
                  cells: list[Cell], timings: dict[str, float]) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """Tasks on a spawn-started process pool; progress events come back through a queue drained by a thread;
    the expert-parallel runs (which start processes of their own) run in this process meanwhile."""
    import multiprocessing as mp
    import threading
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set() or not queue.empty():
            try:
                n, label = queue.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty, or the queue closed at shutdown
                continue
            if label:
                bar.label(label)
            if n:
                bar.step(n)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    results: dict[int, Any] = {}
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(queue,)) as pool:
            t0 = time.perf_counter()
            futures = {i: pool.submit(_timed_task, t, config, stages) for i, t in enumerate(tasks)}
            ep_rows = _ep_rows(config, cells, bar)
            timings["expert-parallel"] = time.perf_counter() - t0
            for i, f in futures.items():
                results[i], timings[_task_name(tasks[i])] = f.result()
    finally:
        stop.set()
        thread.join(timeout=5)
    return results, ep_rows


def _timed_task(task: tuple, config: ValidationConfig, stages: list[str]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return _run_task(task, config, stages), time.perf_counter() - t0


def _ep_cell(config: ValidationConfig, world: int, batch: int, cells: list[Cell]) -> dict[str, Any]:
    preset = config.presets[0] if config.presets else "micro"
    t0 = time.perf_counter()
    try:
        r = _expert_parallel(preset, world, batch, config.ep_steps, config.ep_prompt_len, seed=config.seeds[0])
        reason = "" if r["ok"] else (
            f"e = {r['max_error']:.2e} (tolerance {TOL['expert_parallel']:.0e}); tokens match single process: "
            f"{r['tokens_match_single_process']}; ranks agree: {r['ranks_agree']}")
        cells.append(Cell("expert-parallel", preset, f"expert-parallel (world {world})", "float32", batch,
                          f"prompt {config.ep_prompt_len}", "passed" if r["ok"] else "failed", reason,
                          prompt_len=config.ep_prompt_len, steps=config.ep_steps, seed=config.seeds[0],
                          max_error=r["max_error"], tolerance=TOL["expert_parallel"],
                          tokens_equal=r["tokens_match_single_process"], mode="greedy", reference="naive float32",
                          seconds=time.perf_counter() - t0))
        return r
    except Exception as e:  # noqa: BLE001
        cells.append(Cell("expert-parallel", preset, f"expert-parallel (world {world})", "float32", batch,
                          f"prompt {config.ep_prompt_len}", "failed", f"{type(e).__name__}: {e}",
                          seconds=time.perf_counter() - t0))
        return {"preset": preset, "world": world, "batch": batch, "ok": False, "error": f"{type(e).__name__}: {e}"}


def _matrix_unit(config: ValidationConfig, preset: str, si: int, dname: str, stages: list[str], bar: _Progress
                 ) -> list[Cell]:
    """Every accuracy / determinism / support cell of one (preset, seed, dtype)."""
    cells: list[Cell] = []
    seed = config.seeds[si]
    dtype = _DTYPES[dname]
    model32 = from_preset(preset, seed=seed, device=config.device)
    model, ref64 = _models_for(model32, dtype)
    del model32
    if si == 0 and dtype == torch.float32:
        cells += _harness_cells(model, ref64, preset)
    runnable = []
    for stage in stages:
        for batch in config.batch_sizes:
            bar.label(f"{preset} {_SHORT[dname]} B={batch}: support of {stage}")
            refusal = support_refusal(stage, model, batch)
            if refusal is None:
                runnable.append((stage, batch))
                continue
            if si == 0:
                status, why = refusal
                cells.append(Cell("support", preset, stage, dname, batch, "*", status, why))
            bar.step(len(config.contexts) + (1 if config.determinism and si == 0 else 0))
    for batch in config.batch_sizes:
        here = [s for s, b in runnable if b == batch]
        if "naive" in here:  # first, so every cell of this group can report the router flips
            here = ["naive"] + [s for s in here if s != "naive"]
        for ci, (ctx, plen) in enumerate(config.contexts):
            if not here:
                continue
            bar.label(f"{preset} seed {seed} {_SHORT[dname]} B={batch} {ctx}: fp64 reference")
            t0 = time.perf_counter()
            trace = reference_trace(ref64, batch, plen, config.steps, 1000 * seed + batch,
                                    record_routes="naive" in here)
            t_ref = time.perf_counter() - t0
            naive_routes: list[torch.Tensor] | None = None
            for stage in here:
                bar.label(f"{preset} seed {seed} {_SHORT[dname]} B={batch} {ctx}: {stage}")
                want_det = config.determinism and si == 0 and ci == 0
                cell, det = _accuracy_cell(model, stage, trace, preset, dname, batch, ctx, plen, config.steps, seed,
                                           want_det, t_ref / len(here), record_routes=stage == "naive")
                if stage == "naive":
                    naive_routes = det.pop("routes", None)
                cell.router_flips = _route_flips(trace.routes, naive_routes)
                if cell.status == "failed" and cell.router_flips is not None and "router" not in cell.reason:
                    cell.reason += f"; router top-k sets differing from fp64: {_fmt_pct(cell.router_flips)} of routings"
                cells.append(cell)
                bar.step()
                if want_det and cell.status == "not-run":
                    cells.append(Cell("determinism", preset, stage, dname, batch, ctx, "not-run",
                                      f"accuracy cell not run ({cell.reason})", prompt_len=plen, steps=config.steps,
                                      seed=seed))
                    bar.step()
                elif want_det:
                    cells.append(_determinism_cell(model, stage, trace, preset, dname, batch, ctx, plen,
                                                   config.steps, seed, det))
                    bar.step()
    return cells


def _accuracy_cell(model: KimiForCausalLM, stage: str, trace: ReferenceTrace, preset: str, dname: str, batch: int,
                   ctx: str, plen: int, steps: int, seed: int, keep_outputs: bool, ref_seconds: float,
                   record_routes: bool = False) -> tuple[Cell, dict[str, Any]]:
    t0 = time.perf_counter()
    base = dict(check="accuracy", preset=preset, stage=stage, dtype=dname, batch=batch, context=ctx,
                prompt_len=plen, steps=steps, seed=seed)
    det: dict[str, Any] = {}
    routes: list[torch.Tensor] | None = [] if record_routes else None
    try:
        res, outs, poisoned = run_stage(model, stage, trace, stop_on_token_mismatch=True, routes=routes)
    except _Refused as e:
        return Cell(**base, status="not-run", reason=f"{stage}: refused at construction: {e}",
                    seconds=time.perf_counter() - t0), det
    except Exception as e:  # noqa: BLE001 - a crashing stage is a failed cell, not a crashed suite
        return Cell(**base, status="failed", reason=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0), det
    nonfinite = sum(int((~torch.isfinite(o)).sum()) for o in outs)
    if keep_outputs and len(outs) == trace.steps + 1:
        det["outputs"] = outs
    if routes is not None:
        det["routes"] = routes
    status = "passed" if res.passed and not nonfinite else "failed"
    flips = None
    cell = Cell(**base, status=status, reason="" if status == "passed" else _accuracy_reason(res, nonfinite, flips),
                max_error=res.max_error, tolerance=res.tolerance, top1_agreement=res.top1_agreement,
                tokens_equal=res.tokens_equal if res.mode == "greedy" else None, nonfinite=nonfinite,
                poisoned=poisoned, mode=res.mode, reference=res.reference,
                seconds=time.perf_counter() - t0 + ref_seconds, errors=list(res.errors))
    return cell, det


def _determinism_cell(model: KimiForCausalLM, stage: str, trace: ReferenceTrace, preset: str, dname: str,
                      batch: int, ctx: str, plen: int, steps: int, seed: int, det: dict[str, Any]) -> Cell:
    base = dict(check="determinism", preset=preset, stage=stage, dtype=dname, batch=batch, context=ctx,
                prompt_len=plen, steps=steps, seed=seed, mode="run twice, torch.equal")
    cls = get_stage(stage)
    if not cls.support.deterministic:
        return Cell(**base, status="not-run", reason=f"{stage}: declares itself nondeterministic (atomics / "
                                                     "unordered reductions): held to the tolerance only")
    # a stage with an interleaving / scheduling seed (megakernel-interp) runs the second time under another one:
    # its determinism claim is "whatever the interleaving"
    other = {"seed": 1} if "seed" in inspect.signature(cls.__init__).parameters else {}
    if other:
        base["mode"] = "run twice (second under seed=1), torch.equal"
    t0 = time.perf_counter()
    try:
        first = det.get("outputs")
        if first is None:  # the accuracy run stopped early (tokens diverged) or failed: two fresh runs
            _, first, _ = run_stage(model, stage, trace, stop_on_token_mismatch=False)
        _, second, _ = run_stage(model, stage, trace, stop_on_token_mismatch=False, **other)
    except Exception as e:  # noqa: BLE001
        return Cell(**base, status="failed", reason=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    for s, (a, b) in enumerate(zip(first, second)):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            diff = diff[torch.isfinite(diff)]
            worst = float(diff.max()) if diff.numel() else float("nan")
            return Cell(**base, status="failed", reason=f"declared deterministic, but run 2 differs from run 1 at "
                                                        f"step {s} (max |Δ| = {worst:.3e})",
                        seconds=time.perf_counter() - t0)
    return Cell(**base, status="passed", seconds=time.perf_counter() - t0)
