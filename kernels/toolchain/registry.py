"""Every kernel variant the package builds, with its static shapes, resource budget and PTX features.

A *family* is one kernel op (a module + a variant of it) with a budget and the PTX instructions
its design relies on; a *variant* is a family at the static shapes of one preset and batch size.
Shapes are read from ``kimik3.model.config.get_preset(...)`` for the presets in :data:`PRESETS` and the
batch sizes in :data:`BATCHES`. ``ci=True`` marks the representative subset compiled by the CPU
test suite (every family at ``k3-shard`` B = 8, plus every family at ``tiny`` B = 1, whose odd
widths exercise the predicated tails); the full matrix runs under ``pytest -m slow`` and in
``python -m kimik3 kernels build``. The persistent megakernel is built per routed-expert format too
(:data:`EXPERT_FORMATS`): ``megakernel/<preset>/b<batch>`` reads dense experts, ``megakernel/<preset>/b<batch>-mxfp4``
MXFP4 ones (its static shapes carry ``fp4=True``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kimik3.kernels.contracts.isa import EXPERT_FORMATS  # routed-expert storage a family may be built for
from kimik3.kernels.contracts.meta import SUPPORTED_ARCHS
from kimik3.kernels.toolchain.source import OPS

from kimik3.model.config import ModelConfig, get_preset

__all__ = ["Budget", "Family", "KernelVariant", "FAMILIES", "PERSISTENT", "PRESETS", "BATCHES", "EXPERT_FORMATS",
           "all_variants", "ci_variants", "get_variant", "variants_for", "family", "PROBES", "PROBE_SHAPES",
           "ProbeVariant", "probe_variant", "all_probe_variants"]

PRESETS = ("tiny", "k3-shard")
BATCHES = (1, 8, 64)
CI_POINTS = (("k3-shard", 8), ("tiny", 1))
MLA_CONTEXT = {"tiny": 256, "k3-shard": 4096}  # static cache capacity S compiled in (lengths are runtime)


@dataclass(frozen=True)
class Budget:
    """Per-kernel limits checked on the ptxas report: every kernel of the op must fit.

    ``max_registers``: per thread; the GEMV-style kernels want several CTAs per SM to keep enough
    loads in flight, so most budgets sit well under 255. Spills and stack must be 0 (no local memory).
    ``max_shared_bytes``: dynamic shared memory recorded at trace time (plus any static smem).
    """

    max_registers: int = 255
    max_spill_bytes: int = 0
    max_stack_bytes: int = 0
    max_shared_bytes: int = 0


@dataclass(frozen=True)
class Family:
    module: str
    variant: str
    budget: Budget
    ptx_features: tuple[str, ...]  # substrings that must appear in the PTX
    shapes: Callable[[ModelConfig, int], dict[str, Any]]
    runtime: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: {}
    archs: tuple[str, ...] = SUPPORTED_ARCHS
    description: str = ""
    # routed-expert formats the family is built for; past "dense", ``shapes`` takes ``expert_format=``
    expert_formats: tuple[str, ...] = ("dense",)


def _kda_lb(cfg: ModelConfig) -> float | None:
    return cfg.kda_gate_lower_bound


FAMILIES: dict[str, Family] = {
    "gemv.plain": Family(
        "gemv", "plain", Budget(max_registers=128),
        ("ld.global.nc.v4", "shfl.sync.bfly"),
        lambda c, b: dict(B=b, N=c.kda_proj_dim, K=c.hidden_size),
        description="q_proj-shaped GEMV [P, H]"),
    "gemv.rmsnorm": Family(
        "gemv", "rmsnorm", Budget(max_registers=168),
        ("ld.global.nc.v4", "shfl.sync.bfly", "rsqrt.approx"),
        lambda c, b: dict(B=b, N=3 * c.kda_proj_dim, K=c.hidden_size),
        description="input RMSNorm fused into the concatenated q/k/v projection [3P, H]"),
    "gemv.residual": Family(
        "gemv", "residual", Budget(max_registers=128),
        ("ld.global.nc.v4", "shfl.sync.bfly"),
        lambda c, b: dict(B=b, N=c.hidden_size, K=c.kda_proj_dim),
        description="o_proj [H, P] with the residual add in the epilogue"),
    "gemv.f32out": Family(
        "gemv", "f32out", Budget(max_registers=128),
        ("ld.global.nc.v4", "shfl.sync.bfly"),
        lambda c, b: dict(B=b, N=c.kda_num_heads, K=c.hidden_size),
        description="b_proj [nh, H] (fp32 out; nh need not be a multiple of 4)"),
    "gemv.lm_head": Family(
        "gemv", "lm_head", Budget(max_registers=168, max_shared_bytes=2048),
        ("ld.global.nc.v4", "shfl.sync.bfly", "rsqrt.approx", "bar.sync"),
        lambda c, b: dict(B=b, N=c.vocab_size, K=c.hidden_size),
        description="final RMSNorm + lm_head GEMV + arg-max (two kernels)"),
    "router": Family(
        "router", "router", Budget(max_registers=128),
        ("ld.global.nc.v4", "shfl.sync.bfly", "ex2.approx"),
        lambda c, b: dict(B=b, E=c.n_routed_experts, H=c.hidden_size, topk=c.num_experts_per_tok,
                          n_group=c.n_group, topk_group=c.topk_group, scale=c.routed_scaling_factor,
                          renorm=c.norm_topk_prob),
        description="sigmoid router GEMV + (grouped) top-k + renormalise"),
    "kda": Family(
        "kda", "kda", Budget(max_registers=128, max_shared_bytes=16384),
        ("ld.global.v4.b32", "st.global.v4.b32", "shfl.sync.bfly", "ex2.approx", "bar.sync"),
        lambda c, b: dict(B=b, nh=c.kda_num_heads, D=c.kda_head_dim, W=c.kda_conv_size,
                          lower_bound=_kda_lb(c)),
        description="KDA decode step: conv + l2norm + gated delta rule + gated RMSNorm"),
    "mla": Family(
        "mla_decode", "mla", Budget(max_registers=224),
        ("ld.global.nc.v4", "shfl.sync.bfly", "ex2.approx"),
        lambda c, b: dict(B=b, nh=c.num_attention_heads, DL=c.kv_lora_rank, DR=c.qk_rope_head_dim,
                          S=MLA_CONTEXT.get(c.name, 4096)),
        lambda c: dict(scale=c.mla_softmax_scale),
        description="absorbed MLA decode: split-K partial softmax + combine"),
    "moe.bf16": Family(
        "moe", "bf16", Budget(max_registers=168, max_shared_bytes=8192),
        ("ld.global.nc.v4", "match.any.sync", "tanh.approx", "ex2.approx", "shfl.sync.bfly"),
        lambda c, b: dict(B=b, E=c.n_routed_experts, L=c.expert_in_dim, I=c.moe_intermediate_size,
                          topk=c.num_experts_per_tok),
        description="routed experts, bf16 weights: align + gate/up SiTU + down + combine"),
    "moe.mxfp4": Family(
        "moe", "mxfp4", Budget(max_registers=232, max_shared_bytes=8192),
        ("ld.global.nc.v4", "match.any.sync", "tanh.approx", "cvt.f32.f16", "shfl.sync.bfly"),
        lambda c, b: dict(B=b, E=c.n_routed_experts, L=c.expert_in_dim, I=c.moe_intermediate_size,
                          topk=c.num_experts_per_tok),
        description="routed experts, MXFP4 weights unpacked in registers"),
    "attn_res": Family(
        "attn_res", "mix", Budget(max_registers=128, max_shared_bytes=4096),
        ("ld.global.nc.v4", "st.global.v4", "shfl.sync.bfly", "ex2.approx", "bar.sync"),
        lambda c, b: dict(B=b, H=c.hidden_size, NC=max(2, c.attn_res_slots + 1)),
        description="AttnRes depth mix over all candidates of the model output site"),
}


def _megakernel_shapes(cfg: ModelConfig, batch: int, expert_format: str = "dense") -> dict[str, Any]:
    # DSL-free; imported lazily (kimik3.megakernel imports torch)
    from kimik3.megakernel.kernel_shapes import static_shapes

    return static_shapes(cfg, batch, expert_format=expert_format)


# The persistent megakernel (kernels/megakernel/vm.py): one op, one kernel, a whole decode step. Kept apart
# from FAMILIES, which lists the fused per-operation kernels (their tests enumerate it with per-family inputs and
# references), but built, cached and exported through the same paths: get_variant("megakernel/tiny/b1"),
# build.build(...), and `python -m kimik3 kernels build` (which includes it by default).
PERSISTENT: dict[str, Family] = {
    "megakernel": Family(
        "megakernel", "megakernel",
        # 384 threads per CTA cap ptxas at 168 registers; smem = two 48 KiB weight stage buffers (isa.STAGE_BYTES x
        # STAGE_BUFFERS) + the per-op scratch (each variant's figure: its build report), under the 227 KiB a CTA may
        # use on sm_90a
        Budget(max_registers=168, max_shared_bytes=160 * 1024),
        ("ld.acquire.gpu", "red.release.gpu", "nanosleep", "%globaltimer", "%smid", "cp.async.cg.shared.global",
         "atom.global.cas", "ld.global.nc.v4", "shfl.sync.bfly", "bar.sync"),
        _megakernel_shapes,
        description="persistent decode megakernel: interprets the int32 program, one CTA per SM",
        expert_formats=EXPERT_FORMATS),
}


def _per_variant(cfg: ModelConfig, batch: int) -> dict[str, Any]:
    raise ValueError("a probe kernel's static shapes are its variant's (PROBE_SHAPES), not a model preset's")


# The probe kernels (kernels/probes/): micro-benchmarks of the performance model's constants, run on a GPU by
# scripts/devcheck/probes.py. They measure the hardware, not a model, so they are not built per preset: each variant
# has its own static shapes (PROBE_SHAPES) and is named ``<family>/<tag>`` (ProbeVariant). Kept apart from FAMILIES,
# like the megakernel, but built, cached and exported through the same paths.
PROBES: dict[str, Family] = {
    "probe.bandwidth": Family(
        "probe_bandwidth", "stream",
        # 2 CTAs of 256 threads per SM (the widest variants) share 65536 registers: 128 each
        Budget(max_registers=128, max_shared_bytes=1024),
        ("ld.global.nc.v4", "shfl.sync.bfly", "bar.sync", "%globaltimer", "%smid"),
        _per_variant, description="streaming read of a buffer larger than L2, loads in flight per thread static"),
    "probe.latency": Family(
        "probe_latency", "chase", Budget(max_registers=128, max_shared_bytes=1024),
        ("ld.global.b32", "ld.global.nc.v4", "bar.sync", "%globaltimer", "%smid"),
        _per_variant, description="pointer chase over a buffer larger than L2, alone or beside streaming CTAs"),
    "probe.signal": Family(
        "probe_signal", "pingpong", Budget(max_registers=64, max_shared_bytes=128 * 1024),
        ("red.release.gpu.global.add", "ld.acquire.gpu", "%globaltimer", "%smid"),
        _per_variant, description="release-add / acquire-load ping-pong between two CTAs on different SMs"),
}
PROBE_BUFFER_WORDS = 2**28  # 1 GiB of int32 streamed: twenty times the 50 MB L2 of an H100 / H200 (data/hardware.json)
PROBE_CHAIN_WORDS = 2**25  # the pointer chase spans 128 MiB, 2.5 times that L2
PROBE_MAX_CTAS = 1024  # rows of the per-CTA sums and stamps: the largest grid a probe may be launched with
_STREAM = dict(words=PROBE_BUFFER_WORDS, max_ctas=PROBE_MAX_CTAS, stamp_words=3)
# (threads, loads in flight per thread, CTAs per SM): 4 KiB to 128 KiB in flight per SM, doubling
_BANDWIDTH_POINTS = ((128, 2, 1), (256, 2, 1), (256, 2, 2), (256, 4, 2), (256, 8, 2), (256, 16, 2))
PROBE_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "probe.bandwidth": {f"t{t}-l{n}-c{c}": dict(threads=t, loads=n, ctas_per_sm=c, **_STREAM)
                        for t, n, c in _BANDWIDTH_POINTS},
    # the streamers beside the chase keep 64 KiB in flight per SM (the widest point but one of the sweep)
    "probe.latency": {"chase": dict(threads=256, loads=8, ctas_per_sm=2, unroll=8, chain_words=PROBE_CHAIN_WORDS,
                                    out_words=2, **_STREAM)},
    # 128 KiB of shared memory per CTA: two cannot share an SM's 228 KB (data/hardware.json)
    "probe.signal": {"pingpong": dict(pad_bytes=128 * 1024, out_words=5)},
}


def family(name: str) -> Family:
    """The Family of a fused kernel, of the persistent megakernel or of a probe kernel."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name in PROBES:
        return PROBES[name]
    return PERSISTENT[name]


