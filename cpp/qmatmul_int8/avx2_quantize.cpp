// The integer contracts' quantization of x (kernel.h) with AVX2, 32
// columns per step. Same bits as int_quantize_groups_ref: max|x| is exact
// in any order, id = Q / amax is the same scalar division, x * id the same
// float32 product, and cvtps_epi32 rounds half to even under the default
// rounding mode, as nearbyint does. Decode calls quantize a few hundred
// columns per matmul; the scalar loop (a libm fmax per element where
// compilers keep IEEE semantics) was ~6% of a SmolLM2 token.
#include <immintrin.h>

#include <algorithm>

#include "qmatmul_int8/kernel.h"

namespace mixbits {

namespace {

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 32 codes i0..i3 (8 each, in order) stored as T, in column order. The
// saturating packs are exact (|code| <= Q); they interleave 128-bit lanes,
// which one cross-lane permute undoes.
inline void store32(int8_t* q, __m256i i0, __m256i i1, __m256i i2, __m256i i3) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  // dwords of b: i0[0:4] i1[0:4] i2[0:4] i3[0:4] | i0[4:8] i1[4:8] i2[4:8] i3[4:8]
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, order));
}
inline void store32(int16_t* q, __m256i i0, __m256i i1, __m256i i2, __m256i i3) {
  // qwords of packs_epi32(a, b): a[0:4] b[0:4] | a[4:8] b[4:8]
  const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);
  const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p01);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), p23);
}

}  // namespace

template <class T>
void int_quantize_groups_avx2(const float* x, int ng, int G, T* q, float* d, int32_t* ix,
                              float* xs) {
  if (G % 32 != 0) return int_quantize_groups_ref(x, ng, G, q, d, ix, xs);
  constexpr float Q = kIntQMax<T>;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i qmax = _mm256_set1_epi32(int(Q)), qmin = _mm256_set1_epi32(-int(Q));
  for (int g = 0; g < ng; ++g, x += G, q += G) {
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    for (int i = 0; i < G; i += 16) {
      m0 = _mm256_max_ps(m0, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
      m1 = _mm256_max_ps(m1, _mm256_and_ps(_mm256_loadu_ps(x + i + 8), abs_mask));
    }
    const float amax = hmax8(_mm256_max_ps(m0, m1));
    if (!(amax >= kIntMinAmax<T>)) {  // zero (or negligible) group, as the reference
      std::fill(q, q + G, T(0));
      d[g] = 0.0f;
      ix[g] = 0;
      xs[g] = 0.0f;
      continue;
    }
    const __m256 id = _mm256_set1_ps(Q / amax);
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < G; i += 32) {
      __m256i c[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), id));
        c[j] = _mm256_min_epi32(qmax, _mm256_max_epi32(qmin, v));
        sum = _mm256_add_epi32(sum, c[j]);
      }
      store32(q + i, c[0], c[1], c[2], c[3]);
    }
    d[g] = amax / Q;
    ix[g] = hsum8(sum);
    xs[g] = d[g] * float(ix[g]);
  }
}

template void int_quantize_groups_avx2(const float*, int, int, int8_t*, float*, int32_t*, float*);
template void int_quantize_groups_avx2(const float*, int, int, int16_t*, float*, int32_t*, float*);

}  // namespace mixbits
