"""The fast paths' scope gates, as data: what ``fused``, ``megakernel``, ``megakernel-cpu``, ``megakernel-interp``
and the rank programs of a deployment support (docs/architecture.md §13).

Each gate lists the config features it implements (every feature of :data:`kimik3.scope.features.FEATURES`,
value by value) and the rules its kernels put on shapes and constants; the stages and runners build only through
their gate, and what :meth:`~kimik3.scope.spec.ScopeSpec.refuse` returns is the text the user sees.
:data:`PROGRAM` is what the megakernel's program builder covers (every executor of a program reads it through
:func:`kimik3.megakernel.layout.check_supported`); the executors narrow it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kimik3.kernels.contracts.isa import CTA_THREADS, MAX_LOCAL
from kimik3.kernels.contracts.meta import (
    LM_ROWS_PER_CTA,
    SITU_BETAS,
    SUPPORTED_ARCHS,
    attn_res_threads,
    kda_head_dim_ok,
)
from kimik3.kernels.contracts.meta import RMS_EPS as GEMV_RMS_EPS
from kimik3.kernels.contracts.peers import MAX_WORLD
from kimik3.model.config import ModelConfig
from kimik3.model.quant import MXFP4_GROUP
from kimik3.model.rank_slice import check_split
from kimik3.scope.features import ABSENT
from kimik3.scope.spec import Request, Rule, ScopeSpec

__all__ = ["PROGRAM", "FUSED", "MEGAKERNEL", "MEGAKERNEL_CPU", "MEGAKERNEL_INTERP", "RANKS", "GATES", "mix_sizes",
           "fused_rules_errors", "program_feature_errors", "mxfp4_width_error"]

MEGAKERNEL_MAX_BATCH = 64  # the VM's batch capacity (isa / kernel_shapes: B <= 64)
CPU_MAX_BATCH = 64  # the native executor's capacity (cpu_executor.cpp MAX_BATCH)

_ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _f(**values: tuple[str, ...]) -> dict[str, frozenset[str]]:
    """A feature table from keyword names (underscores for spaces)."""
    return {k.replace("_", " "): frozenset(v) for k, v in values.items()}


# ---------------------------------------------------------------------------------- the megakernel's program
# What the program builder (kimik3/megakernel/step.py) lays out: K3's feature set, both FFN activations and both KDA
# gate forms (the opcodes take them as parameters), either routing (the interpreter routes grouped; the CPU and
# GPU executors refuse it below), a whole model or one rank's slice.
_PROGRAM_FEATURES = _f(
    residual=("Attention Residuals",),
    mixers=("KDA + MLA", "KDA", "MLA", ABSENT),
    mla_query=("q LoRA", ABSENT),
    mla_position=("NoPE", ABSENT),
    mla_output_gate=("gated", "ungated", ABSENT),
    kda_gate=("full-rank g_proj, lower bound", "full-rank g_proj, softplus", ABSENT),
    ffn_activation=("SiTU-GLU", "SwiGLU"),
    ffn_layers=("dense MLP + MoE", "MoE", "dense MLP"),
    moe=("LatentMoE with latent norm", "LatentMoE without latent norm", ABSENT),
    shared_experts=("shared experts", ABSENT),
    routing=("flat top-k", "grouped top-k", ABSENT),
    embeddings=("untied", "tied"),
    deployment=("whole model", "rank slice"),
)
_FLAT_ONLY = {**_PROGRAM_FEATURES, "routing": frozenset({"flat top-k", ABSENT})}


def mxfp4_width_error(cfg: ModelConfig, fmt: str) -> str | None:
    """Why ``cfg``'s routed experts cannot take format ``fmt`` (None: they can)."""
    if fmt != "mxfp4" or not cfg.moe_layers:
        return None
    widths = {"moe_latent_size (Dl)": cfg.moe_latent_size, "moe_intermediate_size (Ie)": cfg.moe_intermediate_size}
    bad = [f"{k} = {v}" for k, v in widths.items() if v is None or v % MXFP4_GROUP]
    return (f"needs the expert widths to be multiples of {MXFP4_GROUP} (one E8M0 scale per {MXFP4_GROUP} "
            "columns): " + ", ".join(bad)) if bad else None


