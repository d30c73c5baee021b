// The AVX2 GEMV: R rows of W against MR rows of x per block, R * MR
// accumulators of 8 lanes; W widened in registers as it is loaded
// (load8_f32: F16C for float16, a shift for bfloat16), read once per
// block of rows for every row of x (from L1 after the first). Memory-bound
// at M = 1; at M = 16-32 about where OpenBLAS's sgemm catches up.
#include <immintrin.h>

#include <cmath>

#include "common/x86_half.h"
#include "common/x86_prefetch.h"
#include "linear/kernel.h"

namespace mixbits {

namespace {

// The same tree as gemv_ref: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m + i][n + r] for r < R, i < MR. Every output is summed in the same
// order by every instantiation (thread-independent results).
template <DType T, int R, int MR>
inline void block(const float* x, int64_t K, const void* w, int64_t n, int64_t m, float* y,
                  int64_t ldy) {
  __m256 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t K8 = K - K % 8;
  constexpr int64_t kStep = 8 * dtype_bytes(T);  // bytes of W per row per step
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + (m + i) * K + k);
    for (int r = 0; r < R; ++r) {
      // One row of x: W streams from memory once; common/x86_prefetch.h's
      // policy (L2, 16 KiB ahead). 4096 x 4096 from DRAM, one thread,
      // loaded host: float16 8.2 -> 10.1-11.0 GB/s, bfloat16 8.8 -> 8.8-12.6.
      if constexpr (MR == 1) {
        const char* p = static_cast<const char*>(w) + ((n + r) * K + k) * dtype_bytes(T);
        if ((reinterpret_cast<uintptr_t>(p) & 63) < uintptr_t(kStep))  // once per line
          _mm_prefetch(p + kPrefetchAhead, _MM_HINT_T1);
      }
      const __m256 wv = load8_f32(w, (n + r) * K + k, T);
      for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_fmadd_ps(xv[i], wv, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MR; ++i) {
      float s = hsum(acc[r][i]);
      const float* xr = x + (m + i) * K;
      for (int64_t k = K8; k < K; ++k) s = std::fma(xr[k], load_as_f32(w, (n + r) * K + k, T), s);
      y[(m + i) * ldy + n + r] = s;
    }
}

// R rows of W at n against every row of x: pairs of rows, then the odd one.
template <DType T, int R>
inline void rows(const float* x, int64_t M, int64_t K, const void* w, int64_t n, float* y,
                 int64_t ldy) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) block<T, R, 2>(x, K, w, n, m, y, ldy);
  if (m < M) block<T, R, 1>(x, K, w, n, m, y, ldy);
}

template <DType T>
void gemv_t(const float* x, int64_t M, const void* w, int64_t K, int64_t n0, int64_t n1,
            float* y, int64_t ldy) {
  int64_t n = n0;
  if (M == 1)  // one row of x: 8 rows of W keep 8 FMA chains in flight
    for (; n + 8 <= n1; n += 8) block<T, 8, 1>(x, K, w, n, 0, y, ldy);
  for (; n + 4 <= n1; n += 4) rows<T, 4>(x, M, K, w, n, y, ldy);
  for (; n < n1; ++n) rows<T, 1>(x, M, K, w, n, y, ldy);
}

}  // namespace

void gemv_avx2(const float* x, int64_t M, const void* w, DType wt, int64_t K, int64_t n0,
               int64_t n1, float* y, int64_t ldy) {
  if (wt == DType::f16)
    gemv_t<DType::f16>(x, M, w, K, n0, n1, y, ldy);
  else if (wt == DType::bf16)
    gemv_t<DType::bf16>(x, M, w, K, n0, n1, y, ldy);
  else
    gemv_t<DType::f32>(x, M, w, K, n0, n1, y, ldy);
}

}  // namespace mixbits
