// The AVX2 decoders of the fp-mode codes, shared by the product kernel
// (avx2.cpp) and the transposed one (avx2_t.cpp). Internal linkage: one
// copy per including file, compiled with that file's AVX2 flags.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "common/x86_prefetch.h"
#include "fpmatmul/kernel.h"

namespace mixbits {
namespace {

struct ScaleTables {
  float e8m0[256];
  float e4m3[256];
};

const ScaleTables& scale_tables() {
  static const ScaleTables t = [] {
    ScaleTables s;
    for (int i = 0; i < 256; ++i) {
      s.e8m0[i] = e8m0_value(uint32_t(i));
      s.e4m3[i] = e4m3_value(uint32_t(i));
    }
    return s;
  }();
  return t;
}

// The 8 codes of one word: lane i gets tab[code_i & 7] with code_i's bit 3
// as its sign (tab = the e2m1 magnitudes times the group's scale; a sign
// flip commutes exactly with that product).
inline __m256 e2m1x8(uint32_t u, __m256 tab) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(u)), shifts);
  const __m256 mag = _mm256_permutevar8x32_ps(tab, v);  // reads bits 0-2 only
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(v, 28),
                                        _mm256_set1_epi32(int(0x80000000u)));
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

// 16 e4m3 codes (bytes) as two vectors of 8 values times 2^-8: e4m3 is
// float16 with the exponent bias 7 lower, so the byte's sign, exponent and
// mantissa moved to float16's positions (sign-extended byte << 7, bit 14
// cleared) is the value times 2^-8 exactly, subnormals included (float16's
// subnormals line up with e4m3's), and F16C widens it exactly. 0x7f / 0xff
// become a float16 NaN. The caller multiplies by 2^8 times the scale.
inline void e4m3x16(const uint8_t* p, __m256* lo, __m256* hi) {
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(int16_t(0xbfff)));
  const __m256i e_m = _mm256_set1_epi16(0x3f80);  // exponent and mantissa all ones: NaN
  h = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, e_m), e_m));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Group g of a row, decoded into v[0 .. group/8).
template <FpMode MD>
inline void decode_group(const uint32_t* row, const uint8_t* srow, int64_t g, __m256* v) {
  constexpr int G = fp_mode_group(MD);
  const ScaleTables& t = scale_tables();
  // The codes stream into L2 ahead of use, once per 64-byte line, as the
  // affine kernels' (common/x86_prefetch.h: rows are contiguous, so this
  // runs on into the next rows).
  constexpr int kGroupBytes = G * fp_mode_bits(MD) / 8;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + g * kGroupBytes;
  if ((reinterpret_cast<uintptr_t>(bytes) & 63) < uintptr_t(kGroupBytes))
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchAhead, _MM_HINT_T1);
  if constexpr (MD == FpMode::Mxfp8) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(row) + g * G;
    for (int i = 0; i < G / 8; i += 2) e4m3x16(p + 8 * i, &v[i], &v[i + 1]);
    const uint8_t sb = srow[g];
    if (sb < 247) {
      // 2^8 · scale is exact below 2^120 (byte 247), so one product per
      // value, rounded once as code · scale is.
      const __m256 sc = _mm256_set1_ps(256.0f * t.e8m0[sb]);
      for (int i = 0; i < G / 8; ++i) v[i] = _mm256_mul_ps(v[i], sc);
    } else {
      // 2^8 · scale would overflow: the exact code value first.
      const __m256 sc = _mm256_set1_ps(t.e8m0[sb]);
      for (int i = 0; i < G / 8; ++i)
        v[i] = _mm256_mul_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(256.0f)), sc);
    }
  } else {
    const float s = MD == FpMode::Nvfp4 ? t.e4m3[srow[g]] : t.e8m0[srow[g]];
    const __m256 tab = _mm256_mul_ps(_mm256_loadu_ps(kE2m1), _mm256_set1_ps(s));
    const uint32_t* p = row + g * (G / 8);
    for (int i = 0; i < G / 8; ++i) v[i] = e2m1x8(p[i], tab);
  }
}

}  // namespace
}  // namespace mixbits
