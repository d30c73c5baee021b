// FpQMatmul: argument checks, graph node, CPU evaluation and gradients.
#include "fpmatmul/fpmatmul.h"

#include <limits>
#include <stdexcept>
#include <string>

#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "fp_qmv_host.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmatmul/qmatmul.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[quantized_matmul] " + msg);
}

}  // namespace

mx::array fp_qmatmul(const mx::array& x, const mx::array& wq, const mx::array& scales,
                     FpMode mode, bool transpose, Backend backend, mx::StreamOrDevice s) {
  const int bits = fp_mode_bits(mode), group = fp_mode_group(mode);
  if (!is_float_dtype(x.dtype())) fail("x must be float32, float16 or bfloat16");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (wq.dtype() != mx::uint32)
    fail("The weight matrix should be uint32, got shape " + shape_str(wq));
  if (scales.dtype() != mx::uint8) fail("Scale type must be uint8 for mode " + std::string(fp_mode_name(mode)));
  if (wq.ndim() != 2 || scales.ndim() != 2)
    fail("w and scales must be 2-D here, got " + shape_str(wq) + " and " + shape_str(scales));
  // W as stored: rows of codes, groups along each row.
  const int rows = wq.shape(0);
  const int64_t cols = int64_t(wq.shape(1)) * 32 / bits;
  if (scales.shape(0) != rows || int64_t(scales.shape(1)) * group != cols)
    fail("The shapes of the weight and scales are incompatible for " + std::string(fp_mode_name(mode)) +
         " (group size " + std::to_string(group) + ", " + std::to_string(bits) +
         " bits): w.shape() == " + shape_str(wq) + " and scales.shape() == " + shape_str(scales));
  if (cols > std::numeric_limits<int32_t>::max()) fail("w has more than 2^31 - 1 columns");
  const int64_t in = transpose ? cols : rows, out_dim = transpose ? rows : cols;
  if (x.shape(-1) != in)
    fail("Last dimension of x (" + std::to_string(x.shape(-1)) +
         ") does not match the quantized matrix's " + std::to_string(in) +
         (transpose ? " columns" : " rows"));
  auto stream = mx::to_stream(s);
  const bool gpu = stream.device == mx::Device::gpu;
  mx::Shape out_shape = x.shape();
  out_shape.back() = int(out_dim);
  // An empty sum (x has no columns): zeros. (MLX's own op dies of an
  // integer division by zero on it in 0.32.4.)
  if (in == 0) return mx::zeros(out_shape, x.dtype(), stream);
  if (gpu) {
    // One Metal GEMV (metal/fp_qmv.metal): x · Wᵀ for few rows of x. Python
    // sends the rest to MLX's op (mixbits/ops.py), so this refusal is for
    // direct callers. A CPU backend name would be ignored there: refused.
    if (backend != Backend::Auto) fail("backend= chooses a CPU kernel; on the GPU leave it unset");
    if (!transpose) fail("the GPU kernel computes x @ w.T only (mx.quantized_matmul runs the other)");
    const int64_t M = int64_t(x.size()) / in;
    if (!metal_host::fp_qmv_applies(M, rows, cols))
      fail("the GPU kernel takes 1 to " + std::to_string(MB_FPQ_MAX_M) + " rows of x, got " +
           std::to_string(M) + " (mx.quantized_matmul runs the others)");
  } else {
    select_fpm(backend);  // throws now, not inside the graph, if unavailable
  }
  // The Metal kernel indexes every input as a dense matrix (a copy node
  // here for one that is not known to be dense); the CPU path reads
  // strided inputs itself.
  auto input = [&](const mx::array& a) { return gpu ? dense_input(a, stream) : a; };
  return mx::array(out_shape, x.dtype(), std::make_shared<FpQMatmul>(stream, mode, transpose, backend),
                   {input(x), input(wq), input(scales)});
}

std::vector<mx::Shape> FpQMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.back() = transpose_ ? inputs[1].shape(0) : inputs[1].shape(1) * 32 / fp_mode_bits(mode_);
  return {s};
}

bool FpQMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FpQMatmul&>(other);
  return mode_ == o.mode_ && transpose_ == o.transpose_ && backend_ == o.backend_;
}

void FpQMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  enc.dispatch([inputs, out = std::move(task_out), mode = mode_, transpose = transpose_,
                fn = transpose_ ? select_fpm(backend_) : select_fpm_t(backend_)]() mutable {
    std::vector<char> wbuf, sbuf;
    FpView w;  // W as stored: N rows of K codes
    w.mode = mode;
    w.N = inputs[1].shape(0);
    w.K = int(int64_t(inputs[1].shape(1)) * 32 / fp_mode_bits(mode));
    w.wq = static_cast<const uint32_t*>(row_major(inputs[1], wbuf));
    w.scales = static_cast<const uint8_t*>(row_major(inputs[2], sbuf));
    // x gathered into dense float32 and y narrowed to x's dtype as for the
    // affine kernels; no bias is folded here, so an inf in x needs no
    // separate IEEE path (every path gives MLX's inf / NaN).
    qmatmul_cpu_eval(inputs[0], nullptr, transpose ? w.K : w.N, transpose ? w.N : w.K, 0, out,
                     [&](QmmPath, const float* xf, int M, float* y) { fn(xf, M, w, y); });
  });
}

#ifndef _METAL_
// (Metal builds: cpp/fpmatmul/metal.cpp.)
void FpQMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("FpQMatmul: this build of mixbits has no GPU kernels");
}
#endif

std::vector<mx::array> FpQMatmul::vjp(const std::vector<mx::array>& primals,
                                      const std::vector<mx::array>& cotangents,
                                      const std::vector<int>& argnums,
                                      const std::vector<mx::array>&) {
  auto s = stream();
  std::vector<mx::array> out;
  for (int arg : argnums) {
    if (arg == 0) {
      // d(x·Wᵀ)/dx = dy·W and d(x·W)/dx = dy·Wᵀ: the other orientation's
      // kernel on the same stored W.
      // On the GPU (transpose only, see fp_qmatmul) dy·W is MLX's own op.
      out.push_back(mx::astype(
          s.device == mx::Device::gpu
              ? mx::quantized_matmul(cotangents[0], primals[1], primals[2], std::nullopt, false,
                                     fp_mode_group(mode_), fp_mode_bits(mode_),
                                     fp_mode_name(mode_), s)
              : fp_qmatmul(cotangents[0], primals[1], primals[2], mode_, !transpose_, backend_, s),
          primals[0].dtype(), s));
    } else if (arg == 2) {
      throw std::invalid_argument(std::string("[QuantizedMatmul::vjp] no gradient wrt scales in ") +
                                  fp_mode_name(mode_) + " quantization.");
    } else {
      throw std::runtime_error("[QuantizedMatmul::vjp] no gradient wrt the quantized weights.");
    }
  }
  return out;
}

std::vector<mx::array> FpQMatmul::jvp(const std::vector<mx::array>& primals,
                                      const std::vector<mx::array>& tangents,
                                      const std::vector<int>& argnums) {
  for (int arg : argnums)
    if (arg != 0)
      throw std::runtime_error("[FpQMatmul::jvp] only x has a tangent (the weights are fixed codes).");
  return {fp_qmatmul(tangents[0], primals[1], primals[2], mode_, transpose_, backend_, stream())};
}

}  // namespace mixbits
