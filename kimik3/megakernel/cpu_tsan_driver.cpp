// Standalone driver of the CPU megakernel executor for ThreadSanitizer runs.
//
// Why standalone: TSan inside a Python process that has loaded PyTorch reports races in code it cannot see
// (OpenMP pools, allocator caches). This binary contains only the executor (the same source, included below) and
// a loop over decode steps, fed one case per rank dumped by kimik3/megakernel/cpu_tsan.py:
//   program.i32  the encoded program          params.f64  the executor's model constants
//   meta.i64     steps, ids buffer, pos buffer, logits buffer, next-token buffer, timeout ms
//   buf<i>.bin   the initial bytes of every buffer (weights, state after prefill, zeroed scratch)
//   ids.i64 / pos.i64   [steps, batch] token ids and positions
// Before every step the activation and output buffers are poisoned (NaN / max int / true), as the Python runner
// does in tests, so reading something nobody wrote in this step shows in the result. It writes, per step, the
// logits (logits.f32) and next tokens (next.i64) into each case. With several cases (the ranks of a deployment,
// in rank order) every rank's executor runs in this one process, each step's launches on concurrent threads, the
// ranks' mailboxes and counter words in this process's memory: TSan then sees the cross-rank protocol's
// release / acquire pairs as it sees the workers'. Exit code: 0 ok, 3 watchdog (dump on stderr), 2 bad input; a
// TSan report makes the process exit with TSan's exit code.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <thread>
#include <vector>

#include "cpu_executor.cpp"

static std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  return std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

static size_t elem_size(int dt) {
  switch (dt) {
    case DT_F32: case DT_I32: return 4;
    case DT_BF16: case DT_F16: return 2;
    case DT_I64: case DT_F64: return 8;
    default: return 1;
  }
}

struct Rank {  // one case: its program, buffers, counter words and executor
  std::string dir;
  std::vector<char> praw, par, mraw, idr, psr;
  const int32_t* prog = nullptr;
  int64_t steps = 0, ids_buf = 0, pos_buf = 0, logits_buf = 0, next_buf = 0;
  double timeout_s = 0;
  int NB = 0, B = 0, S = 0;
  std::vector<std::vector<char>> mem;
  std::vector<int64_t> addrs;
  std::vector<int> kind, dt;
  std::vector<size_t> bytes;
  std::unique_ptr<std::atomic<int64_t>[]> words;
  std::vector<int64_t> timings;
  void* ex = nullptr;
  std::ofstream flog, fnext;
};

static int load(Rank& k) {
  k.praw = slurp(k.dir + "/program.i32");
  k.par = slurp(k.dir + "/params.f64");
  k.mraw = slurp(k.dir + "/meta.i64");
  k.idr = slurp(k.dir + "/ids.i64");
  k.psr = slurp(k.dir + "/pos.i64");
  k.prog = reinterpret_cast<const int32_t*>(k.praw.data());
  const int64_t* meta = reinterpret_cast<const int64_t*>(k.mraw.data());
  k.steps = meta[0], k.ids_buf = meta[1], k.pos_buf = meta[2], k.logits_buf = meta[3], k.next_buf = meta[4];
  k.timeout_s = meta[5] / 1000.0;
  k.NB = k.prog[H_NB], k.B = k.prog[H_BATCH], k.S = k.prog[H_S];
  k.mem.resize(k.NB);
  k.addrs.resize(k.NB);
  k.kind.resize(k.NB);
  k.dt.resize(k.NB);
  k.bytes.resize(k.NB);
  for (int i = 0; i < k.NB; ++i) {
    const int32_t* b = k.prog + k.prog[H_OFF_BUF] + i * BUFFER_WORDS;
    k.kind[i] = b[0];
    k.dt[i] = b[1];
    k.bytes[i] = static_cast<size_t>(b[2]) * b[3] * b[4] * elem_size(b[1]);
    k.mem[i] = slurp(k.dir + "/buf" + std::to_string(i) + ".bin");
    if (k.mem[i].size() != k.bytes[i]) {
      std::fprintf(stderr, "%s buffer %d: %zu bytes on disk, %zu declared\n", k.dir.c_str(), i, k.mem[i].size(),
                   k.bytes[i]);
      return 2;
    }
    k.mem[i].resize(k.bytes[i] + 64);  // never empty: a valid address even for a zero-sized buffer
    k.addrs[i] = reinterpret_cast<int64_t>(k.mem[i].data());
  }
  int64_t n = 0;
  for (int c = 0; c < k.prog[H_C]; ++c) n += std::max(1, k.prog[k.prog[H_OFF_CTR] + c * COUNTER_WORDS + CW_SOURCES]);
  k.words.reset(new std::atomic<int64_t>[std::max<int64_t>(1, n)]);
  for (int64_t c = 0; c < std::max<int64_t>(1, n); ++c) k.words[c].store(0);
  k.timings.resize(static_cast<size_t>(std::max(1, k.prog[H_N])) * 3);
  return 0;
}

