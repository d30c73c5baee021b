// CausalAttention: argument checks, graph construction, and the CPU task
// that hands the inputs' buffers to the driver (driver.cpp).
#include "attn/attn.h"

#include <cmath>
#include <stdexcept>

#include "common/convert.h"
#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("causal_attention: " + msg);
}

// The rows between a head's first key and the next head's, when k (or v),
// [B, Hk, S, D], is heads of S rows of D contiguous elements each, every
// head ld >= S rows after the last and every batch Hk * ld rows: a whole
// buffer (ld = S), or its first S rows as mlx-lm's KVCache hands a decode
// step (keys[..., :offset, :] of a buffer that grows by 256). The kernel
// reads those in place; 0: another layout, read through a copy.
int64_t head_rows(const mx::array& a) {
  const int64_t B = a.shape(0), Hk = a.shape(1), S = a.shape(2), D = a.shape(3);
  if (a.flags().row_contiguous) return S;
  const auto& st = a.strides();
  if ((D > 1 && st[3] != 1) || (S > 1 && st[2] != D) || D == 0) return 0;
  // A size-1 axis's stride says nothing: take the row step from an axis that has more.
  const int64_t step = Hk > 1 ? st[1] : B > 1 ? st[0] / Hk : S * D;
  if (step <= 0 || step % D != 0 || step / D < S) return 0;
  if (B > 1 && st[0] != Hk * step) return 0;
  return step / D;
}

}  // namespace

mx::array causal_attention(const mx::array& q, const mx::array& k,
                           const mx::array& v, float scale,
                           Backend backend, mx::StreamOrDevice s,
                           const std::optional<mx::array>& kv_len) {
  for (auto [a, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    if (a->ndim() != 4)
      fail(std::string(name) + " must be 4-D [batch, heads, length, head_dim], got shape " +
           shape_str(*a));
    if (a->dtype() != mx::float32 && a->dtype() != mx::float16 && a->dtype() != mx::bfloat16)
      fail(std::string(name) + " must be float32, float16 or bfloat16");
  }
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype())
    fail("q, k and v must have one dtype");
  if (k.shape() != v.shape())
    fail("k shape " + shape_str(k) + " differs from v shape " + shape_str(v));
  if (q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3))
    fail("q " + shape_str(q) + " and k " + shape_str(k) +
         " differ in batch or head_dim");
  if (k.shape(1) < 1 || q.shape(1) % k.shape(1) != 0)
    fail("q heads (" + std::to_string(q.shape(1)) +
         ") must be a multiple of the k/v heads (" + std::to_string(k.shape(1)) + ")");
  if (k.shape(2) < q.shape(2))
    fail("k/v length (" + std::to_string(k.shape(2)) +
         ") must be at least the query length (" + std::to_string(q.shape(2)) + ")");
  if (!std::isfinite(scale)) fail("scale must be finite");
  if (kv_len && (kv_len->size() != 1 || !mx::issubdtype(kv_len->dtype(), mx::integer)))
    fail("kv_len must be one integer (an array of size 1), got shape " +
         shape_str(*kv_len) + " of another dtype or size");
  select_attn(backend);  // throws now, not inside the graph, if unavailable
  auto stream = mx::to_stream(s);
  // No contiguous nodes (three per call, ~90 per decode token): q, k and v
  // are usually lazy views (transposes of a projection, a cache update);
  // eval_cpu reads a strided one through a copy.
  // A decode node (kv_len; no derivatives) runs q's RoPE itself.
  std::vector<mx::array> inputs;
  std::optional<Prologue> prologue;
  if (kv_len) prologue = take_input(q, inputs);
  else inputs.push_back(q);
  inputs.push_back(k);
  inputs.push_back(v);
  if (kv_len)
    inputs.push_back(mx::reshape(mx::astype(*kv_len, mx::int32, stream), {1}, stream));
  return mx::array(q.shape(), q.dtype(),
                   std::make_shared<CausalAttention>(stream, scale, backend, bool(kv_len),
                                                     std::move(prologue)),
                   std::move(inputs));
}

std::vector<mx::Shape> CausalAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {read_shape(inputs[0], prologue_, std::nullopt, "causal_attention")};
}

bool CausalAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const CausalAttention&>(other);
  return scale_ == o.scale_ && backend_ == o.backend_ && has_len_ == o.has_len_ &&
         same_prologue(prologue_, o.prologue_);
}

void CausalAttention::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  // Capturing the arrays keeps their buffers alive until the task has run.
  enc.dispatch([inputs, o = std::move(task_out), scale = scale_, kern = select_attn(backend_),
                has_len = has_len_, pro = prologue_]() mutable {
    std::vector<char> pbuf, qbuf, kbuf, vbuf;
    const size_t at = input_count(pro);  // k, v (then kv_len) follow q's inputs
    const mx::array q = run_input(pro, inputs, 0, pbuf);
    const auto& k = inputs[at];
    const auto& v = inputs[at + 1];
    AttnShape sh{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3)};
    if (q.size() == 0) return;
    // K and V in place when both are heads of rows one stride apart (a
    // cache buffer or its filled prefix); else both copied row-major. The
    // copy cost a plain decode step a read and a write of the whole cache.
    const int64_t ld = head_rows(k);
    const bool in_place = ld > 0 && head_rows(v) == ld;
    sh.rows = in_place ? ld : sh.S;
    if (has_len) {
      // Keys [0, kv_len) of the buffers; a length the buffers cannot hold
      // (or shorter than the queries) gives NaN, never a read past them.
      const int64_t len = inputs[at + 2].data<int32_t>()[0];
      if (len < sh.T || len > sh.S) {
        const DType dt = to_dtype(q.dtype());
        for (size_t i = 0; i < o.size(); ++i) store_from_f32(o.data<void>(), int64_t(i), std::nanf(""), dt);
        return;
      }
      sh.S = len;
    }
    causal_attention_cpu(kern, sh, row_major(q, qbuf),
                         in_place ? k.data<void>() : row_major(k, kbuf),
                         in_place ? v.data<void>() : row_major(v, vbuf), to_dtype(q.dtype()),
                         scale, o.data<void>());
  });
}

void CausalAttention::eval_gpu(const std::vector<mx::array>&,
                               std::vector<mx::array>&) {
  throw std::runtime_error(
      "causal_attention: CPU only; on the GPU use "
      "mx.fast.scaled_dot_product_attention");
}

}  // namespace mixbits
