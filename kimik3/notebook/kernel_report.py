"""What a notebook shows of one kernel of the fused decode step: its source, PTX highlights, the ptxas resource
report, the bytes one call moves and any recorded GPU measurement.

Why a module: every kernel section of notebook 04 asks the same questions of a different launch, and the answers
(where the PTX comes from, which instructions prove a design point, when a recorded time measured an older source)
are code that must be linted and tested like the rest, not a long helper cell. Everything here runs on a CPU: the
PTX comes from the CuTe DSL compiler (no GPU needed) or from a cached build, and a measurement that does not exist
is shown as outstanding, never estimated.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from kimik3.fused.launch_cost import launch_bytes, launch_flops

if TYPE_CHECKING:
    from kimik3.fused.plan import FusedStep, Launch
    from kimik3.perf.hardware import HardwareSpec

__all__ = ["PTX_FEATURES", "opcode_notes", "BANDWIDTH_JUDGED_BYTES", "KernelReport", "git_date", "cached_build",
           "get_build",
           "show_source", "ptx_highlights", "hot_loop_excerpt", "measured_rows"]

# PTX instructions whose count shows a design point of the decode kernels (or, for `.local`, its failure: local
# memory means register spills, which a bandwidth-bound kernel must not have).
PTX_FEATURES: dict[str, str] = {
    "ld.global.nc.v4": "16-byte read-only loads (weights, caches): the loads in flight",
    "ld.global.v4": "16-byte loads of read-write data (KDA state)",
    "st.global.v4": "16-byte stores",
    "shfl.sync.bfly": "butterfly warp reductions (no shared memory, no barrier)",
    "rsqrt.approx": "RMSNorm / l2norm scalars",
    "ex2.approx": "exp, sigmoid, softmax in the log2 domain",
    "tanh.approx": "SiTU-GLU",
    "match.any.sync": "MoE align: lanes routed to the same expert",
    "cvt.f32.f16": "MXFP4 codes expanded through fp16",
    "bar.sync": "CTA barriers",
    "fma.rn.f32": "fp32 FMAs",
    ".local": "local memory (must not appear)",
}

# Bytes per call from which a kernel is judged against bandwidth; below it the few-microsecond launch latency
# dominates, so a bandwidth figure would say nothing about the kernel.
BANDWIDTH_JUDGED_BYTES = 32e6

Build = dict[str, Any]  # {"kernels": ptxas resource rows, "ptx": text[, "how": where it came from]}


def opcode_notes() -> pd.DataFrame:
    """What each megakernel opcode's device code does and its known limits, read from the docstrings of the
    ``op_*`` functions in ``kernels/megakernel/`` (each opens with ``NAME:`` and holds a ``Known limits:`` part),
    without importing the DSL."""
    import ast

    from kimik3.kernels.contracts.isa import Op
    from kimik3.kernels.toolchain.source import KERNEL_DIR

    rows = []
    for path in sorted((KERNEL_DIR / "megakernel").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) and node.name.startswith("op_") else None
            if not doc:
                continue
            name, _, body = doc.partition(":")
            what, _, limits = " ".join(body.split()).partition("Known limits:")
            rows.append((name.strip(), what.strip(), limits.strip(), f"kernels/megakernel/{path.name}:{node.name}"))
    notes = pd.DataFrame(rows, columns=["opcode", "device code", "known limits", "function"]).set_index("opcode")
    return notes.reindex([op.name for op in Op if op.name in notes.index])


def git_date(path: str) -> str | None:
    """Commit date (ISO) of the last change to ``path``, or None outside a git checkout. Used to flag a recorded
    measurement older than the kernel source when the record carries no source hash."""
    try:
        return subprocess.run(["git", "log", "-1", "--format=%cI", "--", path], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cached_build(op: Any, arch: str) -> Build | None:
    """A previous build of the same kernel source, DSL, arch, family and shapes (under any name), or None: lets a
    notebook run without the compiler's minutes still show real PTX when one was built before."""
    from kimik3.kernels.toolchain import build as B

    key = B.cache_key(op, arch)
    for d in sorted(B.cache_root().glob(f"*-{arch}-{key}")):
        if (d / "result.json").exists() and (d / "kernel.ptx").exists():
            data = json.loads((d / "result.json").read_text())
            return {"kernels": data["kernels"], "ptx": (d / "kernel.ptx").read_text(), "how": f"cached build {d.name}"}
    return None


