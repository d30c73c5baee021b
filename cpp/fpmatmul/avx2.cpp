// AVX2 + FMA + F16C kernel of the fp-mode matmul (kernel.h). The weights
// are decoded in registers: e2m1 by a permute of the group's 8 scaled
// magnitudes with the sign bit xor-ed in; e4m3 by moving its bits to
// float16 positions and widening them with F16C. Each output is
// sum over k in two 8-lane float32 accumulators (chunks of 16 columns: the
// first 8 in one, the last 8 in the other), then one fixed reduction: the
// same arithmetic on every path, so the result does not depend on M's path,
// the row blocking or the number of threads.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "common/x86_prefetch.h"
#include "fpmatmul/avx2_decode.h"
#include "fpmatmul/kernel.h"

namespace mixbits {

namespace {

// The one reduction of an output's two accumulators.
inline float reduce(__m256 a0, __m256 a1) {
  const __m256 s = _mm256_add_ps(a0, a1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Few rows of x (a decode step): each weight group is decoded in registers
// and multiplied into MB rows at once. (Two weight rows side by side, for
// more accumulator chains, measured slower at M = 1: register spills.)
template <FpMode MD, int MB>
void fused(const float* x, const FpView& w, float* y, int n0, int n1) {
  constexpr int G = fp_mode_group(MD);
  const int64_t K = w.K, groups = w.groups_per_row();
  for (int n = n0; n < n1; ++n) {
    const uint32_t* row = w.wq + int64_t(n) * w.words_per_row();
    const uint8_t* srow = w.scales + int64_t(n) * groups;
    __m256 a0[MB], a1[MB];
    for (int i = 0; i < MB; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 v[G / 8];
      decode_group<MD>(row, srow, g, v);
      for (int c = 0; c < G / 8; c += 2) {
        const int64_t k = g * G + 8 * c;
        for (int i = 0; i < MB; ++i) {
          a0[i] = _mm256_fmadd_ps(v[c], _mm256_loadu_ps(x + i * K + k), a0[i]);
          a1[i] = _mm256_fmadd_ps(v[c + 1], _mm256_loadu_ps(x + i * K + k + 8), a1[i]);
        }
      }
    }
    for (int i = 0; i < MB; ++i) y[int64_t(i) * w.N + n] = reduce(a0[i], a1[i]);
  }
}

// MR x rows times NR decoded weight rows (stride K in `buf`), each output
// summed as everywhere: a0 over the first 8 of every 16 columns, a1 over
// the last 8. 2 x 3 tiles keep 12 accumulators and two x vectors in the 16
// registers, with the weights read as memory operands: 10 loads per 12
// FMAs, where one x row against four weight rows takes 10 per 8.
template <int MR, int NR>
inline void tile(const float* const* xr, const float* const* wr, int64_t K, float (*out)[NR]) {
  __m256 a0[MR][NR], a1[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) a0[i][j] = a1[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(xr[i] + k);
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = _mm256_loadu_ps(wr[j] + k);
      for (int i = 0; i < MR; ++i) a0[i][j] = _mm256_fmadd_ps(wv, xv[i], a0[i][j]);
    }
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(xr[i] + k + 8);
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = _mm256_loadu_ps(wr[j] + k + 8);
      for (int i = 0; i < MR; ++i) a1[i][j] = _mm256_fmadd_ps(wv, xv[i], a1[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i][j] = reduce(a0[i][j], a1[i][j]);
}

// Many rows of x (a prompt): RB weight rows are decoded once into a float
// buffer, then multiplied with the x rows in 2 x 3 tiles (a last odd x row
// in 1 x 3); a short last group of weight rows repeats its last row and
// drops those outputs.
template <FpMode MD>
void buffered(const float* x, int M, const FpView& w, float* y, int n0, int n1) {
  constexpr int G = fp_mode_group(MD), RB = 12, NR = 3;
  const int64_t K = w.K, groups = w.groups_per_row();
  std::vector<float> buf(size_t(RB) * K);
  for (int nb = n0; nb < n1; nb += RB) {
    const int rows = std::min(RB, n1 - nb);
    for (int r = 0; r < rows; ++r) {
      const int n = nb + r;
      const uint32_t* row = w.wq + int64_t(n) * w.words_per_row();
      const uint8_t* srow = w.scales + int64_t(n) * groups;
      float* dst = buf.data() + int64_t(r) * K;
      for (int64_t g = 0; g < groups; ++g) {
        __m256 v[G / 8];
        decode_group<MD>(row, srow, g, v);
        for (int c = 0; c < G / 8; ++c) _mm256_storeu_ps(dst + g * G + 8 * c, v[c]);
      }
    }
    for (int r0 = 0; r0 < rows; r0 += NR) {
      const float* wr[NR];
      for (int j = 0; j < NR; ++j) wr[j] = buf.data() + int64_t(std::min(r0 + j, rows - 1)) * K;
      const int nr = std::min(NR, rows - r0);
      float out[2][NR];
      int m = 0;
      for (; m + 2 <= M; m += 2) {
        const float* xr[2] = {x + int64_t(m) * K, x + int64_t(m + 1) * K};
        tile<2, NR>(xr, wr, K, out);
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < nr; ++j) y[int64_t(m + i) * w.N + nb + r0 + j] = out[i][j];
      }
      if (m < M) {
        const float* xr[1] = {x + int64_t(m) * K};
        tile<1, NR>(xr, wr, K, out);
        for (int j = 0; j < nr; ++j) y[int64_t(m) * w.N + nb + r0 + j] = out[0][j];
      }
    }
  }
}

template <FpMode MD>
void run_mode(const float* x, int M, const FpView& w, float* y) {
  if (M > 4) {
    parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) { buffered<MD>(x, M, w, y, int(n0), int(n1)); });
    return;
  }
  parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: return fused<MD, 1>(x, w, y, int(n0), int(n1));
      case 2: return fused<MD, 2>(x, w, y, int(n0), int(n1));
      case 3: return fused<MD, 3>(x, w, y, int(n0), int(n1));
      default: return fused<MD, 4>(x, w, y, int(n0), int(n1));
    }
  });
}

}  // namespace

void fpm_avx2_run(const float* x, int M, const FpView& w, float* y) {
  if (M <= 0 || w.N <= 0) return;
  switch (w.mode) {
    case FpMode::Mxfp4: return run_mode<FpMode::Mxfp4>(x, M, w, y);
    case FpMode::Nvfp4: return run_mode<FpMode::Nvfp4>(x, M, w, y);
    case FpMode::Mxfp8: return run_mode<FpMode::Mxfp8>(x, M, w, y);
  }
}

}  // namespace mixbits
