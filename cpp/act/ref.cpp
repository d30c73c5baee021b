// Scalar reference of SwiGLU in double; the portable fallback.
#include <cmath>

#include "act/kernel.h"

namespace mixbits {

void swiglu_ref(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double x = g[i];
    y[i] = float(x * double(u[i]) / (1.0 + std::exp(-x)));
  }
}

void swiglu_vjp_ref(const float* g, const float* u, const float* dy, float* dg,
                    float* du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double x = g[i], d = dy[i];
    const double s = 1.0 / (1.0 + std::exp(-x));
    // g = -inf: s = 0 and both products are NaN, as MLX's x * sigmoid(x).
    dg[i] = float(d * double(u[i]) * (s * (1.0 + x * (1.0 - s))));
    du[i] = float(d * (x * s));
  }
}

}  // namespace mixbits
