// Picks the fp-mode matmul kernel from the backend and this CPU
// (common/backend.h), once per graph node, as qmatmul/dispatch.cpp does for
// the affine kernels.
#include "fpmatmul/kernel.h"

namespace mixbits {

FpmRun select_fpm(Backend requested) {
  switch (resolve_backend("fp quantized_matmul", requested, kFpmBackends)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return fpm_avx2_run;
    case Backend::Avx512: return fpm_avx512_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return fpm_neon_run;
#endif
    default: return fpm_ref_run;
  }
}

FpmTRun select_fpm_t(Backend requested) {
  switch (resolve_backend("fp quantized_matmul", requested, kFpmBackends)) {
#if defined(MIXBITS_HAVE_AVX2)
    // One FMA chain per output lane: 16 lanes would sum as 8 do, so the
    // Avx512 backend runs the 8-lane transposed kernel.
    case Backend::Avx2:
    case Backend::Avx512: return fpm_t_avx2_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return fpm_t_neon_run;
#endif
    default: return fpm_t_ref_run;
  }
}

}  // namespace mixbits
