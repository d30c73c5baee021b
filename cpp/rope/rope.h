// MLX primitive for rotary position embedding on the CPU, one graph node.
// MLX's mx.fast.rope runs on the CPU as a composed fallback of ~13 nodes a
// call (SmolLM2: 60 calls, ~780 nodes of a ~2,500-node decode token), and
// its cosines and sines are recomputed in every one.
#pragma once
#include <functional>
#include <optional>
#include <vector>

#include "common/inline_producer.h"
#include "common/primitive.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

class Rope : public mx::UnaryPrimitive, public InlineProducer {
 public:
  // viewed: x's shape when the node's input is an array x is a view of
  // (through_views), read as x's elements in row-major order.
  Rope(mx::Stream s, int dims, bool traditional, float base, float scale,
       std::optional<mx::Shape> viewed)
      : mx::UnaryPrimitive(s),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale),
        viewed_(std::move(viewed)) {}

  MIXBITS_EVAL_UNARY()
  // Wrt x: MLX's own mx.fast.rope (array offset) differentiated by MLX
  // (correct, not fast: only inference calls are routed here). The offset
  // is an integer position: no derivative (refused).
  MIXBITS_GRADS()
  MIXBITS_NAME_AND_EQUIVALENT(Rope)
  MIXBITS_OUTPUT_SHAPES()
  void compute(const std::vector<mx::array>& inputs, const mx::Shape& shape, mx::Dtype dtype,
               void* dst) const override;

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  std::optional<mx::Shape> viewed_;
  // x -> MLX's mx.fast.rope(x) at this node's offset, for vjp and jvp
  // (which refuse argnums other than x's).
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> mlx_fn(
      const std::vector<mx::array>& primals, const std::vector<int>& argnums);
};

// mx.fast.rope(x, dims, traditional=, base=, scale=, offset=) for x
// (..., L, D) in float32/float16/bfloat16 and `offset` one integer (an
// array, read when the node runs, so a compiled decode step can pass its
// position): row l of every leading index is at position offset + l.
// Features past `dims` pass through. Angles, cosines, sines and the
// rotation in float32, one rounding to x's dtype. std::invalid_argument
// (naming the argument) before any node is built.
mx::array rope(const mx::array& x, const mx::array& offset, int dims, bool traditional,
               float base, float scale, mx::StreamOrDevice s = {});

}  // namespace mixbits
