"""Deterministic random weights with sane scales, for presets (tests, notebooks, benchmarks).

Scales keep the logits neither NaN/inf nor saturated: projections ~ N(0, 1/fan_in), norm weights 1 ± 0.1 (so a
missing weight multiply fails a test), KDA decay parameters in the ranges the FLA initialisation uses (§3.2), a
small non-zero router bias (so the selection-only bias is exercised, §5.2). Two choices keep a *random* model as well
conditioned as a trained one, for the bf16 tolerance of docs/validation.md: residual-branch outputs are scaled by
``(2L)^-3/4``, and routed experts are *upcycled* (one random expert plus 10% independent noise each). Why:
docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import math

import torch

from kimik3.model.checks import check_device, check_seed, require_memory, resolve_dtype
from kimik3.model.config import ModelConfig, get_preset
from kimik3.model.modeling import KimiForCausalLM
from kimik3.model.quant import E2M1_VALUES, MXFP4_GROUP, QuantizedExperts

__all__ = ["init_weights", "init_mxfp4_experts", "from_preset", "build_model", "device_model"]

FP4_CODE_RMS = float(E2M1_VALUES.pow(2).mean().sqrt())  # of a uniformly random E2M1 code: 2.93

UPCYCLE_NOISE = 0.1
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight", "experts.w2")


def build_model(cfg: ModelConfig | str, device: str | torch.device = "cpu") -> KimiForCausalLM:
    """An uninitialised model on ``device`` (use ``"meta"`` to count parameters of full-size presets). One that
    ``device`` cannot hold is refused with the GiB it needs, before anything is allocated."""
    cfg = get_preset(cfg)
    if torch.device(check_device(device)).type != "meta":
        with torch.device("meta"):
            shape = KimiForCausalLM(cfg)
        require_memory(sum(t.numel() * t.element_size() for t in (*shape.parameters(), *shape.buffers())), device,
                       f"the model {cfg.name or 'of this config'!r}",
                       'build it on the meta device to count or inspect it: build_model(cfg, "meta")')
    with torch.device(device):
        return KimiForCausalLM(cfg)


@torch.no_grad()
def init_weights(model: KimiForCausalLM, seed: int = 0, device: str | torch.device = "cpu") -> KimiForCausalLM:
    """Fill every parameter deterministically from ``seed`` (fp32, then cast).

    ``device``: where the random numbers are drawn. The CPU generator (the default) gives the same weights on every
    machine; a GPU generator fills a k3-shard-sized model in seconds instead of minutes of CPU sampling, with the
    same rules and scales but other values (nothing that times a step depends on which)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(check_seed(seed))

    def normal(shape, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev) * std

    def uniform(shape, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=dev) * (hi - lo) + lo

    residual_scale = (2 * model.config.num_hidden_layers) ** -0.75
    for name, p in model.named_parameters():
        shape, leaf = p.shape, name.rsplit(".", 2)
        last = name.split(".")[-1]
        parent = leaf[-2] if len(leaf) > 1 else ""
        if last == "A_log":
            v = uniform(shape, 1.0, 16.0).log()
        elif last == "dt_bias":
            dt = uniform(shape, math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            v = dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as FLA initialises it
        elif parent.endswith("_conv1d"):
            v = normal(shape, 0.5)
        elif last == "e_score_correction_bias":
            v = normal(shape, 0.01)
        elif parent.endswith("norm") or parent.endswith("layernorm") or parent == "o_norm":
            v = 1.0 + normal(shape, 0.1)
        elif parent.endswith("_res_proj"):
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif parent == "embed_tokens":
            v = normal(shape, 1.0)
        elif name.endswith(("experts.w1", "experts.w3", "experts.w2")):
            base = normal(shape[1:], 1.0 / math.sqrt(shape[-1]))
            v = (base + UPCYCLE_NOISE * normal(shape, 1.0 / math.sqrt(shape[-1]))) / math.sqrt(1 + UPCYCLE_NOISE**2)
        elif p.dim() == 2:
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        else:
            raise RuntimeError(f"init_weights: no rule for parameter {name} {tuple(shape)}")
        if name.endswith(RESIDUAL_OUTPUTS):
            v = v * residual_scale
        p.data.copy_(v.to(device=p.device, dtype=p.dtype))
    return model


def init_mxfp4_experts(model: KimiForCausalLM, seed: int = 0, device: str | torch.device = "cpu") -> None:
    """Fill routed experts held as MXFP4 (:class:`~kimik3.model.quant.QuantizedExperts`) with random codes and
    E8M0 scales that give each weight the dense rule's magnitude (``1/sqrt(fan_in)``, residual outputs scaled as
    :func:`init_weights` does): uniform FP4 codes have an RMS of :data:`FP4_CODE_RMS`, so the scale is the power
    of two nearest the target over it. No dense copy exists at any point (a model too large for its bf16 experts)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(check_seed(seed) + 1)
    residual_scale = (2 * model.config.num_hidden_layers) ** -0.75
    for name, buf in model.named_buffers():
        if name.endswith("_packed"):
            buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, device=dev, dtype=torch.uint8).to(buf.device))
        elif name.endswith("_scale"):
            fan_in = buf.shape[-1] * MXFP4_GROUP
            target = fan_in ** -0.5 * (residual_scale if name.endswith("w2_scale") else 1.0)
            buf.fill_(127 + round(math.log2(target / FP4_CODE_RMS)))


def from_preset(name: str | ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", init_device: str | torch.device = "cpu",
                experts: str = "dense") -> KimiForCausalLM:
    """A preset model with deterministic random weights (``dtype`` for the bf16 tensors; fp32 ones stay fp32).

    Weights are drawn in fp32 from one CPU generator, one tensor at a time, and written straight into a model
    allocated on ``device`` in ``dtype``: the same seed gives the same weights on every device, and a
    k3-shard-sized model never exists in fp32 in host memory. ``init_device``: where the random numbers are drawn
    (see :func:`init_weights`; ``init_device=device`` on a GPU is the fast path, with other weights than the CPU's).
    ``experts="mxfp4"``: the routed experts are held as MXFP4 from the start (:func:`init_mxfp4_experts`: random
    codes, never a dense copy — how a k3-rank fits one GPU).
    """
    dtype = resolve_dtype(dtype)
    check_seed(seed)
    check_device(device)
    check_device(init_device, "init_device")
    if experts not in ("dense", "mxfp4"):
        raise ValueError(f"experts must be 'dense' or 'mxfp4', got {experts!r}")
    cfg = get_preset(name)
    model = build_model(cfg, "meta").cast_(dtype)
    if experts == "mxfp4":
        for moe in model._moe_layers():
            moe.experts = QuantizedExperts(cfg.held("experts"), cfg.moe_intermediate_size, cfg.expert_in_dim, "meta")
    draw = max(p.numel() for p in model.parameters()) * 4  # one tensor at a time drawn in fp32 on init_device
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    same = torch.device(init_device) == torch.device(device)
    require_memory(weights + (draw if same else 0), device, f"the weights of preset {cfg.name or name!r} in {dtype}"
                   + (" (and one tensor drawn in fp32)" if same else ""))
    if not same:
        require_memory(draw, init_device, "drawing one weight tensor in fp32")
    model = model.to_empty(device=device)
    model.reset_buffers()
    init_weights(model, seed, device=init_device)
    if experts == "mxfp4":
        init_mxfp4_experts(model, seed, device=init_device)
    return model.eval()


def device_model(preset: str | ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cuda") -> KimiForCausalLM:
    """A preset model allocated and initialised on ``device``: the random numbers are drawn there too (the same
    rules as :func:`from_preset`; on a CPU exactly its weights, on a GPU other values, in seconds)."""
    return from_preset(preset, seed=seed, dtype=dtype, device=device, init_device=device)
