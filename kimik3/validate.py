"""The correctness matrix: every stage × preset × dtype × batch × context × seed against an fp64 oracle, with a report.

Why a matrix and not a handful of tests: each optimisation stage claims to compute the same function as the
reference over a *space* (dtypes, batch sizes, padded prompts, context lengths, devices) and declares that space in
its :class:`~kimik3.stages.base.StageSupport`. A bug lives in a corner (batch 33 rows, a context longer than a
tile, bf16), so the suite walks the whole declared space, checks every cell against one reference with the rules
of ``shared/spec/validation.md`` and says, cell by cell, what passed, what failed and what was not run and why.

What one run checks (``python -m kimik3 validate [--quick]``, or :func:`run_validation`):

* **accuracy** — per cell, the stage against stage ``naive`` run in **float64** on the same weights
  (``copy.deepcopy(model).cast_(torch.float64)``; for bf16 cells on the bf16-rounded weights). fp32: greedy,
  ``e ≤ TOL["fp32_stage"]`` per step and identical greedy tokens; bf16: teacher-forced, ``e ≤ TOL["bf16_stage"]``
  per step, top-1 agreement reported. Prompts are right-padded to mixed lengths (:func:`mixed_lengths`). The
  fp64 reference run of a (preset, seed, dtype, batch, context) is computed once and shared by every stage; the
  comparison loop is :func:`kimik3.validation.compare_to_reference`'s, applied to the stored reference, and every
  run checks that both give bit-identical errors on one cell (harness row "reference path").
* **poisoned state, NaN/inf** — every decode-state tensor a stage holds is filled with NaN before its prefill,
  so state the stage reads without writing shows up as NaN; any NaN/inf in an output fails the cell
  (``rel_error`` is inf). Harness rows check that a planted NaN and a planted inf are caught.
* **determinism** — stages whose support says ``deterministic`` run the short-context cell twice (fresh decoders,
  same inputs) and must agree bitwise (``torch.equal``); the others are listed as not run, with why.
* **support** — cells outside a stage's declared support are not run; the suite *verifies* that building the
  decoder there raises ``ValueError`` (fail closed) and reports the refusal message. A stage that accepts a
  configuration it does not declare fails.
* **hazards** — the megakernel hazard checker (:func:`kimik3.megakernel.check_program`) over the programs for
  every batch size (both scheduling policies, the CPU interpreter's 8 queues and an H100/H200's 132 SMs; also
  ``k3-shard``, the single-GPU target, at 132 SMs).
* **expert-parallel** — :func:`kimik3.distributed.run_local` on real gloo process groups against a single
  process, ``e ≤ TOL["expert_parallel"]`` and identical greedy tokens.
* **bf16 drift with depth** — ``k3-deep-tiny`` (K3's 93-layer pattern): the error of every layer's output in bf16
  against fp32 on the same bf16-rounded weights, a curve; reported, not bounded.

The report (:class:`ValidationReport`) is a pandas table plus a self-contained HTML file (``report.html``, plotly.js
inline) and ``cells.csv`` / ``summary.json`` in the run folder. The CLI exits 0 only if every cell that ran
passed (``--report-only``: always 0).

Known issue, reported as it is: on random-weight presets bf16 rounding can flip near-tied top-k expert choices, so
bf16 cells can exceed ``TOL["bf16_stage"]``; such cells fail with the measured error, the top-1 agreement and the
measured fraction of router top-k sets that differ from the fp64 reference (column ``router_flips``, from the
``naive`` stage's run of the same prompts). Tolerances are not loosened here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as _dt
import html
import inspect
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kimik3.config import ModelConfig, get_preset
from kimik3.decoder import Decoder
from kimik3.init import build_model, from_preset
from kimik3.model import DecodeState, KDAState, KimiForCausalLM, MLACache, Router
from kimik3.stages import STAGES, get_stage
from kimik3.stages.base import Stage
from kimik3.tolerances import TOL, poison, rel_error
from kimik3.validation import StageComparison, compare_to_reference, mixed_lengths

__all__ = [
    "CHUNK_TOKENS",
    "CELL_COLUMNS",
    "Cell",
    "ReferenceTrace",
    "ValidationConfig",
    "ValidationReport",
    "compare_with_trace",
    "default_config",
    "drift_figure",
    "drift_with_depth",
    "error_figure",
    "hazard_table",
    "known_stages",
    "main",
    "poison_stage_state",
    "quick_config",
    "reference_trace",
    "run_validation",
    "support_refusal",
    "support_table",
]

# The longest context tile any stage uses: the GPU MLA decode kernel splits each sequence into slices of at least
# 64 tokens (kernels/mla_decode.py ``default_splits``), the CPU megakernel splits the cache in >= 2 parts; naive,
# absorbed and compiled attend over the whole cache. Every context but "short" is longer than this.
CHUNK_TOKENS = 64

STATUSES = ("passed", "failed", "not-run")
CELL_COLUMNS = ["check", "preset", "stage", "dtype", "batch", "context", "prompt_len", "steps", "seed", "status",
                "reason", "max_error", "tolerance", "top1_agreement", "tokens_equal", "router_flips", "nonfinite",
                "poisoned", "mode", "reference", "seconds"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


# ====================================================================== configuration


@dataclass(frozen=True)
class ValidationConfig:
    """What one validation run covers. ``contexts``: (name, prompt tokens) — the padded prompt width; each row's
    own length is drawn in [width/2, width] (the first row is full length). ``not_run``: (what, why) pairs the run
    deliberately leaves out (e.g. ``("preset tiny", "tiny skipped: --quick")``), listed in the report."""

    presets: tuple[str, ...] = ("micro",)
    stages: tuple[str, ...] | None = None  # None: every registered stage
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    batch_sizes: tuple[int, ...] = (1, 2, 8, 33, 64)
    contexts: tuple[tuple[str, int], ...] = (("short", 8), ("over-chunk", 72), ("long", 200))
    steps: int = 8
    seeds: tuple[int, ...] = (0, 1)
    device: str = "cpu"
    determinism: bool = True
    hazards: bool = True
    hazard_presets: tuple[str, ...] = ("k3-shard",)  # checked at 132 SMs in addition to ``presets``
    hazard_sms: tuple[int, ...] = (8, 132)
    hazard_policies: tuple[str, ...] = ("critical_path", "round_robin")
    hazard_max_seq_len: int = 4096
    ep_runs: tuple[tuple[int, int], ...] = ((2, 1), (2, 8), (2, 33), (4, 8))  # (world, batch), fp32
    ep_steps: int = 8
    ep_prompt_len: int = 8
    drift_preset: str = "k3-deep-tiny"
    drift_tokens: int = 16  # 0: skip the drift curve
    drift_batch: int = 1
    threads: int | None = 1  # torch intra-op threads during the run (small models: 1 is fastest on 2 cores)
    quick: bool = False
    not_run: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for d in self.dtypes:
            if d not in _DTYPES:
                raise ValueError(f"unknown dtype {d!r}; use float32 / bfloat16")
        for b in self.batch_sizes:
            if not isinstance(b, int) or b < 1:
                raise ValueError(f"batch sizes must be positive ints, got {b!r}")
        for name, n in self.contexts:
            if n < 1:
                raise ValueError(f"context {name!r}: prompt width must be >= 1, got {n}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        for p in (*self.presets, *self.hazard_presets):
            get_preset(p)  # unknown names raise with the list of known ones

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_config(presets: Sequence[str] | None = None, device: str | None = None, **overrides: Any
                   ) -> ValidationConfig:
    """The full matrix: two seeds, three contexts, 8 steps, every batch size; ``micro`` on a CPU (``tiny`` when
    asked for: it takes hours there), ``micro`` and ``tiny`` on a GPU."""
    device = device or _default_device()
    presets = tuple(presets) if presets else (("micro",) if device == "cpu" else ("micro", "tiny"))
    not_run = tuple((f"preset {p}", f"{p} not requested (pass --presets {','.join((*presets, p))})")
                    for p in ("micro", "tiny") if p not in presets)
    return dataclasses.replace(ValidationConfig(presets=presets, device=device, not_run=not_run), **overrides)


def quick_config(device: str | None = None, **overrides: Any) -> ValidationConfig:
    """The CI subset: ``micro`` only, one seed, 2 steps, the short and one long context (72 tokens, longer than any
    internal chunk), still every stage × dtype × batch the device supports; fewer hazard programs, one
    expert-parallel run and a 4-token drift curve."""
    device = device or _default_device()
    cfg = ValidationConfig(
        presets=("micro",), contexts=(("short", 8), ("long", 72)), steps=2, seeds=(0,), device=device,
        hazard_sms=(8, 132), hazard_policies=("critical_path",), ep_runs=((2, 8),), ep_steps=4, drift_tokens=4,
        quick=True,
        not_run=(("preset tiny", "tiny skipped: --quick"),
                 ("context over-chunk", "over-chunk context skipped: --quick (its 'long' context, 72 tokens, is "
                                        f"already longer than every internal chunk of {CHUNK_TOKENS} tokens)"),
                 ("seed 1", "seed 1 skipped: --quick (one seed)"),
                 ("hazards round_robin", "round_robin scheduling policy skipped: --quick")))
    return dataclasses.replace(cfg, **overrides)


# ====================================================================== cells and the report


@dataclass
class Cell:
    """One row of the report: a check of one configuration, with status ``passed`` / ``failed`` / ``not-run``
    and, unless it passed, the reason. ``"*"`` in a field means "every value of it" (e.g. a refusal that holds
    for every context)."""

    check: str
    preset: str
    stage: str
    dtype: str
    batch: int | str
    context: str
    status: str
    reason: str = ""
    prompt_len: int | str = "*"
    steps: int | str = "*"
    seed: int | str = "*"
    max_error: float | None = None
    tolerance: float | None = None
    top1_agreement: float | None = None
    tokens_equal: bool | None = None
    router_flips: float | None = None
    nonfinite: int | None = None
    poisoned: int | None = None
    mode: str = ""
    reference: str = ""
    seconds: float = 0.0
    errors: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"cell status must be one of {STATUSES}, got {self.status!r}")
        if self.status != "passed" and not self.reason:
            raise ValueError(f"a {self.status} cell needs a reason ({self.check}/{self.stage})")

    def row(self) -> dict[str, Any]:
        return {c: getattr(self, c) for c in CELL_COLUMNS}


@dataclass
class ValidationReport:
    """Everything a run produced. ``cells`` is the matrix; ``hazards``, ``expert_parallel`` and ``drift`` are the
    per-section tables (the first two also contribute cells); ``files`` what was written to ``out_dir``."""

    config: ValidationConfig
    cells: list[Cell]
    hazards: pd.DataFrame
    expert_parallel: pd.DataFrame
    drift: pd.DataFrame | None
    environment: dict[str, Any]
    seconds: float
    drift_fig: Any = None
    files: dict[str, Path] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """One row per cell, columns :data:`CELL_COLUMNS`."""
        return pd.DataFrame([c.row() for c in self.cells], columns=CELL_COLUMNS)

    def summary(self) -> pd.DataFrame:
        """Cells per check and status (rows: checks; columns: passed / failed / not-run / total)."""
        t = self.table()
        s = pd.crosstab(t["check"], t["status"]).reindex(columns=list(STATUSES), fill_value=0)
        s["total"] = s.sum(axis=1)
        s.loc["all"] = s.sum()
        return s

    def accuracy_summary(self) -> pd.DataFrame:
        """Accuracy cells per (preset, stage, dtype): counts by status and the worst error / lowest agreement."""
        t = self.table()
        t = t[t["check"] == "accuracy"]
        if t.empty:
            return pd.DataFrame()
        g = t.groupby(["preset", "stage", "dtype"], sort=False)
        out = pd.DataFrame({s: g["status"].apply(lambda x, s=s: int((x == s).sum())) for s in STATUSES})
        out["worst_error"] = g["max_error"].max()
        out["tolerance"] = g["tolerance"].max()
        out["min_top1_agreement"] = g["top1_agreement"].min()
        return out

    def failures(self) -> pd.DataFrame:
        t = self.table()
        return t[t["status"] == "failed"].reset_index(drop=True)

    def not_run(self) -> pd.DataFrame:
        """Not-run cells grouped by (check, stage, reason), with how many cells each covers."""
        t = self.table()
        t = t[t["status"] == "not-run"]
        if t.empty:
            return pd.DataFrame(columns=["check", "stage", "reason", "cells"])
        return (t.groupby(["check", "stage", "reason"], sort=False).size().rename("cells").reset_index())

    @property
    def passed(self) -> bool:
        """True when no cell that ran failed."""
        return not any(c.status == "failed" for c in self.cells)

    def exit_code(self, report_only: bool = False) -> int:
        return 0 if (report_only or self.passed) else 1

    def to_html(self, path: str | Path) -> Path:
        """Write the self-contained HTML report (no external resources; the drift figure with plotly.js inline)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(_render_html(self), encoding="utf-8")
        return p

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """``report.html``, ``cells.csv``, ``summary.json`` (and ``drift_with_depth.html`` / ``drift.csv``)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = {"report": self.to_html(out / "report.html")}
        t = self.table()
        t.to_csv(out / "cells.csv", index=False)
        files["cells"] = out / "cells.csv"
        if self.drift is not None:
            self.drift.to_csv(out / "drift.csv", index=False)
            files["drift_csv"] = out / "drift.csv"
            if self.drift_fig is not None:
                self.drift_fig.write_html(str(out / "drift_with_depth.html"), include_plotlyjs=True, full_html=True)
                files["drift_figure"] = out / "drift_with_depth.html"
        summary = {"passed": self.passed, "seconds": round(self.seconds, 1), "environment": self.environment,
                   "config": _jsonable(self.config.as_dict()),
                   "counts": {k: {s: int(v) for s, v in row.items()} for k, row in self.summary().iterrows()},
                   "failed": t[t["status"] == "failed"][["check", "preset", "stage", "dtype", "batch", "context",
                                                         "seed", "reason"]].to_dict("records")}
        (out / "summary.json").write_text(json.dumps(_jsonable(summary), indent=1))
        files["summary"] = out / "summary.json"
        self.files = files
        return files


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        try:
            return x.item()
        except (ValueError, AttributeError):
            return str(x)
    return x


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


# ====================================================================== the reference and one comparison


@dataclass
class ReferenceTrace:
    """The fp64 ``naive`` reference for one (model, batch, prompt, steps): its own greedy decode, teacher-forcing
    nothing. ``logits[s]`` [B, V] is step ``s`` (0 = prefill); ``tokens[s]`` its argmax (what every stage is fed)."""

    ids: torch.Tensor
    lengths: list[int]
    steps: int
    logits: list[torch.Tensor]
    reference: str
    routes: list[torch.Tensor] | None = None

    @property
    def tokens(self) -> list[torch.Tensor]:
        return [a.argmax(-1) for a in self.logits]

    @property
    def max_seq_len(self) -> int:
        return self.ids.shape[1] + self.steps + 1


@contextlib.contextmanager
def _record_routes(model: KimiForCausalLM) -> Iterator[list[torch.Tensor]]:
    """Record the expert ids every router call of ``model`` returns, in call order."""
    out: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: out.append(o[1].detach().sort(-1).values.cpu()))
             for m in model.modules() if isinstance(m, Router)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def _prompt(vocab: int, batch: int, prompt_len: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Exactly :func:`compare_to_reference`'s prompt for ``seed``: mixed lengths, ids from generator ``seed + 1``."""
    lengths = mixed_lengths(batch, prompt_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g), lengths


