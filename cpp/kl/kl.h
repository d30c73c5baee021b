// MLX primitive for the fused per-token KL divergence over the last axis.
#pragma once
#include <optional>
#include <vector>

#include "kl/kernel.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

// Inputs: ref [..., V], logits [..., V], and in FixedShift / Probs mode a
// float32 row parameter: the reference shift [...] (FixedShift), or
// negH = sum p log p [..., 2] as a float32 pair hi + lo (Probs; one float32
// would cost ~5e-7 absolute on every KL).
// Outputs, all shaped like the leading dims:
//   0 kl float32          KL(P_ref || Q), NaN where status != 0
//   1 status int32        KLStatus bits, 0 when the row is valid
//   2 argmax_q int32      first index of the candidate's maximum
//   3 lse_q float32       log-sum-exp of the candidate row
//   4 argmax_ref int32    first index of the reference max (Logits mode)
//   5 lse_ref float32     log-sum-exp of the reference (not in Probs mode)
class KLDivergence : public mx::Primitive {
 public:
  KLDivergence(mx::Stream s, KLMode mode, Backend backend)
      : mx::Primitive(s), mode_(mode), backend_(backend) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  const char* name() const override { return "KLDivergence"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  KLMode mode_;
  Backend backend_;
};

// Validates (throws std::invalid_argument naming the argument) and builds
// the graph node; returns the six outputs listed above.
std::vector<mx::array> kl_divergence(const mx::array& ref,
                                     const mx::array& logits,
                                     const std::optional<mx::array>& row_param,
                                     KLMode mode,
                                     Backend backend = Backend::Auto,
                                     mx::StreamOrDevice s = {});

}  // namespace mixbits
