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

QmmRun select_qmm(Backend requested) {
  switch (requested) {
    case Backend::Auto:
#if defined(MIXBITS_HAVE_AVX2)
      if (cpu_has_avx2()) return qmm_avx2_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
      return qmm_neon_run;
#endif
      return qmm_ref_run;
    case Backend::Ref:
      return qmm_ref_run;
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2:
      if (cpu_has_avx2()) return qmm_avx2_run;
      break;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon:
      return qmm_neon_run;
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

}  // namespace mixbits