@dataclass(frozen=True)
class KernelVariant:
    family: str
    preset: str
    batch: int
    shape_items: tuple[tuple[str, Any], ...]
    runtime_items: tuple[tuple[str, Any], ...] = ()
    ci: bool = False
    expert_format: str = "dense"
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def name(self) -> str:
        fmt = "" if self.expert_format == "dense" else f"-{self.expert_format}"
        return f"{self.family}/{self.preset}/b{self.batch}{fmt}"

    @property
    def spec(self) -> Family:
        return family(self.family)

    @property
    def module_name(self) -> str:
        return self.spec.module

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"kimik3.kernels.{OPS[self.module_name]}")

    @property
    def reference(self) -> ModuleType:
        """The fused op's host-side test material, ``kernels/reference/<op>.py`` (``make_inputs``, ``reference``);
        no kernel hash covers it. The persistent megakernel has none (its reference is the CPU interpreter)."""
        if self.family not in FAMILIES:
            raise ValueError(f"kernel family {self.family!r} has no reference module (only the fused kernels of "
                             f"FAMILIES have one; the megakernel is checked against the CPU interpreter)")
        return importlib.import_module(f"kimik3.kernels.reference.{self.spec.module}")

    @property
    def variant(self) -> str:
        return self.spec.variant

    @property
    def shapes(self) -> dict[str, Any]:
        return dict(self.shape_items)

    @property
    def runtime(self) -> dict[str, Any]:
        return dict(self.runtime_items)

    @property
    def budget(self) -> Budget:
        return self.spec.budget

    @property
    def ptx_features(self) -> tuple[str, ...]:
        return self.spec.ptx_features

    @property
    def archs(self) -> tuple[str, ...]:
        return self.spec.archs

    def compile(self, arch: str, **kw: Any) -> Any:
        """``module.compile_for(arch, variant=..., **shapes)`` (a fresh compile, no disk cache)."""
        return self.module.compile_for(arch, variant=self.variant, **self.shapes, **kw)


