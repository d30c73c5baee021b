// Rope: checks, the CPU evaluation (rows in parallel, a strided x copied
// first), and derivatives through MLX's own op.
#include "rope/rope.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/convert.h"
#include "common/cpu_task.h"
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
  throw std::invalid_argument("rope: " + msg);
}

// The rotation's cosines and sines, [L, dims/2] each: row r of x is at
// position offset + r % L, and every head's row at a position turns by the
// same angles, so they are computed once per position (not per row).
// Angle i at position p: (pos0_scaled + p * scale) * inv_freq[i].
struct RopeAngles {
  std::vector<float> c, s;
};

RopeAngles rope_angles(int64_t L, int half, const std::vector<float>& inv_freq,
                       float pos0_scaled, float scale) {
  RopeAngles a{std::vector<float>(size_t(L) * half), std::vector<float>(size_t(L) * half)};
  for (int64_t p = 0; p < L; ++p) {
    const float pos = pos0_scaled + float(p) * scale;
    for (int i = 0; i < half; ++i) {
      const float theta = pos * inv_freq[size_t(i)];
      a.c[size_t(p * half + i)] = std::cos(theta);
      a.s[size_t(p * half + i)] = std::sin(theta);
    }
  }
  return a;
}

// Rows [r0, r1) of x viewed as [rows, D]. Pairs (i, i + dims/2), or
// (2i, 2i + 1) when traditional, rotate by the row's angles; features past
// dims pass through. A half-precision row is widened and narrowed in bulk
// (common/convert.h); xs and ys: D floats of scratch.
void rope_rows(const void* x, void* y, int64_t r0, int64_t r1, int64_t L, int64_t D,
               int dims, bool traditional, const RopeAngles& ang, DType t, float* xs,
               float* ys) {
  const int half = dims / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * D;
    const float* c = ang.c.data() + (r % L) * half;
    const float* s = ang.s.data() + (r % L) * half;
    widen_to_f32(x, base, D, t, xs);
    for (int i = 0; i < half; ++i) {
      const int64_t a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
      ys[a] = xs[a] * c[i] - xs[b] * s[i];
      ys[b] = xs[b] * c[i] + xs[a] * s[i];
    }
    for (int64_t d = dims; d < D; ++d) ys[d] = xs[d];
    narrow_from_f32(ys, D, t, y, base);
  }
}

}  // namespace

mx::array rope(const mx::array& x, const mx::array& offset, int dims, bool traditional,
               float base, float scale, mx::StreamOrDevice s) {
  if (!is_float_dtype(x.dtype())) fail("x must be float32, float16 or bfloat16");
  if (x.ndim() < 2) fail("x must have at least 2 dims (..., L, D), got shape " + shape_str(x));
  if (dims < 2 || dims % 2 || dims > x.shape(-1))
    fail("dims must be even, >= 2 and at most x's last dim " + std::to_string(x.shape(-1)) +
         ", got " + std::to_string(dims));
  if (offset.size() != 1 || !mx::issubdtype(offset.dtype(), mx::integer))
    fail("offset must be one integer (an array of size 1)");
  if (!(base > 0.0f) || !std::isfinite(base)) fail("base must be finite and > 0");
  if (!std::isfinite(scale)) fail("scale must be finite");
  auto stream = mx::to_stream(s);
  auto off = mx::reshape(mx::astype(offset, mx::int32, stream), {1}, stream);
  // No contiguous node: x is usually a lazy transposed view; eval_cpu
  // copies a strided one. A view that keeps the element order (a decode
  // token's heads: one row each) is skipped for the array it views.
  const mx::array src = through_views(x);
  return mx::array(
      x.shape(), x.dtype(),
      std::make_shared<Rope>(stream, dims, traditional, base, scale, viewed_shape(x, src)),
      {src, off});
}

std::vector<mx::Shape> Rope::output_shapes(const std::vector<mx::array>& inputs) {
  return {input_shape(inputs[0], viewed_, "rope")};
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
         scale_ == o.scale_ && viewed_ == o.viewed_;
}

namespace {

// The node's output at y, x read row-major as `shape`.
void rope_all(const std::vector<mx::array>& inputs, const mx::Shape& shape, mx::Dtype dtype,
              void* y, int dims, bool traditional, float base, float scale) {
  std::vector<char> xbuf;
  const void* x = row_major(inputs[0], xbuf);
  const int64_t D = shape.back(), L = shape[shape.size() - 2];
  const int64_t rows = D ? element_count(shape) / D : 0;
  // The frequencies as MLX forms them: exp(i * -ln(base) / (dims/2)) in
  // float32 from a float32 exponent step.
  const int half = dims / 2;
  const float step = float(-std::log(double(base)) / half);
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) inv_freq[size_t(i)] = std::exp(float(i) * step);
  const float pos0 = float(inputs[1].data<int32_t>()[0]) * scale;
  const DType t = to_dtype(dtype);
  const RopeAngles ang = rope_angles(L, half, inv_freq, pos0, scale);
  // 64 rows per task: one decode token's heads run inline.
  parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> xs(static_cast<size_t>(D)), ys(static_cast<size_t>(D));
    rope_rows(x, y, r0, r1, L, D, dims, traditional, ang, t, xs.data(), ys.data());
  });
}

}  // namespace

void Rope::compute(const std::vector<mx::array>& inputs, const mx::Shape& shape, mx::Dtype dtype,
                   void* dst) const {
  rope_all(inputs, shape, dtype, dst, dims_, traditional_, base_, scale_);
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  enc.dispatch([inputs, o = std::move(task_out), dims = dims_, traditional = traditional_,
                base = base_, scale = scale_]() mutable {
    rope_all(inputs, o.shape(), o.dtype(), o.data<void>(), dims, traditional, base, scale);
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("rope: CPU only; on the GPU use mx.fast.rope");
}

namespace {

mx::array mlx_rope(const mx::array& x, const mx::array& offset, int dims, bool traditional,
                   float base, float scale, mx::Stream s) {
  return mx::fast::rope(x, dims, traditional, base, scale, mx::reshape(offset, {}, s),
                        std::nullopt, s);
}

[[noreturn]] void no_offset_grad() {
  throw std::invalid_argument("rope: no derivative wrt the integer offset");
}

}  // namespace

std::function<std::vector<mx::array>(const std::vector<mx::array>&)> Rope::mlx_fn(
    const std::vector<mx::array>& primals, const std::vector<int>& argnums) {
  for (int a : argnums)
    if (a != 0) no_offset_grad();
  const auto s = stream();
  const auto off = primals[1];
  return [=, dims = dims_, traditional = traditional_, base = base_, scale = scale_,
          viewed = viewed_](const std::vector<mx::array>& a) {
    return std::vector<mx::array>{
        mlx_rope(as_viewed(a[0], viewed, s), off, dims, traditional, base, scale, s)};
  };
}

std::vector<mx::array> Rope::vjp(const std::vector<mx::array>& primals,
                                 const std::vector<mx::array>& cotangents,
                                 const std::vector<int>& argnums,
                                 const std::vector<mx::array>&) {
  return mx::vjp(mlx_fn(primals, argnums), {primals[0]}, cotangents).second;
}

std::vector<mx::array> Rope::jvp(const std::vector<mx::array>& primals,
                                 const std::vector<mx::array>& tangents,
                                 const std::vector<int>& argnums) {
  return mx::jvp(mlx_fn(primals, argnums), {primals[0]}, tangents).second;
}

}  // namespace mixbits
