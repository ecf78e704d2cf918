// The megakernel's int32 program executed natively on the CPU: one worker thread per queue (per "SM"), each
// walking its queue once per decode step and waiting on std::atomic counters, as the GPU kernel's CTAs do.
//
// Why a native executor next to the Python interpreter: the interpreter proves the *program* under random
// interleavings, one instruction at a time; this runs it under real concurrency and at memory speed, so the
// idea's cost (waits, load balance, weight streaming) can be measured on any machine.
//
// Synchronisation is exactly the GPU kernel's: an instruction first waits until every (counter c, target t) it
// declares holds counter[c] >= step * total[c] + t (acquire loads), runs, and then adds its amount to its counter
// (release fetch_add). Counters are monotonic across steps and never reset between launches. A wait is a bounded
// spin: past a wall-clock deadline the worker sets the shared error word, every other worker abandons its wait,
// and the host gets a per-worker dump (queue position, instruction, counter, target, value seen).
//
// The encoding constants (opcodes, word offsets, dtype codes, FFN flags, parameter slots) are not written here:
// they come from `mk_encoding.h`, generated at build time from the Python definition (kimik3/megakernel/cpu.py).
//
// Numerics follow the reference model (kimik3/model/modeling.py) and the interpreter: fp32 accumulation everywhere; with
// bf16 activations every value the reference rounds to bf16 (a linear layer's output, the normalised input
// before the norm weight, the GLU output, ...) is rounded here at the same place (`rq`). Summation order and the
// activations' polynomials differ from PyTorch's (within the stage tolerance, not bit for bit); every output
// element is computed by one instruction in a fixed order, so a step is deterministic, and a row's GEMV result
// does not depend on how many other rows share the call.
//
// Two forms of the hot loops: with AVX-512 or AVX2 + FMA (the build uses -march=native on the machine that runs
// it) GEMVs, attention and activations are the vector kernels of `cpu_simd.h`, written once for either width;
// without them the portable loops compile instead (also the ThreadSanitizer build's, which has no -march=native).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>

#include "cpu_simd.h"
#include "mk_encoding.h"

