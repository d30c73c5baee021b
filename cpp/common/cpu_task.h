// The set-up every CPU eval repeats before it dispatches its task:
// allocate each output, register inputs and outputs
// with the stream's command encoder (so MLX orders the task against other
// work on them), and hand the task weak copies of the outputs (capturing
// the arrays themselves would keep the graph alive).
#pragma once
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

// One output: returns the weak copy the task writes through.
inline mlx::core::array begin_cpu_task(mlx::core::cpu::CommandEncoder& enc,
                                       const std::vector<mlx::core::array>& inputs,
                                       mlx::core::array& out) {
  namespace mx = mlx::core;
  for (const auto& a : inputs) enc.set_input_array(a);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  enc.set_output_array(out);
  return mx::array::unsafe_weak_copy(out);
}

// Several outputs: one weak copy per output, in order.
inline std::vector<mlx::core::array> begin_cpu_task(mlx::core::cpu::CommandEncoder& enc,
                                                    const std::vector<mlx::core::array>& inputs,
                                                    std::vector<mlx::core::array>& outputs) {
  namespace mx = mlx::core;
  for (const auto& a : inputs) enc.set_input_array(a);
  std::vector<mx::array> outs;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
    outs.push_back(mx::array::unsafe_weak_copy(o));
  }
  return outs;
}

}  // namespace mixbits
