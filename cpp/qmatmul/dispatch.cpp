// Picks the CPU kernels of the quantized matmul from the backend and what
// this CPU can run (common/backend.h). A wheel built with the AVX2 files
// still runs on an older x86 CPU: their code is reached only through a
// backend that cpu_backends() lists.
#include "common/parallel.h"
#include "qmatmul/kernel.h"

namespace mixbits {

void qmm_ref_run(const float* x, int M, const QMatView& w, float* y) {
  parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) {
    qmm_ref(x, M, w, y, int(n0), int(n1));
  });
}

std::vector<Backend> available_qmm_backends() {
  return available_backends(kQmmBackends);
}

namespace {

// Both directions resolve through here, so a forced backend means the same
// kernels forward and backward.
Backend resolve(Backend requested) {
  return resolve_backend("qmatmul", requested, kQmmBackends);
}

}  // namespace

QmmRun select_qmm(Backend requested) {
  switch (resolve(requested)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return qmm_avx2_run;
    case Backend::Avx512: return qmm_avx512_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return qmm_neon_run;
#endif
    default: return qmm_ref_run;
  }
}

QmmRepacked select_qmm_repacked(Backend requested) {
  switch (resolve(requested)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return qmm_avx2_repacked();
    case Backend::Avx512: return qmm_avx512_repacked();
#endif
    default: return {};  // ref, NEON: no reader of the repacked layout
  }
}

QmmTRun select_qmm_t(Backend requested) {
  switch (resolve(requested)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return qmm_t_avx2_run;
    case Backend::Avx512: return qmm_t_avx512_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return qmm_t_neon_run;  // see prefer_qmm_t for Auto
#endif
    default: return qmm_t_ref_run;
  }
}

bool prefer_qmm_t(Backend requested) {
  const Backend b = resolve(requested);
  return requested != Backend::Auto || b == Backend::Avx2 || b == Backend::Avx512;
}

void qmm_t_ref_run(const float* dy, int M, const QMatView& w, float* dx) {
  parallel_for(w.K, 32, [&](int64_t k0, int64_t k1) {
    qmm_t_ref(dy, M, w, dx, int(k0), int(k1));
  });
}

}  // namespace mixbits
