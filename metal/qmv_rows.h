// The gathered GEMV's (gather_qmv.metal) work for one simdgroup: the dot
// products of one activation row with MB_QMV_ROWS_PER_SIMDGROUP rows of one
// K-segment of one quantized matrix (one dispatch per segment). The dense
// GEMV (qmatmul_gemv.metal) does the same decode and dot over a segment
// table with x staged in threadgroup memory. Included by .metal sources
// only (after mixbits_metal.h).
#pragma once
#include "qmatmul_common.h"

// Each lane walks the segment in chunks of 16 columns (lane l starts at
// 16 l, steps 512), loads and pre-scales its 16 activations once, and per
// row reads the chunk's 2*bits bytes of codes as whole words (uint32, or
// uint16 for odd widths: MbChunkWord) and dots them with the activations by
// masking (mb_qdot16). One simd_sum per row at the end.
// The bias is folded: sum_j (s q_j + b) x_j = s sum q_j x_j + b sum x_j.
//
// xrow: the activation row (all K columns; this segment's are p.k0 ..,
// read through perm); w, scales, biases: row 0 of this segment of the
// matrix. Rows row0 .. row0 + last are computed (last < ROWS_PER_SIMDGROUP,
// row0 + last < N); result[r] for r > last repeats row0 + last, so the
// inner loop needs no bounds check. Every lane receives the sums; all 32
// lanes of the simdgroup must call this (simd_sum).
template <typename IO, typename SC, int bits, int group_size>
inline void mb_qmv_rows(const device typename IO::storage* xrow,
                        const device int32_t* perm, const device uint8_t* w,
                        const device typename SC::storage* scales,
                        const device typename SC::storage* biases,
                        constant MbQmmParams& p, int row0, int last,
                        uint simd_lid, thread float* result) {
  typedef typename MbChunkWord<bits>::type Word;
  constexpr int n_words = mb_chunk_words<bits>();
  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);

  MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) result[r] = 0.0f;
  float xs[MB_CHUNK];
  Word wd[n_words];

  for (int k = int(simd_lid) * MB_CHUNK; k < p.kseg; k += 32 * MB_CHUNK) {
    const int c0 = p.k0 + k;
    MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
      xs[i] = mb_load_x<IO>(xrow, perm, p, c0 + i);
    }
    const float xsum = mb_prescale16<bits>(xs);
    const size_t g = size_t(k / group_size);
    MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
      const size_t n = size_t(row0 + min(r, last));
      // Aligned for Word (see MbChunkWord) when w is 4-byte aligned; the
      // emulator checks it.
      const device Word* wp =
          (const device Word*)(w + n * row_bytes + size_t(k) * bits / 8);
      MB_CHECK_ALIGNED(wp);
      MB_UNROLL for (int j = 0; j < n_words; ++j) wd[j] = wp[j];
      const float s = SC::load(scales[n * groups + g]);
      const float b = SC::load(biases[n * groups + g]);
      result[r] += s * mb_qdot16<bits>(wd, xs) + b * xsum;
    }
  }
  MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
    result[r] = simd_sum(result[r]);
  }
}
