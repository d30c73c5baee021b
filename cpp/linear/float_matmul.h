// float_matmul: op(A) @ op(B) (+ bias) for float32 / float16 / bfloat16
// on the CPU, as one MLX node. MLX's CPU matmul in the Linux mlx-cpu wheel
// is a reference BLAS (~2 GFLOP/s); this node sends large products to the
// OpenBLAS numpy already loads (blas.h) and decode-sized ones (a few rows
// of x against a weight) to a GEMV that reads half weights as they are
// (kernel.h). A float model's nn.Linear calls reach it through
// mixbits.routing; its gradients are float_matmul products too.
#pragma once
#include <vector>

#include "common/backend.h"
#include "common/primitive.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

// Which code computes the product: the GEMV for M <= gemv_max_rows (when
// its kernel is vectorized) and BLAS above, or one of them at every M
// (tests and benchmarks; Gemv also serves when no BLAS is loaded, with the
// operands rearranged to x @ W.T first).
enum class MatmulPath : int { Auto = 0, Gemv = 1, Blas = 2 };

class FloatMatmul : public mx::UnaryPrimitive {
 public:
  FloatMatmul(mx::Stream s, bool trans_a, bool trans_b, Backend backend, MatmulPath path)
      : mx::UnaryPrimitive(s), ta_(trans_a), tb_(trans_b), backend_(backend), path_(path) {}

  MIXBITS_EVAL_UNARY()
  // vjp: the cotangents are float_matmul products themselves (the same
  // kernels, other transposes) and a sum for the bias; jvp: MLX's ops.
  MIXBITS_GRADS()
  MIXBITS_NAME_AND_EQUIVALENT(FloatMatmul)
  MIXBITS_OUTPUT_SHAPES()

 private:
  bool ta_, tb_;
  Backend backend_;
  MatmulPath path_;
};

// a: any rank >= 1, read as the 2-D matrix A of its rows (a.reshape(-1,
// a.shape[-1])); b: 2-D; bias: none or (N,). Returns
//   trans_a false: A @ op(B) + bias, shape a.shape[:-1] + (N,)  (x @ W.T
//                  for trans_b: nn.Linear);
//   trans_a true:  A.T @ op(B) + bias, shape (a.shape[-1], N)   (a weight's
//                  gradient, leading axes of a contracted);
// op(B) = B.T when trans_b. Sums in float32, result in the promoted dtype
// of the inputs, rounded once. std::invalid_argument (naming the argument)
// before any node is built; `backend` picks the GEMV kernel (as other ops).
mx::array float_matmul(const mx::array& a, const mx::array& b, const std::optional<mx::array>& bias,
                       bool trans_a, bool trans_b, Backend backend = Backend::Auto,
                       MatmulPath path = MatmulPath::Auto, mx::StreamOrDevice s = {});

}  // namespace mixbits
