// The contract between the fp-mode GEMV (fp_qmv.metal) and the host code
// that launches it (fp_qmv_host.h, cpp/fpmatmul/metal.cpp): buffer indices,
// shape constants and the parameter block. Plain ints only, so the struct
// has one layout in Metal and in C++.
#pragma once

// MLX's floating-point quantization modes, as FpMode (cpp/fpmatmul/kernel.h)
// numbers them: the kernel is a template over this value.
enum MbFpMode { MB_FP_MXFP4 = 0, MB_FP_NVFP4 = 1, MB_FP_MXFP8 = 2 };

struct MbFpQmvParams {
  int M;  // rows of x (leading dims flattened)
  int N;  // output features (rows of W)
  int K;  // columns of x and W, a multiple of the mode's group size
};

enum MbFpQmvBuffer {
  MB_FPQ_X = 0,       // activations [M, K], float32 / float16 / bfloat16
  MB_FPQ_WQ = 1,      // uint32 [N, K * bits / 32], codes LSB first
  MB_FPQ_SCALES = 2,  // uint8 [N, K / group]: e8m0 (mxfp4, mxfp8) or e4m3 (nvfp4)
  MB_FPQ_OUT = 3,     // [M, N], x's dtype
  MB_FPQ_PARAMS = 4,  // MbFpQmvParams
};

enum MbFpQmvShape {
  // 2 simdgroups x 32 lanes, 4 output rows per simdgroup; a lane takes 16
  // consecutive columns per step (within one group: every group size is a
  // multiple of 16 and the chunks start at multiples of 16), a simdgroup
  // 512 columns per step.
  MB_FPQ_SIMDGROUPS = 2,
  MB_FPQ_ROWS_PER_SIMDGROUP = 4,
  MB_FPQ_ROWS_PER_GROUP = 8,
  MB_FPQ_THREADS = 64,
  MB_FPQ_CHUNK = 16,
  // Up to this many rows of x the GEMV runs; above it MLX's own op.
  MB_FPQ_MAX_M = 8,
};
