// MLX primitive for the gradient of MixedGatherQMM wrt x on the CPU:
// dx[lhs[i]] += dy[i] · W[rhs[i]], un-permuted to x's column order, through
// the packed weights with the backend's transposed kernel (kernel.h:
// select_qmm_t), as MixedQMatmulT does for the ungathered product. The
// path it replaces dequantized every expert (E·N·K·4 bytes) and ran MLX's
// gather_mm, a reference BLAS on Linux. On a GPU stream, for few rows per
// matrix, the Metal kernels of metal/gather_qmv_t.metal (eval_gpu in
// cpp/gather/metal.cpp); elsewhere on the GPU the gradient stays
// dequantize + gather_mm (gather_qmm_t_gpu_runs).
#pragma once
#include <optional>
#include <vector>

#include "common/primitive.h"
#include "qmatmul/qmatmul.h"

namespace mixbits {

// Inputs: dy [lhs.shape..., M, N], [perm [K]], (wq, scales, biases) per
// segment with batch shape [Bw..., N, ·], then lhs and rhs (uint32, dense,
// dy's batch shape). Output: x_shape [Bx..., M, K] in dy's dtype.
class MixedGatherQMMT : public mx::UnaryPrimitive {
 public:
  MixedGatherQMMT(mx::Stream s, std::vector<SegSpec> segs, bool has_perm,
                  Backend backend, mx::Shape x_shape)
      : mx::UnaryPrimitive(s),
        segs_(std::move(segs)),
        has_perm_(has_perm),
        backend_(backend),
        x_shape_(std::move(x_shape)) {}

  MIXBITS_EVAL_UNARY()

  // dx is bilinear in dy and W: wrt dy it is the forward gather (through
  // MixedGatherQMM), wrt scales/biases the same per-expert outer products
  // as the forward's, so gradients of gradients through the gather keep
  // working as they did when dx was built from MLX ops.
  MIXBITS_GRADS()

  MIXBITS_NAME_AND_EQUIVALENT(MixedGatherQMMT)
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>&) override {
    return {x_shape_};
  }

 private:
  std::vector<SegSpec> segs_;
  bool has_perm_;
  Backend backend_;
  mx::Shape x_shape_;
};

// Whether a GPU stream runs MixedGatherQMMT: this build has the Metal
// kernels, every count is positive and fits their 32-bit parameters, and
// M <= MB_QT_MAX_M rows per matrix (as for the dense transposed product:
// the kernel re-decodes W per row, which a GEMM on the dequantized W
// amortizes once M grows). MoE layers have M = 1. At most 8 segments
// (nseg): the one product dispatch binds every segment.
bool gather_qmm_t_gpu_runs(int64_t pairs, int64_t M, int64_t N, int64_t K,
                           int64_t x_batches, int64_t w_batches, int64_t nseg);

// dx for a MixedGatherQMM node's inputs (already checked there) on a CPU
// stream, or on a GPU stream where gather_qmm_t_gpu_runs says so: dy is
// the cotangent, lhs/rhs the node's dense uint32 indices.
mx::array mixed_gather_qmm_t(const mx::array& dy,
                             const std::optional<mx::array>& perm,
                             const std::vector<mx::array>& packed,
                             const std::vector<SegSpec>& segs,
                             const mx::array& lhs, const mx::array& rhs,
                             const mx::Shape& x_shape, Backend backend,
                             mx::StreamOrDevice s = {});

// MLX-op helpers shared by the two primitives' derivatives (grad.cpp).
namespace gather_grad {

// dx = Σ_i scatter to lhs[i] of unpermute(dy[i] · W[rhs[i]]) for a dense
// float W [Bw..., N, K]: the GPU path, and the jvp wrt scales/biases.
mx::array dense_dx(const mx::array& dy, const mx::array& W,
                   const std::optional<mx::array>& perm, const mx::array& lhs,
                   const mx::array& rhs, const mx::Shape& x_shape,
                   mx::StreamOrDevice s);

// G[e] = Σ_{i: rhs[i]=e} dy[i]ᵀ · a[lhs[i]][perm], float32 [Bw..., N, K]:
// what the scales/biases gradients are read from, a = x for the forward,
// the cotangent of dx for MixedGatherQMMT.
mx::array expert_outer(const mx::array& dy, const mx::array& a,
                       const std::optional<mx::array>& perm,
                       const std::vector<mx::array>& packed,
                       const mx::array& lhs, const mx::array& rhs,
                       mx::StreamOrDevice s);

}  // namespace gather_grad

}  // namespace mixbits
