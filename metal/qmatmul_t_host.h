// Host side of the Metal transposed quantized matmul (qmatmul_t.metal), in
// plain C++: which kernels run, in which order, with which parameters,
// grids and buffers. Used by MixedQMatmulT::eval_gpu (cpp/qmatmul/metal.cpp)
// on macOS and by the emulator harness (tests/metal/harness_t.cpp) on
// Linux, so the launch logic the Mac runs is the one the tests exercise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_args.h"
#include "qmatmul_host.h"
#include "qmatmul_t_params.h"

namespace mixbits::metal_host {

static_assert(sizeof(MbQmvTParams) == 6 * sizeof(int),
              "MbQmvTParams is plain ints, laid out alike in Metal and C++");
static_assert(MB_QT_THREADS == MB_QT_CHUNKS * MB_QT_SLICES &&
                  MB_QT_COLS == MB_QT_CHUNKS * 16 && MB_QT_COLS % 128 == 0 &&
                  MB_QT_TG_FLOATS == MB_QT_SLICES * MB_QT_COLS,
              "qmatmul_t.metal's roles: 8 chunks of 16 columns x 8 row slices, "
              "blocks of whole groups, one float per slice and column");
static_assert(size_t(MB_QT_TG_FLOATS) * 4 <= kMaxThreadgroupBytes &&
                  size_t(MB_QT_CHECK_THREADS) * 4 <= kMaxThreadgroupBytes,
              "threadgroup memory within Metal's 32 KiB");

enum class QtKind { PermCheck, Product, Unpermute };

struct QtLaunch : Launch {
  MbQmvTParams params;
  QtKind kind;
  int segment;  // Product only; -1 otherwise
};

// Whether eval_gpu's kernels apply: few rows (MB_QT_MAX_M; above it the
// gradient uses dequantize + GEMM) and 32-bit parameters. mixed_qmatmul_t
// refuses a GPU stream otherwise.
inline bool qmv_t_gpu_applies(int64_t M, int64_t N, int64_t K) {
  const int64_t lim = 0x7fffffff;
  return M <= MB_QT_MAX_M && N <= lim && K <= lim && int64_t(M) * K <= lim;
}

// The launches for dy [M, N] (dense) and the segments. Arguments are
// assumed validated (mixed_qmatmul_t); N may be 0 (dx is then 0).
inline std::vector<QtLaunch> plan_qmv_t(int M, int N, const std::vector<QmmSegment>& segs,
                                        ActType xt, int scale_type, bool has_perm) {
  if (M <= 0 || N < 0 || segs.empty())
    throw std::invalid_argument("plan_qmv_t: empty problem");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_qmv_t: unknown scale dtype");
  int K = 0;
  for (const auto& s : segs) K += s.k;
  const size_t MK = size_t(M) * size_t(K);
  const size_t p = has_perm ? 1 : 0;  // a scratch or perm count, or 0 when unused
  const Elem xe = elem_of(xt), se = elem_of(scale_act_type(scale_type));
  // Every slot of every launch is described (bind order); a slot a launch
  // leaves alone gets `stand`, a buffer that launch writes (fresh, offset 0).
  auto buffers = [&](size_t dy, size_t wq, size_t sb, size_t inv, size_t st, size_t z,
                     size_t out, int stand) {
    auto slot = [&](const char* name, int i, Dir d, Elem e, size_t n) {
      return BufferArg{name, i, d, e, n, n ? -1 : stand};
    };
    const bool check = st && inv && !z;  // perm_check writes inv and status
    const Dir scratch = check ? Dir::Out : Dir::In;
    return std::vector<BufferArg>{
        slot("dy", MB_QT_DY, Dir::In, xe, dy),
        slot("perm", MB_QT_PERM, Dir::In, Elem::I32, inv ? size_t(K) : 0),
        slot("wq", MB_QT_WQ, Dir::In, Elem::U32, wq),
        slot("scales", MB_QT_SCALES, Dir::In, se, sb),
        slot("biases", MB_QT_BIASES, Dir::In, se, sb),
        slot("inv", MB_QT_INV, scratch, Elem::I32, inv),
        slot("status", MB_QT_STATUS, scratch, Elem::I32, st),
        slot("z", MB_QT_Z, out ? Dir::In : Dir::Out, Elem::F32, z),
        slot("out", MB_QT_OUT, Dir::Out, xe, out),
    };
  };
  auto base = [&](QtKind kind) {
    QtLaunch l;
    l.kind = kind;
    l.segment = -1;
    l.params = MbQmvTParams{M, N, K, 0, K, has_perm ? 1 : 0};
    l.grid[1] = uint32_t(M);
    l.grid[2] = 1;
    l.group[1] = l.group[2] = 1;
    l.threadgroup_bytes = 0;
    l.params_index = MB_QT_PARAMS;
    return l;
  };

  std::vector<QtLaunch> plan;
  if (has_perm) {
    QtLaunch l = base(QtKind::PermCheck);
    l.kernel = "mixbits_qmv_t_perm_check";
    l.grid[0] = l.grid[1] = 1;
    l.group[0] = MB_QT_CHECK_THREADS;
    l.threadgroup_bytes = size_t(MB_QT_CHECK_THREADS) * sizeof(int32_t);
    l.buffers = buffers(0, 0, 0, K, 1, 0, 0, MB_QT_STATUS);
    plan.push_back(l);
  }
  int k0 = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const QmmSegment& s = segs[i];
    QtLaunch l = base(QtKind::Product);
    l.kernel = ladder_kernel_name("qmv_t", xt, scale_type, s.bits, s.group_size);
    l.segment = int(i);
    l.params.k0 = k0;
    l.params.kseg = s.k;
    l.grid[0] = uint32_t((s.k + MB_QT_COLS - 1) / MB_QT_COLS);
    l.group[0] = MB_QT_THREADS;
    l.threadgroup_bytes = size_t(MB_QT_TG_FLOATS) * sizeof(float);
    const size_t groups = size_t(N) * size_t(s.k / s.group_size);
    const size_t words = size_t(N) * size_t(s.k) * s.bits / 32;
    l.buffers = buffers(size_t(M) * size_t(N), words, groups, 0, 0, p * MK, (1 - p) * MK,
                        has_perm ? MB_QT_Z : MB_QT_OUT);
    plan.push_back(l);
    k0 += s.k;
  }
  if (has_perm) {
    QtLaunch l = base(QtKind::Unpermute);
    l.kernel = std::string("mixbits_qmv_t_unpermute_") + act_type_name(xt);
    l.grid[0] = uint32_t((K + MB_QT_UNPERM_THREADS - 1) / MB_QT_UNPERM_THREADS);
    l.group[0] = MB_QT_UNPERM_THREADS;
    l.buffers = buffers(0, 0, 0, K, 1, MK, MK, MB_QT_OUT);
    plan.push_back(l);
  }
  return plan;
}

}  // namespace mixbits::metal_host
