// Integer-activation GEMV on the row-interleaved layout (repack.h) for x86
// CPUs without AVX512-VNNI: the same consumption order as repacked_vnni.cpp
// (word j of 16 rows, shift k·B and mask give lane r's codes of row r, 3,
// 5, 6 bits from their low and high plane words; x in repacked_x_col
// order), with a block taken as two 256-bit halves (rows 0-7, 8-15) and
// the integer dots of AVX2. One x row reads both halves in one pass
// (avx2_repacked_m1.cpp; int16 there at 2, 4, 8 bits only); the other
// calls (2-8 rows, and one int16 row at 3, 5, 6 bits) take a half block at
// a time here (half_blocks), its x rows in passes of at most 4 while its
// words are in L1 (the steps both share: avx2_repacked.h):
//   int8:  vpmaddubsw (u8 codes x s8 activations, pairs into int16), summed
//          in int16 over as many steps as cannot overflow (kMaxPartial),
//          then vpmaddwd by 1 into the row's int32 lane: one multiply per
//          32 products instead of two. A pair of 2- to 6-bit codes stays
//          below 2·63·128, inside int16; 8-bit codes would saturate, so
//          they enter as two nibbles, the high one weighted 16 by its
//          vpmaddwd (one step per partial sum).
//   int16: vpmaddwd of 16-bit codes with activation pairs.
// Per group and x row: one convert and two FMAs per 8 rows, as in VNNI.
// This file gets -mavx2 -mfma -mf16c (CMake, avx2_*.cpp) and is reached
// only where cpu_isa().avx2; plain-data headers (see table.h) and
// internal-linkage AVX2 helpers only.
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

// Words of 2-, 4- or 8-bit codes per int16 partial sum in half_rows: the
// most that divide a group's WG words and stay within kMaxPartial steps
// (8-bit codes enter vpmaddubsw as 4-bit nibbles, one step per word).
template <int B, int WG>
constexpr int words_per_partial() {
  constexpr int PB = B == 8 ? 4 : B;  // bits of a code vpmaddubsw sees
  int wp = 1;
  for (int c = 1; c <= WG; ++c)
    if (WG % c == 0 && c * (8 / B) <= kMaxPartial<PB>) wp = c;
  return wp;
}

// Step (W, K) of a chunk: its codes times the x rows' quads. int8: into
// the rows' int16 partial sums p, kChunkPartial<B> steps each, then into
// acc with one vpmaddwd (the same int32 sums as a vpmaddwd per step).
template <int B, int MB, class T, int W, int K>
inline void split_step(const __m256i (&cw)[B], const T* xq, int ldx, int64_t x0,
                       __m256i (&p)[MB], __m256i (&acc)[MB]) {
  constexpr int P = 4 / int(sizeof(T)), LB = split_low_bits(B);
  constexpr int t = W * (8 * int(sizeof(T)) / LB) + K;  // the step's index in the chunk
  const __m256i c = split_code<B, T, W, K>(cw);
  for (int m = 0; m < MB; ++m) {
    int32_t quad;
    std::memcpy(&quad, xq + int64_t(m) * ldx + x0 + W * (32 / LB) + K * P, 4);
    const __m256i xb = _mm256_set1_epi32(quad);
    if constexpr (sizeof(T) == 1) {
      constexpr int PS = kChunkPartial<B>;
      const __m256i prod = _mm256_maddubs_epi16(c, xb);
      p[m] = in_order(t % PS == 0 ? prod : _mm256_add_epi16(p[m], prod));
      if constexpr ((t + 1) % PS == 0)
        acc[m] = in_order(_mm256_add_epi32(acc[m], _mm256_madd_epi16(p[m], _mm256_set1_epi16(1))));
    } else {
      acc[m] = idot<B, T, (MB > 1)>(acc[m], c, xb);
    }
  }
}

// Every step of a chunk, step t = shift t % S of low word t / S. Forced
// inline: GCC otherwise calls it out of line from half_rows (a vzeroupper
// and the accumulators through memory per chunk: 3-bit M = 2 ran 1.3x
// slower).
template <int B, int MB, class T, int... t>
__attribute__((always_inline)) inline void split_chunk(const __m256i (&cw)[B], const T* xq, int ldx,
                                                       int64_t x0, __m256i (&acc)[MB],
                                                       std::integer_sequence<int, t...>) {
  static_assert(sizeof(T) == 2 || sizeof...(t) % kChunkPartial<B> == 0, "a chunk's steps end on a flush");
  constexpr int S = 8 * int(sizeof(T)) / split_low_bits(B);
  __m256i p[MB];
  (split_step<B, MB, T, t / S, t % S>(cw, xq, ldx, x0, p, acc), ...);
}