@dataclass(frozen=True)
class ProbeVariant(KernelVariant):
    """A probe kernel at the static shapes of one of its variants, named ``<family>/<tag>``; ``preset`` and ``batch``
    only fill the manifest's fields (a probe measures the hardware, not a model)."""

    tag: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}/{self.tag}"


def _make(name: str, preset: str, batch: int, expert_format: str = "dense") -> KernelVariant:
    cfg = get_preset(preset)
    fam = family(name)
    if expert_format not in fam.expert_formats:
        raise ValueError(f"kernel family {name!r} is built for expert formats {fam.expert_formats}, not "
                         f"{expert_format!r}")
    shapes = fam.shapes(cfg, batch) if expert_format == "dense" else fam.shapes(cfg, batch, expert_format=expert_format)
    return KernelVariant(name, preset, batch, tuple(sorted(shapes.items())), tuple(sorted(fam.runtime(cfg).items())),
                         ci=name in FAMILIES and (preset, batch) in CI_POINTS, expert_format=expert_format)


def all_variants(presets: tuple[str, ...] = PRESETS, batches: tuple[int, ...] = BATCHES) -> list[KernelVariant]:
    """Every family x preset x batch (66 variants for the defaults)."""
    return [_make(f, p, b) for p in presets for b in batches for f in FAMILIES]


