"""The fast paths' scope gates (kimik3/scope): every kind of reason reachable and worded, all of them returned at
once, fail closed on anything unreviewed, and the stages building only through their gate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kimik3
from kimik3.model.config import ModelConfig, get_preset
from kimik3.model.random_init import build_model
from kimik3.scope import FEATURES, FIELD_ROLES, Request, Rule, ScopeSpec, config_features, unreviewed
from kimik3.scope import features as features_mod
from kimik3.scope.features import ROLE_KINDS
from kimik3.scope.gates import FUSED, GATES, MEGAKERNEL, MEGAKERNEL_CPU, PROGRAM

FAST = ("fused", "megakernel", "megakernel-cpu", "megakernel-interp", "rank programs")


def _req(**kw) -> Request:
    base = dict(dtype=torch.bfloat16, device="cuda", batch=8, context=512, arch="sm_90a", sms=132, world=1)
    return Request(**{**base, **kw})


def test_every_config_field_is_reviewed_and_every_feature_listed_by_every_fast_gate():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert names == set(FIELD_ROLES), names ^ set(FIELD_ROLES)
    assert set(FIELD_ROLES.values()) <= set(FEATURES) | set(ROLE_KINDS)
    for name in FAST:
        assert set(GATES[name].features) == set(FEATURES), name


@pytest.mark.parametrize("preset", ["micro", "tiny", "k3-shard", "kimi-k3"])
def test_k3_presets_pass_the_megakernel_gates(preset):
    cfg = get_preset(preset)
    assert MEGAKERNEL.refuse(cfg, _req()) == []
    assert MEGAKERNEL_CPU.refuse(cfg, _req(device="cpu", dtype=torch.float32, arch=None, sms=None)) == []
    assert PROGRAM.refuse_config(cfg) == []


def test_the_deepseek_family_gets_every_reason_at_once():
    reasons = MEGAKERNEL_CPU.refuse(get_preset("deepseek-v3"), _req(device="cuda", dtype=torch.float16, batch=65))
    text = "\n".join(reasons)
    for part in ("runs on the CPU", "supports dtypes", "supports batch sizes 1..64, got 65",
                 "residual = 'additive residual'", "mla position = 'RoPE + YaRN'", "moe = 'plain MoE'",
                 "routing = 'grouped top-k'"):
        assert part in text, (part, reasons)
    assert len(reasons) == 7, reasons


def test_each_request_reason_is_reachable_and_worded():
    spec = ScopeSpec(name="t", dtypes=(torch.bfloat16,), max_batch=8, devices=("cuda",), archs=("sm_90a",),
                     kept_experts=(), expert_formats=("bf16",), worlds=(1, 4), min_sms_per_rank=2, max_context=1024,
                     features=dict(PROGRAM.features))
    cfg = get_preset("tiny")
    cases = {
        "runs on cuda, not on cpu": _req(device="cpu"),
        "supports dtypes": _req(dtype=torch.float32),
        "reads dense routed experts, but this model holds them as mxfp4": _req(storage="mxfp4"),
        "takes routed experts as bf16, got 'fp8'": _req(experts="fp8"),
        "supports batch sizes 1..8, got 9": _req(batch=9),
        "is built for sm_90a; this GPU is sm_100a": _req(arch="sm_100a"),
        "takes an int world size, got '2'": _req(world="2"),
        "runs world sizes 1..4, got world 5": _req(world=5),
        "needs 2 SM(s) per rank: 7 SMs cannot hold 4 ranks": _req(world=4, sms=7),
        "supports contexts up to 1024 tokens, got max_seq_len=2048": _req(context=2048),
    }
    assert spec.refuse(cfg, _req()) == []
    for text, req in cases.items():
        reasons = spec.refuse(cfg, req)
        assert len(reasons) == 1 and text in reasons[0], (text, reasons)
    # all at once: one reason each, none lost
    every = _req(device="cpu", dtype=torch.float32, storage="mxfp4", experts="fp8", batch=9, context=2048, world=5)
    assert len(spec.refuse(cfg, every)) == 7


def test_feature_value_unlisted_feature_and_rules():
    cfg = get_preset("tiny")
    only_untied = {**PROGRAM.features, "embeddings": frozenset({"tied"})}
    spec = ScopeSpec(name="t", features=only_untied)
    (r,) = spec.refuse_config(cfg)
    assert r == "does not support embeddings = 'untied' (supported: 'tied')"
    missing = {k: v for k, v in PROGRAM.features.items() if k != "routing"}
    (r,) = ScopeSpec(name="t", features=missing).refuse_config(cfg)
    assert "has not reviewed the config feature 'routing' ('flat top-k')" in r and "fail closed" in r

    def boom(c, q):
        raise ZeroDivisionError("no")

    spec = ScopeSpec(name="t", features=dict(PROGRAM.features),
                     rules=(Rule("one", lambda c, q: "fails one"), Rule("two", lambda c, q: ["a", "b"]),
                            Rule("three", boom)))
    assert spec.refuse_config(cfg, _req()) == ["fails one", "a", "b", "could not check three: ZeroDivisionError: no"]
    # a reference stage's spec reads no features
    assert ScopeSpec(name="naive").refuse_config(get_preset("deepseek-v3")) == []


def test_a_config_field_nobody_reviewed_is_refused_by_every_fast_gate():
    New = dataclasses.make_dataclass("NewConfig", [("sliding_window", int, dataclasses.field(default=4096))],
                                     bases=(ModelConfig,), frozen=True)
    base = get_preset("tiny")
    cfg = New(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)})
    assert unreviewed(cfg) and "sliding_window" in unreviewed(cfg)[0]
    for name in FAST:
        assert any("'sliding_window' is not reviewed" in r for r in GATES[name].refuse_config(cfg, _req())), name
    keyed = base.replace(extra={"num_nextn_predict_layers": 1, "swa_layers": [1, 3]})
    assert any("'swa_layers' are not reviewed" in r for r in FUSED.refuse_config(keyed, _req()))
    assert FUSED.refuse_config(base.replace(extra={"num_nextn_predict_layers": 1}), _req()) == []


def test_a_new_feature_and_a_failing_probe_refuse(monkeypatch):
    cfg = get_preset("tiny")
    monkeypatch.setitem(FEATURES, "sliding window", lambda c: "4096 tokens")
    for name in FAST:
        assert any("'sliding window'" in r for r in GATES[name].refuse_config(cfg)), name
    monkeypatch.delitem(FEATURES, "sliding window")
    monkeypatch.setitem(FEATURES, "moe", lambda c: 1 / 0)
    assert config_features(cfg)["moe"].startswith("unknown (probe failed: ZeroDivisionError")
    assert any("moe = 'unknown (probe failed" in r for r in MEGAKERNEL.refuse_config(cfg))
    assert features_mod.FEATURES is FEATURES


def test_stages_build_through_their_gate():
    model = build_model(get_preset("micro").replace(attn_res_block_size=None))
    with pytest.raises(ValueError) as e:
        kimik3.Decoder(model, stage="megakernel-cpu", batch_size=65, max_seq_len=16)
    msg = str(e.value)
    assert msg.startswith("stage 'megakernel-cpu' ") and "batch sizes 1..64, got 65" in msg
    assert "residual = 'additive residual'" in msg
    with pytest.raises(ValueError, match=r"stage 'megakernel' runs on a CUDA GPU .*not on cpu.*batch sizes"):
        kimik3.Decoder(model, stage="megakernel", batch_size=65, max_seq_len=16)
    with pytest.raises(ValueError, match=r"stage 'megakernel-interp' .*world sizes 1\.\.128, got world 129"):
        kimik3.Decoder(kimik3.from_preset("micro", seed=0), stage="megakernel-interp", batch_size=1,
                       max_seq_len=16, world=129)


def test_described_specs_are_plain_data():
    import json

    for name, spec in GATES.items():
        d = spec.describe()
        json.dumps(d)
        assert d["features"] and d["enforced_by"], name
