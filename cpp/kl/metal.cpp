// KLDivergence::eval_gpu: the Metal path. One threadgroup per row runs the
// online max / log-sum-exp pass of kl.metal; the launch plan and the list
// of buffers it binds come from metal/kl_host.h, the same code the
// emulator harness runs on Linux. Compiled only when MLX has Metal (CMake
// adds cpp/*/metal.cpp under MLX_BUILD_METAL); kl.cpp holds the stub for
// builds without it. Every argument was validated when the graph node was
// built (kl_divergence in kl.cpp), so nothing here rejects user input.
#ifdef _METAL_

#ifndef MIXBITS_HAS_METALLIB
// CMake builds mixbits.metallib next to the extension whenever it compiles
// this file; without it get_library would fail on the first call instead.
#error "cpp/kl/metal.cpp needs the mixbits metallib (MIXBITS_HAS_METALLIB)"
#endif

#include <stdexcept>
#include <string>
#include <vector>

#include "common/metal_bind.h"
#include "common/metal_lib.h"
#include "kl/kl.h"
#include "kl_host.h"
#include "kl_params.h"
#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"

namespace mixbits {

namespace {

namespace host = metal_host;

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

  std::vector<mx::array> in = inputs;  // shared handles, for binding
  const int64_t V = in[1].shape(-1);
  const int64_t rows = V ? in[1].size() / V : 0;
  if (rows == 0) return;  // (the builder refuses rows > INT32_MAX)

  const host::ActType ta = metal_act_type(in[0].dtype());
  const host::ActType tb = metal_act_type(in[1].dtype());
  auto* lib = mixbits_metal_library(d);
  auto* kernel = d.get_kernel(host::kl_kernel_name(ta, tb), lib);
  // Any multiple of 32 threads works: take what this pipeline allows.
  const int threads = host::kl_threads_for(kernel->maxTotalThreadsPerThreadgroup());
  const auto l = host::plan_kl(int(rows), int(V), ta, tb, kl_mode(mode_), threads);

  std::vector<mx::array*> arrays(MB_KL_PARAMS, nullptr);
  arrays[MB_KL_A] = &in[0];
  arrays[MB_KL_B] = &in[1];
  if (in.size() > 2) arrays[MB_KL_ROW_PARAM] = &in[2];
  // outputs: kl, status, argmax_q, lse_q, argmax_ref, lse_ref (kl.h), at
  // MB_KL_OUT .. MB_KL_LSE_REF in the same order.
  for (int j = 0; j < 6; ++j) arrays[size_t(MB_KL_OUT + j)] = &outputs[size_t(j)];

  auto& enc = mx::metal::get_command_encoder(s);
  encode_launch(enc, kernel, l, arrays);
}

}  // namespace mixbits

#endif  // _METAL_
