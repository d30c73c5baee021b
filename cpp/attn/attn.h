// MLX primitive for causal (grouped-query) attention on the CPU: the same
// result as mx.fast.scaled_dot_product_attention(q, k, v, scale,
// mask="causal"), float32 only.
#pragma once
#include <vector>

#include "attn/kernel.h"
#include "mlx/ops.h"
#include "common/primitive.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

class CausalAttention : public mx::Primitive {
 public:
  CausalAttention(mx::Stream s, float scale, Backend backend)
      : mx::Primitive(s), scale_(scale), backend_(backend) {}

  MIXBITS_EVAL_MULTI()

  // Derivatives (grad.cpp). vjp wrt q, k, v: on a CPU stream the
  // CausalAttentionVJP kernel below (MLX's CPU matmul is a reference BLAS on
  // Linux, ~40x slower than these GEMMs); on another device MLX's own
  // causal sdpa differentiated by MLX. jvp: MLX's causal sdpa differentiated
  // by MLX on any device (correct, not fast; nothing here needs it fast).
  MIXBITS_GRADS()

  MIXBITS_NAME_AND_EQUIVALENT(CausalAttention)
  MIXBITS_OUTPUT_SHAPES()

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

  MIXBITS_EVAL_MULTI()
  MIXBITS_GRADS()

  MIXBITS_NAME_AND_EQUIVALENT(CausalAttentionVJP)
  MIXBITS_OUTPUT_SHAPES()

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
