// F16C versions of common/convert.h, 8 values per step (widening:
// common/x86_half.h); the tails round as half.h's scalar conversions do.
#include <immintrin.h>

#include "common/convert.h"
#include "common/x86_half.h"

namespace mixbits {

void widen_to_f32_avx2(const void* src, int64_t off, int64_t n, DType dt, float* dst) {
  widen_half_f16c(static_cast<const uint16_t*>(src) + off, n, dt, dst);
  _mm256_zeroupper();
}

void narrow_from_f32_avx2(const float* src, int64_t n, DType dt, void* dst, int64_t off) {
  uint16_t* p = static_cast<uint16_t*>(dst) + off;
  int64_t i = 0;
  if (dt == DType::f16) {
    // vcvtps2ph keeps a NaN's payload; half.h gives sign | 0x7e00 for
    // every NaN, and so do the NaN lanes here.
    const __m128i quiet = _mm_set1_epi16(0x7e00), sign = _mm_set1_epi16(int16_t(0x8000));
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(src + i);
      __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
      h = _mm_blendv_epi8(h, _mm_or_si128(_mm_and_si128(h, sign), quiet), nan16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i), h);
    }
    for (; i < n; ++i) p[i] = f32_to_f16(src[i]);
  } else {
    for (; i < n; ++i) p[i] = f32_to_bf16(src[i]);  // not on a hot path yet
  }
  _mm256_zeroupper();
}

}  // namespace mixbits