namespace mk {

// Capacities of this executor (not of the encoding): batch rows gathered per expert, AttnRes candidates.
constexpr int MAX_BATCH = 64, MAX_DEPTH = 64, MAX_WORLD = 128;

struct Buf {
  char* p = nullptr;
  const uint8_t* mx = nullptr;  // MXFP4 form of a weight (E2M1 codes, low nibble = even column), or null
  const uint8_t* mx_scale = nullptr;  // its E8M0 scales, one per 32 columns
  int dt = 0, kind = 0;
  int64_t d0 = 0, d1 = 0, d2 = 0;
  inline int64_t at(int64_t b, int64_t r, int64_t c) const { return (b * d1 + r) * d2 + c; }
  inline float f(int64_t i) const {
    return dt == DT_F32 ? reinterpret_cast<const float*>(p)[i] : bf2f(reinterpret_cast<const uint16_t*>(p)[i]);
  }
  inline void set(int64_t i, float v) const {
    if (dt == DT_F32) reinterpret_cast<float*>(p)[i] = v;
    else reinterpret_cast<uint16_t*>(p)[i] = f2bf(v);
  }
  inline int64_t i64(int64_t i) const { return reinterpret_cast<const int64_t*>(p)[i]; }
  inline int64_t* pi64() const { return reinterpret_cast<int64_t*>(p); }
  inline bool* pbool() const { return reinterpret_cast<bool*>(p); }
};

struct Opnd {
  const Buf* b;
  int mode;
  int b0, b1, r0, r1, c0, c1;
};

// MXFP4 rows: each row is decoded once into fp32 (E2M1 code x 2^(e-127) per 32 columns) and dotted with every
// batch row; the weight stream is 4.25 bits per weight instead of 16 or 32.
static const float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0(uint8_t e) {
  if (e == 255) return NAN;
  uint32_t bits = e ? static_cast<uint32_t>(e) << 23 : (1u << 22);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static void gemv_mx(const Buf& w, int64_t off, int64_t ldw, int nrows, const float* x, int64_t ldx, int nb, int K,
                    float* y, int ldy) {
  constexpr int ROWS = 8;  // rows decoded per pass: one register block of the fp32 GEMV
  thread_local std::vector<float> rows;
  if (rows.size() < static_cast<size_t>(ROWS) * K) rows.resize(static_cast<size_t>(ROWS) * K);
  const int64_t row0 = off / ldw;  // every caller starts at column 0 of a row
  for (int r0 = 0; r0 < nrows; r0 += ROWS) {
    const int nr = std::min(ROWS, nrows - r0);
    for (int r = 0; r < nr; ++r) {
      float* wr = rows.data() + static_cast<int64_t>(r) * K;
      const uint8_t* q = w.mx + (row0 + r0 + r) * (ldw / 2);
      const uint8_t* sc = w.mx_scale + (row0 + r0 + r) * (ldw / 32);
      for (int g = 0; g < K / 32; ++g) {
        const float s = e8m0(sc[g]);
        for (int i = 0; i < 16; ++i) {
          const uint8_t byte = q[g * 16 + i];
          wr[g * 32 + 2 * i] = kE2M1[byte & 15] * s;
          wr[g * 32 + 2 * i + 1] = kE2M1[byte >> 4] * s;
        }
      }
    }
#ifdef MK_SIMD
    gemv_simd<float>(rows.data(), K, nr, x, ldx, nb, K, y + r0, ldy);
#else
    gemv_t<float>(rows.data(), K, nr, x, ldx, nb, K, y + r0, ldy);
#endif
  }
}

// y[b * ldy + r] = x[b * ldx ..] . W[row0 + r] for a weight buffer of either float dtype (weight element offset
// `off` of row 0); ldx defaults to K.
static void gemv(const Buf& w, int64_t off, int64_t ldw, int nrows, const float* x, int nb, int K, float* y,
                 int ldy, int64_t ldx = -1) {
  if (ldx < 0) ldx = K;
  if (w.mx)
    gemv_mx(w, off, ldw, nrows, x, ldx, nb, K, y, ldy);
#ifdef MK_SIMD
  else if (w.dt == DT_F32)
    gemv_simd<float>(reinterpret_cast<const float*>(w.p) + off, ldw, nrows, x, ldx, nb, K, y, ldy);
  else
    gemv_simd<uint16_t>(reinterpret_cast<const uint16_t*>(w.p) + off, ldw, nrows, x, ldx, nb, K, y, ldy);
#else
  else if (w.dt == DT_F32)
    gemv_t<float>(reinterpret_cast<const float*>(w.p) + off, ldw, nrows, x, ldx, nb, K, y, ldy);
  else
    gemv_t<uint16_t>(reinterpret_cast<const uint16_t*>(w.p) + off, ldw, nrows, x, ldx, nb, K, y, ldy);
#endif
}

// acc[0..n) += a * w[off .. off + n) for a weight row of either float dtype.
static void axpy(const Buf& w, int64_t off, float a, float* acc, int n) {
  if (w.dt == DT_F32) {
    const float* p = reinterpret_cast<const float*>(w.p) + off;
#pragma omp simd
    for (int i = 0; i < n; ++i) acc[i] += a * p[i];
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w.p) + off;
#pragma omp simd
    for (int i = 0; i < n; ++i) acc[i] += a * bf2f(p[i]);
  }
}

// ------------------------------------------------------------------------------------------------ executor

struct WorkerDump {  // what the host reads after a failed step (written by the worker, read after the join)
  int64_t state = 0;  // 0 finished, 1 gave up (watchdog), 2 abandoned its wait (another worker gave up)
  int64_t qpos = 0, qlen = 0, instr = -1, counter = -1, target = 0, seen = 0, word = 0;
};

struct Exec;

struct Worker {
  std::vector<float> s0, s1, s2, s3, s4;  // scratch, grown on demand, never shrunk
  WorkerDump dump;
  std::thread th;
  float* buf(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

struct Exec {
  // program
  std::vector<int32_t> prog;
  int N = 0, S = 0, Q = 0, C = 0, NB = 0, batch = 0;
  const int32_t* ins = nullptr;  // N x INSTR_WORDS
  const int32_t* queues = nullptr;  // S x Q, -1 padded
  std::vector<int64_t> totals;
  std::vector<Buf> bufs;
  std::vector<double> par;
  // a rank of a deployment (kernels/contracts/peers.py): every rank's copy of each MAILBOX buffer (null for other
  // kinds) and every rank's counter memory, mapped from one shared segment; a single GPU's program has world 1
  int rank = 0, world = 1;
  std::vector<std::vector<char*>> peer_p;  // [rank][buffer]
  std::vector<std::atomic<int64_t>*> ctr_of;  // [rank] -> its counter words
  std::vector<int64_t> cbase, csrc;  // per counter: first word, sources (0: local)
  int64_t words = 0;
  int64_t* peer_wait = nullptr;  // N: ns the last step spent waiting on cross-rank counters (null: not recorded)
  // run state
  std::unique_ptr<std::atomic<int64_t>[]> ctr;
  int64_t* timings = nullptr;  // N x 3: start ns, end ns, worker
  int64_t step = 0;
  int64_t timeout_ns = 0;
  std::atomic<int> error{0};
  // thread pool
  std::vector<Worker> workers;
  std::vector<int> cpus;
  bool pin = true;
  std::mutex mu;
  std::condition_variable cv_go, cv_done;
  std::atomic<int64_t> gen{0};
  std::atomic<int> done{0};
  bool quit = false;
  std::string why;
};

static inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

static bool bf_act(const Exec& ex) { return ex.par[P_ACT_BF16] != 0.0; }

// ------------------------------------------------------------------------------------------------ opcodes
// Each body reads its operands in the order the scheduler declares them (instructions.instruction_set_table) and
// touches nothing outside their boxes.

// RMSNorm of row x[0..n) into out: normalise in fp32, round to the activation dtype, multiply by the weight (the
// product rounded when both are bf16), as model.rms_norm.
static void rmsnorm(const float* x, int n, const Buf& w, int64_t woff, float eps, bool bf, float* out) {
  float ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  float r = 1.0f / std::sqrt(ss / n + eps);
  bool round_prod = bf && w.dt == DT_BF16;
  if (!bf && w.dt == DT_F32) {
    const float* wp = reinterpret_cast<const float*>(w.p) + woff;
#pragma omp simd
    for (int i = 0; i < n; ++i) out[i] = wp[i] * (x[i] * r);
  } else {
    for (int i = 0; i < n; ++i) out[i] = rq(w.f(woff + i) * rq(x[i] * r, bf), round_prod);
  }
}

// Rows b0..b1 of column range [c0, c0 + n) of entry `r` of a buffer as floats, row stride n.
static void load_rows(const Buf& b, int b0, int b1, int r, int c0, int n, float* out) {
  for (int bb = b0; bb < b1; ++bb) {
    int64_t base = b.at(bb, r, c0);
    float* o = out + static_cast<int64_t>(bb - b0) * n;
    if (b.dt == DT_F32) {
      std::memcpy(o, reinterpret_cast<const float*>(b.p) + base, sizeof(float) * n);
    } else {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(b.p) + base;
      for (int i = 0; i < n; ++i) o[i] = bf2f(s[i]);
    }
  }
}

static float glu(const Exec& ex, float a, float b, bool bf) {
  if (ex.par[P_SITU] != 0.0) {
    float beta = static_cast<float>(ex.par[P_SITU_BETA]);
    float g = beta * std::tanh(a / beta) * sigmoidf(a);
    double lin = ex.par[P_SITU_LIN];
    float u = std::isnan(lin) ? b : static_cast<float>(lin) * std::tanh(b / static_cast<float>(lin));
    return rq(g * u, bf);
  }
  return rq(rq(siluf(a), bf) * b, bf);  // SwiGLU in the activation dtype, as F.silu(gate) * up
}

// out[i] = glu(rq(a[i]), rq(b[i])) for i < n
static void glu_row(const Exec& ex, const float* a, const float* b, float* out, int n, bool bf) {
#ifdef MK_SIMD
  const bool situ = ex.par[P_SITU] != 0.0;
  const v::F beta = v::set1(static_cast<float>(ex.par[P_SITU_BETA]));
  const double lin = ex.par[P_SITU_LIN];
  const v::F linf = v::set1(static_cast<float>(lin));
  for (int i = 0; i < n; i += v::W) {
    const v::Tail m = v::tail(n - i);
    const v::F av = v::rq(v::load(a + i, m), bf), bv = v::rq(v::load(b + i, m), bf);
    v::F y;
    if (situ) {
      const v::F g = v::mul(v::mul(beta, v::tanh(v::div(av, beta))), v::sigmoid(av));
      const v::F u = std::isnan(lin) ? bv : v::mul(linf, v::tanh(v::div(bv, linf)));
      y = v::rq(v::mul(g, u), bf);
    } else {
      y = v::rq(v::mul(v::rq(v::silu(av), bf), bv), bf);
    }
    v::store(out + i, m, y);
  }
#else
  for (int i = 0; i < n; ++i) out[i] = glu(ex, rq(a[i], bf), rq(b[i], bf), bf);
#endif
}

// x[i] = rq(silu(x[i])) in place
static void silu_row(float* x, int n, bool bf) {
#ifdef MK_SIMD
  for (int i = 0; i < n; i += v::W) {
    const v::Tail m = v::tail(n - i);
    v::store(x + i, m, v::rq(v::silu(v::load(x + i, m)), bf));
  }
#else
  for (int i = 0; i < n; ++i) x[i] = rq(siluf(x[i]), bf);
#endif
}

// x[i] = exp(x[i] - base) in place
static void exp_shifted_row(float* x, int n, float base) {
#ifdef MK_SIMD
  for (int i = 0; i < n; i += v::W) {
    const v::Tail m = v::tail(n - i);
    v::store(x + i, m, v::exp(v::sub(v::load(x + i, m), v::set1(base))));
  }
#else
  for (int i = 0; i < n; ++i) x[i] = std::exp(x[i] - base);
#endif
}

// A row of floats into a buffer at element i (either float dtype), rounding to bf16 where the buffer is bf16.
static void store_row(const Buf& b, int64_t i, const float* v, int n) {
  if (b.dt == DT_F32) {
    std::memcpy(reinterpret_cast<float*>(b.p) + i, v, sizeof(float) * n);
  } else {
    uint16_t* p = reinterpret_cast<uint16_t*>(b.p) + i;
    for (int c = 0; c < n; ++c) p[c] = f2bf(v[c]);
  }
}

// Element (batch row b, column c) of an output box: [b, entry, c] of an activation, as of a MAILBOX (whose
// dimension 1 is slot·world + source rank: kernels/contracts/peers.py).
static inline int64_t row_at(const Opnd& o, int b, int c) { return o.b->at(o.b0 + b, o.r0, o.c0 + c); }

static void op_embed(Exec& ex, Worker&, const Opnd* o, const int32_t*) {
  const Buf &ids = *o[0].b, &emb = *o[1].b, &st = *o[2].b;
  int H = static_cast<int>(emb.d2);
  for (int b = o[2].b0; b < o[2].b1; ++b) {
    int64_t id = ids.i64(ids.at(b, 0, 0));
    for (int c = 0; c < H; ++c) st.set(st.at(b, 0, c), emb.f(emb.at(0, id, c)));
  }
  (void)ex;
}

static void op_attn_res_mix(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const Buf &st = *o[0].b, &nw = *o[1].b, &pw = *o[2].b, &mix = *o[3].b;
  int K = a[1];
  int H = static_cast<int>(st.d2);
  float eps = static_cast<float>(ex.par[P_EPS]);
  bool bf = bf_act(ex);
  float* V = wk.buf(wk.s0, static_cast<size_t>(K) * H);
  float* om = wk.buf(wk.s1, H);
  for (int c = 0; c < H; ++c) om[c] = nw.f(c) * pw.f(c);
  for (int b = o[0].b0; b < o[0].b1; ++b) {
    float sc[MAX_DEPTH];
    float mx = -INFINITY;
    for (int j = 0; j < K; ++j) {
      float* v = V + static_cast<int64_t>(j) * H;
      load_rows(st, b, b + 1, j, 0, H, v);
      float ss = 0, dot = 0;
#pragma omp simd reduction(+ : ss, dot)
      for (int c = 0; c < H; ++c) {
        ss += v[c] * v[c];
        dot += v[c] * om[c];
      }
      sc[j] = dot * (1.0f / std::sqrt(ss / H + eps));
      mx = std::max(mx, sc[j]);
    }
    float den = 0;
    for (int j = 0; j < K; ++j) den += (sc[j] = std::exp(sc[j] - mx));
    float* acc = wk.buf(wk.s2, H);  // candidates in turn, each output element summed in candidate order
    std::fill(acc, acc + H, 0.0f);
    for (int j = 0; j < K; ++j) {
      const float wj = sc[j] / den;
      const float* v = V + static_cast<int64_t>(j) * H;
#pragma omp simd
      for (int c = 0; c < H; ++c) acc[c] += wj * v[c];
    }
    for (int c = 0; c < H; ++c) acc[c] = rq(acc[c], bf);
    store_row(mix, mix.at(b, 0, 0), acc, H);
  }
}

// The normalised input rows of a NORM_PROJ / MLP_GATE_UP / LM_HEAD (operand 0: x rows 0..B of entry r0).
static float* normed_input(Exec& ex, Worker& wk, const Opnd& x, const Buf& nw, float eps, std::vector<float>& dst) {
  int H = x.c1 - x.c0, nb = x.b1 - x.b0;
  float* raw = wk.buf(wk.s3, static_cast<size_t>(H));
  float* xn = wk.buf(dst, static_cast<size_t>(nb) * H);
  for (int b = 0; b < nb; ++b) {
    load_rows(*x.b, x.b0 + b, x.b0 + b + 1, x.r0, x.c0, H, raw);
    rmsnorm(raw, H, nw, 0, eps, bf_act(ex), xn + static_cast<int64_t>(b) * H);
  }
  return xn;
}

static void op_norm_proj(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const Opnd &x = o[0], &w = o[2], &out = o[3];
  int H = x.c1 - x.c0, nb = x.b1 - x.b0, n = w.r1 - w.r0;
  float* xn = normed_input(ex, wk, x, *o[1].b, static_cast<float>(ex.par[P_EPS]), wk.s0);
  float* y = wk.buf(wk.s1, static_cast<size_t>(nb) * n);
  gemv(*w.b, w.b->at(0, w.r0, 0), w.b->d2, n, xn, nb, H, y, n);
  bool bf = bf_act(ex) && !a[0];  // fp32 router logits: fp32 input and weight, fp32 output
  for (int b = 0; b < nb; ++b)
    for (int r = 0; r < n; ++r) out.b->set(out.b->at(out.b0 + b, 0, out.c0 + r), rq(y[b * n + r], bf));
}

static void op_mlp_gate_up(Exec& ex, Worker& wk, const Opnd* o, const int32_t*) {
  const Opnd &x = o[0], &g = o[2], &u = o[3], &out = o[4];
  int H = x.c1 - x.c0, nb = x.b1 - x.b0, n = g.r1 - g.r0;
  bool bf = bf_act(ex);
  float* xn = normed_input(ex, wk, x, *o[1].b, static_cast<float>(ex.par[P_EPS]), wk.s0);
  float* yg = wk.buf(wk.s1, static_cast<size_t>(nb) * n);
  float* yu = wk.buf(wk.s2, static_cast<size_t>(nb) * n);
  gemv(*g.b, g.b->at(0, g.r0, 0), g.b->d2, n, xn, nb, H, yg, n);
  gemv(*u.b, u.b->at(0, u.r0, 0), u.b->d2, n, xn, nb, H, yu, n);
  for (int b = 0; b < nb; ++b) {
    glu_row(ex, yg + b * n, yu + b * n, yg + b * n, n, bf);
    store_row(*out.b, out.b->at(out.b0 + b, 0, out.c0), yg + b * n, n);
  }
}

// n consecutive elements of a buffer from element i as floats.
static void load_span(const Buf& b, int64_t i, int n, float* out) {
  if (b.dt == DT_F32) {
    std::memcpy(out, reinterpret_cast<const float*>(b.p) + i, sizeof(float) * n);
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(b.p) + i;
    for (int c = 0; c < n; ++c) out[c] = bf2f(s[c]);
  }
}

static void op_kda_step(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const int dk = static_cast<int>(ex.par[P_DK]), Wc = static_cast<int>(ex.par[P_CONV]);
  const int h0 = a[0], h1 = a[1], nh = h1 - h0;
  const int hw = 4 * dk + 1;
  const bool bf = bf_act(ex);
  const float eps = static_cast<float>(ex.par[P_EPS]);
  const double lb = ex.par[P_KDA_LB];
  const Opnd &blk = o[0], &fa = o[1], &conv = o[2], &Sd = o[3], &fb = o[4], &dt = o[5], &alog = o[6], &cw = o[7],
             &onorm = o[8], &out = o[9];
  const int nb = blk.b1 - blk.b0;
  // the head weights (f_b, dt_bias, A_log, conv) from the tile's first head in A_log's box: h0 on one GPU, its place
  // among the rank's heads on a rank (which holds only its heads' weights); the state is indexed by the head itself
  const int wh0 = alog.c0;
  float* q = wk.buf(wk.s0, 3 * static_cast<size_t>(dk));  // q, k, v of one head
  float* tmp = wk.buf(wk.s1, static_cast<size_t>(dk) * 5);  // g, dt bias, gate, norm weight, head output
  float* r = wk.buf(wk.s2, 2 * static_cast<size_t>(dk));  // prediction, output
  // the decay gate's f_b projection for every row and head of the instruction at once: its weights stream once
  float* fav = wk.buf(wk.s3, static_cast<size_t>(nb) * dk);
  float* U = wk.buf(wk.s4, static_cast<size_t>(nb) * nh * dk);
  load_rows(*fa.b, blk.b0, blk.b1, 0, fa.c0, dk, fav);
  gemv(*fb.b, fb.b->at(0, static_cast<int64_t>(wh0) * dk, 0), fb.b->d2, nh * dk, fav, nb, dk, U, nh * dk);
  float* g = tmp;
  float* dtv = tmp + dk;
  float* gate = tmp + 2 * dk;
  float* onw = tmp + 3 * dk;
  load_span(*onorm.b, onorm.b->at(0, 0, 0), dk, onw);
  const bool f32 = conv.b->dt == DT_F32 && cw.b->dt == DT_F32 && blk.b->dt == DT_F32;
  for (int b = blk.b0; b < blk.b1; ++b) {
    for (int h = h0; h < h1; ++h) {
      const int hl = h - h0, hwt = wh0 + hl;
      const int64_t bb = blk.b->at(b, 0, blk.c0 + static_cast<int64_t>(hl) * hw);
      // the head's state (read and rewritten below, last touched a step ago: usually not in cache) starts moving
      // in now, under the convolution and gate arithmetic
      float* S = reinterpret_cast<float*>(Sd.b->p) + Sd.b->at(b, h, 0);
      for (int64_t i = 0; i < static_cast<int64_t>(dk) * dk; i += 16) __builtin_prefetch(S + i, 1, 3);
      // short conv over (history, new token), SiLU, cast to the activation dtype
      for (int t = 0; t < 3; ++t) {
        if (f32) {
          float* cs = reinterpret_cast<float*>(conv.b->p) + conv.b->at(b, t, static_cast<int64_t>(h) * dk * (Wc - 1));
          const float* wv = reinterpret_cast<const float*>(cw.b->p) + cw.b->at(0, t, static_cast<int64_t>(hwt) * dk * Wc);
          const float* rw = reinterpret_cast<const float*>(blk.b->p) + bb + t * dk;
          for (int d = 0; d < dk; ++d, cs += Wc - 1, wv += Wc) {
            const float raw = rw[d];
            float acc = 0;
            for (int w = 0; w < Wc - 1; ++w) acc += cs[w] * wv[w];
            acc += raw * wv[Wc - 1];
            q[t * dk + d] = acc;
            for (int w = 0; w < Wc - 2; ++w) cs[w] = cs[w + 1];
            cs[Wc - 2] = raw;
          }
        } else {
          for (int d = 0; d < dk; ++d) {
            const int64_t ch = static_cast<int64_t>(h) * dk + d;  // channel within the projection
            const int64_t cbase = conv.b->at(b, t, ch * (Wc - 1));
            const int64_t wbase = cw.b->at(0, t, (static_cast<int64_t>(hwt) * dk + d) * Wc);
            float raw = blk.b->f(bb + t * dk + d);
            float acc = 0;
            for (int w = 0; w < Wc - 1; ++w) acc += conv.b->f(cbase + w) * cw.b->f(wbase + w);
            acc += raw * cw.b->f(wbase + Wc - 1);
            q[t * dk + d] = acc;
            for (int w = 0; w < Wc - 2; ++w) conv.b->set(cbase + w, conv.b->f(cbase + w + 1));
            conv.b->set(cbase + Wc - 2, raw);
          }
        }
      }
      silu_row(q, 3 * dk, bf);
      float* k = q + dk;
      float* v = q + 2 * dk;
      float sq = 0, sk = 0;
      for (int d = 0; d < dk; ++d) {
        sq += q[d] * q[d];
        sk += k[d] * k[d];
      }
      const float nq = std::sqrt(sq + 1e-6f), nk = std::sqrt(sk + 1e-6f), scale = 1.0f / std::sqrt((float)dk);
      for (int d = 0; d < dk; ++d) {
        q[d] = q[d] / nq * scale;
        k[d] = k[d] / nk;
      }
      // decay gate: u = f_b(f_a) + dt_bias, g = lb * sigmoid(exp(A_log) * u)  or  -exp(A_log) * softplus(u)
      const float* u = U + (static_cast<int64_t>(b - blk.b0) * nh + hl) * dk;
      const float lam = std::exp(alog.b->f(alog.b->at(0, 0, hwt)));
      load_span(*dt.b, dt.b->at(0, 0, static_cast<int64_t>(hwt) * dk), dk, dtv);
      for (int d = 0; d < dk; ++d) g[d] = rq(u[d], bf) + dtv[d];
      if (!std::isnan(lb)) {
        const float lbf = static_cast<float>(lb);
#ifdef MK_SIMD
        for (int d = 0; d < dk; d += v::W) {
          const v::Tail m = v::tail(dk - d);
          const v::F s = v::sigmoid(v::mul(v::set1(lam), v::load(g + d, m)));
          v::store(g + d, m, v::exp(v::mul(v::set1(lbf), s)));
        }
#else
        for (int d = 0; d < dk; ++d) g[d] = std::exp(lbf * sigmoidf(lam * g[d]));
#endif
      } else {
        for (int d = 0; d < dk; ++d) {
          const float uu = g[d];
          g[d] = std::exp(-lam * (uu > 20.0f ? uu : std::log1p(std::exp(uu))));
        }
      }
      const float beta = sigmoidf(blk.b->f(bb + 4 * dk));
      // gated delta rule on S [dk x dk] (key-major): decay rows, predict, correct, read with the new state
      float* pred = r;
      float* outv = r + dk;
      for (int j = 0; j < dk; ++j) pred[j] = 0;
      for (int i = 0; i < dk; ++i) {
        float* row = S + static_cast<int64_t>(i) * dk;
        const float gi = g[i], ki = k[i];
#pragma omp simd
        for (int j = 0; j < dk; ++j) {
          row[j] *= gi;
          pred[j] += row[j] * ki;
        }
      }
      for (int j = 0; j < dk; ++j) pred[j] = beta * (v[j] - pred[j]);
      for (int j = 0; j < dk; ++j) outv[j] = 0;
      for (int i = 0; i < dk; ++i) {
        float* row = S + static_cast<int64_t>(i) * dk;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int j = 0; j < dk; ++j) {
          row[j] += ki * pred[j];
          outv[j] += row[j] * qi;
        }
      }
      // gated RMSNorm of the head output (cast to the activation dtype first)
      float ss = 0;
      for (int j = 0; j < dk; ++j) {
        outv[j] = rq(outv[j], bf);
        ss += outv[j] * outv[j];
      }
      const float rs = 1.0f / std::sqrt(ss / dk + eps);
      load_span(*blk.b, bb + 3 * dk, dk, gate);
      float* y = tmp + 4 * dk;
#ifdef MK_SIMD
      for (int j = 0; j < dk; j += v::W) {
        const v::Tail m = v::tail(dk - j);
        const v::F t = v::mul(v::mul(v::load(outv + j, m), v::set1(rs)), v::load(onw + j, m));
        v::store(y + j, m, v::rq(v::mul(t, v::sigmoid(v::load(gate + j, m))), bf));
      }
#else
      for (int j = 0; j < dk; ++j) y[j] = rq(outv[j] * rs * onw[j] * sigmoidf(gate[j]), bf);
#endif
      store_row(*out.b, out.b->at(b, 0, static_cast<int64_t>(h) * dk), y, dk);
    }
  }
}

static void pv_acc(const Buf& C, int64_t off, int64_t ldc, int T, const float* P, int ldp, int hh, int n,
                   float* acc) {
#ifdef MK_SIMD
  if (C.dt == DT_F32) pv_simd<float>(reinterpret_cast<const float*>(C.p) + off, ldc, T, P, ldp, hh, n, acc);
  else pv_simd<uint16_t>(reinterpret_cast<const uint16_t*>(C.p) + off, ldc, T, P, ldp, hh, n, acc);
#else
  std::fill(acc, acc + static_cast<size_t>(hh) * n, 0.0f);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < hh; ++h) {
      const float pt = P[h * ldp + t];
      axpy(C, off + t * ldc, pt, acc + h * n, n);
    }
#endif
}

static void op_mla_q(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const int nope = static_cast<int>(ex.par[P_NOPE]), rope = static_cast<int>(ex.par[P_ROPE]);
  const int kvl = static_cast<int>(ex.par[P_KVL]), qk = nope + rope;
  const int h0 = a[0], h1 = a[1], hh = h1 - h0;
  const bool bf = bf_act(ex);
  const Opnd &x = o[0], &qb = o[2], &wuk = o[3], &out = o[4];
  const int ql = x.c1 - x.c0, nb = x.b1 - x.b0;
  const int layer = a[-static_cast<int>(W_ARGS) + W_LAYER];
  const float eps = static_cast<float>(ex.par[P_LORA_EPS + 2 * layer]);
  float* cq = normed_input(ex, wk, x, *o[1].b, eps, wk.s0);
  float* Q = wk.buf(wk.s1, static_cast<size_t>(nb) * hh * qk);
  gemv(*qb.b, qb.b->at(0, qb.r0, 0), qb.b->d2, hh * qk, cq, nb, ql, Q, hh * qk);
  for (int i = 0; i < nb * hh * qk; ++i) Q[i] = rq(Q[i], bf);
  float* lat = wk.buf(wk.s2, static_cast<size_t>(nb) * kvl);
  for (int hl = 0; hl < hh; ++hl) {
    // absorb W_UK: q_lat[b] = Q_nope[b] . W_UK[h], every row of the batch in one pass over the head's W_UK
    pv_acc(*wuk.b, wuk.b->at(0, wuk.r0 + static_cast<int64_t>(hl) * nope, 0), wuk.b->d2, nope, Q + hl * qk, hh * qk, nb,
           kvl, lat);
    for (int b = 0; b < nb; ++b) {
      const float* Qh = Q + (static_cast<int64_t>(b) * hh + hl) * qk;
      float* lb = lat + static_cast<int64_t>(b) * kvl;
      const int64_t ob = out.b->at(out.b0 + b, h0 + hl, 0);
      for (int l = 0; l < kvl; ++l) lb[l] = rq(lb[l], bf);
      store_row(*out.b, ob, lb, kvl);
      store_row(*out.b, ob + kvl, Qh + nope, rope);
    }
  }
}

static void op_mla_kv_append(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const int kvl = static_cast<int>(ex.par[P_KVL]), rope = static_cast<int>(ex.par[P_ROPE]);
  const int layer = a[-static_cast<int>(W_ARGS) + W_LAYER];
  const float eps = static_cast<float>(ex.par[P_LORA_EPS + 2 * layer + 1]);
  const Opnd &x = o[0], &pos = o[2], &lat = o[3], &kr = o[4];
  float* raw = wk.buf(wk.s0, kvl + rope);
  float* c = wk.buf(wk.s1, kvl);
  for (int b = x.b0; b < x.b1; ++b) {
    load_rows(*x.b, b, b + 1, 0, x.c0, kvl + rope, raw);
    rmsnorm(raw, kvl, *o[1].b, 0, eps, bf_act(ex), c);
    const int64_t p = pos.b->i64(pos.b->at(b, 0, 0));
    for (int l = 0; l < kvl; ++l) lat.b->set(lat.b->at(b, p, l), c[l]);
    for (int i = 0; i < rope; ++i) kr.b->set(kr.b->at(b, p, i), raw[kvl + i]);
  }
}

static void op_mla_partial(Exec& ex, Worker& wk, const Opnd* o, const int32_t*) {
  const int kvl = static_cast<int>(ex.par[P_KVL]), rope = static_cast<int>(ex.par[P_ROPE]);
  const float scale = static_cast<float>(ex.par[P_MLA_SCALE]);
  const bool bf = bf_act(ex);
  const Opnd &qd = o[0], &pos = o[1], &C = o[2], &KR = o[3], &part = o[4];
  const int t0 = C.r0, T = C.r1 - C.r0, h0 = qd.r0, hh = qd.r1 - qd.r0;
  const int qw = kvl + rope;
  float* qv = wk.buf(wk.s0, static_cast<size_t>(hh) * qw);
  float* s = wk.buf(wk.s1, static_cast<size_t>(hh) * T);
  float* acc = wk.buf(wk.s2, static_cast<size_t>(hh) * kvl);
  float* s2 = wk.buf(wk.s3, static_cast<size_t>(hh) * T);
  float* mrow = wk.buf(wk.s4, 2 * static_cast<size_t>(hh));  // per head: max, sum
  for (int b = qd.b0; b < qd.b1; ++b) {
    const int64_t p = pos.b->i64(pos.b->at(b, 0, 0));
    const int valid = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(T, p - t0 + 1)));
    for (int hl = 0; hl < hh; ++hl) load_rows(*qd.b, b, b + 1, h0 + hl, 0, qw, qv + hl * qw);
    if (valid > 0) {
      // scores of every head against the tile's cache rows: two GEMVs whose "weight rows" are the cache rows
      gemv(*C.b, C.b->at(b, t0, 0), C.b->d2, valid, qv, hh, kvl, s, T, qw);
      gemv(*KR.b, KR.b->at(b, t0, 0), KR.b->d2, valid, qv + kvl, hh, rope, s2, T, qw);
    }
    for (int hl = 0; hl < hh; ++hl) {
      float* sh = s + hl * T;
      const float* s2h = s2 + hl * T;
      float m = -INFINITY;
      for (int t = 0; t < valid; ++t) {
        sh[t] = rq(rq(sh[t], bf) + rq(s2h[t], bf), bf) * scale;
        m = std::max(m, sh[t]);
      }
      mrow[2 * hl] = m;
      exp_shifted_row(sh, valid, std::isfinite(m) ? m : 0.0f);
      float sum = 0;
      for (int t = 0; t < valid; ++t) sum += sh[t];
      mrow[2 * hl + 1] = sum;
    }
    pv_acc(*C.b, C.b->at(b, t0, 0), C.b->d2, valid, s, T, hh, kvl, acc);  // one pass over the rows per head group
    for (int hl = 0; hl < hh; ++hl) {
      float* po = reinterpret_cast<float*>(part.b->p) + part.b->at(b, h0 + hl, part.c0);
      std::memcpy(po, acc + hl * kvl, sizeof(float) * kvl);
      po[kvl] = mrow[2 * hl];
      po[kvl + 1] = mrow[2 * hl + 1];
    }
  }
}

