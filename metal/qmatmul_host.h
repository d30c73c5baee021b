// Host side of the Metal quantized matmul, in plain C++: which kernel runs
// for which segment, with which parameters and grid. Used by
// cpp/qmatmul/metal.cpp on macOS and by the emulator tests on Linux, so the
// launch logic the Mac runs is the one the tests exercise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "qmatmul_params.h"

namespace mixbits::metal_host {

enum class ActType { F32 = 0, F16 = 1, BF16 = 2 };

inline const char* act_type_name(ActType t) {
  switch (t) {
    case ActType::F32: return "float32";
    case ActType::F16: return "float16";
    default: return "bfloat16";
  }
}

struct QmmSegment {
  int bits;
  int group_size;
  int k;
};

enum class QmmPath { Auto = 0, Gemv = 1, Tiled = 2 };

struct Launch {
  std::string kernel;
  uint32_t grid[3];           // threadgroups per grid
  uint32_t group[3];          // threads per threadgroup
  size_t threadgroup_bytes;   // length of [[threadgroup(0)]], 0 if none
};

struct QmmLaunch : Launch {
  MbQmmParams params;
  int segment;
  bool tiled;
};

inline std::string qmm_kernel_name(bool tiled, ActType t, int bits, int gs) {
  return std::string(tiled ? "mixbits_qmm_" : "mixbits_qmv_") +
         act_type_name(t) + "_b" + std::to_string(bits) + "_g" +
         std::to_string(gs);
}

inline bool qmm_uses_tiled(int M, QmmPath path) {
  return path == QmmPath::Tiled || (path == QmmPath::Auto && M > MB_QMV_MAX_M);
}

// More than one segment: the dispatches pass a float32 [M, N] partial sum.
inline bool qmm_needs_acc(size_t n_segments) { return n_segments > 1; }

// One launch per segment, in order. M rows of x (contiguous, K columns),
// N outputs. Arguments are assumed validated (cpp/qmatmul/qmatmul.cpp).
inline std::vector<QmmLaunch> plan_qmm(int M, int N,
                                       const std::vector<QmmSegment>& segs,
                                       ActType xt, int scale_type,
                                       bool has_perm,
                                       QmmPath path = QmmPath::Auto) {
  if (M <= 0 || N <= 0 || segs.empty())
    throw std::invalid_argument("plan_qmm: empty problem");
  int K = 0;
  for (const auto& s : segs) K += s.k;
  const bool tiled = qmm_uses_tiled(M, path);
  std::vector<QmmLaunch> out;
  int k0 = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const QmmSegment& s = segs[i];
    QmmLaunch l;
    l.kernel = qmm_kernel_name(tiled, xt, s.bits, s.group_size);
    l.params.M = M;
    l.params.N = N;
    l.params.K = K;
    l.params.k0 = k0;
    l.params.kseg = s.k;
    l.params.has_perm = has_perm ? 1 : 0;
    l.params.accumulate = i > 0 ? 1 : 0;
    l.params.write_out = i + 1 == segs.size() ? 1 : 0;
    l.params.scale_type = scale_type;
    if (tiled) {
      l.grid[0] = uint32_t((N + MB_QMM_BN - 1) / MB_QMM_BN);
      l.grid[1] = uint32_t((M + MB_QMM_BM - 1) / MB_QMM_BM);
      l.group[0] = MB_QMM_THREADS;
      l.threadgroup_bytes = size_t(MB_QMM_TG_FLOATS) * sizeof(float);
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
    out.push_back(l);
    k0 += s.k;
  }
  return out;
}

}  // namespace mixbits::metal_host
