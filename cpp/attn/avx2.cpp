// AVX2 + FMA attention kernels. Compiled with -mavx2 -mfma -mf16c and
// reached only after a CPUID check (dispatch.cpp). Every exit runs
// vzeroupper: the callers are plain SSE code and would otherwise pay the
// AVX-SSE transition penalty.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attn/gemm_chunks.h"
#include "attn/kernel.h"
#include "common/x86_half.h"
#include "common/x86_prefetch.h"

namespace mixbits {

void kl_exp_avx2(const float* x, float* y, int64_t n);  // kl/avx2.cpp

namespace {

// B's element types: float32 as stored, float16 / bfloat16 widened exactly
// as they are loaded, so the products and sums are those of a widened copy
// (the scalar tails too: gemm_chunks.h's attn_fma_tail).
struct F32 {
  using T = float;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float load1(const float* p) { return *p; }
};
struct F16 {
  using T = uint16_t;
  static __m256 load8(const uint16_t* p) { return load8_f32(p, 0, DType::f16); }
  static float load1(const uint16_t* p) { return _cvtsh_ss(*p); }
};
struct BF16 {
  using T = uint16_t;
  static __m256 load8(const uint16_t* p) { return load8_f32(p, 0, DType::bf16); }
  static float load1(const uint16_t* p) { return bf16_to_f32(*p); }
};

// What a loop over the rows of B prefetches: rows below `rows` (counted from
// its b; 0: none), `ahead` rows on from the one it reads: the x86 kernels'
// distance (common/x86_prefetch.h) in rows, at least 4. In rows of a fixed
// count, a 128-dim float32 cache was never prefetched below 132 keys.
struct Ahead {
  int64_t rows = 0, ahead = 0;
};
inline int64_t rows_ahead(int64_t ldb, size_t elem) {
  return std::max<int64_t>(4, (kPrefetchAhead / int64_t(elem) + ldb - 1) / std::max<int64_t>(ldb, 1));
}

// An R x 8V tile of C. At 6 x 16: 12 ymm accumulators + 2 for the B row +
// 1 broadcast fit the 16 registers, and each k step issues 12 FMAs for 2
// loads, so the loop is FMA-bound instead of load-bound. Float32 blocks of
// 1 or 2 rows (a decode step's P V with 1 or 2 query heads per KV head)
// take 32 columns: 4 or 8 FMA chains instead of 2 or 4, where a 4-cycle FMA
// at 2 a cycle needs 8 (at 2 rows, 16 columns, P V was half of a decode
// call). Half-precision B keeps 16: with its converts, 32 columns measured
// 5-15% slower (16/8 heads, d 128, 512-2048 keys, alternating processes).
// TN: A is stored transposed (element (r, p) at a[p * lda + r]) and the
// tile is added to C (the backward's C += A^T B); else C = A B.
// `add`: the tile is added to C (TN, or a later chunk of k); else C = the
// product. Each step prefetches the tile's lines of B `pf.ahead` rows on.
template <int R, int V, bool TN, class E>
inline void tile(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                 float* c, int64_t ldc, int64_t k, bool add, Ahead pf) {
  constexpr int kLineElems = 64 / int(sizeof(typename E::T));
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = add ? _mm256_loadu_ps(c + r * ldc + 8 * v) : _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    if (p + pf.ahead < pf.rows)
      for (int o = 0; o < 8 * V; o += kLineElems)
        _mm_prefetch((const char*)(b + (p + pf.ahead) * ldb + o), _MM_HINT_T1);
    __m256 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = E::load8(b + p * ldb + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(TN ? a + p * lda + r : a + r * lda + p);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(x, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);
}

// Columns left over after the 16-wide tiles (n % 16): one row at a time,
// 8 lanes then scalar. Rare in practice (key counts are cut at 16, head
// dims are multiples of 16).
template <bool TN, class E>
inline void cols_tail(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, bool add) {
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = TN ? a + i : a + i * lda;
    const int64_t as = TN ? lda : 1;  // stride of row i of A along p
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 acc = add ? _mm256_loadu_ps(c + i * ldc + j) : _mm256_setzero_ps();
      for (int64_t p = 0; p < k; ++p)
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(ai + p * as),
                              E::load8(b + p * ldb + j), acc);
      _mm256_storeu_ps(c + i * ldc + j, acc);
    }
    for (; j < n; ++j)
      c[i * ldc + j] = attn_fma_tail<E>(ai, as, b + j, ldb, 0, k, add ? c[i * ldc + j] : 0.0f);
  }
}

template <int R, bool TN, class E>
inline void row_block(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t n, int64_t k, bool add, Ahead pf) {
  int64_t j = 0;
  if constexpr (R <= 2 && std::is_same_v<E, F32>)
    for (; j + 32 <= n; j += 32) tile<R, 4, TN, E>(a, lda, b + j, ldb, c + j, ldc, k, add, pf);
  for (; j + 16 <= n; j += 16) tile<R, 2, TN, E>(a, lda, b + j, ldb, c + j, ldc, k, add, pf);
  if (j < n) cols_tail<TN, E>(a, lda, b + j, ldb, c + j, ldc, R, n - j, k, add);
}

// Chunks of k and blocks of rows as gemm_chunks.h; the first block of rows
// of each chunk prefetches the rows of B ahead for all (row i of A starts
// at a + i * lda, or at a + i for TN: A's column i).
template <bool TN, class E>
void gemm(const float* a, int64_t lda, const typename E::T* b, int64_t ldb, float* c,
          int64_t ldc, int64_t m, int64_t n, int64_t k) {
  const int64_t ahead = rows_ahead(ldb, sizeof(typename E::T));
  attn_gemm_chunks<TN>(a, lda, b, ldb, c, ldc, m, k,
                       [&](auto R, const float* ai, const typename E::T* bp, float* ci, int64_t kc,
                           int64_t p0, int64_t i, bool add) {
                         const Ahead pf = i == 0 ? Ahead{k - p0, ahead} : Ahead{};
                         row_block<decltype(R)::value, TN, E>(ai, lda, bp, ldb, ci, ldc, n, kc, add, pf);
                       });
  _mm256_zeroupper();
}

