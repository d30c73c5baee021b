// MLX primitive for y = x · Wᵀ with W stored row-interleaved (repack.h):
// the batch-1 integer-activation GEMV layout of issue 16. CPU only; the
// arrays are built by repack_segment and turned back into MLX's layout by
// unrepack_segment (the layout every other reader of a weight expects).
#pragma once
#include <optional>
#include <tuple>
#include <vector>

#include "common/inline_producer.h"
#include "common/primitive.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmatmul/qmatmul.h"
#include "qmatmul_int8/repack.h"

namespace mixbits {

namespace mx = mlx::core;

// What every repacked node answers to a derivative (std::invalid_argument)
// and to the GPU (std::runtime_error): an inference layout of the CPU.
[[noreturn]] void refuse_repacked_grad();
[[noreturn]] void refuse_repacked_gpu();

// A node on one repacked weight or expert stack, fixed by its segments,
// whether x is permuted first, the output rows per matrix, the backend and
// the contract: RepackedQMatmul and RepackedGatherQMM hold these, refuse
// derivatives (an inference layout; differentiate through the original
// one) and are equivalent nodes for mx.compile (which compares the classes
// first) exactly when these agree.
class RepackedWeightPrimitive : public mx::UnaryPrimitive {
 public:
  // viewed: x's shape when the node's input is an array x is a view of
  // (through_views), read as x's elements in row-major order. prologue: x's
  // producer when the node computes x itself (inline_producer.h).
  RepackedWeightPrimitive(mx::Stream s, std::vector<SegSpec> segs, bool has_perm, int n,
                          Backend backend, Activations act,
                          std::optional<mx::Shape> viewed = std::nullopt,
                          std::optional<Prologue> prologue = std::nullopt)
      : mx::UnaryPrimitive(s),
        segs_(std::move(segs)),
        has_perm_(has_perm),
        n_(n),
        backend_(backend),
        act_(act),
        viewed_(std::move(viewed)),
        prologue_(std::move(prologue)) {}

  MIXBITS_GRADS_REFUSED(refuse_repacked_grad)
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  std::vector<SegSpec> segs_;
  bool has_perm_;
  int n_;
  Backend backend_;
  Activations act_;
  std::optional<mx::Shape> viewed_;
  std::optional<Prologue> prologue_;
};

// Inputs: x (or its producer's inputs), [perm], then (wq_r, scales_r, biases_r) per segment.
// Evaluation: activations int8/int16 with at most kInt8MaxM finite rows
// (int8-all: any number of finite rows) run the repacked kernels where select_repacked (kernel.h) has a table: x86
// with AVX512-VNNI or AVX2 (backend auto, avx512, avx2), arm64 NEON (auto,
// neon). Float-contract calls (float activations, or more rows) above
// select_qmm_repacked's min_m run the float kernel on the blocks in place
// where the backend has a reader (AVX-512 and AVX2: the prefill GEMM's
// panel packers), bit for bit what it gives on MLX's layout. Every other call
// (fewer float rows, inf/NaN in x, backend ref, NEON, x86 without
// AVX2) un-repacks W into a temporary of MLX's layout and runs exactly what
// MixedQMatmul runs, so results never depend on the storage beyond the
// kernels' float rounding. That temporary costs one copy of the weight per
// call: correct, not fast.
class RepackedQMatmul : public RepackedWeightPrimitive {
 public:
  using RepackedWeightPrimitive::RepackedWeightPrimitive;
  MIXBITS_EVAL_UNARY()
  MIXBITS_NAME(RepackedQMatmul)
  MIXBITS_OUTPUT_SHAPES()
};

// Several repacked weights applied to one x in one node (one output each):
// a decode token's sibling projections (q/k/v, gate/up) cost one dispatch
// instead of one each. Each output is exactly what RepackedQMatmul gives
// for that weight. Inputs: x, then (wq_r, scales_r, biases_r) per segment
// of each weight in order; no permutation.
class RepackedQMatmulGroup : public mx::Primitive {
 public:
  struct Member {
    std::vector<SegSpec> segs;
    int n;
  };
  RepackedQMatmulGroup(mx::Stream s, std::vector<Member> members, Backend backend,
                       Activations act, std::optional<mx::Shape> viewed,
                       std::optional<Prologue> prologue)
      : mx::Primitive(s),
        members_(std::move(members)),
        backend_(backend),
        act_(act),
        viewed_(std::move(viewed)),
        prologue_(std::move(prologue)) {}

