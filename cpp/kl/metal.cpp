// KLDivergence::eval_gpu: the Metal path. One threadgroup per row runs the
// online max / log-sum-exp pass of kl.metal; the launch plan comes from
// metal/kl_host.h, the same code the emulator tests on Linux run. Compiled
// only when MLX has Metal (CMake adds cpp/*/metal.cpp under
// MLX_BUILD_METAL); kl.cpp holds the stub for builds without it.
#ifdef _METAL_

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "kl/kl.h"
#include "kl_host.h"
#include "kl_params.h"
#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"

namespace mixbits {

namespace {

namespace host = metal_host;

// mixbits.metallib is installed next to this shared library.
const std::string& kl_library_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&kl_library_dir), &info))
      throw std::runtime_error("mixbits: cannot locate the extension library");
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

host::ActType kl_act_type(mx::Dtype t) {
  if (t == mx::float16) return host::ActType::F16;
  if (t == mx::bfloat16) return host::ActType::BF16;
  return host::ActType::F32;
}

int kl_mode(KLMode m) {
  switch (m) {
    case KLMode::FixedShift: return MB_KL_MODE_FIXED_SHIFT;
    case KLMode::Probs: return MB_KL_MODE_PROBS;
    default: return MB_KL_MODE_LOGITS;
  }
}

}  // namespace

void KLDivergence::eval_gpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const mx::Stream& s = stream();
  auto& d = mx::metal::device(s.device);
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));

  // Inputs were made row-contiguous when the graph node was built.
  const mx::array& ref = inputs[0];
  const mx::array& logits = inputs[1];
  const int64_t V = logits.shape(-1);
  const int64_t rows = V ? logits.size() / V : 0;
  if (rows == 0) return;
  if (rows > int64_t(INT32_MAX))
    throw std::invalid_argument("kl_divergence: too many rows for the GPU kernel");

  const auto l = host::plan_kl(int(rows), int(V), kl_act_type(ref.dtype()),
                               kl_act_type(logits.dtype()), kl_mode(mode_));
  auto* lib = d.get_library("mixbits", kl_library_dir());
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(d.get_kernel(l.kernel, lib));
  enc.set_input_array(ref, MB_KL_A);
  enc.set_input_array(logits, MB_KL_B);
  // Logits mode has no row parameter; the reference stands in, unread.
  enc.set_input_array(inputs.size() > 2 ? inputs[2] : ref, MB_KL_ROW_PARAM);
  // outputs: kl, status, argmax_q, lse_q, argmax_ref, lse_ref (kl.h), bound
  // at MB_KL_OUT .. MB_KL_LSE_REF in the same order.
  for (int j = 0; j < 6; ++j) enc.set_output_array(outputs[j], MB_KL_OUT + j);
  enc.set_bytes(l.params, MB_KL_PARAMS);
  enc.set_threadgroup_memory_length(l.threadgroup_bytes, 0);
  enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                            MTL::Size(l.group[0], l.group[1], l.group[2]));
}

}  // namespace mixbits

#endif  // _METAL_