// x rows m0 .. of x (the same rows, moved by m0).
template <class T>
inline RX rows_from(const RX& x, int m0) {
  return RX{static_cast<const T*>(x.xq) + int64_t(m0) * x.ldx, x.ldx, x.d + int64_t(m0) * x.ldg,
            x.xs + int64_t(m0) * x.ldg, x.ldg, x.ix + int64_t(m0) * x.ldg};
}

// One half of a block (8 rows: words from wb, scales and biases from sb)
// against MB <= kHalfRows activation rows: accf[m] = x row m's 8 sums.
template <int B, int G, int MB, class T>
inline void half_rows(const RSeg& s, const RX& x, const uint32_t* wb, int64_t sb, __m256 (&accf)[MB]) {
  constexpr int S = repack_splits(B) ? 1 : 8 * int(sizeof(T)) / B;  // shifts per word
  constexpr int CPW = 32 / B;                                       // codes per word
  constexpr int WG = G * B / 32;                                    // words per group
  const T* xq = static_cast<const T*>(x.xq);
  const int ng = s.ngroups;
  for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    __m256i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
    if constexpr (repack_splits(B)) {
      // Steps per chunk: the low words' shifts.
      constexpr int SC = split_low_bits(B) * (8 * int(sizeof(T)) / split_low_bits(B));
      for (int ch = 0; ch < G / 32; ++ch) {
        const int64_t q = int64_t(g) * (G / 32) + ch;  // chunk: words B*q .. B*q + B-1
        const uint32_t* wp = wb + B * q * R;
        for (int i = 0; i < B; ++i) prefetch_words<B>(wp + i * R);  // a chunk: B lines
        __m256i cw[B];
        for (int i = 0; i < B; ++i) cw[i] = _mm256_loadu_si256((const __m256i*)(wp + i * R));
        split_chunk<B, MB, T>(cw, xq, x.ldx, q * 32, acc, std::make_integer_sequence<int, SC>{});
      }
    } else {
      // int8: each x row's products summed in int16 over WP words
      // (kMaxPartial's bound, as the one-row pass), then one vpmaddwd into
      // its int32 lane: the same int32 sums. 8 bits: the low and the high
      // nibbles' products in two partial sums, the high one weighted 16 by
      // its vpmaddwd (idot's split). int16: every step into the int32
      // lanes (WP = 1).
      constexpr bool kPartial = sizeof(T) == 1;
      constexpr int NH = B == 8 ? 2 : 1;  // partial sums per x row
      constexpr int WP = kPartial ? words_per_partial<B, WG>() : 1;
      for (int j0 = 0; j0 < WG; j0 += WP) {
        __m256i p[NH][MB];
#pragma GCC unroll 16
        for (int jw = 0; jw < WP; ++jw) {
          const int j = g * WG + j0 + jw;
          const __m256i w = _mm256_loadu_si256((const __m256i*)(wb + int64_t(j) * R));
          prefetch_words<B>(wb + int64_t(j) * R);
#pragma GCC unroll 8
          for (int k = 0; k < S; ++k) {
            __m256i c[NH];
            if constexpr (kPartial && B == 8) {
              nibbles(w, c[0], c[NH - 1]);
            } else {
              c[0] = word_code<B, T>(w, k);
            }
            for (int m = 0; m < MB; ++m) {
              int32_t quad;
              std::memcpy(&quad, xq + int64_t(m) * x.ldx + int64_t(j) * CPW + k * (4 / sizeof(T)), 4);
              const __m256i xb = _mm256_set1_epi32(quad);
              if constexpr (kPartial) {
                for (int h = 0; h < NH; ++h) {
                  const __m256i prod = _mm256_maddubs_epi16(c[h], xb);
                  p[h][m] = in_order(jw == 0 && k == 0 ? prod : _mm256_add_epi16(p[h][m], prod));
                }
              } else {
                acc[m] = idot<B, T, (MB > 1)>(acc[m], c[0], xb);
              }
            }
          }
        }
        if constexpr (kPartial)
          for (int m = 0; m < MB; ++m) {
            __m256i sum = _mm256_madd_epi16(p[0][m], _mm256_set1_epi16(1));
            if constexpr (NH == 2)
              sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p[1][m], _mm256_set1_epi16(16)));
            acc[m] = in_order(_mm256_add_epi32(acc[m], sum));
          }
      }
    }
    const __m256 s8 = load8_f32(s.scales, sb + int64_t(g) * R, s.sdt);
    const __m256 b8 = load8_f32(s.biases, sb + int64_t(g) * R, s.sdt);
    for (int m = 0; m < MB; ++m) {
      accf[m] = group_epilogue(accf[m], acc[m], s8, b8, _mm256_set1_ps(x.d[int64_t(m) * x.ldg + g]),
                               _mm256_set1_ps(x.xs[int64_t(m) * x.ldg + g]));
    }
  }
}