def _mxfp4_widths(cfg: ModelConfig, r: Request) -> str | None:
    why = mxfp4_width_error(cfg, r.experts if r.experts is not None else r.storage)
    return f"with MXFP4 experts {why}" if why else None


def _kda_head_fits(cfg: ModelConfig, r: Request) -> str | None:
    if cfg.kda_layers and cfg.kda_head_dim > CTA_THREADS:
        return f"needs a KDA head dim <= {CTA_THREADS} (threads per CTA), got {cfg.kda_head_dim}"
    return None


def _held_mxfp4(cfg: ModelConfig, r: Request) -> str | None:
    if r.storage == "mxfp4" and r.experts not in (None, "mxfp4"):
        return ("holds its routed experts as MXFP4 in this model: run it with experts='mxfp4' (the held codes and "
                "scales stream as they are) or call model.dequantize_experts() first")
    return None


def _rank_experts(cfg: ModelConfig, r: Request) -> str | None:
    if r.world > 1 and r.experts not in (None, "dense"):
        return "streams dense experts in a rank program (experts='mxfp4' runs one GPU's program)"
    return None


_MXFP4_RULE = Rule("MXFP4 experts: latent and expert hidden widths multiples of 32", _mxfp4_widths)

PROGRAM = ScopeSpec(
    name="megakernel program", dtypes=_ALL_DTYPES, max_batch=MEGAKERNEL_MAX_BATCH, worlds=(1, MAX_WORLD),
    kept_experts=("mxfp4",), features=_PROGRAM_FEATURES, rules=(_MXFP4_RULE,),
    about="what the megakernel's program builder lays out (kimik3/megakernel/step.py): the K3 feature set",
    enforced_by=("kimik3/megakernel/layout.py:check_supported", "kimik3/megakernel/step.py:build_program"))

MEGAKERNEL = ScopeSpec(
    name="megakernel", dtypes=(torch.bfloat16,), max_batch=MEGAKERNEL_MAX_BATCH, devices=("cuda",),
    archs=SUPPORTED_ARCHS, kept_experts=("mxfp4",), worlds=(1, MAX_LOCAL), features=_FLAT_ONLY,
    rules=(_MXFP4_RULE, Rule(f"KDA head dim <= {CTA_THREADS}", _kda_head_fits)),
    device_note=f"on a CUDA GPU ({' or '.join(SUPPORTED_ARCHS)}), one persistent launch per step",
    about="one persistent CuTe DSL launch per decode step: one GPU's program, or every rank of a deployment of up "
          f"to {MAX_LOCAL} in one launch on disjoint SM sets",
    enforced_by=("kimik3/megakernel/gpu_stage.py:MegakernelStage", "kimik3/megakernel/gpu.py:MegakernelRunner",
                 "kimik3/megakernel/gpu_ranks.py:launch_plan"))

MEGAKERNEL_CPU = ScopeSpec(
    name="megakernel-cpu", dtypes=(torch.float32, torch.bfloat16), max_batch=CPU_MAX_BATCH, devices=("cpu",),
    kept_experts=("mxfp4",), expert_formats=("dense", "mxfp4"), worlds=(1, MAX_WORLD), features=_FLAT_ONLY,
    rules=(_MXFP4_RULE, Rule("a model holding MXFP4 experts runs with experts='mxfp4'", _held_mxfp4),
           Rule("rank programs stream dense experts", _rank_experts)),
    device_note="on the CPU (native worker threads, one per core)",
    about="the megakernel's program run by native worker threads waiting on atomic counters; a deployment's ranks "
          "as processes over a shared segment",
    enforced_by=("kimik3/megakernel/cpu.py:MegakernelCPUStage", "kimik3/megakernel/cpu.py:CPUMegakernel"))

MEGAKERNEL_INTERP = ScopeSpec(
    name="megakernel-interp", dtypes=_ALL_DTYPES, max_batch=MEGAKERNEL_MAX_BATCH, devices=("cpu",),
    kept_experts=("mxfp4",), worlds=(1, MAX_WORLD), features=_PROGRAM_FEATURES, rules=(_MXFP4_RULE,),
    device_note="on the CPU (a Python interpreter of the program under random interleavings)",
    about="the megakernel's program interpreted in Python, the race checker; every rank of a deployment "
          "interleaved",
    enforced_by=("kimik3/megakernel/interp_ranks.py:MegakernelInterpStage",))

