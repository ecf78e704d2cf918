// The native executor's numerics and vector kernels (cpu_executor.cpp includes this file; architecture §8).
//
// One source for every x86 vector width: `MK_SIMD` is the width in floats the build targets — 16 with AVX-512
// (F, BW, VL), 8 with AVX2 + FMA, undefined without either (the executor's portable loops compile instead, as in the
// ThreadSanitizer build, which has no -march=native) — and namespace `mk::v` wraps the few operations the kernels
// use, so the GEMV, the activations and attention's P·V are written once. Which width a build got is decided by
// -march=native on the machine that runs it, and reported by `mk_simd_width()`.
//
// Numerics: fp32 accumulation; every output of a GEMV is summed over k in vector-width chunks, its lanes reduced by
// the same tree whatever block it sits in, so a row's result does not depend on how many other rows share the call.
// exp and tanh are the Cephes single-precision polynomials (within about 2 ulp of libm).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MK_SIMD 16
#elif defined(__AVX2__) && defined(__FMA__)
#define MK_SIMD 8
#endif
#ifdef MK_SIMD
#include <immintrin.h>
#endif

namespace mk {

// ------------------------------------------------------------------------------------------------ scalar numerics
static inline float bf2f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f2bf(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

static inline float rq(float x, bool bf) { return bf ? bf2f(f2bf(x)) : x; }
static inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }
static inline float siluf(float x) { return x / (1.0f + std::exp(-x)); }

template <class WT>
static inline float wcv(WT w);
template <>
inline float wcv<float>(float w) { return w; }
template <>
inline float wcv<uint16_t>(uint16_t w) { return bf2f(w); }

// ------------------------------------------------------------------------------------------------ portable GEMV
// Rows [0, nb) of x (float, row stride ldx) against rows [0, nrows) of a weight (row stride ldw) -> y[b][r].
// Register-blocked: 4 weight rows x 1 batch row (batch < 4: the 4-row block stays in L1 while every batch row
// passes over it) and 2 weight rows x 4 batch rows (batch >= 4: FMAs per load count). The `omp simd reduction`
// pragmas let the compiler vectorise the fp32 sums without -ffast-math (which would also reorder everything else).
template <class WT>
static void gemv_t(const WT* W, int64_t ldw, int nrows, const float* x, int64_t ldx, int nb, int K, float* y,
                   int64_t ldy) {
  if (nb < 4) {
    int r = 0;
    for (; r + 4 <= nrows; r += 4) {
      const WT *w0 = W + r * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
      for (int b = 0; b < nb; ++b) {
        const float* xb = x + static_cast<int64_t>(b) * ldx;
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int k = 0; k < K; ++k) {
          float xv = xb[k];
          a0 += wcv<WT>(w0[k]) * xv;
          a1 += wcv<WT>(w1[k]) * xv;
          a2 += wcv<WT>(w2[k]) * xv;
          a3 += wcv<WT>(w3[k]) * xv;
        }
        float* yb = y + static_cast<int64_t>(b) * ldy + r;
        yb[0] = a0; yb[1] = a1; yb[2] = a2; yb[3] = a3;
      }
    }
    for (; r < nrows; ++r) {
      const WT* w = W + r * ldw;
      for (int b = 0; b < nb; ++b) {
        const float* xb = x + static_cast<int64_t>(b) * ldx;
        float a = 0;
#pragma omp simd reduction(+ : a)
        for (int k = 0; k < K; ++k) a += wcv<WT>(w[k]) * xb[k];
        y[static_cast<int64_t>(b) * ldy + r] = a;
      }
    }
    return;
  }
  int r0 = 0;
  // 2 weight rows x 4 batch rows: 8 independent accumulators hide the FMA latency, 6 loads feed 8 FMAs
  for (; r0 + 2 <= nrows; r0 += 2) {
    const WT* w0 = W + r0 * ldw;
    const WT* w1 = w0 + ldw;
    int b = 0;
    for (; b + 4 <= nb; b += 4) {
      const float *x0 = x + static_cast<int64_t>(b) * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0, c0 = 0, c1 = 0, c2 = 0, c3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3, c0, c1, c2, c3)
      for (int k = 0; k < K; ++k) {
        const float u = wcv<WT>(w0[k]), v = wcv<WT>(w1[k]);
        const float e0 = x0[k], e1 = x1[k], e2 = x2[k], e3 = x3[k];
        a0 += u * e0; a1 += u * e1; a2 += u * e2; a3 += u * e3;
        c0 += v * e0; c1 += v * e1; c2 += v * e2; c3 += v * e3;
      }
      float* yb = y + static_cast<int64_t>(b) * ldy + r0;
      yb[0] = a0; yb[1] = c0; yb[ldy] = a1; yb[ldy + 1] = c1;
      yb[2 * ldy] = a2; yb[2 * ldy + 1] = c2; yb[3 * ldy] = a3; yb[3 * ldy + 1] = c3;
    }
    for (; b < nb; ++b) {
      const float* xb = x + static_cast<int64_t>(b) * ldx;
      float a = 0, c = 0;
#pragma omp simd reduction(+ : a, c)
      for (int k = 0; k < K; ++k) {
        a += wcv<WT>(w0[k]) * xb[k];
        c += wcv<WT>(w1[k]) * xb[k];
      }
      y[static_cast<int64_t>(b) * ldy + r0] = a;
      y[static_cast<int64_t>(b) * ldy + r0 + 1] = c;
    }
  }
  for (int r = r0; r < nrows; ++r) {
    const WT* w = W + r * ldw;
    for (int b = 0; b < nb; ++b) {
      const float* xb = x + static_cast<int64_t>(b) * ldx;
      float a = 0;
#pragma omp simd reduction(+ : a)
      for (int k = 0; k < K; ++k) a += wcv<WT>(w[k]) * xb[k];
      y[static_cast<int64_t>(b) * ldy + r] = a;
    }
  }
}

