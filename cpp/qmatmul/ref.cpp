// Scalar references for the mixed-segment quantized matmul y = x · Wᵀ and
// its transpose dx = dy · W: the oracles every SIMD backend is tested
// against, and the fallback on any CPU.
#include <algorithm>
#include <vector>

#include "qmatmul/kernel.h"

namespace mixbits {

void qmm_ref(const float* x, int M, const QMatView& w, float* y, int n0,
             int n1) {
  const int K = w.K;
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < M; ++m) {
      const float* xr = x + int64_t(m) * K;
      double acc = 0.0;  // the reference trades speed for a tight sum
      for (const SegView& s : w.segs) {
        const uint32_t* row = s.wq + int64_t(n) * s.words_per_row();
        const int64_t g0 = int64_t(n) * s.groups_per_row();
        for (int64_t g = 0; g < s.groups_per_row(); ++g) {
          float sc = load_as_f32(s.scales, g0 + g, w.sdtype);
          float bi = load_as_f32(s.biases, g0 + g, w.sdtype);
          for (int i = 0; i < s.group_size; ++i) {
            int64_t j = g * s.group_size + i;
            float wv = sc * float(unpack_code(row, j, s.bits)) + bi;
            acc += double(wv) * double(xr[s.k0 + j]);
          }
        }
      }
      y[int64_t(m) * w.N + n] = float(acc);
    }
  }
}

void qmm_t_ref(const float* dy, int M, const QMatView& w, float* dx, int k0,
               int k1) {
  const int N = w.N, K = w.K;
  std::vector<float> col(N);
  for (const SegView& s : w.segs) {
    const int c0 = std::max(k0, s.k0), c1 = std::min(k1, s.k0 + s.k);
    for (int c = c0; c < c1; ++c) {
      // Column c of W, decoded once for all M rows, with the same float
      // rounding of s*q + b as the forward reference.
      const int64_t j = c - s.k0, g = j / s.group_size;
      for (int n = 0; n < N; ++n) {
        const int64_t gi = int64_t(n) * s.groups_per_row() + g;
        col[n] = load_as_f32(s.scales, gi, w.sdtype) *
                     float(unpack_code(s.wq + int64_t(n) * s.words_per_row(), j, s.bits)) +
                 load_as_f32(s.biases, gi, w.sdtype);
      }
      for (int m = 0; m < M; ++m) {
        const float* d = dy + int64_t(m) * N;
        double acc = 0.0;
        for (int n = 0; n < N; ++n) acc += double(d[n]) * double(col[n]);
        dx[int64_t(m) * K + c] = float(acc);
      }
    }
  }
}

}  // namespace mixbits
