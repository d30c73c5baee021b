#include "bench/probe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "common/cpu.h"
#include "common/parallel.h"

#if defined(MIXBITS_HAVE_AVX2)
#include <immintrin.h>
#endif

namespace mixbits {

namespace {

// Sum of 64-bit words with 8 independent accumulators, so the loop is
// limited by loads, not by an add chain. Plain C++: the compiler vectorizes
// it for the baseline ISA, which is enough to saturate DRAM.
uint64_t read_words(const uint64_t* p, int64_t n) {
  uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  for (; i < n; ++i) a[0] += p[i];
  uint64_t s = 0;
  for (int j = 0; j < 8; ++j) s += a[j];
  return s;
}

#if defined(MIXBITS_HAVE_AVX2)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni")
// 12 independent vpdpbusd chains (latency 4-5 cycles, so 12 keep one or two
// pipes busy); the empty asm keeps the operand live in a register each
// iteration so the loop is not folded.
__attribute__((noinline)) int vnni_chain(long iters) {
  __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x05060708);
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(a));
  }
  for (int i = 1; i < 12; ++i) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
  return _mm512_reduce_add_epi32(acc[0]);
}
#pragma GCC pop_options
#endif

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

double read_bandwidth_gbps(int64_t nbytes, int reps) {
  if (nbytes < (1 << 20)) throw std::invalid_argument("probe: nbytes must be >= 1 MiB");
  if (reps < 1) throw std::invalid_argument("probe: reps must be >= 1");
  const int64_t nwords = nbytes / 8;
  std::unique_ptr<void, FreeDeleter> mem(std::aligned_alloc(4096, nwords * 8));
  if (!mem) throw std::runtime_error("probe: out of memory");
  uint64_t* buf = static_cast<uint64_t*>(mem.get());
  // Touch every page from the threads that will read it (first touch).
  constexpr int64_t kGrain = 1 << 18;  // words per chunk: 2 MiB
  parallel_for(nwords, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) buf[i] = uint64_t(i);
  });
  std::atomic<uint64_t> sink{0};
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    parallel_for(nwords, kGrain, [&](int64_t b, int64_t e) {
      sink.fetch_add(read_words(buf + b, e - b), std::memory_order_relaxed);
    });
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  if (sink.load() == 42) std::abort();  // keeps the reads observable
  return double(nwords * 8) / best / 1e9;
}

double int8_dot_ns(int reps) {
  if (reps < 1) throw std::invalid_argument("probe: reps must be >= 1");
#if defined(MIXBITS_HAVE_AVX2)
  if (!cpu_isa().avx512vnni) return 0.0;
  constexpr long kIters = 2000000;  // x 12 instructions: ~10 ms at one per cycle
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    const int sink = vnni_chain(kIters);
    auto t1 = std::chrono::steady_clock::now();
    if (sink == 42) std::abort();  // keeps the chain observable
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best / (kIters * 12.0) * 1e9;
#else
  return 0.0;
#endif
}

}  // namespace mixbits
