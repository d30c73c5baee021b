// MixedQMatmul::eval_gpu: the Metal path. One dispatch per product (per
// MB_QMM_MAX_SEGS K-segments): the kernel walks the segment table itself,
// each segment with its own bits and group size (GEMV for few rows, tiled
// above MB_QMV_MAX_M); the launch plan (kernel names, grids, segment
// tables, and the buffers each launch binds) comes from
// metal/qmatmul_host.h, the same code the emulator harness runs on Linux.
// Compiled only when MLX has Metal (CMake adds cpp/*/metal.cpp under
// MLX_BUILD_METAL); qmatmul.cpp holds the stub for builds without it.
// Every argument was validated, and x, perm, wq, scales and biases made
// contiguous, when the graph node was built (mixed_qmatmul): eval_gpu
// needs no copy kernel of its own and rejects no user input.
//
// MixedQMatmulT::eval_gpu (the gradient wrt x, dx = dy · W un-permuted,
// for few rows of dy): one qmatmul_t.metal dispatch over every segment,
// the perm included; the plan from metal/qmatmul_t_host.h.
#ifdef _METAL_

#ifndef MIXBITS_HAS_METALLIB
// CMake builds mixbits.metallib next to the extension whenever it compiles
// this file; without it get_library would fail on the first call instead.
#error "cpp/qmatmul/metal.cpp needs the mixbits metallib (MIXBITS_HAS_METALLIB)"
#endif

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/metal_bind.h"
#include "common/metal_lib.h"
#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "qmatmul/qmatmul.h"
#include "qmatmul/transposed.h"
#include "qmatmul_host.h"
#include "qmatmul_params.h"
#include "qmatmul_t_host.h"

namespace mixbits {

namespace host = metal_host;

void MixedQMatmul::eval_gpu(const std::vector<mx::array>& inputs,
                            mx::array& out) {
  const mx::Stream& s = stream();
  auto& d = mx::metal::device(s.device);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  std::vector<mx::array> in = inputs;  // shared handles, for binding
  const int first = has_perm_ ? 2 : 1;
  const int N = in[size_t(first)].shape(0);
  int K = 0;
  std::vector<host::QmmSegment> segs;
  for (const SegSpec& sg : segs_) {
    segs.push_back({sg.bits, sg.group_size, sg.k});
    K += sg.k;
  }
  // (the builder refuses M > INT32_MAX)
  const int M = int(in[0].size() / size_t(K));
  if (M == 0 || N == 0) return;

  auto* lib = mixbits_metal_library(d);
  const host::ActType at = metal_act_type(out.dtype());
  const int st = metal_scale_type(in[size_t(first) + 1].dtype());
  // The GEMV's threadgroup size is the host's choice (qmv_simdgroups),
  // bounded by what its pipeline allows on this GPU.
  int gemv_threads = 1024;
  if (!host::qmm_uses_tiled(M, host::QmmPath::Auto))
    gemv_threads = int(d.get_kernel(host::qmm_kernel_name(false, at, st), lib)
                           ->maxTotalThreadsPerThreadgroup());
  const auto plan =
      host::plan_qmm(M, N, segs, at, st, has_perm_, host::QmmPath::Auto, gemv_threads);

  auto& enc = mx::metal::get_command_encoder(s);
  // Only more than MB_QMM_MAX_SEGS segments pass a float32 partial sum from
  // dispatch to dispatch.
  std::optional<mx::array> acc;
  if (host::qmm_needs_acc(segs.size())) acc = metal_temporary(enc, {M, N}, mx::float32);

  for (const host::QmmLaunch& l : plan) {
    auto* kernel = launch_pipeline(d, lib, l, "qmatmul");
    std::vector<mx::array*> arrays(MB_QMM_PARAMS, nullptr);
    arrays[MB_QMM_X] = &in[0];
    if (has_perm_) arrays[MB_QMM_PERM] = &in[1];
    for (int j = 0; j < l.params.nseg; ++j) {
      const size_t i = size_t(first) + 3 * size_t(l.first_segment + j);
      arrays[size_t(host::qmm_wq_slot(j))] = &in[i];
      arrays[size_t(host::qmm_scales_slot(j))] = &in[i + 1];
      arrays[size_t(host::qmm_biases_slot(j))] = &in[i + 2];
    }
    // As an output the partial sum also orders this dispatch after the one
    // that wrote it (MLX inserts the barrier).
    if (acc) arrays[MB_QMM_ACC] = &*acc;
    arrays[MB_QMM_OUT] = &out;

    encode_launch(enc, kernel, l, arrays);
  }
}

// One dispatch (qmatmul_t.metal walks the segment table and checks and
// applies the perm itself): no scratch buffers. mixed_qmatmul_t builds this
// node only for problems qmv_t_gpu_applies.
void MixedQMatmulT::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  namespace host = metal_host;
  const mx::Stream& s = stream();
  auto& d = mx::metal::device(s.device);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  std::vector<mx::array> in = inputs;  // shared handles, for binding
  const size_t first = has_perm_ ? 2 : 1;
  const int N = in[first].shape(0);
  std::vector<host::QmmSegment> segs;
  int K = 0;
  for (const SegSpec& sg : segs_) {
    segs.push_back({sg.bits, sg.group_size, sg.k});
    K += sg.k;
  }
  const int M = int(out.size() / size_t(K));
  if (M == 0) return;
  const auto plan = host::plan_qmv_t(M, N, segs, metal_act_type(out.dtype()),
                                     metal_scale_type(in[first + 1].dtype()), has_perm_);

  auto& enc = mx::metal::get_command_encoder(s);
  auto* lib = mixbits_metal_library(d);
  for (const host::QtLaunch& l : plan) {
    auto* kernel = launch_pipeline(d, lib, l, "qmatmul (transposed)");
    std::vector<mx::array*> arrays(MB_QT_PARAMS, nullptr);
    arrays[MB_QT_DY] = &in[0];
    if (has_perm_) arrays[MB_QT_PERM] = &in[1];
    for (int j = 0; j < l.params.nseg; ++j) {
      const size_t i = first + 3 * size_t(j);
      arrays[size_t(host::qt_wq_slot(j))] = &in[i];
      arrays[size_t(host::qt_scales_slot(j))] = &in[i + 1];
      arrays[size_t(host::qt_biases_slot(j))] = &in[i + 2];
    }
    arrays[MB_QT_OUT] = &out;

    encode_launch(enc, kernel, l, arrays);
  }
}

}  // namespace mixbits

#endif  // _METAL_
