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
// a threadgroup owns a block of one dx row and sums every pair that targets
// it, in a fixed order: no atomics, the same sum on every run. The launches,
// in order:
//   perm_check  (with a perm) qmatmul_t.metal's, unchanged: inverse + status;
//   group       one threadgroup: the pairs grouped by lhs (order, bounds),
//               and bad indices folded into the status;
//   product     one per K-segment: z (with a perm) or dx (without);
//   unpermute   (with a perm) qmatmul_t.metal's, over the Bx·M rows of z.
#pragma once
#include "qmatmul_t_params.h"

struct MbGatherTParams {
  MbQmvTParams q;  // as for the dense product: M rows per matrix, N, K, the
                   // segment (k0, kseg), has_perm. First, so the shared
                   // perm_check and unpermute read their block from it.
  int x_batches;   // dx matrices; lhs[i] >= x_batches: every dx element NaN
  int w_batches;   // experts; rhs[i] >= w_batches: every dx element NaN
  int pairs;       // entries of lhs and rhs (dy matrices)
};

// Buffer indices. 0 .. 8 are MbQmvTBuffer's, so the shared perm_check and
// unpermute bind the same scratch buffers (inv, status, z, out) at the
// same slots; the parameter block is last here, at 13 (the shared kernels
// take theirs at MB_QT_PARAMS = 9, where this numbering has lhs).
enum MbGatherTBuffer {
  MB_GT_DY = 0,       // [pairs, M, N] dy's dtype
  MB_GT_PERM = 1,     // int32 [K]
  MB_GT_WQ = 2,       // uint32 [w_batches, N, kseg*bits/32]
  MB_GT_SCALES = 3,   // [w_batches, N, kseg/group_size]
  MB_GT_BIASES = 4,   // [w_batches, N, kseg/group_size]
  MB_GT_INV = 5,      // int32 [K] scratch: inverse permutation
  MB_GT_STATUS = 6,   // int32 [1] scratch: MbPermStatus, bad indices as OUT_OF_RANGE
  MB_GT_Z = 7,        // float32 [x_batches, M, K] scratch: z in packed order
  MB_GT_OUT = 8,      // [x_batches, M, K] dy's dtype: dx
  MB_GT_LHS = 9,      // uint32 [pairs]
  MB_GT_RHS = 10,     // uint32 [pairs]
  MB_GT_ORDER = 11,   // int32 [pairs] scratch: pair indices grouped by lhs
  MB_GT_BOUNDS = 12,  // int32 [x_batches + 1] scratch: bin b is order[bounds[b-1] .. bounds[b])
  MB_GT_PARAMS = 13,  // MbGatherTParams
};

enum MbGatherTShape {
  // group: one threadgroup; thread t owns a contiguous run of the
  // x_batches + 1 bins (the last one collects out-of-range lhs), counts
  // and places the pairs of its bins in index order (every thread reads
  // every lhs: O(pairs) per thread, no atomics).
  MB_GT_GROUP_THREADS = 256,
};
