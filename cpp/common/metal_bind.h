// Binds the MLX arrays of one Metal launch to their buffer slots, from the
// launch's own description of its buffers (metal/kernel_args.h, the same
// description the emulator harness allocates from), and refuses an array
// that does not match it. A mismatch here is a bug in mixbits, not bad
// user input (that is refused when the graph is built), so it throws
// std::logic_error naming the buffer. Included only by cpp/*/metal.cpp.
#pragma once
#ifdef _METAL_

#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_args.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/metal/device.h"

namespace mixbits {

namespace metal_bind_detail {

namespace mx = mlx::core;
namespace host = metal_host;

inline bool same_storage(mx::Dtype t, host::Elem e) {
  switch (e) {
    case host::Elem::F32: return t == mx::float32;
    case host::Elem::F16: return t == mx::float16;
    case host::Elem::BF16: return t == mx::bfloat16;
    case host::Elem::U8: return t == mx::uint8;
    // The kernels read index buffers as int32 bits; a uint32 perm gives the
    // same bits (an entry >= 2^31 reads as out of range, as on the CPU).
    default: return t == mx::int32 || t == mx::uint32;
  }
}

[[noreturn]] inline void mismatch(const std::string& kernel,
                                  const host::BufferArg& b,
                                  const std::string& what) {
  throw std::logic_error("mixbits: " + kernel + ": buffer " + host::describe(b) +
                         ": " + what);
}

}  // namespace metal_bind_detail

// arrays[i] is the array for buffer index i, nullptr for a slot the launch
// leaves unused (its description names the stand-in bound there).
inline void bind_buffers(mlx::core::metal::CommandEncoder& enc,
                         const metal_host::Launch& l,
                         const std::vector<mlx::core::array*>& arrays) {
  namespace d = metal_bind_detail;
  using metal_host::Dir;
  for (const auto& b : l.buffers) {
    if (!b.used()) {
      if (b.stand_in < 0 || size_t(b.stand_in) >= arrays.size() ||
          !arrays[size_t(b.stand_in)])
        d::mismatch(l.kernel, b, "unused slot without a stand-in");
      const mlx::core::array& s = *arrays[size_t(b.stand_in)];
      // Never read or written; only its alignment matters to Metal.
      if (s.offset() != 0) d::mismatch(l.kernel, b, "stand-in has an offset");
      enc.set_buffer(static_cast<const MTL::Buffer*>(s.buffer().ptr()), b.index, 0);
      continue;
    }
    if (size_t(b.index) >= arrays.size() || !arrays[size_t(b.index)])
      d::mismatch(l.kernel, b, "no array given");
    mlx::core::array& a = *arrays[size_t(b.index)];
    if (!d::same_storage(a.dtype(), b.elem))
      d::mismatch(l.kernel, b, "array has another dtype");
    if (a.size() != b.count)
      d::mismatch(l.kernel, b, "array has " + std::to_string(a.size()) + " elements");
    if (!a.flags().row_contiguous)
      d::mismatch(l.kernel, b, "array is not row-contiguous");
    if (a.offset() % int64_t(metal_host::elem_bytes(b.elem)) != 0)
      d::mismatch(l.kernel, b, "array offset is not element-aligned");
    if (b.dir == Dir::In) {
      enc.set_input_array(a, b.index);
    } else {
      enc.set_output_array(a, b.index);
    }
  }
}

// A scratch array that lives as long as the command buffer (partial sums,
// inverse permutations): allocated here, freed by MLX when the GPU is done.
inline mlx::core::array metal_temporary(mlx::core::metal::CommandEncoder& enc,
                                        mlx::core::Shape shape, mlx::core::Dtype t) {
  size_t n = 1;
  for (int v : shape) n *= size_t(v);
  mlx::core::array a(mlx::core::allocator::malloc(n * t.size()), std::move(shape), t);
  enc.add_temporary(a);
  return a;
}

// The pipeline of a launch's kernel. Its threads per threadgroup are part
// of the kernel's design (tile shapes, simdgroup roles): a GPU whose
// pipeline allows fewer cannot run it, said in one std::runtime_error
// naming the op.
inline MTL::ComputePipelineState* launch_pipeline(mlx::core::metal::Device& d,
                                                  MTL::Library* lib,
                                                  const metal_host::Launch& l,
                                                  const std::string& op) {
  auto* kernel = d.get_kernel(l.kernel, lib);
  if (kernel->maxTotalThreadsPerThreadgroup() < l.threads_per_group())
    throw std::runtime_error(op + ": this GPU allows " +
                             std::to_string(kernel->maxTotalThreadsPerThreadgroup()) +
                             " threads per threadgroup for " + l.kernel + ", which needs " +
                             std::to_string(l.threads_per_group()));
  return kernel;
}

// One launch: pipeline, buffers (bind_buffers), the launch's parameter
// block, its threadgroup memory if any, the grid.
template <class L>
void encode_launch(mlx::core::metal::CommandEncoder& enc, MTL::ComputePipelineState* kernel,
                   const L& l, const std::vector<mlx::core::array*>& arrays) {
  enc.set_compute_pipeline_state(kernel);
  bind_buffers(enc, l, arrays);
  enc.set_bytes(l.params, l.params_index);
  if (l.threadgroup_bytes) enc.set_threadgroup_memory_length(l.threadgroup_bytes, 0);
  enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                            MTL::Size(l.group[0], l.group[1], l.group[2]));
}

}  // namespace mixbits

#endif  // _METAL_