@torch.no_grad()
def reference_trace(ref_model: KimiForCausalLM, batch: int, prompt_len: int, steps: int, seed: int,
                    record_routes: bool = False) -> ReferenceTrace:
    """Run stage ``naive`` on ``ref_model`` (the fp64 oracle) greedily, as :func:`compare_to_reference` does."""
    ids, lengths = _prompt(ref_model.config.vocab_size, batch, prompt_len, seed)
    dec = Decoder(ref_model, "naive", batch_size=batch, max_seq_len=prompt_len + steps + 1)
    with _record_routes(ref_model) if record_routes else contextlib.nullcontext() as routes:
        a = dec.prefill(ids.to(ref_model.device), lengths)
        logits = [a]
        for _ in range(steps):
            a = dec.step(a.argmax(-1))
            logits.append(a)
    return ReferenceTrace(ids, lengths, steps, [x.cpu() for x in logits],
                          f"naive {str(ref_model.dtype).replace('torch.', '')}", routes if record_routes else None)


def poison_stage_state(stage: Stage) -> int:
    """NaN-fill every decode-state tensor ``stage`` holds (its ``DecodeState`` attributes, and those of stages it
    wraps). A correct stage (re)writes all state its prefill reads; one that relies on zero-initialised buffers
    it never reset reads NaN and fails. Returns how many tensors were poisoned."""
    seen: set[int] = set()
    n = 0

    def visit(obj: Any, depth: int) -> None:
        nonlocal n
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        if isinstance(obj, DecodeState):
            for s in obj.layers:
                for t in ((s.S, s.conv) if isinstance(s, KDAState) else (s.latent, s.k_r) if isinstance(s, MLACache)
                          else ()):
                    poison(t)
                    n += 1
        elif isinstance(obj, Stage):
            for v in vars(obj).values():
                if isinstance(v, (DecodeState, Stage)):
                    visit(v, depth + 1)

    visit(stage, 0)
    return n


