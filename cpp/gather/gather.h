// MLX primitive for the gathered (and batched) mixed-segment quantized
// matmul: out[i] = x[lhs[i]] · W[rhs[i]]ᵀ, the meaning of
// mx.gather_qmm(..., transpose=True), for expert stacks (MoE) and for
// weights with leading batch dimensions.
#pragma once
#include <optional>
#include <vector>

#include "common/primitive.h"
#include "qmatmul/qmatmul.h"

namespace mixbits {

// Inputs: x [Bx..., M, K], [perm [K]], (wq, scales, biases) per segment with
// a common batch shape [Bw..., N, ·], then lhs and rhs (uint32, one shape).
// Output: lhs.shape + [M, N] in x's dtype.
class MixedGatherQMM : public mx::UnaryPrimitive {
 public:
  MixedGatherQMM(mx::Stream s, std::vector<SegSpec> segs, bool has_perm,
                 Backend backend, bool sorted, Activations act = Activations::Float)
      : mx::UnaryPrimitive(s),
        segs_(std::move(segs)),
        has_perm_(has_perm),
        backend_(backend),
        sorted_(sorted),
        act_(act) {}

  MIXBITS_EVAL_UNARY()

  // As MixedQMatmul's: wrt x through the transposed kernels
  // (MixedGatherQMMT, transposed.h) on the CPU where MixedQMatmul's takes
  // them and on the GPU where the Metal ones apply (gather_qmm_t_gpu_runs),
  // else dequantize + gather_mm; wrt every segment's scales/biases through MLX
  // ops (segmented_mm, dequantize); no gradient wrt the packed weights,
  // the permutation or the indices. An integer contract's node has the
  // float product's derivatives, as MixedQMatmul's.
  MIXBITS_GRADS()

  MIXBITS_NAME_AND_EQUIVALENT(MixedGatherQMM)
  MIXBITS_OUTPUT_SHAPES()

 private:
  std::vector<SegSpec> segs_;
  bool has_perm_;
  Backend backend_;
  bool sorted_;
  Activations act_;
};

// Validates as MLX's gather_qmm does (std::invalid_argument -> ValueError)
// and builds the node. Without indices each defaults to every batch of its
// operand in order, as in MLX. On a GPU stream the node runs the Metal
// gathered GEMV (cpp/gather/metal.cpp); only where that kernel cannot run
// (an MLX without Metal, counts past 32 bits, an empty batch) is the
// product composed from MLX ops (dequantize + gather_mm).
// `act` (CPU only, as mixed_qmatmul's): an integer contract runs each
// expert's rows on the integer kernels when that expert has at most
// activation_int_max_m(act) of them in the call, so its pairs get exactly
// mixed_qmatmul(those rows, W[expert], act)'s result; an expert with more
// rows, or rows with an inf or NaN, takes the float path.
mx::array mixed_gather_qmm(const mx::array& x,
                           const std::optional<mx::array>& perm,
                           const std::vector<mx::array>& packed,
                           const std::vector<SegSpec>& segs,
                           std::optional<mx::array> lhs,
                           std::optional<mx::array> rhs, bool sorted,
                           Backend backend = Backend::Auto,
                           mx::StreamOrDevice s = {},
                           Activations act = Activations::Float);

// x · Wᵀ for a W with leading batch dimensions, broadcast against x's as
// mx.quantized_matmul(..., transpose=True) does (x needs at least 3 dims).
mx::array mixed_batched_qmm(const mx::array& x,
                            const std::optional<mx::array>& perm,
                            const std::vector<mx::array>& packed,
                            const std::vector<SegSpec>& segs,
                            Backend backend = Backend::Auto,
                            mx::StreamOrDevice s = {},
                            Activations act = Activations::Float);

}  // namespace mixbits