def _even_split(cfg: ModelConfig, r: Request) -> str | None:
    try:
        check_split(cfg, r.world)
    except ValueError as e:
        return f"cannot split this model over {r.world} ranks: {e}"
    return None


# the rank programs of a tensor- x expert-parallel deployment, built from the whole model: every split dimension
# divides by the world, the routed experts combine in the latent space
RANKS = replace(
    PROGRAM, name="rank programs", worlds=(2, MAX_WORLD),
    features={**_PROGRAM_FEATURES, "deployment": frozenset({"whole model"}),
              "moe": frozenset({"LatentMoE with latent norm", "LatentMoE without latent norm", ABSENT})},
    rules=(_MXFP4_RULE, Rule("every split dimension (heads, experts, latent, shared, dense, vocabulary) divides by "
                             "the world", _even_split)),
    about="the rank programs of a tensor- x expert-parallel deployment, collectives as opcodes "
          "(kimik3/megakernel/ranks.py; the split rule: kimik3/model/rank_slice.py)",
    enforced_by=("kimik3/megakernel/ranks.py:Shard.check",))


# ---------------------------------------------------------------------------------- the fused kernels
def mix_sizes(cfg: ModelConfig) -> set[int]:
    """Candidate counts of every AttnRes mix of a step (the residual wiring of DecoderLayer.residual)."""
    s, out = 0, set()
    for i in range(cfg.num_hidden_layers):
        if s:
            out.add(s + 1)
        if i % cfg.attn_res_block_size == 0:
            s += 1
        out.add(s + 1)
    out.add(s + 1)
    return out


def _fused_shapes(c: ModelConfig, r: Request) -> list[str]:
    """The fused kernels' shape and constant rules, every violation."""
    e: list[str] = []
    fmt = r.experts or "bf16"
    if r.context is not None and r.context < 1:
        e.append(f"cache length must be >= 1, got {r.context}")
    if c.hidden_act == "situ" and (c.situ_beta, c.situ_linear_beta) != SITU_BETAS:
        e.append(f"the MoE kernel implements SiTU-GLU with beta={SITU_BETAS[0]}, beta_lin={SITU_BETAS[1]}; this "
                 f"config has beta={c.situ_beta}, beta_lin={c.situ_linear_beta}")
    if c.rms_norm_eps != GEMV_RMS_EPS:
        e.append(f"the kernels normalise with eps={GEMV_RMS_EPS}; this config's rms_norm_eps is {c.rms_norm_eps}")
    H = c.hidden_size
    if H % 8:
        e.append(f"hidden_size {H} must be a multiple of 8 (16-byte loads)")
    if c.vocab_size % LM_ROWS_PER_CTA:
        e.append(f"the lm_head kernel needs vocab_size % {LM_ROWS_PER_CTA} == 0, got {c.vocab_size}")
    if c.kda_layers:
        if not kda_head_dim_ok(c.kda_head_dim):
            e.append(f"the KDA kernel supports head dims 32, 64 and 128 (one 256-thread CTA holds the q, k and v "
                     f"channels of a head); this config has kda_head_dim={c.kda_head_dim}")
        if c.kda_conv_size < 2:
            e.append(f"the KDA kernel needs a short conv of width >= 2, got {c.kda_conv_size}")
    if c.mla_layers:
        DL, DR = c.kv_lora_rank, c.qk_rope_head_dim
        if DL % 128 or DR % 32 or DR <= 0:
            e.append(f"the MLA kernel needs kv_lora_rank % 128 == 0 and qk_rope_head_dim a positive multiple of 32 "
                     f"(lanes own kv_lora/32 latent + rope/32 rope dims); got {DL} and {DR}")
        for name, v in (("qk_nope_head_dim", c.qk_nope_head_dim), ("v_head_dim", c.v_head_dim),
                        ("q_lora_rank", c.q_lora_rank or 8)):
            if v % 8:
                e.append(f"{name}={v} must be a multiple of 8 (16-byte loads of the per-head / q_b GEMVs)")
        if c.num_attention_heads < 1:
            e.append("MLA needs attention heads")
    if c.moe_layers:
        L, inner = c.expert_in_dim, c.moe_intermediate_size
        q = 32 if fmt == "mxfp4" else 8
        if L % q or inner % q:
            e.append(f"the {fmt} expert kernel needs the expert widths to be multiples of {q}; got in={L}, "
                     f"intermediate={inner}")
        if c.num_experts_per_tok > 32:
            e.append(f"the router kernel keeps one choice per lane: top-k <= 32, got {c.num_experts_per_tok}")
        if c.n_routed_experts % c.n_group:
            e.append("n_routed_experts must be divisible by n_group")
        if c.n_shared_experts and (c.moe_intermediate_size * c.n_shared_experts) % 8:
            e.append("the shared-expert width must be a multiple of 8")
    if any(c.ffn(i) == "dense" for i in range(c.num_hidden_layers)) and c.intermediate_size % 8:
        e.append(f"the dense MLP width {c.intermediate_size} must be a multiple of 8")
    if c.attn_res_block_size:
        for nc in sorted(mix_sizes(c)):
            if attn_res_threads(H, nc) > 1024:
                e.append(f"the AttnRes kernel cannot cover hidden_size {H} with {nc} candidates in one CTA")
    return e


