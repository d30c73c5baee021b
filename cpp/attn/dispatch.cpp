// Picks the attention kernels from the backend and what this CPU can run.
#include "attn/kernel.h"

namespace mixbits {

std::vector<Backend> available_attn_backends() {
  return available_backends(kAttnBackends);
}

AttnKernels select_attn(Backend requested) {
  switch (resolve_backend("causal_attention", requested, kAttnBackends)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return {attn_gemm_avx2, attn_exp_row_avx2, attn_gemm_tn_acc_avx2, attn_gemm_nt_avx2};
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return {attn_gemm_neon, attn_exp_row_neon, attn_gemm_tn_acc_neon, attn_gemm_nt_neon};
#endif
    default: return {attn_gemm_ref, attn_exp_row_ref, attn_gemm_tn_acc_ref, attn_gemm_nt_ref};
  }
}

}  // namespace mixbits
