// The transposed product's work for one threadgroup, shared by the dense
// kernel (qmatmul_t.metal: dx = dy · W) and the gathered one
// (gather_qmv_t.metal: dx[lhs[i]] += dy[i] · W[rhs[i]]): one block of
// sets x 128 columns of one K-segment, for every row of dy, summed over the rows of W,
// and stored to its dx columns (through the permutation when there is
// one). The kernels differ only in which (dy matrix, W matrix) products a
// block sums and how they learn the permutation's case, so the decode,
// the per-thread sums, the reduction and the stores live here once.
// Included by .metal sources only (after mixbits_metal.h).
#pragma once
#include "qmatmul_common.h"
#include "qmatmul_t_params.h"

// The segment of threadgroup t of the grid (segments in order, ceil(kseg /
// (sets * MB_QT_COLS)) blocks each) and the block's first column in it.
inline int mb_qt_find_block(constant MbQmmFusedParams& p, int t, int sets, thread int& block) {
  const int cols = sets * MB_QT_COLS;
  for (int s = 0; s < p.nseg; ++s) {
    const int nb = (p.seg[s].kseg + cols - 1) / cols;
    if (t < nb) {
      block = t * cols;
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

// Roles (qmatmul_t_params.h, MbQmvTShape): thread t of a set owns the 8
// columns of chunk t % 16 and the rows n = t / 16 + 4 i of W. A column of
// W is a strided walk through the rows, so each thread decodes its chunk of
// each of its rows once and applies it to every row m < M of dy (acc:
// [MB_QT_MAX_M][8], bsum: [MB_QT_MAX_M]). The 8 columns lie in one group,
// so per row one scale and one bias apply and the bias term is one running
// sum per row of dy, sum_n dy[m, n] b[n, g].
//
// Loads: the 4 lanes of a 32-column run (lanes q .. q + 3, q = `quad`)
// read its `bits` words of row n, lane r words r and r + 4 (those below
// `bits`), and each takes the one or two words holding its 8 codes (bit
// 8 r bits of the run) by simd_shuffle: every weight word read once, 4
// bytes at a time. The first lane of each group (lead) loads its scale and
// bias, handed to the group's other lanes (src) the same way. dy: the
// threadgroup's `nthreads` threads stage rows n0 .. n0 + 255 of the M rows
// of dy as floats ([row][M]; between two barriers) and every thread reads
// them there, so dy is read once per threadgroup and call.
// Every thread of the threadgroup calls this with the same M and N
// (uniform trip counts: the barriers and shuffles are met by every lane).
//
// Adds one (dy matrix, W matrix) product to the sums: dy the matrix's row
// 0 (rows of N values); w the quad's run in row 0 of the W matrix (word
// (run's first column) * bits / 32 of the segment's row; row_words words
// per row); sc, bi row 0 of its scales and biases (`groups` per row); g
// the chunk's group; on: the run lies in the segment (a run wholly past
// the segment's end decodes nothing and contributes zeros; segments are
// whole groups, so a run is wholly in or out).
template <typename IO, typename SC, int bits>
inline void mb_qt_accumulate(const device typename IO::storage* dy, int M, int N,
                             const device uint32_t* w, size_t row_words,
                             const device typename SC::storage* sc,
                             const device typename SC::storage* bi, size_t groups, size_t g,
                             bool on, bool lead, ushort src, ushort quad, int slice, uint lid,
                             int nthreads, threadgroup float* stage, thread float* acc,
                             thread float* bsum) {
  const int lane = int(lid) & 3;              // r: the lane's place in its quad
  const int bit = 8 * lane * bits;            // its codes' first bit in the run
  const int wlo = bit >> 5, shift = bit & 31;
  for (int n0 = 0; n0 < N; n0 += MB_QT_STAGE_ROWS) {
    const int rows = min(int(MB_QT_STAGE_ROWS), N - n0);
    for (int idx = int(lid); idx < M * rows; idx += nthreads) {
      const int m = idx / rows, rr = idx % rows;
      stage[rr * M + m] = IO::load(dy[size_t(m) * size_t(N) + size_t(n0 + rr)]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Whole 4-row steps: every lane of a simdgroup makes the same trips.
    const int steps = (rows + MB_QT_SLICES - 1) / MB_QT_SLICES * MB_QT_SLICES;
    for (int rr = slice; rr < steps; rr += MB_QT_SLICES) {
      const bool row = rr < rows;
      const size_t n = size_t(n0 + rr);
      float s_own = 0.0f, b_own = 0.0f;
      if (row && on && lead) {
        s_own = SC::load(sc[n * groups + g]);
        b_own = SC::load(bi[n * groups + g]);
      }
      const float s = simd_shuffle(s_own, src);
      const float b = simd_shuffle(b_own, src);
      uint32_t w0 = 0u, w1 = 0u;
      if (row && on) {
        if (lane < bits) w0 = w[n * row_words + size_t(lane)];
        if (bits > 4 && lane + 4 < bits) w1 = w[n * row_words + size_t(lane + 4)];
      }
      uint32_t lo = simd_shuffle(w0, ushort(quad + (wlo & 3)));
      uint32_t hi = simd_shuffle(w0, ushort(quad + ((wlo + 1) & 3)));
      if (bits > 4) {
        const uint32_t lo1 = simd_shuffle(w1, ushort(quad + (wlo & 3)));
        const uint32_t hi1 = simd_shuffle(w1, ushort(quad + ((wlo + 1) & 3)));
        if (wlo >= 4) lo = lo1;
        if (wlo + 1 >= 4) hi = hi1;
      }
      uint32_t codes[MB_QT_CHUNK_COLS];
      mb_unpack8_words<bits>(lo, hi, shift, codes);
      if (row) {
        MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) {
          if (m < M) {
            const float d = stage[rr * M + m];
            const float a = d * s;
            bsum[m] += d * b;
            MB_UNROLL for (int i = 0; i < MB_QT_CHUNK_COLS; ++i) {
              acc[m * MB_QT_CHUNK_COLS + i] += a * float(codes[i]);
            }
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
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

// Meets the slices' sums and stores the block's columns of rows m < M:
// column c < ncols of the block goes to dx column cols[c] (the block's
// perm entries, in threadgroup memory: a scatter) when `scatter`, else
// kc0 + c; row m to dx row out_row0 + m (K columns). Slices 2 h and 2 h + 1
// of a set are the halves of its simdgroup h: added by one shuffle; then
// simdgroup 1's sums go through red ([M][sets * COLS], reusing dy's stage)
// to simdgroup 0's, and the threadgroup stores the block row by row.
// Every thread of the threadgroup must call this (barriers); the slices
// are added in a fixed order, (0 + 1) + (2 + 3).
template <typename IO>
inline void mb_qt_finish(threadgroup float* red, thread const float* acc,
                         thread const float* bsum, int M, int sets, uint lid, int ncols,
                         bool scatter, threadgroup const int32_t* cols, int kc0, int K,
                         size_t out_row0, device typename IO::storage* out) {
  const int width = sets * MB_QT_COLS, nthreads = sets * MB_QT_THREADS;
  const int set = int(lid) / MB_QT_THREADS, t = int(lid) % MB_QT_THREADS;
  const int c0 = set * MB_QT_COLS + MB_QT_CHUNK_COLS * (t % MB_QT_CHUNKS);
  const bool low = t % 32 < MB_QT_CHUNKS;  // the simdgroup's first slice
  float v[MB_QT_MAX_M * MB_QT_CHUNK_COLS];
  MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) {
    if (m < M) {
      MB_UNROLL for (int i = 0; i < MB_QT_CHUNK_COLS; ++i) {
        const float a = acc[m * MB_QT_CHUNK_COLS + i] + bsum[m];
        v[m * MB_QT_CHUNK_COLS + i] = a + simd_shuffle_xor(a, ushort(MB_QT_CHUNKS));
      }
    }
  }
  if (low && t >= 32) {
    for (int m = 0; m < M; ++m) {
      MB_UNROLL for (int i = 0; i < MB_QT_CHUNK_COLS; ++i) {
        red[m * width + c0 + i] = v[m * MB_QT_CHUNK_COLS + i];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (low && t < 32) {
    for (int m = 0; m < M; ++m) {
      MB_UNROLL for (int i = 0; i < MB_QT_CHUNK_COLS; ++i) {
        red[m * width + c0 + i] = v[m * MB_QT_CHUNK_COLS + i] + red[m * width + c0 + i];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int idx = int(lid); idx < M * width; idx += nthreads) {
    const int m = idx / width, c = idx % width;
    if (c >= ncols) continue;
    const int j = scatter ? cols[c] : kc0 + c;
    out[(out_row0 + size_t(m)) * size_t(K) + size_t(j)] = IO::store(red[idx]);
  }
}

// One column of one W matrix for the rows m < M of a dy matrix (the slow
// path of a perm with repeated entries): z[m] += sum_n dy[m, n] W[n, col].
// w, sc, bi: row 0 of the segment's matrix.
template <typename IO, typename SC, int bits>
inline void mb_qt_column(const device typename IO::storage* dy, int M, int N,
                         const device uint32_t* w, size_t row_words,
                         const device typename SC::storage* sc,
                         const device typename SC::storage* bi, size_t groups, int group_shift,
                         int col, thread float* z) {
  const size_t g = size_t(col >> group_shift);
  // The code's bits in the row: word col * bits / 32 at bit (col * bits) %
  // 32, and the next word when it runs past (3, 5 and 6 bits): 4-byte loads.
  const size_t wi = size_t(col) * bits / 32;
  const int shift = (col * bits) & 31;
  const bool two = shift + bits > 32;
  for (int n = 0; n < N; ++n) {
    const device uint32_t* wr = w + size_t(n) * row_words + wi;
    const uint64_t v = uint64_t(wr[0]) | (two ? uint64_t(wr[1]) << 32 : uint64_t(0));
    const uint32_t code = uint32_t(v >> shift) & mb_code_mask<bits>();
    const float wv = SC::load(sc[size_t(n) * groups + g]) * float(code) +
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