static void op_mla_reduce(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const int kvl = static_cast<int>(ex.par[P_KVL]), dv = static_cast<int>(ex.par[P_DV]);
  const int h0 = a[0], h1 = a[1], hh = h1 - h0;
  const bool gated = a[2] != 0, bf = bf_act(ex);
  const Opnd &part = o[0], &wuv = o[1];
  const Opnd& out = o[gated ? 3 : 2];
  const int nsplit = (part.c1 - part.c0) / (kvl + 2);
  const int nb = part.b1 - part.b0;
  float* OL = wk.buf(wk.s0, static_cast<size_t>(nb) * kvl);
  float* Y = wk.buf(wk.s1, static_cast<size_t>(nb) * dv);
  for (int hl = 0; hl < hh; ++hl) {
    for (int b = part.b0; b < part.b1; ++b) {  // merge the context splits of every row
      const float* pp = reinterpret_cast<const float*>(part.b->p) + part.b->at(b, h0 + hl, 0);
      float* ol = OL + static_cast<int64_t>(b - part.b0) * kvl;
      float M = -INFINITY;
      for (int s = 0; s < nsplit; ++s) M = std::max(M, pp[s * (kvl + 2) + kvl]);
      float den = 0;
      for (int i = 0; i < kvl; ++i) ol[i] = 0;
      for (int s = 0; s < nsplit; ++s) {
        const float* ps = pp + s * (kvl + 2);
        const float w = std::exp(ps[kvl] - M);
        den += w * ps[kvl + 1];
#pragma omp simd
        for (int i = 0; i < kvl; ++i) ol[i] += w * ps[i];
      }
      for (int i = 0; i < kvl; ++i) ol[i] = rq(ol[i] / den, bf);
    }
    // W_UV of the head once for all rows
    gemv(*wuv.b, wuv.b->at(0, wuv.r0 + static_cast<int64_t>(hl) * dv, 0), wuv.b->d2, dv, OL, nb, kvl, Y, dv);
    for (int b = part.b0; b < part.b1; ++b) {
      const float* y = Y + static_cast<int64_t>(b - part.b0) * dv;
      for (int d = 0; d < dv; ++d) {
        float v = rq(y[d], bf);
        if (gated) {
          const Opnd& g = o[2];
          v = rq(v * rq(sigmoidf(g.b->f(g.b->at(b, 0, g.c0 + hl * dv + d))), bf), bf);
        }
        out.b->set(out.b->at(b, 0, out.c0 + hl * dv + d), v);
      }
    }
  }
}

