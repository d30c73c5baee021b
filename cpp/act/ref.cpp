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

}  // namespace mixbits
