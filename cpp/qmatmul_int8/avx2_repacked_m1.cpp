// One x row against the row-interleaved layout (repack.h) on AVX2: both
// 256-bit halves of a block (rows 0-7 and 8-15) in one pass, where the
// other calls go through avx2_repacked.cpp's half_blocks, a half block per
// pass, reading every line of words twice. Here each line is loaded once,
// each broadcast of x serves 16 rows and the group's d and xs are
// broadcast once. int8, below 8 bits: the products of several steps are
// summed in int16 before one vpmaddwd (at most kMaxPartial steps). The
// int32 sums and the float epilogue are half_blocks', bit for bit. Fewer
// live vectors also keep the float accumulators in registers (half_blocks'
// M = 1 loop chained them through the stack).
//
// This file gets -mavx2 -mfma -mf16c (CMake, avx2_*.cpp) and is reached
// only through avx2_repacked.cpp's tables.
#if defined(MIXBITS_HAVE_AVX2)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "common/x86_prefetch.h"
#include "qmatmul_int8/avx2_repacked.h"
#include "qmatmul_int8/repack.h"
#include "common/x86_half.h"

namespace mixbits {
namespace {

// p0/p1 (int16 partial sums of the two halves) into acc0/acc1, after every
// P-th step t of a word or chunk.
template <int P, int t>
inline void flush_partial(__m256i& p0, __m256i& p1, __m256i& acc0, __m256i& acc1) {
  if constexpr ((t + 1) % P == 0) {
    const __m256i ones = _mm256_set1_epi16(1);
    acc0 = in_order(_mm256_add_epi32(acc0, _mm256_madd_epi16(p0, ones)));
    acc1 = in_order(_mm256_add_epi32(acc1, _mm256_madd_epi16(p1, ones)));
    p0 = p1 = _mm256_setzero_si256();
  }
}

template <int B, int t>
inline void split_step_m1(const __m256i (&cw0)[B], const __m256i (&cw1)[B], const int8_t* xq,
                          int64_t x0, __m256i& p0, __m256i& p1, __m256i& acc0, __m256i& acc1) {
  constexpr int LB = split_low_bits(B), S = 8 / LB, W = t / S, K = t % S;
  int32_t quad;
  std::memcpy(&quad, xq + x0 + W * (32 / LB) + K * 4, 4);
  const __m256i xb = _mm256_set1_epi32(quad);
  p0 = in_order(_mm256_add_epi16(p0, _mm256_maddubs_epi16(split_code<B, int8_t, W, K>(cw0), xb)));
  p1 = in_order(_mm256_add_epi16(p1, _mm256_maddubs_epi16(split_code<B, int8_t, W, K>(cw1), xb)));
  flush_partial<kChunkPartial<B>, t>(p0, p1, acc0, acc1);
}

template <int B, int... t>
__attribute__((always_inline)) inline void split_chunk_m1(const __m256i (&cw0)[B], const __m256i (&cw1)[B],
                                                          const int8_t* xq, int64_t x0, __m256i& acc0,
                                                          __m256i& acc1, std::integer_sequence<int, t...>) {
  static_assert(sizeof...(t) % kChunkPartial<B> == 0, "a chunk's steps end on a flush");
  __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
  (split_step_m1<B, t>(cw0, cw1, xq, x0, p0, p1, acc0, acc1), ...);
}

// Step k of a 2- or 4-bit word pair (w0: rows 0-7, w1: rows 8-15).
template <int B, int k>
inline void word_step_m1(__m256i w0, __m256i w1, const int8_t* xw, __m256i& p0, __m256i& p1,
                         __m256i& acc0, __m256i& acc1) {
  int32_t quad;
  std::memcpy(&quad, xw + k * 4, 4);
  const __m256i xb = _mm256_set1_epi32(quad);
  p0 = in_order(_mm256_add_epi16(p0, _mm256_maddubs_epi16(word_code<B, int8_t>(w0, k), xb)));
  p1 = in_order(_mm256_add_epi16(p1, _mm256_maddubs_epi16(word_code<B, int8_t>(w1, k), xb)));
  flush_partial<8 / B, k>(p0, p1, acc0, acc1);  // one partial sum per word
}

template <int B, int... k>
__attribute__((always_inline)) inline void word_m1(__m256i w0, __m256i w1, const int8_t* xw, __m256i& acc0,
                                                   __m256i& acc1, std::integer_sequence<int, k...>) {
  static_assert(sizeof...(k) <= kMaxPartial<B>, "a word's products fit one int16 partial sum");
  __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
  (word_step_m1<B, k>(w0, w1, xw, p0, p1, acc0, acc1), ...);
}

// One x row's group g for both halves of a block (so: the group's offset
// in the scales and biases; iq0, iq1: the halves' exact integer dots).
inline void block_epilogue(const RSeg& s, const RX& x, int g, int64_t so, __m256i iq0, __m256i iq1,
                           __m256& accf0, __m256& accf1) {
  const __m256 d = _mm256_set1_ps(x.d[g]), xs = _mm256_set1_ps(x.xs[g]);
  accf0 = group_epilogue(accf0, iq0, load8_f32(s.scales, so, s.sdt), load8_f32(s.biases, so, s.sdt), d, xs);
  accf1 = group_epilogue(accf1, iq1, load8_f32(s.scales, so + H, s.sdt), load8_f32(s.biases, so + H, s.sdt),
                         d, xs);
}

// y[n0 ..] += a block's 16 sums (accf0: rows 0-7, accf1: 8-15). The last
// block may hold padding rows: add into the real ones only.
inline void add_block(__m256 accf0, __m256 accf1, int n0, int N, float* y) {
  const int nreal = N - n0 < R ? N - n0 : R;
  alignas(32) float v[R];
  _mm256_store_ps(v, accf0);
  _mm256_store_ps(v + H, accf1);
  for (int r = 0; r < nreal; ++r) y[n0 + r] += v[r];
}

// Word j of a block of 2-, 4- or 8-bit codes (wb: the block's words): w0
// rows 0-7, w1 rows 8-15, its line prefetched ahead.
template <int B>
inline void load_word(const uint32_t* wb, int j, __m256i& w0, __m256i& w1) {
  const uint32_t* wp = wb + int64_t(j) * R;
  prefetch_words<B>(wp);
  w0 = _mm256_loadu_si256((const __m256i*)wp);
  w1 = _mm256_loadu_si256((const __m256i*)(wp + H));
}

// Blocks [b0, b1) of a segment, both halves in one pass: group_dots(wb,
// g, iq0, iq1) gives group g's exact integer dots of the block whose words
// start at wb (iq0: rows 0-7, iq1: 8-15); the float epilogue and the
// block's store are the same for both contracts. The lambdas passed here
// carry no always_inline of their own: GCC 12 with one there dropped every
// _mm_prefetch inside them (0 prefetches in this file's object, 207
// without the attribute); they inline all the same.
template <class GroupDots>
__attribute__((always_inline)) inline void each_block(const RSeg& s, const RX& x, int b0, int b1, int N,
                                                      float* y, GroupDots&& group_dots) {
  const int ng = s.ngroups;
  for (int b = b0; b < b1; ++b) {
    const uint32_t* wb = s.wq + int64_t(b) * s.words * R;
    const int64_t sb = int64_t(b) * ng * R;
    __m256 accf0 = _mm256_setzero_ps(), accf1 = _mm256_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      __m256i iq0, iq1;
      group_dots(wb, g, iq0, iq1);
      block_epilogue(s, x, g, sb + int64_t(g) * R, iq0, iq1, accf0, accf1);
    }
    add_block(accf0, accf1, b * R, N, y);
  }
}

}  // namespace

