// The contract between the quantized-matmul kernels (qmatmul_gemv.metal,
// qmatmul_tiled.metal) and the host code that launches them (qmatmul_host.h,
// cpp/qmatmul/metal.cpp): buffer indices, tile shapes and the per-dispatch
// parameter block. Plain ints only, so the struct has one layout in Metal
// and in C++.
#pragma once

// dtype of scales and biases. It may differ from x's; it picks the kernel
// instantiation (qmm_kernel_name), the kernels never switch on it.
enum MbScaleType { MB_SCALE_F32 = 0, MB_SCALE_F16 = 1, MB_SCALE_BF16 = 2 };

// One dispatch computes the contribution of ONE K-segment:
//   part[m, n] = sum_{j < kseg} x[m, col(k0 + j)] * W_seg[n, j]
// with col(k) = perm[k] when has_perm, else k. With several segments the
// dispatches run in order: the first writes float32 acc, the next ones add
// to it, the last adds and writes `out` in the activation dtype.
struct MbQmmParams {
  int M;            // rows of x (leading dims flattened)
  int N;            // output features
  int K;            // columns of x (all segments)
  int k0;           // first column of this segment, in permuted order
  int kseg;         // columns of this segment
  int has_perm;     // gather x through perm
  int accumulate;   // add acc[m, n] (float32) to the result
  int write_out;    // 1: store to out (activation dtype); 0: store to acc
};

// Buffer indices ([[buffer(i)]]), the same for both kernels.
enum MbQmmBuffer {
  MB_QMM_X = 0,       // activations [M, K]
  MB_QMM_PERM = 1,    // int32 [K]; bound to x when there is no perm
  MB_QMM_WQ = 2,      // uint32 [N, kseg*bits/32]
  MB_QMM_SCALES = 3,  // [N, kseg/group_size]
  MB_QMM_BIASES = 4,  // [N, kseg/group_size]
  MB_QMM_ACC = 5,     // float32 [M, N]; bound to out when unused
  MB_QMM_OUT = 6,     // [M, N] activation dtype
  MB_QMM_PARAMS = 7,  // MbQmmParams
};

enum MbQmmShape {
  // GEMV (qmv): 2 simdgroups x 32 lanes, 4 output rows per simdgroup; each
  // lane reads 16 consecutive codes per step, a simdgroup 512 columns.
  MB_QMV_SIMDGROUPS = 2,
  MB_QMV_ROWS_PER_SIMDGROUP = 4,
  MB_QMV_ROWS_PER_GROUP = 8,
  MB_QMV_THREADS = 64,
  // Up to this many rows of x, GEMV is used; above it, the tiled kernel.
  MB_QMV_MAX_M = 8,
  // Tiled (qmm): a BM x BN block of outputs per threadgroup of 4
  // simdgroups (2 x 2, each a 16 x 16 block: 2 x 2 simdgroup_float8x8
  // accumulators), K walked in steps of BK = 32 (the smallest group size,
  // so one BK step of one row lies in one group). Each step stages x and
  // dequantized W in threadgroup memory as float, rows padded by 4 floats
  // (16 bytes, as MLX pads) to spread banks and keep rows 16-byte aligned;
  // the output tile is staged in the x tile's space at the end.
  MB_QMM_BM = 32,
  MB_QMM_BN = 32,
  MB_QMM_BK = 32,
  MB_QMM_SIMDGROUPS = 4,
  MB_QMM_THREADS = 128,
  MB_QMM_TILE_STRIDE = 36,
  MB_QMM_TG_FLOATS = (32 + 32) * 36,
};
