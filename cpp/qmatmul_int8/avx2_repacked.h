// The steps the AVX2 repacked GEMV's passes share (avx2_repacked.cpp:
// 2-8 x rows, a half block at a time; avx2_repacked_m1.cpp: one x row,
// both halves in one pass): how a word's codes are cut out, multiplied
// with broadcast activations and summed, and the per-group float
// epilogue. Both passes must produce a block's integer sums and float
// epilogue alike, bit for bit (the tests compare them).
//
// Include only in files built with -mavx2 -mfma -mf16c (avx2_*.cpp): the
// helpers have internal linkage, one copy per including file, as
// common/x86_half.h's load8_f32.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "qmatmul_int8/repack.h"

namespace mixbits {

// One x row against blocks [b0, b1) of a segment, both 256-bit halves of
// a block in one pass (avx2_repacked_m1.cpp, instantiated for every width
// and group size of the table): int8 at every width, int16 at 2, 4, 8.
template <int B, int G>
void repacked_m1_int8_avx2(const RSeg& s, const RX& x, int b0, int b1, int N, float* y);
template <int B, int G>
void repacked_m1_int16_avx2(const RSeg& s, const RX& x, int b0, int b1, int N, float* y);

namespace {

constexpr int R = kRepackRows;
constexpr int H = 8;  // rows per 256-bit half

// v, opaque to the optimizer: GCC reassociates a chain of integer vector
// adds, and for a pass of several x rows it then computes all the pass's
// products (vpmaddubsw, or vpmaddwd for int16) first and spills them to
// the stack; passing each sum through this keeps one add per product, in
// program order.
inline __m256i in_order(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

// 8-bit codes as two 4-bit nibbles per byte (lo, hi), the form vpmaddubsw
// takes them in without saturating: a code is lo + 16 * hi.
inline void nibbles(__m256i c, __m256i& lo, __m256i& hi) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(c, lo4);
  hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), lo4);
}

// acc + per int32 lane the dot of the lane's codes with the broadcast x,
// one step at a time: the int16 contract, and the one-row int8 pass at 8
// bits (every other int8 loop sums int16 partials first). Ordered: the
// adds kept in order (in_order), as passes of several x rows need; one
// row measured 7% faster without (int16, 4-bit, 4096^2).
template <int B, class T, bool Ordered = true>
inline __m256i idot(__m256i acc, __m256i c, __m256i x) {
  if constexpr (sizeof(T) == 2) {
    const __m256i sum = _mm256_add_epi32(acc, _mm256_madd_epi16(c, x));
    return Ordered ? in_order(sum) : sum;
  } else {
    static_assert(B == 8, "below 8 bits the int8 loops sum int16 partials");
    __m256i lo, hi;
    nibbles(c, lo, hi);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x), _mm256_set1_epi16(1)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x), _mm256_set1_epi16(16)));
  }
}

template <int D>
inline __m256i shift_r(__m256i v) {
  if constexpr (D > 0) return _mm256_srli_epi32(v, D);
  else if constexpr (D < 0) return _mm256_slli_epi32(v, -D);
  else return v;
}

// Shift k's codes of a word of B-bit codes (bytes for int8, 16-bit halves
// for int16): the word shifted by k*B, masked unless the codes fill it.
template <int B, class T>
inline __m256i word_code(__m256i w, int k) {
  constexpr uint32_t kMask = repack_code_mask<B, T>();
  const __m256i c = k == 0 ? w : _mm256_srli_epi32(w, k * B);
  if constexpr (kMask == 0xFFFFFFFFu) return c;
  else return _mm256_and_si256(c, _mm256_set1_epi32(int(kMask)));
}

// One group's float epilogue for 8 rows and one x row: accf plus the exact
// integer dot times scales * d, plus biases * xs (the activation sum).
inline __m256 group_epilogue(__m256 accf, __m256i iq, __m256 scales, __m256 biases, __m256 d,
                             __m256 xs) {
  accf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iq), _mm256_mul_ps(scales, d), accf);
  return _mm256_fmadd_ps(biases, xs, accf);
}

// Split segments (3, 5, 6 bits; repack.h): per chunk of 32 codes, the
// LB-bit kernel's shift K of low word W, ORed with high word split_hword's
// shift by split_hshift masked to bits LB.. of each element.
template <int B, class T, int W, int K>
inline __m256i split_code(const __m256i (&cw)[B]) {
  constexpr int LB = split_low_bits(B);
  const __m256i lo = _mm256_and_si256(shift_r<LB * K>(cw[W]),
                                      _mm256_set1_epi32(int(repack_code_mask<LB, T>())));
  const __m256i hw = cw[LB + split_hword(B, W * (32 / LB))];
  const __m256i hi = _mm256_and_si256(shift_r<split_hshift(B, W, K)>(hw),
                                      _mm256_set1_epi32(int(repack_code_mask<B - LB, T>() << LB)));
  return _mm256_or_si256(lo, hi);
}

// Steps (vpmaddubsw products of one x row) an int16 partial sum can hold:
// |steps * 2 * (2^B - 1) * 128| < 2^15.
template <int B>
constexpr int kMaxPartial = 32767 / (2 * ((1 << B) - 1) * 128);  // 3 bits 18, 5 bits 4, 6 bits 2

// Steps per int16 partial sum in a split chunk (8 steps: a divisor of 8).
template <int B>
constexpr int kChunkPartial = kMaxPartial<B> >= 8 ? 8 : kMaxPartial<B> >= 4 ? 4 : 2;

}  // namespace
}  // namespace mixbits