// Four 8-lane partial dot products reduced to one __m128 of 4 scores (two
// rounds of hadd, then the two 128-bit halves); the k % 8 tail of a head
// dim that is not a multiple of 8 is added after, in order.
template <class E>
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, const float* a,
                      const typename E::T* b, int64_t ldb, int64_t p, int64_t k) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  if (p < k) {
    alignas(16) float t[4];
    _mm_store_ps(t, r);
    for (int j = 0; j < 4; ++j) t[j] = attn_fma_tail<E>(a, 1, b + j * ldb, 1, p, k, t[j]);
    r = _mm_load_ps(t);
  }
  return r;
}

// Scores of R query rows (rows of A, lda apart) against 4 key rows (B): the
// 4R dot products run side by side, so each key vector is loaded once for
// all R rows and the 4R accumulators (12 at R = 3) are independent FMA
// chains. One row at a time (4 chains for a 4-cycle FMA) left the loop
// latency-bound: 40% of a decode attention call at 2000 keys.
// `pf`: 4 rows to prefetch into L2, one line per row per 64 bytes (null: none).
template <int R, class E>
inline void nt_rows4(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                     float* c, int64_t ldc, int64_t k, const typename E::T* pf) {
  constexpr int64_t kLine = 64 / sizeof(typename E::T);
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= k; p += 8) {
    if (pf && p % kLine == 0)
      for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(pf + j * ldb + p), _MM_HINT_T1);
    const __m256 b0 = E::load8(b + p), b1 = E::load8(b + ldb + p),
                 b2 = E::load8(b + 2 * ldb + p), b3 = E::load8(b + 3 * ldb + p);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_loadu_ps(a + r * lda + p);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(x, b2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(x, b3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm_storeu_ps(c + r * ldc,
                  reduce4<E>(acc[r][0], acc[r][1], acc[r][2], acc[r][3], a + r * lda, b, ldb, p, k));
}

template <class E>
inline float dot1(const float* a, const typename E::T* b, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= k; p += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + p), E::load8(b + p), acc);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  r = _mm_hadd_ps(r, r);
  r = _mm_hadd_ps(r, r);
  float s = _mm_cvtss_f32(r);
  return attn_fma_tail<E>(a, 1, b, 1, p, k, s);
}

// The key rows rows_ahead on are prefetched by the first block of query
// rows: decode reads a cold cache, which the hardware prefetcher alone
// streamed at about 10 GB/s here.
template <class E>
void gemm_nt(const float* a, int64_t lda, const typename E::T* b, int64_t ldb, float* c,
             int64_t ldc, int64_t m, int64_t n, int64_t k) {
  using T = typename E::T;
  const int64_t ahead = (rows_ahead(ldb, sizeof(T)) + 3) / 4 * 4;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // 4 key rows, read once from memory, for every query row
    const T* bj = b + j * ldb;
    const T* pf = j + ahead + 4 <= n ? bj + ahead * ldb : nullptr;
    float* cj = c + j;
    int64_t i = 0;
    for (; i + 3 <= m; i += 3, pf = nullptr)
      nt_rows4<3, E>(a + i * lda, lda, bj, ldb, cj + i * ldc, ldc, k, pf);
    if (m - i == 2) nt_rows4<2, E>(a + i * lda, lda, bj, ldb, cj + i * ldc, ldc, k, pf);
    if (m - i == 1) nt_rows4<1, E>(a + i * lda, lda, bj, ldb, cj + i * ldc, ldc, k, pf);
  }
  for (; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) c[i * ldc + j] = dot1<E>(a + i * lda, b + j * ldb, k);
  _mm256_zeroupper();
}

}  // namespace

void attn_gemm_nt_avx2(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                       float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  with_b_type<F32, F16, BF16>(b, bt, [&](auto e, auto bp) { gemm_nt<decltype(e)>(a, lda, bp, ldb, c, ldc, m, n, k); });
}

void attn_gemm_avx2(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  with_b_type<F32, F16, BF16>(b, bt, [&](auto e, auto bp) { gemm<false, decltype(e)>(a, lda, bp, ldb, c, ldc, m, n, k); });
}

void attn_gemm_tn_acc_avx2(const float* a, int64_t lda, const float* b,
                           int64_t ldb, float* c, int64_t ldc, int64_t m,
                           int64_t n, int64_t k) {
  gemm<true, F32>(a, lda, b, ldb, c, ldc, m, n, k);
}

// The KL kernel's exp maps NaN to 0 (its masked lanes), which dropped a
// NaN score from the softmax and gave a finite row where MLX gives NaN;
// the subtraction pass notes any NaN, and the row's sum is then NaN.
float attn_exp_row_avx2(float* x, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), m);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
    _mm256_storeu_ps(x + i, d);
  }
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    x[i] -= max;
    any_nan = any_nan || std::isnan(x[i]);
  }
  kl_exp_avx2(x, x, n);  // the KL kernel's vector exp, elementwise in place
  __m256 s = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float total = 0;
  for (float v : lanes) total += v;
  for (; i < n; ++i) total += x[i];
  _mm256_zeroupper();
  return any_nan ? std::nanf("") : total;
}

}  // namespace mixbits
