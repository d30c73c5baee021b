// MLX primitive for y = x · Wᵀ with W a mixed-segment quantized matrix.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "common/primitive.h"
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

// The CPU matmul's numeric contracts (DESIGN.md): float activations
// (float tolerance vs dequantize + matmul) or x quantized to int8 or int16
// per group with integer dots (cpp/qmatmul_int8/kernel.h). Int8 and Int16
// apply to calls of at most kInt8MaxM rows (larger ones take the float
// path); Int8All is Int8's contract at every M (prompts too: the opt-in of
// issue 16), so at M <= kInt8MaxM it is Int8 bit for bit.
enum class Activations : int { Float = 0, Int8 = 1, Int16 = 2, Int8All = 3 };
// Names indexed by the enum's values: the one list Python's
// mixbits.ops.ACTIVATIONS (and every --activations choice) is built from.
const std::vector<std::string>& activation_names();
// The name of `act`, or "?" for a value outside the enum.
const char* activation_name(Activations act);
// Whether `act` is one of the enum's values.
bool activations_valid(Activations act);
// The integer code width of the contract: 8, 16, or 0 for the float one.
int activation_code_bits(Activations act);
// The most rows a call may have and still run the integer contract (0 for
// the float contract; larger calls run the float path).
int activation_int_max_m(Activations act);
// The refusal of an out-of-range value (the message lists the names).
std::string activations_refusal(Activations act);
// The integer contract's kernel on MLX's layout for the backend (throws if
// the backend is unavailable); null for the float contract.
QmmRun select_qmm_int(Activations act, Backend backend);
// fn over any number of rows: chunks of at most kInt8MaxM, the rows every
// original-layout integer kernel takes (the same result: the contract
// quantizes each row on its own).
void run_int_rows(QmmRun fn, const float* x, int M, const QMatView& w, float* y);

// Inputs: x, [perm], then (wq, scales, biases) per segment.
class MixedQMatmul : public mx::UnaryPrimitive {
 public:
  // viewed: x's shape when the node's input is an array x is a view of
  // (through_views; CPU streams), read as x's elements in row-major order.
  MixedQMatmul(mx::Stream s, std::vector<SegSpec> segs, bool has_perm,
               Backend backend, Activations act = Activations::Float,
               std::optional<mx::Shape> viewed = std::nullopt)
      : mx::UnaryPrimitive(s),
        segs_(std::move(segs)),
        has_perm_(has_perm),
        backend_(backend),
        act_(act),
        viewed_(std::move(viewed)) {}

  MIXBITS_EVAL_UNARY()

  // Gradients (grad.cpp) wrt x, and wrt every segment's scales and biases;
  // none wrt the packed codes or the permutation (as MLX's QuantizedMatmul).
  // Built from MLX ops on the same stream, except dy·W on a CPU stream, which
  // runs the transposed kernel (MixedQMatmulT, transposed.h).
  MIXBITS_GRADS()
  // Batching over x only; a vmapped weight is refused.
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  MIXBITS_NAME_AND_EQUIVALENT(MixedQMatmul)
  MIXBITS_OUTPUT_SHAPES()

 private:
  std::vector<SegSpec> segs_;
  bool has_perm_;
  Backend backend_;
  Activations act_;
  std::optional<mx::Shape> viewed_;
  // The node's x input as x: reshaped to viewed_ when it is a view's root.
  mx::array as_x(const mx::array& in);
};

// Validates everything (throws std::invalid_argument naming the bad
// argument) and builds the graph node. `packed` holds wq, scales, biases per
// segment, in segment order.
mx::array mixed_qmatmul(const mx::array& x, const std::optional<mx::array>& perm,
                        const std::vector<mx::array>& packed,
                        const std::vector<SegSpec>& segs,
                        Backend backend = Backend::Auto,
                        mx::StreamOrDevice s = {},
                        Activations act = Activations::Float);

// The CPU evaluation shared by every layout of W (MixedQMatmul here,
// RepackedQMatmul in qmatmul_int8/repacked_qmatmul.cpp), run inside the
// primitive's dispatched task once W is readable: gathers x through `perm`
// (may be null) into float32, scans it for inf/NaN, calls `run` with the
// path the contract takes (Int only if M <= int_max_m, i.e. never for 0,
// and x is finite; IeeeRef when x has an inf), and converts y to out's
// dtype.
enum class QmmPath { Int, Float, IeeeRef };
// The path for `rows` rows of float32 x (xf[0..n)): Int if rows <= int_max_m
// and x is finite, IeeeRef if x has an inf, else Float. The one definition,
// for qmatmul_cpu_eval and each expert's rows in gather_cpu_eval.
QmmPath qmm_path(const float* xf, int64_t n, int64_t rows, int int_max_m);
using QmmPathFn = std::function<void(QmmPath path, const float* xf, int M, float* y)>;
void qmatmul_cpu_eval(const mx::array& x, const int32_t* perm, int K, int N, int int_max_m,
                      mx::array& out, const QmmPathFn& run);

// Graph helpers shared by the gradients of MixedQMatmul and of the gather
// primitive (grad.cpp). `packed` as above; weights may carry leading batch
// dimensions (..., N, words).
namespace grad {
// The dense weight (..., N, K) in stored (permuted) column order, in the
// scales' dtype.
mx::array dequantize_all(const std::vector<mx::array>& packed,
                         const std::vector<SegSpec>& segs, mx::StreamOrDevice s);
// y = x[..., perm] (a copy of x when there is no permutation).
mx::array permute_cols(const mx::array& x, const std::optional<mx::array>& perm,
                       mx::StreamOrDevice s);
// The transpose of permute_cols: d[..., perm[k]] += g[..., k].
mx::array unpermute_cols(const mx::array& g, const std::optional<mx::array>& perm,
                         mx::StreamOrDevice s);
// Gradients wrt scales and biases of segment i from G = dyᵀ·x[perm]
// ((..., N, K), float32): dL/ds = Σ_{k∈g} G·q, dL/db = Σ_{k∈g} G.
mx::array scales_grad(const mx::array& G, const std::vector<mx::array>& packed,
                      const std::vector<SegSpec>& segs, size_t i,
                      mx::StreamOrDevice s);
mx::array biases_grad(const mx::array& G, const std::vector<mx::array>& packed,
                      const std::vector<SegSpec>& segs, size_t i,
                      mx::StreamOrDevice s);
}  // namespace grad

}  // namespace mixbits
