// MLX primitive for y = x · Wᵀ with W in one of MLX's floating-point
// quantization modes (mxfp4, nvfp4, mxfp8), as mx.quantize stores it: the
// CPU evaluation runs fpmatmul/kernel.h's kernels: y = x · Wᵀ
// (transpose=true, W [N, K]) or y = x · W (transpose=false, W [K, N]), as
// mx.quantized_matmul. The GPU evaluation is metal/fp_qmv.metal
// (cpp/fpmatmul/metal.cpp: x · Wᵀ, 1..8 rows of x). Python routes CPU calls
// with a 2-D W here, on the GPU only transpose=True with those few rows
// (mixbits/ops.py); the rest runs MLX's own op.
#pragma once
#include "common/primitive.h"
#include "fpmatmul/kernel.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mixbits {

namespace mx = mlx::core;

// Inputs: x, wq, scales.
class FpQMatmul : public mx::UnaryPrimitive {
 public:
  FpQMatmul(mx::Stream s, FpMode mode, bool transpose, Backend backend)
      : mx::UnaryPrimitive(s), mode_(mode), transpose_(transpose), backend_(backend) {}

  MIXBITS_EVAL_UNARY()
  // As MLX's QuantizedMatmul in these modes: a gradient wrt x only (the
  // product with the other transpose, by the same backend's kernel); wrt
  // the scales a ValueError, wrt the codes a RuntimeError, MLX's messages.
  MIXBITS_GRADS()
  MIXBITS_NAME_AND_EQUIVALENT(FpQMatmul)
  MIXBITS_OUTPUT_SHAPES()

 private:
  FpMode mode_;
  bool transpose_;
  Backend backend_;
};

// Checks the arguments (std::invalid_argument naming the bad one, which
// Python sees as a ValueError, as MLX's own checks) and builds the node; on
// a GPU stream it refuses what the Metal GEMV cannot run (transpose=false,
// more than 8 rows, a backend name).
mx::array fp_qmatmul(const mx::array& x, const mx::array& wq, const mx::array& scales,
                     FpMode mode, bool transpose = true, Backend backend = Backend::Auto,
                     mx::StreamOrDevice s = {});

}  // namespace mixbits
