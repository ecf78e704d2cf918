"""Shared fixtures: small transformers oracle checkpoints and the device check's tiny kernel exports, written once
per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# the host JIT's float -> bf16 conversion, before any test module imports the CuTe DSL (kernels/verify/host_runtime.py)
import kimik3.kernels.verify  # noqa: E402,F401

# ---- every test's outcome into runs/test-results.json (kimik3.evidence.results), which the dossiers read
_RECORDER = None


def pytest_sessionstart(session):
    global _RECORDER
    from kimik3.evidence.results import Recorder

    try:
        _RECORDER = Recorder()
    except Exception as e:  # the run goes on; the dossiers then say these results were never recorded
        session.config.issue_config_time_warning(pytest.PytestWarning(f"test results not recorded: {e}"), 2)


def pytest_runtest_logreport(report):
    if _RECORDER is not None:
        _RECORDER.add(report.nodeid, report.when, report.outcome, report.duration)


def pytest_sessionfinish(session, exitstatus):
    if _RECORDER is not None:
        _RECORDER.write()

ORACLE_VOCAB = 160


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a whole test module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    For modules of small tensors and many small ops: a second thread buys nothing there, and idle OpenMP threads
    spin after each op, competing for CI's two cores with the other job or with a CPU executor's own workers."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _dsv3_config(q_lora: int | None, norm_topk: bool, **kw):
    from transformers import DeepseekV3Config

    # grouped routing (n_group 4 > topk_group 2), YaRN with mscale, two dense layers, tiny widths
    base = dict(vocab_size=ORACLE_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=2,
                q_lora_rank=q_lora, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                norm_topk_prob=norm_topk, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                eos_token_id=2,
                rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    base.update(kw)
    return DeepseekV3Config(**base)


def _kimi_linear_config():
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=ORACLE_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_token=2, num_shared_experts=1, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]})


def randomize_router_bias(hf_model, seed: int = 0) -> None:
    """transformers initialises e_score_correction_bias to zero; make it non-zero so selection-only use matters."""
    g = torch.Generator().manual_seed(seed)
    for mod in hf_model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.copy_(torch.randn(mod.e_score_correction_bias.shape, generator=g) * 0.05)


ORACLES = {
    "dsv3-qlora-norm": lambda: ("deepseek_v3", _dsv3_config(16, True)),
    "dsv3-qlora-nonorm": lambda: ("deepseek_v3", _dsv3_config(16, False)),
    "dsv3-noqlora-norm": lambda: ("deepseek_v3", _dsv3_config(None, True)),
    "dsv3-noqlora-nonorm": lambda: ("deepseek_v3", _dsv3_config(None, False)),
    "kimi-linear": lambda: ("kimi_linear", _kimi_linear_config()),
}


@pytest.fixture(scope="session")
def oracle_checkpoint(tmp_path_factory):
    """name -> (directory written by transformers' save_pretrained, the transformers model)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            from transformers import DeepseekV3ForCausalLM, KimiLinearForCausalLM

            kind, cfg = ORACLES[name]()
            torch.manual_seed(1234)
            cls = DeepseekV3ForCausalLM if kind == "deepseek_v3" else KimiLinearForCausalLM
            hf = cls(cfg).eval()
            with torch.no_grad():
                randomize_router_bias(hf)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cache[name] = (path, hf)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` batch-1 targets of the device check (fused ops and the megakernel, dense and MXFP4 experts, and
    the kernel of tiny's rank programs),
    exported once per session: the dry-run tests and the megakernel's export test read the same folder (the
    megakernel's export takes tens of seconds)."""
    from device_check_script import build_prebuilt

    return build_prebuilt(tmp_path_factory.mktemp("prebuilt"), "--presets", "tiny,tiny-rank", "--batches", "1")
