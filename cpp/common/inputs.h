// How the primitives take their array inputs. Wrapping every input in
// mx::contiguous adds a graph node per input per call (~690 nodes per
// decode token of a small model, ~2.8 ms of ~36 ms), although the weights
// are evaluated and row-contiguous and most activations are too.
#pragma once
#include <cstdint>
#include <optional>
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

// The number of elements of an array of `shape`.
inline int64_t element_count(const mlx::core::Shape& shape) {
  int64_t n = 1;
  for (int d : shape) n *= d;
  return n;
}

// An array of `shape` over memory at p that it does not own (no copy, no
// free): the caller keeps p alive while the array is read. For handing a
// task-local buffer to code that takes arrays.
inline mlx::core::array borrowed(void* p, const mlx::core::Shape& shape, mlx::core::Dtype dtype) {
  return mlx::core::array(p, shape, dtype, [](void*) {});
}

// For eval_cpu: a's elements in row-major order as an array of `shape`
// (a's size), a's own buffer or a copy in `buf` (row_major), held by
// neither: for code that indexes an array densely, on an input that may be
// strided or a view's root.
mlx::core::array dense_as(const mlx::core::array& a, const mlx::core::Shape& shape,
                          std::vector<char>& buf);

// The array a lazy `x` is a view of, when x was made from it by views that
// keep the elements in row-major order (reshape, expand/squeeze dims, a
// transpose that moves only axes of size 1); else x. A primitive that reads
// its input as row-major elements (row_major) and takes its logical shape
// from x, not from the array it is handed, can take this root: the view
// nodes then leave the graph. A decode token of a llama-style model has 8
// such nodes per layer around attention (q/k/v reshaped to heads and
// transposed, the output back), ~3 us of MLX dispatch each.
mlx::core::array through_views(const mlx::core::array& x);

// What a node built on root = through_views(x) keeps: x's shape when root
// is another shape, else nothing (the input is x itself).
inline std::optional<mlx::core::Shape> viewed_shape(const mlx::core::array& x,
                                                    const mlx::core::array& root) {
  if (x.shape() == root.shape()) return std::nullopt;
  return x.shape();
}

// The shape a node reads its input `in` as: `viewed` when it was built on a
// view's root, else in's own. For output_shapes: a shapeless compile that
// replays such a node on an input of another size gets std::invalid_argument
// naming `op` (the view's new shape is not known), not a wrong shape.
mlx::core::Shape input_shape(const mlx::core::array& in,
                             const std::optional<mlx::core::Shape>& viewed, const char* op);

// For derivatives built from MLX ops on such a node's input `a`: a as the
// shape the node reads it as (reshaped to `viewed`), else a itself.
inline mlx::core::array as_viewed(const mlx::core::array& a,
                                  const std::optional<mlx::core::Shape>& viewed,
                                  mlx::core::Stream s) {
  return viewed ? mlx::core::reshape(a, *viewed, s) : a;
}

}  // namespace mixbits
