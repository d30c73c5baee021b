// Host side of the Metal gathered quantized matmul, in plain C++: which
// kernel runs for which segment, with which parameters, grid and buffers.
// Used by cpp/gather/metal.cpp on macOS and by the emulator harness on
// Linux, so the launch logic the Mac runs is the one the tests exercise.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "gather_params.h"
#include "kernel_args.h"
#include "qmatmul_host.h"

namespace mixbits::metal_host {

static_assert(sizeof(MbGatherParams) == sizeof(MbQmmParams) + 4 * sizeof(int),
              "MbGatherParams is plain ints, laid out alike in Metal and C++");

static_assert(sizeof(MbGatherFusedParams) == sizeof(MbQmmFusedParams) + 4 * sizeof(int) &&
                  MB_GQMV_WQ0 == MB_GQMV_OUT + 1 && MB_GQMV_BIASES7 == MB_GQMV_WQ0 + 3 * 7 + 2 &&
                  MB_GQMV_PARAMS == MB_GQMV_BIASES7 + 1 && MB_GQMV_PARAMS <= 30,
              "the gathered GEMV: three slots per segment after the fixed ones, the "
              "parameter block last, within Metal's 31");

// The tiled kernel's launches (gather_qmm.metal, one per K-segment).
struct GatherLaunch : Launch {
  MbGatherParams params;
  int segment;
  bool tiled;  // always true: gather_qmm.metal
};

// The GEMV's launches (gather_qmv.metal): one per MB_QMM_MAX_SEGS segments.
struct GatherQmvLaunch : Launch {
  MbGatherFusedParams params;
  int first_segment;  // segments first_segment .. + params.q.nseg - 1
};

// Buffer slots of segment j of a GEMV launch (0 <= j < MB_QMM_MAX_SEGS).
inline int gather_qmv_wq_slot(int j) { return MB_GQMV_WQ0 + 3 * j; }
inline int gather_qmv_scales_slot(int j) { return MB_GQMV_SCALES0 + 3 * j; }
inline int gather_qmv_biases_slot(int j) { return MB_GQMV_BIASES0 + 3 * j; }
constexpr SegmentSlots kGatherQmvSegmentSlots{gather_qmv_wq_slot, gather_qmv_scales_slot,
                                              gather_qmv_biases_slot, MB_GQMV_OUT};

// Why the gathered kernel cannot run a problem ("" if it can): its
// parameters and grid are 32-bit. mixed_gather_qmm asks before building
// the node and composes MLX ops instead when this says no.
inline std::string gather_gpu_refusal(int64_t pairs, int64_t M, int64_t x_batches,
                                      int64_t w_batches) {
  const int64_t lim = 0x7fffffff;
  if (pairs > lim) return "more than 2^31-1 output matrices";
  if (pairs * M > lim) return "more than 2^31-1 output rows";
  if (x_batches > lim || w_batches > lim) return "more than 2^31-1 matrices in x or W";
  return "";
}

// Whether the tiled kernel (gather_qmm.metal) runs rather than the GEMV:
// every output matrix alone has more rows than the GEMV takes, or the
// caller says the pairs are sorted by expert (mlx-lm sorts them when a
// layer sees many tokens), there are rows for at least two 32-row blocks
// and the experts average at least MB_QMV_MAX_M rows each (rows spread
// over min(w_batches, pairs) experts), so a block's runs fill its MMAs.
// With fewer rows per expert the GEMV reads each expert's weights once per
// run of its (sorted) rows in an 8-row block, without the tiled kernel's
// 32-row MMA passes over one or two real rows (64 pairs over 128 experts:
// 4% of the MMA rows were real).
inline bool gather_tiled(int pairs, int M, bool sorted, int w_batches) {
  const int64_t rows = int64_t(pairs) * M;
  const int64_t experts = std::min<int64_t>(w_batches, pairs);
  return M > MB_QMV_MAX_M ||
         (sorted && rows >= 2 * MB_QMM_BM && rows >= int64_t(MB_QMV_MAX_M) * experts);
}

// Flat output rows per threadgroup of the gathered GEMV: sorted pairs put
// an expert's rows next to each other, so 8-row blocks catch runs of them;
// otherwise one output matrix (its M rows share one expert).
inline int gather_block_rows(int M, bool sorted) { return sorted ? int(MB_QMV_MAX_M) : M; }

// The GEMV's launches, in order: one per MB_QMM_MAX_SEGS segments (one for
// every product the quantizer makes), the segment table in the parameter
// block; more segments pass a float32 partial sum (qmm_needs_acc). x:
// x_batches dense [M, K] matrices; each segment's arrays: w_batches
// matrices of N rows; `pairs` entries of lhs and rhs (uint32); `sorted`:
// the caller's sorted_indices. For problems gather_tiled refuses.
inline std::vector<GatherQmvLaunch> plan_gather_qmv(int pairs, int M, int N, int x_batches,
                                                    int w_batches,
                                                    const std::vector<QmmSegment>& segs,
                                                    ActType xt, int scale_type, bool has_perm,
                                                    bool sorted, int max_gemv_threads = 1024) {
  if (pairs <= 0 || M <= 0 || N <= 0 || x_batches <= 0 || w_batches <= 0 || segs.empty())
    throw std::invalid_argument("plan_gather_qmv: empty problem");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_gather_qmv: unknown scale dtype");
  if (int64_t(pairs) * M > 0x7fffffff)
    throw std::invalid_argument("plan_gather_qmv: more than 2^31-1 output rows");
  if (gather_tiled(pairs, M, sorted, w_batches))
    throw std::invalid_argument("plan_gather_qmv: the tiled kernel's problem (plan_gather)");
  int K = 0;
  for (const auto& s : segs) {
    if (log2_group(s.group_size) < 0 || s.k % s.group_size != 0)
      throw std::invalid_argument("plan_gather_qmv: bad segment");
    K += s.k;
  }
  const bool acc = qmm_needs_acc(segs.size());
  const size_t outs = size_t(pairs) * size_t(M) * size_t(N);
  const Elem se = elem_of(scale_act_type(scale_type));
  const int br = gather_block_rows(M, sorted);
  const int64_t rows = int64_t(pairs) * M;
  const int blocks = int((rows + br - 1) / br);
  const int wrows = qmv_simdgroups(N, max_gemv_threads, blocks) * MB_QMV_ROWS_PER_SIMDGROUP;
  std::vector<GatherQmvLaunch> plan;
  int k0 = 0;
  for (size_t first = 0; first < segs.size(); first += MB_QMM_MAX_SEGS) {
    const size_t n = std::min(segs.size() - first, size_t(MB_QMM_MAX_SEGS));
    GatherQmvLaunch l;
    l.kernel = std::string("mixbits_gather_qmv_") + act_type_name(xt) + "_" +
               act_type_name(scale_act_type(scale_type));
    MbGatherFusedParams& g = l.params;
    g = MbGatherFusedParams{};
    MbQmmFusedParams& q = g.q;
    q = fused_params(M, N, K, has_perm, first, n, segs.size());
    g.x_batches = x_batches;
    g.w_batches = w_batches;
    g.pairs = pairs;
    g.block_rows = br;
    l.grid[0] = uint32_t((N + wrows - 1) / wrows);
    l.grid[1] = uint32_t(blocks);
    l.grid[2] = 1;
    l.group[0] = uint32_t(wrows / MB_QMV_ROWS_PER_SIMDGROUP * 32);
    l.group[1] = l.group[2] = 1;
    // The block's lhs and rhs entries, then x for its rows.
    l.threadgroup_bytes =
        (2 * size_t(MB_QMV_MAX_M) + size_t(std::min<int64_t>(br, rows)) * MB_QMV_BLOCK) *
        sizeof(float);
    l.first_segment = int(first);
    // Unused slots get `out` (freshly allocated: offset 0, aligned).
    l.buffers = {
        {"x", MB_GQMV_X, Dir::In, elem_of(xt), size_t(x_batches) * size_t(M) * size_t(K), -1},
        {"perm", MB_GQMV_PERM, Dir::In, Elem::I32, has_perm ? size_t(K) : 0,
         has_perm ? -1 : MB_GQMV_OUT},
        {"lhs", MB_GQMV_LHS, Dir::In, Elem::U32, size_t(pairs), -1},
        {"rhs", MB_GQMV_RHS, Dir::In, Elem::U32, size_t(pairs), -1},
        {"acc", MB_GQMV_ACC, Dir::Out, Elem::F32, acc ? outs : 0, acc ? -1 : MB_GQMV_OUT},
        {"out", MB_GQMV_OUT, Dir::Out, elem_of(xt), outs, -1},
    };
    l.params_index = MB_GQMV_PARAMS;
    fill_segment_table(q, l.buffers, segs, first, n, size_t(w_batches) * size_t(N), se,
                       kGatherQmvSegmentSlots, k0);
    plan.push_back(l);
  }
  return plan;
}

// The tiled kernel's launches (for problems gather_tiled accepts): one per
// segment, in order. x: x_batches dense [M, K] matrices;
// each segment's arrays: w_batches matrices of N rows; `pairs` entries of
// lhs and rhs (uint32); `sorted`: the caller's sorted_indices. Arguments
// are assumed validated (cpp/gather/gather.cpp).
inline std::vector<GatherLaunch> plan_gather(int pairs, int M, int N, int x_batches,
                                             int w_batches, const std::vector<QmmSegment>& segs,
                                             ActType xt, int scale_type, bool has_perm,
                                             bool sorted) {
  if (pairs <= 0 || M <= 0 || N <= 0 || x_batches <= 0 || w_batches <= 0 || segs.empty())
    throw std::invalid_argument("plan_gather: empty problem");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_gather: unknown scale dtype");
  if (int64_t(pairs) * M > 0x7fffffff)
    throw std::invalid_argument("plan_gather: more than 2^31-1 output rows");
  const bool tiled = gather_tiled(pairs, M, sorted, w_batches);
  if (!tiled) throw std::invalid_argument("plan_gather: the GEMV's problem (plan_gather_qmv)");
  int K = 0;
  for (const auto& s : segs) K += s.k;
  const bool acc = per_segment_needs_acc(segs.size());
  const size_t outs = size_t(pairs) * size_t(M) * size_t(N);
  const Elem se = elem_of(scale_act_type(scale_type));
  std::vector<GatherLaunch> plan;
  int k0 = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const QmmSegment& s = segs[i];
    GatherLaunch l;
    l.kernel = ladder_kernel_name("gather_qmm", xt, scale_type, s.bits, s.group_size);
    MbQmmParams& q = l.params.q;
    q.M = M;
    q.N = N;
    q.K = K;
    q.k0 = k0;
    q.kseg = s.k;
    q.has_perm = has_perm ? 1 : 0;
    q.accumulate = i > 0 ? 1 : 0;
    q.write_out = i + 1 == segs.size() ? 1 : 0;
    l.params.x_batches = x_batches;
    l.params.w_batches = w_batches;
    l.params.pairs = pairs;
    l.params.block_rows = 0;
    {
      const int64_t rows = int64_t(pairs) * M;
      l.grid[0] = uint32_t((N + MB_QMM_BN - 1) / MB_QMM_BN);
      l.grid[1] = uint32_t((rows + MB_QMM_BM - 1) / MB_QMM_BM);
      l.grid[2] = 1;
      l.group[0] = MB_QMM_THREADS;
      l.threadgroup_bytes = size_t(MB_GATHER_QMM_TG_FLOATS) * sizeof(float);
    }
    l.group[1] = l.group[2] = 1;
    l.segment = int(i);
    l.tiled = true;
    const size_t mats = size_t(w_batches) * size_t(N);
    const size_t groups = mats * size_t(s.k / s.group_size);
    // Unused slots get `out` (freshly allocated: offset 0, aligned).
    l.buffers = {
        {"x", MB_GATHER_X, Dir::In, elem_of(xt), size_t(x_batches) * size_t(M) * size_t(K), -1},
        {"perm", MB_GATHER_PERM, Dir::In, Elem::I32, has_perm ? size_t(K) : 0,
         has_perm ? -1 : MB_GATHER_OUT},
        {"wq", MB_GATHER_WQ, Dir::In, Elem::U32, mats * size_t(s.k) * s.bits / 32, -1},
        {"scales", MB_GATHER_SCALES, Dir::In, se, groups, -1},
        {"biases", MB_GATHER_BIASES, Dir::In, se, groups, -1},
        {"lhs", MB_GATHER_LHS, Dir::In, Elem::U32, size_t(pairs), -1},
        {"rhs", MB_GATHER_RHS, Dir::In, Elem::U32, size_t(pairs), -1},
        {"acc", MB_GATHER_ACC, Dir::Out, Elem::F32, acc ? outs : 0, acc ? -1 : MB_GATHER_OUT},
        {"out", MB_GATHER_OUT, Dir::Out, elem_of(xt), outs, -1},
    };
    l.params_index = MB_GATHER_PARAMS;
    plan.push_back(l);
    k0 += s.k;
  }
  return plan;
}

}  // namespace mixbits::metal_host
