"""The correctness matrix (``python -m kimik3 validate``): it runs, reports every cell as passed / failed / not-run
with a reason, and catches what it exists to catch — a planted numerical bug, a stage that reads state it never
wrote (poisoned buffers), a stage that accepts what it does not declare, and a nondeterministic stage that claims
to be deterministic."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import kimik3
from kimik3.__main__ import main as cli
from kimik3.model.modeling import KDAState
from kimik3.stages import STAGES
from kimik3.stages.absorbed import AbsorbedStage
from kimik3.stages.base import StageSupport
from kimik3.stages.naive import NaiveStage
from kimik3.validation import (
    CELL_COLUMNS,
    ValidationConfig,
    bf16_pair,
    compare_to_reference,
    compare_with_trace,
    drift_figure,
    drift_with_depth,
    hazard_table,
    only_batches,
    quick_config,
    reference_trace,
    run_validation,
    support_refusal,
)
from kimik3.validation.metric import TOL

# ---------------------------------------------------------------- fake stages (registered per test)


class NoisyStage(NaiveStage):
    """The planted bug: every decode step adds 1e-3 noise to the logits."""

    name = "test-noisy"

    def step(self, ids, positions):
        out = super().step(ids, positions)
        g = torch.Generator().manual_seed(int(positions.sum()))
        return out + 1e-3 * torch.randn(out.shape, generator=g, dtype=out.dtype)


class JitterStage(NaiveStage):
    """Claims to be deterministic, but each run differs in the last bits (an unordered reduction, say)."""

    name = "test-jitter"

    def step(self, ids, positions):
        out = super().step(ids, positions)
        return out * (1 + 1e-6 * torch.rand(out.shape, dtype=out.dtype))


class HonestJitterStage(JitterStage):
    name = "test-honest-jitter"
    support = StageSupport(deterministic=False)


class SmallStage(NaiveStage):
    """Declares fp32 only, batch <= 2, and refuses the rest (through Stage.__init__)."""

    name = "test-small"
    support = StageSupport(dtypes=(torch.float32,), max_batch=2, devices=("cpu",))


class LyingStage(NaiveStage):
    """Declares batch <= 2 but never checks it: must be reported as failing closed-ness."""

    name = "test-lying"
    support = StageSupport(max_batch=2)

    def __init__(self, model, batch_size, max_seq_len):  # skips Stage.__init__'s support check
        self.model, self.batch_size, self.max_seq_len = model, batch_size, max_seq_len


class StaleTailStage(AbsorbedStage):
    """Prefill copies the prompt's cache rows but never resets the rest of the static cache: correct only while
    the buffers happen to be zero. Poisoning the state before prefill exposes it."""

    name = "test-stale-tail"

    @torch.no_grad()
    def prefill(self, input_ids, lengths):
        B, T = input_ids.shape
        tmp = self.model.new_state(B, T)
        pos = torch.arange(T).expand(B, T)
        logits = self.model.forward_tokens(input_ids, tmp, pos, pos < lengths[:, None])
        for d, s in zip(self.state.layers, tmp.layers):
            if isinstance(d, KDAState):
                d.S.copy_(s.S)
                d.conv.copy_(s.conv)
            else:
                d.latent[:, :T].copy_(s.latent)
                d.k_r[:, :T].copy_(s.k_r)
        return logits[torch.arange(B), lengths - 1].float()


@pytest.fixture
def register(monkeypatch):
    def add(*classes):
        for cls in classes:
            monkeypatch.setitem(STAGES, cls.name, cls)
    return add


def _small(stages, **kw) -> ValidationConfig:
    base = dict(presets=("micro",), stages=tuple(stages), dtypes=("float32",), batch_sizes=(1, 3),
                contexts=(("short", 6),), steps=2, seeds=(0,), hazards=False, ep_runs=(), drift_tokens=0)
    base.update(kw)
    return ValidationConfig(**base)


def _cells(report, check=None, stage=None):
    t = report.table()
    if check:
        t = t[t["check"] == check]
    if stage:
        t = t[t["stage"] == stage]
    return t


def _assert_well_formed(t):
    assert list(t.columns) == CELL_COLUMNS
    assert set(t["status"]) <= {"passed", "failed", "not-run"}
    bad = t[(t["status"] != "passed") & (t["reason"].fillna("").str.len() == 0)]
    assert bad.empty, f"cells without a reason:\n{bad}"


# ---------------------------------------------------------------- the CLI, end to end


def test_validate_quick_cli(tmp_path):
    """`validate --quick` on the CPU: micro, every CPU stage × dtype × batch, HTML report, reasons for the rest."""
    out = tmp_path / "run"
    code = cli(["validate", "--quick", "--out", str(out), "--no-progress"])
    summary = json.loads((out / "summary.json").read_text())
    assert code == (0 if summary["passed"] else 1)
    html = (out / "report.html").read_text()
    assert "kimik3 validation report" in html and "Not run, and why" in html
    assert "<script" in html and not re.search(r"<script[^>]*\ssrc=", html)  # self-contained: plotly.js inline
    import pandas as pd

    t = pd.read_csv(out / "cells.csv", keep_default_na=False)
    _assert_well_formed(t)
    acc = t[t["check"] == "accuracy"]
    assert set(acc["preset"]) == {"micro"}
    ran = acc[acc["status"] != "not-run"]
    for stage in ("naive", "absorbed", "compiled", "megakernel-interp", "megakernel-cpu"):
        for dtype in ("float32", "bfloat16"):
            got = ran[(ran["stage"] == stage) & (ran["dtype"] == dtype)]
            assert sorted({int(b) for b in got["batch"]}) == [1, 2, 8, 33, 64], (stage, dtype)
            assert set(got["context"]) == {"short", "long"}
    # fp32 must pass everywhere; bf16 may fail on random weights, but then with the measured numbers
    fp32 = ran[ran["dtype"] == "float32"]
    assert (fp32["status"] == "passed").all(), fp32[fp32["status"] != "passed"][["stage", "batch", "reason"]]
    for r in ran[ran["status"] == "failed"].to_dict("records"):
        assert "top-1 agreement" in r["reason"] and r["max_error"] != ""
    notrun = t[t["status"] == "not-run"]
    reasons = " | ".join(notrun["reason"])
    assert "graphs: needs CUDA" in reasons and "tiny skipped: --quick" in reasons
    assert "expert-parallel" in reasons
    assert (t[t["check"] == "expert-parallel"]["status"] == "passed").all()
    assert (t[t["check"] == "hazards"]["status"] == "passed").all() and (t["check"] == "hazards").sum() >= 10
    assert (t[t["check"] == "determinism"]["status"] == "passed").all()
    drift = pd.read_csv(out / "drift.csv")
    assert len(drift) == kimik3.get_preset("k3-deep-tiny").num_hidden_layers + 1
    assert (out / "drift_with_depth.html").exists()


# ---------------------------------------------------------------- what it must catch


def test_planted_bug_is_caught(register):
    register(NoisyStage)
    r = run_validation(_small(["naive", "test-noisy"]), progress=False, workers=1)
    _assert_well_formed(r.table())
    acc = _cells(r, "accuracy")
    assert (acc[acc["stage"] == "naive"]["status"] == "passed").all()
    noisy = acc[acc["stage"] == "test-noisy"]
    assert len(noisy) == 2 and (noisy["status"] == "failed").all()
    assert all("> 1e-04" in x for x in noisy["reason"])
    assert not r.passed and r.exit_code() == 1 and r.exit_code(report_only=True) == 0


def test_cells_outside_support_are_not_run_with_the_refusal(register):
    register(SmallStage)
    r = run_validation(_small(["test-small"], dtypes=("float32", "bfloat16"), batch_sizes=(1, 8)),
                       progress=False, workers=1)
    sup = _cells(r, "support", "test-small")
    assert (sup["status"] == "not-run").all() and len(sup) == 3  # fp32 B=8, bf16 B=1, bf16 B=8
    reasons = " | ".join(sup["reason"])
    assert "batch 8 > stage max 2 — refused: stage 'test-small' supports batch sizes 1..2" in reasons
    assert "bf16 not supported" in reasons and "refused:" in reasons
    ran = _cells(r, "accuracy", "test-small")
    assert list(ran["batch"]) == [1] and (ran["status"] == "passed").all()


def test_stage_that_does_not_fail_closed_is_a_failure(register):
    register(LyingStage)
    model = kimik3.from_preset("micro")
    assert support_refusal("test-lying", model, 2) is None
    status, reason = support_refusal("test-lying", model, 3)
    assert status == "failed" and "does not fail closed" in reason
    assert support_refusal("graphs", model, 1)[0] == "not-run"  # a real refusal (CPU)


def test_determinism_check(register):
    register(JitterStage, HonestJitterStage)
    r = run_validation(_small(["naive", "test-jitter", "test-honest-jitter"], batch_sizes=(2,)), progress=False,
                       workers=1)
    det = _cells(r, "determinism").set_index("stage")
    assert det.loc["naive", "status"] == "passed"
    assert det.loc["test-jitter", "status"] == "failed" and "differs from run 1" in det.loc["test-jitter", "reason"]
    assert det.loc["test-honest-jitter", "status"] == "not-run"
    assert "nondeterministic" in det.loc["test-honest-jitter", "reason"]
    acc = _cells(r, "accuracy").set_index("stage")  # the jitter is far inside the tolerance
    assert acc.loc["test-jitter", "status"] == "passed"


def test_poisoned_state_catches_a_stage_that_never_resets_its_cache(register):
    register(StaleTailStage)
    r = run_validation(_small(["absorbed", "test-stale-tail"], batch_sizes=(2,)), progress=False, workers=1)
    acc = _cells(r, "accuracy").set_index("stage")
    assert acc.loc["absorbed", "status"] == "passed" and acc.loc["absorbed", "poisoned"] > 0
    assert acc.loc["test-stale-tail", "status"] == "failed"
    assert "non-finite" in acc.loc["test-stale-tail", "reason"]
    # ...and without the poison the same stage passes: the bug only shows because the buffers were poisoned
    model = kimik3.from_preset("micro")
    ref = compare_to_reference(model, "test-stale-tail", 2, 6, 2, seed=2)
    assert ref.passed


# ---------------------------------------------------------------- pieces


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stored_reference_equals_compare_to_reference(dtype):
    import copy

    model = kimik3.from_preset("micro", seed=3)
    if dtype == "bfloat16":
        model, _ = bf16_pair(model)
    ref64 = copy.deepcopy(model).cast_(torch.float64)
    direct = compare_to_reference(model, "absorbed", 3, 7, 3, seed=5, reference=ref64)
    stored = compare_with_trace(model, "absorbed", reference_trace(ref64, 3, 7, 3, seed=5))
    assert direct.reference == stored.reference == "naive float64"
    assert direct.errors == stored.errors and direct.top1_agreement == stored.top1_agreement
    assert direct.passed and stored.passed


def test_quick_config_is_the_ci_subset():
    q = quick_config("cpu")
    assert q.presets == ("micro",) and q.quick and len(q.seeds) == 1
    assert q.batch_sizes == (1, 2, 8, 33, 64) and q.dtypes == ("float32", "bfloat16")
    assert [n for n, _ in q.contexts] == ["short", "long"] and dict(q.contexts)["long"] > 64
    assert any("tiny skipped: --quick" in why for _, why in q.not_run)
    with pytest.raises(ValueError, match="unknown preset"):
        dataclasses.replace(q, presets=("nope",))
    few = only_batches(q, [1, 33])  # notebook 06's CI run: the batches left out are listed, not dropped silently
    assert few.batch_sizes == (1, 33) and few.not_run[:-1] == q.not_run
    assert few.not_run[-1] == ("batch sizes 2, 8, 64", "batch sizes 2, 8, 64 not requested (this run takes 1, 33)")
    assert only_batches(q, q.batch_sizes).not_run == q.not_run
    with pytest.raises(ValueError, match="at least one"):
        only_batches(q, [])
    with pytest.raises(ValueError, match="positive ints"):
        only_batches(q, [0])


def test_drift_with_depth_small():
    d = drift_with_depth("micro", tokens=3, batch=2)
    cfg = kimik3.get_preset("micro")
    assert len(d) == cfg.num_hidden_layers + 1 and d["mixer"].iloc[-1] == "logits"
    assert (d["error"] > 0).all() and (d["error"] < 1).all()
    assert list(d["mixer"].iloc[:-1]) == [cfg.mixer(i) for i in range(cfg.num_hidden_layers)]
    # the tolerance line is a named trace at its value (an hline's annotation on a log axis sat at 10^value)
    fig = drift_figure(d)
    tol = [t for t in fig.data if t.name and t.name.startswith("TOL bf16_stage")]
    assert len(tol) == 1 and set(tol[0].y) == {TOL["bf16_stage"]} and not fig.layout.annotations


def test_hazard_table_small():
    t = hazard_table(["micro"], [1, 33], [8], ["critical_path", "round_robin"])
    assert len(t) == 4 and (t["status"] == "passed").all() and (t["violations"] == 0).all()
