// The gathered product on a repacked expert stack: out[i] = x[lhs[i]] ·
// W[rhs[i]]ᵀ (mx.gather_qmm's meaning, as MixedGatherQMM) with every expert
// of W row-interleaved (qmatmul_int8/repack.h), so a decode step's chosen
// experts run the repacked integer GEMV. CPU only, as RepackedQMatmul.
#pragma once
#include <optional>
#include <vector>

#include "common/primitive.h"
#include "qmatmul/qmatmul.h"
#include "qmatmul_int8/repacked_qmatmul.h"

namespace mixbits {

// Inputs: x [Bx..., M, K] (or an array x views, or x's producer's inputs:
// RepackedWeightPrimitive's viewed and prologue), [perm [K]],
// (wq_r, scales_r, biases_r) per segment with a common stack shape
// [Bw..., blocks, ·, 16], then lhs and rhs (uint32, one shape; may be
// strided, as may x and perm). Each expert's rows take the path RepackedQMatmul
// takes for them (gather_cpu_eval), so a pair's output is bit for bit
// RepackedQMatmul's on that expert's rows.
class RepackedGatherQMM : public RepackedWeightPrimitive {
 public:
  using RepackedWeightPrimitive::RepackedWeightPrimitive;
  MIXBITS_EVAL_UNARY()
  MIXBITS_NAME(RepackedGatherQMM)
  MIXBITS_OUTPUT_SHAPES()
};

// Validates (check_repacked per expert's shape; indices as
// mixed_gather_qmm) and builds the node; n: each expert's output rows.
mx::array repacked_gather_qmm(const mx::array& x, const std::optional<mx::array>& perm,
                              const std::vector<mx::array>& packed_r,
                              const std::vector<SegSpec>& segs, int n,
                              std::optional<mx::array> lhs, std::optional<mx::array> rhs,
                              Backend backend = Backend::Auto, mx::StreamOrDevice s = {},
                              Activations act = Activations::Int8);

}  // namespace mixbits
