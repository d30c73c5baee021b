// NEON version of the KL chunk for arm64: the AVX2 algorithm (blocks,
// float32 scratch, per-block rebase, double folding) with 4-lane vectors
// and one exp flavour (clamped and masked) to stay short.
#if defined(__ARM_NEON)
#include <arm_neon.h>

#include <algorithm>
#include <cmath>

#include "kl/kernel.h"

namespace mixbits {

namespace {

constexpr int kBlock = 1024;
constexpr int kFold = 256;

// e^x: x = n ln2 + r, |r| <= ln2/2, the same degree-6 polynomial as the
// AVX2 exp, 2^n built in the exponent bits; x < -87.3, -inf and NaN give 0.
inline float32x4_t exp4(float32x4_t x) {
  const float32x4_t lo = vdupq_n_f32(-87.3f);
  const uint32x4_t valid = vcgeq_f32(x, lo);  // false for NaN
  x = vmaxq_f32(x, lo);
  float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
  r = vfmsq_f32(r, n, vdupq_n_f32(1.42860682030941723e-06f));
  float32x4_t p = vdupq_n_f32(0.001381461275741458f);
  p = vfmaq_f32(vdupq_n_f32(0.008368710055947304f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.04166838899254799f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.1666652113199234f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.4999999403953552f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  float32x4_t y = vmulq_f32(p, vreinterpretq_f32_s32(e));
  return vreinterpretq_f32_u32(vandq_u32(valid, vreinterpretq_u32_f32(y)));
}

inline float load1(const void* p, int64_t i, DType t) { return load_as_f32(p, i, t); }

inline float32x4_t load4(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::f32: return vld1q_f32(static_cast<const float*>(p) + i);
    case DType::f16:
      return vcvt_f32_f16(vreinterpret_f16_u16(
          vld1_u16(static_cast<const uint16_t*>(p) + i)));
    default:
      return vreinterpretq_f32_u32(
          vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(p) + i), 16));
  }
}

inline void widen_add(float64x2_t& acc, float32x4_t v) {
  acc = vaddq_f64(acc, vcvt_f64_f32(vget_low_f32(v)));
  acc = vaddq_f64(acc, vcvt_high_f64_f32(v));
}

}  // namespace

