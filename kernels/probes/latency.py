"""Probe: HBM load-to-use latency, unloaded and under a saturating stream, by a pointer chase.

Thread 0 of CTA 0 follows a chain of int32 indices (``idx = chain[idx]``: each load's address is the previous
load's value) for ``steps`` hops between two globaltimer reads. The host builds the chain as one random cycle over
nodes spread across a buffer larger than L2 (scripts/devcheck/probes.py), so every hop of a run touches a line the
run has not touched before. With more than one CTA the others stream the bandwidth probe's buffer ``passes`` times
meanwhile (``bandwidth.stream_sum``): the loaded latency; their stamps tell the host whether the stream covered the
chase. ``chase`` is what tests/test_probes.py executes on the host. Exported like every kernel (docs/architecture.md,
appendix "kernels toolchain: prebuilt artefacts"); design: appendix "kernels/probes: measuring the model's constants".
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from kimik3.kernels.common import device as C
from kimik3.kernels.probes.bandwidth import STAMP_WORDS, WORDS, cta_total, stamp, stream_sum
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

__all__ = ["SOURCE_HASH", "VARIANTS", "OUT_WORDS", "chase", "specs", "compile_for"]

SOURCE_HASH = kernel_source_hash("probe_latency")
VARIANTS = ("chase",)
OUT_WORDS = 2  # the chase's elapsed globaltimer ns, the index it ended on


@cute.jit
def chase(mChain: cute.Tensor, idx: Int32, steps: Int32, UNROLL: cutlass.Constexpr) -> Int32:
    """The index reached after ``steps`` hops (a multiple of ``UNROLL``) from ``idx``, ``UNROLL`` hops per loop
    iteration: every load waits for the one before it."""
    for _it in cutlass.range(steps // UNROLL, unroll=1):
        for _u in cutlass.range_constexpr(UNROLL):
            idx = mChain[idx]
    return idx


@cute.kernel
def probe_latency_kernel(mChain: cute.Tensor, mBuf: cute.Tensor, mOut: cute.Tensor, mSum: cute.Tensor,
                         mTime: cute.Tensor, start: Int32, steps: Int32, passes: Int32, THREADS: cutlass.Constexpr,
                         LOADS: cutlass.Constexpr, UNROLL: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    alloc = cutlass.memory.SmemAllocator()
    red = C.smem_tensor(alloc, Int32, (THREADS // 32,), "probe_latency")
    if bidx == 0:
        if tidx == 0:
            t0 = cute.arch.globaltimer()
            idx = chase(mChain, start, steps, UNROLL)
            t1 = cute.arch.globaltimer()
            mOut[0] = t1 - t0
            mOut[1] = Int64(idx)
            mTime[0, 0] = t0
            mTime[0, 1] = t1
            mTime[0, 2] = Int64(cute.arch.smid())
    else:  # CTA-uniform branch: the streamers' barrier is reached by all of their threads
        t0 = cute.arch.globaltimer()
        acc = Int32(0)
        for _p in cutlass.range(passes, unroll=1):
            acc = acc + stream_sum(mBuf, (bidx - 1) * THREADS + tidx, (nblk - 1) * THREADS, LOADS)
        total = cta_total(acc, tidx, red, THREADS // 32)
        if (tidx == 0) & (bidx < cute.size(mSum)):
            mSum[bidx] = total
            stamp(mTime, bidx, t0)


@cute.jit
def probe_latency(mChain: cute.Tensor, mBuf: cute.Tensor, mOut: cute.Tensor, mSum: cute.Tensor, mTime: cute.Tensor,
                  start: Int32, steps: Int32, passes: Int32, num_ctas: Int32, stream: Any,
                  THREADS: cutlass.Constexpr, LOADS: cutlass.Constexpr, UNROLL: cutlass.Constexpr,
                  CPS: cutlass.Constexpr):
    """CTA 0 chases; ``num_ctas`` - 1 streaming CTAs (0 for the unloaded latency) read ``mBuf`` ``passes`` times."""
    probe_latency_kernel(mChain, mBuf, mOut, mSum, mTime, start, steps, passes, THREADS, LOADS, UNROLL).launch(
        grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=CPS,
        preferred_smem_carveout=-1)  # an explicit carveout: no device query at compile time (guide pitfall 7)


# ---------------------------------------------------------------------------------------------- host side
def specs(*, chain_words: int, words: int, max_ctas: int, out_words: int, stamp_words: int
          ) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """name -> (dtype, static shape) of every tensor parameter, in call order."""
    if (out_words, stamp_words) != (OUT_WORDS, STAMP_WORDS):
        raise ValueError(f"probe_latency: out_words / stamp_words must be {OUT_WORDS} / {STAMP_WORDS}, got "
                         f"{out_words} / {stamp_words}")
    if chain_words <= 0 or words <= 0 or words % WORDS or max_ctas < 1:
        raise ValueError(f"probe_latency: need chain_words > 0, words a positive multiple of {WORDS} and "
                         f"max_ctas >= 1; got {chain_words}, {words}, {max_ctas}")
    return {"chain": (Int32, (chain_words,)), "buf": (Int32, (words,)), "out": (Int64, (out_words,)),
            "sums": (Int32, (max_ctas,)), "stamps": (Int64, (max_ctas, stamp_words))}


def compile_for(arch: str, *, variant: str = "chase", threads: int, loads: int, ctas_per_sm: int, unroll: int,
                chain_words: int, words: int, max_ctas: int, out_words: int = OUT_WORDS,
                stamp_words: int = STAMP_WORDS, tvm_ffi: bool = False, remark_file: str | None = None) -> Any:
    """Compile the chase (and its streamers) for static shapes; TVM-FFI signature ``(chain, buf, out, sums, stamps,
    start, steps, passes, num_ctas)``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown probe_latency variant {variant!r}; expected one of {VARIANTS}")
    if threads % 32 or not 32 <= threads <= 1024 or loads < 1 or ctas_per_sm < 1 or unroll < 1:
        raise ValueError(f"probe_latency: need threads a multiple of 32 in [32, 1024] and loads, ctas_per_sm, unroll "
                         f">= 1; got {threads}, {loads}, {ctas_per_sm}, {unroll}")
    sp = specs(chain_words=chain_words, words=words, max_ctas=max_ctas, out_words=out_words, stamp_words=stamp_words)
    fakes = [dsl.fake(dt, shp) for dt, shp in sp.values()]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(probe_latency, *fakes, Int32(0), Int32(unroll), Int32(1), Int32(1),
                            dsl.fake_stream(tvm_ffi), threads, loads, unroll, ctas_per_sm, options=opts)
