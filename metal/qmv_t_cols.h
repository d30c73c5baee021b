// The transposed product's work for one threadgroup, shared by the dense
// kernel (qmatmul_t.metal: dx = dy · W) and the gathered one
// (gather_qmv_t.metal: dx[lhs[i]] += dy[i] · W[rhs[i]]): one 128-column
// block of one K-segment, summed over the rows of W. The kernels differ
// only in which (dy row, matrix) products a block sums and where the
// result goes, so the decode, the per-thread sums and the reduction live
// here once. Included by .metal sources only (after mixbits_metal.h).
#pragma once
#include "qmatmul_common.h"
#include "qmatmul_t_params.h"

// Roles (qmatmul_t_params.h, MbQmvTShape): thread t owns the 16 columns
// of chunk t % 8 (block + 16 * chunk ..) and the rows n = t / 8 + 8 i.
// A column of W is a strided walk through the rows, so each thread decodes
// its chunk of each of its rows with mb_unpack8, the tiled forward's
// decode. The 16 columns lie in one group, so per row one scale and one
// bias apply and the bias term is one running sum, sum_n dy[n] b[n, g].
//
// Adds one (dy row, matrix) product to the thread's sums: dyr is the dy
// row (N values); w the thread's chunk in row 0 of the matrix's segment
// (the byte at column `col`); scales, biases row 0 of the matrix's
// segment; g the chunk's group. The caller checks col < kseg.
template <typename IO, typename SC, int bits, int group_size>
inline void mb_qmv_t_accumulate(const device typename IO::storage* dyr,
                                const device uint8_t* w,
                                const device typename SC::storage* scales,
                                const device typename SC::storage* biases, int N,
                                size_t row_bytes, size_t groups, size_t g, int slice,
                                thread float* acc, thread float& bsum) {
  uint32_t codes[MB_CHUNK];
  for (int n = slice; n < N; n += MB_QT_SLICES) {
    const float d = IO::load(dyr[n]);
    const float a = d * SC::load(scales[size_t(n) * groups + g]);
    bsum += d * SC::load(biases[size_t(n) * groups + g]);
    const device uint8_t* wr = w + size_t(n) * row_bytes;
    mb_unpack8<bits>(wr, codes);
    mb_unpack8<bits>(wr + bits, codes + 8);  // 8 codes are `bits` bytes
    MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) acc[i] += a * float(codes[i]);
  }
}

// Meets the 8 slices' sums in threadgroup memory (red: MB_QT_TG_FLOATS)
// and stores the block's columns of output row `row`: each thread finishes
// 2 columns, adding the slices in a fixed order. With a permutation
// (p.has_perm) the float32 z in packed column order, for the unpermute
// launch; without one dx in dy's dtype. Every thread of the threadgroup
// must call this (barrier).
template <typename IO>
inline void mb_qmv_t_finish(threadgroup float* red, thread const float* acc, float bsum,
                            int slice, int chunk, uint lid, int block,
                            constant MbQmvTParams& p, size_t row, device float* z,
                            device typename IO::storage* out) {
  MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
    red[slice * MB_QT_COLS + MB_CHUNK * chunk + i] = acc[i] + bsum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int c = int(lid); c < MB_QT_COLS; c += MB_QT_THREADS) {
    if (block + c >= p.kseg) break;
    float v = 0.0f;
    MB_UNROLL for (int s = 0; s < MB_QT_SLICES; ++s) v += red[s * MB_QT_COLS + c];
    const size_t idx = row * size_t(p.K) + size_t(p.k0 + block + c);
    if (p.has_perm) {
      z[idx] = v;
    } else {
      out[idx] = IO::store(v);
    }
  }
}
