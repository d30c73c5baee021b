// The scalar GEMV: the definition the AVX2 kernel is checked against, with
// the same summation order (8 partial sums over k, a fixed tree, the tail).
#include <cstring>

#include "linear/kernel.h"

namespace mixbits {

void gemv_ref(const float* x, int64_t M, const void* w, DType wt, int64_t K, int64_t n0,
              int64_t n1, float* y, int64_t ldy) {
  const int64_t K8 = K - K % 8;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float lane[8] = {};
      for (int64_t k = 0; k < K8; k += 8)
        for (int j = 0; j < 8; ++j) lane[j] += xr[k + j] * load_as_f32(w, n * K + k + j, wt);
      float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      for (int64_t k = K8; k < K; ++k) s += xr[k] * load_as_f32(w, n * K + k, wt);
      y[m * ldy + n] = s;
    }
  }
}

}  // namespace mixbits
