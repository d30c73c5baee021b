// The GEMV's work on one K-segment, shared by the dense GEMV
// (qmatmul_gemv.metal: all segments of a product in one dispatch) and the
// gathered one (gather_qmv.metal: one expert's rows per run, one segment
// per dispatch). Included by .metal sources only (after mixbits_metal.h).
#pragma once
#include "qmatmul_common.h"

// One segment of width `bits` for one simdgroup: `sets` sets of
// L = 32 / sets consecutive lanes (sets = 1, 2 or 4), each set owning
// MB_QMV_ROWS_PER_SIMDGROUP rows of W (row0 .. row0 + last are the calling
// lane's set's; results for r > last repeat row0 + last,
// so the inner loop needs no bounds check) against up to MB_QMV_MAX_M rows
// of x: row m starts at element xrow[m] of x (< 0: a row of NaN, read from
// nowhere -- the gathered kernel's out-of-range lhs).
//
// The segment is walked in blocks of MB_QMV_BLOCK columns. Per block, the
// whole threadgroup first stages the block's columns of every x row,
// gathered through perm, as float in threadgroup memory (xt [M][BLOCK]):
// perm and x are read once per threadgroup, not once per simdgroup and row
// of W. Then lane l of each set takes the 16 columns 16 (l + L i) .., i <
// sets, of the block: it reads,
// per row of W, the chunk's 2*bits bytes of codes as whole words
// (MbChunkWord), gets the group's scale and bias (read by one lane of the
// group), and dots them with each x row's 16 staged activations by masking
// (mb_prescale16 / mb_qdot16). The bias is folded:
// sum_j (s q_j + b) x_j = s sum q_j x_j + b sum x_j.
// More sets give a simdgroup more rows of W (4 sets: 16) for the same
// registers per lane (acc stays 8 x 4), so a threadgroup covers more rows
// of W per staging of x (qmv_shape in qmatmul_host.h); the caller sums a
// row's partials over its set's lanes (mb_qmv_set_sum).
// w, scales, biases: row 0 of this segment of the matrix; k0, kseg: the
// segment's columns (permuted order). All `threads` threads of the
// threadgroup must call this (barriers, shuffles) with the same arguments
// except the row ones.
template <typename IO, typename SC, int bits>
inline void mb_qmv_segment(const device typename IO::storage* x, thread const long* xrow,
                           const device int32_t* perm, int has_perm, int K, int k0, int kseg,
                           int group_shift, const device uint8_t* w,
                           const device typename SC::storage* scales,
                           const device typename SC::storage* biases, threadgroup float* xt,
                           int rows_x, int row0, int last, uint lid, uint simd_lid,
                           int threads, int sets, thread float* acc) {
  typedef typename MbChunkWord<bits>::type Word;
  constexpr int n_words = mb_chunk_words<bits>();
  constexpr int R = MB_QMV_ROWS_PER_SIMDGROUP;
  const size_t row_bytes = size_t(kseg) * bits / 8;
  const size_t groups = size_t(kseg) >> group_shift;

  for (int kb = 0; kb < kseg; kb += MB_QMV_BLOCK) {
    const int cols = min(int(MB_QMV_BLOCK), kseg - kb);
    for (int c = int(lid); c < cols; c += threads) {
      const uint32_t pc = mb_perm_col(perm, has_perm, K, k0 + kb + c);
      for (int m = 0; m < rows_x; ++m) {
        xt[m * MB_QMV_BLOCK + c] =
            pc < uint32_t(K) && xrow[m] >= 0 ? IO::load(x[size_t(xrow[m]) + pc]) : NAN;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Every lane makes `sets` trips (MB_QMV_BLOCK = 16 L sets columns), so
    // the shuffles below are reached by the whole simdgroup.
    const int L = 32 / sets;
    for (int c = int(simd_lid % uint(L)) * MB_CHUNK; c < MB_QMV_BLOCK; c += L * MB_CHUNK) {
      const int k = kb + c;
      const size_t g = size_t(k) >> group_shift;
      // A group spans group_size / 16 <= 8 consecutive lanes of a set
      // (blocks start on a group boundary and end on one: cols is a multiple
      // of the group size; a trip spans 16 L >= 128 columns):
      // its first lane reads the scale and bias, the others take them by
      // shuffle, so each is read once per row, not once per 16 columns.
      const uint owner = simd_lid & ~((uint(1) << (group_shift - 4)) - 1u);
      const bool reads = simd_lid == owner && c < cols;
      float s[R], b[R];
      MB_UNROLL for (int r = 0; r < R; ++r) {
        const size_t n = size_t(row0 + min(r, last));
        const float sv = reads ? SC::load(scales[n * groups + g]) : 0.0f;
        const float bv = reads ? SC::load(biases[n * groups + g]) : 0.0f;
        s[r] = simd_shuffle(sv, ushort(owner));
        b[r] = simd_shuffle(bv, ushort(owner));
      }
      if (c < cols) {  // cols is a multiple of 32: chunks are whole
        Word wd[R][n_words];
        MB_UNROLL for (int r = 0; r < R; ++r) {
          const size_t n = size_t(row0 + min(r, last));
          // Aligned for Word (see MbChunkWord) when w is 4-byte aligned; the
          // emulator checks it.
          const device Word* wp =
              (const device Word*)(w + n * row_bytes + size_t(k) * bits / 8);
          MB_CHECK_ALIGNED(wp);
          MB_UNROLL for (int j = 0; j < n_words; ++j) wd[r][j] = wp[j];
        }
        MB_UNROLL for (int m = 0; m < MB_QMV_MAX_M; ++m) {
          if (m < rows_x) {
            float xs[MB_CHUNK];
            MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) xs[i] = xt[m * MB_QMV_BLOCK + c + i];
            const float xsum = mb_prescale16<bits>(xs);
            MB_UNROLL for (int r = 0; r < R; ++r) {
              acc[m * R + r] += s[r] * mb_qdot16<bits>(wd[r], xs) + b[r] * xsum;
            }
          }
        }
      }
    }
    // The next block overwrites xt: wait until every simdgroup has read it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Sum of v over the calling lane's set of 32 / sets consecutive lanes (see
// mb_qmv_segment), in every lane of the set. Uniform over the simdgroup.
inline float mb_qmv_set_sum(float v, int sets) {
  if (sets == 1) return simd_sum(v);
  for (int off = 16 / sets; off > 0; off /= 2) v += simd_shuffle_xor(v, ushort(off));
  return v;
}
