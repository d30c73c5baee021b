// Scalar reference for the mixed-segment quantized matmul: the oracle every
// SIMD backend is tested against, and the fallback on any CPU.
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

}  // namespace mixbits
