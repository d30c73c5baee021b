// The contract between the transposed quantized-matmul kernels
// (qmatmul_t.metal) and the host code that launches them (qmatmul_t_host.h,
// cpp/qmatmul/metal.cpp: MixedQMatmulT::eval_gpu): buffer indices, the
// work split and the parameter block. Plain ints only, so the struct has
// one layout in Metal and in C++.
//
// The product is dx = dy · W, un-permuted, for dy [M, N] and the [N, K]
// mixed-segment W (the gradient of y = x[:, perm] · Wᵀ wrt x):
//   z[m, k]          = sum_n dy[m, n] * W[n, k]      (k in packed order)
//   dx[m, perm[k]]  += z[m, k]                       (perm a permutation)
// With a permutation there are three kinds of launch, in order:
//   perm_check  one threadgroup: validates perm and builds its inverse;
//   qmv_t       one per K-segment: z for that segment's columns;
//   unpermute   dx from z, inverse and status.
// Without one, each segment's qmv_t writes dx directly. Segments own
// disjoint columns, so unlike the forward no partial sum crosses dispatches.
#pragma once

struct MbQmvTParams {
  int M;         // rows of dy (leading dims flattened)
  int N;         // rows of W = columns of dy
  int K;         // columns of W, all segments
  int k0;        // first column of this segment, in packed order
  int kseg;      // columns of this segment
  int has_perm;  // 1: qmv_t writes z (float32), 0: dx (dy's dtype)
};

// What perm_check finds (status[0]); the CPU primitive's three cases
// (cpp/qmatmul/transposed.cpp), which unpermute reproduces.
enum MbPermStatus {
  MB_PERM_BIJECTIVE = 0,    // dx[m, j] = z[m, inv[j]]
  MB_PERM_REPEATS = 1,      // in range, some j hit twice: repeated columns sum
  MB_PERM_OUT_OF_RANGE = 2, // some entry outside [0, K): every row NaN
};

// Buffer indices ([[buffer(i)]]), one numbering for the three kernels.
enum MbQmvTBuffer {
  MB_QT_DY = 0,      // [M, N] dy's dtype
  MB_QT_PERM = 1,    // int32 [K]
  MB_QT_WQ = 2,      // uint32 [N, kseg*bits/32]
  MB_QT_SCALES = 3,  // [N, kseg/group_size]
  MB_QT_BIASES = 4,  // [N, kseg/group_size]
  MB_QT_INV = 5,     // int32 [K] scratch: inverse permutation
  MB_QT_STATUS = 6,  // int32 [1] scratch: MbPermStatus
  MB_QT_Z = 7,       // float32 [M, K] scratch: z in packed order
  MB_QT_OUT = 8,     // [M, K] dy's dtype: dx
  MB_QT_PARAMS = 9,  // MbQmvTParams
};

enum MbQmvTShape {
  // qmv_t: a threadgroup owns MB_QT_COLS columns of one dy row: 8 chunks of
  // 16 codes (MB_CHUNK, byte-aligned for every width and inside one group)
  // x 8 row slices. Thread t decodes chunk t % 8 of rows n = t / 8 + 8 i,
  // so each packed word of the block is read once per threadgroup, and the
  // 8 slices' sums meet in threadgroup memory.
  MB_QT_CHUNKS = 8,
  MB_QT_SLICES = 8,
  MB_QT_THREADS = 64,
  MB_QT_COLS = 128,
  MB_QT_TG_FLOATS = 8 * 128,
  // perm_check: one threadgroup; unpermute: one output column per thread.
  MB_QT_CHECK_THREADS = 256,
  MB_QT_UNPERM_THREADS = 64,
  // Up to this many rows of dy, the gradient on a GPU stream runs these
  // kernels; above it, dequantize + MLX's GEMM (grad.cpp): qmv_t keeps one
  // dy row per threadgroup and re-decodes W for every row, which a GEMM on
  // the dequantized W amortizes once M grows.
  MB_QT_MAX_M = 8,
};
