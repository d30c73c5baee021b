// The weighted squared error of a quantized segment against float weights,
// sum over elements of weight * (s*q + b - w)^2, in one pass over the codes.
// The gradient proxy (python/mixbits/measure/grad.py) needs this number for
// every tensor x candidate; through mx.dequantize, a float copy and numpy it
// cost ~18 ns per weight on one core, over half of that proxy's run.
#pragma once
#include "mlx/array.h"

namespace mixbits {

// wq: uint32 [R, k*bits/32] in MLX's LSB-first bitstream; scales, biases:
// [R, k/group_size] in one float dtype; w, weight: float32 [R, k]. Rows are
// independent, so leading batch dimensions are flattened into R by the
// caller. Evaluates its inputs. The sum is float64, formed per block of
// rows and added in block order, so it does not depend on the thread count.
double weighted_quant_error(const mlx::core::array& wq, const mlx::core::array& scales,
                            const mlx::core::array& biases, const mlx::core::array& w,
                            const mlx::core::array& weight, int bits, int group_size);

}  // namespace mixbits
