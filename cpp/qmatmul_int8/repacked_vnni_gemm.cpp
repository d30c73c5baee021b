// The int8 contract's prefill GEMM on the row-interleaved layout (repack.h)
// with AVX512-VNNI: activations="int8-all" calls of many rows.
//
// The GEMV (repacked_vnni.cpp) decodes a block's words for every pass of 8
// x rows: at a prompt's hundreds of rows the shifts and masks cost as much
// as the dots. Here a block's codes are decoded once per K-chunk of kKC
// columns into an L1-resident buffer (kKC/4 vectors of 16 rows x 4 codes,
// in the order repacked_x_col put x in: vector v meets x quad v), with the
// chunk's scales and biases as float32, then every x row reuses them: per
// code vector, one load and one vpdpbusd per x row (MB rows share the
// load), per group and x row one convert and two FMAs for 16 W rows.
//
// Same numbers as the GEMV bit for bit: the integer dots are exact, and
// each row's float accumulator sees the same operations in the same order
// (per group: fma(float(iq), s*d, acc), then fma(b, xs, acc); per segment
// y += acc). The float accumulators of up to kMS rows live in a tile while
// the chunks go by.
//
// Off by default (repack.h, kRepackGemmMinM): on the Xeon this was
// written on it was no faster than the GEMV's passes, which already issue
// one vpdpbusd per 64 MACs and decode with one shift and one AND per 8 of
// them; set_repacked_gemm_min_m turns it on (tests, measurements).
//
// Compiled under a target pragma and reached only where cpu_isa() saw
// AVX512-VNNI; plain-data headers only (see table.h).
#if defined(MIXBITS_HAVE_AVX2)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "qmatmul_int8/repack.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#include "qmatmul_int8/x86_load16.h"
#include "qmatmul_int8/x86_repacked_codes.h"

