// Scalar reference of the fp-mode matmul: the oracle the SIMD kernels are
// tested against, and the fallback on any CPU.
#include "common/parallel.h"
#include "fpmatmul/kernel.h"

namespace mixbits {

const char* fp_mode_name(FpMode m) {
  return m == FpMode::Mxfp4 ? "mxfp4" : m == FpMode::Nvfp4 ? "nvfp4" : "mxfp8";
}

void fpm_ref(const float* x, int M, const FpView& w, float* y, int n0, int n1) {
  for (int n = n0; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      const float* xr = x + int64_t(m) * w.K;
      double acc = 0.0;  // the reference trades speed for a tight sum
      for (int64_t j = 0; j < w.K; ++j) acc += double(fp_weight(w, n, j)) * double(xr[j]);
      y[int64_t(m) * w.N + n] = float(acc);
    }
}

void fpm_ref_run(const float* x, int M, const FpView& w, float* y) {
  parallel_for(w.N, 8, [&](int64_t n0, int64_t n1) { fpm_ref(x, M, w, y, int(n0), int(n1)); });
}

void fpm_t_ref_run(const float* x, int M, const FpView& w, float* y) {
  const int64_t R = w.N, C = w.K;
  parallel_for(C, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int m = 0; m < M; ++m) {
        double acc = 0.0;
        for (int64_t r = 0; r < R; ++r) acc += double(fp_weight(w, int(r), c)) * double(x[m * R + r]);
        y[m * C + c] = float(acc);
      }
  });
}

}  // namespace mixbits