void kl_chunk_neon(KLMode mode, const KLChunk& c, KLState& st) {
  const bool logits = mode == KLMode::Logits;
  const bool probs = mode == KLMode::Probs;
  alignas(16) float fa[kBlock];
  alignas(16) float fb[kBlock];
  const float pad_a = probs ? 0.0f : kNegInf;
  const float32x4_t zero = vdupq_n_f32(0.0f);

  for (int64_t i0 = 0; i0 < c.n; i0 += kBlock) {
    const int n = int(std::min<int64_t>(kBlock, c.n - i0));
    const int nfull = n / 4, nv = (n + 3) / 4;
    // Pass 1: scratch, maxima, NaN and sign checks.
    float32x4_t vma = vdupq_n_f32(kNegInf), vmb = vma;
    uint32x4_t bad_a = vdupq_n_u32(0), bad_b = bad_a;
    for (int v = 0; v < nv; ++v) {
      float32x4_t xa, xb;
      if (v < nfull) {
        xa = load4(c.a, i0 + 4 * v, c.at);
        xb = load4(c.b, i0 + 4 * v, c.bt);
      } else {
        float ta[4], tb[4];
        for (int j = 0; j < 4; ++j) {
          bool in = 4 * v + j < n;
          ta[j] = in ? load1(c.a, i0 + 4 * v + j, c.at) : pad_a;
          tb[j] = in ? load1(c.b, i0 + 4 * v + j, c.bt) : kNegInf;
        }
        xa = vld1q_f32(ta);
        xb = vld1q_f32(tb);
      }
      vst1q_f32(fa + 4 * v, xa);
      vst1q_f32(fb + 4 * v, xb);
      vma = vmaxnmq_f32(vma, xa);  // maxnm skips NaN
      vmb = vmaxnmq_f32(vmb, xb);
      bad_a = vorrq_u32(bad_a, vmvnq_u32(vceqq_f32(xa, xa)));
      bad_b = vorrq_u32(bad_b, vmvnq_u32(vceqq_f32(xb, xb)));
      if (probs) bad_a = vorrq_u32(bad_a, vcltq_f32(xa, zero));
    }
    if (vmaxvq_u32(bad_a)) {
      for (int i = 0; i < n; ++i) {
        if (std::isnan(fa[i])) st.flags |= kNanRef;
        if (probs && fa[i] < 0) st.flags |= kNegWeight;
      }
    }
    if (vmaxvq_u32(bad_b)) st.flags |= kNanLogits;
    const float bmb = vmaxvq_f32(vmb);
    if (bmb > st.maxb) {
      st.maxb = bmb;
      st.argb = c.offset + i0 + (std::find(fb, fb + n, bmb) - fb);
    }
    kl_rebase_b(st, bmb);
    if (logits) {
      const float bma = vmaxvq_f32(vma);
      if (bma > st.maxa) {
        st.maxa = bma;
        st.arga = c.offset + i0 + (std::find(fa, fa + n, bma) - fa);
      }
      kl_rebase_a(st, bma);
    }
    const float32x4_t vca = vdupq_n_f32(st.ca == kNegInf ? 0.0f : st.ca);
    const float32x4_t vcb = vdupq_n_f32(st.cb == kNegInf ? 0.0f : st.cb);
    // Pass 2.
    float64x2_t dsa = vdupq_n_f64(0), dsb = dsa, dt = dsa;
    for (int v0 = 0; v0 < nv; v0 += kFold / 4) {
      const int v1 = std::min(nv, v0 + kFold / 4);
      float32x4_t sa = zero, sb = zero, t = zero;
      for (int v = v0; v < v1; ++v) {
        float32x4_t xb = vsubq_f32(vld1q_f32(fb + 4 * v), vcb);
        sb = vaddq_f32(sb, exp4(xb));
        float32x4_t w, d;
        if (probs) {
          w = vld1q_f32(fa + 4 * v);
          d = vnegq_f32(xb);
        } else {
          float32x4_t xa = vsubq_f32(vld1q_f32(fa + 4 * v), vca);
          w = exp4(xa);
          d = vsubq_f32(xa, xb);
        }
        // w = 0 contributes nothing even where d is infinite.
        d = vreinterpretq_f32_u32(
            vandq_u32(vcgtq_f32(w, zero), vreinterpretq_u32_f32(d)));
        sa = vaddq_f32(sa, w);
        t = vfmaq_f32(t, w, d);
      }
      widen_add(dsa, sa);
      widen_add(dsb, sb);
      widen_add(dt, t);
    }
    st.sa += vaddvq_f64(dsa);
    st.sb += vaddvq_f64(dsb);
    st.t += vaddvq_f64(dt);
  }
}

void kl_exp_neon(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(y + i, exp4(vld1q_f32(x + i)));
  if (i < n) {
    float t[4] = {0, 0, 0, 0};
    for (int j = 0; i + j < n; ++j) t[j] = x[i + j];
    vst1q_f32(t, exp4(vld1q_f32(t)));
    for (int j = 0; i + j < n; ++j) y[i + j] = t[j];
  }
}

double kl_exp_sum_neon(const float* x, int64_t n, int64_t reps) {
  float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t i = 0; i + 16 <= n; i += 16) {
      s0 = vaddq_f32(s0, exp4(vld1q_f32(x + i)));
      s1 = vaddq_f32(s1, exp4(vld1q_f32(x + i + 4)));
      s2 = vaddq_f32(s2, exp4(vld1q_f32(x + i + 8)));
      s3 = vaddq_f32(s3, exp4(vld1q_f32(x + i + 12)));
    }
  return double(vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3))));
}

}  // namespace mixbits
#endif  // __ARM_NEON
