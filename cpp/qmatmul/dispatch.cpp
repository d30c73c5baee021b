// Picks the CPU backend for the quantized matmul from what this CPU can run.
// A wheel built with the AVX2 file still runs on an older x86 CPU: the
// AVX2 code is reached only after the run-time feature check.
#include <stdexcept>
#include <string>

#include "common/cpu.h"
#include "common/parallel.h"
#include "qmatmul/kernel.h"

namespace mixbits {

void qmm_ref_run(const float* x, int M, const QMatView& w, float* y) {
  parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) {
    qmm_ref(x, M, w, y, int(n0), int(n1));
  });
}

std::vector<Backend> available_qmm_backends() {
  std::vector<Backend> out{Backend::Ref};
#if defined(MIXBITS_HAVE_AVX2)
  if (cpu_has_avx2()) out.push_back(Backend::Avx2);
#endif
#if defined(MIXBITS_HAVE_NEON)
  out.push_back(Backend::Neon);
#endif
  return out;
}

namespace {

// The concrete backend `requested` names on this CPU (Auto: the fastest
// available). Both directions go through this one choice, so a forced
// backend means the same kernels forward and backward.
Backend resolve(Backend requested) {
  switch (requested) {
    case Backend::Auto:
#if defined(MIXBITS_HAVE_AVX2)
      if (cpu_has_avx2()) return Backend::Avx2;
#endif
#if defined(MIXBITS_HAVE_NEON)
      return Backend::Neon;
#endif
      return Backend::Ref;
    case Backend::Ref:
      return Backend::Ref;
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2:
      if (cpu_has_avx2()) return Backend::Avx2;
      break;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon:
      return Backend::Neon;
#endif
    default:
      break;
  }
  static const char* names[] = {"auto", "ref", "avx2", "neon"};
  int i = int(requested);
  throw std::invalid_argument(
      std::string("qmatmul: backend ") +
      (i >= 0 && i < 4 ? names[i] : std::to_string(i).c_str()) +
      " is not available on this CPU");
}

}  // namespace

QmmRun select_qmm(Backend requested) {
  switch (resolve(requested)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return qmm_avx2_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return qmm_neon_run;
#endif
    default: return qmm_ref_run;
  }
}

QmmTRun select_qmm_t(Backend requested) {
  switch (resolve(requested)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return qmm_t_avx2_run;
#endif
    // No NEON transposed kernel yet: a forced "neon" runs the scalar
    // reference (see prefer_qmm_t for what Auto does on arm64).
    default: return qmm_t_ref_run;
  }
}

bool prefer_qmm_t(Backend requested) {
  return requested != Backend::Auto || resolve(requested) == Backend::Avx2;
}

void qmm_t_ref_run(const float* dy, int M, const QMatView& w, float* dx) {
  parallel_for(w.K, 32, [&](int64_t k0, int64_t k1) {
    qmm_t_ref(dy, M, w, dx, int(k0), int(k1));
  });
}

}  // namespace mixbits
