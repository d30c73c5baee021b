// MLX primitive for causal (grouped-query) attention on the CPU: the same
// result as mx.fast.scaled_dot_product_attention(q, k, v, scale,
// mask="causal"), float32 only.
#pragma once
#include <optional>
#include <vector>

#include "attn/kernel.h"
#include "mlx/ops.h"
#include "common/inline_producer.h"
#include "common/primitive.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

class CausalAttention : public mx::Primitive {
 public:
  // prologue (decode nodes, has_len): q's producer (its RoPE) when the node
  // computes q itself (inline_producer.h); its inputs then stand in q's place.
  CausalAttention(mx::Stream s, float scale, Backend backend, bool has_len = false,
                  std::optional<Prologue> prologue = std::nullopt)
      : mx::Primitive(s),
        scale_(scale),
        backend_(backend),
        has_len_(has_len),
        prologue_(std::move(prologue)) {}

  MIXBITS_EVAL_MULTI()

  // Derivatives (grad.cpp). vjp wrt q, k, v: on a CPU stream the
  // CausalAttentionVJP kernel below (MLX's CPU matmul is a reference BLAS on
  // Linux, ~40x slower than these GEMMs); on another device MLX's own
  // causal sdpa differentiated by MLX. jvp: MLX's causal sdpa differentiated
  // by MLX on any device (correct, not fast; nothing here needs it fast).
  // A node with kv_len (a decode step) has no derivatives: refused.
  MIXBITS_GRADS()

  MIXBITS_NAME_AND_EQUIVALENT(CausalAttention)
  MIXBITS_OUTPUT_SHAPES()

 private:
  float scale_;
  Backend backend_;
  bool has_len_;  // a last input: the number of keys in use (kv_len)
  std::optional<Prologue> prologue_;
  void refuse_derivatives_with_len() const;
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
// argument) before building the graph node. With `kv_len` (one integer,
// read when the node runs, so a compiled decode step can pass its offset
// as an array), only keys [0, kv_len) exist: query t sees keys
// 0 .. t + kv_len - T, as if k and v were cut to kv_len rows; a kv_len
// outside [T, S] gives NaN.
mx::array causal_attention(const mx::array& q, const mx::array& k,
                           const mx::array& v, float scale,
                           Backend backend = Backend::Auto,
                           mx::StreamOrDevice s = {},
                           const std::optional<mx::array>& kv_len = std::nullopt);

}  // namespace mixbits
