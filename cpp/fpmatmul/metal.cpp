// FpQMatmul::eval_gpu: the Metal path for MLX's fp quantization modes
// (mxfp4, nvfp4, mxfp8), one dispatch of metal/fp_qmv.metal's GEMV for
// 1..MB_FPQ_MAX_M rows of x; the launch (kernel name, grid, parameters and
// the buffers it binds) comes from metal/fp_qmv_host.h, the same code the
// emulator harness runs on Linux (tests/metal/harness_fp.cpp). More rows,
// stacks of matrices and transpose=False never get here: Python sends
// them to mx.quantized_matmul (mixbits/ops.py), and fp_qmatmul refuses a
// GPU node the kernel cannot run.
// Compiled only when MLX has Metal (CMake adds cpp/*/metal.cpp under
// MLX_BUILD_METAL); fpmatmul.cpp holds the stub for builds without it.
// x, wq and scales were made dense when the node was built (fp_qmatmul).
#ifdef _METAL_

#ifndef MIXBITS_HAS_METALLIB
#error "cpp/fpmatmul/metal.cpp needs the mixbits metallib (MIXBITS_HAS_METALLIB)"
#endif

#include <stdexcept>
#include <vector>

#include "common/metal_bind.h"
#include "common/metal_lib.h"
#include "fp_qmv_host.h"
#include "fpmatmul/fpmatmul.h"
#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"

namespace mixbits {

void FpQMatmul::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  namespace host = metal_host;
  const mx::Stream& s = stream();
  auto& d = mx::metal::device(s.device);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  // fp_qmatmul builds GPU nodes for x · Wᵀ only.
  if (!transpose_) throw std::logic_error("FpQMatmul::eval_gpu: transpose=false on the GPU");
  std::vector<mx::array> in = inputs;  // shared handles, for binding
  const int N = in[1].shape(0);
  const int K = int(int64_t(in[1].shape(1)) * 32 / fp_mode_bits(mode_));
  const int M = int(in[0].size() / size_t(K));
  if (M == 0 || N == 0) return;

  // FpMode and MbFpMode number the modes alike (static_asserts below).
  const host::FpQmvLaunch l =
      host::plan_fp_qmv(M, N, K, int(mode_), metal_act_type(out.dtype()));
  auto& enc = mx::metal::get_command_encoder(s);
  auto* kernel = launch_pipeline(d, mixbits_metal_library(d), l, "quantized_matmul (fp mode)");
  std::vector<mx::array*> arrays(MB_FPQ_PARAMS, nullptr);
  arrays[MB_FPQ_X] = &in[0];
  arrays[MB_FPQ_WQ] = &in[1];
  arrays[MB_FPQ_SCALES] = &in[2];
  arrays[MB_FPQ_OUT] = &out;
  encode_launch(enc, kernel, l, arrays);
}

static_assert(int(FpMode::Mxfp4) == MB_FP_MXFP4 && int(FpMode::Nvfp4) == MB_FP_NVFP4 &&
                  int(FpMode::Mxfp8) == MB_FP_MXFP8,
              "FpMode and MbFpMode must number the modes alike");

}  // namespace mixbits

#endif  // _METAL_