static void op_o_proj_residual(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const Opnd &x = o[0], &w = o[1], &out = o[2];
  const int K = x.c1 - x.c0, nb = x.b1 - x.b0, n = w.r1 - w.r0;
  const bool bf = bf_act(ex);
  float* xv = wk.buf(wk.s0, static_cast<size_t>(nb) * K);
  load_rows(*x.b, x.b0, x.b1, 0, x.c0, K, xv);
  float* y = wk.buf(wk.s1, static_cast<size_t>(nb) * n);
  gemv(*w.b, w.b->at(0, w.r0, w.c0), w.b->d2, n, xv, nb, K, y, n);  // (w.c0: a rank's input columns)
  for (int b = 0; b < nb; ++b)
    for (int c = 0; c < n; ++c) {
      const int64_t i = row_at(out, b, c);
      const float v = rq(y[b * n + c], bf);
      out.b->set(i, a[0] ? rq(out.b->f(i) + v, bf) : v);
    }
}

static void op_router(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const Opnd &lg = o[0], &bias = o[1], &sel = o[2], &mw = o[3], &use = o[4];
  const int E = static_cast<int>(ex.par[P_E]), k = static_cast<int>(ex.par[P_TOPK]);
  const int B = lg.b1 - lg.b0, D = sel.c1 - sel.c0;
  const bool renorm = ex.par[P_RENORM] != 0.0;
  const float rs = static_cast<float>(ex.par[P_ROUTE_SCALE]);
  float* sc = wk.buf(wk.s0, static_cast<size_t>(B) * E);
  float* ch = wk.buf(wk.s1, E);
  float* wt = wk.buf(wk.s2, static_cast<size_t>(B) * k);
  std::vector<int> idx(static_cast<size_t>(B) * k);
  std::vector<char> chosen(E, 0);
  for (int b = 0; b < B; ++b) {
    for (int e = 0; e < E; ++e) {
      sc[b * E + e] = sigmoidf(lg.b->f(lg.b->at(b, 0, e)));
      ch[e] = sc[b * E + e] + bias.b->f(e);
    }
    float sum = 0;
    for (int j = 0; j < k; ++j) {  // top-k by the biased score; the lowest id among equals, as torch.topk
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken |= idx[b * k + i] == e;
        if (!taken && (best < 0 || ch[e] > ch[best])) best = e;
      }
      idx[b * k + j] = best;
      chosen[best] = 1;
      wt[b * k + j] = sc[b * E + best];
      sum += wt[b * k + j];
    }
    for (int j = 0; j < k; ++j) {
      if (renorm && k > 1) wt[b * k + j] = wt[b * k + j] / (sum + 1e-20f);
      wt[b * k + j] *= rs;
    }
  }
  std::vector<int> uniq;  // (args 0, 1: a rank's experts [lo, hi); the others are left to their ranks)
  const int lo = a[1] > a[0] ? a[0] : 0, hi = a[1] > a[0] ? a[1] : E;
  for (int e = lo; e < hi; ++e)
    if (chosen[e]) uniq.push_back(e);
  int64_t* sp = sel.b->pi64();
  // (a slot holds the expert's index among the rank's: e - lo, the rank holds only its experts)
  for (int j = 0; j < D; ++j) sp[sel.b->at(0, 0, j)] = j < static_cast<int>(uniq.size()) ? uniq[j] - lo : -1;
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < D; ++j) {
      float w = 0;
      bool u = false;
      if (j < static_cast<int>(uniq.size()))
        for (int i = 0; i < k; ++i)
          if (idx[b * k + i] == uniq[j]) {
            w += wt[b * k + i];
            u = true;
          }
      mw.b->set(mw.b->at(b, 0, j), w);
      use.b->pbool()[use.b->at(b, 0, j)] = u;
    }
}

