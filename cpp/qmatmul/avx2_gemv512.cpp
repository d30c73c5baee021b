// Small M, 16-lane kernels for CPUs that also have AVX-512F (the AVX-512
// row of the table): the 8-lane file's scheme (avx2_gemv.cpp) with one
// unit's window in both halves of a register (load_unit2, extract_pair in
// avx2_decode.h), in passes of at most 4 x rows.
#include <vector>

#include "common/x86_prefetch.h"
#include "qmatmul/avx2_decode.h"
#include "qmatmul/avx2_table.h"

namespace mixbits {
namespace {

template <int B, int G, int MB, int R, int A>
MIXBITS_AVX512 void gemv_rows512(const SegView& s, DType sdt, const float* xq,
                                       const float* xs, int ldx, int n0, int n1,
                                       float* y, int ldy) {
  constexpr bool kScaleW = MB >= 2;  // as in gemv_rows
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
    __m512 tot[R][MB], acc[R][MB][A];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        tot[r][m] = _mm512_setzero_ps();
        for (int a = 0; a < A; ++a) acc[r][m][a] = _mm512_setzero_ps();
      }
    for (int g = 0; g < ngroups; ++g) {
      __m512 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm512_set1_ps(sc[r * ngroups + g]);
#pragma GCC unroll 4
      for (int u = 0; u < G / kUnit; ++u) {
        const int c = g * G + u * kUnit;
        const float* xp = xq + c;
        // Decode the unit of all R rows first, then each activation load
        // feeds R FMAs.
        __m512 v0[R], v1[R];
        for (int r = 0; r < R; ++r) {
          prefetch_row_unit<B>(rowp[r] + c * B / 8);
          const __m512i w2 = load_unit2<B>(rowp[r] + c * B / 8);
          v0[r] = extract_pair<B, 0>(w2);
          v1[r] = extract_pair<B, 1>(w2);
          if constexpr (kScaleW) {
            v0[r] = _mm512_mul_ps(v0[r], sv[r]);
            v1[r] = _mm512_mul_ps(v1[r], sv[r]);
          }
        }
        for (int m = 0; m < MB; ++m) {
          const __m512 x0 = _mm512_loadu_ps(xp + m * ldx);
          const __m512 x1 = _mm512_loadu_ps(xp + m * ldx + 16);
          for (int r = 0; r < R; ++r) {
            acc[r][m][0] = _mm512_fmadd_ps(v0[r], x0, acc[r][m][0]);
            acc[r][m][A - 1] = _mm512_fmadd_ps(v1[r], x1, acc[r][m][A - 1]);
          }
        }
      }
      if constexpr (!kScaleW) {
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < MB; ++m) {
            __m512 a = acc[r][m][0];
            if constexpr (A > 1) a = _mm512_add_ps(a, acc[r][m][1]);
            tot[r][m] = _mm512_fmadd_ps(a, sv[r], tot[r][m]);
            for (int i = 0; i < A; ++i) acc[r][m][i] = _mm512_setzero_ps();
          }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        __m512 t = tot[r][m];
        if constexpr (kScaleW) {
          t = acc[r][m][0];
          if constexpr (A > 1) t = _mm512_add_ps(t, acc[r][m][1]);
        }
        y[int64_t(m) * ldy + n + r] += _mm512_reduce_add_ps(t) +
                                       dot(bi + r * ngroups, xs + m * ngroups, ngroups);
      }
  }
}

template <int B, int G, int MB>
void gemv_mb512(const SegView& s, DType sdt, const float* xq, const float* xs,
                int ldx, int n0, int n1, float* y, int ldy) {
  // 32 registers hold R*MB*A accumulators, 2R decoded vectors and 2
  // activation vectors. Several W rows per pass so each activation load
  // (from L2 when MB rows of x exceed L1) feeds R FMAs.
  constexpr int R = MB <= 4 ? 4 : (MB <= 6 ? 3 : 2);
  constexpr int A = MB <= 2 ? 2 : 1;
  const int nfull = n0 + (n1 - n0) / R * R;
  gemv_rows512<B, G, MB, R, A>(s, sdt, xq, xs, ldx, n0, nfull, y, ldy);
  if (nfull < n1)  // same A: same summation order wherever a row falls
    gemv_rows512<B, G, MB, 1, A>(s, sdt, xq, xs, ldx, nfull, n1, y, ldy);
}

template <int B, int G>
void gemv_seg512(const SegView& s, DType sdt, const float* xq, const float* xs,
                 int ldx, int mb, int n0, int n1, float* y, int ldy) {
  switch (mb) {
#define MIXBITS_MB(V) \
  case V: return gemv_mb512<B, G, V>(s, sdt, xq, xs, ldx, n0, n1, y, ldy);
    MIXBITS_MB(1) MIXBITS_MB(2) MIXBITS_MB(3) MIXBITS_MB(4)
    MIXBITS_MB(5) MIXBITS_MB(6) MIXBITS_MB(7) MIXBITS_MB(8)
#undef MIXBITS_MB
  }
}

template <int B>
constexpr GemvFn gemv_col[3] = {gemv_seg512<B, 32>, gemv_seg512<B, 64>, gemv_seg512<B, 128>};

}  // namespace

extern const GemvCols kGemvAvx512 = {
    {}, {}, {gemv_col<2>[0], gemv_col<2>[1], gemv_col<2>[2]},
    {gemv_col<3>[0], gemv_col<3>[1], gemv_col<3>[2]},
    {gemv_col<4>[0], gemv_col<4>[1], gemv_col<4>[2]},
    {gemv_col<5>[0], gemv_col<5>[1], gemv_col<5>[2]},
    {gemv_col<6>[0], gemv_col<6>[1], gemv_col<6>[2]},
    {}, {gemv_col<8>[0], gemv_col<8>[1], gemv_col<8>[2]}};

}  // namespace mixbits