#ifdef MK_SIMD
// ------------------------------------------------------------------------------------------------ the vector layer
namespace v {
constexpr int W = MK_SIMD;

#if MK_SIMD == 16
using F = __m512;
struct Tail {  // the first n lanes of a vector (every mask the kernels use is a prefix)
  __mmask16 m;
};
static inline Tail tail(int n) {
  return {n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>(n <= 0 ? 0 : (1u << n) - 1)};
}
static inline F zero() { return _mm512_setzero_ps(); }
static inline F set1(float a) { return _mm512_set1_ps(a); }
static inline F load(const float* p) { return _mm512_loadu_ps(p); }
static inline F load(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}
static inline F load(const float* p, Tail t) { return _mm512_maskz_loadu_ps(t.m, p); }
static inline F load(const uint16_t* p, Tail t) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(t.m, p)), 16));
}
static inline void store(float* p, Tail t, F a) { _mm512_mask_storeu_ps(p, t.m, a); }
static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
static inline F min(F a, F b) { return _mm512_min_ps(a, b); }
static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
static inline F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
static inline F abs(F a) { return _mm512_abs_ps(a); }
static inline F with_sign_of(F mag, F s) {  // integer ops: AVX512F alone has no float and / or
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}
static inline F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline F scale2(F y, F n) { return _mm512_scalef_ps(y, n); }  // y * 2^n, n integral
static inline F where_lt(F a, F b, F t, F f) {                       // a < b ? t : f
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), f, t);
}
static inline F round_bf16(F x) {  // to bf16 and back, nearest even, NaN kept (as rq)
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(r), x);
}
// out[i] = the sum of the lanes of a[i], i < 8
static inline void sums8(F a0, F a1, F a2, F a3, F a4, F a5, F a6, F a7, float* out) {
  // fold 512 -> 256 bits, two accumulators per register
  const F t01 = add(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const F t23 = add(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  const F t45 = add(_mm512_shuffle_f32x4(a4, a5, 0x44), _mm512_shuffle_f32x4(a4, a5, 0xEE));
  const F t67 = add(_mm512_shuffle_f32x4(a6, a7, 0x44), _mm512_shuffle_f32x4(a6, a7, 0xEE));
  // 256 -> 128 bits: 128-bit lane i holds accumulator i (u) / 4+i (w)
  const F u = add(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
  const F w = add(_mm512_shuffle_f32x4(t45, t67, 0x88), _mm512_shuffle_f32x4(t45, t67, 0xDD));
  // 128 -> 32 bits within each lane: lane 4i holds sum(a[i]), lane 4i+1 sum(a[4+i])
  const F x = add(_mm512_unpacklo_ps(u, w), _mm512_unpackhi_ps(u, w));
  alignas(64) float s[16];
  _mm512_store_ps(s, add(x, _mm512_permute_ps(x, 0x4E)));
  for (int i = 0; i < 4; ++i) {
    out[i] = s[4 * i];
    out[4 + i] = s[4 * i + 1];
  }
}

#else  // MK_SIMD == 8: AVX2 + FMA
using F = __m256;
struct Tail {
  __m256i m;
  int n;
};
static inline Tail tail(int n) {
  return {_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), n};
}
static inline F zero() { return _mm256_setzero_ps(); }
static inline F set1(float a) { return _mm256_set1_ps(a); }
static inline F load(const float* p) { return _mm256_loadu_ps(p); }
static inline F load(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16));
}
static inline F load(const float* p, Tail t) { return _mm256_maskload_ps(p, t.m); }
static inline F load(const uint16_t* p, Tail t) {  // AVX2 has no 16-bit masked load: the tail via a copy
  if (t.n >= 8) return load(p);
  alignas(16) uint16_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < t.n; ++i) b[i] = p[i];
  return load(b);
}
static inline void store(float* p, Tail t, F a) { _mm256_maskstore_ps(p, t.m, a); }
static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
static inline F min(F a, F b) { return _mm256_min_ps(a, b); }
static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
static inline F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
static inline F abs(F a) { return _mm256_andnot_ps(set1(-0.0f), a); }
static inline F with_sign_of(F mag, F s) { return _mm256_or_ps(mag, _mm256_and_ps(s, set1(-0.0f))); }
static inline F floor(F a) { return _mm256_floor_ps(a); }
static inline F scale2(F y, F n) {
  // y * 2^n for integral n in [-150, 128] (what exp's clamp allows): two factors 2^h, 2^(n-h) with h = n >> 1 are
  // normal numbers, the first product is exact, so the result is rounded once, as AVX-512's scalef rounds it
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256i e127 = _mm256_set1_epi32(127);
  const F a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, e127), 23));
  const F b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), e127), 23));
  return mul(mul(y, a), b);
}
static inline F where_lt(F a, F b, F t, F f) { return _mm256_blendv_ps(f, t, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline F round_bf16(F x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
static inline void sums8(F a0, F a1, F a2, F a3, F a4, F a5, F a6, F a7, float* out) {
  // each lane sum is ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), whichever accumulator it is
  const F u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const F u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  _mm256_storeu_ps(out, add(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}
#endif

// ------------------------------------------------------------------------------------------------ vector math
static inline F exp(F x) {
  // clamp where exp is 0 / inf in fp32 anyway (max/min keep a NaN in the second operand)
  x = min(set1(89.0f), max(set1(-104.0f), x));
  const F fx = floor(fma(x, set1(1.44269504088896341f), set1(0.5f)));
  x = fnma(fx, set1(0.693359375f), x);
  x = fnma(fx, set1(-2.12194440e-4f), x);
  F y = set1(1.9875691500e-4f);
  y = fma(y, x, set1(1.3981999507e-3f));
  y = fma(y, x, set1(8.3334519073e-3f));
  y = fma(y, x, set1(4.1665795894e-2f));
  y = fma(y, x, set1(1.6666665459e-1f));
  y = fma(y, x, set1(5.0000001201e-1f));
  y = fma(y, mul(x, x), add(x, set1(1.0f)));
  return scale2(y, fx);  // y * 2^fx, overflowing to inf / underflowing to 0 like exp
}

static inline F tanh(F x) {
  const F ax = abs(x);
  const F e = exp(add(ax, ax));
  const F big = with_sign_of(sub(set1(1.0f), div(set1(2.0f), add(e, set1(1.0f)))), x);
  const F z = mul(x, x);
  F p = set1(-5.70498872745e-3f);
  p = fma(p, z, set1(2.06390887954e-2f));
  p = fma(p, z, set1(-5.37397155531e-2f));
  p = fma(p, z, set1(1.33314422036e-1f));
  p = fma(p, z, set1(-3.33332819422e-1f));
  const F small = fma(mul(p, z), x, x);
  return where_lt(ax, set1(0.625f), small, big);
}

static inline F sigmoid(F x) { return div(set1(1.0f), add(set1(1.0f), exp(sub(zero(), x)))); }
static inline F silu(F x) { return div(x, add(set1(1.0f), exp(sub(zero(), x)))); }
static inline F rq(F x, bool bf) { return bf ? round_bf16(x) : x; }
}  // namespace v

// ------------------------------------------------------------------------------------------------ vector GEMV
// A block of R weight rows x NB batch rows keeps R*NB vector accumulators in registers, so each weight vector is
// loaded once per block and feeds NB FMAs (the portable loops need most of a load per FMA, which at batch 8 costs
// more than the weight stream); the R*NB partial sums are reduced together eight at a time; and the next block's
// rows are prefetched while this one computes, so their misses start before the loads that need them. The block
// shape fits the register file: AVX-512's 32 registers hold 4 x 4 accumulators, AVX2's 16 hold 2 x 4.
constexpr int GEMV_ROWS = MK_SIMD == 16 ? 4 : 2;  // weight rows per block when several batch rows share it

// y[b * ldy + r] = W[r] . x[b] for r < R, b < NB, over K columns.
template <int R, int NB, bool PF, class WT>
static inline void gemv_block(const WT* __restrict W, int64_t ldw, const float* __restrict x, int64_t ldx, int K,
                              float* __restrict y, int64_t ldy, const WT* __restrict pf) {
  v::F acc[R * NB];
#pragma GCC unroll 32
  for (int i = 0; i < R * NB; ++i) acc[i] = v::zero();
  int k = 0;
  for (; k + v::W <= K; k += v::W) {
    if (PF && (k * static_cast<int>(sizeof(WT))) % 64 == 0) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * ldw + k), _MM_HINT_T0);
    }
    if constexpr (NB == 1) {  // one accumulator per row: load and use each weight vector at once
      const v::F xv = v::load(x + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = v::fma(v::load(W + r * ldw + k), xv, acc[r]);
    } else {
      v::F w[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) w[r] = v::load(W + r * ldw + k);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const v::F xv = v::load(x + b * ldx + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r * NB + b] = v::fma(w[r], xv, acc[r * NB + b]);
      }
    }
  }
  if (k < K) {
    const v::Tail t = v::tail(K - k);
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const v::F xv = v::load(x + b * ldx + k, t);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * NB + b] = v::fma(v::load(W + r * ldw + k, t), xv, acc[r * NB + b]);
    }
  }
  // reduce in groups of 8 accumulators (the last group padded with zeros)
  float s[8];
  const v::F z = v::zero();
