// The CPU drivers of causal attention and of its vjp: the work split and
// the softmax around the backend's GEMMs and row exp (kernel.h). No MLX
// types, so the aarch64 harness (tests/neon/attn_harness.cpp) runs the
// very driver the extension runs, with the NEON kernels.
//
// The backward, for one query head with S = scale Q K^T (causal),
// P = softmax(S), O = P V and the output cotangent dO:
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
#include <memory>
#include <vector>

#include "attn/kernel.h"
#include "common/convert.h"
#include "common/parallel.h"

namespace mixbits {

namespace {

// Query positions per work item, forward and backward. With 3 query heads
// per KV head that is 96 rows: the scores for 96 rows x 1024 keys (384 KiB)
// stay in L2, and a 256-token batch still splits into enough items for
// every core.
constexpr int64_t kQueryBlock = 32;

// Elements [off, off + n) of a `dt` array as float32: a pointer into it
// for float32 (no copy), else widened into `tmp`.
const float* rows_as_f32(const void* p, int64_t off, int64_t n, DType dt, float* tmp) {
  if (dt == DType::f32) return static_cast<const float*>(p) + off;
  widen_to_f32(p, off, n, dt, tmp);
  return tmp;
}

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

// Each KV head's first S rows of D elements (`rows` rows apart per head,
// type dt) as a float32 [D, ld] matrix: K^T (and the backward's V^T), the
// GEMMs' B operand for Q K^T and dO V^T, reading keys contiguously along
// the tile's output row. Columns S .. ld-1 are never read: no fill.
std::unique_ptr<float[]> transpose_heads(const void* x, DType dt, int64_t heads, int64_t rows,
                                         int64_t S, int64_t D, int64_t ld) {
  std::unique_ptr<float[]> t(new float[size_t(heads * D * ld)]);
  parallel_for(heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(static_cast<size_t>(D));
    for (int64_t i = i0; i < i1; ++i) {
      float* dst = t.get() + i * D * ld;
      for (int64_t s = 0; s < S; ++s) {
        const float* src = rows_as_f32(x, (i * rows + s) * D, D, dt, row.data());
        for (int64_t d = 0; d < D; ++d) dst[d * ld + s] = src[d];
      }
    }
  });
  return t;
}

}  // namespace

