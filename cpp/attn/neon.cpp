// NEON attention kernels for arm64, the CPU path of a Mac: avx2.cpp's
// algorithm (k in chunks as gemm_chunks.h, R x 16 tiles, 4 key rows at a time for a decode
// step's scores) in 4-lane vectors. arm64 has 32 vector registers, so a
// 6 x 16 tile holds its 24 accumulators with the B row, and a decode
// step's scores run 4 query rows against 4 keys (16 chains). No software
// prefetch: the AVX2 distance was tuned on one x86 host, and Apple cores
// stream in-order rows with their own prefetchers. Results are checked
// under qemu-user (tests/test_attn_neon_emulated.py); the speed is a Mac's
// to measure (bench/bench_attention.py, bench_decode_attention.py).
#if defined(__ARM_NEON)
#include <arm_neon.h>

#include <algorithm>
#include <cmath>

#include "attn/gemm_chunks.h"
#include "attn/kernel.h"

namespace mixbits {

void kl_exp_neon(const float* x, float* y, int64_t n);  // kl/neon.cpp

namespace {

// B's element types, widened exactly as they are loaded (as avx2.cpp's).
struct F32 {
  using T = float;
  static float32x4_t load4(const float* p) { return vld1q_f32(p); }
  static float load1(const float* p) { return *p; }
};
struct F16 {
  using T = uint16_t;
  static float32x4_t load4(const uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static float load1(const uint16_t* p) { return f16_to_f32(*p); }
};
struct BF16 {
  using T = uint16_t;
  static float32x4_t load4(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  static float load1(const uint16_t* p) { return bf16_to_f32(*p); }
};

// An R x 4V tile of C; TN and `add` as avx2.cpp's tile.
template <int R, int V, bool TN, class E>
inline void tile(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                 float* c, int64_t ldc, int64_t k, bool add) {
  float32x4_t acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = add ? vld1q_f32(c + r * ldc + 4 * v) : vdupq_n_f32(0.0f);
  for (int64_t p = 0; p < k; ++p) {
    float32x4_t bv[V];
    for (int v = 0; v < V; ++v) bv[v] = E::load4(b + p * ldb + 4 * v);
    for (int r = 0; r < R; ++r) {
      const float x = TN ? a[p * lda + r] : a[r * lda + p];
      for (int v = 0; v < V; ++v) acc[r][v] = vfmaq_n_f32(acc[r][v], bv[v], x);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) vst1q_f32(c + r * ldc + 4 * v, acc[r][v]);
}

// Columns left over after the 16-wide tiles: one row at a time, 4 lanes
// then scalar.
template <bool TN, class E>
inline void cols_tail(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, bool add) {
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = TN ? a + i : a + i * lda;
    const int64_t as = TN ? lda : 1;  // stride of row i of A along p
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      float32x4_t acc = add ? vld1q_f32(c + i * ldc + j) : vdupq_n_f32(0.0f);
      for (int64_t p = 0; p < k; ++p) acc = vfmaq_n_f32(acc, E::load4(b + p * ldb + j), ai[p * as]);
      vst1q_f32(c + i * ldc + j, acc);
    }
    for (; j < n; ++j)
      c[i * ldc + j] = attn_fma_tail<E>(ai, as, b + j, ldb, 0, k, add ? c[i * ldc + j] : 0.0f);
  }
}

// Blocks of 1-2 rows (a decode step's P V with 1 or 2 query heads per KV
// head) take 32 columns, 8 or 16 FMA chains instead of 4 or 8.
template <int R, bool TN, class E>
inline void row_block(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t n, int64_t k, bool add) {
  int64_t j = 0;
  if constexpr (R <= 2)
    for (; j + 32 <= n; j += 32) tile<R, 8, TN, E>(a, lda, b + j, ldb, c + j, ldc, k, add);
  for (; j + 16 <= n; j += 16) tile<R, 4, TN, E>(a, lda, b + j, ldb, c + j, ldc, k, add);
  if (j < n) cols_tail<TN, E>(a, lda, b + j, ldb, c + j, ldc, R, n - j, k, add);
}

template <bool TN, class E>
void gemm(const float* a, int64_t lda, const typename E::T* b, int64_t ldb, float* c,
          int64_t ldc, int64_t m, int64_t n, int64_t k) {
  attn_gemm_chunks<TN>(a, lda, b, ldb, c, ldc, m, k,
                       [&](auto R, const float* ai, const typename E::T* bp, float* ci, int64_t kc,
                           int64_t, int64_t, bool add) {
                         row_block<decltype(R)::value, TN, E>(ai, lda, bp, ldb, ci, ldc, n, kc, add);
                       });
}

// Scores of R query rows against 4 key rows: 4R independent FMA chains,
// each key vector loaded once for all R rows. Pairwise adds reduce the four
// 4-lane sums to one vector of 4 scores; a head dim's k % 4 tail is added
// after, in order.
template <int R, class E>
inline void nt_rows4(const float* a, int64_t lda, const typename E::T* b, int64_t ldb,
                     float* c, int64_t ldc, int64_t k) {
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = vdupq_n_f32(0.0f);
  int64_t p = 0;
  for (; p + 4 <= k; p += 4) {
    const float32x4_t b0 = E::load4(b + p), b1 = E::load4(b + ldb + p),
                      b2 = E::load4(b + 2 * ldb + p), b3 = E::load4(b + 3 * ldb + p);
    for (int r = 0; r < R; ++r) {
      const float32x4_t x = vld1q_f32(a + r * lda + p);
      acc[r][0] = vfmaq_f32(acc[r][0], x, b0);
      acc[r][1] = vfmaq_f32(acc[r][1], x, b1);
      acc[r][2] = vfmaq_f32(acc[r][2], x, b2);
      acc[r][3] = vfmaq_f32(acc[r][3], x, b3);
    }
  }
  for (int r = 0; r < R; ++r) {
    float32x4_t s = vpaddq_f32(vpaddq_f32(acc[r][0], acc[r][1]), vpaddq_f32(acc[r][2], acc[r][3]));
    if (p < k) {
      float t[4];
      vst1q_f32(t, s);
      for (int j = 0; j < 4; ++j) t[j] = attn_fma_tail<E>(a + r * lda, 1, b + j * ldb, 1, p, k, t[j]);
      s = vld1q_f32(t);
    }
    vst1q_f32(c + r * ldc, s);
  }
}

template <class E>
inline float dot1(const float* a, const typename E::T* b, int64_t k) {
  float32x4_t acc = vdupq_n_f32(0.0f);
  int64_t p = 0;
  for (; p + 4 <= k; p += 4) acc = vfmaq_f32(acc, vld1q_f32(a + p), E::load4(b + p));
  float s = vaddvq_f32(acc);
  return attn_fma_tail<E>(a, 1, b, 1, p, k, s);
}

template <class E>
void gemm_nt(const float* a, int64_t lda, const typename E::T* b, int64_t ldb, float* c,
             int64_t ldc, int64_t m, int64_t n, int64_t k) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // 4 key rows, read once, for every query row
    const typename E::T* bj = b + j * ldb;
    float* cj = c + j;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) nt_rows4<4, E>(a + i * lda, lda, bj, ldb, cj + i * ldc, ldc, k);
    switch (m - i) {
      case 3: nt_rows4<3, E>(a + i * lda, lda, bj, ldb, cj + i * ldc, ldc, k); break;
      case 2: nt_rows4<2, E>(a + i * lda, lda, bj, ldb, cj + i * ldc, ldc, k); break;
      case 1: nt_rows4<1, E>(a + i * lda, lda, bj, ldb, cj + i * ldc, ldc, k); break;
      default: break;
    }
  }
  for (; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) c[i * ldc + j] = dot1<E>(a + i * lda, b + j * ldb, k);
}

}  // namespace

