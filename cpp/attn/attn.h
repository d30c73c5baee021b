// MLX primitive for causal (grouped-query) attention on the CPU: the same
// result as mx.fast.scaled_dot_product_attention(q, k, v, scale,
// mask="causal"), float32 only.
#pragma once
#include <vector>

#include "attn/kernel.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

class CausalAttention : public mx::Primitive {
 public:
  CausalAttention(mx::Stream s, float scale, Backend backend)
      : mx::Primitive(s), scale_(scale), backend_(backend) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  // Derivatives (grad.cpp). vjp wrt q, k, v: on a CPU stream the
  // CausalAttentionVJP kernel below (MLX's CPU matmul is a reference BLAS on
  // Linux, ~40x slower than these GEMMs); on another device MLX's own
  // causal sdpa differentiated by MLX. jvp: MLX's causal sdpa differentiated
  // by MLX on any device (correct, not fast; nothing here needs it fast).
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;

  const char* name() const override { return "CausalAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  Backend backend_;
};

// The backward of CausalAttention on the CPU. Inputs q, k, v (contiguous, as
// the forward node holds them) and the output cotangent dout [B, H, T, D];
// outputs dq, dk, dv. Its own derivatives (second order) are MLX's: the
// vjp / jvp of MLX's causal sdpa vjp, differentiated by MLX.
class CausalAttentionVJP : public mx::Primitive {
 public:
  CausalAttentionVJP(mx::Stream s, float scale, Backend backend)
      : mx::Primitive(s), scale_(scale), backend_(backend) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;

  const char* name() const override { return "CausalAttentionVJP"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  Backend backend_;
};

// q [B, H, T, D], k and v [B, Hk, S, D] float32 with H % Hk == 0 and
// S >= T; returns [B, H, T, D]. Validates (std::invalid_argument naming the
// argument) before building the graph node.
mx::array causal_attention(const mx::array& q, const mx::array& k,
                           const mx::array& v, float scale,
                           Backend backend = Backend::Auto,
                           mx::StreamOrDevice s = {});

}  // namespace mixbits
