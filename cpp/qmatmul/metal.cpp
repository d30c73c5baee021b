// MixedQMatmul::eval_gpu: the Metal path. One dispatch per K-segment, each
// a kernel specialized for that segment's bits and group size (GEMV for few
// rows, tiled above MB_QMV_MAX_M); the launch plan (kernel names, grids,
// parameters) comes from metal/qmatmul_host.h, the same code the emulator
// tests on Linux run. Compiled only when MLX has Metal (CMake adds
// cpp/*/metal.cpp under MLX_BUILD_METAL); qmatmul.cpp holds the stub for
// builds without it.
#ifdef _METAL_

#include <dlfcn.h>

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"
#include "qmatmul/qmatmul.h"
#include "qmatmul_host.h"
#include "qmatmul_params.h"

namespace mixbits {

namespace {

namespace host = metal_host;

// mixbits.metallib is installed next to this shared library.
const std::string& library_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&library_dir), &info))
      throw std::runtime_error("mixbits: cannot locate the extension library");
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

host::ActType act_type(mx::Dtype t) {
  if (t == mx::float16) return host::ActType::F16;
  if (t == mx::bfloat16) return host::ActType::BF16;
  return host::ActType::F32;
}

int scale_type(mx::Dtype t) {
  if (t == mx::float16) return MB_SCALE_F16;
  if (t == mx::bfloat16) return MB_SCALE_BF16;
  return MB_SCALE_F32;
}

}  // namespace

void MixedQMatmul::eval_gpu(const std::vector<mx::array>& inputs,
                            mx::array& out) {
  const mx::Stream& s = stream();
  auto& d = mx::metal::device(s.device);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  const int first = has_perm_ ? 2 : 1;
  const int N = inputs[first].shape(0);
  int K = 0;
  std::vector<host::QmmSegment> segs;
  for (const SegSpec& sg : segs_) {
    segs.push_back({sg.bits, sg.group_size, sg.k});
    K += sg.k;
  }
  const int M = int(inputs[0].size() / K);
  if (M == 0 || N == 0) return;

  // The kernels index x as a dense [M, K] matrix; x, perm, wq, scales and
  // biases were made contiguous when the graph node was built
  // (mixed_qmatmul), so eval_gpu needs no copy kernel of its own.
  const mx::array& x = inputs[0];
  if (!x.flags().row_contiguous)
    throw std::logic_error("qmatmul: x reached eval_gpu not row-contiguous");
  const mx::array& perm = has_perm_ ? inputs[1] : x;
  const auto plan = host::plan_qmm(M, N, segs, act_type(out.dtype()),
                                   scale_type(inputs[first + 1].dtype()),
                                   has_perm_);

  // Several segments pass a float32 partial sum from dispatch to dispatch.
  std::optional<mx::array> acc;
  if (host::qmm_needs_acc(segs.size())) {
    acc = mx::array(mx::allocator::malloc(size_t(M) * N * sizeof(float)),
                    {M, N}, mx::float32);
    mx::metal::get_command_encoder(s).add_temporary(*acc);
  }

  auto* lib = d.get_library("mixbits", library_dir());
  auto& enc = mx::metal::get_command_encoder(s);
  for (const host::QmmLaunch& l : plan) {
    const int i = l.segment;
    enc.set_compute_pipeline_state(d.get_kernel(l.kernel, lib));
    enc.set_input_array(x, MB_QMM_X);
    enc.set_input_array(perm, MB_QMM_PERM);  // x stands in when unused
    enc.set_input_array(inputs[first + 3 * i], MB_QMM_WQ);
    enc.set_input_array(inputs[first + 3 * i + 1], MB_QMM_SCALES);
    enc.set_input_array(inputs[first + 3 * i + 2], MB_QMM_BIASES);
    // As an output the partial sum also orders this dispatch after the one
    // that wrote it (MLX inserts the barrier).
    enc.set_output_array(acc ? *acc : out, MB_QMM_ACC);
    enc.set_output_array(out, MB_QMM_OUT);
    enc.set_bytes(l.params, MB_QMM_PARAMS);
    if (l.threadgroup_bytes)
      enc.set_threadgroup_memory_length(l.threadgroup_bytes, 0);
    enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                              MTL::Size(l.group[0], l.group[1], l.group[2]));
  }
}

}  // namespace mixbits

#endif  // _METAL_