void attn_gemm_nt_neon(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                       float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  with_b_type<F32, F16, BF16>(b, bt, [&](auto e, auto bp) {
    gemm_nt<decltype(e)>(a, lda, bp, ldb, c, ldc, m, n, k);
  });
}

void attn_gemm_neon(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  with_b_type<F32, F16, BF16>(b, bt, [&](auto e, auto bp) {
    gemm<false, decltype(e)>(a, lda, bp, ldb, c, ldc, m, n, k);
  });
}

void attn_gemm_tn_acc_neon(const float* a, int64_t lda, const float* b,
                           int64_t ldb, float* c, int64_t ldc, int64_t m,
                           int64_t n, int64_t k) {
  gemm<true, F32>(a, lda, b, ldb, c, ldc, m, n, k);
}

// NaN scores as avx2.cpp's exp row: the KL exp maps NaN to 0, so the
// subtraction pass notes any NaN and the row's sum is then NaN.
float attn_exp_row_neon(float* x, int64_t n, float max) {
  const float32x4_t m = vdupq_n_f32(max);
  uint32x4_t nan = vdupq_n_u32(0);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float32x4_t d = vsubq_f32(vld1q_f32(x + i), m);
    nan = vorrq_u32(nan, vmvnq_u32(vceqq_f32(d, d)));
    vst1q_f32(x + i, d);
  }
  bool any_nan = vmaxvq_u32(nan) != 0;
  for (; i < n; ++i) {
    x[i] -= max;
    any_nan = any_nan || std::isnan(x[i]);
  }
  kl_exp_neon(x, x, n);
  float32x4_t s = vdupq_n_f32(0.0f);
  for (i = 0; i + 4 <= n; i += 4) s = vaddq_f32(s, vld1q_f32(x + i));
  float total = vaddvq_f32(s);
  for (; i < n; ++i) total += x[i];
  return any_nan ? std::nanf("") : total;
}

}  // namespace mixbits
#endif
