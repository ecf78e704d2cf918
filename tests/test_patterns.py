"""Module-name patterns from checkpoints (``kimik3/model/patterns.py``): the same answers as ``re.match`` on the
syntax they support, linear time on patterns that make ``re`` backtrack without end, and a clear refusal of the
rest."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from kimik3.model.patterns import MAX_PATTERN, compile_pattern

REAL = ["re:.*self_attn.*", r"re:.*mlp\.gate$", "re:model.layers.[0-9]+.mlp.experts.*", r"re:^(?:lm_head|model\.embed)",
        r"re:.*\.(q|kv)_(a|b)_proj$", r"re:[^.]+\.layers\.\d+\.mlp\.shared_experts\..*", "re:.*block_sparse_moe.gate"]
NAMES = ["model.layers.0.self_attn.q_a_proj", "model.layers.3.mlp.gate", "model.layers.3.mlp.gate_proj",
         "model.layers.12.mlp.experts.7.down_proj", "lm_head", "model.embed_tokens", "language_model.model.x",
         "model.layers.1.mlp.shared_experts.up_proj", "model.layers.2.block_sparse_moe.gate", ""]


@pytest.mark.parametrize("pat", REAL)
def test_real_ignore_patterns_agree_with_re(pat: str) -> None:
    p = compile_pattern(pat[3:])
    for n in NAMES:
        assert p.match(n) == (re.match(pat[3:], n) is not None), (pat, n)


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", ".", "[ab]", "[^a]", r"\.", "(a|b)", "(?:ab|b)"]
    out = []
    for _ in range(rng.randint(1, 4)):
        a = rng.choice(atoms) if depth > 1 or rng.random() < 0.7 else f"({_random_pattern(rng, depth + 1)})"
        out.append(a + rng.choice(["", "", "*", "+", "?"]))
    return "|".join(["".join(out)] + ([_random_pattern(rng, depth + 1)] if depth < 1 and rng.random() < 0.2 else []))


def test_random_patterns_agree_with_re() -> None:
    rng = random.Random(0)
    for _ in range(400):
        pat = _random_pattern(rng) + rng.choice(["", "$"])
        p = compile_pattern(pat)
        for _ in range(10):
            name = "".join(rng.choice("ab.") for _ in range(rng.randint(0, 6)))
            assert p.match(name) == (re.match(pat, name) is not None), (pat, name)


def test_catastrophic_patterns_stay_linear() -> None:
    name = "a" * 5000
    for pat in ["(.*.*)*Z", "(a|aa)*b", "(a*)*b$", "((a+)+)+c"]:
        t0 = time.perf_counter()
        assert compile_pattern(pat).match(name) is False
        assert time.perf_counter() - t0 < 5.0, pat


@pytest.mark.parametrize("pat, why", [("a{2,3}", "counted repeats"), ("(?=a)", "lookarounds"), (r"(a)\1", r"\\1"),
                                      ("(?i)a", "inline flags"), ("(a", "unclosed"), ("a)", "unbalanced"),
                                      ("*a", "nothing to repeat"), ("[ab", "unclosed"), ("a*?", "lazy"),
                                      ("a^b", "only at the ends"), ("[z-a]", "reversed"),
                                      ("x" * (MAX_PATTERN + 1), "characters")])
def test_unsupported_syntax_is_refused_by_name(pat: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        compile_pattern(pat)


def test_a_checkpoint_with_a_backtracking_ignore_pattern_loads(tmp_path: Path) -> None:
    """The pattern from the probe, ``re:(.*.*)*Z``, in a real export's ignore list: the load finishes (``re`` would
    backtrack for hours on a 40-character module name) and leaves the model as exported."""
    import json
    import signal

    import torch

    import kimik3

    d = tmp_path / "ckpt"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d, expert_format="mxfp4")
    direct = kimik3.from_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]
    qc["ignore"] = list(qc.get("ignore") or ()) + ["re:(.*.*)*Z"]
    (d / "config.json").write_text(json.dumps(cfg))

    def alarm(*_: object) -> None:
        raise TimeoutError("from_pretrained did not finish in 60 s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(60)
    try:
        model = kimik3.from_pretrained(d)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    for (n, a), (_, b) in zip(direct.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), n


def test_a_bad_pattern_in_a_checkpoint_is_named(tmp_path: Path) -> None:
    import json

    import kimik3

    d = tmp_path / "ckpt"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d, expert_format="mxfp4")
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]
    qc["ignore"] = ["re:a{2,3}"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config.ignore\[0\]: module pattern 'a\{2,3\}': counted"):
        kimik3.from_pretrained(d)


def test_groups_nested_past_the_limit_are_refused_not_recursed_into() -> None:
    from kimik3.model.patterns import MAX_DEPTH

    assert compile_pattern("(" * MAX_DEPTH + "a" + ")" * MAX_DEPTH).match("a")
    with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} deep"):
        compile_pattern("(" * 250 + "a" + ")" * 250)


def test_a_long_list_is_matched_quickly_and_too_many_patterns_are_refused() -> None:
    from kimik3.model.quant import MAX_PATTERNS, parse_quantization_config

    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(20_000)]
    qc = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": names,
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32,
                                                                     "type": "float", "symmetric": True}}}}
    spec = parse_quantization_config(qc)
    t0 = time.perf_counter()
    hits = sum(spec.ignored(f"model.layers.{i}.mlp.experts.{e}.w1") for i in range(200) for e in range(50))
    assert hits == 0 and spec.ignored(names[-1]) and time.perf_counter() - t0 < 10
    qc["ignore"] = [f"re:model\\.layers\\.{i}\\." for i in range(MAX_PATTERNS + 1)]
    with pytest.raises(ValueError, match=rf"holds {MAX_PATTERNS + 1} 're:' patterns, more than the {MAX_PATTERNS}"):
        parse_quantization_config(qc)