class _Refused(Exception):
    """A stage refused to build (``ValueError`` from its constructor): the cell is not run, with the message."""


@torch.no_grad()
def _run_stage(model: KimiForCausalLM, stage: str, trace: ReferenceTrace, stop_on_token_mismatch: bool,
               routes: list[torch.Tensor] | None = None, **stage_options: Any
               ) -> tuple[StageComparison, list[torch.Tensor], int]:
    """The loop of :func:`compare_to_reference` against a stored reference; also returns the stage's logits per
    step and how many state tensors were poisoned before its prefill."""
    bf16 = model.dtype == torch.bfloat16
    B = trace.ids.shape[0]
    try:
        dut = Decoder(model, stage, batch_size=B, max_seq_len=trace.max_seq_len, **stage_options)
    except ValueError as e:
        raise _Refused(str(e)) from e
    poisoned = poison_stage_state(dut.stage)
    res = StageComparison(stage=stage, dtype=str(model.dtype).replace("torch.", ""), batch_size=B,
                          prompt_lengths=list(trace.lengths), steps=trace.steps,
                          mode="teacher-forced" if bf16 else "greedy",
                          tolerance=TOL["bf16_stage"] if bf16 else TOL["fp32_stage"], reference=trace.reference)
    outs: list[torch.Tensor] = []
    with _record_routes(model) if routes is not None else contextlib.nullcontext() as rec:
        b = dut.prefill(trace.ids.to(model.device), trace.lengths)
        agree = []
        for s in range(trace.steps + 1):
            a = trace.logits[s]
            outs.append(b.detach().cpu())
            res.errors.append(rel_error(b, a))
            ref_tok, dut_tok = a.argmax(-1), b.float().argmax(-1).cpu()
            agree.append((ref_tok == dut_tok).float().mean().item())
            if not bf16 and not torch.equal(ref_tok, dut_tok):
                res.tokens_equal = False
                if stop_on_token_mismatch:
                    break
            if s < trace.steps:
                b = dut.step(ref_tok.to(model.device))
    if routes is not None:
        routes.extend(rec)
    res.top1_agreement = sum(agree) / len(agree)
    return res, outs, poisoned