#pragma GCC unroll 4
  for (int g = 0; g < R * NB; g += 8) {
    auto A = [&](int i) { return g + i < R * NB ? acc[g + i] : z; };
    v::sums8(A(0), A(1), A(2), A(3), A(4), A(5), A(6), A(7), s);
    for (int i = 0; i < 8 && g + i < R * NB; ++i) y[((g + i) % NB) * ldy + (g + i) / NB] = s[i];
  }
}

// R weight rows against every batch row, four at a time: the first group streams the block's rows in (and
// prefetches the next block's); later groups re-read them from L1.
template <int R, bool PF, class WT>
static inline void gemv_rows(const WT* W, int64_t ldw, const float* x, int64_t ldx, int nb, int K, float* y,
                             int64_t ldy, const WT* pf) {
  int b = 0;
  for (; b + 4 <= nb; b += 4) {
    if (b == 0) gemv_block<R, 4, PF, WT>(W, ldw, x, ldx, K, y, ldy, pf);
    else gemv_block<R, 4, false, WT>(W, ldw, x + b * ldx, ldx, K, y + b * ldy, ldy, pf);
  }
  const int left = nb - b;
  const bool first = b == 0;
  const float* xb = x + b * ldx;
  float* yb = y + b * ldy;
  if (left == 3) first ? gemv_block<R, 3, PF, WT>(W, ldw, xb, ldx, K, yb, ldy, pf)
                       : gemv_block<R, 3, false, WT>(W, ldw, xb, ldx, K, yb, ldy, pf);
  else if (left == 2) first ? gemv_block<R, 2, PF, WT>(W, ldw, xb, ldx, K, yb, ldy, pf)
                            : gemv_block<R, 2, false, WT>(W, ldw, xb, ldx, K, yb, ldy, pf);
  else if (left == 1) first ? gemv_block<R, 1, PF, WT>(W, ldw, xb, ldx, K, yb, ldy, pf)
                            : gemv_block<R, 1, false, WT>(W, ldw, xb, ldx, K, yb, ldy, pf);
}

