// Picks the GEMV kernel from the backend and what this CPU can run.
#include "linear/kernel.h"

namespace mixbits {

std::vector<Backend> available_linear_backends() { return available_backends(kLinearBackends); }

GemvFn select_gemv(Backend requested, Backend* resolved) {
  const Backend b = resolve_backend("float_matmul", requested, kLinearBackends);
  if (resolved) *resolved = b;
#if defined(MIXBITS_HAVE_AVX2)
  if (b == Backend::Avx2) return gemv_avx2;
#endif
  return gemv_ref;
}

}  // namespace mixbits
