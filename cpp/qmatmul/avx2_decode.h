// Decode of MLX's quantized bitstreams into floats on x86, and the small
// helpers every x86 kernel file shares (see avx2_table.h for the files).
//
// Codes are read 32 at a time (a "unit": every group size is a multiple of
// 32, so a unit never straddles a group or a segment). Each of the 8 lanes
// gets a 32-bit window of the row's bitstream holding 4 consecutive codes:
// lane i holds codes 4i..4i+3 at bit offsets s_i + k*bits (s_i = 4 for odd
// lanes of 3- and 5-bit rows, else 0). Extraction k is then a single AND
// with a per-lane mask and an int->float convert: lane i yields
// code(4i+k) * 2^(s_i + k*bits). No shifts: the power of two is divided out
// of the activations instead, once per call (exact in float). So x is
// re-ordered per unit into "decode order" (position 8k+i holds column
// 4i+k) and pre-scaled per segment.
//
// Everything here is in an unnamed namespace: each kernel file gets its own
// copy, so no out-of-line helper is shared (and picked by the linker)
// across files.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "common/x86_half.h"
#include "qmatmul/kernel.h"

// 16-lane functions: compiled for AVX-512F inside files built for AVX2, run
// only through the AVX-512 table row (CPUID-checked by dispatch.cpp).
#define MIXBITS_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

namespace mixbits {
namespace {

constexpr int kUnit = 32;  // codes per decode unit

// ------------------------------------------------------------ decode

constexpr int lane_shift(int B, int i) { return ((B & 1) && (i & 1)) ? 4 : 0; }

// Bit position of code (4i+k) inside lane i's window; the 8-bit top code
// is shifted down instead of masked (its mask would hit the sign bit).
constexpr int code_exp(int B, int k, int i) {
  return (B == 8 && k == 3) ? 0 : lane_shift(B, i) + k * B;
}

constexpr int lane_mask(int B, int k, int i) {
  return int(((1u << B) - 1u) << code_exp(B, k, i));
}

template <int B>
inline __m256i load_unit(const uint8_t* p);

// 2-bit: 8 bytes, lane i = byte i.
template <>
inline __m256i load_unit<2>(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
// 4-bit: 16 bytes, lane i = bytes 2i..2i+1.
template <>
inline __m256i load_unit<4>(const uint8_t* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
}
// 8-bit: 32 bytes, lane i = word i.
template <>
inline __m256i load_unit<8>(const uint8_t* p) {
  return _mm256_loadu_si256((const __m256i*)p);
}
// 3-bit: 12 bytes; lanes start at bytes 0,1,3,4 | 6,7,9,10 (2 bytes each).
// The two halves are loaded separately so no load leaves the unit.
template <>
inline __m256i load_unit<3>(const uint8_t* p) {
  const __m128i lo = _mm_loadl_epi64((const __m128i*)p);
  const __m128i hi = _mm_loadl_epi64((const __m128i*)(p + 4));
  const __m256i ctrl = _mm256_setr_epi8(
      0, 1, -1, -1, 1, 2, -1, -1, 3, 4, -1, -1, 4, 5, -1, -1,  //
      2, 3, -1, -1, 3, 4, -1, -1, 5, 6, -1, -1, 6, 7, -1, -1);
  return _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), ctrl);
}
// 5-bit: 20 bytes; lanes start at bytes 0,2,5,7 | 10,12,15,17 (3 bytes).
template <>
inline __m256i load_unit<5>(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)p);
  const __m128i hi = _mm_loadu_si128((const __m128i*)(p + 4));
  const __m256i ctrl = _mm256_setr_epi8(
      0, 1, 2, -1, 2, 3, 4, -1, 5, 6, 7, -1, 7, 8, 9, -1,  //
      6, 7, 8, -1, 8, 9, 10, -1, 11, 12, 13, -1, 13, 14, 15, -1);
  return _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), ctrl);
}
// 6-bit: 24 bytes; lanes start at bytes 3i (3 bytes each).
template <>
inline __m256i load_unit<6>(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)p);
  const __m128i hi = _mm_loadu_si128((const __m128i*)(p + 8));
  const __m256i ctrl = _mm256_setr_epi8(
      0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  //
      4, 5, 6, -1, 7, 8, 9, -1, 10, 11, 12, -1, 13, 14, 15, -1);
  return _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), ctrl);
}

// Codes (4i+k), i = 0..7, as floats times 2^code_exp(B, k, i).
template <int B, int K>
inline __m256 extract(__m256i win) {
  if constexpr (B == 8 && K == 3) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(win, 24));
  } else {
    const __m256i m = _mm256_setr_epi32(
        lane_mask(B, K, 0), lane_mask(B, K, 1), lane_mask(B, K, 2),
        lane_mask(B, K, 3), lane_mask(B, K, 4), lane_mask(B, K, 5),
        lane_mask(B, K, 6), lane_mask(B, K, 7));
    return _mm256_cvtepi32_ps(_mm256_and_si256(win, m));
  }
}

