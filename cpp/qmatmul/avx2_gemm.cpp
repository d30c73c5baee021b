// Row-major dequantized tiles of W (s*q + b) and register-blocked dot-
// product micro-kernels (4x3 with 8 lanes, 6x4 with 16): the transposed
// product (avx2_t.cpp) runs on both; the forward GEMM (avx2_panel.cpp)
// packs its panels from dequant_tile.
#include "common/x86_prefetch.h"
#include "qmatmul/avx2_decode.h"
#include "qmatmul/avx2_table.h"

namespace mixbits {
namespace {

// Rows ahead dequant_tile prefetches: packers call it for 8 or 16 rows.
constexpr int kPrefetchRows = 8;

// Dequantizes rows [n, n+nr) x columns [c0, c1) (group-aligned) of one
// segment into dst (row stride ld), in decode order: w = s*q + b.
template <int B, int G>
void dequant_tile(const SegView& s, DType sdt, int n, int nr, int c0, int c1,
                  float* dst, int ld) {
  static constexpr UnitScale<B> us{};
  const int ngroups = s.k / G;
  const int64_t row_bytes = int64_t(s.k) * B / 8;
  const int g0 = c0 / G, g1 = c1 / G;
  float sc[kKC / 32], bi[kKC / 32];
  const int64_t span0 = int64_t(c0) * B / 8, span = int64_t(c1 - c0) * B / 8;
  for (int r = 0; r < nr; ++r) {
    const uint8_t* rowp =
        reinterpret_cast<const uint8_t*>(s.wq) + int64_t(n + r) * row_bytes;
    // The same span kPrefetchRows rows below: read by this call or the
    // next. Past the last row it prefetches nothing useful, and an x86
    // prefetch never faults.
    prefetch_span(rowp + kPrefetchRows * row_bytes + span0, span);
    to_f32(s.scales, int64_t(n + r) * ngroups + g0, g1 - g0, sdt, sc);
    to_f32(s.biases, int64_t(n + r) * ngroups + g0, g1 - g0, sdt, bi);
    float* d = dst + int64_t(r) * ld - c0;
    for (int g = g0; g < g1; ++g) {
      const __m256 sv = _mm256_set1_ps(sc[g - g0]);
      const __m256 bv = _mm256_set1_ps(bi[g - g0]);
      const __m256 s0 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 0));
      const __m256 s1 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 8));
      const __m256 s2 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 16));
      const __m256 s3 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 24));
      for (int u = 0; u < G / kUnit; ++u) {
        const int c = g * G + u * kUnit;
        const __m256i win = load_unit<B>(rowp + c * B / 8);
        _mm256_storeu_ps(d + c + 0, _mm256_fmadd_ps(extract<B, 0>(win), s0, bv));
        _mm256_storeu_ps(d + c + 8, _mm256_fmadd_ps(extract<B, 1>(win), s1, bv));
        _mm256_storeu_ps(d + c + 16, _mm256_fmadd_ps(extract<B, 2>(win), s2, bv));
        _mm256_storeu_ps(d + c + 24, _mm256_fmadd_ps(extract<B, 3>(win), s3, bv));
      }
    }
  }
}

// y[i, j] += sum_p x[i, p] * w[j, p] for an MR x NR block, lanes along p.
template <int MR, int NR>
void micro(const float* x, int ldx, const float* w, int ldw, int kc, float* y,
           int ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int p = 0; p < kc; p += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] += hsum(acc[i][j]);
}

// The same micro-kernel with 16-lane registers, for the AVX-512 row. 32
// registers allow a 6x4 block: 24 accumulators, 10 loads per 24 FMAs.
template <int MR, int NR>
MIXBITS_AVX512 void micro512(const float* x, int ldx, const float* w, int ldw,
                             int kc, float* y, int ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int p = 0; p < kc; p += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  // Four sums at once: fold to 8 lanes, then a horizontal-add tree. Tails
  // (NR < 4) run the same tree on zeros, so every output is summed in the
  // same order whatever block it falls in (threaded == single-thread).
  for (int i = 0; i < MR; ++i) {
    __m256 h[4];
    for (int j = 0; j < 4; ++j)
      h[j] = j < NR ? _mm256_add_ps(_mm512_castps512_ps256(acc[i][j]),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                        _mm512_castps_pd(acc[i][j]), 1)))
                    : _mm256_setzero_ps();
    const __m256 t =
        _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    if constexpr (NR == 4) {
      _mm_storeu_ps(y + i * ldy, _mm_add_ps(_mm_loadu_ps(y + i * ldy), s4));
    } else {
      alignas(16) float r[4];
      _mm_store_ps(r, s4);
      for (int j = 0; j < NR; ++j) y[i * ldy + j] += r[j];
    }
  }
}

template <int B>
constexpr DequantFn dequant_col[3] = {dequant_tile<B, 32>, dequant_tile<B, 64>,
                                      dequant_tile<B, 128>};
template <int MR>
constexpr MicroFn micro_row[4] = {nullptr, micro<MR, 1>, micro<MR, 2>, micro<MR, 3>};
template <int MR>
constexpr MicroFn micro512_row[5] = {nullptr, micro512<MR, 1>, micro512<MR, 2>,
                                     micro512<MR, 3>, micro512<MR, 4>};

}  // namespace

extern const DequantCols kDequantAvx2 = {
    {}, {}, {dequant_col<2>[0], dequant_col<2>[1], dequant_col<2>[2]},
    {dequant_col<3>[0], dequant_col<3>[1], dequant_col<3>[2]},
    {dequant_col<4>[0], dequant_col<4>[1], dequant_col<4>[2]},
    {dequant_col<5>[0], dequant_col<5>[1], dequant_col<5>[2]},
    {dequant_col<6>[0], dequant_col<6>[1], dequant_col<6>[2]},
    {}, {dequant_col<8>[0], dequant_col<8>[1], dequant_col<8>[2]}};

extern const MicroFn* const kMicroAvx2[5] = {nullptr, micro_row<1>, micro_row<2>,
                                             micro_row<3>, micro_row<4>};
extern const MicroFn* const kMicroAvx512[7] = {
    nullptr,          micro512_row<1>, micro512_row<2>, micro512_row<3>,
    micro512_row<4>, micro512_row<5>, micro512_row<6>};

}  // namespace mixbits
