// Standalone driver of the CPU megakernel executor for ThreadSanitizer runs.
//
// Why standalone: TSan inside a Python process that has loaded PyTorch reports races in code it cannot see
// (OpenMP pools, allocator caches). This binary contains only the executor (the same source, included below) and
// a loop over decode steps, fed a case dumped by kimik3/megakernel/cpu_tsan.py:
//   program.i32  the encoded program          params.f64  the executor's model constants
//   meta.i64     steps, ids buffer, pos buffer, logits buffer, next-token buffer, timeout ms
//   buf<i>.bin   the initial bytes of every buffer (weights, state after prefill, zeroed scratch)
//   ids.i64 / pos.i64   [steps, batch] token ids and positions
// Before every step the activation and output buffers are poisoned (NaN / max int / true), as the Python runner
// does in tests, so reading something nobody wrote in this step shows in the result. It writes, per step, the
// logits (logits.f32) and next tokens (next.i64). Exit code: 0 ok, 3 watchdog (dump on stderr), 2 bad input; a
// TSan report makes the process exit with TSan's exit code.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
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

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASE_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<char> praw = slurp(dir + "/program.i32"), par = slurp(dir + "/params.f64");
  std::vector<char> mraw = slurp(dir + "/meta.i64"), idr = slurp(dir + "/ids.i64"), psr = slurp(dir + "/pos.i64");
  const int32_t* prog = reinterpret_cast<const int32_t*>(praw.data());
  const int64_t nwords = static_cast<int64_t>(praw.size() / 4);
  const int64_t* meta = reinterpret_cast<const int64_t*>(mraw.data());
  const int64_t steps = meta[0], ids_buf = meta[1], pos_buf = meta[2], logits_buf = meta[3], next_buf = meta[4];
  const double timeout_s = meta[5] / 1000.0;
  const int NB = prog[H_NB], B = prog[H_BATCH], S = prog[H_S];
  std::vector<std::vector<char>> mem(NB);
  std::vector<int64_t> addrs(NB);
  std::vector<int> kind(NB), dt(NB);
  std::vector<size_t> bytes(NB);
  for (int i = 0; i < NB; ++i) {
    const int32_t* b = prog + prog[H_OFF_BUF] + i * BUFFER_WORDS;
    kind[i] = b[0];
    dt[i] = b[1];
    bytes[i] = static_cast<size_t>(b[2]) * b[3] * b[4] * elem_size(b[1]);
    mem[i] = slurp(dir + "/buf" + std::to_string(i) + ".bin");
    if (mem[i].size() != bytes[i]) {
      std::fprintf(stderr, "buffer %d: %zu bytes on disk, %zu declared\n", i, mem[i].size(), bytes[i]);
      return 2;
    }
    mem[i].resize(bytes[i] + 64);  // never empty: a valid address even for a zero-sized buffer
    addrs[i] = reinterpret_cast<int64_t>(mem[i].data());
  }
  std::vector<int64_t> timings(static_cast<size_t>(std::max(1, prog[H_N])) * 3);
  std::vector<int32_t> cpus;
  void* ex = mk_create(prog, nwords, addrs.data(), nullptr, reinterpret_cast<const double*>(par.data()),
                       static_cast<int64_t>(par.size() / 8), 0, cpus.data(), 0, timings.data());
  if (!ex) {
    std::fprintf(stderr, "executor refused the program: %s\n", mk_last_error());
    return 2;
  }
  std::ofstream flog(dir + "/logits.f32", std::ios::binary), fnext(dir + "/next.i64", std::ios::binary);
  const int64_t* ids = reinterpret_cast<const int64_t*>(idr.data());
  const int64_t* pos = reinterpret_cast<const int64_t*>(psr.data());
  int rc = 0;
  for (int64_t s = 0; s < steps && rc == 0; ++s) {
    for (int i = 0; i < NB; ++i) {
      if (kind[i] != KIND_ACT && kind[i] != KIND_OUTPUT) continue;
      char* p = mem[i].data();
      const size_t n = bytes[i] / elem_size(dt[i]);
      for (size_t k = 0; k < n; ++k) {
        switch (dt[i]) {
          case DT_F32: reinterpret_cast<float*>(p)[k] = std::numeric_limits<float>::quiet_NaN(); break;
          case DT_BF16: reinterpret_cast<uint16_t*>(p)[k] = 0x7fc0; break;
          case DT_I64: reinterpret_cast<int64_t*>(p)[k] = std::numeric_limits<int64_t>::max(); break;
          case DT_BOOL: reinterpret_cast<bool*>(p)[k] = true; break;
          default: break;
        }
      }
    }
    for (int b = 0; b < B; ++b) {
      reinterpret_cast<int64_t*>(mem[ids_buf].data())[b] = ids[s * B + b];
      reinterpret_cast<int64_t*>(mem[pos_buf].data())[b] = pos[s * B + b];
    }
    if (mk_run_step(ex, s, timeout_s) != 0) {
      std::vector<int64_t> d(static_cast<size_t>(S) * 7);
      mk_dump(ex, d.data());
      std::fprintf(stderr, "watchdog in step %lld\n", static_cast<long long>(s));
      for (int w = 0; w < S; ++w)
        std::fprintf(stderr, "  worker %d: state %lld at %lld/%lld instruction %lld counter %lld needs %lld saw %lld\n",
                     w, (long long)d[7 * w], (long long)d[7 * w + 1], (long long)d[7 * w + 2],
                     (long long)d[7 * w + 3], (long long)d[7 * w + 4], (long long)d[7 * w + 5],
                     (long long)d[7 * w + 6]);
      rc = 3;
      break;
    }
    flog.write(mem[logits_buf].data(), static_cast<std::streamsize>(bytes[logits_buf]));
    fnext.write(mem[next_buf].data(), static_cast<std::streamsize>(bytes[next_buf]));
  }
  mk_destroy(ex);
  return rc;
}
