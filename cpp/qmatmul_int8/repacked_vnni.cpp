// Integer-activation GEMV on the row-interleaved layout (repack.h), with
// AVX512-VNNI: a 512-bit load is word j of 16 W rows, lane r = row r. Each
// shift-and-mask of it gives, per lane, 4 byte codes (int8) or 2 16-bit
// codes (int16) of that row, multiplied by a broadcast quad (pair) of
// activations with vpdpbusd (vpdpwssd) into the row's int32 lane. No
// transpose, no horizontal sum: per group and x row one convert and two
// FMAs (scales * d, biases * xs) cover 16 rows. 3, 5, 6 bits: per chunk of
// 32 codes the 2- (3 bits) or 4-bit (5, 6) kernel's shifts of the low-plane
// words, each ORed with one shift and mask of a high-plane word (repack.h;
// split_step here, the same decode in avx2_repacked.cpp, neon_repacked.cpp).
//
// Same contract as x86.h's kernels (kernel.h): exact integer dots per group,
// float32 epilogue. Compiled under a target pragma and reached only after
// cpu_isa() saw AVX512-VNNI (see vnni.cpp for why no library headers here).
#if defined(MIXBITS_HAVE_AVX2)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "qmatmul_int8/repack.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#include "common/x86_prefetch.h"
#include "qmatmul_int8/x86_load16.h"
#include "qmatmul_int8/x86_repacked_codes.h"

