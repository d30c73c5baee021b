// MLX primitive for the transposed product dx = dy · W (W the [N, K]
// mixed-segment quantized matrix), un-permuted to x's column order: the CPU
// gradient of MixedQMatmul wrt x. MLX's own CPU matmul is a
// reference BLAS on Linux, so dequantize + matmul there is ~40x slower than
// an sgemm; this runs the backend's transposed kernel instead
// (kernel.h: select_qmm_t). On a GPU stream, for few rows of dy, Metal
// kernels do the same through the packed weights (qmatmul_t.metal,
// cpp/qmatmul/metal.cpp); above that the gradient is dequantize + matmul.
#pragma once
#include <cstdint>
#include <vector>

#include "common/primitive.h"
#include "qmatmul/qmatmul.h"

namespace mixbits {

// Inputs: dy [..., N], [perm], then (wq, scales, biases) per segment.
// Output [..., K] in dy's dtype: dx[..., perm[k]] += (dy · W)[..., k], the
// transpose of the forward's gather (a repeated column accumulates). The
// un-permutation is fused into the output pass: an MLX scatter of the same
// size took 0.56 ms (256 x 576) and 4.6 ms (1024 x 1536) here, 10-25% of
// the whole gradient on the bench's mixed tensors.
class MixedQMatmulT : public mx::UnaryPrimitive {
 public:
  MixedQMatmulT(mx::Stream s, std::vector<SegSpec> segs, bool has_perm,
                Backend backend)
      : mx::UnaryPrimitive(s),
        segs_(std::move(segs)),
        has_perm_(has_perm),
        backend_(backend) {}

  MIXBITS_EVAL_UNARY()

  // dx is bilinear in dy and W: derivatives wrt dy (through the forward
  // kernel) and wrt scales and biases (grad:: helpers), so gradients of
  // gradients through qmatmul keep working on the CPU.
  MIXBITS_GRADS()
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  MIXBITS_NAME_AND_EQUIVALENT(MixedQMatmulT)
  MIXBITS_OUTPUT_SHAPES()

 private:
  std::vector<SegSpec> segs_;
  bool has_perm_;
  Backend backend_;
};

// Whether a GPU stream runs MixedQMatmulT for M rows of dy and nseg
// K-segments: this build has the Metal kernel, M <= MB_QT_MAX_M
// (qmatmul_t_params.h), where decoding W once for every row still beats
// dequantize + GEMM, at most 8 segments and K <= MB_QT_MAX_K (its one
// dispatch binds every segment and checks the perm in threadgroup memory).
bool qmatmul_t_gpu_runs(int64_t M, int64_t N, int64_t K, int64_t nseg);

// dx = dy · W, un-permuted, on a CPU stream, or on a GPU stream where
// qmatmul_t_gpu_runs says so. The weights and perm are those a
// MixedQMatmul node already validated; dy's shape and dtype are checked
// here (std::invalid_argument).
mx::array mixed_qmatmul_t(const mx::array& dy,
                          const std::optional<mx::array>& perm,
                          const std::vector<mx::array>& packed,
                          const std::vector<SegSpec>& segs, Backend backend,
                          mx::StreamOrDevice s = {});

}  // namespace mixbits
