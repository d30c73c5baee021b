// MLX primitive for RMS normalization on the CPU, one graph node: MLX's
// mx.fast.rms_norm runs on the CPU as a composed fallback of three nodes
// (square, sum, a fused multiply chain), ~35 us a call on a decode token
// against ~5 us for one node (bench/decode_profile.py).
#pragma once
#include <optional>
#include <vector>

#include "common/inline_producer.h"
#include "common/primitive.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

class RmsNorm : public mx::UnaryPrimitive, public InlineProducer {
 public:
  // viewed: x's shape when the node's input is an array x is a view of
  // (through_views), read as x's elements in row-major order.
  RmsNorm(mx::Stream s, float eps, std::optional<mx::Shape> viewed)
      : mx::UnaryPrimitive(s), eps_(eps), viewed_(std::move(viewed)) {}

  MIXBITS_EVAL_UNARY()
  // MLX's own mx.fast.rms_norm differentiated by MLX (correct, not fast:
  // only inference calls are routed here).
  MIXBITS_GRADS()
  MIXBITS_NAME_AND_EQUIVALENT(RmsNorm)
  MIXBITS_OUTPUT_SHAPES()
  void compute(const std::vector<mx::array>& inputs, const mx::Shape& shape, mx::Dtype dtype,
               void* dst) const override;

 private:
  float eps_;
  std::optional<mx::Shape> viewed_;
};

// mx.fast.rms_norm(x, w, eps): x float32/float16/bfloat16 with last axis D,
// w of shape (D,) in one of those dtypes; the result in their promoted
// dtype. Computed as MLX's fallback orders it: x * rsqrt(mean(x^2) + eps)
// in float32, rounded to the result dtype, times w (rounded again).
// std::invalid_argument (naming the argument) before any node is built.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps,
                   mx::StreamOrDevice s = {});

}  // namespace mixbits