def ci_variants() -> list[KernelVariant]:
    return [v for v in all_variants() if v.ci]


def variants_for(presets: tuple[str, ...] | list[str], batches: tuple[int, ...] | list[int],
                 families: tuple[str, ...] | list[str] | None = None,
                 expert_formats: tuple[str, ...] | list[str] = ("dense",)) -> list[KernelVariant]:
    """Variants of the given presets / batches (any preset of kimik3.model.config works, not only PRESETS), each
    family in those of ``expert_formats`` it is built for (the fused MoE kernel's formats are families of their
    own)."""
    fams = list(families) if families else [*FAMILIES, *PERSISTENT]
    unknown = [f for f in fams if f not in FAMILIES and f not in PERSISTENT]
    if unknown:
        raise ValueError(f"unknown kernel families {unknown}; known: {sorted([*FAMILIES, *PERSISTENT])}")
    bad = [x for x in expert_formats if x not in EXPERT_FORMATS]
    if bad:
        raise ValueError(f"unknown expert formats {bad}; known: {EXPERT_FORMATS}")
    return [_make(f, p, int(b), x) for p in presets for b in batches for f in fams for x in expert_formats
            if x in family(f).expert_formats]


def get_variant(name: str) -> KernelVariant:
    """Parse ``family/preset/bN`` (e.g. ``moe.mxfp4/k3-shard/b8``), or ``family/preset/bN-FORMAT`` for a family built
    per routed-expert format (``megakernel/k3-shard/b8-mxfp4``); a probe kernel is ``family/tag``
    (:func:`probe_variant`)."""
    if name.partition("/")[0] in PROBES:
        return probe_variant(name)
    try:
        family, preset, b = name.split("/")
        b, _, fmt = b.partition("-")
        if not b.startswith("b") or fmt == "dense":
            raise ValueError
        return _make(family, preset, int(b[1:]), fmt or "dense")
    except (ValueError, KeyError):
        raise ValueError(f"bad kernel variant name {name!r}; expected family/preset/bN with family in "
                         f"{sorted([*FAMILIES, *PERSISTENT])} (megakernel: also bN-mxfp4)") from None


def probe_variant(name: str) -> ProbeVariant:
    """The probe variant ``family/tag`` of :data:`PROBE_SHAPES` (e.g. ``probe.bandwidth/t256-l8-c2``)."""
    fam, _, tag = name.partition("/")
    if fam not in PROBE_SHAPES or tag not in PROBE_SHAPES[fam]:
        known = sorted(f"{f}/{t}" for f, tags in PROBE_SHAPES.items() for t in tags)
        raise ValueError(f"unknown probe kernel {name!r}; known: {known}")
    return ProbeVariant(fam, "probe", 1, tuple(sorted(PROBE_SHAPES[fam][tag].items())), tag=tag)


def all_probe_variants(families: tuple[str, ...] | list[str] | None = None) -> list[ProbeVariant]:
    """Every variant of the probe ``families`` (default: all), in :data:`PROBE_SHAPES` order."""
    fams = list(families) if families else list(PROBES)
    unknown = [f for f in fams if f not in PROBES]
    if unknown:
        raise ValueError(f"unknown probe families {unknown}; known: {sorted(PROBES)}")
    return [probe_variant(f"{f}/{t}") for f in fams for t in PROBE_SHAPES[f]]
