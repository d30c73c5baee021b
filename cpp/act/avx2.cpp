// AVX2 SwiGLU: blocks of 256 elements; e^-g through the KL kernel's vector
// exp into an L1-resident scratch, then one fused pass. vzeroupper on exit
// (the callers are SSE code).
#include <immintrin.h>

#include <algorithm>

#include "act/kernel.h"

namespace mixbits {

void kl_exp_avx2(const float* x, float* y, int64_t n);  // kl/avx2.cpp

void swiglu_avx2(const float* g, const float* u, float* y, int64_t n) {
  constexpr int64_t kBlock = 256;
  alignas(32) float e[kBlock];
  // The exp is valid on [-87.3, 88]; beyond it silu is g (or 0) to float
  // precision anyway. min/max return the bound for NaN, but g itself
  // carries the NaN into y. Below g = -88 the result is g*u*0, as the
  // reference's g*u/(1+inf) (NaN for g = -inf, like MLX's silu).
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
      __m256 x = _mm256_sub_ps(zero, _mm256_loadu_ps(g + i0 + i));
      _mm256_store_ps(e + i, _mm256_min_ps(_mm256_max_ps(x, lo), hi));
    }
    for (; i < m; ++i) e[i] = std::min(std::max(-g[i0 + i], -87.0f), 88.0f);
    kl_exp_avx2(e, e, m);
    for (i = 0; i + 8 <= m; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i0 + i);
      const __m256 gu = _mm256_mul_ps(gv, _mm256_loadu_ps(u + i0 + i));
      const __m256 r = _mm256_div_ps(gu, _mm256_add_ps(one, _mm256_load_ps(e + i)));
      const __m256 tiny = _mm256_cmp_ps(gv, _mm256_set1_ps(-88.0f), _CMP_LT_OQ);
      _mm256_storeu_ps(y + i0 + i, _mm256_blendv_ps(r, _mm256_mul_ps(gu, zero), tiny));
    }
    for (; i < m; ++i) {
      const float gu = g[i0 + i] * u[i0 + i];
      y[i0 + i] = g[i0 + i] < -88.0f ? gu * 0.0f : gu / (1.0f + e[i]);
    }
  }
  _mm256_zeroupper();
}

// Same blocks and exp as swiglu_avx2; s = 1 / (1 + e^-g) is taken as 0
// below g = -88 (as the forward's gu * 0 there), so g = -inf gives NaN in
// both outputs like the reference and MLX, and finite g < -88 gives
// (signed) zeros where the exact values are below 1e-36.
void swiglu_vjp_avx2(const float* g, const float* u, const float* dy, float* dg,
                     float* du, int64_t n) {
  constexpr int64_t kBlock = 256;
  alignas(32) float e[kBlock];
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 cut = _mm256_set1_ps(-88.0f);
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
      __m256 x = _mm256_sub_ps(zero, _mm256_loadu_ps(g + i0 + i));
      _mm256_store_ps(e + i, _mm256_min_ps(_mm256_max_ps(x, lo), hi));
    }
    for (; i < m; ++i) e[i] = std::min(std::max(-g[i0 + i], -87.0f), 88.0f);
    kl_exp_avx2(e, e, m);
    for (i = 0; i + 8 <= m; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i0 + i);
      const __m256 d = _mm256_loadu_ps(dy + i0 + i);
      __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, _mm256_load_ps(e + i)));
      s = _mm256_blendv_ps(s, zero, _mm256_cmp_ps(gv, cut, _CMP_LT_OQ));
      // silu'(g) = s (1 + g (1 - s))
      const __m256 ds = _mm256_mul_ps(
          s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
      const __m256 du_v = _mm256_mul_ps(d, _mm256_mul_ps(gv, s));
      const __m256 dg_v =
          _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + i0 + i)), ds);
      _mm256_storeu_ps(dg + i0 + i, dg_v);
      _mm256_storeu_ps(du + i0 + i, du_v);
    }
    for (; i < m; ++i) {
      const float x = g[i0 + i], d = dy[i0 + i];
      const float s = x < -88.0f ? 0.0f : 1.0f / (1.0f + e[i]);
      dg[i0 + i] = d * u[i0 + i] * (s * (1.0f + x * (1.0f - s)));
      du[i0 + i] = d * (x * s);
    }
  }
  _mm256_zeroupper();
}

}  // namespace mixbits