template <class WT>
static void gemv_simd(const WT* W, int64_t ldw, int nrows, const float* x, int64_t ldx, int nb, int K, float* y,
                      int64_t ldy) {
  int r = 0;
  if (nb == 1) {  // memory-bound: 8 rows in flight, one x load per 8 FMAs
    for (; r + 8 <= nrows; r += 8) {
      const WT* nxt = W + (r + 8 < nrows ? r + 8 : r) * ldw;
      gemv_block<8, 1, true, WT>(W + r * ldw, ldw, x, ldx, K, y + r, ldy, nxt);
    }
  } else {
    constexpr int R = GEMV_ROWS;
    for (; r + R <= nrows; r += R) {
      const WT* nxt = W + (r + R < nrows ? r + R : r) * ldw;
      gemv_rows<R, true, WT>(W + r * ldw, ldw, x, ldx, nb, K, y + r, ldy, nxt);
    }
  }
  for (; r < nrows; ++r) gemv_rows<1, false, WT>(W + r * ldw, ldw, x, ldx, nb, K, y + r, ldy, W);
}

// ------------------------------------------------------------------------------------------------ attention P·V
// acc[h * n + i] = sum_t P[h * ldp + t] * C[t * ldc + i] for h < HB heads, i < n, t < T, each element summed in t
// order: PV_COLS column vectors x HB heads of accumulators stay in registers over the whole tile, so each cache row
// chunk is loaded once per head group.
constexpr int PV_COLS = MK_SIMD == 16 ? 4 : 2;

