"""Where the compiled kernels of a fused step's plan come from: the CuTe DSL JIT, or verified prebuilt artefacts.

:func:`load_kernels` gives one callable per op of a plan (:mod:`kimik3.fused.plan`), every prebuilt one through the
checks of :mod:`kimik3.kernels.toolchain.loader` (source hash, arch, shapes, file hashes), and refuses with one
``ValueError`` naming every op without a usable kernel. :func:`build_prebuilt_kernels` exports the ops of a set
of targets on a machine with the DSL; :func:`_prebuilt_cache_len` picks the static MLA cache length a prebuilt
directory was built for.

Design: docs/architecture.md (map: the rooms, ``kimik3/stages/``; one decode step, end to end).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kimik3.fused.plan import FusedOp, fused_ops
from kimik3.kernels.contracts.meta import SUPPORTED_ARCHS
from kimik3.kernels.toolchain.loader import (
    PREBUILT_ENV,
    default_prebuilt_dir,
    dsl_available,
    find_prebuilt,
    jit_compiled,
    load_prebuilt_fn,
    resolve_source,
)
from kimik3.model.config import ModelConfig

__all__ = ["load_kernels", "build_prebuilt_kernels"]


def _find_prebuilt(manifest: dict[str, Any], op: FusedOp, arch: str) -> str | None:
    return find_prebuilt(manifest, op.module_name, op.variant, arch, op.shapes)


def _build_hint(ops: Iterable[FusedOp]) -> str:
    presets = sorted({o.preset for o in ops})
    batches = sorted({o.batch for o in ops})
    return (f"build them on a machine with the CuTe DSL: python scripts/device_check.py --build-prebuilt DIR "
            f"--presets {','.join(presets)} --batches {','.join(map(str, batches))} (then pass prebuilt=DIR or set "
            f"${PREBUILT_ENV})")


def load_kernels(ops: Sequence[FusedOp], arch: str, source: str = "auto",
                 prebuilt_dir: str | os.PathLike | None = None) -> dict[tuple[str, str, str], Callable[..., Any]]:
    """A callable per op: JIT-compiled (TVM-FFI) when ``source`` is "jit" (or "auto" with the DSL installed and no
    explicit prebuilt directory), else loaded from ``prebuilt_dir`` with every check of
    :func:`kimik3.kernels.toolchain.prebuilt.load_prebuilt` (source hash, arch, shapes, file hashes). Any op
    without a usable kernel makes the whole call fail with one ``ValueError`` listing them."""
    source = resolve_source(source, prebuilt_dir)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"stage 'fused' has kernels for {', '.join(SUPPORTED_ARCHS)}, not {arch}")
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        raise ValueError("stage 'fused' calls its kernels through TVM-FFI: `pip install apache-tvm-ffi` (or carry "
                         "its wheel to the GPU machine, scripts/device_check.sh)") from None
    out: dict[tuple[str, str, str], Callable[..., Any]] = {}
    if source == "jit":
        if not dsl_available():
            raise ValueError("kernels='jit' needs the CuTe DSL (pip install nvidia-cutlass-dsl); or use prebuilt "
                             "kernels (kernels='prebuilt', prebuilt=DIR)")
        for op in ops:
            out[op.key] = jit_compiled((arch, *op.key), lambda op=op: op.compile(arch, tvm_ffi=True))
        return out
    directory = Path(prebuilt_dir) if prebuilt_dir is not None else default_prebuilt_dir()
    if directory is None:
        raise ValueError("stage 'fused' found no kernels: the CuTe DSL is not installed and no prebuilt directory was "
                         f"given (prebuilt=DIR or ${PREBUILT_ENV}); " + _build_hint(ops))
    from kimik3.kernels.toolchain import prebuilt as pb

    manifest = pb.read_manifest(directory)
    problems: list[str] = []
    for op in ops:
        name = _find_prebuilt(manifest, op, arch)
        if name is None:
            problems.append(f"{op.name}: not built for {arch}")
            continue
        try:
            fn = load_prebuilt_fn(directory, manifest, name, arch, op.shapes)
        except (ValueError, ImportError) as e:
            problems.append(f"{op.name}: {e}")
            continue
        if fn is None:
            problems.append(f"{op.name}: exported as a cubin only (needs the tvm-ffi format)")
            continue
        out[op.key] = fn
    if problems:
        raise ValueError(f"stage 'fused' has no usable kernel in {directory} for {len(problems)} op(s): "
                         + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "") + "; "
                         + _build_hint([o for o in ops if o.key not in out]))
    return out


def _prebuilt_cache_len(directory: Path | None, cfg: ModelConfig, B: int, arch: str, need: int) -> int | None:
    """The static MLA cache length of the prebuilt MLA kernel for this config: the smallest S >= ``need``."""
    if directory is None or not (directory / "manifest.json").exists():
        return None
    manifest = json.loads((directory / "manifest.json").read_text())
    best = None
    want = dict(B=B, nh=cfg.num_attention_heads, DL=cfg.kv_lora_rank, DR=cfg.qk_rope_head_dim)
    for e in manifest.get("kernels", {}).values():
        sh = e.get("shapes", {})
        if e.get("module") == "mla_decode" and e.get("arch") == arch and all(sh.get(k) == v for k, v in want.items()):
            S = int(sh.get("S", 0))
            if S >= need and (best is None or S < best):
                best = S
    return best


def build_prebuilt_kernels(arch: str, out_dir: str | os.PathLike, targets: Sequence[tuple[str, int, str]], *,
                           ship_runtime: bool = True, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Export every op the fused step needs for ``targets`` = [(preset, batch, expert_format), ...] into
    ``out_dir`` (TVM-FFI ``.so`` + cubin + PTX + manifest), skipping ops already there for the same arch, shapes
    and current kernel source. Needs the CuTe DSL, g++ and apache-tvm-ffi; no GPU."""
    from kimik3.kernels.toolchain import prebuilt as pb
    from kimik3.kernels.toolchain import source as _source

    seen: dict[tuple[str, str, str], FusedOp] = {}
    for preset, batch, fmt in targets:
        for op in fused_ops(preset, int(batch), fmt):
            seen.setdefault(op.key, op)
    out = Path(out_dir)
    manifest: dict[str, Any] = {}
    if (out / pb.MANIFEST).exists():
        manifest = pb.read_manifest(out)
    todo = []
    for op in seen.values():
        name = _find_prebuilt(manifest, op, arch) if manifest.get("arch") == arch else None
        if name is not None and manifest["kernels"][name].get("source_hash") == _source.kernel_source_hash(
                op.module_name):
            continue
        todo.append(op)
    if log:
        log(f"fused step: {len(seen)} distinct ops for {len(targets)} target(s); {len(todo)} to build")
    if not todo and not ship_runtime:
        return manifest
    return pb.build_prebuilt(arch, out, todo, fmt="tvm-ffi", ship_runtime=ship_runtime, log=log)
