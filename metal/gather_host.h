// Host side of the Metal gathered quantized matmul, in plain C++: which
// kernel runs, with which segment table, parameters, grid and buffers.
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

static_assert(sizeof(MbGatherFusedParams) == sizeof(MbQmmFusedParams) + 5 * sizeof(int) &&
                  MB_GQMV_WQ0 == MB_GQMV_OUT + 1 && MB_GQMV_BIASES7 == MB_GQMV_WQ0 + 3 * 7 + 2 &&
                  MB_GQMV_PARAMS == MB_GQMV_BIASES7 + 1 && MB_GQMV_PARAMS <= 30,
              "the gathered kernels: three slots per segment after the fixed ones, the "
              "parameter block last, within Metal's 31");

// A launch of either gathered kernel (gather_qmv.metal, the GEMV;
// gather_qmm.metal, the tiled one): one per MB_QMM_MAX_SEGS segments, the
// same parameter block and buffer slots for both.
struct GatherLaunch : Launch {
  MbGatherFusedParams params;
  int first_segment;  // segments first_segment .. + params.q.nseg - 1
  bool tiled;         // gather_qmm.metal
};

// Buffer slots of segment j of a launch (0 <= j < MB_QMM_MAX_SEGS).
inline int gather_qmv_wq_slot(int j) { return MB_GQMV_WQ0 + 3 * j; }
inline int gather_qmv_scales_slot(int j) { return MB_GQMV_SCALES0 + 3 * j; }
inline int gather_qmv_biases_slot(int j) { return MB_GQMV_BIASES0 + 3 * j; }
constexpr SegmentSlots kGatherSegmentSlots{gather_qmv_wq_slot, gather_qmv_scales_slot,
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
// 8 of its (sorted) rows, without the tiled kernel's
// 32-row weight tiles and 8-row MMA fragments for one or two real rows
// (64 pairs over 128 experts: 4% of the MMA rows were real when each run
// was a 32-row pass; 1 or 2 of a fragment's 8 with runs packed).
inline bool gather_tiled(int pairs, int M, bool sorted, int w_batches) {
  const int64_t rows = int64_t(pairs) * M;
  const int64_t experts = std::min<int64_t>(w_batches, pairs);
  return M > MB_QMV_MAX_M ||
         (sorted && rows >= 2 * MB_QMM_BM && rows >= int64_t(MB_QMV_MAX_M) * experts);
}

// Flat output rows per threadgroup of the gathered GEMV: sorted pairs put
// an expert's rows next to each other, so 8-row blocks, chained (a run
// belongs whole to the block it starts in: gather_qmv.metal), read each
// expert's weights once per 8 of its rows; otherwise one output matrix
// (its M rows share one expert).
inline int gather_block_rows(int M, bool sorted) { return sorted ? int(MB_QMV_MAX_M) : M; }

// What the two plans share: the problem's checks, K, and one launch per
// MB_QMM_MAX_SEGS segments with its parameter block (block_rows left to the
// caller), segment table and buffers, in order. `who` names the caller in
// errors.
inline std::vector<GatherLaunch> gather_launches(const char* who, int pairs, int M, int N,
                                                 int x_batches, int w_batches,
                                                 const std::vector<QmmSegment>& segs,
                                                 ActType xt, int scale_type, bool has_perm,
                                                 bool tiled) {
  const std::string w(who);
  if (pairs <= 0 || M <= 0 || N <= 0 || x_batches <= 0 || w_batches <= 0 || segs.empty())
    throw std::invalid_argument(w + ": empty problem");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument(w + ": unknown scale dtype");
  if (int64_t(pairs) * M > 0x7fffffff)
    throw std::invalid_argument(w + ": more than 2^31-1 output rows");
  int K = 0;
  for (const auto& s : segs) {
    if (log2_group(s.group_size) < 0 || s.k % s.group_size != 0)
      throw std::invalid_argument(w + ": bad segment");
    K += s.k;
  }
  const bool acc = qmm_needs_acc(segs.size());
  const size_t outs = size_t(pairs) * size_t(M) * size_t(N);
  const Elem se = elem_of(scale_act_type(scale_type));
  std::vector<GatherLaunch> plan;
  int k0 = 0;
  for (size_t first = 0; first < segs.size(); first += MB_QMM_MAX_SEGS) {
    const size_t n = std::min(segs.size() - first, size_t(MB_QMM_MAX_SEGS));
    GatherLaunch l;
    l.kernel = std::string(tiled ? "mixbits_gather_qmm_" : "mixbits_gather_qmv_") +
               act_type_name(xt) + "_" + act_type_name(scale_act_type(scale_type));
    MbGatherFusedParams& g = l.params;
    g = MbGatherFusedParams{};
    g.q = fused_params(M, N, K, has_perm, first, n, segs.size());
    g.x_batches = x_batches;
    g.w_batches = w_batches;
    g.pairs = pairs;
    l.first_segment = int(first);
    l.tiled = tiled;
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
    fill_segment_table(g.q, l.buffers, segs, first, n, size_t(w_batches) * size_t(N), se,
                       kGatherSegmentSlots, k0);
    plan.push_back(l);
  }
  return plan;
}

// The GEMV's launches, in order: one per MB_QMM_MAX_SEGS segments (one for
// every product the quantizer makes), the segment table in the parameter
// block; more segments pass a float32 partial sum (qmm_needs_acc). x:
// x_batches dense [M, K] matrices; each segment's arrays: w_batches
// matrices of N rows; `pairs` entries of lhs and rhs (uint32); `sorted`:
// the caller's sorted_indices. For problems gather_tiled refuses.
inline std::vector<GatherLaunch> plan_gather_qmv(int pairs, int M, int N, int x_batches,
                                                 int w_batches,
                                                 const std::vector<QmmSegment>& segs,
                                                 ActType xt, int scale_type, bool has_perm,
                                                 bool sorted, int max_gemv_threads = 1024) {
  auto plan = gather_launches("plan_gather_qmv", pairs, M, N, x_batches, w_batches, segs, xt,
                              scale_type, has_perm, false);
  if (gather_tiled(pairs, M, sorted, w_batches))
    throw std::invalid_argument("plan_gather_qmv: the tiled kernel's problem (plan_gather)");
  const int br = gather_block_rows(M, sorted);
  const int64_t rows = int64_t(pairs) * M;
  const int blocks = int((rows + br - 1) / br);
  const int wrows = qmv_simdgroups(N, max_gemv_threads, blocks) * MB_QMV_ROWS_PER_SIMDGROUP;
  for (GatherLaunch& l : plan) {
    l.params.block_rows = br;
    l.params.chained = sorted ? 1 : 0;
    l.grid[0] = uint32_t((N + wrows - 1) / wrows);
    l.grid[1] = uint32_t(blocks);
    l.grid[2] = 1;
    l.group[0] = uint32_t(wrows / MB_QMV_ROWS_PER_SIMDGROUP * 32);
    l.group[1] = l.group[2] = 1;
    // Index entries (the rhs window, a pass's lhs), then x for a pass's rows.
    l.threadgroup_bytes =
        (size_t(MB_GQMV_IDX_FLOATS) + size_t(std::min<int64_t>(br, rows)) * MB_QMV_BLOCK) *
        sizeof(float);
  }
  return plan;
}

// The tiled kernel's launches (for problems gather_tiled accepts), in
// order: one per MB_QMM_MAX_SEGS segments, as plan_gather_qmv's. A
// threadgroup owns a 32 x 32 block of the flat pairs·M output rows and N
// outputs (the dense tiled kernel's 32-row blocks and threadgroup memory,
// plus the block's 2 x 32 index entries).
// Arguments as plan_gather_qmv's, validated (cpp/gather/gather.cpp).
inline std::vector<GatherLaunch> plan_gather(int pairs, int M, int N, int x_batches,
                                             int w_batches, const std::vector<QmmSegment>& segs,
                                             ActType xt, int scale_type, bool has_perm,
                                             bool sorted) {
  auto plan = gather_launches("plan_gather", pairs, M, N, x_batches, w_batches, segs, xt,
                              scale_type, has_perm, true);
  if (!gather_tiled(pairs, M, sorted, w_batches))
    throw std::invalid_argument("plan_gather: the GEMV's problem (plan_gather_qmv)");
  const int64_t rows = int64_t(pairs) * M;
  // x tiles hold x as stored; W tiles are float16 when x and the scales
  // are (MbWTile), as plan_qmm sizes the dense tiled kernel's.
  const bool half_w = xt == ActType::F16 && scale_type == MB_SCALE_F16;
  for (GatherLaunch& l : plan) {
    l.params.block_rows = MB_QMM_BM;
    l.grid[0] = uint32_t((N + MB_QMM_BN - 1) / MB_QMM_BN);
    l.grid[1] = uint32_t((rows + MB_QMM_BM - 1) / MB_QMM_BM);
    l.grid[2] = 1;
    l.group[0] = MB_QMM_THREADS;
    l.group[1] = l.group[2] = 1;
    l.threadgroup_bytes =
        size_t(mb_gather_qmm_tg_floats(xt == ActType::F32 ? 4 : 2, half_w ? 2 : 4)) *
        sizeof(float);
  }
  return plan;
}

}  // namespace mixbits::metal_host