static void op_expert_gate_up(Exec& ex, Worker& wk, const Opnd* o, const int32_t*) {
  const Opnd &xl = o[0], &sel = o[1], &use = o[2], &w1 = o[3], &w3 = o[4], &out = o[5];
  const int Dl = xl.c1 - xl.c0, n = w1.r1 - w1.r0, B = use.b1 - use.b0;
  const bool bf = bf_act(ex);
  float* x = wk.buf(wk.s0, static_cast<size_t>(B) * Dl);
  float* yg = wk.buf(wk.s1, static_cast<size_t>(B) * n);
  float* yu = wk.buf(wk.s2, static_cast<size_t>(B) * n);
  int rows[MAX_BATCH];
  for (int j = sel.c0; j < sel.c1; ++j) {
    const int64_t e = sel.b->i64(sel.b->at(0, 0, j));
    if (e < 0) break;  // slots are filled from the front
    int m = 0;  // the rows routed to this slot, gathered so the expert's weight rows stream once for all of them
    for (int b = use.b0; b < use.b1; ++b)
      if (use.b->pbool()[use.b->at(b, 0, j)]) {
        load_rows(*xl.b, b, b + 1, 0, 0, Dl, x + static_cast<int64_t>(m) * Dl);
        rows[m++] = b;
      }
    if (!m) continue;
    gemv(*w1.b, w1.b->at(e, w1.r0, 0), w1.b->d2, n, x, m, Dl, yg, n);
    gemv(*w3.b, w3.b->at(e, w3.r0, 0), w3.b->d2, n, x, m, Dl, yu, n);
    for (int i = 0; i < m; ++i) {
      glu_row(ex, yg + i * n, yu + i * n, yg + i * n, n, bf);
      store_row(*out.b, out.b->at(rows[i], j, out.c0), yg + i * n, n);
    }
  }
}

static void op_expert_down(Exec& ex, Worker& wk, const Opnd* o, const int32_t*) {
  const Opnd &mh = o[0], &sel = o[1], &use = o[2], &mw = o[3], &w2 = o[4], &out = o[5];
  const int Ie = mh.c1 - mh.c0, n = w2.r1 - w2.r0, B = mh.b1 - mh.b0, D = sel.c1 - sel.c0;
  const bool bf = bf_act(ex);
  float* acc = wk.buf(wk.s0, static_cast<size_t>(B) * n);
  float* h = wk.buf(wk.s1, static_cast<size_t>(B) * Ie);
  float* y = wk.buf(wk.s2, static_cast<size_t>(B) * n);
  std::fill(acc, acc + static_cast<size_t>(B) * n, 0.0f);
  for (int s = 0; s < D; ++s) {
    const int64_t e = sel.b->i64(sel.b->at(0, 0, s));
    if (e < 0) break;
    int m = 0;  // the rows that routed to this slot, gathered so the expert's rows stream once for all of them
    int rows[MAX_BATCH];
    for (int b = 0; b < B; ++b)
      if (use.b->pbool()[use.b->at(b, 0, s)]) {
        load_rows(*mh.b, b, b + 1, s, 0, Ie, h + static_cast<int64_t>(m) * Ie);
        rows[m++] = b;
      }
    if (!m) continue;
    gemv(*w2.b, w2.b->at(e, w2.r0, 0), w2.b->d2, n, h, m, Ie, y, n);
    for (int i = 0; i < m; ++i) {
      const float w = mw.b->f(mw.b->at(rows[i], 0, s));
      for (int r = 0; r < n; ++r) acc[rows[i] * n + r] += rq(y[i * n + r], bf) * w;
    }
  }
  const bool keep = out.b->dt == DT_F32;  // a rank's fp32 partial for the cross-rank sum stays unrounded
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < n; ++r) out.b->set(row_at(out, b, r), keep ? acc[b * n + r] : rq(acc[b * n + r], bf));
}

static void op_ffn_out(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const int flags = a[0];
  const bool bf = bf_act(ex);
  int k = 0;
  float* sum = nullptr;
  int nb = 0, n = 0;
  auto add_source = [&](const Opnd& x, const Buf* norm, const Opnd& w) {
    const int K = x.c1 - x.c0;  // x's box: the weight's input columns (across ranks, the rank's share of them)
    nb = x.b1 - x.b0;
    n = w.r1 - w.r0;
    float* xv = wk.buf(wk.s0, static_cast<size_t>(nb) * K);
    float* raw = wk.buf(wk.s3, K);
    for (int b = 0; b < nb; ++b) {
      float* xb = xv + static_cast<int64_t>(b) * K;
      load_rows(*x.b, x.b0 + b, x.b0 + b + 1, 0, x.c0, K, raw);
      if (norm) rmsnorm(raw, K, *norm, 0, static_cast<float>(ex.par[P_EPS]), bf, xb);
      else std::memcpy(xb, raw, sizeof(float) * K);
    }
    float* y = wk.buf(wk.s1, static_cast<size_t>(nb) * n);
    gemv(*w.b, w.b->at(0, w.r0, w.c0), w.b->d2, n, xv, nb, K, y, n);
    if (!sum) {
      sum = wk.buf(wk.s2, static_cast<size_t>(nb) * n);
      for (int i = 0; i < nb * n; ++i) sum[i] = rq(y[i], bf);
    } else {
      for (int i = 0; i < nb * n; ++i) sum[i] = rq(sum[i] + rq(y[i], bf), bf);
    }
  };
  if (flags & FFN_ROUTED) {
    const Opnd& x = o[k++];
    const Buf* norm = (flags & FFN_LATENT_NORM) ? o[k++].b : nullptr;
    add_source(x, norm, o[k++]);
  }
  if (flags & FFN_MLP) {
    add_source(o[k], nullptr, o[k + 1]);
    k += 2;
  }
  const Opnd& st = o[k];  // the stream's tile accumulates; a rank's partial (pushed) is written
  for (int b = 0; b < nb; ++b)
    for (int c = 0; c < n; ++c) {
      const int64_t i = row_at(st, b, c);
      st.b->set(i, (st.mode & MODE_READ) ? rq(st.b->f(i) + sum[b * n + c], bf) : sum[b * n + c]);
    }
}