def get_build(op: Any, arch: str, *, compile_kernels: bool, have_dsl: bool) -> tuple[Build | None, str]:
    """The PTX and ptxas report of ``op`` for ``arch`` and a sentence saying where they came from: compiled now
    (``compile_kernels``), else a cached build, else None with the reason, so a section never shows stale or
    missing PTX without saying so."""
    if not have_dsl:
        return None, "the CuTe DSL is not installed here: no PTX"
    if compile_kernels:
        from kimik3.kernels.toolchain import build as B

        t0 = time.perf_counter()
        r = B.build(op, arch, use_cache=False)
        return {"kernels": r.kernels, "ptx": r.ptx}, f"compiled now for {arch} in {time.perf_counter() - t0:.1f} s"
    hit = cached_build(op, arch)
    if hit is None:
        return None, "compilation skipped (compile_kernels=False) and no cached build: run with compile_kernels=True"
    return hit, hit["how"]


def show_source(*functions: Callable[..., Any]) -> None:
    """Display each function's source as a Markdown code block: the notebook shows the code that runs, read from
    ``kernels/`` at run time, never a copy that could drift."""
    from IPython.display import Markdown, display

    for f in functions:
        src = inspect.getsource(f)
        display(Markdown(f"`{f.__module__}.{f.__name__}` ({len(src.splitlines())} lines)\n```python\n{src}```"))


def ptx_highlights(ptx: str) -> pd.DataFrame:
    """Count of each :data:`PTX_FEATURES` instruction in ``ptx``: those present, and always ``.local`` (whose count
    must be 0)."""
    rows = [{"instruction": k, "count": ptx.count(k), "why": v} for k, v in PTX_FEATURES.items()]
    return pd.DataFrame(rows)[lambda d: (d["count"] > 0) | (d["instruction"] == ".local")]


def hot_loop_excerpt(ptx: str, n: int = 16) -> str:
    """``n`` PTX lines from the first 16-byte load of a real loop (after ``.pragma "nounroll"``, else the first
    16-byte load at all), headed by how many global loads issue before the first arithmetic instruction: the
    loads-in-flight that a bandwidth-bound kernel depends on."""
    if n < 1:
        raise ValueError(f"n must be a positive number of PTX lines, got {n}")
    lines = ptx.splitlines()
    loops = [i for i, ln in enumerate(lines) if '"nounroll"' in ln]
    nc = [i for i, ln in enumerate(lines) if "ld.global.nc.v4" in ln]
    wide = [i for i, ln in enumerate(lines) if "ld.global.v4" in ln] + nc
    in_loop = [i for i in nc if loops and i > loops[0]]
    first = in_loop[0] if in_loop else nc[0] if nc else min(wide) if wide else None
    if first is None:
        return "(no 16-byte global load found)"
    burst = 0
    for ln in lines[first:]:
        if "ld.global" in ln:
            burst += 1
        elif re.search(r"\b(fma|mul|add|sub)\.(rn\.)?f32", ln):
            break
    body = "\n".join(lines[max(0, first - 2):first + n])
    return f"{burst} global loads issued before the first arithmetic instruction:\n{body}"


def measured_rows(recorded: pd.DataFrame, launch_name: str, batch: int) -> pd.DataFrame:
    """The recorded measurements (``kimik3.perf.recorded.load_recorded``) of one launch's kernel at ``batch``."""
    if recorded.empty:
        return recorded
    return recorded[(recorded["block"] == f"kernel:{launch_name}") & (recorded["batch_size"] == batch)]


