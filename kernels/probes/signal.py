"""Probe: how long a release-add on one SM takes to be seen by an acquire load on another, by a ping-pong.

Two one-warp CTAs, kept on different SMs by their shared memory (each takes more than half of an SM's), ping-pong
through two int32 counters in global memory with the instructions of the megakernel's dependency counters
(``kernels/megakernel/vm.py``: ``cute.arch.red(..., sem="release", scope="gpu")`` signals, ``cute.arch.load(...,
sem="acquire", scope="gpu")`` waits), without the megakernel's ``nanosleep`` back-off: ``warm`` rounds, then
``rounds`` timed by globaltimer on CTA 0; one round is two signal-to-acquire latencies. A wait gives up after
``max_spins`` loads (the CTA's row says so) instead of hanging. Exported like every kernel (docs/architecture.md,
appendix "kernels toolchain: prebuilt artefacts"); design: appendix "kernels/probes: measuring the model's constants".
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from kimik3.kernels.common import device as C
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

__all__ = ["SOURCE_HASH", "VARIANTS", "OUT_WORDS", "CTAS", "THREADS", "signal", "wait_for", "specs", "compile_for"]

SOURCE_HASH = kernel_source_hash("probe_signal")
VARIANTS = ("pingpong",)
CTAS, THREADS = 2, 32
# per CTA: globaltimer at the first timed round, at the end, %smid, rounds completed, 1 if no wait gave up
OUT_WORDS = 5


@cute.jit
def signal(ptr: cute.Pointer) -> None:
    """The megakernel's signal: a release add (``red.release.gpu.global.add``)."""
    cute.arch.red(ptr, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")


@cute.jit
def wait_for(ptr: cute.Pointer, target: Int32, max_spins: Int32) -> Int32:
    """Spin on the megakernel's acquire load (``ld.acquire.gpu``) until ``*ptr >= target``: 1 once it holds, 0 after
    ``max_spins`` more loads without it."""
    seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    spins = Int32(0)
    while (seen < target) & (spins < max_spins):
        spins = spins + 1
        seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    return Int32(1) if seen >= target else Int32(0)


@cute.kernel
def probe_signal_kernel(mCtr: cute.Tensor, mOut: cute.Tensor, warm: Int32, rounds: Int32, max_spins: Int32,
                        PAD: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    alloc = cutlass.memory.SmemAllocator()
    pad = C.smem_tensor(alloc, Int32, (PAD // 4,), "probe_signal")  # residency only: one CTA per SM
    if tidx == 0:
        pad[0] = bidx
        mine = mCtr.iterator + bidx
        theirs = mCtr.iterator + (1 - bidx)
        ok = Int32(1)
        i = Int32(0)
        t0 = cute.arch.globaltimer()
        while (i < warm + rounds) & (ok == 1):
            if i == warm:
                t0 = cute.arch.globaltimer()
            if bidx == 0:  # CTA 0 serves, CTA 1 returns: round i ends when CTA 0 sees CTA 1's (i + 1)-th add
                signal(mine)
                ok = wait_for(theirs, i + 1, max_spins)
            else:
                ok = wait_for(theirs, i + 1, max_spins)
                if ok == 1:
                    signal(mine)
            i = i + 1
        t1 = cute.arch.globaltimer()
        mOut[bidx, 0] = t0
        mOut[bidx, 1] = t1
        mOut[bidx, 2] = Int64(cute.arch.smid())
        mOut[bidx, 3] = Int64(i)
        mOut[bidx, 4] = Int64(ok)


@cute.jit
def probe_signal(mCtr: cute.Tensor, mOut: cute.Tensor, warm: Int32, rounds: Int32, max_spins: Int32, stream: Any,
                 PAD: cutlass.Constexpr):
    """Two co-resident CTAs (a cooperative launch), one warp each; the counters start at 0."""
    probe_signal_kernel(mCtr, mOut, warm, rounds, max_spins, PAD).launch(
        grid=[CTAS, 1, 1], block=[THREADS, 1, 1], stream=stream, cooperative=True)


# ---------------------------------------------------------------------------------------------- host side
def specs(*, out_words: int) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """name -> (dtype, static shape) of every tensor parameter, in call order."""
    if out_words != OUT_WORDS:
        raise ValueError(f"probe_signal: out_words must be {OUT_WORDS}, got {out_words}")
    return {"counters": (Int32, (CTAS,)), "out": (Int64, (CTAS, out_words))}


def compile_for(arch: str, *, variant: str = "pingpong", pad_bytes: int, out_words: int = OUT_WORDS,
                tvm_ffi: bool = False, remark_file: str | None = None) -> Any:
    """Compile the ping-pong; ``pad_bytes`` of dynamic shared memory per CTA (more than half an SM's keeps the two
    CTAs apart). TVM-FFI signature ``(counters, out, warm, rounds, max_spins)``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown probe_signal variant {variant!r}; expected one of {VARIANTS}")
    if pad_bytes < 4 or pad_bytes % 16:
        raise ValueError(f"probe_signal: pad_bytes must be a positive multiple of 16, got {pad_bytes}")
    fakes = [dsl.fake(dt, shp) for dt, shp in specs(out_words=out_words).values()]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(probe_signal, *fakes, Int32(1), Int32(1), Int32(1), dsl.fake_stream(tvm_ffi), pad_bytes,
                            options=opts)