template <int HB, class CT>
static void pv_block(const CT* C, int64_t ldc, int T, const float* P, int ldp, int n, float* acc) {
  constexpr int CW = PV_COLS * v::W;
  for (int c0 = 0; c0 < n; c0 += CW) {
    v::Tail m[PV_COLS];
#pragma GCC unroll 4
    for (int j = 0; j < PV_COLS; ++j) m[j] = v::tail(n - c0 - v::W * j);
    v::F a[HB][PV_COLS];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
      for (int j = 0; j < PV_COLS; ++j) a[h][j] = v::zero();
    for (int t = 0; t < T; ++t) {
      v::F cv[PV_COLS];
#pragma GCC unroll 4
      for (int j = 0; j < PV_COLS; ++j) cv[j] = v::load(C + t * ldc + c0 + v::W * j, m[j]);
#pragma GCC unroll 4
      for (int h = 0; h < HB; ++h) {
        const v::F p = v::set1(P[h * ldp + t]);
#pragma GCC unroll 4
        for (int j = 0; j < PV_COLS; ++j) a[h][j] = v::fma(p, cv[j], a[h][j]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
      for (int j = 0; j < PV_COLS; ++j) v::store(acc + h * n + c0 + v::W * j, m[j], a[h][j]);
  }
}

template <class CT>
static void pv_simd(const CT* C, int64_t ldc, int T, const float* P, int ldp, int hh, int n, float* acc) {
  int h = 0;
  for (; h + 4 <= hh; h += 4) pv_block<4, CT>(C, ldc, T, P + h * ldp, ldp, n, acc + h * n);
  const int left = hh - h;
  if (left == 3) pv_block<3, CT>(C, ldc, T, P + h * ldp, ldp, n, acc + h * n);
  else if (left == 2) pv_block<2, CT>(C, ldc, T, P + h * ldp, ldp, n, acc + h * n);
  else if (left == 1) pv_block<1, CT>(C, ldc, T, P + h * ldp, ldp, n, acc + h * n);
}
#endif  // MK_SIMD

}  // namespace mk
