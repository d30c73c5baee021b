// Host side of the Metal gathered transposed product (gather_qmv_t.metal),
// in plain C++: which kernels run, in which order, with which parameters,
// grids and buffers. Used by MixedGatherQMMT::eval_gpu (cpp/gather/
// metal.cpp) on macOS and by the emulator harness (tests/metal/
// harness_gather_t.cpp) on Linux. One product over every segment, whose
// segment table is filled as the forward's (fill_segment_table,
// qmatmul_host.h), after a grouping launch (with the perm's check) unless
// the product groups the few pairs itself (gt_fused).
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

static_assert(sizeof(MbGatherTParams) == sizeof(MbQmmFusedParams) + 4 * sizeof(int),
              "MbGatherTParams is plain ints, laid out alike in Metal and C++");
static_assert(MB_GT_WQ0 + 3 * MB_QMM_MAX_SEGS == MB_GT_PARAMS &&
                  MB_GT_PARAMS + 1 == MB_GT_N_BUFFERS && MB_GT_N_BUFFERS <= 31,
              "three slots per segment, the parameter block last, within Metal's 31");
static_assert(size_t(MB_GT_GROUP_THREADS) * 4 <= kMaxThreadgroupBytes &&
                  size_t(mb_gt_tg_words(MB_QT_MAX_M, MB_QT_MAX_K, 1, 1)) * 4 <=
                      kMaxThreadgroupBytes,
              "threadgroup memory within Metal's 32 KiB");

inline int gt_wq_slot(int j) { return MB_GT_WQ0 + 3 * j; }
inline int gt_scales_slot(int j) { return MB_GT_SCALES0 + 3 * j; }
inline int gt_biases_slot(int j) { return MB_GT_BIASES0 + 3 * j; }
constexpr SegmentSlots kGtSegmentSlots{gt_wq_slot, gt_scales_slot, gt_biases_slot, MB_GT_OUT};

enum class GtKind { Group, Product };

struct GatherTLaunch : Launch {
  MbGatherTParams params;
  GtKind kind;
};

// Whether eval_gpu's kernels apply: few rows per matrix (MB_QT_MAX_M, as
// the dense transposed product: above it MixedGatherQMM's gradient is
// dequantize + gather_mm), at most MB_QMM_MAX_SEGS segments (one product
// dispatch binds them all), something to compute, and 32-bit parameters
// and grids. mixed_gather_qmm_t refuses a GPU stream otherwise.
inline bool gather_qmv_t_gpu_applies(int64_t pairs, int64_t M, int64_t N, int64_t K,
                                     int64_t x_batches, int64_t w_batches, int64_t nseg = 1) {
  const int64_t lim = 0x7fffffff;
  return pairs > 0 && M > 0 && N > 0 && K > 0 && x_batches > 0 && w_batches > 0 &&
         M <= MB_QT_MAX_M && nseg <= MB_QMM_MAX_SEGS && pairs < lim && N <= lim && K <= lim &&
         x_batches < lim && w_batches <= lim && x_batches * M * K <= lim &&
         x_batches + pairs + K + 2 <= lim;
}

// Words of the index scratch (MB_GT_INDEX): status, bounds, order, inverse.
inline size_t gt_index_words(int pairs, int x_batches, int K, bool has_perm) {
  return size_t(mb_gt_inv_at(x_batches, pairs)) + (has_perm ? size_t(K) : 0);
}

// Whether the fused product can take the problem at all, whatever its
// re-reads: its threadgroups list their dx matrix's pairs (index and
// expert) in threadgroup memory, room for MB_GT_FUSED_MAX_PAIRS, and check
// a perm with the dense kernel's K-bit map, room for MB_QT_MAX_K columns
// (mb_gt_tg_words sizes both; past either the kernel would write past its
// threadgroup memory). gt_fused asks it first; plan_gather_qmv_t refuses a
// forced fuse past it.
inline bool gt_fusable(int pairs, int K, bool has_perm) {
  return pairs <= MB_GT_FUSED_MAX_PAIRS && !(has_perm && K > MB_QT_MAX_K);
}

// The fused product's re-reads (every threadgroup reads all of lhs and rhs,
// and perm) may add at most 1 / kGtFusedShare of the weight bytes the
// product reads (each pair's expert, every column).
constexpr int kGtFusedShare = 16;
// Whether the product groups the pairs itself, in ONE dispatch: few pairs
// (its threadgroups list their matrix's pairs in threadgroup memory), a
// perm within the dense kernel's K-bit map, and re-reads within the share.
// Decode top-8 of 128 at N 768, K 2048 (one dx matrix, 16 threadgroups):
// 16 x 64 index bytes (+ 16 x 8 KiB of perm) against 7.1 MB of weights.
// Otherwise the grouping is a launch of its own: many pairs over many dx
// matrices would have every threadgroup scan every pair (threadgroups x
// pairs), and there is no barrier across a dispatch's threadgroups.
inline bool gt_fused(int pairs, int N, int K, int x_batches, const std::vector<QmmSegment>& segs,
                     int scale_bytes, bool has_perm) {
  if (!gt_fusable(pairs, K, has_perm)) return false;
  double w_row = 0;  // one expert row's bytes over every segment
  for (const auto& s : segs)
    w_row += double(s.k) * s.bits / 8 + 2.0 * (s.k / s.group_size) * scale_bytes;
  const double rereads =
      double(qt_blocks(segs)) * x_batches * (8.0 * pairs + (has_perm ? 4.0 * K : 0.0));
  return rereads * kGtFusedShare <= double(pairs) * N * w_row;
}