def compare_with_trace(model: KimiForCausalLM, stage: str, trace: ReferenceTrace, **stage_options: Any
                       ) -> StageComparison:
    """:func:`kimik3.validation.compare_to_reference` with the reference run taken from ``trace`` (same prompt,
    same loop, same rules): what lets one fp64 reference run serve every stage."""
    return _run_stage(model, stage, trace, True, **stage_options)[0]


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
    from kimik3.distributed import run_local, traffic_model

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


def drift_figure(drift: pd.DataFrame) -> Any:
    """Error per layer (log scale), KDA and MLA layers marked, AttnRes block starts as dotted lines."""
    import plotly.graph_objects as go

    layers = drift[drift["mixer"] != "logits"]
    fig = go.Figure()
    fig.add_scatter(x=layers["layer"], y=layers["error"], mode="lines", name="layer output", line=dict(color="#999"),
                    hoverinfo="skip")
    for kind, color in (("kda", "#1f77b4"), ("mla", "#d62728")):
        g = layers[layers["mixer"] == kind]
        fig.add_scatter(x=g["layer"], y=g["error"], mode="markers", name=f"{kind.upper()} layer",
                        marker=dict(color=color, size=6),
                        hovertemplate="layer %{x}<br>e = %{y:.3e}<extra>" + kind.upper() + "</extra>")
    last = drift[drift["mixer"] == "logits"]
    if not last.empty:
        fig.add_scatter(x=last["layer"], y=last["error"], mode="markers", name="logits",
                        marker=dict(color="black", symbol="star", size=11),
                        hovertemplate="logits<br>e = %{y:.3e}<extra></extra>")
    for x in layers.loc[layers["block_start"], "layer"]:
        fig.add_vline(x=x, line=dict(color="#bbb", dash="dot", width=1))
    fig.add_hline(y=TOL["bf16_stage"], line=dict(color="#2ca02c", dash="dash", width=1),
                  annotation_text="TOL bf16_stage (micro/tiny logits; not a bound here)",
                  annotation_position="top left")
    a = drift.attrs
    fig.update_yaxes(type="log", title="e(bf16, fp32) of the layer output")
    fig.update_xaxes(title="layer (dotted: AttnRes block starts)")
    fig.update_layout(template="plotly_white", height=440,
                      title=f"bf16 drift with depth: {a.get('preset', '')}, {a.get('tokens', '?')} tokens × batch "
                            f"{a.get('batch', '?')}, seed {a.get('seed', '?')} (reported, not bounded)")
    return fig