static void op_lm_head(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const Opnd &x = o[0], &w = o[2], &lg = o[3], &bv = o[4], &bi = o[5];
  const int H = x.c1 - x.c0, nb = x.b1 - x.b0, n = w.r1 - w.r0;
  const bool bf = bf_act(ex);
  float* xn = normed_input(ex, wk, x, *o[1].b, static_cast<float>(ex.par[P_EPS]), wk.s0);
  float* y = wk.buf(wk.s1, static_cast<size_t>(nb) * n);
  gemv(*w.b, w.b->at(0, w.r0, 0), w.b->d2, n, xn, nb, H, y, n);
  for (int b = 0; b < nb; ++b) {
    float* yb = y + static_cast<int64_t>(b) * n;
    int best = 0;
    for (int r = 0; r < n; ++r) {
      yb[r] = rq(yb[r], bf);
      if (yb[r] > yb[best]) best = r;  // first maximum: the lowest vocabulary id among equals
    }
    std::memcpy(reinterpret_cast<float*>(lg.b->p) + lg.b->at(lg.b0 + b, 0, lg.c0), yb, sizeof(float) * n);
    bv.b->set(row_at(bv, b, 0), yb[best]);
    bi.b->pi64()[row_at(bi, b, 0)] = best + a[2];
  }
}

static void op_argmax(Exec&, Worker&, const Opnd* o, const int32_t*) {
  const Opnd &bv = o[0], &bi = o[1], &nx = o[2];
  for (int b = bv.b0; b < bv.b1; ++b) {
    int best = bv.c0;
    for (int t = bv.c0; t < bv.c1; ++t)
      if (bv.b->f(bv.b->at(b, 0, t)) > bv.b->f(bv.b->at(b, 0, best))) best = t;
    nx.b->pi64()[nx.b->at(b, 0, 0)] = bi.b->i64(bi.b->at(b, 0, best));
  }
}

// Every rank's partial of these batch rows (mailbox [batch, slot·world + source, H]) summed in rank order into the
// block's partial sum (stream entry K-1: started or accumulated, as its operand's mode says), then the AttnRes mix.
static void op_allreduce_mix(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const Opnd &mb = o[0], &ent = o[2];
  const int H = mb.c1 - mb.c0;
  const bool bf = bf_act(ex);
  float* s = wk.buf(wk.s4, H);
  for (int b = ent.b0; b < ent.b1; ++b) {
    std::fill(s, s + H, 0.0f);
    for (int r = mb.r0; r < mb.r1; ++r)
      for (int c = 0; c < H; ++c) s[c] += mb.b->f(mb.b->at(b, r, c));
    const int64_t i = ent.b->at(b, ent.r0, 0);
    for (int c = 0; c < H; ++c) ent.b->set(i + c, rq((ent.mode & MODE_READ) ? ent.b->f(i + c) + s[c] : s[c], bf));
  }
  const Opnd mix_ops[4] = {Opnd{ent.b, MODE_READ, ent.b0, ent.b1, 0, ent.r1, 0, H}, o[3], o[4], o[5]};
  op_attn_res_mix(ex, wk, mix_ops, a);
}

// Every rank's fp32 latent partial of these batch rows ([batch, source, Dl]) summed in rank order, cast once and
// (args 0) latent-normed: the combined expert sum, the same on every rank.
static void op_moe_combine(Exec& ex, Worker& wk, const Opnd* o, const int32_t* a) {
  const Opnd& mb = o[0];
  const Opnd& out = o[a[0] ? 2 : 1];
  const int D = mb.c1 - mb.c0;
  const bool bf = bf_act(ex);
  float* s = wk.buf(wk.s4, D);
  float* y = wk.buf(wk.s3, D);
  for (int b = out.b0; b < out.b1; ++b) {
    std::fill(s, s + D, 0.0f);
    for (int r = mb.r0; r < mb.r1; ++r)
      for (int c = 0; c < D; ++c) s[c] += mb.b->f(mb.b->at(b, r, mb.c0 + c));
    for (int c = 0; c < D; ++c) s[c] = rq(s[c], bf);
    if (a[0]) rmsnorm(s, D, *o[1].b, 0, static_cast<float>(ex.par[P_EPS]), bf, y);
    else std::memcpy(y, s, sizeof(float) * D);
    const int64_t i = out.b->at(b, out.r0, out.c0);
    for (int c = 0; c < D; ++c) out.b->set(i + c, rq(y[c], bf));
  }
}

// The next token from every vocabulary shard's per-tile bests ([batch, source, tile], rank-major = ascending id).
static void op_argmax_all(Exec&, Worker&, const Opnd* o, const int32_t*) {
  const Opnd &bv = o[0], &bi = o[1], &nx = o[2];
  for (int b = bv.b0; b < bv.b1; ++b) {
    int br = bv.r0, bt = bv.c0;
    for (int r = bv.r0; r < bv.r1; ++r)
      for (int t = bv.c0; t < bv.c1; ++t)
        if (bv.b->f(bv.b->at(b, r, t)) > bv.b->f(bv.b->at(b, br, bt))) br = r, bt = t;
    nx.b->pi64()[nx.b->at(b, 0, 0)] = bi.b->i64(bi.b->at(b, br, bt));
  }
}

typedef void (*OpFn)(Exec&, Worker&, const Opnd*, const int32_t*);

static OpFn op_table(int op) {
  switch (op) {
    case OP_EMBED: return op_embed;
    case OP_ATTN_RES_MIX: return op_attn_res_mix;
    case OP_NORM_PROJ: return op_norm_proj;
    case OP_MLP_GATE_UP: return op_mlp_gate_up;
    case OP_KDA_STEP: return op_kda_step;
    case OP_MLA_Q: return op_mla_q;
    case OP_MLA_KV_APPEND: return op_mla_kv_append;
    case OP_MLA_PARTIAL: return op_mla_partial;
    case OP_MLA_REDUCE: return op_mla_reduce;
    case OP_O_PROJ_RESIDUAL: return op_o_proj_residual;
    case OP_ROUTER: return op_router;
    case OP_EXPERT_GATE_UP: return op_expert_gate_up;
    case OP_EXPERT_DOWN: return op_expert_down;
    case OP_FFN_OUT: return op_ffn_out;
    case OP_LM_HEAD: return op_lm_head;
    case OP_ARGMAX: return op_argmax;
    case OP_ALLREDUCE_MIX: return op_allreduce_mix;
    case OP_ARGMAX_ALL: return op_argmax_all;
    case OP_MOE_COMBINE: return op_moe_combine;
    default: return nullptr;
  }
}

// ------------------------------------------------------------------------------------------------ workers

// While a wait spins, the core's memory bandwidth is idle: stream the instruction's static weights toward it (the
// CPU form of the GPU kernel's cp.async prefetch before the waits). Only operands declared PREFETCH on WEIGHT
// buffers qualify (the hazard checker allows nothing else before the waits), one expert / matrix at a time, whole
// rows, at most PREFETCH_BYTES (about what the L2 keeps), a few lines per poll so the wait stays responsive.
constexpr int64_t PREFETCH_BYTES = 1 << 20, PREFETCH_LINES_PER_POLL = 8;

struct Prefetch {
  const char* p[MAX_OPERANDS];
  int64_t left[MAX_OPERANDS];
  int n = 0, cur = 0;
  int64_t budget = PREFETCH_BYTES;
  void init(const Opnd* ops, int nops) {
    n = cur = 0;
    budget = PREFETCH_BYTES;
    for (int j = 0; j < nops; ++j) {
      const Opnd& o = ops[j];
      if (!(o.mode & MODE_PREFETCH) || o.b->kind != KIND_WEIGHT || o.b->mx || o.b1 - o.b0 != 1) continue;
      const int64_t es = o.b->dt == DT_F32 ? 4 : 2;
      p[n] = o.b->p + o.b->at(o.b0, o.r0, 0) * es;
      left[n++] = (o.r1 - o.r0) * o.b->d2 * es;
    }
  }
  inline void step() {
    for (int k = 0; k < PREFETCH_LINES_PER_POLL && cur < n && budget > 0; ++k) {
      __builtin_prefetch(p[cur], 0, 2);
      p[cur] += 64;
      left[cur] -= 64;
      budget -= 64;
      if (left[cur] <= 0) ++cur;
    }
  }
};

static inline int od_buf(const int32_t* row, int j) { return row[W_OPS + OPERAND_WORDS * j]; }

// Copy an operand's box from this rank's copy of its mailbox to rank r's (element size from the dtype).
static void push_box(Exec& ex, const Opnd& o, int buf, int r) {
  const Buf& b = *o.b;
  const int64_t es = b.dt == DT_F32 ? 4 : b.dt == DT_I64 ? 8 : b.dt == DT_BOOL ? 1 : 2;
  char* dst = ex.peer_p[r][buf];
  for (int i = o.b0; i < o.b1; ++i)
    for (int k = o.r0; k < o.r1; ++k) {
      const int64_t at = b.at(i, k, o.c0) * es;
      std::memcpy(dst + at, b.p + at, (o.c1 - o.c0) * es);
    }
}

