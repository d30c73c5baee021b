// MixedGatherQMM::eval_gpu: the Metal path. The gathered GEMV
// (metal/gather_qmv.metal) or, for many sorted rows, the tiled gathered
// kernel (metal/gather_qmm.metal), each ONE dispatch per product: the
// kernel walks the segment table, instantiated per activation and scale
// dtype (past MB_QMM_MAX_SEGS segments, dispatches of that many passing a
// float32 partial sum); the launch plan (kernel names, grids, parameters,
// and the buffers each launch binds) comes from metal/gather_host.h, the
// same code the emulator harness runs on Linux. Compiled only when MLX has
// Metal (CMake adds cpp/*/metal.cpp under MLX_BUILD_METAL); gather.cpp holds
// the stub for builds without it. Every argument was validated, every
// input made dense and the indices made uint32 of one shape when the node
// was built (mixed_gather_qmm), and the builder sends here only problems
// gather_gpu_refusal accepts: nothing here rejects user input.
//
// MixedGatherQMMT::eval_gpu (the gradient wrt x, dx[lhs[i]] += dy[i] ·
// W[rhs[i]] un-permuted, for few rows per matrix): the grouping of the
// pairs by dx matrix (with the perm's check), then one gather_qmv_t.metal
// product over every segment; the plan from metal/gather_t_host.h.
#ifdef _METAL_

#ifndef MIXBITS_HAS_METALLIB
#error "cpp/gather/metal.cpp needs the mixbits metallib (MIXBITS_HAS_METALLIB)"
#endif

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/metal_bind.h"
#include "common/metal_lib.h"
#include "gather/gather.h"
#include "gather/transposed.h"
#include "gather_host.h"
#include "gather_params.h"
#include "gather_t_host.h"
#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"

