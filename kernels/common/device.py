"""Device helpers every CuTe DSL kernel here inlines: warp reductions, fast exp / sigmoid on ``ex2.approx``,
bf16 rounding, the warp arg-max, the MXFP4 decode into bf16x2 fragments, and shared-memory allocations recorded at
trace time (their bytes never reach the PTX). Design: ``docs/architecture.md`` (map), ``docs/cute-dsl-notes.md``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from kimik3.kernels.common.trace import tracing_for_host

LOG2E = 1.4426950408889634
VEC = 8  # bf16 elements per 16-byte vector load


# ---------------------------------------------------------------------------------------------- sizes
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def batch_tile(batch: int, cap: int = 16) -> int:
    """Batch rows one CTA handles: all of them up to ``cap``, else the largest divisor <= cap.

    Keeping the per-warp accumulators for at most ``cap`` rows bounds register use at B = 64;
    the remaining tiles run as extra CTAs (grid x, fastest-varying, so CTAs that read the same
    weight rows are resident together and the re-reads hit L2).
    """
    if batch <= cap:
        return batch
    return max(d for d in range(1, cap + 1) if batch % d == 0)


# Shared memory comes from SmemAllocator as *dynamic* shared memory, whose size never appears in
# the PTX or the ptxas report. The kernels allocate through smem_tensor(), which records the bytes
# at trace time, so the build can check the budget without a GPU.
_SMEM_LOG: dict[str, int] = {}


def smem_tensor(alloc: Any, dtype: Any, shape: Any, kernel: str, align: int = 16) -> Any:
    """``alloc.allocate_tensor`` plus a trace-time record of the bytes under ``kernel``."""
    layout = cute.make_layout(shape)
    nbytes = math.prod(shape if isinstance(shape, tuple) else (shape,)) * (dtype.width // 8)
    used = _SMEM_LOG.get(kernel, 0)
    _SMEM_LOG[kernel] = -(-used // align) * align + nbytes
    return alloc.allocate_tensor(dtype, layout, align)


@contextlib.contextmanager
def smem_log() -> Iterator[dict[str, int]]:
    """Collect the shared-memory bytes of every kernel traced inside the block."""
    _SMEM_LOG.clear()
    out: dict[str, int] = {}
    try:
        yield out
    finally:
        out.update(_SMEM_LOG)
        _SMEM_LOG.clear()


# ---------------------------------------------------------------------------------------------- device side
@cute.jit
def warp_sum(x: Float32) -> Float32:
    """Butterfly sum over the 32 lanes (5 x shfl.sync.bfly); every lane gets the total."""
    for off in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=16 >> off)
    return x


@cute.jit
def warp_max(x: Float32) -> Float32:
    for off in cutlass.range_constexpr(5):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=16 >> off))
    return x


@cute.jit
def exp_fast(x: Float32) -> Float32:
    """exp(x) as ex2.approx(x * log2 e): ~2 ulp, plenty for bf16 outputs and the fp32 KDA decay."""
    return cute.math.exp2(x * LOG2E, approx=True)


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """1 / (1 + exp(-x)); exp overflows to inf for x << 0 and rcp(inf) = 0, so no clamp is needed."""
    return cute.arch.rcp_approx(1.0 + exp_fast(-x))


@cute.jit
def bf16_round(x: Float32) -> Float32:
    """Round to bf16 and back: where the reference materialises a bf16 intermediate."""
    return x.to(BFloat16).to(Float32)


@cute.jit
def argmax_take(v: Float32, i: Int32, bv: Float32, bi: Int32) -> Any:
    """Whether candidate (v, i) beats the best so far (bv, bi): a larger value, or an equal one with a lower index
    (torch.argmax / torch.topk's order on ties). Every arg-max and top-k comparison of the kernels is this one."""
    return (v > bv) | ((v == bv) & (i < bi))


@cute.jit
def warp_argmax(v: Float32, i: Int32, levels: cutlass.Constexpr = 5) -> tuple[Float32, Int32]:
    """Butterfly arg-max over the warp (GPU only: shuffles) through :func:`argmax_take`; ``levels`` < 5 reduces over
    the lane bits 4 .. 5 - levels only (e.g. 3: across the 8 lane groups of an mma fragment)."""
    for off in cutlass.range_constexpr(levels):
        ov = cute.arch.shuffle_sync_bfly(v, offset=16 >> off)
        oi = cute.arch.shuffle_sync_bfly(i, offset=16 >> off)
        take = argmax_take(ov, oi, v, i)
        v, i = (ov, oi) if take else (v, i)
    return v, i


# ---------------------------------------------------------------------------------------------- MXFP4 decode
# One 32-bit word holds 8 E2M1 codes (low nibble = even column). Both MXFP4 paths use the pair order (register /
# element pair s of a word = columns s, s + 4: fp4_pair_col); the fused MoE kernel (moe.py, CUDA cores, fp32) decodes
# with fp4_place / fp4_widen / fp4_expand / fp4_scale / x_pair_order, the megakernel's tensor-core expert opcodes
# (megakernel/moe.py) with fp4_bf16x2 and its helpers below. fp32 path: each code becomes an fp16 by masking the fp16
# exponent/mantissa ((c & 7) << 9) and the sign into bit 15: fp16 value = E2M1(c) · 2^-14, exact (code 1 lands on an
# fp16 subnormal, which cvt.f32.f16 keeps). fp4_scale folds the 2^14 back into the group's power-of-two scale.
@cute.jit
def fp4_place(w: Uint32) -> Any:
    """The 8 E2M1 codes of one 32-bit word placed as fp16 bits, TensorSSA (4,) uint32 in *pair order*: element s is
    the fp16x2 (column s, column s + 4) of the word's 8 columns, each value E2M1 · 2^-14 (``fp4_widen`` makes them
    fp32). Integer ops only, so a word can be placed once and widened where it is used."""
    h32 = cute.make_rmem_tensor((4,), Uint32)
    for s in cutlass.range_constexpr(4):
        t = (w >> (4 * s)) & 0x000F000F
        h32[s] = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
    return h32.load()


@cute.jit
def fp4_widen(placed: Any) -> Any:
    """``fp4_place``'s 4 fp16x2 words -> TensorSSA (8,) fp32, element 2s + hi holding column s + 4·hi
    (``fp4_pair_col``); exact."""
    return placed.bitcast(Float16).to(Float32)


@cute.jit
def fp4_expand(w: Uint32, scale: Any = None) -> Any:
    """The 8 E2M1 codes of one 32-bit word -> TensorSSA (8,) fp32 of value · 2^-14 (times ``scale`` when given), in
    pair order (``fp4_place`` then ``fp4_widen``). The scale is a power of two (``fp4_scale``), so the product is
    exact."""
    v = fp4_widen(fp4_place(w))
    if const_expr(scale is not None):
        v = v * scale
    return v


def fp4_pair_col(q: int) -> int:
    """Column (within a 32-column group) held by element q = 8j + 2s + hi of word j's fp4_expand output."""
    j, s, hi = q // 8, (q // 2) % 4, q % 2
    return 8 * j + s + 4 * hi


@cute.jit
def x_pair_order(rx: cute.Tensor, j: cutlass.Constexpr) -> Any:
    """rx: (8,) bf16, columns 8j..8j+7 of a group in order -> TensorSSA (8,) fp32 in the pair order of word j's
    fp4_expand. Static register moves only, element by element."""
    xs = rx.load().to(Float32)
    xp = cute.make_rmem_tensor((VEC,), Float32)
    for q in cutlass.range_constexpr(VEC):
        xp[q] = xs[fp4_pair_col(VEC * j + q) - VEC * j]
    return xp.load()


@cute.jit
def fp4_scale(e: Any) -> Float32:
    """2^(e - 127) · 2^14 as fp32 bits ((e + 14) << 23): the E8M0 scale, also undoing fp4_expand's fp16 placement.
    Scale bytes above 240 (2^114 and up) do not fit this form and are not expected."""
    return ((Uint32(e) + 14) << 23).bitcast(Float32)


# The tensor-core operand decode (megakernel/moe.py's MXFP4 expert opcodes) skips fp32: the 3 magnitude bits (e1 e0 m)
# of code c go to bf16 bits 8..6 (exponent field e1 e0, top mantissa bit m) and its sign to bit 15, which is the bf16
# value E2M1(c) · 2^-126 exactly (code 1, 0.5, becomes the bf16 subnormal 2^-127; bf16x2 mul keeps subnormals), then one
# bf16x2 multiply by 2^(e - 1) per register gives E2M1 · 2^(e - 127). 2^(e - 1) is a bf16 for e <= 128 (exponent
# field e + 126); a larger scale byte (not produced by quantisation, legal E8M0) multiplies by 2^127 first and by
# 2^(e - 128) second (``fp4_scale_hi``), both exact until the final rounding, which overflows where fp32 does.
# Placement of register s (columns s, s + 4: nibbles at bits 4s and 16 + 4s): the two nibbles masked out of the word
# (for s >= 2 of the word shifted right by 8, shared by s = 2, 3), then one integer multiply by 2^a + 2^(a + 6)
# (a = 6 - 4·(s % 2)) writes the nibble shifted by a (magnitude at bits 8..6) and by a + 6 (sign at bit 15) into
# disjoint bit ranges (6..9 and 12..15 of each half: no carries), and one mask keeps those bits.
FP4_BF16_BITS = 0x81C081C0  # bf16 bits 15 and 8..6 of both halves
FP4_BIG_SCALE = 128  # scale bytes above this need fp4_scale_hi


def fp4_word_place(s: int) -> tuple[int, int, int]:
    """Register s's placement constants: (right shift of the word, nibble mask, multiplier)."""
    a = 6 - 4 * (s % 2)
    return 8 * (s // 2), 0x000F000F << (4 * (s % 2)), (1 << a) + (1 << (a + 6))


@cute.jit
def fp4_bf16_scale(e: Any, keep: Any = None) -> Uint32:
    """The bf16x2 register (2^(min(e, 128) - 1), twice) that ``fp4_bf16x2``'s placed codes are multiplied by;
    ``keep`` (uint32 all-ones / 0): 0 zeroes the group."""
    s = (cutlass.min(Uint32(e), Uint32(FP4_BIG_SCALE)) + 126) << 7
    if const_expr(keep is not None):
        s = s & keep
    return s | (s << 16)


@cute.jit
def fp4_scale_hi(e: Any) -> Uint32:
    """The second factor of a scale byte above 128: bf16x2 2^(e - 128) (exponent field e - 1; 1.0 for e <= 128)."""
    s = (cutlass.max(Uint32(e), Uint32(FP4_BIG_SCALE)) - 1) << 7
    return s | (s << 16)


@cute.jit
def fp4_rescale(t: cute.Tensor, scale: Uint32) -> None:
    """(4,) uint32 bf16x2 registers times the bf16x2 ``scale`` in place (the second factor of a scale above 128)."""
    sv = cute.make_rmem_tensor((4,), Uint32)
    sv.fill(scale)
    tb = cute.recast_tensor(t, BFloat16)
    tb.store(tb.load() * cute.recast_tensor(sv, BFloat16).load())


@cute.jit
def fp4_bf16x2(w: Uint32, scale: Uint32) -> cute.Tensor:
    """The 8 E2M1 codes of one 32-bit word times their group's scale as (4,) uint32 bf16x2 registers (the
    tensor-core A operand), in pair order: register s holds (column s, column s + 4), low half first. ``scale``:
    ``fp4_bf16_scale`` of the group's byte; the values are E2M1 · 2^(e - 127) exactly for e <= 128 (larger:
    ``fp4_rescale`` by ``fp4_scale_hi``). Integer placement (``fp4_word_place``: and, multiply, and per register; one
    shift per word), then one bf16x2 multiply per register."""
    t = cute.make_rmem_tensor((4,), Uint32)
    w8 = w >> 8
    for s in cutlass.range_constexpr(4):
        sh, mask, mul = fp4_word_place(s)
        t[s] = (((w8 if const_expr(sh) else w) & Uint32(mask)) * Uint32(mul)) & Uint32(FP4_BF16_BITS)
    fp4_rescale(t, scale)
    return t


def x_pair_src(j: int, s: int) -> tuple[int, int, int, int]:
    """Where register s of word j's B operand gets its halves (columns ``fp4_pair_col`` of elements 2s and 2s + 1):
    (x register of the low half, its half, x register of the high half, its half), the x chunk read as 4 bf16x2
    registers of consecutive columns."""
    lo, hi = (fp4_pair_col(VEC * j + 2 * s + h) - VEC * j for h in range(2))
    return lo // 2, lo % 2, hi // 2, hi % 2


@cute.jit
def fp4_group_scales(e: Any, e8: Any, keep: Any) -> tuple[Uint32, Uint32, Any]:
    """A lane's two groups (rows g and g + 8) of scale bytes e, e8: their ``fp4_bf16_scale`` (times ``keep``) and
    whether either needs the second factor (a byte above 128: never written by quantisation)."""
    big = cutlass.max(Uint32(e), Uint32(e8)) > FP4_BIG_SCALE
    return fp4_bf16_scale(e, keep), fp4_bf16_scale(e8, keep), big


@cute.jit
def fp4_decode_pair(w: Uint32, w8: Uint32, e: Any, e8: Any, scales: tuple) -> tuple[cute.Tensor, cute.Tensor]:
    """One code word of each of the lane's two groups as bf16x2 registers (``fp4_bf16x2``), ``scales`` from
    ``fp4_group_scales``; the rare branch multiplies both by their ``fp4_scale_hi`` (1.0 for a byte <= 128)."""
    fg, f8, big = scales
    t, t8 = fp4_bf16x2(w, fg), fp4_bf16x2(w8, f8)
    if big:
        fp4_rescale(t, fp4_scale_hi(e))
        fp4_rescale(t8, fp4_scale_hi(e8))
    return t, t8


@dsl_user_op
def _prmt(a: Any, b: Any, sel: int, *, loc: Any = None, ip: Any = None) -> Uint32:
    """``prmt.b32 d, a, b, sel`` (GPU only; no side effects, so it schedules like an ALU op)."""
    args = [Uint32(v).ir_value(loc=loc, ip=ip) for v in (a, b)]
    return Uint32(llvm.inline_asm(T.i32(), args, f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def x_pair_bf16x2(rx: cute.Tensor, j: cutlass.Constexpr) -> cute.Tensor:
    """rx: (8,) bf16, columns 8j..8j+7 of a group in order -> (4,) uint32 bf16x2 registers in the pair order of word
    j's ``fp4_bf16x2`` (the B operand matching it): one ``prmt.b32`` per register on the GPU; the host execution (which
    cannot run inline PTX) takes the same halves with shifts and masks (``x_pair_src``)."""
    rw = cute.recast_tensor(rx, Uint32)
    xp = cute.make_rmem_tensor((4,), Uint32)
    for s in cutlass.range_constexpr(4):
        wl, hl, wh, hh = x_pair_src(j, s)
        if const_expr(tracing_for_host()):
            lo = (rw[wl] >> 16) if const_expr(hl) else (rw[wl] & Uint32(0xFFFF))
            hi = (rw[wh] & Uint32(0xFFFF0000)) if const_expr(hh) else (rw[wh] << 16)
            xp[s] = lo | hi
        else:  # bytes 2h, 2h + 1 of register wl, then of register wh (prmt bytes 4..7)
            xp[s] = _prmt(rw[wl], rw[wh], (2 * hl) | ((2 * hl + 1) << 4) | ((4 + 2 * hh) << 8) | ((5 + 2 * hh) << 12))
    return xp
