// The loops the SIMD attention GEMMs share (avx2.cpp, neon.cpp): k in
// chunks, rows of C in blocks, and the scalar tails; each backend supplies
// the register tiles that run one block of one chunk.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace mixbits {

// k in chunks of kAttnKc rows of B: every column tile of a chunk reads the
// same rows of B, so B streams from memory once, in order (the x86 tiles
// prefetch the rows ahead meanwhile). Without the chunks a decode step's
// P V (3 rows, 64 columns, k = the keys) ran 4 passes over V, one 64-byte
// line of each 256-byte row per pass, and read a cold cache at 9 GB/s.
// Chunks change no sum: each element of C still adds its k terms in order
// (C holds the sum between chunks).
constexpr int64_t kAttnKc = 64;

// C = A B, or C += A^T B with A stored k x m (TN): for each chunk of k,
// rows of C in blocks of 6, then one block of the 5..1 left. block(R, a, b,
// c, kc, p0, i, add) runs the R rows from row i of one chunk (R an
// std::integral_constant; a, b, c at that block and chunk, kc rows of B
// from row p0; add: C already holds a sum there, so the block adds to it).
template <bool TN, class T, class Block>
inline void attn_gemm_chunks(const float* a, int64_t lda, const T* b, int64_t ldb, float* c,
                             int64_t ldc, int64_t m, int64_t k, Block&& block) {
  const int64_t row_step = TN ? 1 : lda;
  for (int64_t p0 = 0; p0 == 0 || p0 < k; p0 += kAttnKc) {
    const int64_t kc = std::min(kAttnKc, k - p0);
    const float* ap = TN ? a + p0 * lda : a + p0;
    const T* bp = b + p0 * ldb;
    const bool add = TN || p0 > 0;
    int64_t i = 0;
    for (; i + 6 <= m; i += 6)
      block(std::integral_constant<int, 6>{}, ap + i * row_step, bp, c + i * ldc, kc, p0, i, add);
    const float* ai = ap + i * row_step;
    float* ci = c + i * ldc;
    switch (m - i) {
      case 5: block(std::integral_constant<int, 5>{}, ai, bp, ci, kc, p0, i, add); break;
      case 4: block(std::integral_constant<int, 4>{}, ai, bp, ci, kc, p0, i, add); break;
      case 3: block(std::integral_constant<int, 3>{}, ai, bp, ci, kc, p0, i, add); break;
      case 2: block(std::integral_constant<int, 2>{}, ai, bp, ci, kc, p0, i, add); break;
      case 1: block(std::integral_constant<int, 1>{}, ai, bp, ci, kc, p0, i, add); break;
      default: break;
    }
  }
}

// s plus a[p * as] * B's element p * bs for p in [p0, k), in order: the
// scalar tails of the SIMD GEMMs (columns past the vector tiles, head dims
// past the vector width), B widened by the backend's element type E. The
// fused multiply-adds are spelled out: left to the compiler, one
// instantiation fused them and another did not.
template <class E>
inline float attn_fma_tail(const float* a, int64_t as, const typename E::T* b, int64_t bs,
                           int64_t p0, int64_t k, float s) {
  for (int64_t p = p0; p < k; ++p) s = std::fma(a[p * as], E::load1(b + p * bs), s);
  return s;
}

}  // namespace mixbits
