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
// TN: A is stored transposed (element (r, p) at a[p * lda + r]) and the
// tile is added to C (the backward's C += A^T B); else C = A B.
template <int R, bool TN>
inline void tile16(const float* a, int64_t lda, const float* b, int64_t ldb,
                   float* c, int64_t ldc, int64_t k) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = TN ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
    acc[r][1] = TN ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b + p * ldb);
    const __m256 b1 = _mm256_loadu_ps(b + p * ldb + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(TN ? a + p * lda + r : a + r * lda + p);
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
// 8 lanes then scalar. Rare in practice (key counts are cut at 16, head
// dims are multiples of 16).
template <bool TN>
inline void cols_tail(const float* a, int64_t lda, const float* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = TN ? a + i : a + i * lda;
    const int64_t as = TN ? lda : 1;  // stride of row i of A along p
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 acc = TN ? _mm256_loadu_ps(c + i * ldc + j) : _mm256_setzero_ps();
      for (int64_t p = 0; p < k; ++p)
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(ai + p * as),
                              _mm256_loadu_ps(b + p * ldb + j), acc);
      _mm256_storeu_ps(c + i * ldc + j, acc);
    }
    for (; j < n; ++j) {
      float s = TN ? c[i * ldc + j] : 0.0f;
      for (int64_t p = 0; p < k; ++p) s += ai[p * as] * b[p * ldb + j];
      c[i * ldc + j] = s;
    }
  }
}

template <int R, bool TN>
inline void row_block(const float* a, int64_t lda, const float* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t n, int64_t k) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) tile16<R, TN>(a, lda, b + j, ldb, c + j, ldc, k);
  if (j < n) cols_tail<TN>(a, lda, b + j, ldb, c + j, ldc, R, n - j, k);
}

// Rows of C in blocks of 6; row i of A starts at a + i * lda (plain) or at
// a + i (TN: A's column i).
template <bool TN>
void gemm(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
          int64_t ldc, int64_t m, int64_t n, int64_t k) {
  const int64_t row_step = TN ? 1 : lda;
  int64_t i = 0;
  for (; i + 6 <= m; i += 6)
    row_block<6, TN>(a + i * row_step, lda, b, ldb, c + i * ldc, ldc, n, k);
  const float* ai = a + i * row_step;
  float* ci = c + i * ldc;
  switch (m - i) {
    case 5: row_block<5, TN>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 4: row_block<4, TN>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 3: row_block<3, TN>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 2: row_block<2, TN>(ai, lda, b, ldb, ci, ldc, n, k); break;
    case 1: row_block<1, TN>(ai, lda, b, ldb, ci, ldc, n, k); break;
    default: break;
  }
  _mm256_zeroupper();
}


// Scores for one query row against 4 key rows: four 8-lane dot products
// reduced together (two rounds of hadd, then the two 128-bit halves).
inline __m128 dot4(const float* a, const float* b, int64_t ldb, int64_t k) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  int64_t p = 0;
  for (; p + 8 <= k; p += 8) {
    const __m256 x = _mm256_loadu_ps(a + p);
    acc0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + p), acc0);
    acc1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + ldb + p), acc1);
    acc2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 2 * ldb + p), acc2);
    acc3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 3 * ldb + p), acc3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc0, acc1), _mm256_hadd_ps(acc2, acc3));
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  if (p < k) {  // head dims not a multiple of 8
    alignas(16) float t[4];
    _mm_store_ps(t, r);
    for (; p < k; ++p)
      for (int j = 0; j < 4; ++j) t[j] += a[p] * b[j * ldb + p];
    r = _mm_load_ps(t);
  }
  return r;
}

inline float dot1(const float* a, const float* b, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= k; p += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + p), _mm256_loadu_ps(b + p), acc);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  r = _mm_hadd_ps(r, r);
  r = _mm_hadd_ps(r, r);
  float s = _mm_cvtss_f32(r);
  for (; p < k; ++p) s += a[p] * b[p];
  return s;
}

}  // namespace

void attn_gemm_nt_avx2(const float* a, int64_t lda, const float* b, int64_t ldb,
                       float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)  // 4 key rows, read once from memory, for every query row
    for (int64_t i = 0; i < m; ++i)
      _mm_storeu_ps(c + i * ldc + j, dot4(a + i * lda, b + j * ldb, ldb, k));
  for (; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) c[i * ldc + j] = dot1(a + i * lda, b + j * ldb, k);
  _mm256_zeroupper();
}

void attn_gemm_avx2(const float* a, int64_t lda, const float* b, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  gemm<false>(a, lda, b, ldb, c, ldc, m, n, k);
}

void attn_gemm_tn_acc_avx2(const float* a, int64_t lda, const float* b,
                           int64_t ldb, float* c, int64_t ldc, int64_t m,
                           int64_t n, int64_t k) {
  gemm<true>(a, lda, b, ldb, c, ldc, m, n, k);
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