// Walk queue w once: for each instruction wait (bounded spin), execute, signal. Returns normally also when the
// watchdog tripped here or elsewhere (the dump says which).
static void run_queue(Exec& ex, int w) {
  Worker& wk = ex.workers[w];
  const int32_t* q = ex.queues + static_cast<int64_t>(w) * ex.Q;
  int len = 0;
  while (len < ex.Q && q[len] >= 0) ++len;
  wk.dump = WorkerDump();
  wk.dump.qlen = len;
  Opnd ops[MAX_OPERANDS];
  Prefetch pf;
  for (int k = 0; k < len; ++k) {
    const int v = q[k];
    const int32_t* row = ex.ins + static_cast<int64_t>(v) * INSTR_WORDS;
    wk.dump.qpos = k;
    wk.dump.instr = v;
    const int nops = row[W_NOPS];
    for (int j = 0; j < nops; ++j) {
      const int32_t* od = row + W_OPS + OPERAND_WORDS * j;
      ops[j] = Opnd{&ex.bufs[od[0]], od[1], od[2], od[3], od[4], od[5], od[6], od[7]};
    }
    bool prefetching = false;
    const int nw = row[W_NWAITS];
    int64_t peer_ns = 0;
    // a wait on a cross-rank counter is one wait per source word (each written by its source rank alone)
    for (int j = 0; j < nw; ++j) {
      const int c = row[W_WAITS + 2 * j];
      const int64_t need = ex.step * ex.totals[c] + row[W_WAITS + 2 * j + 1];
      for (int64_t word = 0; word < std::max<int64_t>(1, ex.csrc[c]); ++word) {
        std::atomic<int64_t>& cw = ex.ctr_of[ex.rank][ex.cbase[c] + word];
        int64_t seen = cw.load(std::memory_order_acquire);
        if (seen >= need) continue;
        const int64_t t_start = now_ns();
        if (!prefetching) {
          pf.init(ops, nops);
          prefetching = true;
        }
        for (uint64_t spin = 1;; ++spin) {
          if (pf.cur < pf.n && pf.budget > 0) pf.step();
          else cpu_relax();
          seen = cw.load(std::memory_order_acquire);
          if (seen >= need) break;
          if ((spin & 255) == 0) {
            // every 256 polls give the core away: on a shared (or oversubscribed) machine the producer may be
            // waiting for this very core
            sched_yield();
            const bool other = ex.error.load(std::memory_order_relaxed) != 0;
            const bool late = now_ns() - t_start > ex.timeout_ns;
            if (other || late) {
              if (late) {  // the first worker to give up sets the error word; the others see it and leave
                int expected = 0;
                ex.error.compare_exchange_strong(expected, 1);
              }
              wk.dump.state = late ? 1 : 2;
              wk.dump.counter = c;
              wk.dump.word = word;
              wk.dump.target = need;
              wk.dump.seen = seen;
              return;
            }
          }
        }
        if (ex.csrc[c]) peer_ns += now_ns() - t_start;
      }
    }
    const int64_t t0 = now_ns();
    OpFn fn = op_table(row[W_OP]);
    if (fn) fn(ex, wk, ops, row + W_ARGS);
    const int lo = row[W_PEER_LO], hi = row[W_PEER_HI];
    for (int j = 0; j < nops && hi > lo; ++j)  // pushes: the box lands on every other rank of the range ...
      if (ops[j].mode & MODE_PUSH)
        for (int r = lo; r < hi; ++r)
          if (r != ex.rank) push_box(ex, ops[j], od_buf(row, j), r);
    if (row[W_SIGNAL] >= 0) {  // ... before the signal that releases it
      const int c = row[W_SIGNAL];
      if (ex.csrc[c])
        for (int r = lo; r < hi; ++r)
          ex.ctr_of[r][ex.cbase[c] + ex.rank].fetch_add(row[W_AMOUNT], std::memory_order_release);
      else
        ex.ctr_of[ex.rank][ex.cbase[c]].fetch_add(row[W_AMOUNT], std::memory_order_release);
    }
    if (ex.peer_wait) ex.peer_wait[v] = peer_ns;
    int64_t* t = ex.timings + static_cast<int64_t>(v) * 3;
    t[0] = t0;
    t[1] = now_ns();
    t[2] = w;
  }
  wk.dump.qpos = len;
  wk.dump.instr = -1;
  wk.dump.state = 0;
}

