// How the primitives take their array inputs. Wrapping every input in
// mx::contiguous adds a graph node per input per call (~690 nodes per
// decode token of a small model, ~2.8 ms of ~36 ms), although the weights
// are evaluated and row-contiguous and most activations are too.
#pragma once
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

namespace mixbits {

// `a` itself when it is already evaluated and row-contiguous (weights, as a
// rule), else mx::contiguous(a): for kernels that index a dense buffer
// and do not check the layout at eval time.
inline mlx::core::array dense_input(const mlx::core::array& a, mlx::core::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mlx::core::contiguous(a, false, s);
}

// For eval_cpu, where an input's layout is known: a's elements in
// row-major order, that is a's own buffer when it is row-contiguous, else
// a copy gathered through its strides into `buf` (which must outlive the
// use). Lets a builder hand lazy inputs over without a contiguous node.
const void* row_major(const mlx::core::array& a, std::vector<char>& buf);

}  // namespace mixbits
