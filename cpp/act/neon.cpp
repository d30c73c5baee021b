// NEON SwiGLU for arm64: avx2.cpp's blocks, clamp and cut-offs in 4-lane
// vectors, e^-g through the KL kernel's NEON exp. Checked under qemu-user
// (tests/test_attn_neon_emulated.py); the speed is a Mac's to measure.
#if defined(__ARM_NEON)
#include <arm_neon.h>

#include <algorithm>
#include <cmath>

#include "act/kernel.h"

namespace mixbits {

void kl_exp_neon(const float* x, float* y, int64_t n);  // kl/neon.cpp

namespace {

constexpr int64_t kBlock = 256;

// e[0..m) = e^-g, the argument clamped to [-87, 88] as avx2.cpp does
// (beyond it silu is g or 0 to float precision; NaN is carried by g).
void exp_neg(const float* g, float* e, int64_t m) {
  const float32x4_t lo = vdupq_n_f32(-87.0f), hi = vdupq_n_f32(88.0f);
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) vst1q_f32(e + i, vminq_f32(vmaxq_f32(vnegq_f32(vld1q_f32(g + i)), lo), hi));
  for (; i < m; ++i) e[i] = std::min(std::max(-g[i], -87.0f), 88.0f);
  kl_exp_neon(e, e, m);
}

}  // namespace

// Below g = -88 the result is g*u*0, as the reference's g*u/(1+inf) (NaN
// for g = -inf, like MLX's silu).
void swiglu_neon(const float* g, const float* u, float* y, int64_t n) {
  alignas(16) float e[kBlock];
  const float32x4_t one = vdupq_n_f32(1.0f), zero = vdupq_n_f32(0.0f), cut = vdupq_n_f32(-88.0f);
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    exp_neg(g + i0, e, m);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      const float32x4_t gv = vld1q_f32(g + i0 + i);
      const float32x4_t gu = vmulq_f32(gv, vld1q_f32(u + i0 + i));
      const float32x4_t r = vdivq_f32(gu, vaddq_f32(one, vld1q_f32(e + i)));
      vst1q_f32(y + i0 + i, vbslq_f32(vcltq_f32(gv, cut), vmulq_f32(gu, zero), r));
    }
    for (; i < m; ++i) {
      const float gu = g[i0 + i] * u[i0 + i];
      y[i0 + i] = g[i0 + i] < -88.0f ? gu * 0.0f : gu / (1.0f + e[i]);
    }
  }
}

// s = 1 / (1 + e^-g), taken as 0 below g = -88 (avx2.cpp's rule).
void swiglu_vjp_neon(const float* g, const float* u, const float* dy, float* dg,
                     float* du, int64_t n) {
  alignas(16) float e[kBlock];
  const float32x4_t one = vdupq_n_f32(1.0f), zero = vdupq_n_f32(0.0f), cut = vdupq_n_f32(-88.0f);
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    exp_neg(g + i0, e, m);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      const float32x4_t gv = vld1q_f32(g + i0 + i);
      const float32x4_t d = vld1q_f32(dy + i0 + i);
      float32x4_t s = vdivq_f32(one, vaddq_f32(one, vld1q_f32(e + i)));
      s = vbslq_f32(vcltq_f32(gv, cut), zero, s);
      // silu'(g) = s (1 + g (1 - s))
      const float32x4_t ds = vmulq_f32(s, vfmaq_f32(one, gv, vsubq_f32(one, s)));
      vst1q_f32(dg + i0 + i, vmulq_f32(vmulq_f32(d, vld1q_f32(u + i0 + i)), ds));
      vst1q_f32(du + i0 + i, vmulq_f32(d, vmulq_f32(gv, s)));
    }
    for (; i < m; ++i) {
      const float x = g[i0 + i], d = dy[i0 + i];
      const float s = x < -88.0f ? 0.0f : 1.0f / (1.0f + e[i]);
      dg[i0 + i] = d * u[i0 + i] * (s * std::fma(x, 1.0f - s, 1.0f));
      du[i0 + i] = d * (x * s);
    }
  }
}

}  // namespace mixbits
#endif