static void pin_to(Exec& ex, int w) {
#if defined(__linux__)
  if (!ex.pin || ex.cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(ex.cpus[w % ex.cpus.size()], &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: a refusal leaves it unpinned
#else
  (void)ex;
  (void)w;
#endif
}

static void worker_main(Exec* ex, int w) {
  pin_to(*ex, w);
  int64_t seen_gen = 0;
  for (;;) {
    // between steps: spin briefly (the host usually launches the next step within microseconds), then sleep
    int64_t g = ex->gen.load(std::memory_order_acquire);
    for (int i = 0; i < 2000 && g == seen_gen; ++i) {
      cpu_relax();
      g = ex->gen.load(std::memory_order_acquire);
    }
    if (g == seen_gen) {
      std::unique_lock<std::mutex> lk(ex->mu);
      ex->cv_go.wait(lk, [&] { return ex->gen.load(std::memory_order_acquire) != seen_gen || ex->quit; });
      g = ex->gen.load(std::memory_order_acquire);
    }
    if (g < 0) return;  // shutdown
    seen_gen = g;
    run_queue(*ex, w);
    if (ex->done.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<int>(ex->workers.size())) {
      std::lock_guard<std::mutex> lk(ex->mu);
      ex->cv_done.notify_one();
    }
  }
}

}  // namespace mk

// ------------------------------------------------------------------------------------------------ C ABI

static thread_local std::string g_error;

extern "C" {

const char* mk_last_error() { return g_error.c_str(); }

int64_t mk_abi_version() { return MK_ABI_VERSION; }
// The vector width in floats the hot loops were built for (16: AVX-512, 8: AVX2 + FMA, 1: the portable loops).
int64_t mk_simd_width() {
#ifdef MK_SIMD
  return MK_SIMD;
#else
  return 1;
#endif
}

// The hot loops alone, for their own tests: y[b * ldy + r] = W[r] . x[b] as the executor computes it (weight dtype
// DT_F32 or DT_BF16; ldx = K), and an element-wise function of the executor's vector math (0 exp, 1 tanh,
// 2 sigmoid, 3 silu, 4 bf16 rounding: the vector kernels where the build has them, else the portable forms).
int mk_probe_gemv(const void* w, int dt, int64_t ldw, int nrows, const float* x, int nb, int K, float* y,
                  int64_t ldy) {
  if ((dt != DT_F32 && dt != DT_BF16) || nrows < 0 || nb < 1 || K < 1 || ldw < K || ldy < nrows) return 1;
  mk::Buf b;
  b.p = const_cast<char*>(static_cast<const char*>(w));
  b.dt = dt;
  mk::gemv(b, 0, ldw, nrows, x, nb, K, y, static_cast<int>(ldy));
  return 0;
}

int mk_probe_act(int which, const float* x, int n, float* y) {
  if (n < 0 || which < 0 || which > 4) return 1;
  std::memcpy(y, x, sizeof(float) * n);
  if (which == 3) { mk::silu_row(y, n, false); return 0; }
  if (which == 4) {
#ifdef MK_SIMD
    for (int i = 0; i < n; i += mk::v::W) mk::v::store(y + i, mk::v::tail(n - i), mk::v::round_bf16(mk::v::load(x + i, mk::v::tail(n - i))));
#else
    for (int i = 0; i < n; ++i) y[i] = mk::rq(x[i], true);
#endif
    return 0;
  }
#ifdef MK_SIMD
  for (int i = 0; i < n; i += mk::v::W) {
    const mk::v::Tail t = mk::v::tail(n - i);
    const mk::v::F a = mk::v::load(x + i, t);
    mk::v::store(y + i, t, which == 0 ? mk::v::exp(a) : which == 1 ? mk::v::tanh(a) : mk::v::sigmoid(a));
  }
#else
  for (int i = 0; i < n; ++i) y[i] = which == 0 ? std::exp(x[i]) : which == 1 ? std::tanh(x[i]) : mk::sigmoidf(x[i]);
#endif
  return 0;
}

// Header fields as this executor reads them (tested against the Python decoder): N, S, Q, C, NB, batch,
// off_buf, off_ctr, off_ins, off_q, total.
int mk_header(const int32_t* prog, int64_t nwords, int64_t* out) {
  if (nwords < HEADER_WORDS || prog[H_MAGIC] != MAGIC || prog[H_VERSION] != VERSION) return 1;
  const int idx[] = {H_N, H_S, H_Q, H_C, H_NB, H_BATCH, H_OFF_BUF, H_OFF_CTR, H_OFF_INS, H_OFF_Q, H_TOTAL};
  for (int i = 0; i < 11; ++i) out[i] = prog[idx[i]];
  return 0;
}

// mx_addrs: per buffer (packed codes, scales) addresses of an MXFP4 form the executor streams instead of the
// buffer's own weights (0, 0: none), or null for none at all. A rank of a deployment (world > 1) also gets, for
// every rank r, peer_addrs[r·NB + i]: rank r's copy of buffer i (MAILBOX buffers; 0 for the others) and
// ctr_addrs[r]: rank r's counter memory (int64 words, kernels/contracts/peers.py), all in one shared segment;
// peer_wait (N, nullable) receives the ns each instruction waited on cross-rank counters.
void* mk_create_rank(const int32_t* prog, int64_t nwords, const int64_t* addrs, const int64_t* mx_addrs,
                     const double* params, int64_t nparams, int pin, const int32_t* cpus, int ncpus, int64_t* timings,
                     int rank, int world, const int64_t* peer_addrs, const int64_t* ctr_addrs, int64_t* peer_wait) {
  using namespace mk;
  if (nwords < HEADER_WORDS || prog[H_MAGIC] != MAGIC || prog[H_VERSION] != VERSION) {
    g_error = "not a megakernel program (magic / version)";
    return nullptr;
  }
  if (prog[H_INSTR_WORDS] != INSTR_WORDS || prog[H_TOTAL] != nwords) {
    g_error = "program width / length do not match this executor's encoding";
    return nullptr;
  }
  if (nparams < P_COUNT) {
    g_error = "too few parameters";
    return nullptr;
  }
  if (prog[H_BATCH] > MAX_BATCH || prog[H_BATCH] < 1) {
    g_error = "batch " + std::to_string(prog[H_BATCH]) + " outside 1.." + std::to_string(MAX_BATCH);
    return nullptr;
  }
  auto* ex = new Exec();
  ex->prog.assign(prog, prog + nwords);
  const int32_t* h = ex->prog.data();
  ex->N = h[H_N];
  ex->S = h[H_S];
  ex->Q = h[H_Q];
  ex->C = h[H_C];
  ex->NB = h[H_NB];
  ex->batch = h[H_BATCH];
  ex->ins = h + h[H_OFF_INS];
  ex->queues = h + h[H_OFF_Q];
  ex->par.assign(params, params + nparams);
  const int pw = h[H_WORLD] ? h[H_WORLD] : 1;
  if (pw != world || h[H_RANK] != (world > 1 ? rank : 0) || world < 1 || world > MAX_WORLD) {
    g_error = "the program is rank " + std::to_string(h[H_RANK]) + " of " + std::to_string(pw) +
              ", the executor was created as rank " + std::to_string(rank) + " of " + std::to_string(world);
    delete ex;
    return nullptr;
  }
  ex->rank = world > 1 ? rank : 0;
  ex->world = world;
  ex->peer_wait = peer_wait;
  for (int c = 0; c < ex->C; ++c) {
    const int32_t* cr = h + h[H_OFF_CTR] + c * COUNTER_WORDS;
    ex->totals.push_back(cr[CW_TOTAL]);
    ex->cbase.push_back(ex->words);
    ex->csrc.push_back(cr[CW_SOURCES]);
    if (cr[CW_SOURCES] != 0 && cr[CW_SOURCES] != world) {
      g_error = "counter " + std::to_string(c) + " has " + std::to_string(cr[CW_SOURCES]) + " sources in a world of " +
                std::to_string(world);
      delete ex;
      return nullptr;
    }
    ex->words += std::max(1, cr[CW_SOURCES]);
  }
  ex->bufs.resize(ex->NB);
  for (int i = 0; i < ex->NB; ++i) {
    const int32_t* b = h + h[H_OFF_BUF] + i * BUFFER_WORDS;
    Buf& B = ex->bufs[i];
    B.kind = b[0];
    B.dt = b[1];
    B.d0 = b[2];
    B.d1 = b[3];
    B.d2 = b[4];
    B.p = reinterpret_cast<char*>(addrs[i]);
    if (mx_addrs && mx_addrs[2 * i]) {
      if (B.d2 % 32) {
        g_error = "buffer " + std::to_string(i) + ": MXFP4 rows must be a multiple of 32 columns";
        delete ex;
        return nullptr;
      }
      B.mx = reinterpret_cast<const uint8_t*>(mx_addrs[2 * i]);
      B.mx_scale = reinterpret_cast<const uint8_t*>(mx_addrs[2 * i + 1]);
    }
    if (B.dt != DT_F32 && B.dt != DT_BF16 && B.dt != DT_I64 && B.dt != DT_BOOL) {
      g_error = "buffer " + std::to_string(i) + " has a dtype this executor does not implement (code " +
                std::to_string(B.dt) + ")";
      delete ex;
      return nullptr;
    }
  }
  for (int v = 0; v < ex->N; ++v) {
    const int32_t* r = ex->ins + static_cast<int64_t>(v) * INSTR_WORDS;
    if (r[W_PEER_LO] < 0 || r[W_PEER_HI] > world || (r[W_PEER_HI] > r[W_PEER_LO] && world == 1)) {
      g_error = "instruction " + std::to_string(v) + " names peer ranks outside the world of " + std::to_string(world);
      delete ex;
      return nullptr;
    }
    const int op = r[W_OP];
    if (op != OP_NOP && !op_table(op)) {
      g_error = "instruction " + std::to_string(v) + " has opcode " + std::to_string(op) + " without CPU code";
      delete ex;
      return nullptr;
    }
    if (op == OP_ATTN_RES_MIX && ex->ins[static_cast<int64_t>(v) * INSTR_WORDS + W_ARGS + 1] > MAX_DEPTH) {
      g_error = "instruction " + std::to_string(v) + " mixes more than " + std::to_string(MAX_DEPTH) + " entries";
      delete ex;
      return nullptr;
    }
  }
  if (world > 1) {  // every rank's mailboxes and counter words live in the shared segment the host mapped
    if (!peer_addrs || !ctr_addrs) {
      g_error = "a rank program needs every rank's mailbox and counter addresses";
      delete ex;
      return nullptr;
    }
    ex->peer_p.assign(world, std::vector<char*>(ex->NB, nullptr));
    for (int r = 0; r < world; ++r) {
      ex->ctr_of.push_back(reinterpret_cast<std::atomic<int64_t>*>(ctr_addrs[r]));
      for (int i = 0; i < ex->NB; ++i) ex->peer_p[r][i] = reinterpret_cast<char*>(peer_addrs[r * ex->NB + i]);
    }
    for (int i = 0; i < ex->NB; ++i)
      if (ex->bufs[i].kind == KIND_MAILBOX)
        for (int r = 0; r < world; ++r)
          if (!ex->peer_p[r][i]) {
            g_error = "mailbox buffer " + std::to_string(i) + " has no address on rank " + std::to_string(r);
            delete ex;
            return nullptr;
          }
  } else {
    ex->ctr.reset(new std::atomic<int64_t>[std::max<int64_t>(1, ex->words)]);
    for (int64_t c = 0; c < std::max<int64_t>(1, ex->words); ++c) ex->ctr[c].store(0);
    ex->ctr_of.push_back(ex->ctr.get());
  }
  ex->timings = timings;
  ex->pin = pin != 0;
  ex->cpus.assign(cpus, cpus + ncpus);
  ex->workers = std::vector<Worker>(ex->S);
  // queue 0 runs on the calling thread (one thread per core, none of them idle-spinning for the others)
  for (int w = 1; w < ex->S; ++w) ex->workers[w].th = std::thread(worker_main, ex, w);
  return ex;
}

void* mk_create(const int32_t* prog, int64_t nwords, const int64_t* addrs, const int64_t* mx_addrs,
                const double* params, int64_t nparams, int pin, const int32_t* cpus, int ncpus, int64_t* timings) {
  return mk_create_rank(prog, nwords, addrs, mx_addrs, params, nparams, pin, cpus, ncpus, timings, 0, 1, nullptr,
                        nullptr, nullptr);
}

// Point buffer i at addrs[i] (state buffers move when a decode state is re-allocated). Between steps only.
void mk_set_addrs(void* handle, const int64_t* addrs) {
  auto* ex = static_cast<mk::Exec*>(handle);
  for (int i = 0; i < ex->NB; ++i) ex->bufs[i].p = reinterpret_cast<char*>(addrs[i]);
}

// This rank's counter words (one per local counter, one per source of a cross-rank one) back to zero / read out.
void mk_reset_counters(void* handle) {
  auto* ex = static_cast<mk::Exec*>(handle);
  for (int64_t c = 0; c < ex->words; ++c) ex->ctr_of[ex->rank][c].store(0);
}

int64_t mk_counter_words(void* handle) { return static_cast<mk::Exec*>(handle)->words; }

void mk_counters(void* handle, int64_t* out) {
  auto* ex = static_cast<mk::Exec*>(handle);
  for (int64_t c = 0; c < ex->words; ++c) out[c] = ex->ctr_of[ex->rank][c].load();
}

// One decode step (step number `step`: waits target step * total + t). 0: done; 1: the watchdog tripped (read
// mk_dump). Blocks until every worker has finished or given up.
int mk_run_step(void* handle, int64_t step, double timeout_s) {
  auto* ex = static_cast<mk::Exec*>(handle);
  ex->step = step;
  ex->timeout_ns = static_cast<int64_t>(timeout_s * 1e9);
  ex->error.store(0);
  ex->done.store(0);
  {
    std::lock_guard<std::mutex> lk(ex->mu);
    ex->gen.fetch_add(1, std::memory_order_release);
  }
  ex->cv_go.notify_all();
  const int S = static_cast<int>(ex->workers.size());
  mk::run_queue(*ex, 0);
  ex->done.fetch_add(1, std::memory_order_acq_rel);
  for (int i = 0; i < 2000 && ex->done.load(std::memory_order_acquire) < S; ++i) mk::cpu_relax();
  if (ex->done.load(std::memory_order_acquire) < S) {
    std::unique_lock<std::mutex> lk(ex->mu);
    ex->cv_done.wait(lk, [&] { return ex->done.load(std::memory_order_acquire) >= S; });
  }
  return ex->error.load() ? 1 : 0;
}

// Per worker 8 words: state (0 finished, 1 gave up, 2 abandoned), queue position, queue length, instruction,
// counter, target, value seen, counter word (the source rank of a cross-rank counter).
void mk_dump(void* handle, int64_t* out) {
  auto* ex = static_cast<mk::Exec*>(handle);
  for (size_t w = 0; w < ex->workers.size(); ++w) {
    const mk::WorkerDump& d = ex->workers[w].dump;
    int64_t* o = out + 8 * w;
    o[0] = d.state; o[1] = d.qpos; o[2] = d.qlen; o[3] = d.instr; o[4] = d.counter; o[5] = d.target;
    o[6] = d.seen; o[7] = d.word;
  }
}

void mk_destroy(void* handle) {
  auto* ex = static_cast<mk::Exec*>(handle);
  if (!ex) return;
  {
    std::lock_guard<std::mutex> lk(ex->mu);
    ex->quit = true;
    ex->gen.store(-1, std::memory_order_release);
  }
  ex->cv_go.notify_all();
  for (auto& w : ex->workers)
    if (w.th.joinable()) w.th.join();
  delete ex;
}

}  // extern "C"
