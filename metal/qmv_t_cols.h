// The transposed product's work for one threadgroup, shared by the dense
// kernel (qmatmul_t.metal: dx = dy · W) and the gathered one
// (gather_qmv_t.metal: dx[lhs[i]] += dy[i] · W[rhs[i]]): one 128-column
// block of one K-segment, for every row of dy, summed over the rows of W,
// and stored to its dx columns (through the permutation when there is
// one). The kernels differ only in which (dy matrix, W matrix) products a
// block sums and how they learn the permutation's case, so the decode,
// the per-thread sums, the reduction and the stores live here once.
// Included by .metal sources only (after mixbits_metal.h).
#pragma once
#include "qmatmul_common.h"
#include "qmatmul_t_params.h"

// The segment of threadgroup t of the grid (segments in order, ceil(kseg /
// MB_QT_COLS) blocks each) and the block's first column in it.
inline int mb_qt_find_block(constant MbQmmFusedParams& p, int t, thread int& block) {
  for (int s = 0; s < p.nseg; ++s) {
    const int nb = (p.seg[s].kseg + MB_QT_COLS - 1) / MB_QT_COLS;
    if (t < nb) {
      block = t * MB_QT_COLS;
      return s;
    }
    t -= nb;
  }
  block = 0;
  return 0;  // not reached: the host sizes the grid from the same table
}

// A threadgroup-memory fetch-or (the perm check's bit map).
#if defined(__METAL_VERSION__)
inline uint32_t mb_tg_fetch_or(threadgroup uint32_t* w, uint32_t bits) {
  return atomic_fetch_or_explicit((threadgroup atomic_uint*)w, bits, memory_order_relaxed);
}
#else
// The emulator's threads are fibers that switch only at barriers and simd
// operations, so a plain read-modify-write is atomic there.
inline uint32_t mb_tg_fetch_or(uint32_t* w, uint32_t bits) {
  const uint32_t old = *w;
  *w = old | bits;
  return old;
}
#endif

// Roles (qmatmul_t_params.h, MbQmvTShape): thread t owns the 8 columns of
// chunk t % 16 (block + 8 * chunk ..) and the rows n = t / 16 + 4 i of W.
// A column of W is a strided walk through the rows, so each thread decodes
// its chunk of each of its rows with mb_unpack8 once and applies it to
// every row m < M of dy (acc: [MB_QT_MAX_M][8], bsum: [MB_QT_MAX_M]). The 8
// columns lie in one group, so per row one scale and one bias apply and
// the bias term is one running sum per row of dy, sum_n dy[m, n] b[n, g].
// The 16 lanes of a slice (lanes base .. base + 15 of a simdgroup) work on
// the same row n: lane m < M loads dy[m, n] and the first lane of each
// group loads its scale and bias (lane src), and simd_shuffle hands them to
// the others, so each is read once per threadgroup. Every thread of the
// threadgroup calls this with the same M and N (uniform trip counts: the
// shuffles are met by every lane).
//
// Adds one (dy matrix, W matrix) product to the sums: dy the matrix's row
// 0 (rows of N values); w the thread's chunk in row 0 of the W matrix (the
// byte at column `col` of the segment); sc, bi row 0 of its scales and
// biases (`groups` per row); g the chunk's group; on: col < kseg (a chunk
// wholly past the segment's end decodes nothing and contributes zeros).
template <typename IO, typename SC, int bits>
inline void mb_qt_accumulate(const device typename IO::storage* dy, int M, int N,
                             const device uint8_t* w, size_t row_bytes,
                             const device typename SC::storage* sc,
                             const device typename SC::storage* bi, size_t groups, size_t g,
                             bool on, bool lead, ushort src, ushort base, int chunk, int slice,
                             thread float* acc, thread float* bsum) {
  for (int n0 = 0; n0 < N; n0 += MB_QT_SLICES) {
    const int n = n0 + slice;
    const bool row = n < N;
    float d_own = 0.0f, s_own = 0.0f, b_own = 0.0f;
    if (row && chunk < M) d_own = IO::load(dy[size_t(chunk) * size_t(N) + size_t(n)]);
    if (row && on && lead) {
      s_own = SC::load(sc[size_t(n) * groups + g]);
      b_own = SC::load(bi[size_t(n) * groups + g]);
    }
    const float s = simd_shuffle(s_own, src);
    const float b = simd_shuffle(b_own, src);
    uint32_t codes[MB_QT_CHUNK_COLS];
    if (row && on) {
      mb_unpack8<bits>(w + size_t(n) * row_bytes, codes);
    } else {
      MB_UNROLL for (int i = 0; i < MB_QT_CHUNK_COLS; ++i) codes[i] = 0u;
    }
    MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) {
      if (m < M) {
        const float d = simd_shuffle(d_own, ushort(base + m));
        const float a = d * s;
        bsum[m] += d * b;
        MB_UNROLL for (int i = 0; i < MB_QT_CHUNK_COLS; ++i) {
          acc[m * MB_QT_CHUNK_COLS + i] += a * float(codes[i]);
        }
      }
    }
  }
}