def _fused_rule(cfg: ModelConfig, r: Request) -> list[str]:
    return [f"has no kernel path for {cfg.name or 'this config'} (batch {r.batch}): {e}" for e in _fused_shapes(cfg, r)]


FUSED = ScopeSpec(
    name="fused", dtypes=(torch.bfloat16,), max_batch=64, devices=("cuda",), archs=SUPPORTED_ARCHS,
    kept_experts=("mxfp4",), expert_formats=("bf16", "mxfp4"),
    # the megakernel program's features, narrowed: the MoE kernel implements SiTU-GLU and the latent norm only, and
    # the fused step is one GPU's
    features={**_PROGRAM_FEATURES, **_f(ffn_activation=("SiTU-GLU",), moe=("LatentMoE with latent norm", ABSENT),
                                        deployment=("whole model",))},
    rules=(Rule("kernel shapes and constants: 16-byte widths, head dims, eps, SiTU betas, vocabulary tiles, "
                "AttnRes CTA size", _fused_rule),),
    device_note=f"the CuTe DSL kernels on a CUDA GPU ({' or '.join(SUPPORTED_ARCHS)})",
    about="one decode step composed of the CuTe DSL kernels of kernels/fused/, replayed as a CUDA graph",
    enforced_by=("kimik3/stages/fused.py:FusedStage", "kimik3/fused/plan.py:FusedStep"))

# every gate by the name of what it admits
GATES: dict[str, ScopeSpec] = {"fused": FUSED, "megakernel": MEGAKERNEL, "megakernel-cpu": MEGAKERNEL_CPU,
                               "megakernel-interp": MEGAKERNEL_INTERP, "rank programs": RANKS,
                               "megakernel program": PROGRAM}


def fused_rules_errors(cfg: ModelConfig, batch_size: int, cache_len: int, expert_format: str = "bf16") -> list[str]:
    """Every reason the fused kernels cannot run ``cfg`` at this batch, cache length and expert format, from the
    config alone (no device or dtype): the fused gate's features and rules."""
    r = Request(dtype=torch.bfloat16, device="cuda", batch=batch_size, context=cache_len, experts=expert_format)
    out = []
    if expert_format not in FUSED.expert_formats:
        out.append(f"expert_format must be one of {FUSED.expert_formats}, got {expert_format!r}")
    if batch_size < 1:
        out.append(f"batch size must be >= 1, got {batch_size}")
    return out + FUSED.refuse_config(cfg, r)


def program_feature_errors(cfg: ModelConfig) -> list[str]:
    """Every feature of ``cfg`` the megakernel's program builder does not lay out (empty: it does)."""
    return PROGRAM.refuse_config(cfg)
