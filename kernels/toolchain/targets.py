"""The (preset, batch) pairs that are built ahead of time for a GPU machine without the CuTe DSL compiler.

One definition, read by everything that must agree on it: the prebuilt export (``scripts/device_check.py
--build-prebuilt``), the GPU tests (which may use only what was exported: the loader refuses any other static
shape) and the device check's plan. Adding a pair here adds it to the export, the tests and the plan together.
"""

from __future__ import annotations

__all__ = ["FUSED_TARGETS", "MEGAKERNEL_TARGETS", "MEGAKERNEL_MXFP4_TARGETS", "MEGAKERNEL_RANK_TARGETS",
           "PROBE_TARGETS", "fused_cases", "megakernel_cases", "megakernel_variants", "rank_variants", "probe_variants",
           "select"]

# (preset, batch, expert format) of every fused decode step that is exported
FUSED_TARGETS: tuple[tuple[str, int, str], ...] = (
    ("tiny", 1, "bf16"), ("tiny", 8, "bf16"), ("tiny", 64, "bf16"), ("tiny", 8, "mxfp4"),
    ("k3-shard", 1, "bf16"), ("k3-shard", 8, "bf16"), ("k3-shard", 64, "bf16"), ("k3-shard", 1, "mxfp4"),
    ("k3-shard", 8, "mxfp4"),
)
# (preset, batch) of every persistent-megakernel variant that is exported (the registry names them
# ``megakernel/<preset>/b<batch>``)
MEGAKERNEL_TARGETS: tuple[tuple[str, int], ...] = (("tiny", 1), ("k3-shard", 1), ("k3-shard", 8), ("k3-shard", 64))
# (preset, batch) of the megakernel variants compiled for MXFP4 routed experts (``megakernel/<preset>/b<batch>-mxfp4``:
# the program carries the experts as the K3 release stores them)
MEGAKERNEL_MXFP4_TARGETS: tuple[tuple[str, int], ...] = (("tiny", 1), ("k3-shard", 1), ("k3-shard", 8))
# (rank-slice preset, batch, expert format) of the megakernel variants built for rank programs (MKConfig.ranks): the
# loopback check's (every rank of tiny over 2 in one launch) and one rank of K3 on the rack at batch 1 and 8 (its
# experts MXFP4: bf16 ones would not fit one GPU). Apart from the single-GPU targets: they run rank programs only.
MEGAKERNEL_RANK_TARGETS: tuple[tuple[str, int, str], ...] = (
    ("tiny-rank", 1, "dense"), ("k3-rank", 1, "mxfp4"), ("k3-rank", 8, "mxfp4"),
)

# registry names of the probe kernels exported for the device check's constants phase (scripts/devcheck/probes.py):
# the bandwidth sweep (threads, loads in flight per thread, CTAs per SM), the pointer chase and the signal ping-pong
PROBE_TARGETS: tuple[str, ...] = (
    "probe.bandwidth/t128-l2-c1", "probe.bandwidth/t256-l2-c1", "probe.bandwidth/t256-l2-c2",
    "probe.bandwidth/t256-l4-c2", "probe.bandwidth/t256-l8-c2", "probe.bandwidth/t256-l16-c2",
    "probe.latency/chase", "probe.signal/pingpong",
)


def probe_variants(families: str = "") -> list[str]:
    """Registry names of the exported probe kernels, restricted to comma-separated probe ``families`` ("" = all,
    e.g. ``"probe.signal"``)."""
    fams = [f for f in families.split(",") if f]
    known = {n.partition("/")[0] for n in PROBE_TARGETS}
    unknown = [f for f in fams if f not in known]
    if unknown:
        raise ValueError(f"no probe targets for famil(ies) {unknown}; known: {sorted(known)}")
    return [n for n in PROBE_TARGETS if not fams or n.partition("/")[0] in fams]


def fused_cases(expert_format: str = "bf16") -> list[tuple[str, int]]:
    """The (preset, batch) pairs of the fused step exported with ``expert_format``."""
    if expert_format not in ("bf16", "mxfp4"):
        raise ValueError(f"expert_format must be 'bf16' or 'mxfp4', got {expert_format!r}")
    return [(p, b) for p, b, f in FUSED_TARGETS if f == expert_format]


def megakernel_cases(preset: str | None = None, expert_format: str = "dense") -> list[tuple[str, int]]:
    """The exported megakernel (preset, batch) pairs for ``expert_format`` ("dense" or "mxfp4"), all or those of one
    preset."""
    if expert_format not in ("dense", "mxfp4"):
        raise ValueError(f"expert_format must be 'dense' or 'mxfp4', got {expert_format!r}")
    targets = MEGAKERNEL_TARGETS if expert_format == "dense" else MEGAKERNEL_MXFP4_TARGETS
    return [(p, b) for p, b in targets if preset is None or p == preset]


def megakernel_variants(presets: str = "", batches: str = "", ranks: bool = False) -> list[str]:
    """Registry names of the exported megakernel variants, dense then MXFP4 (``ranks``: then those built for rank
    programs), restricted to comma-separated ``presets`` / ``batches`` ("" = all) as :func:`select` restricts the
    targets."""
    _, dense = select(presets, batches)  # (validates the arguments)
    ps, bs = _parse(presets, batches)
    fp4 = [(p, b) for p, b in MEGAKERNEL_MXFP4_TARGETS if (not ps or p in ps) and (not bs or b in bs)]
    out = [f"megakernel/{p}/b{b}" for p, b in dense] + [f"megakernel/{p}/b{b}-mxfp4" for p, b in fp4]
    return out + (rank_variants(presets, batches) if ranks else [])


def rank_variants(presets: str = "", batches: str = "") -> list[str]:
    """Registry names of the exported megakernel variants for rank programs (:data:`MEGAKERNEL_RANK_TARGETS`),
    restricted as :func:`megakernel_variants`."""
    ps, bs = _parse(presets, batches)
    return [f"megakernel/{p}/b{b}" + ("" if f == "dense" else f"-{f}") for p, b, f in MEGAKERNEL_RANK_TARGETS
            if (not ps or p in ps) and (not bs or b in bs)]


def _parse(presets: str, batches: str) -> tuple[list[str], list[int]]:
    ps = [p for p in presets.split(",") if p]
    try:
        bs = [int(b) for b in batches.split(",") if b]
    except ValueError:
        raise ValueError(f"batches must be comma-separated integers, got {batches!r}") from None
    return ps, bs


def select(presets: str = "", batches: str = "") -> tuple[list[tuple[str, int, str]], list[tuple[str, int]]]:
    """The fused and megakernel targets restricted to comma-separated ``presets`` / ``batches`` ("" = all)."""
    ps, bs = _parse(presets, batches)
    known = {p for p, _, _ in FUSED_TARGETS} | {p for p, _ in MEGAKERNEL_TARGETS} | {
        p for p, _ in MEGAKERNEL_MXFP4_TARGETS} | {p for p, _, _ in MEGAKERNEL_RANK_TARGETS}
    unknown = [p for p in ps if p not in known]
    if unknown:
        raise ValueError(f"no prebuilt targets for preset(s) {unknown}; known: {sorted(known)}")
    fused = [t for t in FUSED_TARGETS if (not ps or t[0] in ps) and (not bs or t[1] in bs)]
    mk = [t for t in MEGAKERNEL_TARGETS if (not ps or t[0] in ps) and (not bs or t[1] in bs)]
    return fused, mk
