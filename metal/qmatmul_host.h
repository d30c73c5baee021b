// Host side of the Metal quantized matmul, in plain C++: which kernel runs
// for which segment, with which parameters, grid and buffers. Used by
// cpp/qmatmul/metal.cpp on macOS and by the emulator tests on Linux, so the
// launch logic the Mac runs is the one the tests exercise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_args.h"
#include "qmatmul_params.h"

namespace mixbits::metal_host {

struct QmmSegment {
  int bits;
  int group_size;
  int k;
};

enum class QmmPath { Auto = 0, Gemv = 1, Tiled = 2 };

struct QmmLaunch : Launch {
  MbQmmParams params;
  int segment;
  bool tiled;
};

// Threadgroup memory a kernel may use: Metal guarantees 32 KiB on every
// Apple GPU MLX supports (maxThreadgroupMemoryLength).
constexpr size_t kMaxThreadgroupBytes = 32 * 1024;
constexpr size_t kQmmThreadgroupBytes = size_t(MB_QMM_TG_FLOATS) * sizeof(float);
static_assert(kQmmThreadgroupBytes <= kMaxThreadgroupBytes,
              "the tiled kernel's tiles exceed 32 KiB of threadgroup memory");
static_assert(MB_QMM_TG_FLOATS >= (MB_QMM_BM + MB_QMM_BN) * MB_QMM_TILE_STRIDE &&
                  MB_QMM_TILE_STRIDE >= MB_QMM_BK && MB_QMM_TILE_STRIDE >= MB_QMM_BN &&
                  MB_QMM_TILE_STRIDE % 4 == 0,
              "x and W tiles (and the output tile staged in the x tile) fit, rows 16-byte aligned");
static_assert(MB_QMM_THREADS == 32 * MB_QMM_SIMDGROUPS && MB_QMM_SIMDGROUPS == 4 &&
                  MB_QMM_BM == 32 && MB_QMM_BN == 32 && MB_QMM_THREADS * 8 == MB_QMM_BM * MB_QMM_BK,
              "qmatmul_tiled.metal's roles: 2 x 2 simdgroups of 16 x 16, 8 values per thread");

inline ActType scale_act_type(int scale_type) {
  return scale_type == MB_SCALE_F32   ? ActType::F32
         : scale_type == MB_SCALE_F16 ? ActType::F16
                                      : ActType::BF16;
}

// mixbits_<kind>_<x dtype>_<scale dtype>_b<bits>_g<gs>, as instantiated by
// MB_QMM_LADDER (qmatmul_common.h).
inline std::string ladder_kernel_name(const char* kind, ActType t, int scale_type, int bits,
                                      int gs) {
  return std::string("mixbits_") + kind + "_" + act_type_name(t) + "_" +
         act_type_name(scale_act_type(scale_type)) + "_b" + std::to_string(bits) + "_g" +
         std::to_string(gs);
}

inline std::string qmm_kernel_name(bool tiled, ActType t, int scale_type, int bits, int gs) {
  return ladder_kernel_name(tiled ? "qmm" : "qmv", t, scale_type, bits, gs);
}

inline bool qmm_uses_tiled(int M, QmmPath path) {
  return path == QmmPath::Tiled || (path == QmmPath::Auto && M > MB_QMV_MAX_M);
}

// More than one segment: the dispatches pass a float32 [M, N] partial sum.
inline bool qmm_needs_acc(size_t n_segments) { return n_segments > 1; }

// Why the Metal kernels cannot run a problem ("" if they can): their
// parameters are int32. Checked when the graph node is built
// (cpp/qmatmul/qmatmul.cpp), so eval_gpu never meets such a problem.
inline std::string qmm_gpu_refusal(int64_t M, int64_t N, int64_t K) {
  const int64_t lim = 0x7fffffff;
  if (M > lim) return "x has more than 2^31-1 rows for the GPU kernels";
  if (N > lim || K > lim) return "the weight is too large for the GPU kernels";
  return "";
}

// One launch per segment, in order. M rows of x (contiguous, K columns),
// N outputs. Arguments are assumed validated (cpp/qmatmul/qmatmul.cpp).
inline std::vector<QmmLaunch> plan_qmm(int M, int N,
                                       const std::vector<QmmSegment>& segs,
                                       ActType xt, int scale_type,
                                       bool has_perm,
                                       QmmPath path = QmmPath::Auto) {
  if (M <= 0 || N <= 0 || segs.empty())
    throw std::invalid_argument("plan_qmm: empty problem");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_qmm: unknown scale dtype");
  int K = 0;
  for (const auto& s : segs) K += s.k;
  const bool tiled = qmm_uses_tiled(M, path);
  std::vector<QmmLaunch> out;
  int k0 = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const QmmSegment& s = segs[i];
    QmmLaunch l;
    l.kernel = qmm_kernel_name(tiled, xt, scale_type, s.bits, s.group_size);
    l.params.M = M;
    l.params.N = N;
    l.params.K = K;
    l.params.k0 = k0;
    l.params.kseg = s.k;
    l.params.has_perm = has_perm ? 1 : 0;
    l.params.accumulate = i > 0 ? 1 : 0;
    l.params.write_out = i + 1 == segs.size() ? 1 : 0;
    if (tiled) {
      l.grid[0] = uint32_t((N + MB_QMM_BN - 1) / MB_QMM_BN);
      l.grid[1] = uint32_t((M + MB_QMM_BM - 1) / MB_QMM_BM);
      l.group[0] = MB_QMM_THREADS;
      l.threadgroup_bytes = kQmmThreadgroupBytes;
    } else {
      l.grid[0] = uint32_t(M);
      l.grid[1] = uint32_t((N + MB_QMV_ROWS_PER_GROUP - 1) / MB_QMV_ROWS_PER_GROUP);
      l.group[0] = MB_QMV_THREADS;
      l.threadgroup_bytes = 0;
    }
    l.grid[2] = 1;
    l.group[1] = l.group[2] = 1;
    l.segment = int(i);
    l.tiled = tiled;
    const size_t mk = size_t(M) * size_t(K), mn = size_t(M) * size_t(N);
    const size_t groups = size_t(N) * size_t(s.k / s.group_size);
    const Elem se = elem_of(scale_act_type(scale_type));
    const bool acc = qmm_needs_acc(segs.size());
    // Unused slots get `out` (freshly allocated: offset 0, aligned).
    l.buffers = {
        {"x", MB_QMM_X, Dir::In, elem_of(xt), mk, -1},
        {"perm", MB_QMM_PERM, Dir::In, Elem::I32, has_perm ? size_t(K) : 0,
         has_perm ? -1 : MB_QMM_OUT},
        {"wq", MB_QMM_WQ, Dir::In, Elem::U32, size_t(N) * size_t(s.k) * s.bits / 32, -1},
        {"scales", MB_QMM_SCALES, Dir::In, se, groups, -1},
        {"biases", MB_QMM_BIASES, Dir::In, se, groups, -1},
        {"acc", MB_QMM_ACC, Dir::Out, Elem::F32, acc ? mn : 0, acc ? -1 : MB_QMM_OUT},
        {"out", MB_QMM_OUT, Dir::Out, elem_of(xt), mn, -1},
    };
    l.params_index = MB_QMM_PARAMS;
    out.push_back(l);
    k0 += s.k;
  }
  return out;
}

}  // namespace mixbits::metal_host