namespace mixbits {

namespace {

int64_t matrices(const mx::array& a) {
  int64_t n = 1;
  for (int i = 0; i + 2 < int(a.ndim()); ++i) n *= a.shape(i);
  return n;
}

}  // namespace

void MixedGatherQMM::eval_gpu(const std::vector<mx::array>& inputs,
                              mx::array& out) {
  namespace host = metal_host;
  const mx::Stream& s = stream();
  auto& d = mx::metal::device(s.device);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  std::vector<mx::array> in = inputs;  // shared handles, for binding
  const size_t first = has_perm_ ? 2 : 1;
  const size_t lhs = in.size() - 2, rhs = in.size() - 1;
  const int M = in[0].shape(-2), N = in[first].shape(-2);
  const int64_t pairs = int64_t(in[lhs].size());
  if (pairs == 0 || M == 0 || N == 0) return;
  std::vector<host::QmmSegment> segs;
  for (const SegSpec& sg : segs_) segs.push_back({sg.bits, sg.group_size, sg.k});

  // (the builder checked these against gather_gpu_refusal)
  const int xb = int(matrices(in[0])), wb = int(matrices(in[first]));
  const host::ActType at = metal_act_type(out.dtype());
  const int st = metal_scale_type(in[first + 1].dtype());
  auto* lib = mixbits_metal_library(d);
  auto& enc = mx::metal::get_command_encoder(s);

  std::vector<host::GatherLaunch> plan;
  if (host::gather_tiled(int(pairs), M, sorted_, wb)) {
    plan = host::plan_gather(int(pairs), M, N, xb, wb, segs, at, st, has_perm_, sorted_);
  } else {
    // The GEMV's threadgroup size is the host's choice (qmv_simdgroups),
    // bounded by what the pipeline allows on this GPU.
    const auto probe = host::plan_gather_qmv(int(pairs), M, N, xb, wb, segs, at, st,
                                             has_perm_, sorted_);
    const int gemv_threads = int(
        d.get_kernel(probe.at(0).kernel, lib)->maxTotalThreadsPerThreadgroup());
    plan = host::plan_gather_qmv(int(pairs), M, N, xb, wb, segs, at, st, has_perm_, sorted_,
                                 gemv_threads);
  }
  // More than MB_QMM_MAX_SEGS segments pass a float32 partial sum.
  std::optional<mx::array> acc;
  if (host::qmm_needs_acc(segs.size()))
    acc = metal_temporary(enc, {int(pairs), M, N}, mx::float32);
  for (const host::GatherLaunch& l : plan) {
    auto* kernel = launch_pipeline(d, lib, l, "gather_qmm");
    std::vector<mx::array*> arrays(MB_GQMV_PARAMS, nullptr);
    arrays[MB_GQMV_X] = &in[0];
    if (has_perm_) arrays[MB_GQMV_PERM] = &in[1];
    arrays[MB_GQMV_LHS] = &in[lhs];
    arrays[MB_GQMV_RHS] = &in[rhs];
    for (int j = 0; j < l.params.q.nseg; ++j) {
      const size_t i = size_t(l.first_segment + j);
      arrays[size_t(host::gather_qmv_wq_slot(j))] = &in[first + 3 * i];
      arrays[size_t(host::gather_qmv_scales_slot(j))] = &in[first + 3 * i + 1];
      arrays[size_t(host::gather_qmv_biases_slot(j))] = &in[first + 3 * i + 2];
    }
    // As an output the partial sum also orders this dispatch after the one
    // that wrote it (MLX inserts the barrier).
    if (acc) arrays[MB_GQMV_ACC] = &*acc;
    arrays[MB_GQMV_OUT] = &out;
    encode_launch(enc, kernel, l, arrays);
  }
}

// The index scratch (status, the pairs grouped by dx matrix, the inverse
// perm) is a temporary of the command buffer; as the grouping's output and
// the product's input it also orders the two dispatches (MLX inserts the
// barrier). mixed_gather_qmm_t builds this node only for problems
// gather_qmm_t_gpu_runs accepts.
void MixedGatherQMMT::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  namespace host = metal_host;
  const mx::Stream& s = stream();
  auto& d = mx::metal::device(s.device);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  std::vector<mx::array> in = inputs;  // shared handles, for binding
  const size_t first = has_perm_ ? 2 : 1;
  const size_t lhs = in.size() - 2, rhs = in.size() - 1;
  const int M = out.shape(-2), K = out.shape(-1), N = in[first].shape(-2);
  const int pairs = int(in[lhs].size());
  const int Bx = int(matrices(out)), Bw = int(matrices(in[first]));
  std::vector<host::QmmSegment> segs;
  for (const SegSpec& sg : segs_) segs.push_back({sg.bits, sg.group_size, sg.k});
  const auto plan = host::plan_gather_qmv_t(pairs, M, N, Bx, Bw, segs,
                                            metal_act_type(out.dtype()),
                                            metal_scale_type(in[first + 1].dtype()), has_perm_);

  auto& enc = mx::metal::get_command_encoder(s);
  // The grouping's scratch, when the plan has a grouping launch (a fused
  // product groups the pairs itself).
  std::optional<mx::array> index;
  if (plan.front().kind == host::GtKind::Group)
    index = metal_temporary(enc, {int(host::gt_index_words(pairs, Bx, K, has_perm_))},
                            mx::int32);

  auto* lib = mixbits_metal_library(d);
  for (const host::GatherTLaunch& l : plan) {
    auto* kernel = launch_pipeline(d, lib, l, "gather_qmm (transposed)");
    std::vector<mx::array*> arrays(MB_GT_PARAMS, nullptr);
    arrays[MB_GT_DY] = &in[0];
    if (has_perm_) arrays[MB_GT_PERM] = &in[1];
    arrays[MB_GT_OUT] = &out;
    arrays[MB_GT_LHS] = &in[lhs];
    arrays[MB_GT_RHS] = &in[rhs];
    if (index) arrays[MB_GT_INDEX] = &*index;
    if (l.kind == host::GtKind::Product) {
      for (int j = 0; j < l.params.q.nseg; ++j) {
        const size_t i = first + 3 * size_t(j);
        arrays[size_t(host::gt_wq_slot(j))] = &in[i];
        arrays[size_t(host::gt_scales_slot(j))] = &in[i + 1];
        arrays[size_t(host::gt_biases_slot(j))] = &in[i + 2];
      }
    }

    encode_launch(enc, kernel, l, arrays);
  }
}

}  // namespace mixbits

#endif  // _METAL_