// The lanes that share a chunk's scale: the chunks of one group are
// consecutive lanes of a slice (group_size / 8 of them: 4, 8 or 16), the
// first of which loads it.
inline bool mb_qt_group_lead(int chunk, int group_shift) {
  return (chunk & ((1 << (group_shift - 3)) - 1)) == 0;
}
inline ushort mb_qt_group_src(uint simd_lid, int group_shift) {
  return ushort(simd_lid & ~uint((1 << (group_shift - 3)) - 1));
}

// Meets the slices' sums in threadgroup memory (red: mb_qt_red_words(M))
// and stores the block's columns of rows m < M: column c < ncols of the
// block goes to dx column cols[c] (the block's perm entries, in
// threadgroup memory: a scatter) when `scatter`, else kc0 + c; row m to dx
// row out_row0 + m (K columns). Every thread of the threadgroup must call
// this (barrier); the slices are added in a fixed order.
template <typename IO>
inline void mb_qt_finish(threadgroup float* red, thread const float* acc,
                         thread const float* bsum, int M, int slice, int chunk, uint lid,
                         int ncols, bool scatter, threadgroup const int32_t* cols, int kc0,
                         int K, size_t out_row0, device typename IO::storage* out) {
  MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) {
    if (m < M) {
      MB_UNROLL for (int i = 0; i < MB_QT_CHUNK_COLS; ++i) {
        red[(m * MB_QT_SLICES + slice) * MB_QT_COLS + MB_QT_CHUNK_COLS * chunk + i] =
            acc[m * MB_QT_CHUNK_COLS + i] + bsum[m];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int idx = int(lid); idx < M * MB_QT_COLS; idx += MB_QT_THREADS) {
    const int m = idx / MB_QT_COLS, c = idx % MB_QT_COLS;
    if (c >= ncols) continue;
    float v = 0.0f;
    MB_UNROLL for (int s = 0; s < MB_QT_SLICES; ++s) {
      v += red[(m * MB_QT_SLICES + s) * MB_QT_COLS + c];
    }
    const int j = scatter ? cols[c] : kc0 + c;
    out[(out_row0 + size_t(m)) * size_t(K) + size_t(j)] = IO::store(v);
  }
}

// One column of one W matrix for the rows m < M of a dy matrix (the slow
// path of a perm with repeated entries): z[m] += sum_n dy[m, n] W[n, col].
// w, sc, bi: row 0 of the segment's matrix.
template <typename IO, typename SC, int bits>
inline void mb_qt_column(const device typename IO::storage* dy, int M, int N,
                         const device uint8_t* w, size_t row_bytes,
                         const device typename SC::storage* sc,
                         const device typename SC::storage* bi, size_t groups, int group_shift,
                         int col, thread float* z) {
  const size_t g = size_t(col >> group_shift);
  const device uint8_t* w8 = w + size_t(col >> 3) * bits;  // its run of 8 codes
  const int i = col & 7;
  for (int n = 0; n < N; ++n) {
    uint32_t codes[8];
    mb_unpack8<bits>(w8 + size_t(n) * row_bytes, codes);
    const float wv = SC::load(sc[size_t(n) * groups + g]) * float(codes[i]) +
                     SC::load(bi[size_t(n) * groups + g]);
    MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) {
      if (m < M) z[m] += IO::load(dy[size_t(m) * size_t(N) + size_t(n)]) * wv;
    }
  }
}

// The segment holding packed column k (segments in order, k < K).
inline int mb_qt_segment_of(constant MbQmmFusedParams& p, int k) {
  int s = 0;
  while (s + 1 < p.nseg && k >= p.seg[s + 1].k0) ++s;
  return s;
}