template <int B, int G>
void repacked_m1_int8_avx2(const RSeg& s, const RX& x, int b0, int b1, int N, float* y) {
  constexpr int CPW = 32 / B, WG = G * B / 32;
  const int8_t* xq = static_cast<const int8_t*>(x.xq);
  each_block(s, x, b0, b1, N, y,
             [&](const uint32_t* wb, int g, __m256i& acc0, __m256i& acc1) {
    acc0 = acc1 = _mm256_setzero_si256();
    if constexpr (repack_splits(B)) {
      constexpr int SC = split_low_bits(B) * (8 / split_low_bits(B));  // steps per chunk
#pragma GCC unroll 4
      for (int ch = 0; ch < G / 32; ++ch) {
        const int64_t q = int64_t(g) * (G / 32) + ch;  // chunk: words B*q .. B*q + B-1
        const uint32_t* wp = wb + B * q * R;
        for (int i = 0; i < B; ++i) prefetch_words<B>(wp + i * R);  // a chunk: B lines
        __m256i cw0[B], cw1[B];
        for (int i = 0; i < B; ++i) {
          cw0[i] = _mm256_loadu_si256((const __m256i*)(wp + i * R));
          cw1[i] = _mm256_loadu_si256((const __m256i*)(wp + i * R + H));
        }
        split_chunk_m1<B>(cw0, cw1, xq, q * 32, acc0, acc1, std::make_integer_sequence<int, SC>{});
      }
    } else {
#pragma GCC unroll 8
      for (int jw = 0; jw < WG; ++jw) {
        const int j = g * WG + jw;
        __m256i w0, w1;
        load_word<B>(wb, j, w0, w1);
        if constexpr (B == 8) {
          int32_t quad;
          std::memcpy(&quad, xq + int64_t(j) * CPW, 4);
          const __m256i xb = _mm256_set1_epi32(quad);
          acc0 = idot<8, int8_t>(acc0, w0, xb);
          acc1 = idot<8, int8_t>(acc1, w1, xb);
        } else {
          word_m1<B>(w0, w1, xq + int64_t(j) * CPW, acc0, acc1, std::make_integer_sequence<int, 8 / B>{});
        }
      }
    }
  });
}

