// Picks the attention kernels from what this CPU can run.
#include <stdexcept>
#include <string>

#include "attn/kernel.h"
#include "common/cpu.h"

namespace mixbits {

namespace {

bool available(AttnBackend b) {
  switch (b) {
    case AttnBackend::Ref: return true;
    case AttnBackend::Avx2: return cpu_has_avx2();
    default: return false;
  }
}

}  // namespace

std::vector<AttnBackend> available_attn_backends() {
  std::vector<AttnBackend> out;
  for (auto b : {AttnBackend::Ref, AttnBackend::Avx2, AttnBackend::Neon})
    if (available(b)) out.push_back(b);
  return out;
}

AttnKernels select_attn(AttnBackend requested) {
  AttnBackend b = requested;
  if (b == AttnBackend::Auto)
    b = available(AttnBackend::Avx2) ? AttnBackend::Avx2 : AttnBackend::Ref;
  if (!available(b))
    throw std::invalid_argument("causal_attention: backend " +
                                std::to_string(int(b)) +
                                " is not available on this CPU");
  switch (b) {
#if defined(MIXBITS_HAVE_AVX2)
    case AttnBackend::Avx2: return {attn_gemm_avx2, attn_exp_row_avx2, attn_gemm_tn_acc_avx2};
#endif
    default: return {attn_gemm_ref, attn_exp_row_ref, attn_gemm_tn_acc_ref};
  }
}

}  // namespace mixbits
