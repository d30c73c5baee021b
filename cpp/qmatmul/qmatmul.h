// MLX primitive for y = x · Wᵀ with W a mixed-segment quantized matrix.
#pragma once
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmatmul/kernel.h"

namespace mixbits {

namespace mx = mlx::core;

struct SegSpec {
  int bits;
  int group_size;
  int k;
  bool operator==(const SegSpec&) const = default;
};

// Inputs: x, [perm], then (wq, scales, biases) per segment.
class MixedQMatmul : public mx::UnaryPrimitive {
 public:
  MixedQMatmul(mx::Stream s, std::vector<SegSpec> segs, bool has_perm,
               Backend backend)
      : mx::UnaryPrimitive(s),
        segs_(std::move(segs)),
        has_perm_(has_perm),
        backend_(backend) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "MixedQMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  std::vector<SegSpec> segs_;
  bool has_perm_;
  Backend backend_;
};

// Validates everything (throws std::invalid_argument naming the bad
// argument) and builds the graph node. `packed` holds wq, scales, biases per
// segment, in segment order.
mx::array mixed_qmatmul(const mx::array& x, const std::optional<mx::array>& perm,
                        const std::vector<mx::array>& packed,
                        const std::vector<SegSpec>& segs,
                        Backend backend = Backend::Auto,
                        mx::StreamOrDevice s = {});

}  // namespace mixbits
