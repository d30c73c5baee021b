// GEMV kernel of the mixed-segment quantized matmul y = x · Wᵀ, for few
// rows of x (M <= MB_QMV_MAX_M), in the style of MLX's qmv_fast.
//
// W is a list of K-segments, each stored exactly as MLX stores a quantized
// matrix (see quant_utils.h). ONE dispatch computes the whole product: the
// kernel walks the segment table (MbQmmFusedParams, qmatmul_params.h), each
// segment with its own bit width and group size, and accumulates in
// registers. It is instantiated per activation dtype x scale dtype only; the
// decode is a template per width, picked once per segment
// (MB_QMM_SWITCH_BITS). The tiled kernel for more rows is in
// qmatmul_tiled.metal.
#include "mixbits_metal.h"
#include "qmatmul_common.h"

// One segment of width `bits` for one simdgroup: MB_QMV_ROWS_PER_SIMDGROUP
// rows (row0 .. row0 + last; results for r > last repeat row0 + last, so
// the inner loop needs no bounds check) against every row of x.
//
// The segment is walked in blocks of MB_QMV_BLOCK columns. Per block, the
// whole threadgroup first stages the block's columns of every x row,
// gathered through perm, as float in threadgroup memory (xt [M][BLOCK]):
// perm and x are read once per threadgroup, not once per simdgroup and row
// of W. Then lane l takes the 16 columns 16 l .. of the block: it reads,
// per row of W, the chunk's 2*bits bytes of codes as whole words
// (MbChunkWord), gets the group's scale and bias (read by one lane of the
// group), and dots them with each x
// row's 16 staged activations by masking (mb_prescale16 / mb_qdot16). The
// bias is folded: sum_j (s q_j + b) x_j = s sum q_j x_j + b sum x_j.
// All `threads` threads of the threadgroup must call this (barriers,
// shuffles).
template <typename IO, typename SC, int bits>
inline void mb_qmv_segment(const device typename IO::storage* x,
                           const device int32_t* perm, const device uint8_t* w,
                           const device typename SC::storage* scales,
                           const device typename SC::storage* biases,
                           constant MbQmmFusedParams& p, constant MbQmmSeg& sg,
                           threadgroup float* xt, int m0, int rows_x, int row0,
                           int last, uint lid, uint simd_lid, int threads,
                           thread float* acc) {
  typedef typename MbChunkWord<bits>::type Word;
  constexpr int n_words = mb_chunk_words<bits>();
  constexpr int R = MB_QMV_ROWS_PER_SIMDGROUP;
  const size_t row_bytes = size_t(sg.kseg) * bits / 8;
  const size_t groups = size_t(sg.kseg) >> sg.group_shift;

  for (int kb = 0; kb < sg.kseg; kb += MB_QMV_BLOCK) {
    const int cols = min(int(MB_QMV_BLOCK), sg.kseg - kb);
    for (int c = int(lid); c < cols; c += threads) {
      const uint32_t pc = mb_perm_col(perm, p.has_perm, p.K, sg.k0 + kb + c);
      for (int m = 0; m < rows_x; ++m) {
        xt[m * MB_QMV_BLOCK + c] =
            pc < uint32_t(p.K) ? IO::load(x[size_t(m0 + m) * size_t(p.K) + pc]) : NAN;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int c = int(simd_lid) * MB_CHUNK;
    const int k = kb + c;
    const size_t g = size_t(k) >> sg.group_shift;
    // A group spans group_size / 16 consecutive lanes (blocks start on a
    // group boundary and end on one: cols is a multiple of the group size):
    // its first lane reads the scale and bias, the others take them by
    // shuffle, so each is read once per row, not once per 16 columns.
    const uint owner = simd_lid & ~((uint(1) << (sg.group_shift - 4)) - 1u);
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
    // The next block overwrites xt: wait until every simdgroup has read it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Threadgroup = S simdgroups x 32 lanes, S = 8, 16 or 32 as the host picks
// (qmv_simdgroups: the more, the fewer threadgroups re-read x);
// grid = (ceil(N / 4S), ceil(M / 8)). Each simdgroup owns 4 consecutive
// output rows and computes them for the threadgroup's up to MB_QMV_MAX_M
// rows of x (acc: 8 x 4 floats per lane), so at M <= 8 (the only M the host
// sends here by default) each row of W is read once per call whatever M,
// and the staged x serves 4S rows of W. Buffers: qmatmul_params.h (MbQmmBuffer);
// slots of segments past p.nseg are bound to a stand-in and never read.
template <typename IO, typename SC>
[[kernel]] void mb_qmv(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    device float* acc_buf [[buffer(2)]],
    device typename IO::storage* out [[buffer(3)]],
    const device uint32_t* wq0 [[buffer(4)]],
    const device typename SC::storage* scales0 [[buffer(5)]],
    const device typename SC::storage* biases0 [[buffer(6)]],
    const device uint32_t* wq1 [[buffer(7)]],
    const device typename SC::storage* scales1 [[buffer(8)]],
    const device typename SC::storage* biases1 [[buffer(9)]],
    const device uint32_t* wq2 [[buffer(10)]],
    const device typename SC::storage* scales2 [[buffer(11)]],
    const device typename SC::storage* biases2 [[buffer(12)]],
    const device uint32_t* wq3 [[buffer(13)]],
    const device typename SC::storage* scales3 [[buffer(14)]],
    const device typename SC::storage* biases3 [[buffer(15)]],
    const device uint32_t* wq4 [[buffer(16)]],
    const device typename SC::storage* scales4 [[buffer(17)]],
    const device typename SC::storage* biases4 [[buffer(18)]],
    const device uint32_t* wq5 [[buffer(19)]],
    const device typename SC::storage* scales5 [[buffer(20)]],
    const device typename SC::storage* biases5 [[buffer(21)]],
    const device uint32_t* wq6 [[buffer(22)]],
    const device typename SC::storage* scales6 [[buffer(23)]],
    const device typename SC::storage* biases6 [[buffer(24)]],
    const device uint32_t* wq7 [[buffer(25)]],
    const device typename SC::storage* scales7 [[buffer(26)]],
    const device typename SC::storage* biases7 [[buffer(27)]],
    constant MbQmmFusedParams& p [[buffer(28)]],
    threadgroup float* xt [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]],
    uint nsimd [[simdgroups_per_threadgroup]]) {
  const device uint32_t* wqs[MB_QMM_MAX_SEGS] = {wq0, wq1, wq2, wq3, wq4, wq5, wq6, wq7};
  const device typename SC::storage* scs[MB_QMM_MAX_SEGS] = {
      scales0, scales1, scales2, scales3, scales4, scales5, scales6, scales7};
  const device typename SC::storage* bis[MB_QMM_MAX_SEGS] = {
      biases0, biases1, biases2, biases3, biases4, biases5, biases6, biases7};
  constexpr int R = MB_QMV_ROWS_PER_SIMDGROUP;
  const int row0 = int(tid.x) * int(nsimd) * R + int(simd_gid) * R;
  // A simdgroup past N still stages x and meets the barriers: it computes
  // row N - 1 and stores nothing. Rows past N otherwise repeat the last.
  const bool active = row0 < p.N;
  const int r0 = active ? row0 : p.N - 1;
  const int last = min(R - 1, p.N - 1 - r0);
  const int m0 = int(tid.y) * MB_QMV_MAX_M;
  const int rows_x = min(int(MB_QMV_MAX_M), p.M - m0);

  float acc[MB_QMV_MAX_M * R];
  MB_UNROLL for (int i = 0; i < MB_QMV_MAX_M * R; ++i) acc[i] = 0.0f;

  for (int s = 0; s < p.nseg; ++s) {
#define MB_QMV_SEG(B)                                                                  \
  mb_qmv_segment<IO, SC, B>(x, perm, (const device uint8_t*)wqs[s], scs[s], bis[s], p, \
                            p.seg[s], xt, m0, rows_x, r0, last, lid, simd_lid, \
                            int(nsimd) * 32, acc)
    MB_QMM_SWITCH_BITS(p.seg[s].bits, MB_QMV_SEG)
#undef MB_QMV_SEG
  }

  MB_UNROLL for (int m = 0; m < MB_QMV_MAX_M; ++m) {
    if (m < rows_x) {
      MB_UNROLL for (int r = 0; r < R; ++r) {
        const float v = simd_sum(acc[m * R + r]);
        if (active && simd_lid == 0 && r <= last) {
          mb_qmm_store<IO>(acc_buf, out, p, size_t(m0 + m) * size_t(p.N) + size_t(row0 + r), v);
        }
      }
    }
  }
}

#define MB_QMV_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_qmv, io, sc)
MB_QMM_FUSED_LADDER(MB_QMV_INST, "qmv")
