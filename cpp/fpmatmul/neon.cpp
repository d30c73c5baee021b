// NEON kernel of the fp-mode matmul (kernel.h), arm64. Weights are decoded
// per group through a small table (the 16 signed e2m1 values, or the 256
// e4m3 ones, times the group's scale: the same float products as the
// reference) into a buffer of RB rows, then multiplied with every x row,
// four weight rows per x load. Each output sums in four 4-lane float32
// accumulators (one per 4 columns of each 16) and one fixed reduction, so
// the result does not depend on the blocking or the number of threads.
#include <arm_neon.h>

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "fpmatmul/kernel.h"
#include "fpmatmul/neon_decode.h"

namespace mixbits {

namespace {

inline float reduce(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
  return vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
}

void rows(const float* x, int M, const FpView& w, float* y, int n0, int n1) {
  constexpr int RB = 16;
  const int64_t K = w.K;
  std::vector<float> buf(size_t(RB) * K);
  for (int nb = n0; nb < n1; nb += RB) {
    const int nr = std::min(RB, n1 - nb);
    for (int r = 0; r < nr; ++r) decode_span(w, nb + r, 0, w.groups_per_row(), buf.data() + int64_t(r) * K);
    for (int m = 0; m < M; ++m) {
      const float* xr = x + int64_t(m) * K;
      for (int r0 = 0; r0 < nr; r0 += 4) {
        const float* wr[4];
        for (int i = 0; i < 4; ++i) wr[i] = buf.data() + int64_t(std::min(r0 + i, nr - 1)) * K;
        float32x4_t a[4][4];
        for (int i = 0; i < 4; ++i)
          for (int q = 0; q < 4; ++q) a[i][q] = vdupq_n_f32(0.0f);
        for (int64_t k = 0; k < K; k += 16) {
          float32x4_t xv[4];
          for (int q = 0; q < 4; ++q) xv[q] = vld1q_f32(xr + k + 4 * q);
          for (int i = 0; i < 4; ++i)
            for (int q = 0; q < 4; ++q) a[i][q] = vfmaq_f32(a[i][q], vld1q_f32(wr[i] + k + 4 * q), xv[q]);
        }
        for (int i = 0; i < 4 && r0 + i < nr; ++i)
          y[int64_t(m) * w.N + nb + r0 + i] = reduce(a[i][0], a[i][1], a[i][2], a[i][3]);
      }
    }
  }
}

}  // namespace

void fpm_neon_run(const float* x, int M, const FpView& w, float* y) {
  if (M <= 0 || w.N <= 0) return;
  parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) { rows(x, M, w, y, int(n0), int(n1)); });
}

}  // namespace mixbits