// x rows per half_rows pass: AVX2 has 16 vector registers, and 4 rows'
// int16 partials, int32 and float accumulators take 12 of them (8 bits,
// two partials per row: 3 or 2 rows per pass measured no faster).
constexpr int kHalfRows = 4;

// All MB x rows against one half of a block, kHalfRows at a time while the
// half's words are still in L1; y: the half's first row (nreal real rows).
template <int B, int G, int MB, class T>
void half_all_rows(const RSeg& s, const RX& x, const uint32_t* wb, int64_t sb, int nreal, float* y,
                   int ldy) {
  constexpr int passes = (MB + kHalfRows - 1) / kHalfRows;
  constexpr int C = (MB + passes - 1) / passes;  // even passes: 5 rows as 3 + 2, not 4 + 1
  __m256 accf[C];
  half_rows<B, G, C, T>(s, x, wb, sb, accf);
  alignas(32) float v[H];
  for (int m = 0; m < C; ++m) {
    _mm256_store_ps(v, accf[m]);
    float* yp = y + int64_t(m) * ldy;
    for (int r = 0; r < nreal; ++r) yp[r] += v[r];
  }
  if constexpr (MB > C)
    half_all_rows<B, G, MB - C, T>(s, rows_from<T>(x, C), wb, sb, nreal, y + C * int64_t(ldy), ldy);
}

// Blocks [b0, b1) of one segment against MB activation rows, a half block
// (rows 8h .. 8h+7) at a time.
template <int B, int G, int MB, class T>
void half_blocks(const RSeg& s, const RX& x, int b0, int b1, int N, float* y, int ldy) {
  for (int b = b0; b < b1; ++b) {
    for (int h = 0; h < 2; ++h) {
      // The last block may hold padding rows: add into the real ones only.
      const int n0 = b * R + h * H;
      const int nreal = N - n0 <= 0 ? 0 : N - n0 < H ? N - n0 : H;
      if (nreal == 0) continue;
      half_all_rows<B, G, MB, T>(s, x, s.wq + int64_t(b) * s.words * R + h * H,
                                 int64_t(b) * s.ngroups * R + h * H, nreal, y + n0, ldy);
    }
  }
}

template <int B, int G, class T>
void seg_kernel(const RSeg& s, const RX& x, int mb, int b0, int b1, int N, float* y, int ldy) {
  switch (mb) {
    case 1:
      if constexpr (sizeof(T) == 1) return repacked_m1_int8_avx2<B, G>(s, x, b0, b1, N, y);
      else if constexpr (!repack_splits(B)) return repacked_m1_int16_avx2<B, G>(s, x, b0, b1, N, y);
      else return half_blocks<B, G, 1, T>(s, x, b0, b1, N, y, ldy);
    case 2: return half_blocks<B, G, 2, T>(s, x, b0, b1, N, y, ldy);
    case 3: return half_blocks<B, G, 3, T>(s, x, b0, b1, N, y, ldy);
    case 4: return half_blocks<B, G, 4, T>(s, x, b0, b1, N, y, ldy);
    case 5: return half_blocks<B, G, 5, T>(s, x, b0, b1, N, y, ldy);
    case 6: return half_blocks<B, G, 6, T>(s, x, b0, b1, N, y, ldy);
    case 7: return half_blocks<B, G, 7, T>(s, x, b0, b1, N, y, ldy);
    case 8: return half_blocks<B, G, 8, T>(s, x, b0, b1, N, y, ldy);
  }
}

template <class T>
RTable make_table() {
  RTable t{};
#define MIXBITS_R_ROW(B) \
  t.fn[B][0] = seg_kernel<B, 32, T>; t.fn[B][1] = seg_kernel<B, 64, T>; t.fn[B][2] = seg_kernel<B, 128, T>;
  MIXBITS_R_ROW(2) MIXBITS_R_ROW(3) MIXBITS_R_ROW(4) MIXBITS_R_ROW(5) MIXBITS_R_ROW(6)
  MIXBITS_R_ROW(8)
#undef MIXBITS_R_ROW
  return t;
}

}  // namespace

const RTable& repacked_int8_table_avx2() {
  static const RTable t = make_table<int8_t>();
  return t;
}
const RTable& repacked_int16_table_avx2() {
  static const RTable t = make_table<int16_t>();
  return t;
}

}  // namespace mixbits
#endif
