// The contract between the gathered kernels (gather_qmv.metal, the GEMV;
// gather_qmm.metal, the tiled one) and the host code that launches them
// (gather_host.h, cpp/gather/metal.cpp): buffer indices and the
// per-dispatch parameter block, the same for both kernels. Plain ints
// only, so the struct has one layout in Metal and in C++.
#pragma once
#include "qmatmul_params.h"

// One dispatch computes ONE K-segment's contribution to every output matrix
//   out[i] = x[lhs[i]] · W[rhs[i]]ᵀ,  i < pairs (grid z),
// for x [x_batches, M, K] and each segment's arrays [w_batches, N, ...]
// (MixedGatherQMM's inputs, dense). `q` describes one x matrix against one
// weight matrix exactly as for the dense matmul (M, N, K, the segment, the
// partial-sum flags); acc and out are [pairs, M, N].
struct MbGatherParams {
  MbQmmParams q;
  int x_batches;  // lhs[i] >= x_batches: output matrix i is NaN
  int w_batches;  // rhs[i] >= w_batches: output matrix i is NaN
  int pairs;      // entries of lhs and rhs (output matrices)
  int block_rows; // GEMV: flat output rows per threadgroup (<= MB_QMV_MAX_M)
};

// Buffer indices ([[buffer(i)]]).
enum MbGatherBuffer {
  MB_GATHER_X = 0,       // activations [x_batches, M, K]
  MB_GATHER_PERM = 1,    // int32 [K]; bound to out when there is no perm
  MB_GATHER_WQ = 2,      // uint32 [w_batches, N, kseg*bits/32]
  MB_GATHER_SCALES = 3,  // [w_batches, N, kseg/group_size]
  MB_GATHER_BIASES = 4,  // [w_batches, N, kseg/group_size]
  MB_GATHER_LHS = 5,     // uint32 [pairs]
  MB_GATHER_RHS = 6,     // uint32 [pairs]
  MB_GATHER_ACC = 7,     // float32 [pairs, M, N]; bound to out when unused
  MB_GATHER_OUT = 8,     // [pairs, M, N] activation dtype
  MB_GATHER_PARAMS = 9,  // MbGatherParams
};
