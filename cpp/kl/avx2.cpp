// AVX2 + FMA + F16C version of the KL chunk. Compiled with -mavx2 -mfma
// -mf16c and reached only after a CPUID check (see dispatch.cpp).
//
// The row is walked in L1-sized blocks. Pass 1 converts a block to float32
// scratch while taking the maxima and the NaN checks; the running shifts are
// then raised once per block (scalar, double) and pass 2 does the exps and
// sums from the scratch. Each block's sums are float32 lanes (<= 64 terms
// per lane) folded into the double state: a blocked sum, so long rows lose
// no precision.
#include <immintrin.h>

#include <algorithm>

#include "common/x86_half.h"
#include "kl/kernel.h"

namespace mixbits {

namespace {

constexpr int kBlock = 1024;

// e^x for x known to lie in [-87.3, 88]: x = n ln2 + r with |r| <= ln2/2,
// e^r by a degree-6 polynomial fitted for minimum relative error on that
// interval (~6e-8), 2^n assembled in the exponent bits. No clamp, no mask.
inline __m256 exp8_inrange(__m256 x) {
  // 1.5 * 2^23 + 127: adding it rounds x*log2(e) to an integer n and leaves
  // n + 127 in the low mantissa bits, ready to shift into an exponent.
  const __m256 magic = _mm256_set1_ps(12583039.0f);
  __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
  __m256 n = _mm256_sub_ps(t, magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-06f), r);
  __m256 p = _mm256_set1_ps(0.001381461275741458f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.008368710055947304f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.04166838899254799f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.1666652113199234f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.4999999403953552f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  return _mm256_mul_ps(
      p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

// e^x for any float32 lanes: lanes below -87.3 (including -inf) give exactly
// 0, NaN gives 0; the rest as exp8_inrange.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  return _mm256_and_ps(valid, exp8_inrange(_mm256_max_ps(x, lo)));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline double hsum(__m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  double s = 0;
  for (float x : f) s += x;
  return s;
}

// Which side holds a NaN (rare path: the row's KL is then NaN anyway).
inline void flag_nans(const float* fa, const float* fb, int n, KLState& st) {
  for (int i = 0; i < n; ++i) {
    if (std::isnan(fa[i])) st.flags |= kNanRef;
    if (std::isnan(fb[i])) st.flags |= kNanLogits;
  }
}

inline int64_t first_index_of(const float* x, int n, float v) {
  for (int i = 0; i < n; ++i)
    if (x[i] == v) return i;
  return 0;
}

// Sums of one block, folded into double lanes every kFold elements so no
// float32 lane ever adds more than kFold/16 terms.
struct BlockSums {
  __m256d sa = _mm256_setzero_pd(), sb = _mm256_setzero_pd(),
          t = _mm256_setzero_pd();
};

inline __m256d widen_add(__m256d acc, __m256 v) {
  acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

inline double hsum_pd(__m256d v) {
  alignas(32) double d[4];
  _mm256_store_pd(d, v);
  return (d[0] + d[1]) + (d[2] + d[3]);
}

constexpr int kFold = 256;

// Pass 2 over the float32 scratch. kSafe: every shifted value of the block
// is known to lie in exp's range, so no -inf / underflow lanes exist and
// the clamps and masks can go (the common case for real logits).
template <KLMode kMode, bool kSafe>
void block_sums(const float* fa, const float* fb, int nv, __m256 vca,
                __m256 vcb, const char* next_a, int lines_a,
                const char* next_b, int lines_b, BlockSums& out) {
  constexpr bool kProbs = kMode == KLMode::Probs;
  const __m256 zero = _mm256_setzero_ps();
  auto ex = [](__m256 x) { return kSafe ? exp8_inrange(x) : exp8(x); };
  auto step = [&](int v, __m256& sa, __m256& sb, __m256& t) {
    __m256 xb = _mm256_sub_ps(_mm256_load_ps(fb + 8 * v), vcb);
    sb = _mm256_add_ps(sb, ex(xb));
    if (kProbs) {
      __m256 w = _mm256_load_ps(fa + 8 * v);
      // w = 0 contributes nothing even where b = -inf (0 * inf is NaN).
      __m256 d =
          kSafe ? xb : _mm256_and_ps(_mm256_cmp_ps(w, zero, _CMP_GT_OQ), xb);
      sa = _mm256_add_ps(sa, w);
      t = _mm256_fnmadd_ps(w, d, t);
    } else {
      __m256 xa = _mm256_sub_ps(_mm256_load_ps(fa + 8 * v), vca);
      __m256 w = ex(xa);
      __m256 d = _mm256_sub_ps(xa, xb);
      if (!kSafe) d = _mm256_and_ps(_mm256_cmp_ps(w, zero, _CMP_GT_OQ), d);
      sa = _mm256_add_ps(sa, w);
      t = _mm256_fmadd_ps(w, d, t);
    }
  };
  for (int v0 = 0; v0 < nv; v0 += kFold / 8) {
    const int v1 = std::min(nv, v0 + kFold / 8);
    // Two independent accumulator sets keep the exps overlapped.
    __m256 sa0 = zero, sa1 = zero, sb0 = zero, sb1 = zero, t0 = zero,
           t1 = zero;
    int v = v0;
    for (; v + 1 < v1; v += 2) {
      // Pull the next block in while this one computes: one line of each
      // input per step, the block's lines spread over the pass.
      const int j = v >> 1;
      if (j < lines_a) _mm_prefetch(next_a + 64 * j, _MM_HINT_T0);
      if (j < lines_b) _mm_prefetch(next_b + 64 * j, _MM_HINT_T0);
      step(v, sa0, sb0, t0);
      step(v + 1, sa1, sb1, t1);
    }
    if (v < v1) step(v, sa0, sb0, t0);
    out.sa = widen_add(out.sa, _mm256_add_ps(sa0, sa1));
    out.sb = widen_add(out.sb, _mm256_add_ps(sb0, sb1));
    out.t = widen_add(out.t, _mm256_add_ps(t0, t1));
  }
}

template <KLMode kMode, DType kA, DType kB>
void chunk(const KLChunk& c, KLState& st) {
  constexpr bool kLogits = kMode == KLMode::Logits;
  constexpr bool kProbs = kMode == KLMode::Probs;
  constexpr int kSizeA = dtype_bytes(kA);
  constexpr int kSizeB = dtype_bytes(kB);
  alignas(32) float fa[kBlock];
  alignas(32) float fb[kBlock];
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const __m256 pinf = _mm256_set1_ps(-kNegInf);
  const __m256 zero = _mm256_setzero_ps();
  // Padding past the row end: no mass on either side.
  const float pad_a = kProbs ? 0.0f : kNegInf;
  const char* pa = static_cast<const char*>(c.a);
  const char* pb = static_cast<const char*>(c.b);

  for (int64_t i0 = 0; i0 < c.n; i0 += kBlock) {
    const int n = int(std::min<int64_t>(kBlock, c.n - i0));
    const int nfull = n / 8;
    const int nv = (n + 7) / 8;
    // Pass 1: convert to scratch; maxima and minima. NaN is not looked for
    // here: max/min skip NaN lanes (x is the first operand), so a NaN ends
    // up in the sums of the in-range path, or is caught by the scan of the
    // general path; either way the block is then rescanned for flags.
    // Two accumulator sets: one max/min chain would bind the loop to the
    // instruction latency (4 cycles per vector).
    __m256 vma[2] = {ninf, ninf}, vmb[2] = {ninf, ninf};
    __m256 vna[2] = {pinf, pinf}, vnb[2] = {pinf, pinf};
    auto scan = [&](int v, int k, __m256 xa, __m256 xb) {
      _mm256_store_ps(fa + 8 * v, xa);
      _mm256_store_ps(fb + 8 * v, xb);
      if (kLogits) vma[k] = _mm256_max_ps(xa, vma[k]);
      vmb[k] = _mm256_max_ps(xb, vmb[k]);
      vna[k] = _mm256_min_ps(xa, vna[k]);
      vnb[k] = _mm256_min_ps(xb, vnb[k]);
    };
    int v = 0;
    for (; v + 1 < nfull; v += 2) {
      scan(v, 0, load8_f32(c.a, i0 + 8 * v, kA), load8_f32(c.b, i0 + 8 * v, kB));
      scan(v + 1, 1, load8_f32(c.a, i0 + 8 * v + 8, kA),
           load8_f32(c.b, i0 + 8 * v + 8, kB));
    }
    if (v < nfull) {
      scan(v, 0, load8_f32(c.a, i0 + 8 * v, kA), load8_f32(c.b, i0 + 8 * v, kB));
      ++v;
    }
    if (nfull < nv) {
      alignas(32) float ta[8], tb[8];
      for (int j = 0; j < 8; ++j) {
        int64_t i = i0 + 8 * nfull + j;
        bool in = 8 * nfull + j < n;
        ta[j] = in ? load_as_f32(c.a, i, c.at) : pad_a;
        tb[j] = in ? load_as_f32(c.b, i, c.bt) : kNegInf;
      }
      scan(nfull, 1, _mm256_load_ps(ta), _mm256_load_ps(tb));
    }
    const float mina = -hmax(_mm256_sub_ps(zero, _mm256_min_ps(vna[0], vna[1])));
    const float minb = -hmax(_mm256_sub_ps(zero, _mm256_min_ps(vnb[0], vnb[1])));
    if (kProbs && mina < 0) st.flags |= kNegWeight;
    const float bmb = hmax(_mm256_max_ps(vmb[0], vmb[1]));
    if (bmb > st.maxb) {
      st.maxb = bmb;
      st.argb = c.offset + i0 + first_index_of(fb, n, bmb);
    }
    kl_rebase_b(st, bmb);
    if (kLogits) {
      const float bma = hmax(_mm256_max_ps(vma[0], vma[1]));
      if (bma > st.maxa) {
        st.maxa = bma;
        st.arga = c.offset + i0 + first_index_of(fa, n, bma);
      }
      kl_rebase_a(st, bma);
    }
    // A side with nothing finite yet shifts by 0: all its exps are 0 anyway.
    const float ca = st.ca == kNegInf ? 0.0f : st.ca;
    const float cb = st.cb == kNegInf ? 0.0f : st.cb;
    // -86 leaves a margin below exp's -87.3 floor for rounding of x - c.
    const bool safe = minb - cb >= -86.0f && (kProbs || mina - ca >= -86.0f);
    if (!safe) {
      // The general path masks lanes that exp sends to 0, NaN among them,
      // so look for NaN explicitly first.
      __m256 bad = zero;
      for (int v = 0; v < nv; ++v)
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_load_ps(fa + 8 * v),
                                              _mm256_load_ps(fb + 8 * v),
                                              _CMP_UNORD_Q));
      if (!_mm256_testz_ps(bad, bad)) flag_nans(fa, fb, n, st);
    }
    const int64_t rest = c.n - i0 - n;  // elements after this block
    const int lines_a = int(std::min<int64_t>(rest, kBlock) * kSizeA / 64);
    const int lines_b = int(std::min<int64_t>(rest, kBlock) * kSizeB / 64);
    const char* next_a = pa + (i0 + n) * kSizeA;
    const char* next_b = pb + (i0 + n) * kSizeB;
    BlockSums bs;
    const __m256 vca = _mm256_set1_ps(ca), vcb = _mm256_set1_ps(cb);
    if (safe)
      block_sums<kMode, true>(fa, fb, nv, vca, vcb, next_a, lines_a, next_b,
                              lines_b, bs);
    else
      block_sums<kMode, false>(fa, fb, nv, vca, vcb, next_a, lines_a, next_b,
                               lines_b, bs);
    const double sa = hsum_pd(bs.sa), sb = hsum_pd(bs.sb), t = hsum_pd(bs.t);
    if (std::isnan(sa) || std::isnan(sb) || std::isnan(t)) flag_nans(fa, fb, n, st);
    st.sa += sa;
    st.sb += sb;
    st.t += t;
  }
}

}  // namespace

// Dispatch ladder: mode, then the two dtypes, each a compile-time constant
// inside the loops.
template <KLMode kMode, DType kA>
void chunk_b(const KLChunk& c, KLState& st) {
  switch (c.bt) {
    case DType::f32: return chunk<kMode, kA, DType::f32>(c, st);
    case DType::f16: return chunk<kMode, kA, DType::f16>(c, st);
    default: return chunk<kMode, kA, DType::bf16>(c, st);
  }
}

template <KLMode kMode>
void chunk_a(const KLChunk& c, KLState& st) {
  switch (c.at) {
    case DType::f32: return chunk_b<kMode, DType::f32>(c, st);
    case DType::f16: return chunk_b<kMode, DType::f16>(c, st);
    default: return chunk_b<kMode, DType::bf16>(c, st);
  }
}

void kl_chunk_avx2(KLMode mode, const KLChunk& c, KLState& st) {
  switch (mode) {
    case KLMode::Logits: chunk_a<KLMode::Logits>(c, st); break;
    case KLMode::FixedShift: chunk_a<KLMode::FixedShift>(c, st); break;
    case KLMode::Probs: chunk_a<KLMode::Probs>(c, st); break;
  }
  // Leave the upper halves of the ymm registers clean: this thread goes on
  // to run MLX's SSE code, which otherwise pays a transition penalty on
  // every instruction (measured: MLX ops 30-40x slower afterwards).
  _mm256_zeroupper();
}

void kl_exp_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float t[8];
    for (int j = 0; j < 8; ++j) t[j] = i + j < n ? x[i + j] : 0.0f;
    _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
    for (int j = 0; i + j < n; ++j) y[i + j] = t[j];
  }
  _mm256_zeroupper();
}

double kl_exp_sum_avx2(const float* x, int64_t n, int64_t reps) {
  // The exp the KL pass runs on ordinary rows (arguments in range), four
  // independent chains in flight: the cheapest an exp gets here.
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t i = 0; i + 32 <= n; i += 32) {
      s0 = _mm256_add_ps(s0, exp8_inrange(_mm256_loadu_ps(x + i)));
      s1 = _mm256_add_ps(s1, exp8_inrange(_mm256_loadu_ps(x + i + 8)));
      s2 = _mm256_add_ps(s2, exp8_inrange(_mm256_loadu_ps(x + i + 16)));
      s3 = _mm256_add_ps(s3, exp8_inrange(_mm256_loadu_ps(x + i + 24)));
    }
  double r = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  _mm256_zeroupper();
  return r;
}

}  // namespace mixbits