  MIXBITS_EVAL_MULTI()
  MIXBITS_GRADS_REFUSED(refuse_repacked_grad)
  MIXBITS_NAME_AND_EQUIVALENT(RepackedQMatmulGroup)
  MIXBITS_OUTPUT_SHAPES()

 private:
  std::vector<Member> members_;
  Backend backend_;
  Activations act_;
  std::optional<mx::Shape> viewed_;    // as RepackedWeightPrimitive's
  std::optional<Prologue> prologue_;  // as RepackedWeightPrimitive's
};

// Validates (std::invalid_argument naming the argument) and builds the node.
// `packed_r`: wq_r, scales_r, biases_r per segment; n: W's output rows.
mx::array repacked_qmatmul(const mx::array& x, const std::optional<mx::array>& perm,
                           const std::vector<mx::array>& packed_r,
                           const std::vector<SegSpec>& segs, int n,
                           Backend backend = Backend::Auto, mx::StreamOrDevice s = {},
                           Activations act = Activations::Int8);

// One weight of a group: its repacked arrays, segments and output rows.
struct RepackedMember {
  std::vector<mx::array> packed_r;
  std::vector<SegSpec> segs;
  int n;
};
// The grouped node (same checks per weight; all see the same x).
std::vector<mx::array> repacked_qmatmul_group(const mx::array& x,
                                              const std::vector<RepackedMember>& members,
                                              Backend backend = Backend::Auto,
                                              mx::StreamOrDevice s = {},
                                              Activations act = Activations::Int8);

// The checks of one repacked weight (with leading `batch` dims: a stack of
// them, e.g. experts) against x (std::invalid_argument naming the
// argument); every repacked node makes them before it is built.
void check_repacked(const mx::array& x, const std::optional<mx::array>& perm,
                    const std::vector<mx::array>& packed_r, const std::vector<SegSpec>& segs,
                    int n, Activations act, const mx::Shape& batch = {});
// The stream after the device and backend checks every repacked node makes
// (std::invalid_argument now, not inside the graph).
mx::Stream repacked_stream(mx::StreamOrDevice s, Backend backend, Activations act);

// The kernels a repacked node runs for (act, backend), chosen once per node.
struct RepackedKernels {
  Activations act;
  QmmRun fn, fn_int;
  const RTable* table;
  QmmRepacked fn_r;  // the float contract on the repacked arrays, where fn has it
};
RepackedKernels kernels_for(Activations act, Backend backend);

// Matrix `matrix` of repacked segment arrays (3 per segment, dense, with
// any leading stack dims flattened): its shape view and kernel segments.
struct RepackedView {
  QMatView shape;
  std::vector<RSeg> rsegs;
};
RepackedView repacked_view(const std::vector<SegSpec>& segs, int N, DType sdtype,
                           const std::vector<const void*>& arrays, int64_t matrix);
// y = x · Wᵀ for M rows of dense float32 x (already permuted) on the path
// qmatmul_cpu_eval chose: the repacked integer kernels, the float kernel on
// the blocks where one reads them, else W un-repacked into a temporary and
// what MixedQMatmul runs (see RepackedQMatmul).
void run_repacked(const RepackedKernels& k, QmmPath path, const float* xf, int M,
                  const RepackedView& v, float* y);

// One segment (MLX layout: wq [N, k*bits/32], scales/biases [N, k/gs]) to
// the row-interleaved layout, evaluated now (a layer does this once).
// Refuses bit widths repack_supports_bits does not accept.
// Whether this CPU has repacked kernels (AVX512-VNNI or AVX2 on x86, NEON
// on arm64); elsewhere every call on a repacked weight un-repacks it first.
bool repacked_kernels_available();

std::tuple<mx::array, mx::array, mx::array> repack_segment(const mx::array& wq,
                                                           const mx::array& scales,
                                                           const mx::array& biases,
                                                           int bits, int group_size);
// The exact inverse, for the N real rows of a `bits`-bit segment.
std::tuple<mx::array, mx::array, mx::array> unrepack_segment(const mx::array& wq_r,
                                                             const mx::array& scales_r,
                                                             const mx::array& biases_r,
                                                             int n, int bits);
// parts (equal shapes and dtypes, evaluated now) stacked along a new first
// dim into one array whose data starts on a 64-byte line, as
// repack_segment's arrays do: how mixbits.ops.repack joins the experts of a
// stack it repacked one by one.
mx::array line_aligned_stack(const std::vector<mx::array>& parts);

}  // namespace mixbits
