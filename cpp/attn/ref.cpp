// Scalar reference of the attention kernels: plain loops, double
// accumulation. Also the portable fallback on CPUs without a SIMD backend.
#include <cmath>

#include "attn/kernel.h"

namespace mixbits {

namespace {
// C = A . B, or A . B^T with B stored n x k (BT), in double.
template <bool BT>
void gemm_ref(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb, float* c,
              int64_t ldc, int64_t m, int64_t n, int64_t k) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += double(a[i * lda + p]) * load_as_f32(b, BT ? j * ldb + p : p * ldb + j, bt);
      c[i * ldc + j] = float(s);
    }
}
}  // namespace

void attn_gemm_ref(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                   float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  gemm_ref<false>(a, lda, b, bt, ldb, c, ldc, m, n, k);
}

void attn_gemm_nt_ref(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  gemm_ref<true>(a, lda, b, bt, ldb, c, ldc, m, n, k);
}

float attn_exp_row_ref(float* x, int64_t n, float max) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = float(std::exp(double(x[i]) - double(max)));
    s += x[i];
  }
  return float(s);
}

void attn_gemm_tn_acc_ref(const float* a, int64_t lda, const float* b,
                          int64_t ldb, float* c, int64_t ldc, int64_t m,
                          int64_t n, int64_t k) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = c[i * ldc + j];
      for (int64_t p = 0; p < k; ++p) s += double(a[p * lda + i]) * b[p * ldb + j];
      c[i * ldc + j] = float(s);
    }
}

}  // namespace mixbits
