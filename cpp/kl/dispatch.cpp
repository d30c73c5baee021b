// Picks the KL chunk backend from what this CPU can run, and hosts the
// exp helpers used by tests and benchmarks.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/cpu.h"
#include "common/parallel.h"
#include "kl/kernel.h"

namespace mixbits {

namespace {

Backend resolve(Backend requested) {
  return resolve_backend("kl_divergence", requested, kKLBackends);
}

// Scalar exp sum, the reference backend's share of the throughput probe.
double exp_sum_ref(const float* x, int64_t n, int64_t reps) {
  double s = 0;
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t i = 0; i < n; ++i) s += std::exp(x[i]);
  return s;
}

}  // namespace

std::vector<Backend> available_kl_backends() {
  return available_backends(kKLBackends);
}

KLChunkFn select_kl(Backend requested) {
  switch (resolve(requested)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return kl_chunk_avx2;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return kl_chunk_neon;
#endif
    default: return kl_chunk_ref;
  }
}

void kl_vector_exp(Backend backend, const float* x, float* y, int64_t n) {
  switch (resolve(backend)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return kl_exp_avx2(x, y, n);
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return kl_exp_neon(x, y, n);
#endif
    default:
      for (int64_t i = 0; i < n; ++i) y[i] = float(std::exp(double(x[i])));
  }
}

double kl_exp_seconds(Backend backend, int64_t n_exps) {
  const Backend b = resolve(backend);
  // 1024 arguments spread over [-20, 0]: L1-resident, so only the exp
  // arithmetic is timed. Each thread evaluates its share n_exps/threads.
  constexpr int64_t kN = 1024;
  const int64_t threads = num_threads();
  const int64_t reps = std::max<int64_t>(1, n_exps / (kN * threads));
  std::vector<double> sink(threads, 0.0);
  auto t0 = std::chrono::steady_clock::now();
  parallel_for(threads, 1, [&](int64_t t0_, int64_t t1_) {
    float x[kN];
    for (int64_t i = 0; i < kN; ++i) x[i] = -20.0f * float(i) / kN;
    for (int64_t t = t0_; t < t1_; ++t) {
      switch (b) {
#if defined(MIXBITS_HAVE_AVX2)
        case Backend::Avx2: sink[t] = kl_exp_sum_avx2(x, kN, reps); break;
#endif
#if defined(MIXBITS_HAVE_NEON)
        case Backend::Neon: sink[t] = kl_exp_sum_neon(x, kN, reps); break;
#endif
        default: sink[t] = exp_sum_ref(x, kN, reps);
      }
    }
  });
  auto t1 = std::chrono::steady_clock::now();
  double s = 0;
  for (double v : sink) s += v;
  if (!(s > 0)) throw std::runtime_error("exp probe produced no sum");
  // Scale to exactly n_exps in case of rounding of reps.
  double secs = std::chrono::duration<double>(t1 - t0).count();
  return secs * double(n_exps) / double(reps * kN * threads);
}

}  // namespace mixbits
