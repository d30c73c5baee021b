// MLX primitive writing one decode token's keys (or values) into a
// fixed-capacity cache buffer of a compiled decode step (mixbits.decode).
// mx.slice_update does the same, but the values reach it through the
// model's reshape to heads and transpose, two more nodes per layer at ~5 us
// of MLX dispatch each; this node reads them through those views.
#pragma once
#include <optional>
#include <vector>

#include "common/inline_producer.h"
#include "common/primitive.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

// Inputs: buf [B, H, S, D], x (or an array it views, read in row-major
// order as [B, H, 1, D], or x's producer's inputs), slot (one integer).
// Output: buf with row `slot` of every (b, h) replaced by x's, in buf's
// dtype. A buffer nothing else
// holds is written in place, as mx.slice_update does; otherwise it is
// copied first. One output: a node with two (keys and values together)
// holds its inputs once per output, and its buffers were never donatable.
class KvWrite : public mx::UnaryPrimitive {
 public:
  // prologue: x's producer (the keys' RoPE) when the node computes x
  // itself (inline_producer.h); its inputs then stand in x's place.
  KvWrite(mx::Stream s, std::optional<Prologue> prologue)
      : mx::UnaryPrimitive(s), prologue_(std::move(prologue)) {}

  MIXBITS_EVAL_UNARY()
  // A decode cache's bookkeeping: no derivatives (std::invalid_argument).
  MIXBITS_GRADS_REFUSED(refuse_kv_write_grad)
  MIXBITS_NAME_AND_EQUIVALENT(KvWrite)
  MIXBITS_OUTPUT_SHAPES()

 private:
  std::optional<Prologue> prologue_;
  [[noreturn]] static void refuse_kv_write_grad();
};

// mx.slice_update(buf, x.astype(buf.dtype), slot, axes=(2,)), slot clamped
// to [0, S) as MLX clamps a dynamic start. buf: 4-D float32/float16/
// bfloat16 [B, H, S, D]; x: float [B, H, 1, D]; slot: one integer.
// std::invalid_argument (naming the argument) before any node is built.
// CPU streams only.
mx::array kv_write(const mx::array& buf, const mx::array& x, const mx::array& slot,
                   mx::StreamOrDevice s = {});

}  // namespace mixbits
