// MLX primitive for the fused SwiGLU activation on the CPU.
#pragma once
#include <vector>

#include "act/kernel.h"
#include "mlx/ops.h"
#include "common/inline_producer.h"
#include "common/primitive.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

class Swiglu : public mx::Primitive, public InlineProducer {
 public:
  Swiglu(mx::Stream s, Backend backend) : mx::Primitive(s), backend_(backend) {}

  MIXBITS_EVAL_MULTI()

  // Derivatives wrt gate and up (act.cpp): on a CPU stream through the
  // SwigluVjp kernel below (vjp) or it and Swiglu (jvp); on another device
  // composed of MLX ops.
  MIXBITS_GRADS()

  MIXBITS_NAME_AND_EQUIVALENT(Swiglu)
  void compute(const std::vector<mx::array>& inputs, const mx::Shape& shape, mx::Dtype dtype,
               void* dst) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  Backend backend_;
};

// The vjp of Swiglu on the CPU: inputs gate, up, dy (contiguous float32 of
// one shape); outputs d gate, d up. Its own derivatives (second order) are
// those of the same formulas written with MLX ops, differentiated by MLX.
class SwigluVjp : public mx::Primitive {
 public:
  SwigluVjp(mx::Stream s, Backend backend) : mx::Primitive(s), backend_(backend) {}

  MIXBITS_EVAL_MULTI()
  MIXBITS_GRADS()

  MIXBITS_NAME_AND_EQUIVALENT(SwigluVjp)
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }

 private:
  Backend backend_;
};

// silu(gate) * up for float32 arrays of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& up,
                 Backend backend = Backend::Auto,
                 mx::StreamOrDevice s = {});

}  // namespace mixbits