namespace mixbits {
namespace {

constexpr int R = kRepackRows;

// Split segments (3, 5, 6 bits; repack.h): per chunk of 32 codes, step
// (W, K)'s codes (split_code) times the x rows' quads.
template <int B, int MB, int A, class T, int W, int K>
inline void split_step(const __m512i (&cw)[B], const T* xq, int ldx, int64_t x0,
                       __m512i (&acc)[A][MB]) {
  constexpr int P = 4 / int(sizeof(T)), LB = split_low_bits(B), S = 8 * int(sizeof(T)) / LB;
  const __m512i c = split_code<B, T, W, K>(cw);
  constexpr int a = (W * S + K) % A;
  for (int m = 0; m < MB; ++m) {
    int32_t quad;
    std::memcpy(&quad, xq + int64_t(m) * ldx + x0 + W * (32 / LB) + K * P, 4);
    acc[a][m] = idot<T>(acc[a][m], c, _mm512_set1_epi32(quad));
  }
}

// Every step of a chunk, step t = shift t % S of low word t / S.
template <int B, int MB, int A, class T, int... t>
inline void split_chunk(const __m512i (&cw)[B], const T* xq, int ldx, int64_t x0,
                        __m512i (&acc)[A][MB], std::integer_sequence<int, t...>) {
  constexpr int S = 8 * int(sizeof(T)) / split_low_bits(B);
  (split_step<B, MB, A, T, t / S, t % S>(cw, xq, ldx, x0, acc), ...);
}

// Blocks [b0, b1) of one segment against MB activation rows.
template <int B, int G, int MB, class T>
void blocks(const RSeg& s, const RX& x, int b0, int b1, int N, float* y, int ldy) {
  constexpr int S = repack_splits(B) ? 1 : 8 * int(sizeof(T)) / B;  // shifts per word
  constexpr int CPW = 32 / B;                // codes per word
  constexpr int WG = G * B / 32;             // words per group
  // Independent accumulator chains to hide vpdpbusd latency (5 cycles)
  // where MB alone gives too few: A*MB <= 8 of the 32 zmm registers.
  constexpr int A = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
  // int8, 2 bits, where every chain holds one shift (A % S == 0): shift k's
  // codes are masked in place, 2^(2k) times the code (<= 192, still a
  // valid u8), and each chain's exact sum is shifted back once per group:
  // three of the word's four vector shifts saved, the same int32 sums.
  // 2-bit is compute-bound (four shifts per word): one thread, M=1, in
  // alternating runs 4096x4096 0.25-0.30 -> 0.17-0.27 ms, 11008x4096
  // 0.55-0.71 -> 0.41-0.46. 4-bit (one shift per word saved) showed no
  // consistent change and keeps the shifts.
  constexpr bool kInPlace = sizeof(T) == 1 && B == 2 && A % S == 0;
  const T* xq = static_cast<const T*>(x.xq);
  const int ng = s.ngroups;
  for (int b = b0; b < b1; ++b) {
    const uint32_t* wb = s.wq + int64_t(b) * s.words * R;
    const int64_t sb = int64_t(b) * ng * R;
    __m512 accf[MB];
    for (int m = 0; m < MB; ++m) accf[m] = _mm512_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      __m512i acc[A][MB];
      for (int a = 0; a < A; ++a)
        for (int m = 0; m < MB; ++m) acc[a][m] = _mm512_setzero_si512();
      if constexpr (repack_splits(B)) {
        // Steps per chunk: the low words' shifts.
        constexpr int SC = split_low_bits(B) * (8 * int(sizeof(T)) / split_low_bits(B));
#pragma GCC unroll 4
        for (int ch = 0; ch < G / 32; ++ch) {
          const int64_t q = int64_t(g) * (G / 32) + ch;  // chunk: words B*q .. B*q + B-1
          const uint32_t* wp = wb + B * q * R;
          __m512i cw[B];
          for (int i = 0; i < B; ++i) {
            prefetch_words<B>(wp + i * R);
            cw[i] = _mm512_loadu_si512((const void*)(wp + i * R));
          }
          split_chunk<B, MB, A, T>(cw, xq, x.ldx, q * 32, acc, std::make_integer_sequence<int, SC>{});
        }
      } else {
        // Words in runs of U, each run unrolled whole: the chain index a must
        // be a constant for acc to stay in registers (a group of 16 or 32
        // words unrolled 8 at a time left it a runtime value, and every dot
        // went through the stack: 8-bit g64 at 4 rows ran slower than at 8).
        constexpr int U = WG < 8 ? WG : 8;
        static_assert(WG % U == 0 && U * S % A == 0, "every run starts on chain 0");
        for (int j0 = 0; j0 < WG; j0 += U) {
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u) {
            const int j = g * WG + j0 + u;
            const __m512i w = _mm512_loadu_si512((const void*)(wb + int64_t(j) * R));
            prefetch_words<B>(wb + int64_t(j) * R);
#pragma GCC unroll 8
            for (int k = 0; k < S; ++k) {
              const __m512i c = kInPlace ? word_code_in_place<B>(w, k) : word_code<B, T>(w, k);
              const int a = (u * S + k) % A;
              for (int m = 0; m < MB; ++m) {
                int32_t quad;
                std::memcpy(&quad, xq + int64_t(m) * x.ldx + int64_t(j) * CPW + k * (4 / sizeof(T)), 4);
                acc[a][m] = idot<T>(acc[a][m], c, _mm512_set1_epi32(quad));
              }
            }
          }
        }
      }
      const __m512 s16 = load16_f32(s.scales, sb + int64_t(g) * R, s.sdt);
      const __m512 b16 = load16_f32(s.biases, sb + int64_t(g) * R, s.sdt);
      for (int m = 0; m < MB; ++m) {
        __m512i iq;
        if constexpr (kInPlace) {
          __m512i part[S];  // chain a holds shift a % S
          for (int k = 0; k < S; ++k) part[k] = acc[k][m];
          for (int a = S; a < A; ++a) part[a % S] = _mm512_add_epi32(part[a % S], acc[a][m]);
          iq = part[0];
          for (int k = 1; k < S; ++k) iq = _mm512_add_epi32(iq, _mm512_srai_epi32(part[k], k * B));
        } else {
          iq = acc[0][m];
          for (int a = 1; a < A; ++a) iq = _mm512_add_epi32(iq, acc[a][m]);
        }
        const __m512 sd = _mm512_mul_ps(s16, _mm512_set1_ps(x.d[int64_t(m) * x.ldg + g]));
        accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iq), sd, accf[m]);
        accf[m] = _mm512_fmadd_ps(b16, _mm512_set1_ps(x.xs[int64_t(m) * x.ldg + g]), accf[m]);
      }
    }
    // The last block may hold padding rows: store the real ones only.
    const int n0 = b * R, nreal = N - n0 < R ? N - n0 : R;
    const __mmask16 live = __mmask16((1u << nreal) - 1u);
    for (int m = 0; m < MB; ++m) {
      float* yp = y + int64_t(m) * ldy + n0;
      const __m512 old = _mm512_maskz_loadu_ps(live, yp);
      _mm512_mask_storeu_ps(yp, live, _mm512_add_ps(old, accf[m]));
    }
  }
}

template <int B, int G, class T>
void seg_kernel(const RSeg& s, const RX& x, int mb, int b0, int b1, int N, float* y, int ldy) {
  switch (mb) {
    case 1: return blocks<B, G, 1, T>(s, x, b0, b1, N, y, ldy);
    case 2: return blocks<B, G, 2, T>(s, x, b0, b1, N, y, ldy);
    case 3: return blocks<B, G, 3, T>(s, x, b0, b1, N, y, ldy);
    case 4: return blocks<B, G, 4, T>(s, x, b0, b1, N, y, ldy);
    case 5: return blocks<B, G, 5, T>(s, x, b0, b1, N, y, ldy);
    case 6: return blocks<B, G, 6, T>(s, x, b0, b1, N, y, ldy);
    case 7: return blocks<B, G, 7, T>(s, x, b0, b1, N, y, ldy);
    case 8: return blocks<B, G, 8, T>(s, x, b0, b1, N, y, ldy);
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

const RTable& repacked_int8_table_vnni() {
  static const RTable t = [] {
    RTable r = make_table<int8_t>();
    repacked_int8_gemm_vnni(r);
    return r;
  }();
  return t;
}
const RTable& repacked_int16_table_vnni() {
  static const RTable t = make_table<int16_t>();
  return t;
}

}  // namespace mixbits
#pragma GCC pop_options
#endif
