// The member declarations every mixbits MLX primitive repeats, written once
// (MLX's own primitives use the same idiom: DEFINE_GRADS, DEFINE_NAME in
// mlx/primitives.h; those expand to unqualified names of namespace
// mlx::core, so ours spell them out). A class keeps its own comments next
// to the macro that declares what they describe.
#pragma once
#include <vector>

#include "mlx/primitives.h"

// eval_cpu / eval_gpu of a primitive with one output (mx::UnaryPrimitive).
#define MIXBITS_EVAL_UNARY()                                                      \
  void eval_cpu(const std::vector<mlx::core::array>& inputs,                      \
                mlx::core::array& out) override;                                  \
  void eval_gpu(const std::vector<mlx::core::array>& inputs,                      \
                mlx::core::array& out) override;

// eval_cpu / eval_gpu of a primitive with several outputs (mx::Primitive).
#define MIXBITS_EVAL_MULTI()                                                      \
  void eval_cpu(const std::vector<mlx::core::array>& inputs,                      \
                std::vector<mlx::core::array>& outputs) override;                 \
  void eval_gpu(const std::vector<mlx::core::array>& inputs,                      \
                std::vector<mlx::core::array>& outputs) override;

// vjp and jvp.
#define MIXBITS_GRADS()                                                           \
  std::vector<mlx::core::array> vjp(const std::vector<mlx::core::array>& primals, \
                                    const std::vector<mlx::core::array>& cotangents, \
                                    const std::vector<int>& argnums,             \
                                    const std::vector<mlx::core::array>& outputs) \
      override;                                                                   \
  std::vector<mlx::core::array> jvp(const std::vector<mlx::core::array>& primals, \
                                    const std::vector<mlx::core::array>& tangents, \
                                    const std::vector<int>& argnums) override;

// vjp and jvp defined here as a call to REFUSE, a [[noreturn]] function
// that throws (a primitive with no derivative, e.g. an inference layout).
#define MIXBITS_GRADS_REFUSED(REFUSE)                                             \
  std::vector<mlx::core::array> vjp(const std::vector<mlx::core::array>&,        \
                                    const std::vector<mlx::core::array>&,        \
                                    const std::vector<int>&,                     \
                                    const std::vector<mlx::core::array>&) override { \
    REFUSE();                                                                     \
  }                                                                               \
  std::vector<mlx::core::array> jvp(const std::vector<mlx::core::array>&,        \
                                    const std::vector<mlx::core::array>&,        \
                                    const std::vector<int>&) override {          \
    REFUSE();                                                                     \
  }

// name(): the class name, as MLX prints it.
#define MIXBITS_NAME(NAME) \
  const char* name() const override { return #NAME; }

// name() and is_equivalent.
#define MIXBITS_NAME_AND_EQUIVALENT(NAME)                                         \
  MIXBITS_NAME(NAME)                                                              \
  bool is_equivalent(const mlx::core::Primitive& other) const override;

// output_shapes, defined in the primitive's .cpp.
#define MIXBITS_OUTPUT_SHAPES()                                                   \
  std::vector<mlx::core::Shape> output_shapes(                                    \
      const std::vector<mlx::core::array>& inputs) override;
