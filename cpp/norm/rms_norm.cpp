// RmsNorm: checks, the CPU evaluation (rows in parallel, strided inputs
// copied first), and derivatives through MLX's own op.
#include "norm/rms_norm.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "common/convert.h"
#include "common/cpu_task.h"
#include "common/grads.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/transforms.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("rms_norm: " + msg);
}

// One row: the float32 sum of squares in 8 interleaved partial sums (they
// vectorize), the scaling in float32, and MLX's two roundings (x * inv to
// y's dtype, then times the weight). Half-precision rows are widened and
// narrowed in bulk (common/convert.h): per-element conversions were most of
// a float16 model's norm. xs, ws: D floats of scratch each.
void rms_norm_row(const void* x, const float* ws, void* y, int64_t row, int64_t D, DType xt,
                  DType yt, float eps, float* xs) {
  const int64_t base = row * D;
  widen_to_f32(x, base, D, xt, xs);
  float part[8] = {};
  for (int64_t i = 0; i < D; ++i) part[i % 8] += xs[i] * xs[i];
  const float ss = ((part[0] + part[1]) + (part[2] + part[3])) +
                   ((part[4] + part[5]) + (part[6] + part[7]));
  const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
  for (int64_t i = 0; i < D; ++i) xs[i] *= inv;
  if (yt != DType::f32) {  // the first rounding, to y's dtype
    narrow_from_f32(xs, D, yt, y, base);
    widen_to_f32(y, base, D, yt, xs);
  }
  for (int64_t i = 0; i < D; ++i) xs[i] *= ws[i];
  narrow_from_f32(xs, D, yt, y, base);
}

mx::array mlx_rms_norm(const mx::array& x, const mx::array& w, float eps, mx::Stream s) {
  return mx::fast::rms_norm(x, w, eps, s);
}

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s) {
  if (!is_float_dtype(x.dtype())) fail("x must be float32, float16 or bfloat16");
  if (!is_float_dtype(w.dtype())) fail("weight must be float32, float16 or bfloat16");
  if (x.ndim() < 1 || x.shape(-1) < 1) fail("x must have a non-empty last axis, got shape " + shape_str(x));
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1))
    fail("weight must have shape (" + std::to_string(x.shape(-1)) + ",), got " + shape_str(w));
  if (!(eps >= 0.0f) || !std::isfinite(eps)) fail("eps must be finite and >= 0");
  auto stream = mx::to_stream(s);
  // No contiguous node: x is usually lazy; eval_cpu copies a strided one.
  // A reshape to heads (q_norm / k_norm) is skipped for the array it views.
  const mx::array src = through_views(x);
  return mx::array(x.shape(), mx::promote_types(x.dtype(), w.dtype()),
                   std::make_shared<RmsNorm>(stream, eps, viewed_shape(x, src)), {src, w});
}

std::vector<mx::Shape> RmsNorm::output_shapes(const std::vector<mx::array>& inputs) {
  return {input_shape(inputs[0], viewed_, "rms_norm")};
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && viewed_ == o.viewed_;
}

namespace {

// The node's output at dst: rows of shape's last axis, x (and w) read
// row-major.
void rms_norm_rows(const std::vector<mx::array>& inputs, const mx::Shape& shape,
                   mx::Dtype dtype, void* y, float eps) {
  std::vector<char> xbuf, wbuf;
  const void* x = row_major(inputs[0], xbuf);
  const void* w = row_major(inputs[1], wbuf);
  const int64_t D = shape.back(), rows = D ? element_count(shape) / D : 0;
  const DType xt = to_dtype(inputs[0].dtype()), wt = to_dtype(inputs[1].dtype()),
              yt = to_dtype(dtype);
  std::vector<float> ws(static_cast<size_t>(D));
  widen_to_f32(w, 0, D, wt, ws.data());
  // 64 rows per task: a decode token (one row) runs inline.
  parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> xs(static_cast<size_t>(D));
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(x, ws.data(), y, r, D, xt, yt, eps, xs.data());
  });
}

}  // namespace

void RmsNorm::compute(const std::vector<mx::array>& inputs, const mx::Shape& shape,
                      mx::Dtype dtype, void* dst) const {
  rms_norm_rows(inputs, shape, dtype, dst, eps_);
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  enc.dispatch([inputs, o = std::move(task_out), eps = eps_]() mutable {
    rms_norm_rows(inputs, o.shape(), o.dtype(), o.data<void>(), eps);
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("rms_norm: CPU only; on the GPU use mx.fast.rms_norm");
}

std::vector<mx::array> RmsNorm::vjp(const std::vector<mx::array>& primals,
                                    const std::vector<mx::array>& cotangents,
                                    const std::vector<int>& argnums,
                                    const std::vector<mx::array>&) {
  const float eps = eps_;
  const auto s = stream();
  auto f = [eps, s, viewed = viewed_](const std::vector<mx::array>& a) {
    return std::vector<mx::array>{mlx_rms_norm(as_viewed(a[0], viewed, s), a[1], eps, s)};
  };
  return pick(mx::vjp(f, primals, cotangents).second, argnums);
}

std::vector<mx::array> RmsNorm::jvp(const std::vector<mx::array>& primals,
                                    const std::vector<mx::array>& tangents,
                                    const std::vector<int>& argnums) {
  const float eps = eps_;
  const auto s = stream();
  auto f = [eps, s, viewed = viewed_](const std::vector<mx::array>& a) {
    return std::vector<mx::array>{mlx_rms_norm(as_viewed(a[0], viewed, s), a[1], eps, s)};
  };
  return mx::jvp(f, primals, full_tangents(primals, tangents, argnums, s)).second;
}

}  // namespace mixbits
