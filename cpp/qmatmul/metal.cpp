// MixedQMatmul::eval_gpu: the Metal path. One dispatch per K-segment, each
// a kernel specialized for that segment's bits, group size and scale dtype
// (GEMV for few rows, tiled above MB_QMV_MAX_M); the launch plan (kernel
// names, grids, parameters, and the buffers each launch binds) comes from
// metal/qmatmul_host.h, the same code the emulator harness runs on Linux.
// Compiled only when MLX has Metal (CMake adds cpp/*/metal.cpp under
// MLX_BUILD_METAL); qmatmul.cpp holds the stub for builds without it.
// Every argument was validated, and x, perm, wq, scales and biases made
// contiguous, when the graph node was built (mixed_qmatmul): eval_gpu
// needs no copy kernel of its own and rejects no user input.
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
#include "qmatmul_host.h"
#include "qmatmul_params.h"

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

  const auto plan = host::plan_qmm(M, N, segs, metal_act_type(out.dtype()),
                                   metal_scale_type(in[size_t(first) + 1].dtype()),
                                   has_perm_);

  // Several segments pass a float32 partial sum from dispatch to dispatch.
  std::optional<mx::array> acc;
  if (host::qmm_needs_acc(segs.size())) {
    acc = mx::array(mx::allocator::malloc(size_t(M) * N * sizeof(float)),
                    {M, N}, mx::float32);
    mx::metal::get_command_encoder(s).add_temporary(*acc);
  }

  auto* lib = mixbits_metal_library(d);
  auto& enc = mx::metal::get_command_encoder(s);
  for (const host::QmmLaunch& l : plan) {
    const size_t i = size_t(l.segment);
    auto* kernel = d.get_kernel(l.kernel, lib);
    // The kernels' thread counts are part of their design (tile shapes,
    // simdgroup roles); a pipeline that allows fewer cannot run them.
    if (kernel->maxTotalThreadsPerThreadgroup() < l.threads_per_group())
      throw std::runtime_error(
          "qmatmul: this GPU allows " +
          std::to_string(kernel->maxTotalThreadsPerThreadgroup()) +
          " threads per threadgroup for " + l.kernel + ", which needs " +
          std::to_string(l.threads_per_group()));
    std::vector<mx::array*> arrays(MB_QMM_PARAMS, nullptr);
    arrays[MB_QMM_X] = &in[0];
    if (has_perm_) arrays[MB_QMM_PERM] = &in[1];
    arrays[MB_QMM_WQ] = &in[size_t(first) + 3 * i];
    arrays[MB_QMM_SCALES] = &in[size_t(first) + 3 * i + 1];
    arrays[MB_QMM_BIASES] = &in[size_t(first) + 3 * i + 2];
    // As an output the partial sum also orders this dispatch after the one
    // that wrote it (MLX inserts the barrier).
    if (acc) arrays[MB_QMM_ACC] = &*acc;
    arrays[MB_QMM_OUT] = &out;

    enc.set_compute_pipeline_state(kernel);
    bind_buffers(enc, l, arrays);
    enc.set_bytes(l.params, l.params_index);
    if (l.threadgroup_bytes)
      enc.set_threadgroup_memory_length(l.threadgroup_bytes, 0);
    enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                              MTL::Size(l.group[0], l.group[1], l.group[2]));
  }
}

}  // namespace mixbits

#endif  // _METAL_
