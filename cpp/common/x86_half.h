// Float16 / bfloat16 -> float32 with F16C, 8 per step: the one loop the
// bulk conversion (avx2_convert.cpp) and the float kernels' scale loads
// (qmatmul/avx2_decode.h's to_f32, inlined in their hot loops) share.
// Only for files built with -mavx2 -mf16c. The tail (n % 8 values) uses
// F16C's scalar convert: a padded vector there cost two libc memcpy calls
// per call (~7% of a 576x576 GEMV, which converts 18 groups per row).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "common/half.h"

namespace mixbits {
namespace {

// Eight values at p + off as float32 lanes: float32 loaded, float16 by
// F16C's convert, bfloat16 widened by a shift. The one 8-lane load every
// AVX2 kernel reading a float of either width uses (repacked scales and
// biases, the panel packers, KL's logits, attention's K and V), so they
// widen alike. Internal linkage, one copy per including file, inlined into
// its AVX2 code; the 16-lane twin is qmatmul_int8/x86_load16.h.
inline __m256 load8_f32(const void* p, int64_t off, DType t) {
  if (t == DType::f32) return _mm256_loadu_ps(static_cast<const float*>(p) + off);
  const __m128i h = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(p) + off));
  if (t == DType::f16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16
}

}  // namespace

inline void widen_half_f16c(const uint16_t* p, int64_t n, DType t, float* dst) {
  int64_t i = 0;
  if (t == DType::f16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(p[i]);
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    for (; i < n; ++i) dst[i] = bf16_to_f32(p[i]);
  }
}

}  // namespace mixbits