static void poison(Rank& k) {
  for (int i = 0; i < k.NB; ++i) {
    if (k.kind[i] != KIND_ACT && k.kind[i] != KIND_OUTPUT) continue;
    char* p = k.mem[i].data();
    const size_t n = k.bytes[i] / elem_size(k.dt[i]);
    for (size_t j = 0; j < n; ++j) {
      switch (k.dt[i]) {
        case DT_F32: reinterpret_cast<float*>(p)[j] = std::numeric_limits<float>::quiet_NaN(); break;
        case DT_BF16: reinterpret_cast<uint16_t*>(p)[j] = 0x7fc0; break;
        case DT_I64: reinterpret_cast<int64_t*>(p)[j] = std::numeric_limits<int64_t>::max(); break;
        case DT_BOOL: reinterpret_cast<bool*>(p)[j] = true; break;
        default: break;
      }
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CASE_DIR [CASE_DIR ...]  (one case per rank, in rank order)\n", argv[0]);
    return 2;
  }
  const int world = argc - 1;
  std::vector<Rank> ranks(world);
  for (int r = 0; r < world; ++r) {
    ranks[r].dir = argv[r + 1];
    if (int rc = load(ranks[r])) return rc;
    if (ranks[r].steps != ranks[0].steps || ranks[r].NB != ranks[0].NB) {
      std::fprintf(stderr, "case %d: steps or buffer count differ from case 0\n", r);
      return 2;
    }
  }
  std::vector<int64_t> peer(static_cast<size_t>(world) * ranks[0].NB), ctr(world);
  for (int r = 0; r < world; ++r) {
    ctr[r] = reinterpret_cast<int64_t>(ranks[r].words.get());
    for (int i = 0; i < ranks[0].NB; ++i) peer[r * ranks[0].NB + i] = ranks[r].kind[i] == KIND_MAILBOX ? ranks[r].addrs[i] : 0;
  }
  std::vector<int32_t> cpus;
  for (int r = 0; r < world; ++r) {
    Rank& k = ranks[r];
    k.ex = world == 1 ? mk_create(k.prog, static_cast<int64_t>(k.praw.size() / 4), k.addrs.data(), nullptr,
                                  reinterpret_cast<const double*>(k.par.data()), static_cast<int64_t>(k.par.size() / 8),
                                  0, cpus.data(), 0, k.timings.data())
                      : mk_create_rank(k.prog, static_cast<int64_t>(k.praw.size() / 4), k.addrs.data(), nullptr,
                                       reinterpret_cast<const double*>(k.par.data()),
                                       static_cast<int64_t>(k.par.size() / 8), 0, cpus.data(), 0, k.timings.data(), r,
                                       world, peer.data(), ctr.data(), nullptr);
    if (!k.ex) {
      std::fprintf(stderr, "executor refused the program of case %d: %s\n", r, mk_last_error());
      return 2;
    }
    k.flog.open(k.dir + "/logits.f32", std::ios::binary);
    k.fnext.open(k.dir + "/next.i64", std::ios::binary);
  }
  int rc = 0;
  for (int64_t s = 0; s < ranks[0].steps && rc == 0; ++s) {
    std::vector<int> res(world, 0);
    for (Rank& k : ranks) {
      poison(k);
      const int64_t* ids = reinterpret_cast<const int64_t*>(k.idr.data());
      const int64_t* pos = reinterpret_cast<const int64_t*>(k.psr.data());
      for (int b = 0; b < k.B; ++b) {
        reinterpret_cast<int64_t*>(k.mem[k.ids_buf].data())[b] = ids[s * k.B + b];
        reinterpret_cast<int64_t*>(k.mem[k.pos_buf].data())[b] = pos[s * k.B + b];
      }
    }
    std::vector<std::thread> th;
    for (int r = 1; r < world; ++r) th.emplace_back([&, r] { res[r] = mk_run_step(ranks[r].ex, s, ranks[r].timeout_s); });
    res[0] = mk_run_step(ranks[0].ex, s, ranks[0].timeout_s);
    for (auto& t : th) t.join();
    for (int r = 0; r < world; ++r) {
      Rank& k = ranks[r];
      if (res[r] != 0) {
        std::vector<int64_t> d(static_cast<size_t>(k.S) * 8);
        mk_dump(k.ex, d.data());
        std::fprintf(stderr, "watchdog in step %lld on rank %d\n", static_cast<long long>(s), r);
        for (int w = 0; w < k.S; ++w)
          std::fprintf(stderr, "  worker %d: state %lld at %lld/%lld instruction %lld counter %lld (word %lld) needs "
                       "%lld saw %lld\n", w, (long long)d[8 * w], (long long)d[8 * w + 1], (long long)d[8 * w + 2],
                       (long long)d[8 * w + 3], (long long)d[8 * w + 4], (long long)d[8 * w + 7],
                       (long long)d[8 * w + 5], (long long)d[8 * w + 6]);
        rc = 3;
        continue;
      }
      k.flog.write(k.mem[k.logits_buf].data(), static_cast<std::streamsize>(k.bytes[k.logits_buf]));
      k.fnext.write(k.mem[k.next_buf].data(), static_cast<std::streamsize>(k.bytes[k.next_buf]));
    }
  }
  for (Rank& k : ranks) mk_destroy(k.ex);
  return rc;
}
