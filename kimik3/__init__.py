"""kimik3: one Kimi K3 decode step, from naive PyTorch to a CuTe DSL megakernel, measured step by step."""

import kimik3._kernel_package  # noqa: F401  (first: lets kimik3.kernels import from a bare copy of the repository)
from kimik3._version import __version__  # noqa: F401  (the package version attribute)
from kimik3.decoder import Decoder
from kimik3.model.checkpoint import from_pretrained, save_pretrained
from kimik3.model.config import PRESET_NAMES, ModelConfig, config_from_hf, get_preset, load_config
from kimik3.model.modeling import KimiForCausalLM
from kimik3.model.random_init import build_model, from_preset
from kimik3.perf.cost import decode_cost, parameter_counts

__all__ = [
    "Decoder",
    "KimiForCausalLM",
    "ModelConfig",
    "PRESET_NAMES",
    "build_model",
    "config_from_hf",
    "decode_cost",
    "parameter_counts",
    "from_preset",
    "from_pretrained",
    "get_preset",
    "load_config",
    "save_pretrained",
]
