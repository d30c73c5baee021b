// Derivatives of CausalAttention: the CPU backward kernel (the
// CausalAttentionVJP primitive) and the vjp / jvp hooks.
//
// For one query head with S = scale Q K^T (causal), P = softmax(S),
// O = P V and the output cotangent dO:
//   dV = P^T dO,   dP = dO V^T,   dS = P o (dP - rowsum(P o dP)),
//   dQ = scale dS K,   dK = scale dS^T Q,
// and the query heads of a group add into their shared KV head's dK, dV
// (grouped-query attention, as the forward reads K and V once per group).
// rowsum(P o dP) equals rowsum(dO o O) (flash attention's D); with whole
// rows of P at hand it is taken from P and dP directly, so the backward
// needs neither the forward's output nor its softmax statistics.
//
// Work split: P and dS are recomputed from q, k (the forward keeps
// nothing), one block of 32 query positions at a time, with the r query
// heads of a KV group stacked as rows (as the forward does), and are used
// at once: 5 GEMMs per block (S, dP, dQ = scale dS K, dV += P^T dO,
// dK += dS^T Q), nothing of size T x S stored, everything in L2. dK and dV
// of one KV head are sums over all its query blocks, so each KV head's
// query blocks are cut into C fixed ranges of equal causal work (C from the
// head count alone, chunk_count()) that run in parallel into their own
// partial dK / dV, added up in chunk order at the end: results do not
// depend on the thread count. An earlier version stored P and dS whole
// ([H, T, S]) and ran dK / dV per key block; at T = 1024 that moved 75 MB
// through memory per call and its backward was 1.8x slower.
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

constexpr int64_t kQueryBlock = 32;  // query positions per block (x r heads)

// Chunks per KV head: (heads x chunks) items >= 16 where up to 4 chunks
// give that (both cores busy at batch 1 with 3 KV heads, room for 16), one
// chunk (no partials beyond dK, dV themselves) once there are 16 heads. A
// function of the shape alone, so results do not depend on the thread
// count; the partials are at most 4x the size of k and v.
int64_t chunk_count(int64_t heads) {
  return std::clamp<int64_t>((16 + heads - 1) / heads, 1, 4);
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Row stride of the packed K^T / V^T: S rounded up to 16 floats, plus 16
// when that is a multiple of 1 KiB. A GEMM tile walks D rows of it at this
// stride; at 1 or 4 KiB (S = 256, 1024) those rows share a handful of L1
// sets and evict each other on every k step.
int64_t packed_ld(int64_t S) {
  int64_t ld = round_up(S, 16);
  return ld % 256 == 0 ? ld + 16 : ld;
}

// Packs each KV head's [S, D] matrix as [D, ld] (the GEMMs' B operand for
// Q K^T and dO V^T reads keys contiguously).
std::vector<float> transpose_heads(const float* x, int64_t heads, int64_t S,
                                   int64_t D, int64_t ld) {
  std::vector<float> t(size_t(heads * D * ld));
  parallel_for(heads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* src = x + i * S * D;
      float* dst = t.data() + i * D * ld;
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; ++d) dst[d * ld + s] = src[s * D + d];
    }
  });
  return t;
}

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

