// Picks the SwiGLU kernels from the backend and what this CPU can run.
#include "act/kernel.h"

namespace mixbits {

std::vector<Backend> available_act_backends() {
  return available_backends(kActBackends);
}

SwigluFn select_swiglu(Backend requested) {
  [[maybe_unused]] const Backend b = resolve_backend("swiglu", requested, kActBackends);
#if defined(MIXBITS_HAVE_AVX2)
  if (b == Backend::Avx2) return swiglu_avx2;
#endif
#if defined(MIXBITS_HAVE_NEON)
  if (b == Backend::Neon) return swiglu_neon;
#endif
  return swiglu_ref;
}

SwigluVjpFn select_swiglu_vjp(Backend requested) {
  // Same availability rules (and errors) as the forward.
  [[maybe_unused]] const SwigluFn fwd = select_swiglu(requested);
#if defined(MIXBITS_HAVE_AVX2)
  if (fwd == swiglu_avx2) return swiglu_vjp_avx2;
#endif
#if defined(MIXBITS_HAVE_NEON)
  if (fwd == swiglu_neon) return swiglu_vjp_neon;
#endif
  return swiglu_vjp_ref;
}

}  // namespace mixbits
