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
// Memory: P and dS are recomputed from q, k (the forward keeps nothing)
// and stored whole, float32 (~[heads, T, S], key-blocked), instead of being
// recomputed once more per key block as flash attention's backward does.
// That costs the minimum of 5 GEMMs (recompute S, then dP, dQ, dK, dV) and
// lets both passes run in parallel without atomics:
//   pass 1, per (head, query head of the group, block of 32 queries):
//     S and dP for the block's rows, then P and dS, dQ = scale dS K;
//   pass 2, per (head, block of 64 keys): dV and dK of those keys, summed
//     over the group's query heads and the rows that see the keys.
// At SmolLM2's layout (9 query / 3 KV heads, T = S = 256) the two buffers
// are 4.7 MB; MLX's own CPU vjp materializes several [H, T, S] arrays too.
// Long contexts are cut into waves of KV heads so the buffers stay under
// wave_bytes() (one KV head at a time at least).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

#include "attn/attn.h"
#include "common/parallel.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/transforms.h"

namespace mixbits {

namespace {

constexpr int64_t kQueryBlock = 32;  // rows of one query head per pass-1 item
constexpr int64_t kKeyBlock = 64;    // keys per pass-2 item (a 64 x D block of dK, dV)

// Bytes of P + dS held at once: 256 MiB, or MIXBITS_ATTN_GRAD_WAVE_BYTES
// (read per call; lets the tests run the wave loop on small shapes).
int64_t wave_bytes() {
  if (const char* e = std::getenv("MIXBITS_ATTN_GRAD_WAVE_BYTES")) {
    const long long v = std::atoll(e);
    if (v > 0) return int64_t(v);
  }
  return int64_t(256) << 20;
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

// Tangents for every input: the given ones at their argnums, zeros elsewhere.
std::vector<mx::array> full_tangents(const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& tangents,
                                     const std::vector<int>& argnums,
                                     mx::Stream s) {
  std::vector<mx::array> t;
  for (const auto& p : primals) t.push_back(mx::zeros_like(p, s));
  for (size_t j = 0; j < argnums.size(); ++j) t[size_t(argnums[j])] = tangents[j];
  return t;
}

std::vector<mx::array> pick(const std::vector<mx::array>& all,
                            const std::vector<int>& argnums) {
  std::vector<mx::array> out;
  for (int a : argnums) out.push_back(all[size_t(a)]);
  return out;
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
  const int64_t nkb = (S + kKeyBlock - 1) / kKeyBlock;
  // P and dS are kept key-blocked, [head, query head, key block, T, 64]:
  // pass 2 reads a 64-key column strip of every row as a dense k x 64
  // panel (a row-major [T, S] strip would be 64 floats every S floats, a
  // 4 KiB stride at S = 1024 that thrashes the L1 sets).
  const int64_t head_floats = r * nkb * T * kKeyBlock;  // one KV head's P (or dS)
  const int64_t wave =
      head_floats == 0
          ? heads
          : std::clamp<int64_t>(wave_bytes() / (2 * 4 * head_floats), 1, heads);
  // From MLX's allocator, whose buffer cache hands the same pages back on
  // the next call: fresh 10-100 MB vectors page-faulted (and zeroed) on every
  // call, ~25% of the time at T = 1024. No initialization needed: pass 1
  // writes every entry pass 2 reads.
  const size_t buf_bytes = size_t(std::max<int64_t>(wave * head_floats, 1)) * 4;
  auto p_buf = mx::allocator::malloc(buf_bytes);
  auto ds_buf = mx::allocator::malloc(buf_bytes);
  float* const P = static_cast<float*>(p_buf.buffer().raw_ptr());
  float* const dS = static_cast<float*>(ds_buf.buffer().raw_ptr());
  // Row t of query head (i, g) in key block kb of a key-blocked buffer.
  auto blk = [&](float* base, int64_t i, int64_t g, int64_t kb, int64_t t) {
    return base + (((i * r + g) * nkb + kb) * T + t) * kKeyBlock;
  };

  for (int64_t h0 = 0; h0 < heads; h0 += wave) {
    const int64_t nh = std::min(wave, heads - h0);
    // Pass 1: P, dS and dQ, per (head of the wave, query head, query block).
    parallel_for(nh * r * nqb, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> sc(size_t(kQueryBlock * S)), dp(sc.size());
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t i = w / (r * nqb), g = (w / nqb) % r, qb = w % nqb;
        const int64_t bh = h0 + i, b = bh / Hk, hk = bh % Hk;
        const int64_t h = hk * r + g;
        const int64_t t0 = qb * kQueryBlock, nt = std::min(kQueryBlock, T - t0);
        const int64_t e = t0 + nt + off;  // keys any row of this block sees
        const int64_t qoff = ((b * H + h) * T + t0) * D;
        kern.gemm(q + qoff, D, kt.data() + bh * D * ld, ld, sc.data(), e, nt, e, D);
        kern.gemm(dout + qoff, D, vt.data() + bh * D * ld, ld, dp.data(), e, nt, e, D);
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t n = t0 + t + off + 1;  // causal: keys 0 .. t + off
          float* x = sc.data() + t * e;
          float* ds = dp.data() + t * e;  // dP, then dS in place
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
          for (int64_t j = 0; j < n; ++j) ds[j] = x[j] * (ds[j] - dotf);
          std::fill(ds + n, ds + e, 0.0f);  // the dQ GEMM reads keys 0 .. e-1
          // Into the key-blocked buffers, zeros past the causal boundary to
          // the end of the block holding key n-1 (pass 2 reads whole blocks
          // of every row that sees any key of them, and no block past it).
          for (int64_t kb = 0, c0 = 0; c0 < n; ++kb, c0 += kKeyBlock) {
            const int64_t c = std::min(kKeyBlock, n - c0);
            float* pd = blk(P, i, g, kb, t0 + t);
            float* dd = blk(dS, i, g, kb, t0 + t);
            std::copy(x + c0, x + c0 + c, pd);
            std::copy(ds + c0, ds + c0 + c, dd);
            std::fill(pd + c, pd + kKeyBlock, 0.0f);
            std::fill(dd + c, dd + kKeyBlock, 0.0f);
          }
        }
        float* dqr = dq + qoff;
        kern.gemm(dp.data(), e, k + bh * S * D, D, dqr, D, nt, D, e);
        for (int64_t j = 0; j < nt * D; ++j) dqr[j] *= scale;
      }
    });
    // Pass 2: dV and dK per (head of the wave, key block): the rows of every
    // query head of the group that see any key of the block, in order.
    parallel_for(nh * nkb, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t i = w / nkb, kb = w % nkb;
        const int64_t bh = h0 + i, b = bh / Hk, hk = bh % Hk;
        const int64_t s0 = kb * kKeyBlock, m = std::min(kKeyBlock, S - s0);
        const int64_t tmin = std::max<int64_t>(0, s0 - off);  // first row seeing s0
        float* dvb = dv + (bh * S + s0) * D;
        float* dkb = dk + (bh * S + s0) * D;
        std::fill(dvb, dvb + m * D, 0.0f);
        std::fill(dkb, dkb + m * D, 0.0f);
        for (int64_t g = 0; g < r; ++g) {
          const int64_t qoff = ((b * H + hk * r + g) * T + tmin) * D;
          kern.gemm_tn_acc(blk(P, i, g, kb, tmin), kKeyBlock, dout + qoff,
                           D, dvb, D, m, D, T - tmin);
          kern.gemm_tn_acc(blk(dS, i, g, kb, tmin), kKeyBlock, q + qoff,
                           D, dkb, D, m, D, T - tmin);
        }
        for (int64_t j = 0; j < m * D; ++j) dkb[j] *= scale;
      }
    });
  }
}

std::vector<mx::array> CausalAttention::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto s = stream();
  const auto& q = primals[0];
  const auto& k = primals[1];
  const auto& v = primals[2];
  std::vector<mx::array> all;
  if (s.device == mx::Device::cpu) {
    // One node computes all three (they share P and dS); the ones not asked
    // for are dropped from the graph. The primals are the forward node's
    // inputs, already contiguous.
    auto dout = mx::contiguous(mx::astype(cotangents[0], mx::float32, s), false, s);
    all = mx::array::make_arrays(
        {q.shape(), k.shape(), v.shape()},
        {mx::float32, mx::float32, mx::float32},
        std::make_shared<CausalAttentionVJP>(s, scale_, backend_),
        {q, k, v, dout});
  } else {
    all = mlx_attention_vjp({q, k, v, cotangents[0]}, scale_, s);
  }
  return pick(all, argnums);
}

std::vector<mx::array> CausalAttention::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents, const std::vector<int>& argnums) {
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
  for (const auto& a : inputs) enc.set_input_array(a);
  std::vector<mx::array> outs;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
    outs.push_back(mx::array::unsafe_weak_copy(o));
  }
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
