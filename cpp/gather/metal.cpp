// MixedGatherQMM::eval_gpu: the Metal path. One dispatch per K-segment of
// the gathered GEMV (metal/gather_qmv.metal) or, for many sorted rows, the
// tiled gathered kernel (metal/gather_qmm.metal), each specialized for
// that segment's bits, group size and scale dtype, the segments meeting in
// a float32 partial sum; the launch plan (kernel names, grids, parameters,
// and the buffers each launch binds) comes from metal/gather_host.h, the
// same code the emulator harness runs on Linux. Compiled only when MLX has
// Metal (CMake adds cpp/*/metal.cpp under MLX_BUILD_METAL); gather.cpp holds
// the stub for builds without it. Every argument was validated, every
// input made dense and the indices made uint32 of one shape when the node
// was built (mixed_gather_qmm), and the builder sends here only problems
// gather_gpu_refusal accepts: nothing here rejects user input.
#ifdef _METAL_

#ifndef MIXBITS_HAS_METALLIB
#error "cpp/gather/metal.cpp needs the mixbits metallib (MIXBITS_HAS_METALLIB)"
#endif

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/metal_bind.h"
#include "common/metal_lib.h"
#include "gather/gather.h"
#include "gather_host.h"
#include "gather_params.h"
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
  const auto plan = host::plan_gather(
      int(pairs), M, N, int(matrices(in[0])), int(matrices(in[first])), segs,
      metal_act_type(out.dtype()), metal_scale_type(in[first + 1].dtype()), has_perm_, sorted_);

  auto& enc = mx::metal::get_command_encoder(s);
  // Several segments pass a float32 partial sum from dispatch to dispatch.
  std::optional<mx::array> acc;
  if (host::qmm_needs_acc(segs.size()))
    acc = metal_temporary(enc, {int(pairs), M, N}, mx::float32);

  auto* lib = mixbits_metal_library(d);
  for (const host::GatherLaunch& l : plan) {
    const size_t i = size_t(l.segment);
    auto* kernel = launch_pipeline(d, lib, l, "gather_qmm");
    std::vector<mx::array*> arrays(MB_GATHER_PARAMS, nullptr);
    arrays[MB_GATHER_X] = &in[0];
    if (has_perm_) arrays[MB_GATHER_PERM] = &in[1];
    arrays[MB_GATHER_WQ] = &in[first + 3 * i];
    arrays[MB_GATHER_SCALES] = &in[first + 3 * i + 1];
    arrays[MB_GATHER_BIASES] = &in[first + 3 * i + 2];
    arrays[MB_GATHER_LHS] = &in[lhs];
    arrays[MB_GATHER_RHS] = &in[rhs];
    // As an output the partial sum also orders this dispatch after the one
    // that wrote it (MLX inserts the barrier).
    if (acc) arrays[MB_GATHER_ACC] = &*acc;
    arrays[MB_GATHER_OUT] = &out;

    encode_launch(enc, kernel, l, arrays);
  }
}

}  // namespace mixbits

#endif  // _METAL_