// int16, one x row, 2/4/8 bits: both halves of each block in one pass, as
// the int8 pass above: each line of words loaded once and each activation
// pair broadcast once for 16 rows; two chains per half (even and odd
// steps) to cover vpmaddwd's latency. The int32 sums are half_blocks'
// (exact), and so is the float epilogue, bit for bit.
template <int B, int G>
void repacked_m1_int16_avx2(const RSeg& s, const RX& x, int b0, int b1, int N, float* y) {
  constexpr int S = 16 / B, CPW = 32 / B, WG = G * B / 32;
  const int16_t* xq = static_cast<const int16_t*>(x.xq);
  each_block(s, x, b0, b1, N, y,
             [&](const uint32_t* wb, int g, __m256i& iq0, __m256i& iq1) {
    __m256i acc[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                         {_mm256_setzero_si256(), _mm256_setzero_si256()}};  // [half][step parity]
#pragma GCC unroll 8
    for (int jw = 0; jw < WG; ++jw) {
      const int j = g * WG + jw;
      __m256i w0, w1;
      load_word<B>(wb, j, w0, w1);
#pragma GCC unroll 8
      for (int k = 0; k < S; ++k) {
        int32_t pair;
        std::memcpy(&pair, xq + int64_t(j) * CPW + 2 * k, 4);
        const __m256i xb = _mm256_set1_epi32(pair);
        acc[0][k % 2] = idot<B, int16_t>(acc[0][k % 2], word_code<B, int16_t>(w0, k), xb);
        acc[1][k % 2] = idot<B, int16_t>(acc[1][k % 2], word_code<B, int16_t>(w1, k), xb);
      }
    }
    iq0 = _mm256_add_epi32(acc[0][0], acc[0][1]);
    iq1 = _mm256_add_epi32(acc[1][0], acc[1][1]);
  });
}

// Every width and group size of the tables (avx2_repacked.cpp's
// make_table); int16 only where the words are not split.
#define MIXBITS_M1_ROW(B)                                                              \
  template void repacked_m1_int8_avx2<B, 32>(const RSeg&, const RX&, int, int, int, float*); \
  template void repacked_m1_int8_avx2<B, 64>(const RSeg&, const RX&, int, int, int, float*); \
  template void repacked_m1_int8_avx2<B, 128>(const RSeg&, const RX&, int, int, int, float*);
#define MIXBITS_M1_INT16_ROW(B)                                                         \
  template void repacked_m1_int16_avx2<B, 32>(const RSeg&, const RX&, int, int, int, float*); \
  template void repacked_m1_int16_avx2<B, 64>(const RSeg&, const RX&, int, int, int, float*); \
  template void repacked_m1_int16_avx2<B, 128>(const RSeg&, const RX&, int, int, int, float*);
MIXBITS_M1_ROW(2) MIXBITS_M1_ROW(3) MIXBITS_M1_ROW(4) MIXBITS_M1_ROW(5) MIXBITS_M1_ROW(6) MIXBITS_M1_ROW(8)
MIXBITS_M1_INT16_ROW(2) MIXBITS_M1_INT16_ROW(4) MIXBITS_M1_INT16_ROW(8)
#undef MIXBITS_M1_ROW
#undef MIXBITS_M1_INT16_ROW

}  // namespace mixbits
#endif