namespace mixbits {
namespace {

using T = int8_t;
constexpr int R = kRepackRows;
// Columns per K-chunk: its codes (16 bytes per column: 8 KiB), and MB x
// rows' codes of it (4 KiB at 8 rows), stay in L1 while the rows go by.
constexpr int kKC = 512;
// x rows whose float accumulators a tile holds (4 KiB): the codes are
// decoded once per chunk and per kMS rows.
constexpr int kMS = 64;
// x rows per micro-kernel pass: 8 independent vpdpbusd chains (latency 5)
// and 8 float accumulators of the 32 zmm registers.
constexpr int kMB = 8;

// One K-chunk of a block, decoded.
struct Chunk {
  __m512i codes[kKC / 4];  // vector v: x columns 4v .. 4v+3 of the chunk
  __m512 sc[kKC / 32], bi[kKC / 32];  // per group of the chunk (G >= 32)
  // The words that follow this chunk's (the next chunk of the block, or
  // the next block's first: [NB, words, 16] is one stream), prefetched
  // while the x rows go by, so the next decode does not wait for memory
  // (at tens of rows the weight stream is what bounds the call).
  const char* next;
  int next_bytes_per_group;
};

// Groups [g0, g0 + gc) of block wb (its words), into c.codes.
template <int B, int G>
inline void decode(const uint32_t* wb, int g0, int gc, Chunk& c) {
  __m512i* out = c.codes;
  if constexpr (repack_splits(B)) {
    // Per chunk of 32 codes: B words, 8 steps (split_code), as the GEMV.
    constexpr int S = 8 / split_low_bits(B);
    const int q0 = g0 * (G / 32), q1 = (g0 + gc) * (G / 32);
    for (int q = q0; q < q1; ++q) {
      const uint32_t* wp = wb + int64_t(B) * q * R;
      __m512i cw[B];
      for (int i = 0; i < B; ++i) cw[i] = _mm512_loadu_si512((const void*)(wp + i * R));
      [&]<int... t>(std::integer_sequence<int, t...>) {
        ((*out++ = split_code<B, T, t / S, t % S>(cw)), ...);
      }(std::make_integer_sequence<int, split_low_bits(B) * S>{});
    }
  } else {
    constexpr int S = 8 / B, WG = G * B / 32;  // shifts per word, words per group
    const int j0 = g0 * WG, j1 = (g0 + gc) * WG;
    for (int j = j0; j < j1; ++j) {
      const __m512i w = _mm512_loadu_si512((const void*)(wb + int64_t(j) * R));
#pragma GCC unroll 8
      for (int k = 0; k < S; ++k) *out++ = word_code<B, T>(w, k);
    }
  }
}

// MB x rows (x codes of the chunk at xq, row m at xq + m * ldx; d and xs of
// the chunk's groups at d, xs, row m at + m * ldg) against a decoded chunk
// of gc groups; tile rows m hold the rows' float accumulators.
template <int G, int MB>
__attribute__((always_inline)) inline void rows(const Chunk& c, int gc, const T* xq, int ldx, const float* d, const float* xs,
                 int ldg, __m512* tile, bool prefetch) {
  constexpr int VG = G / 4;  // code vectors per group
  __m512 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = tile[m];
  for (int g = 0; g < gc; ++g) {
    __m512i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_si512();
    const __m512i* cv = c.codes + g * VG;
    const T* xg = xq + g * G;
    if (prefetch)
      for (int l = 0; l < c.next_bytes_per_group; l += 64)
        _mm_prefetch(c.next + g * c.next_bytes_per_group + l, _MM_HINT_T0);
#pragma GCC unroll 2
    for (int v = 0; v < VG; ++v) {
      const __m512i w = _mm512_load_si512((const void*)(cv + v));
      for (int m = 0; m < MB; ++m) {
        int32_t quad;
        std::memcpy(&quad, xg + int64_t(m) * ldx + 4 * v, 4);
        acc[m] = _mm512_dpbusd_epi32(acc[m], w, _mm512_set1_epi32(quad));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 sd = _mm512_mul_ps(c.sc[g], _mm512_set1_ps(d[int64_t(m) * ldg + g]));
      accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), sd, accf[m]);
      accf[m] = _mm512_fmadd_ps(c.bi[g], _mm512_set1_ps(xs[int64_t(m) * ldg + g]), accf[m]);
    }
  }
  for (int m = 0; m < MB; ++m) tile[m] = accf[m];
}

// Rows [m0, m1) of the tile's kMS: passes of 8, then 4, 2, 1 for the rest.
template <int G>
inline void tile_rows(const Chunk& c, int gc, const RX& x, int64_t col0, int g0, int m0, int m1,
                      __m512* tile) {
  auto pass = [&]<int MB>(int m) {
    rows<G, MB>(c, gc, static_cast<const T*>(x.xq) + int64_t(m) * x.ldx + col0, x.ldx,
                x.d + int64_t(m) * x.ldg + g0, x.xs + int64_t(m) * x.ldg + g0, x.ldg,
                tile + (m - m0), m == m0);
  };
  int m = m0;
  for (; m + kMB <= m1; m += kMB) pass.template operator()<kMB>(m);
  if (m + 4 <= m1) pass.template operator()<4>(m), m += 4;
  if (m + 2 <= m1) pass.template operator()<2>(m), m += 2;
  if (m < m1) pass.template operator()<1>(m);
}

// The RFn of the table: y[m * ldy + n] += the segment's contribution for
// all mb rows and the real rows of blocks [b0, b1).
template <int B, int G>
void gemm(const RSeg& s, const RX& x, int mb, int b0, int b1, int N, float* y, int ldy) {
  constexpr int KG = kKC / G;  // groups per chunk
  const int ng = s.ngroups;
  alignas(64) Chunk c;
  alignas(64) __m512 tile[kMS];
  for (int b = b0; b < b1; ++b) {
    const uint32_t* wb = s.wq + int64_t(b) * s.words * R;
    const int64_t sb = int64_t(b) * ng * R;
    const int n0 = b * R, nreal = N - n0 < R ? N - n0 : R;
    const __mmask16 live = __mmask16((1u << nreal) - 1u);
    for (int ms = 0; ms < mb; ms += kMS) {
      const int me = mb - ms < kMS ? mb : ms + kMS;
      for (int m = ms; m < me; ++m) tile[m - ms] = _mm512_setzero_ps();
      for (int g0 = 0; g0 < ng; g0 += KG) {
        const int gc = ng - g0 < KG ? ng - g0 : KG;
        decode<B, G>(wb, g0, gc, c);
        c.next = reinterpret_cast<const char*>(wb + int64_t(g0 + gc) * (G * B / 32) * R);
        c.next_bytes_per_group = G * B / 32 * R * 4;
        for (int g = 0; g < gc; ++g) {
          c.sc[g] = load16_f32(s.scales, sb + int64_t(g0 + g) * R, s.sdt);
          c.bi[g] = load16_f32(s.biases, sb + int64_t(g0 + g) * R, s.sdt);
        }
        tile_rows<G>(c, gc, x, int64_t(g0) * G, g0, ms, me, tile);
      }
      // The last block may hold padding rows: store the real ones only.
      for (int m = ms; m < me; ++m) {
        float* yp = y + int64_t(m) * ldy + n0;
        const __m512 old = _mm512_maskz_loadu_ps(live, yp);
        _mm512_mask_storeu_ps(yp, live, _mm512_add_ps(old, tile[m - ms]));
      }
    }
  }
}

}  // namespace

void repacked_int8_gemm_vnni(RTable& t) {
#define MIXBITS_G_ROW(B) t.gemm[B][0] = gemm<B, 32>; t.gemm[B][1] = gemm<B, 64>; t.gemm[B][2] = gemm<B, 128>;
  MIXBITS_G_ROW(2) MIXBITS_G_ROW(3) MIXBITS_G_ROW(4) MIXBITS_G_ROW(5) MIXBITS_G_ROW(6)
  MIXBITS_G_ROW(8)
#undef MIXBITS_G_ROW
  t.gemm_min_m = kRepackGemmMinM;
}

}  // namespace mixbits
#pragma GCC pop_options
#endif
