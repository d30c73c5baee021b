// Derivatives of Swiglu, y = silu(g) u:
//   dy/dg = u silu'(g) = u s (1 + g (1 - s)),  dy/du = silu(g) = g s,
// s = sigmoid(g). On a CPU stream the vjp is one vectorized pass
// (SwigluVjp, both inputs at once); MLX's CPU runs the same formulas as a
// handful of scalar elementwise passes. Other devices and second
// derivatives use MLX ops.
#include <stdexcept>

#include "act/act.h"
#include "common/cpu_task.h"
#include "common/grads.h"
#include "common/parallel.h"
#include "common/inputs.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/transforms.h"

namespace mixbits {

namespace {

mx::array silu_prime(const mx::array& g, mx::Stream s) {
  auto sg = mx::sigmoid(g, s);
  auto one = mx::array(1.0f, g.dtype());
  return mx::multiply(sg, mx::add(one, mx::multiply(g, mx::subtract(one, sg, s), s), s), s);
}

// [dg, du] of silu(g) u for the cotangent dy, as MLX ops.
std::vector<mx::array> mlx_swiglu_vjp(const std::vector<mx::array>& in, mx::Stream s) {
  const auto& g = in[0];
  const auto& u = in[1];
  const auto& dy = in[2];
  return {mx::multiply(mx::multiply(dy, u, s), silu_prime(g, s), s),
          mx::multiply(dy, mx::multiply(g, mx::sigmoid(g, s), s), s)};
}

// The kernels' dtype; SwigluVjp and Swiglu copy a strided input themselves.
mx::array f32(const mx::array& a, mx::Stream s) { return mx::astype(a, mx::float32, s); }

}  // namespace

std::vector<mx::array> Swiglu::vjp(const std::vector<mx::array>& primals,
                                   const std::vector<mx::array>& cotangents,
                                   const std::vector<int>& argnums,
                                   const std::vector<mx::array>&) {
  auto s = stream();
  const auto& g = primals[0];
  if (s.device != mx::Device::cpu)
    return pick(mlx_swiglu_vjp({g, primals[1], cotangents[0]}, s), argnums);
  // Both gradients come from one node; one not asked for is dropped.
  auto all = mx::array::make_arrays(
      {g.shape(), g.shape()}, {mx::float32, mx::float32},
      std::make_shared<SwigluVjp>(s, backend_),
      {g, primals[1], f32(cotangents[0], s)});
  return pick(all, argnums);
}

std::vector<mx::array> Swiglu::jvp(const std::vector<mx::array>& primals,
                                   const std::vector<mx::array>& tangents,
                                   const std::vector<int>& argnums) {
  auto s = stream();
  const auto& g = primals[0];
  const auto& u = primals[1];
  std::optional<mx::array> y;
  auto add = [&](mx::array t) { y = y ? mx::add(*y, t, s) : t; };
  for (size_t j = 0; j < argnums.size(); ++j) {
    const bool cpu = s.device == mx::Device::cpu;
    if (argnums[j] == 0) {
      // u silu'(g) tg: the vjp kernel's dg for dy = tg.
      add(cpu ? mx::array::make_arrays(
                    {g.shape(), g.shape()}, {mx::float32, mx::float32},
                    std::make_shared<SwigluVjp>(s, backend_),
                    {g, u, f32(tangents[j], s)})[0]
              : mlx_swiglu_vjp({g, u, tangents[j]}, s)[0]);
    } else {
      // silu(g) tu: the forward itself with tu for up.
      add(cpu ? swiglu(g, f32(tangents[j], s), backend_, s)
              : mlx_swiglu_vjp({g, u, tangents[j]}, s)[1]);
    }
  }
  return {*y};
}

bool SwigluVjp::is_equivalent(const mx::Primitive& other) const {
  return backend_ == static_cast<const SwigluVjp&>(other).backend_;
}

void SwigluVjp::eval_cpu(const std::vector<mx::array>& inputs,
                         std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> outs = begin_cpu_task(enc, inputs, outputs);
  enc.dispatch([inputs, outs, fn = select_swiglu_vjp(backend_)]() mutable {
    // g and u are Swiglu's inputs as its caller passed them (maybe strided).
    std::vector<char> gbuf, ubuf, dybuf;
    const float* g = static_cast<const float*>(row_major(inputs[0], gbuf));
    const float* u = static_cast<const float*>(row_major(inputs[1], ubuf));
    const float* dy = static_cast<const float*>(row_major(inputs[2], dybuf));
    float* dg = outs[0].data<float>();
    float* du = outs[1].data<float>();
    // Grain as the forward's.
    parallel_for(int64_t(outs[0].size()), 32768, [&](int64_t i0, int64_t i1) {
      fn(g + i0, u + i0, dy + i0, dg + i0, du + i0, i1 - i0);
    });
  });
}

void SwigluVjp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // Not reached: Swiglu's vjp / jvp build this node on CPU streams only.
  throw std::runtime_error("[SwigluVjp] CPU only");
}

std::vector<mx::array> SwigluVjp::vjp(const std::vector<mx::array>& primals,
                                      const std::vector<mx::array>& cotangents,
                                      const std::vector<int>& argnums,
                                      const std::vector<mx::array>&) {
  auto s = stream();
  auto f = [s](const std::vector<mx::array>& x) { return mlx_swiglu_vjp(x, s); };
  return pick(mx::vjp(f, primals, cotangents).second, argnums);
}

std::vector<mx::array> SwigluVjp::jvp(const std::vector<mx::array>& primals,
                                      const std::vector<mx::array>& tangents,
                                      const std::vector<int>& argnums) {
  auto s = stream();
  auto f = [s](const std::vector<mx::array>& x) { return mlx_swiglu_vjp(x, s); };
  return mx::jvp(f, primals, full_tangents(primals, tangents, argnums, s)).second;
}

}  // namespace mixbits