void causal_attention_vjp_cpu(const AttnKernels& kern, const AttnShape& sh,
                              const float* q, const float* k, const float* v,
                              const float* dout, float scale, float* dq,
                              float* dk, float* dv) {
  const int64_t B = sh.B, H = sh.H, Hk = sh.Hk, T = sh.T, S = sh.S, D = sh.D;
  const int64_t r = H / Hk, off = S - T, heads = B * Hk;
  if (heads == 0 || S == 0 || D == 0) return;
  const int64_t ld = packed_ld(S);
  const std::vector<float> kt = transpose_heads(k, heads, S, D, ld);
  const std::vector<float> vt = transpose_heads(v, heads, S, D, ld);
  const int64_t nqb = (T + kQueryBlock - 1) / kQueryBlock;
  // Chunk c of every head covers query blocks [lo[c], lo[c + 1]), cut where
  // the causal work (rows x keys seen) reaches c / C of the total.
  const int64_t C = chunk_count(heads);
  std::vector<int64_t> lo(size_t(C + 1), nqb);
  lo[0] = 0;
  {
    auto work = [&](int64_t qb) {
      const int64_t t0 = qb * kQueryBlock, nt = std::min(kQueryBlock, T - t0);
      return double(nt) * double(t0 + nt + off);
    };
    double total = 0, acc = 0;
    for (int64_t qb = 0; qb < nqb; ++qb) total += work(qb);
    int64_t c = 1;
    for (int64_t qb = 0; qb < nqb && c < C; ++qb) {
      acc += work(qb);
      while (c < C && acc * double(C) >= total * double(c)) lo[size_t(c++)] = qb + 1;
    }
  }
  // Partial dK, dV [heads, C, S, D] from MLX's allocator (its buffer
  // cache hands the same pages back on the next call).
  const size_t part_floats = size_t(heads * C * S * D);
  auto pk_buf = mx::allocator::malloc(part_floats * 4);
  auto pv_buf = mx::allocator::malloc(part_floats * 4);
  float* const pk = static_cast<float*>(pk_buf.buffer().raw_ptr());
  float* const pv = static_cast<float*>(pv_buf.buffer().raw_ptr());
  const int64_t R = r * kQueryBlock;  // rows of a block, all heads of the group

  parallel_for(heads * C, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> qa(size_t(R * D)), da(qa.size()), dqa(qa.size());
    std::vector<float> sc(size_t(R * ld)), dp(sc.size());
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t bh = w / C, c = w % C, b = bh / Hk, hk = bh % Hk;
      float* pdk = pk + (bh * C + c) * S * D;
      float* pdv = pv + (bh * C + c) * S * D;
      std::fill(pdk, pdk + S * D, 0.0f);
      std::fill(pdv, pdv + S * D, 0.0f);
      for (int64_t qb = lo[size_t(c)]; qb < lo[size_t(c + 1)]; ++qb) {
        const int64_t t0 = qb * kQueryBlock, nt = std::min(kQueryBlock, T - t0);
        const int64_t rows = r * nt;
        const int64_t e = t0 + nt + off;  // keys any row of this block sees
        // Row g * nt + t: query head hk * r + g, position t0 + t.
        for (int64_t g = 0; g < r; ++g) {
          const int64_t src = ((b * H + hk * r + g) * T + t0) * D;
          std::copy(q + src, q + src + nt * D, qa.data() + g * nt * D);
          std::copy(dout + src, dout + src + nt * D, da.data() + g * nt * D);
        }
        kern.gemm(qa.data(), D, kt.data() + bh * D * ld, DType::f32, ld, sc.data(), ld, rows, e, D);
        kern.gemm(da.data(), D, vt.data() + bh * D * ld, DType::f32, ld, dp.data(), ld, rows, e, D);
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t n = t0 + row % nt + off + 1;  // causal: keys 0 .. t + off
          float* x = sc.data() + row * ld;
          float* ds = dp.data() + row * ld;  // dP, then dS in place
          for (int64_t j = 0; j < n; ++j) x[j] *= scale;
          const float inv = 1.0f / kern.exp_row(x, n, attn_row_max(x, n));
          // rowsum(P o dP) in double, 4 independent partial sums (one
          // running sum is a serial chain of 4-cycle adds).
          double acc[4] = {0, 0, 0, 0};
          int64_t j = 0;
          for (; j + 4 <= n; j += 4)
            for (int l = 0; l < 4; ++l) {
              x[j + l] *= inv;
              acc[l] += double(x[j + l]) * ds[j + l];
            }
          for (; j < n; ++j) {
            x[j] *= inv;
            acc[0] += double(x[j]) * ds[j];
          }
          const float dotf = float((acc[0] + acc[1]) + (acc[2] + acc[3]));
          for (j = 0; j < n; ++j) ds[j] = x[j] * (ds[j] - dotf);
          // The GEMMs below read keys 0 .. e-1 of every row.
          std::fill(x + n, x + e, 0.0f);
          std::fill(ds + n, ds + e, 0.0f);
        }
        kern.gemm(dp.data(), ld, k + bh * S * D, DType::f32, D, dqa.data(), D, rows, D, e);
        for (int64_t g = 0; g < r; ++g) {
          float* dst = dq + ((b * H + hk * r + g) * T + t0) * D;
          const float* src = dqa.data() + g * nt * D;
          for (int64_t i = 0; i < nt * D; ++i) dst[i] = src[i] * scale;
        }
        kern.gemm_tn_acc(sc.data(), ld, da.data(), D, pdv, D, e, D, rows);
        kern.gemm_tn_acc(dp.data(), ld, qa.data(), D, pdk, D, e, D, rows);
      }
    }
  });
  // dK = scale * sum of the partials, dV = their sum, in chunk order.
  parallel_for(heads * S, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bh = i / S, s = i % S;
      float* odk = dk + i * D;
      float* odv = dv + i * D;
      for (int64_t d = 0; d < D; ++d) {
        float sk = 0, sv = 0;
        for (int64_t c = 0; c < C; ++c) {
          sk += pk[((bh * C + c) * S + s) * D + d];
          sv += pv[((bh * C + c) * S + s) * D + d];
        }
        odk[d] = sk * scale;
        odv[d] = sv;
      }
    }
  });
}

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
    causal_attention_vjp_cpu(kern, sh, q.data<float>(), k.data<float>(),
                             inputs[2].data<float>(), inputs[3].data<float>(),
                             scale, outs[0].data<float>(), outs[1].data<float>(),
                             outs[2].data<float>());
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
