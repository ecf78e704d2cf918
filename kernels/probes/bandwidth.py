"""Probe: the HBM read bandwidth a persistent grid sustains at a known number of bytes in flight per SM.

Each thread issues ``loads`` independent 16-byte read-only loads (``ld.global.nc.v4``, the path the decode kernels
stream weights through) per step before it adds any of them up, so a variant keeps ``threads`` x ``loads`` x 16 B x
``ctas_per_sm`` in flight per SM. Each CTA writes the int32 sum of what it read (no load is dead) and one row of
stamps (globaltimer at start and end, ``%smid``); the host divides the bytes by the span of the stamps.
``stream_sum`` (which chunks a thread reads, and their sum) is what tests/test_probes.py executes on the host;
``cta_total`` and ``stamp`` serve the loaded-latency probe too (``latency.py``). Exported like every kernel
(docs/architecture.md, appendix "kernels toolchain: prebuilt artefacts"); design and the runner: appendix
"kernels/probes: measuring the model's constants".
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from kimik3.kernels.common import device as C
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

__all__ = ["SOURCE_HASH", "VARIANTS", "WORDS", "STAMP_WORDS", "stream_sum", "cta_total", "stamp", "specs",
           "compile_for"]

SOURCE_HASH = kernel_source_hash("probe_bandwidth")
VARIANTS = ("stream",)
WORDS = 4  # int32 words per 16-byte load
STAMP_WORDS = 3  # per CTA: globaltimer at its start, at its end, %smid


@cute.jit
def _step(gB: cute.Tensor, c0: Int32, T: Int32, acc: Int32, LOADS: cutlass.Constexpr, TAIL: cutlass.Constexpr
          ) -> Int32:
    """Chunks c0, c0 + T, ..., c0 + (LOADS - 1) T of gB ((WORDS, chunks)) added to ``acc``: every load is issued
    before the first add; ``TAIL``: loads past the last chunk are skipped (the one partial step)."""
    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128, invariant=True)
    r = cute.make_rmem_tensor((WORDS, LOADS), Int32)
    n = cute.size(gB, mode=[1])
    if const_expr(TAIL):
        r.fill(0)
    for u in cutlass.range_constexpr(LOADS):
        if const_expr(TAIL):
            if c0 + u * T < n:
                cute.copy(ld, gB[(None, c0 + u * T)], r[None, u])
        else:
            cute.copy(ld, gB[(None, c0 + u * T)], r[None, u])
    for u in cutlass.range_constexpr(LOADS):
        for w in cutlass.range_constexpr(WORDS):
            acc = acc + r[w, u]
    return acc


@cute.jit
def stream_sum(mBuf: cute.Tensor, g: Int32, T: Int32, LOADS: cutlass.Constexpr) -> Int32:
    """Thread ``g`` of ``T``: the wrapping int32 sum of its 16-byte chunks of ``mBuf``. Step s covers chunks
    [s T LOADS, (s + 1) T LOADS); the thread reads s T LOADS + u T + g for u < LOADS, so for each u the T threads
    read T consecutive chunks (a warp: 512 contiguous bytes per load). The last, partial step is predicated."""
    gB = cute.zipped_divide(mBuf, (WORDS,))
    n = cute.size(gB, mode=[1])
    span = T * LOADS
    steps = n // span
    acc = Int32(0)
    for s in cutlass.range(steps, unroll=1):
        acc = _step(gB, s * span + g, T, acc, LOADS, False)
    if steps * span < n:
        acc = _step(gB, steps * span + g, T, acc, LOADS, True)
    return acc


@cute.jit
def cta_total(acc: Int32, tidx: Int32, red: cute.Tensor, NW: cutlass.Constexpr) -> Int32:
    """``acc`` summed over the CTA's ``NW`` warps (a butterfly per warp, ``red``: NW int32 of shared memory, one
    barrier); every thread returns the total."""
    for off in cutlass.range_constexpr(5):
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=16 >> off)
    if tidx % 32 == 0:
        red[tidx // 32] = acc
    cute.arch.sync_threads()
    total = red[0]
    for w in cutlass.range_constexpr(1, NW):
        total = total + red[w]
    return total


@cute.jit
def stamp(mTime: cute.Tensor, row: Int32, t0: Int64) -> None:
    """Row ``row`` of the stamps: ``t0``, globaltimer now, ``%smid``."""
    mTime[row, 0] = t0
    mTime[row, 1] = cute.arch.globaltimer()
    mTime[row, 2] = Int64(cute.arch.smid())


@cute.kernel
def probe_bandwidth_kernel(mBuf: cute.Tensor, mSum: cute.Tensor, mTime: cute.Tensor, THREADS: cutlass.Constexpr,
                           LOADS: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    alloc = cutlass.memory.SmemAllocator()
    red = C.smem_tensor(alloc, Int32, (THREADS // 32,), "probe_bandwidth")
    t0 = cute.arch.globaltimer()
    acc = stream_sum(mBuf, bidx * THREADS + tidx, nblk * THREADS, LOADS)
    total = cta_total(acc, tidx, red, THREADS // 32)  # its barrier: every load of the CTA has landed
    if (tidx == 0) & (bidx < cute.size(mSum)):
        mSum[bidx] = total
        stamp(mTime, bidx, t0)


@cute.jit
def probe_bandwidth(mBuf: cute.Tensor, mSum: cute.Tensor, mTime: cute.Tensor, num_ctas: Int32, stream: Any,
                    THREADS: cutlass.Constexpr, LOADS: cutlass.Constexpr, CPS: cutlass.Constexpr):
    """``num_ctas`` CTAs of ``THREADS`` threads stream all of ``mBuf`` once (compiled for ``CPS`` resident CTAs per
    SM; the host launches CPS per SM)."""
    assert cute.size(mBuf) % WORDS == 0 and THREADS % 32 == 0
    probe_bandwidth_kernel(mBuf, mSum, mTime, THREADS, LOADS).launch(
        grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=CPS,
        preferred_smem_carveout=-1)  # an explicit carveout: no device query at compile time (guide pitfall 7)


# ---------------------------------------------------------------------------------------------- host side
def specs(*, words: int, max_ctas: int, stamp_words: int) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """name -> (dtype, static shape) of every tensor parameter, in call order."""
    if stamp_words != STAMP_WORDS:
        raise ValueError(f"probe_bandwidth: stamp_words must be {STAMP_WORDS} (start, end, smid), got {stamp_words}")
    if words <= 0 or words % WORDS:
        raise ValueError(f"probe_bandwidth: words must be a positive multiple of {WORDS}, got {words}")
    return {"buf": (Int32, (words,)), "sums": (Int32, (max_ctas,)), "stamps": (Int64, (max_ctas, stamp_words))}


def compile_for(arch: str, *, variant: str = "stream", threads: int, loads: int, ctas_per_sm: int, words: int,
                max_ctas: int, stamp_words: int = STAMP_WORDS, tvm_ffi: bool = False, remark_file: str | None = None
                ) -> Any:
    """Compile the streaming read for static shapes (fake tensors: no GPU needed); TVM-FFI signature
    ``(buf, sums, stamps, num_ctas)``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown probe_bandwidth variant {variant!r}; expected one of {VARIANTS}")
    if threads % 32 or not 32 <= threads <= 1024 or loads < 1 or ctas_per_sm < 1:
        raise ValueError(f"probe_bandwidth: need threads a multiple of 32 in [32, 1024], loads >= 1 and "
                         f"ctas_per_sm >= 1; got threads={threads}, loads={loads}, ctas_per_sm={ctas_per_sm}")
    fakes = [dsl.fake(dt, shp) for dt, shp in specs(words=words, max_ctas=max_ctas, stamp_words=stamp_words).values()]
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(probe_bandwidth, *fakes, Int32(1), dsl.fake_stream(tvm_ffi), threads, loads, ctas_per_sm,
                            options=opts)
