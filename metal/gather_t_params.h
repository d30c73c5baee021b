// The contract between the gathered transposed kernels (gather_qmv_t.metal)
// and the host code that launches them (gather_t_host.h,
// cpp/gather/metal.cpp: MixedGatherQMMT::eval_gpu). Plain ints only, so the
// struct has one layout in Metal and in C++.
//
// The product is the gradient of the gathered matmul wrt x:
//   z[b, m, k]      = sum over pairs i with lhs[i] = b of
//                     sum_n dy[i, m, n] * W[rhs[i]][n, k]   (k in packed order)
//   dx[b, m, perm[k]] = z[b, m, k]                           (perm a permutation)
// for dy [pairs, M, N], x_batches dx matrices [M, K] and w_batches experts.
// Several pairs may name one dx matrix (an MoE token's top-k experts), so
// a threadgroup owns a block of one dx matrix and sums every pair that
// targets it, in a fixed order: no atomics, the same sum on every run.
// Whatever the segment count, ONE launch for few pairs (fused: the product
// groups them itself, each threadgroup reading all of lhs, rhs and perm,
// gt_fused in gather_t_host.h), otherwise two:
//   group    one threadgroup: the pairs grouped by lhs (order, bounds), bad
//            indices and (with a perm) the perm's case (MbPermStatus, the
//            dense product's three cases) in the status;
//   product  ONE dispatch over every segment (the segment table,
//            MbQmmFusedParams, as the dense transposed kernel's): each
//            threadgroup one 128-column block of one segment for all M rows
//            of one dx matrix, stored to dx through perm (a scatter: no
//            float32 z round trip, no unpermute launch).
#pragma once
#include "qmatmul_t_params.h"

struct MbGatherTParams {
  MbQmmFusedParams q;  // M rows per matrix, N, K, has_perm, the segments
  int x_batches;       // dx matrices; lhs[i] >= x_batches: every dx element NaN
  int w_batches;       // experts; rhs[i] >= w_batches: every dx element NaN
  int pairs;           // entries of lhs and rhs (dy matrices)
  int fused;           // the product groups the pairs itself (no grouping
                       // launch): every threadgroup reads all of lhs, rhs
                       // (and perm); the host's choice for few pairs
};

// Buffer indices, declaration order: the fixed slots, three per segment
// (8 segments: slots 6 .. 29), the parameter block last (all 31 of Metal's
// slots).
enum MbGatherTBuffer {
  MB_GT_DY = 0,       // [pairs, M, N] dy's dtype
  MB_GT_PERM = 1,     // int32 [K]; bound to out when there is no perm
  MB_GT_OUT = 2,      // [x_batches, M, K] dy's dtype: dx
  MB_GT_LHS = 3,      // uint32 [pairs]
  MB_GT_RHS = 4,      // uint32 [pairs]
  MB_GT_INDEX = 5,    // int32 scratch (gt_index_words): the status, the
                      // bounds [x_batches + 1], the order [pairs], then
                      // (with a perm) the inverse [K]
  MB_GT_WQ0 = 6,      // segment 0: uint32 [w_batches, N, kseg*bits/32]
  MB_GT_SCALES0 = 7,  // segment 0: [w_batches, N, kseg/group_size]
  MB_GT_BIASES0 = 8,  // segment 0: [w_batches, N, kseg/group_size]
  MB_GT_WQ1 = 9,
  MB_GT_SCALES1 = 10,
  MB_GT_BIASES1 = 11,
  MB_GT_WQ2 = 12,
  MB_GT_SCALES2 = 13,
  MB_GT_BIASES2 = 14,
  MB_GT_WQ3 = 15,
  MB_GT_SCALES3 = 16,
  MB_GT_BIASES3 = 17,
  MB_GT_WQ4 = 18,
  MB_GT_SCALES4 = 19,
  MB_GT_BIASES4 = 20,
  MB_GT_WQ5 = 21,
  MB_GT_SCALES5 = 22,
  MB_GT_BIASES5 = 23,
  MB_GT_WQ6 = 24,
  MB_GT_SCALES6 = 25,
  MB_GT_BIASES6 = 26,
  MB_GT_WQ7 = 27,
  MB_GT_SCALES7 = 28,
  MB_GT_BIASES7 = 29,
  MB_GT_PARAMS = 30,  // MbGatherTParams
};

enum MbGatherTShape {
  MB_GT_N_BUFFERS = 31,
  // group: one threadgroup; thread t owns a contiguous run of the
  // x_batches + 1 bins (the last one collects out-of-range lhs), counts
  // and places the pairs of its bins in index order (every thread reads
  // every lhs: O(pairs) per thread, no atomics).
  MB_GT_GROUP_THREADS = 256,
};

// The index scratch's layout (MB_GT_INDEX), in int32 words.
constexpr int mb_gt_bounds_at() { return 1; }
constexpr int mb_gt_order_at(int x_batches) { return 1 + x_batches + 1; }
constexpr int mb_gt_inv_at(int x_batches, int pairs) { return 1 + x_batches + 1 + pairs; }
// Pairs a fused product takes (MbGatherTParams.fused): its threadgroups
// keep the list of their dx matrix's pairs (index and expert) in
// threadgroup memory.
constexpr int MB_GT_FUSED_MAX_PAIRS = 256;
// Threadgroup memory of the product (one set of the dense kernel's
// roles), in 4-byte words: dy's stage, reused by the sums' reduction, then
// the block's perm entries; fused, then the threads' flags, the list of
// the matrix's pairs and their experts and (with a perm) the dense
// kernel's K-bit map (rounded up to 4 words: 16-byte units).
constexpr int mb_gt_tg_words(int M, int K = 0, int fused = 0, int has_perm = 0) {
  return (mb_qt_red_words(M, 1) + MB_QT_COLS +
          (fused ? MB_QT_THREADS + 2 * MB_GT_FUSED_MAX_PAIRS +
                       (has_perm ? mb_qt_map_words(K) : 0)
                 : 0) + 3) / 4 * 4;
}
