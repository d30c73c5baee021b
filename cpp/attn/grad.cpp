// Derivatives of CausalAttention: the CPU backward kernel (the
// CausalAttentionVJP primitive) and the vjp / jvp hooks. The backward's
// math and work split are driver.cpp's.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "attn/attn.h"
#include "common/cpu_task.h"
#include "common/grads.h"
#include "common/inputs.h"
#include "common/parallel.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/transforms.h"

namespace mixbits {

namespace {

// MLX's causal sdpa: the composite that the vjp on other devices and every
// jvp / second derivative differentiate.
mx::array mlx_attention(const mx::array& q, const mx::array& k,
                        const mx::array& v, float scale, mx::Stream s) {
  return mx::fast::scaled_dot_product_attention(q, k, v, scale, "causal",
                                                std::nullopt, {}, false, s);
}

// [dq, dk, dv] of MLX's causal sdpa at (q, k, v) for the cotangent dout.
std::vector<mx::array> mlx_attention_vjp(const std::vector<mx::array>& in,
                                         float scale, mx::Stream s) {
  auto f = [scale, s](const std::vector<mx::array>& x) {
    return std::vector<mx::array>{mlx_attention(x[0], x[1], x[2], scale, s)};
  };
  return mx::vjp(f, {in[0], in[1], in[2]}, {in[3]}).second;
}

}  // namespace

void CausalAttention::refuse_derivatives_with_len() const {
  if (has_len_)
    throw std::invalid_argument(
        "causal_attention: no derivatives through a call with kv_len (a decode "
        "step's attention); differentiate the model's plain forward");
}

std::vector<mx::array> CausalAttention::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  refuse_derivatives_with_len();
  auto s = stream();
  const auto& q = primals[0];
  const auto& k = primals[1];
  const auto& v = primals[2];
  std::vector<mx::array> all;
  if (s.device == mx::Device::cpu) {
    // One node computes all three (they share P and dS); the ones not asked
    // for are dropped from the graph. The backward kernel reads dense
    // float32 arrays: the primals (the forward node's inputs, possibly
    // strided views) are made so, half precision widened, and the
    // gradients rounded back to their dtype.
    const auto dt = q.dtype();
    auto f32 = [&](const mx::array& a) {
      return dense_input(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s), s);
    };
    all = mx::array::make_arrays(
        {q.shape(), k.shape(), v.shape()},
        {mx::float32, mx::float32, mx::float32},
        std::make_shared<CausalAttentionVJP>(s, scale_, backend_),
        {f32(q), f32(k), f32(v), f32(cotangents[0])});
    if (dt != mx::float32)
      for (auto& g : all) g = mx::astype(g, dt, s);
  } else {
    all = mlx_attention_vjp({q, k, v, cotangents[0]}, scale_, s);
  }
  return pick(all, argnums);
}

std::vector<mx::array> CausalAttention::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents, const std::vector<int>& argnums) {
  refuse_derivatives_with_len();
  auto s = stream();
  const float scale = scale_;
  auto f = [scale, s](const std::vector<mx::array>& x) {
    return std::vector<mx::array>{mlx_attention(x[0], x[1], x[2], scale, s)};
  };
  return mx::jvp(f, primals, full_tangents(primals, tangents, argnums, s)).second;
}

std::vector<mx::Shape> CausalAttentionVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
}

bool CausalAttentionVJP::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const CausalAttentionVJP&>(other);
  return scale_ == o.scale_ && backend_ == o.backend_;
}

void CausalAttentionVJP::eval_cpu(const std::vector<mx::array>& inputs,
                                  std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> outs = begin_cpu_task(enc, inputs, outputs);
  enc.dispatch([inputs, outs, scale = scale_,
                kern = select_attn(backend_)]() mutable {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    AttnShape sh{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3)};
    // The partial dK, dV from MLX's allocator: its buffer cache hands the
    // same pages back on the next call.
    auto partials = mx::allocator::malloc(size_t(attn_vjp_scratch_floats(sh)) * 4);
    causal_attention_vjp_cpu(kern, sh, q.data<float>(), k.data<float>(),
                             inputs[2].data<float>(), inputs[3].data<float>(),
                             scale, outs[0].data<float>(), outs[1].data<float>(),
                             outs[2].data<float>(),
                             static_cast<float*>(partials.buffer().raw_ptr()));
  });
}

void CausalAttentionVJP::eval_gpu(const std::vector<mx::array>&,
                                  std::vector<mx::array>&) {
  // Not reached: CausalAttention::vjp builds this node on CPU streams only.
  throw std::runtime_error("[CausalAttentionVJP] CPU only");
}

std::vector<mx::array> CausalAttentionVJP::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto s = stream();
  const float scale = scale_;
  auto f = [scale, s](const std::vector<mx::array>& x) {
    return mlx_attention_vjp(x, scale, s);
  };
  return pick(mx::vjp(f, primals, cotangents).second, argnums);
}

std::vector<mx::array> CausalAttentionVJP::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents, const std::vector<int>& argnums) {
  auto s = stream();
  const float scale = scale_;
  auto f = [scale, s](const std::vector<mx::array>& x) {
    return mlx_attention_vjp(x, scale, s);
  };
  return mx::jvp(f, primals, full_tangents(primals, tangents, argnums, s)).second;
}

}  // namespace mixbits
