// MLX primitive for the fused SwiGLU activation on the CPU.
#pragma once
#include <vector>

#include "act/kernel.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

class Swiglu : public mx::Primitive {
 public:
  Swiglu(mx::Stream s, ActBackend backend) : mx::Primitive(s), backend_(backend) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  const char* name() const override { return "Swiglu"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  ActBackend backend_;
};

// silu(gate) * up for float32 arrays of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& up,
                 ActBackend backend = ActBackend::Auto,
                 mx::StreamOrDevice s = {});

}  // namespace mixbits