void causal_attention_cpu(const AttnKernels& kern, const AttnShape& sh,
                          const void* q, const void* k, const void* v,
                          DType dt, float scale, void* out) {
  const int64_t B = sh.B, H = sh.H, Hk = sh.Hk, T = sh.T, S = sh.S, D = sh.D;
  const int64_t r = H / Hk, off = S - T, ld = sh.kv_rows();
  // Scratch is written before it is read: no zero fill (a decode step's
  // attention is small enough for a memset of the block-sized buffers to
  // show).
  auto scratch = [](int64_t n) { return std::unique_ptr<float[]>(new float[size_t(n)]); };
  // A decode step (one query per head) reads each key once, so its scores
  // come straight from the key rows (gemm_nt): transposing K would cost as
  // much as the product. Longer queries reuse K^T, float32 whatever the
  // inputs' type, across their rows.
  // The GEMMs read half-precision K rows and V as they are: widened copies
  // cost a write and a read back of twice the bytes (a bfloat16 cache of
  // 2000 keys went at 8 GB/s).
  const bool direct = T == 1;
  // At packed_ld's stride, not S: with S = 1024 the 4 KiB rows of K^T
  // evicted each other from L1 (SmolLM2 heads, one thread: 2 x 1024
  // 38.5-38.8 -> 30.1-31.4 ms, 1 x 2048 73.6-74.1 -> 60.8-60.9).
  const int64_t kld = packed_ld(S);
  const auto kt = direct ? nullptr : transpose_heads(k, dt, B * Hk, ld, S, D, kld);
  // K and V rows of KV head bh, in the caller's buffers (row stride ld).
  const size_t es = dtype_bytes(dt);
  auto k_rows = [&](int64_t bh) { return static_cast<const char*>(k) + bh * ld * D * es; };
  auto v_rows = [&](int64_t bh) { return static_cast<const char*>(v) + bh * ld * D * es; };
  const int64_t nqb = (T + kQueryBlock - 1) / kQueryBlock;
  const int64_t qb = std::min(kQueryBlock, T);  // rows of a block: 1 in a decode step
  parallel_for(B * Hk * nqb, 1, [&](int64_t w0, int64_t w1) {
    auto qa = scratch(r * qb * D), sc = scratch(r * qb * S), o = scratch(r * qb * D),
         inv = scratch(r * qb);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t bh = w / nqb;  // b * Hk + hk
      const int64_t b = bh / Hk, hk = bh % Hk;
      const int64_t t0 = (w % nqb) * kQueryBlock;
      const int64_t nt = std::min(kQueryBlock, T - t0);
      const int64_t rows = r * nt;
      const int64_t e = t0 + nt + off;  // keys any row of this block sees
      for (int64_t g = 0; g < r; ++g) {
        float* dst = qa.get() + g * nt * D;
        const float* src = rows_as_f32(q, ((b * H + hk * r + g) * T + t0) * D, nt * D, dt, dst);
        for (int64_t i = 0; i < nt * D; ++i) dst[i] = src[i] * scale;
      }
      if (direct)
        kern.gemm_nt(qa.get(), D, k_rows(bh), dt, D, sc.get(), e, rows, e, D);
      else
        kern.gemm(qa.get(), D, kt.get() + bh * D * kld, DType::f32, kld, sc.get(), e, rows, e, D);
      for (int64_t row = 0; row < rows; ++row) {
        float* x = sc.get() + row * e;
        const int64_t n = t0 + row % nt + off + 1;  // causal: keys 0 .. t+off
        inv[row] = 1.0f / kern.exp_row(x, n, attn_row_max(x, n));
        std::fill(x + n, x + e, 0.0f);
      }
      kern.gemm(sc.get(), e, v_rows(bh), dt, D, o.get(), D, rows, D, e);
      for (int64_t g = 0; g < r; ++g) {
        const int64_t dst = ((b * H + hk * r + g) * T + t0) * D;
        for (int64_t t = 0; t < nt; ++t) {
          const float f = inv[g * nt + t];
          float* src = o.get() + (g * nt + t) * D;
          for (int64_t d = 0; d < D; ++d) src[d] *= f;
          narrow_from_f32(src, D, dt, out, dst + t * D);
        }
      }
    }
  });
}

int64_t attn_vjp_scratch_floats(const AttnShape& sh) {
  return 2 * sh.B * sh.Hk * chunk_count(sh.B * sh.Hk) * sh.S * sh.D;
}

void causal_attention_vjp_cpu(const AttnKernels& kern, const AttnShape& sh,
                              const float* q, const float* k, const float* v,
                              const float* dout, float scale, float* dq,
                              float* dk, float* dv, float* partials) {
  const int64_t B = sh.B, H = sh.H, Hk = sh.Hk, T = sh.T, S = sh.S, D = sh.D;
  const int64_t r = H / Hk, off = S - T, heads = B * Hk;
  if (heads == 0 || S == 0 || D == 0) return;
  const int64_t ld = packed_ld(S);
  const auto kt = transpose_heads(k, DType::f32, heads, S, S, D, ld);
  const auto vt = transpose_heads(v, DType::f32, heads, S, S, D, ld);
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
  // Partial dK, dV [heads, C, S, D], in the caller's scratch.
  float* const pk = partials;
  float* const pv = partials + heads * C * S * D;
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
        kern.gemm(qa.data(), D, kt.get() + bh * D * ld, DType::f32, ld, sc.data(), ld, rows, e, D);
        kern.gemm(da.data(), D, vt.get() + bh * D * ld, DType::f32, ld, dp.data(), ld, rows, e, D);
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

}  // namespace mixbits
