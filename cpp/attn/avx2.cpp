// AVX2 + FMA attention kernels. Compiled with -mavx2 -mfma and reached only
// after a CPUID check (dispatch.cpp). Every exit runs vzeroupper: the
// callers are plain SSE code and would otherwise pay the AVX-SSE
// transition penalty.
#include <immintrin.h>

#include "attn/kernel.h"

namespace mixbits {

void kl_exp_avx2(const float* x, float* y, int64_t n);  // kl/avx2.cpp

namespace {

// A 6 x 16 tile of C: 12 ymm accumulators + 2 for the B row + 1 broadcast
// fit the 16 registers, and each k step issues 12 FMAs for 2 loads, so the
// loop is FMA-bound instead of load-bound.
template <int R>
inline void tile16(const float* a, int64_t lda, const float* b, int64_t ldb,
                   float* c, int64_t ldc, int64_t k) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b + p * ldb);
    const __m256 b1 = _mm256_loadu_ps(b + p * ldb + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + p);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

// Columns left over after the 16-wide tiles (n % 16): one row at a time,
// 8 lanes then scalar. Rare in practice (key counts are cut at 16).
inline void cols_tail(const float* a, int64_t lda, const float* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t p = 0; p < k; ++p)
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(a + i * lda + p),
                              _mm256_loadu_ps(b + p * ldb + j), acc);
      _mm256_storeu_ps(c + i * ldc + j, acc);
    }
    for (; j < n; ++j) {
      float s = 0;
      for (int64_t p = 0; p < k; ++p) s += a[i * lda + p] * b[p * ldb + j];
      c[i * ldc + j] = s;
    }
  }
}

template <int R>
inline void row_block(const float* a, int64_t lda, const float* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t n, int64_t k) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) tile16<R>(a, lda, b + j, ldb, c + j, ldc, k);
  if (j < n) cols_tail(a, lda, b + j, ldb, c + j, ldc, R, n - j, k);
}

}  // namespace

void attn_gemm_avx2(const float* a, int64_t lda, const float* b, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  int64_t i = 0;
  for (; i + 6 <= m; i += 6) row_block<6>(a + i * lda, lda, b, ldb, c + i * ldc, ldc, n, k);
  const float* ai = a + i * lda;
  float* ci = c + i * ldc;
  switch (m - i) {
    case 5: row_block<5>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 4: row_block<4>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 3: row_block<3>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 2: row_block<2>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 1: row_block<1>(ai, lda, b, ldb, ci, ldc, n, k); break;
    default: break;
  }
  _mm256_zeroupper();
}

float attn_exp_row_avx2(float* x, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_loadu_ps(x + i), m));
  for (; i < n; ++i) x[i] -= max;
  kl_exp_avx2(x, x, n);  // the KL kernel's vector exp, elementwise in place
  __m256 s = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float total = 0;
  for (float v : lanes) total += v;
  for (; i < n; ++i) total += x[i];
  _mm256_zeroupper();
  return total;
}

}  // namespace mixbits