// The launches for dy [pairs, M, N] against the w_batches-matrix stack of
// segments, into dx [x_batches, M, K]: the grouping and the product, or
// the fused product alone. Arguments are assumed validated
// (mixed_gather_qmm_t, gather_qmv_t_gpu_applies).
inline std::vector<GatherTLaunch> plan_gather_qmv_t(int pairs, int M, int N, int x_batches,
                                                    int w_batches,
                                                    const std::vector<QmmSegment>& segs,
                                                    ActType xt, int scale_type, bool has_perm,
                                                    int fuse = -1) {
  if (segs.empty() ||
      !gather_qmv_t_gpu_applies(pairs, M, N, 1, x_batches, w_batches, int64_t(segs.size())))
    throw std::invalid_argument("plan_gather_qmv_t: a problem the kernels do not take");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_gather_qmv_t: unknown scale dtype");
  int K = 0;
  for (const auto& s : segs) {
    if (log2_group(s.group_size) < 0 || s.k % s.group_size != 0)
      throw std::invalid_argument("plan_gather_qmv_t: bad segment");
    K += s.k;
  }
  const Elem xe = elem_of(xt), se = elem_of(scale_act_type(scale_type));
  // fuse: -1 the host's choice (gt_fused); 0 or 1 forced (the tests', to
  // run both plans on one problem).
  if (fuse == 1 && !gt_fusable(pairs, K, has_perm))
    throw std::invalid_argument("plan_gather_qmv_t: too many pairs or perm entries to fuse");
  const bool fused = fuse < 0 ? gt_fused(pairs, N, K, x_batches, segs, int(elem_bytes(se)),
                                         has_perm)
                              : fuse != 0;
  const size_t words = fused ? 0 : gt_index_words(pairs, x_batches, K, has_perm);
  MbGatherTParams base{};
  base.q.M = M;
  base.q.N = N;
  base.q.K = K;
  base.q.has_perm = has_perm ? 1 : 0;
  base.q.nseg = int(segs.size());
  base.q.accumulate = 0;
  base.q.write_out = 1;
  base.q.qmv_sets = 1;
  base.x_batches = x_batches;
  base.w_batches = w_batches;
  base.pairs = pairs;
  base.fused = fused ? 1 : 0;

  std::vector<GatherTLaunch> plan;
  if (!fused) {
    GatherTLaunch l;
    l.kernel = "mixbits_gather_t_group";
    l.params = base;
    l.kind = GtKind::Group;
    l.grid[0] = l.grid[1] = l.grid[2] = 1;
    l.group[0] = MB_GT_GROUP_THREADS;
    l.group[1] = l.group[2] = 1;
    l.threadgroup_bytes = size_t(MB_GT_GROUP_THREADS) * sizeof(int32_t);
    l.params_index = MB_GT_PARAMS;
    l.buffers = {
        {"dy", MB_GT_DY, Dir::In, xe, 0, MB_GT_INDEX},
        {"perm", MB_GT_PERM, Dir::In, Elem::I32, has_perm ? size_t(K) : 0, MB_GT_INDEX},
        {"out", MB_GT_OUT, Dir::Out, xe, 0, MB_GT_INDEX},
        {"lhs", MB_GT_LHS, Dir::In, Elem::U32, size_t(pairs), -1},
        {"rhs", MB_GT_RHS, Dir::In, Elem::U32, size_t(pairs), -1},
        {"index", MB_GT_INDEX, Dir::Out, Elem::I32, words, -1},
    };
    for (int j = 0; j < MB_QMM_MAX_SEGS; ++j)
      for (int slot : {gt_wq_slot(j), gt_scales_slot(j), gt_biases_slot(j)})
        l.buffers.push_back({"(unused)", slot, Dir::In, Elem::U32, 0, MB_GT_INDEX});
    for (BufferArg& b : l.buffers)
      if (b.used()) b.stand_in = -1;
    plan.push_back(l);
  }
  {
    GatherTLaunch l;
    l.kernel = std::string("mixbits_gather_qmv_t_") + act_type_name(xt) + "_" +
               act_type_name(scale_act_type(scale_type));
    l.params = base;
    l.kind = GtKind::Product;
    l.grid[0] = qt_blocks(segs);
    l.grid[1] = uint32_t(x_batches);
    l.grid[2] = 1;
    l.group[0] = MB_QT_THREADS;
    l.group[1] = l.group[2] = 1;
    l.threadgroup_bytes =
        size_t(mb_gt_tg_words(M, K, fused ? 1 : 0, has_perm ? 1 : 0)) * sizeof(float);
    l.params_index = MB_GT_PARAMS;
    l.buffers = {
        {"dy", MB_GT_DY, Dir::In, xe, size_t(pairs) * size_t(M) * size_t(N), -1},
        {"perm", MB_GT_PERM, Dir::In, Elem::I32, has_perm ? size_t(K) : 0,
         has_perm ? -1 : MB_GT_OUT},
        {"out", MB_GT_OUT, Dir::Out, xe, size_t(x_batches) * size_t(M) * size_t(K), -1},
        {"lhs", MB_GT_LHS, Dir::In, Elem::U32, fused ? size_t(pairs) : 0,
         fused ? -1 : MB_GT_OUT},
        {"rhs", MB_GT_RHS, Dir::In, Elem::U32, size_t(pairs), -1},
        {"index", MB_GT_INDEX, Dir::In, Elem::I32, words, fused ? MB_GT_OUT : -1},
    };
    int k0 = 0;
    fill_segment_table(l.params.q, l.buffers, segs, 0, segs.size(),
                       size_t(w_batches) * size_t(N), se, kGtSegmentSlots, k0);
    plan.push_back(l);
  }
  return plan;
}

}  // namespace mixbits::metal_host