def error_figure(report: ValidationReport) -> Any:
    """Heatmap of the accuracy cells: worst ``e`` over seeds divided by the cell's tolerance (log colour, 1 =
    the bound), rows stage × dtype, columns batch × context; hover shows status and top-1 agreement."""
    import numpy as np
    import plotly.graph_objects as go

    t = report.table()
    t = t[(t["check"] == "accuracy") & (t["status"] != "not-run")].copy()
    fig = go.Figure()
    if t.empty:
        return fig.update_layout(title="no accuracy cells ran")
    t["ratio"] = t["max_error"].astype(float) / t["tolerance"].astype(float)
    t["row"] = t["preset"] + " · " + t["stage"] + " · " + t["dtype"].map(lambda d: _SHORT.get(d, d))
    t["col"] = "B=" + t["batch"].astype(str) + " " + t["context"]
    t["failed"] = t["status"] == "failed"
    g = t.groupby(["row", "col"], sort=False).agg(ratio=("ratio", "max"), failed=("failed", "sum"),
                                                   top1=("top1_agreement", "min")).reset_index()
    rows, cols = list(dict.fromkeys(t["row"])), list(dict.fromkeys(t["col"]))
    z = np.full((len(rows), len(cols)), np.nan)
    text = [["" for _ in cols] for _ in rows]
    for r in g.to_dict("records"):
        i, j = rows.index(r["row"]), cols.index(r["col"])
        z[i, j] = np.log10(max(r["ratio"], 1e-6)) if math.isfinite(r["ratio"]) else 3.0
        text[i][j] = f"e/tol {r['ratio']:.2g}<br>top-1 {r['top1']:.0%}" + ("<br><b>FAILED</b>" if r["failed"] else "")
    fig.add_heatmap(z=z, x=cols, y=rows, text=text, hovertemplate="%{y}<br>%{x}<br>%{text}<extra></extra>",
                    colorscale=[[0, "#2166ac"], [0.5, "#f7f7f7"], [0.75, "#fdae61"], [1, "#b2182b"]], zmin=-3, zmax=1,
                    colorbar=dict(title="log10 e/tol", tickvals=[-3, -2, -1, 0, 1],
                                  ticktext=["1e-3", "1e-2", "0.1", "1 (bound)", "10"]))
    fig.update_layout(template="plotly_white", height=120 + 28 * len(rows),
                      title="Worst per-step error over the tolerance, every accuracy cell (red ≥ 1: failed)")
    return fig


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


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=5)
        return out.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "") if out.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _environment(device: str) -> dict[str, Any]:
    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": _git_commit(),
           "torch": torch.__version__, "python": platform.python_version(), "device": device,
           "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
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
        res, outs, poisoned = _run_stage(model, stage, trace, stop_on_token_mismatch=True, routes=routes)
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
    # a stage with an interleaving / scheduling seed (megakernel-cpu) runs the second time under another one:
    # its determinism claim is "whatever the interleaving"
    other = {"seed": 1} if "seed" in inspect.signature(cls.__init__).parameters else {}
    if other:
        base["mode"] = "run twice (second under seed=1), torch.equal"
    t0 = time.perf_counter()
    try:
        first = det.get("outputs")
        if first is None:  # the accuracy run stopped early (tokens diverged) or failed: two fresh runs
            _, first, _ = _run_stage(model, stage, trace, stop_on_token_mismatch=False)
        _, second, _ = _run_stage(model, stage, trace, stop_on_token_mismatch=False, **other)
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


