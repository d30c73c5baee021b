// AVX2 integer-activation kernels. int8: maddubs (u8 codes x s8 activations, pairs
// into int16) then madd with ones into int32. Pair sums stay below 2^15 up
// to 6 bits (2 * 63 * 127); 8-bit codes (up to 255) would saturate, so they
// are widened to int16 and multiplied with madd directly.
#include <immintrin.h>

#include "qmatmul_int8/x86.h"

namespace mixbits {
namespace {

struct DotAvx2 : Int8Lanes256 {
  static constexpr int kMaxMB = 4;  // 16 registers: R*MB <= 4
  template <int MB>
  static constexpr int rows_per_pass() { return MB == 1 ? 4 : MB == 2 ? 2 : 1; }
  template <int B>
  static __m256i dot(__m256i acc, __m256i w, __m256i x) {
    if constexpr (B == 8) {
      const __m256i lo = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)),
                                           _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)));
      const __m256i hi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1)),
                                           _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1)));
      return _mm256_add_epi32(acc, _mm256_add_epi32(lo, hi));
    } else {
      const __m256i p16 = _mm256_maddubs_epi16(w, x);
      return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
    }
  }
};

// int16 activations: the 32 byte codes widened to two vectors of 16-bit
// codes, madd with 16-bit activations (pairs of 255 * 32767 fit int32; a
// group of 128 sums to at most 2^30).
struct DotAvx2I16 : Lanes256 {
  using Code = int16_t;
  struct XV { __m256i lo, hi; };
  static constexpr int kMaxMB = 4;
  template <int MB>
  static constexpr int rows_per_pass() { return MB == 1 ? 4 : MB == 2 ? 2 : 1; }
  static XV load_x(const Code* p) {
    return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 16))};
  }
  template <int B>
  static Acc dot(Acc acc, __m256i w, const XV& x) {
    const __m256i lo = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), x.lo);
    const __m256i hi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1)), x.hi);
    return _mm256_add_epi32(acc, _mm256_add_epi32(lo, hi));
  }
};

}  // namespace

const I8Table& int8_table_avx2() {
  static const I8Table t = make_table<DotAvx2>("avx2");
  return t;
}

const I8Table& int16_table_avx2() {
  static const I8Table t = make_table<DotAvx2I16>("avx2");
  return t;
}

}  // namespace mixbits