// 2^-code_exp per decode position (8k + i) of a unit.
template <int B>
struct UnitScale {
  float v[kUnit];
  constexpr UnitScale() : v() {
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 8; ++i) {
        float f = 1.0f;
        for (int e = 0; e < code_exp(B, k, i); ++e) f *= 0.5f;
        v[8 * k + i] = f;
      }
  }
};

// ------------------------------------------------------------ helpers

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// n scales or biases from element `off` of src, as float32.
inline void to_f32(const void* src, int64_t off, int n, DType t, float* dst) {
  if (t == DType::f32)
    std::memcpy(dst, static_cast<const float*>(src) + off, sizeof(float) * n);
  else
    widen_half_f16c(static_cast<const uint16_t*>(src) + off, n, t, dst);
}

inline float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Column c of a row, in decode order: position 8k+i of a unit <- 4i+k.
// `scale` (32 floats, or null) multiplies position p of every unit. A unit
// is an 8x4 (i, k) matrix to transpose: 4x4 transposes inside each 128-bit
// half, then one cross-half permute per output row.
inline void to_decode_order(const float* src, int n, float* dst,
                            const float* scale = nullptr) {
  const __m256i ilv = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 sc[4];
  for (int k = 0; k < 4; ++k)
    sc[k] = scale ? _mm256_loadu_ps(scale + 8 * k) : _mm256_set1_ps(1.0f);
  for (int u = 0; u < n; u += kUnit) {
    const __m256 a = _mm256_loadu_ps(src + u), b = _mm256_loadu_ps(src + u + 8);
    const __m256 c = _mm256_loadu_ps(src + u + 16), d = _mm256_loadu_ps(src + u + 24);
    const __m256 t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
    const __m256 t2 = _mm256_unpacklo_ps(c, d), t3 = _mm256_unpackhi_ps(c, d);
    const __m256 r[4] = {
        _mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
        _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int k = 0; k < 4; ++k)
      _mm256_storeu_ps(dst + u + 8 * k,
                       _mm256_mul_ps(_mm256_permutevar8x32_ps(r[k], ilv), sc[k]));
  }
}

// Sums of x over consecutive groups of gs (a multiple of 8) columns.
inline void group_sums(const float* src, int ngroups, int gs, float* out) {
  for (int g = 0; g < ngroups; ++g) {
    __m256 a0 = _mm256_loadu_ps(src), a1 = _mm256_setzero_ps();
    for (int c = 8; c < gs; c += 16) {
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(src + c));
      if (c + 8 < gs) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(src + c + 8));
    }
    out[g] = hsum(_mm256_add_ps(a0, a1));
    src += gs;
  }
}


// ------------------------------------------------------------ 16-lane decode
// For the 16-lane small-M kernel (avx2_gemv512.cpp). One unit's 8-lane
// window is duplicated into both halves of a 16-lane register, so one
// AND + convert yields extractions k and k+1: decode positions 0..15, then
// 16..31, contiguous in the same x layout. The 8-bit top code has its own
// exponent in the AVX2 layout (shifted, not masked), so its half is
// shifted per lane instead.
template <int B, int H>  // H: 0 -> extractions 0,1; 1 -> extractions 2,3
MIXBITS_AVX512 inline __m512 extract_pair(__m512i w2) {
  constexpr int k0 = 2 * H, k1 = 2 * H + 1;
  if constexpr (B == 8 && H == 1) {
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 24, 24, 24, 24,
                                         24, 24, 24, 24);
    const __m512i m = _mm512_setr_epi32(
        0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000,
        0xFF0000, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w2, sh), m));
  } else {
    const __m512i m = _mm512_setr_epi32(
        lane_mask(B, k0, 0), lane_mask(B, k0, 1), lane_mask(B, k0, 2),
        lane_mask(B, k0, 3), lane_mask(B, k0, 4), lane_mask(B, k0, 5),
        lane_mask(B, k0, 6), lane_mask(B, k0, 7), lane_mask(B, k1, 0),
        lane_mask(B, k1, 1), lane_mask(B, k1, 2), lane_mask(B, k1, 3),
        lane_mask(B, k1, 4), lane_mask(B, k1, 5), lane_mask(B, k1, 6),
        lane_mask(B, k1, 7));
    return _mm512_cvtepi32_ps(_mm512_and_si512(w2, m));
  }
}

// A unit's window in both 8-lane halves. For 2-, 4- and 8-bit rows the
// bytes are broadcast by the load itself (a load-port operation) before
// widening, which saves the cross-lane insert of the generic path.
template <int B>
MIXBITS_AVX512 inline __m512i load_unit2(const uint8_t* p) {
  if constexpr (B == 2) {
    const __m128i b = _mm_castpd_si128(_mm_loaddup_pd((const double*)p));
    return _mm512_cvtepu8_epi32(b);
  } else if constexpr (B == 4) {
    return _mm512_cvtepu16_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p)));
  } else if constexpr (B == 8) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
  } else {
    const __m256i win = load_unit<B>(p);
    return _mm512_inserti64x4(_mm512_castsi256_si512(win), win, 1);
  }
}

}  // namespace
}  // namespace mixbits