# ====================================================================== HTML


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4;position:sticky;top:0}
tr.passed td.status{background:#dff0d8}tr.failed td.status{background:#f2dede;font-weight:bold}
tr.not-run td.status{background:#eee;color:#666}
.badge{display:inline-block;padding:2px 8px;border-radius:4px;color:#fff;font-weight:bold}
.ok{background:#3c763d}.bad{background:#a94442}.note{background:#fcf8e3;padding:8px;border:1px solid #faebcc}
code{background:#f4f4f4;padding:0 3px}
"""


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.3e}" if (abs(v) < 1e-2 or abs(v) >= 1e4 or math.isinf(v)) else f"{v:.4g}"
    return str(v)


def _table_html(df: pd.DataFrame, status_col: str | None = "status") -> str:
    if df is None or df.empty:
        return "<p><i>none</i></p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    rows = []
    for rec in df.to_dict("records"):
        cls = html.escape(str(rec.get(status_col, ""))) if status_col else ""
        tds = "".join(f"<td class='{html.escape(str(c))}'>{html.escape(_fmt(rec[c]))}</td>" for c in df.columns)
        rows.append(f"<tr class='{cls}'>{tds}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _render_html(r: ValidationReport) -> str:
    t = r.table()
    cfg = r.config
    ok = r.passed
    env_txt = html.escape("; ".join(f"{k}: {v}" for k, v in r.environment.items()))
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kimik3 validation report</title>"
             f"<style>{_CSS}</style></head><body>",
             "<h1>kimik3 validation report "
             f"<span class='badge {'ok' if ok else 'bad'}'>{'ALL RUN CELLS PASSED' if ok else 'FAILURES'}</span></h1>",
             f"<p>{env_txt}<br>mode: {'--quick' if cfg.quick else 'full'}; presets "
             f"{', '.join(cfg.presets)}; dtypes {', '.join(cfg.dtypes)}; batch sizes {list(cfg.batch_sizes)}; "
             f"contexts {', '.join(f'{n} ({w} prompt tokens)' for n, w in cfg.contexts)}; {cfg.steps} decode "
             f"steps; seeds {list(cfg.seeds)}; run time {r.seconds:.0f} s. Reference: stage <code>naive</code> in "
             f"float64 on the same (for bf16: bf16-rounded) weights. Tolerances (validation.md): fp32 "
             f"e ≤ {TOL['fp32_stage']:.0e} per step + identical greedy tokens; bf16 teacher-forced "
             f"e ≤ {TOL['bf16_stage']:.0e} per step; expert-parallel e ≤ {TOL['expert_parallel']:.0e}. Internal "
             f"chunk: {CHUNK_TOKENS} tokens.</p>",
             "<h2>Summary</h2>", _table_html(r.summary().reset_index(), None)]
    acc = r.accuracy_summary()
    js_done = False
    if not acc.empty:
        parts += ["<h3>Accuracy by stage and dtype</h3>", _table_html(acc.reset_index(), None),
                  error_figure(r).to_html(include_plotlyjs=True, full_html=False)]
        js_done = True
    parts += ["<div class='note'>Known issue: on random-weight presets bf16 rounding can flip near-tied top-k expert "
              "choices, so bf16 cells can exceed the bf16 tolerance. Such cells are reported as failed with their "
              "error, top-1 agreement and <code>router_flips</code> (share of router calls whose top-k set "
              "differs from the fp64 reference in the naive stage's run of the same prompts). Tolerances are not "
              "loosened.</div>",
              "<h2>Failed</h2>", _table_html(r.failures()),
              "<h2>Not run, and why</h2>", _table_html(r.not_run(), None)]
    if r.drift is not None:
        parts.append("<h2>bf16 drift with depth (reported, not bounded)</h2>")
        if r.drift_fig is not None:
            parts.append(r.drift_fig.to_html(include_plotlyjs=not js_done, full_html=False))
        parts.append(_table_html(r.drift, None))
    parts += ["<h2>Megakernel hazard checker</h2>", _table_html(r.hazards),
              "<h2>Expert parallelism (gloo processes vs one process)</h2>", _table_html(r.expert_parallel, None),
              "<h2>Every cell</h2>", _table_html(t), "</body></html>"]
    return "\n".join(parts)


# ====================================================================== CLI


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _names(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3 validate``: run the matrix, write the report, exit 0 only if every run cell passed."""
    ap = argparse.ArgumentParser(prog="python -m kimik3 validate", description=main.__doc__)
    ap.add_argument("--quick", action="store_true", help="the CI subset: micro, one seed, 2 steps, short+long context")
    ap.add_argument("--presets", type=_names, default=None, help="comma-separated, e.g. micro,tiny")
    ap.add_argument("--stages", type=_names, default=None, help="comma-separated (default: every stage)")
    ap.add_argument("--dtypes", type=_names, default=None, help="float32,bfloat16")
    ap.add_argument("--batch-sizes", type=_ints, default=None)
    ap.add_argument("--seeds", type=_ints, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads during the run (default 1)")
    ap.add_argument("--no-determinism", action="store_true")
    ap.add_argument("--no-hazards", action="store_true")
    ap.add_argument("--no-ep", action="store_true", help="skip the expert-parallel processes")
    ap.add_argument("--drift-tokens", type=int, default=None, help="0 skips the bf16 drift curve")
    ap.add_argument("--out", default="runs/validate", help="run folder for report.html, cells.csv, summary.json")
    ap.add_argument("--report-only", action="store_true", help="exit 0 whatever failed")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    over: dict[str, Any] = {}
    for key, val in (("stages", a.stages), ("dtypes", a.dtypes), ("batch_sizes", a.batch_sizes), ("seeds", a.seeds),
                     ("steps", a.steps), ("drift_tokens", a.drift_tokens)):
        if val is not None:
            over[key] = val
    if a.threads is not None:
        over["threads"] = a.threads
    if a.no_determinism:
        over["determinism"] = False
    if a.no_hazards:
        over["hazards"] = False
    if a.no_ep:
        over["ep_runs"] = ()
    if a.quick:
        cfg = quick_config(a.device, **over)
        if a.presets:
            extra = tuple(w for w in cfg.not_run if not any(w[0] == f"preset {p}" for p in a.presets))
            cfg = dataclasses.replace(cfg, presets=a.presets, not_run=extra)
    else:
        cfg = default_config(a.presets, a.device, **over)
    report = run_validation(cfg, a.out, progress=not a.no_progress)
    s = report.summary()
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 160):
        print(s.to_string())
        acc = report.accuracy_summary()
        if not acc.empty:
            print(acc.to_string())
        f = report.failures()
        if not f.empty:
            print("\nFAILED:")
            print(f[["check", "preset", "stage", "dtype", "batch", "context", "seed", "reason"]].to_string())
        nr = report.not_run()
        if not nr.empty:
            print("\nNOT RUN:")
            print(nr.to_string())
    print(f"\nreport: {report.files.get('report')}  ({report.seconds:.0f} s)")
    code = report.exit_code(a.report_only)
    if not report.passed:
        print("some cells failed" + (" (--report-only: exit 0)" if a.report_only else ""))
    return code
