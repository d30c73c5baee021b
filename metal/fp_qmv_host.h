// Host side of the fp-mode GEMV (fp_qmv.metal), in plain C++: kernel name,
// grid, parameters and the buffers the launch binds. Used by
// cpp/fpmatmul/metal.cpp on macOS and by the emulator harness on Linux
// (tests/metal/harness_fp.cpp), so the launch the Mac runs is the one the
// tests exercise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fp_qmv_params.h"
#include "kernel_args.h"

namespace mixbits::metal_host {

struct FpQmvLaunch : Launch {
  MbFpQmvParams params;
};

inline const char* fp_mode_metal_name(int mode) {
  return mode == MB_FP_MXFP4 ? "mxfp4" : mode == MB_FP_NVFP4 ? "nvfp4" : "mxfp8";
}
inline int fp_mode_metal_bits(int mode) { return mode == MB_FP_MXFP8 ? 8 : 4; }
inline int fp_mode_metal_group(int mode) { return mode == MB_FP_NVFP4 ? 16 : 32; }

// mixbits_fp_qmv_<mode>_<x dtype>, as fp_qmv.metal instantiates them.
inline std::string fp_qmv_kernel_name(int mode, ActType t) {
  return std::string("mixbits_fp_qmv_") + fp_mode_metal_name(mode) + "_" + act_type_name(t);
}

// Whether the GEMV takes a problem of M rows of x (the node is built for
// the GPU only then; Python routes the rest to MLX's op) and N, K that fit
// its int parameters.
inline bool fp_qmv_applies(int64_t M, int64_t N, int64_t K) {
  const int64_t lim = 0x7fffffff;
  return M >= 1 && M <= MB_FPQ_MAX_M && N <= lim && K <= lim;
}

// One launch: M rows of x (contiguous, K columns), N outputs. Arguments
// are assumed validated (cpp/fpmatmul/fpmatmul.cpp); a plan the kernel
// cannot run throws std::invalid_argument.
inline FpQmvLaunch plan_fp_qmv(int M, int N, int K, int mode, ActType xt) {
  if (mode < MB_FP_MXFP4 || mode > MB_FP_MXFP8)
    throw std::invalid_argument("plan_fp_qmv: unknown mode");
  if (M <= 0 || N <= 0 || K <= 0) throw std::invalid_argument("plan_fp_qmv: empty problem");
  if (!fp_qmv_applies(M, N, K))
    throw std::invalid_argument("plan_fp_qmv: more than " + std::to_string(MB_FPQ_MAX_M) +
                                " rows of x (MLX's op runs those)");
  const int group = fp_mode_metal_group(mode);
  if (K % group != 0)
    throw std::invalid_argument("plan_fp_qmv: K is not a multiple of the group size");
  FpQmvLaunch l;
  l.kernel = fp_qmv_kernel_name(mode, xt);
  l.params.M = M;
  l.params.N = N;
  l.params.K = K;
  l.grid[0] = uint32_t(M);
  l.grid[1] = uint32_t((N + MB_FPQ_ROWS_PER_GROUP - 1) / MB_FPQ_ROWS_PER_GROUP);
  l.grid[2] = 1;
  l.group[0] = MB_FPQ_THREADS;
  l.group[1] = l.group[2] = 1;
  l.threadgroup_bytes = 0;
  const size_t n = size_t(N), k = size_t(K), m = size_t(M);
  l.buffers = {
      {"x", MB_FPQ_X, Dir::In, elem_of(xt), m * k, -1},
      {"wq", MB_FPQ_WQ, Dir::In, Elem::U32, n * k * size_t(fp_mode_metal_bits(mode)) / 32, -1},
      {"scales", MB_FPQ_SCALES, Dir::In, Elem::U8, n * (k / size_t(group)), -1},
      {"out", MB_FPQ_OUT, Dir::Out, elem_of(xt), m * n, -1},
  };
  l.params_index = MB_FPQ_PARAMS;
  return l;
}

}  // namespace mixbits::metal_host
