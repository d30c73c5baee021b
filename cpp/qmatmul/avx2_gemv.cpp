// Small M (batch-1 and decoding), 8-lane AVX2 kernels: every weight is
// decoded once into a vector of floats and FMA'd against up to 8 activation
// rows; the affine bias is folded, y = sum_g s_g * (sum q x) + b_g * (sum x),
// with sum x per group computed once per call by the driver (avx2.cpp).
#include <algorithm>
#include <vector>

#include "common/x86_prefetch.h"
#include "qmatmul/avx2_decode.h"
#include "qmatmul/avx2_table.h"

namespace mixbits {
namespace {

// Rows [n0, n1) (a multiple of R) of one segment against MB activation
// rows; adds into y (row stride ldy). A accumulators per (row, x-row) keep
// enough independent FMA chains in flight when R*MB is small.
//
// With one activation row the group scale is applied to the per-group sum
// (one FMA per group, the decode stays and+cvt+fma per 8 weights). With
// several rows, a per-group accumulator for each would not fit in the 16
// registers, so the decoded weights are multiplied by the scale once and
// then reused for all rows (one extra multiply shared by MB FMAs).
template <int B, int G, int MB, int R, int A>
void gemv_rows(const SegView& s, DType sdt, const float* xq, const float* xs,
               int ldx, int n0, int n1, float* y, int ldy) {
  constexpr bool kScaleW = MB >= 2;
  const int ngroups = s.k / G;
  const int64_t row_bytes = int64_t(s.k) * B / 8;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(2) * R * ngroups);
  float* sc = scratch.data();
  float* bi = sc + size_t(R) * ngroups;
  for (int n = n0; n < n1; n += R) {
    const uint8_t* rowp[R];
    for (int r = 0; r < R; ++r)
      rowp[r] = reinterpret_cast<const uint8_t*>(s.wq) + int64_t(n + r) * row_bytes;
    // R consecutive rows of scales (biases) are contiguous: one conversion.
    to_f32(s.scales, int64_t(n) * ngroups, R * ngroups, sdt, sc);
    to_f32(s.biases, int64_t(n) * ngroups, R * ngroups, sdt, bi);
    __m256 tot[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_setzero_ps();
    __m256 acc[R][MB][A];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m)
        for (int a = 0; a < A; ++a) acc[r][m][a] = _mm256_setzero_ps();
    for (int g = 0; g < ngroups; ++g) {
      __m256 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm256_broadcast_ss(sc + r * ngroups + g);
#pragma GCC unroll 4
      for (int u = 0; u < G / kUnit; ++u) {
        const int c = g * G + u * kUnit;
        const float* xp = xq + c;
        for (int r = 0; r < R; ++r) {
          prefetch_row_unit<B>(rowp[r] + c * B / 8);
          const __m256i win = load_unit<B>(rowp[r] + c * B / 8);
          auto step = [&]<int K>() {
            __m256 wf = extract<B, K>(win);
            if constexpr (kScaleW) wf = _mm256_mul_ps(wf, sv[r]);
            for (int m = 0; m < MB; ++m)
              acc[r][m][K % A] = _mm256_fmadd_ps(
                  wf, _mm256_loadu_ps(xp + m * ldx + 8 * K), acc[r][m][K % A]);
          };
          step.template operator()<0>();
          step.template operator()<1>();
          step.template operator()<2>();
          step.template operator()<3>();
        }
      }
      if constexpr (!kScaleW) {
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < MB; ++m) {
            __m256 a = acc[r][m][0];
            if constexpr (A > 1) a = _mm256_add_ps(a, acc[r][m][1]);
            tot[r][m] = _mm256_fmadd_ps(a, sv[r], tot[r][m]);
            for (int i = 0; i < A; ++i) acc[r][m][i] = _mm256_setzero_ps();
          }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        __m256 t = tot[r][m];
        if constexpr (kScaleW) {
          t = acc[r][m][0];
          if constexpr (A > 1) t = _mm256_add_ps(t, acc[r][m][1]);
        }
        y[int64_t(m) * ldy + n + r] +=
            hsum(t) + dot(bi + r * ngroups, xs + m * ngroups, ngroups);
      }
  }
}

// Rows of W stream start to end, what the hardware prefetcher likes best.
// (Walking the segment in column blocks so that the MB rows of x stay in
// L1 was measured slower here, even with software prefetch of the next
// rows: the short strided runs of W cost more than x coming from L2.)
template <int B, int G, int MB>
void gemv_mb(const SegView& s, DType sdt, const float* xq, const float* xs,
             int ldx, int n0, int n1, float* y, int ldy) {
  constexpr int R = MB == 1 ? 4 : (MB <= 3 ? 2 : 1);
  constexpr int A = R * MB <= 4 ? 2 : 1;
  const int nfull = n0 + (n1 - n0) / R * R;
  gemv_rows<B, G, MB, R, A>(s, sdt, xq, xs, ldx, n0, nfull, y, ldy);
  if (nfull < n1)
    // Same A as the main rows: same summation order wherever a row falls.
    gemv_rows<B, G, MB, 1, A>(s, sdt, xq, xs, ldx, nfull, n1, y, ldy);
}

template <int B, int G>
void gemv_seg(const SegView& s, DType sdt, const float* xq, const float* xs,
              int ldx, int mb, int n0, int n1, float* y, int ldy) {
  switch (mb) {
#define MIXBITS_MB(V) \
  case V: return gemv_mb<B, G, V>(s, sdt, xq, xs, ldx, n0, n1, y, ldy);
    MIXBITS_MB(1) MIXBITS_MB(2) MIXBITS_MB(3) MIXBITS_MB(4)
    MIXBITS_MB(5) MIXBITS_MB(6) MIXBITS_MB(7) MIXBITS_MB(8)
#undef MIXBITS_MB
  }
}

template <int B>
constexpr GemvFn gemv_col[3] = {gemv_seg<B, 32>, gemv_seg<B, 64>, gemv_seg<B, 128>};

}  // namespace

extern const GemvCols kGemvAvx2 = {
    {}, {}, {gemv_col<2>[0], gemv_col<2>[1], gemv_col<2>[2]},
    {gemv_col<3>[0], gemv_col<3>[1], gemv_col<3>[2]},
    {gemv_col<4>[0], gemv_col<4>[1], gemv_col<4>[2]},
    {gemv_col<5>[0], gemv_col<5>[1], gemv_col<5>[2]},
    {gemv_col<6>[0], gemv_col<6>[1], gemv_col<6>[2]},
    {}, {gemv_col<8>[0], gemv_col<8>[1], gemv_col<8>[2]}};

}  // namespace mixbits
