// Host side of the Metal gathered transposed product (gather_qmv_t.metal),
// in plain C++: which kernels run, in which order, with which parameters,
// grids and buffers. Used by MixedGatherQMMT::eval_gpu (cpp/gather/
// metal.cpp) on macOS and by the emulator harness (tests/metal/
// harness_gather_t.cpp) on Linux. The perm check and the unpermute are
// the dense transposed product's launches (qmatmul_t_host.h's plan for the
// x_batches·M rows of z), taken over unchanged.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "gather_t_params.h"
#include "kernel_args.h"
#include "qmatmul_host.h"
#include "qmatmul_t_host.h"

namespace mixbits::metal_host {

static_assert(sizeof(MbGatherTParams) == sizeof(MbQmvTParams) + 3 * sizeof(int),
              "MbGatherTParams is plain ints, laid out alike in Metal and C++");
// The shared perm check and unpermute bind the scratch at the same slots.
constexpr bool gt_slots_match_qt() {
  const int gt[] = {MB_GT_DY, MB_GT_PERM, MB_GT_WQ, MB_GT_SCALES, MB_GT_BIASES,
                    MB_GT_INV, MB_GT_STATUS, MB_GT_Z, MB_GT_OUT};
  const int qt[] = {MB_QT_DY, MB_QT_PERM, MB_QT_WQ, MB_QT_SCALES, MB_QT_BIASES,
                    MB_QT_INV, MB_QT_STATUS, MB_QT_Z, MB_QT_OUT};
  for (int i = 0; i < 9; ++i)
    if (gt[i] != qt[i]) return false;
  return true;
}
static_assert(gt_slots_match_qt(), "MbGatherTBuffer 0 .. 8 are MbQmvTBuffer's");
static_assert(size_t(MB_GT_GROUP_THREADS) * 4 <= kMaxThreadgroupBytes,
              "threadgroup memory within Metal's 32 KiB");

enum class GtKind { PermCheck, Group, Product, Unpermute };

struct GatherTLaunch : Launch {
  MbGatherTParams params;  // the shared kernels read params.q (bound at MB_QT_PARAMS)
  GtKind kind;
  int segment;  // Product only; -1 otherwise
};

// Whether eval_gpu's kernels apply: few rows per matrix (MB_QT_MAX_M, as
// the dense transposed product: above it MixedGatherQMM's gradient is
// dequantize + gather_mm), something to compute, and 32-bit parameters and
// grids. mixed_gather_qmm_t refuses a GPU stream otherwise.
inline bool gather_qmv_t_gpu_applies(int64_t pairs, int64_t M, int64_t N, int64_t K,
                                     int64_t x_batches, int64_t w_batches) {
  const int64_t lim = 0x7fffffff;
  return pairs > 0 && M > 0 && N > 0 && K > 0 && x_batches > 0 && w_batches > 0 &&
         M <= MB_QT_MAX_M && pairs < lim && N <= lim && K <= lim && x_batches < lim &&
         w_batches <= lim && x_batches * M * K <= lim;
}

// The launches for dy [pairs, M, N] against the w_batches-matrix stack of
// segments, into dx [x_batches, M, K]. Arguments are assumed validated
// (mixed_gather_qmm_t, gather_qmv_t_gpu_applies).
inline std::vector<GatherTLaunch> plan_gather_qmv_t(int pairs, int M, int N, int x_batches,
                                                    int w_batches,
                                                    const std::vector<QmmSegment>& segs,
                                                    ActType xt, int scale_type, bool has_perm) {
  if (!gather_qmv_t_gpu_applies(pairs, M, N, 1, x_batches, w_batches) || segs.empty())
    throw std::invalid_argument("plan_gather_qmv_t: a problem the kernels do not take");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_gather_qmv_t: unknown scale dtype");
  int K = 0;
  for (const auto& s : segs) K += s.k;
  const size_t rows = size_t(x_batches) * size_t(M), BK = rows * size_t(K);
  const Elem xe = elem_of(xt), se = elem_of(scale_act_type(scale_type));
  const MbGatherTParams base{{M, N, K, 0, K, has_perm ? 1 : 0}, x_batches, w_batches, pairs};

  // The dense product's plan over the rows of z: its first and last
  // launches are the perm check and the unpermute, with their buffers.
  std::vector<QtLaunch> dense;
  if (has_perm) dense = plan_qmv_t(int(rows), N, segs, xt, scale_type, true);
  auto shared = [&](const QtLaunch& q, GtKind kind) {
    GatherTLaunch l;
    static_cast<Launch&>(l) = q;
    l.params = base;
    l.params.q = q.params;
    l.kind = kind;
    l.segment = -1;
    return l;
  };
  // This numbering's slots (0 .. MB_GT_BIASES as the dense product's); a
  // slot a launch leaves alone gets `stand`, a buffer it writes.
  auto slots = [&](size_t dy, size_t wq, size_t sb, Dir status_dir, size_t z, size_t out,
                   size_t lhs, Dir index_dir, int stand) {
    auto slot = [&](const char* name, int i, Dir d, Elem e, size_t n) {
      return BufferArg{name, i, d, e, n, n ? -1 : stand};
    };
    return std::vector<BufferArg>{
        slot("dy", MB_GT_DY, Dir::In, xe, dy),
        slot("perm", MB_GT_PERM, Dir::In, Elem::I32, 0),
        slot("wq", MB_GT_WQ, Dir::In, Elem::U32, wq),
        slot("scales", MB_GT_SCALES, Dir::In, se, sb),
        slot("biases", MB_GT_BIASES, Dir::In, se, sb),
        slot("inv", MB_GT_INV, Dir::In, Elem::I32, 0),
        slot("status", MB_GT_STATUS, status_dir, Elem::I32, 1),
        slot("z", MB_GT_Z, Dir::Out, Elem::F32, z),
        slot("out", MB_GT_OUT, Dir::Out, xe, out),
        slot("lhs", MB_GT_LHS, Dir::In, Elem::U32, lhs),
        slot("rhs", MB_GT_RHS, Dir::In, Elem::U32, size_t(pairs)),
        slot("order", MB_GT_ORDER, index_dir, Elem::I32, size_t(pairs)),
        slot("bounds", MB_GT_BOUNDS, index_dir, Elem::I32, size_t(x_batches) + 1),
    };
  };

  std::vector<GatherTLaunch> plan;
  if (has_perm) plan.push_back(shared(dense.front(), GtKind::PermCheck));
  {
    GatherTLaunch l;
    l.kernel = "mixbits_gather_t_group";
    l.params = base;
    l.kind = GtKind::Group;
    l.segment = -1;
    l.grid[0] = l.grid[1] = l.grid[2] = 1;
    l.group[0] = MB_GT_GROUP_THREADS;
    l.group[1] = l.group[2] = 1;
    l.threadgroup_bytes = size_t(MB_GT_GROUP_THREADS) * sizeof(int32_t);
    l.params_index = MB_GT_PARAMS;
    l.buffers = slots(0, 0, 0, Dir::Out, 0, 0, size_t(pairs), Dir::Out, MB_GT_ORDER);
    plan.push_back(l);
  }
  int k0 = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const QmmSegment& s = segs[i];
    GatherTLaunch l;
    l.kernel = ladder_kernel_name("gather_qmv_t", xt, scale_type, s.bits, s.group_size);
    l.params = base;
    l.params.q.k0 = k0;
    l.params.q.kseg = s.k;
    l.kind = GtKind::Product;
    l.segment = int(i);
    l.grid[0] = uint32_t((s.k + MB_QT_COLS - 1) / MB_QT_COLS);
    l.grid[1] = uint32_t(M);
    l.grid[2] = uint32_t(x_batches);
    l.group[0] = MB_QT_THREADS;
    l.group[1] = l.group[2] = 1;
    l.threadgroup_bytes = size_t(MB_QT_TG_FLOATS) * sizeof(float);
    l.params_index = MB_GT_PARAMS;
    const size_t mats = size_t(w_batches) * size_t(N);
    l.buffers = slots(size_t(pairs) * size_t(M) * size_t(N), mats * size_t(s.k) * s.bits / 32,
                      mats * size_t(s.k / s.group_size), Dir::In, has_perm ? BK : 0,
                      has_perm ? 0 : BK, 0, Dir::In, has_perm ? MB_GT_Z : MB_GT_OUT);
    plan.push_back(l);
    k0 += s.k;
  }
  if (has_perm) plan.push_back(shared(dense.back(), GtKind::Unpermute));
  return plan;
}

}  // namespace mixbits::metal_host
