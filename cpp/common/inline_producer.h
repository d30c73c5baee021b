// Producers a consuming node computes itself. On a decode token MLX spends
// ~5 us of CPU per graph node whatever it computes; a small elementwise or
// row-wise node (RMSNorm before q/k/v, SwiGLU before down_proj, RoPE before
// the cache write) costs more in dispatch than in arithmetic. A consumer
// that finds such a node behind its input takes the producer's inputs
// instead and runs the producer's own code on them inside its task: the
// same bits, one node fewer.
//
// Only consumers without derivatives fold (the repacked matmuls and
// expert stacks, the decode cache write, a decode attention with kv_len):
// a folded input has no node of its own to differentiate through. A
// producer that has other consumers still runs for them; the fold then
// computes its output twice (correct, a little more work).
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace mixbits {

// Implemented by the mixbits primitives a consumer may run inline.
class InlineProducer {
 public:
  virtual ~InlineProducer() = default;
  // The node's output for `inputs`, `shape` and `dtype` (the output's),
  // written row-major at dst. Runs on the calling thread (no dispatch),
  // inside the consumer's task, where the inputs are evaluated.
  virtual void compute(const std::vector<mlx::core::array>& inputs,
                       const mlx::core::Shape& shape, mlx::core::Dtype dtype,
                       void* dst) const = 0;
};

// What a consumer keeps of a producer it folded: the node, how many of the
// consumer's inputs (first in its list) stand for it, the producer's output
// shape and dtype, and, when the producer's own first input is another
// producer's output (a query's RMSNorm before its RoPE), that one too,
// computed first.
struct Prologue {
  std::shared_ptr<mlx::core::Primitive> node;
  int n_inputs = 1;
  mlx::core::Shape shape;
  mlx::core::Dtype dtype = mlx::core::float32;
  std::shared_ptr<const Prologue> first;
};

// If `x` is the lazy, single output of an InlineProducer, that producer
// (and its inputs, appended to `inputs`); else nothing, and x is appended.
std::optional<Prologue> take_input(const mlx::core::array& x,
                                   std::vector<mlx::core::array>& inputs);

// Inside the consumer's task: the input whose arrays start at
// inputs[first], as an array: the producer's output computed into
// `storage` (which must outlive its use) when there is a prologue, else
// inputs[first].
mlx::core::array run_input(const std::optional<Prologue>& p,
                           const std::vector<mlx::core::array>& inputs, size_t first,
                           std::vector<char>& storage);

// For output_shapes: the shape the consumer reads its input as, `viewed`
// or the producer's output shape or the input's own, refused as
// input_shape (inputs.h) refuses when a shapeless compile changes its size.
// An InlineProducer's output has its first input's element count.
mlx::core::Shape read_shape(const mlx::core::array& first_input, const std::optional<Prologue>& p,
                            const std::optional<mlx::core::Shape>& viewed, const char* op);

// How many of a consumer's inputs its x takes.
inline int input_count(const std::optional<Prologue>& p) { return p ? p->n_inputs : 1; }

// For is_equivalent: both without a prologue, or equivalent producers.
bool same_prologue(const std::optional<Prologue>& a, const std::optional<Prologue>& b);

}  // namespace mixbits