@dataclass
class KernelReport:
    """One notebook's view of the kernels of a fused step: the shapes (``batch``, ``context``), where PTX comes
    from (``arch``, ``compile_kernels``), the chip the analytic bound is computed for and the recorded
    measurements. :meth:`section` shows everything about one launch."""

    step: FusedStep
    arch: str
    compile_kernels: bool
    batch: int
    context: int
    preset: str
    hardware: HardwareSpec
    recorded: pd.DataFrame
    have_dsl: bool | None = None  # None: whether the CuTe DSL is importable here
    launches: dict[str, Launch] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.context < 0:
            raise ValueError(f"batch must be >= 1 and context >= 0, got batch={self.batch}, context={self.context}")
        if self.have_dsl is None:
            from kimik3.kernels.toolchain.loader import dsl_available

            self.have_dsl = dsl_available()
        self.launches = {ln.name: ln for ln in self.step.program}

    def build(self, op: Any) -> tuple[Build | None, str]:
        """:func:`get_build` with this report's arch and compile setting."""
        return get_build(op, self.arch, compile_kernels=self.compile_kernels, have_dsl=bool(self.have_dsl))

    def launch(self, launch_name: str) -> Launch:
        """The launch of the step named ``launch_name``; ``ValueError`` naming the kernel launches when unknown or
        when it is a PyTorch glue op (no kernel to report on)."""
        ln = self.launches.get(launch_name)
        if ln is None or ln.op is None:
            kernels = [n for n, x in self.launches.items() if x.op is not None]
            what = "is a glue op, not a kernel" if ln is not None else "is not a launch of this step"
            raise ValueError(f"{launch_name!r} {what}; kernel launches: {', '.join(kernels[:12])} ...")
        return ln

    def section(self, launch_name: str, *functions: Callable[..., Any]) -> None:
        """Display one kernel section: what the launch does and which launches share its compiled op, the source of
        ``functions``, the PTX highlights and ptxas resources against the op's budget, the bytes and FLOPs of one
        call with the analytic bound on ``hardware``, and the recorded measurements (flagged stale when they
        measured an older kernel source) or that the GPU measurement is outstanding."""
        from IPython.display import Markdown, display

        ln = self.launch(launch_name)
        op = ln.op
        users = [n for n, x in self.launches.items() if x.op is not None and x.op.key == op.key]
        display(Markdown(f"**{launch_name}**: `{op.name}` — {ln.note}. Same compiled op for {len(users)} launch(es) "
                         f"of the step: {', '.join(users[:6])}{' ...' if len(users) > 6 else ''}"))
        show_source(*functions)
        res, how = self.build(op)
        display(Markdown(f"*PTX / ptxas*: {how}"))
        if res is not None:
            ptx = res["ptx"]
            target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
            display(Markdown(f"`.target {target.group(1) if target else '?'}`, {len(ptx.splitlines()):,} PTX lines"))
            display(ptx_highlights(ptx))
            display(Markdown(f"```\n{hot_loop_excerpt(ptx)}\n```"))
            rk = pd.DataFrame(res["kernels"])
            rk["kernel"] = rk["name"].str.replace(r"^kernel_cutlass_(\w+?_kernel).*", r"\1", regex=True)
            b = op.budget
            rk["budget"] = f"<= {b.max_registers} regs, 0 spills, <= {b.max_shared_bytes} B smem"
            display(rk[["kernel", "registers", "spill_stores", "spill_loads", "stack", "shared_bytes", "budget"]])
        batch, context, hw = self.batch, self.context, self.hardware
        nbytes, flops = launch_bytes(ln, context=context), launch_flops(ln, context=context)
        bound = nbytes / hw.hbm_bandwidth
        judge = ("judged against 80 % of measured copy bandwidth" if nbytes >= BANDWIDTH_JUDGED_BYTES else
                 "under 32 MB: judged against the launch-latency floor (a few microseconds)")
        display(Markdown(f"*Bytes per call* (from the kernel's shapes, {batch=}, {context=}): "
                         f"**{nbytes / 1e6:,.2f} MB**, {flops / 1e9:,.3f} GFLOP ({flops / nbytes:.2f} FLOP/B). "
                         f"Analytic bound on the {hw.name} at the "
                         f"datasheet {hw.hbm_bandwidth / 1e12:.1f} TB/s: **{bound * 1e6:,.1f} µs**; {judge}."))
        rows = measured_rows(self.recorded, launch_name, batch)
        if rows.empty:
            display(Markdown("*Measured*: **GPU measurement outstanding** (`data/measurements/gpu_outstanding.json`, "
                             f"kernel-bandwidth-{self.preset}-b{batch})."))
            return
        from kimik3.kernels.toolchain.source import kernel_source_hash

        now = kernel_source_hash(op.module_name)[:16]
        src_date = git_date(f"kernels/{op.module_name}.py")
        for _, r in rows.iterrows():
            h = r.get("source_hash")
            stale = (h != now) if isinstance(h, str) else bool(src_date and str(r["date"]) < src_date)
            flag = " — **stale: measured an older kernel source**" if stale else ""
            display(Markdown(f"*Measured* ({r['label']}, {r['device']}): {r['seconds'] * 1e6:,.1f} µs, "
                             f"{r['bytes'] / r['seconds'] / 1e9:,.0f} GB/s{flag}"))
