// AVX2 + FMA + F16C kernel of the fp-mode matmul (kernel.h). The weights
// are decoded in registers: e2m1 by a permute of the group's 8 scaled
// magnitudes with the sign bit xor-ed in; e4m3 by moving its bits to
// float16 positions and widening them with F16C. Each output is
// sum over k in two 8-lane float32 accumulators (chunks of 16 columns: the
// first 8 in one, the last 8 in the other), then one fixed reduction: the
// same arithmetic on every path, so the result does not depend on M's path,
// the row blocking or the number of threads.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "common/x86_prefetch.h"
#include "fpmatmul/kernel.h"

namespace mixbits {

namespace {

struct ScaleTables {
  float e8m0[256];
  float e4m3[256];
};

const ScaleTables& scale_tables() {
  static const ScaleTables t = [] {
    ScaleTables s;
    for (int i = 0; i < 256; ++i) {
      s.e8m0[i] = e8m0_value(uint32_t(i));
      s.e4m3[i] = e4m3_value(uint32_t(i));
    }
    return s;
  }();
  return t;
}

// The 8 codes of one word: lane i gets tab[code_i & 7] with code_i's bit 3
// as its sign (tab = the e2m1 magnitudes times the group's scale; a sign
// flip commutes exactly with that product).
inline __m256 e2m1x8(uint32_t u, __m256 tab) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(u)), shifts);
  const __m256 mag = _mm256_permutevar8x32_ps(tab, v);  // reads bits 0-2 only
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(v, 28),
                                        _mm256_set1_epi32(int(0x80000000u)));
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

// 16 e4m3 codes (bytes) as two vectors of 8 values times 2^-8: e4m3 is
// float16 with the exponent bias 7 lower, so the byte's sign, exponent and
// mantissa moved to float16's positions (sign-extended byte << 7, bit 14
// cleared) is the value times 2^-8 exactly, subnormals included (float16's
// subnormals line up with e4m3's), and F16C widens it exactly. 0x7f / 0xff
// become a float16 NaN. The caller multiplies by 2^8 times the scale.
inline void e4m3x16(const uint8_t* p, __m256* lo, __m256* hi) {
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(int16_t(0xbfff)));
  const __m256i e_m = _mm256_set1_epi16(0x3f80);  // exponent and mantissa all ones: NaN
  h = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, e_m), e_m));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Group g of a row, decoded into v[0 .. group/8).
template <FpMode MD>
inline void decode_group(const uint32_t* row, const uint8_t* srow, int64_t g, __m256* v) {
  constexpr int G = fp_mode_group(MD);
  const ScaleTables& t = scale_tables();
  // The codes stream into L2 ahead of use, once per 64-byte line, as the
  // affine kernels' (common/x86_prefetch.h: rows are contiguous, so this
  // runs on into the next rows).
  constexpr int kGroupBytes = G * fp_mode_bits(MD) / 8;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + g * kGroupBytes;
  if ((reinterpret_cast<uintptr_t>(bytes) & 63) < uintptr_t(kGroupBytes))
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchAhead, _MM_HINT_T1);
  if constexpr (MD == FpMode::Mxfp8) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(row) + g * G;
    for (int i = 0; i < G / 8; i += 2) e4m3x16(p + 8 * i, &v[i], &v[i + 1]);
    const uint8_t sb = srow[g];
    if (sb < 247) {
      // 2^8 · scale is exact below 2^120 (byte 247), so one product per
      // value, rounded once as code · scale is.
      const __m256 sc = _mm256_set1_ps(256.0f * t.e8m0[sb]);
      for (int i = 0; i < G / 8; ++i) v[i] = _mm256_mul_ps(v[i], sc);
    } else {
      // 2^8 · scale would overflow: the exact code value first.
      const __m256 sc = _mm256_set1_ps(t.e8m0[sb]);
      for (int i = 0; i < G / 8; ++i)
        v[i] = _mm256_mul_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(256.0f)), sc);
    }
  } else {
    const float s = MD == FpMode::Nvfp4 ? t.e4m3[srow[g]] : t.e8m0[srow[g]];
    const __m256 tab = _mm256_mul_ps(_mm256_loadu_ps(kE2m1), _mm256_set1_ps(s));
    const uint32_t* p = row + g * (G / 8);
    for (int i = 0; i < G / 8; ++i) v[i] = e2m1x8(p[i], tab);
  }
}

// The one reduction of an output's two accumulators.
inline float reduce(__m256 a0, __m256 a1) {
  const __m256 s = _mm256_add_ps(a0, a1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Few rows of x (a decode step): each weight group is decoded in registers
// and multiplied into MB rows at once. (Two weight rows side by side, for
// more accumulator chains, measured slower at M = 1: register spills.)
template <FpMode MD, int MB>
void fused(const float* x, const FpView& w, float* y, int n0, int n1) {
  constexpr int G = fp_mode_group(MD);
  const int64_t K = w.K, groups = w.groups_per_row();
  for (int n = n0; n < n1; ++n) {
    const uint32_t* row = w.wq + int64_t(n) * w.words_per_row();
    const uint8_t* srow = w.scales + int64_t(n) * groups;
    __m256 a0[MB], a1[MB];
    for (int i = 0; i < MB; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 v[G / 8];
      decode_group<MD>(row, srow, g, v);
      for (int c = 0; c < G / 8; c += 2) {
        const int64_t k = g * G + 8 * c;
        for (int i = 0; i < MB; ++i) {
          a0[i] = _mm256_fmadd_ps(v[c], _mm256_loadu_ps(x + i * K + k), a0[i]);
          a1[i] = _mm256_fmadd_ps(v[c + 1], _mm256_loadu_ps(x + i * K + k + 8), a1[i]);
        }
      }
    }
    for (int i = 0; i < MB; ++i) y[int64_t(i) * w.N + n] = reduce(a0[i], a1[i]);
  }
}

// MR x rows times NR decoded weight rows (stride K in `buf`), each output
// summed as everywhere: a0 over the first 8 of every 16 columns, a1 over
// the last 8. 2 x 3 tiles keep 12 accumulators and two x vectors in the 16
// registers, with the weights read as memory operands: 10 loads per 12
// FMAs, where one x row against four weight rows takes 10 per 8.
template <int MR, int NR>
inline void tile(const float* const* xr, const float* const* wr, int64_t K, float (*out)[NR]) {
  __m256 a0[MR][NR], a1[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) a0[i][j] = a1[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(xr[i] + k);
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = _mm256_loadu_ps(wr[j] + k);
      for (int i = 0; i < MR; ++i) a0[i][j] = _mm256_fmadd_ps(wv, xv[i], a0[i][j]);
    }
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(xr[i] + k + 8);
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = _mm256_loadu_ps(wr[j] + k + 8);
      for (int i = 0; i < MR; ++i) a1[i][j] = _mm256_fmadd_ps(wv, xv[i], a1[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i][j] = reduce(a0[i][j], a1[i][j]);
}

// Many rows of x (a prompt): RB weight rows are decoded once into a float
// buffer, then multiplied with the x rows in 2 x 3 tiles (a last odd x row
// in 1 x 3); a short last group of weight rows repeats its last row and
// drops those outputs.
template <FpMode MD>
void buffered(const float* x, int M, const FpView& w, float* y, int n0, int n1) {
  constexpr int G = fp_mode_group(MD), RB = 12, NR = 3;
  const int64_t K = w.K, groups = w.groups_per_row();
  std::vector<float> buf(size_t(RB) * K);
  for (int nb = n0; nb < n1; nb += RB) {
    const int rows = std::min(RB, n1 - nb);
    for (int r = 0; r < rows; ++r) {
      const int n = nb + r;
      const uint32_t* row = w.wq + int64_t(n) * w.words_per_row();
      const uint8_t* srow = w.scales + int64_t(n) * groups;
      float* dst = buf.data() + int64_t(r) * K;
      for (int64_t g = 0; g < groups; ++g) {
        __m256 v[G / 8];
        decode_group<MD>(row, srow, g, v);
        for (int c = 0; c < G / 8; ++c) _mm256_storeu_ps(dst + g * G + 8 * c, v[c]);
      }
    }
    for (int r0 = 0; r0 < rows; r0 += NR) {
      const float* wr[NR];
      for (int j = 0; j < NR; ++j) wr[j] = buf.data() + int64_t(std::min(r0 + j, rows - 1)) * K;
      const int nr = std::min(NR, rows - r0);
      float out[2][NR];
      int m = 0;
      for (; m + 2 <= M; m += 2) {
        const float* xr[2] = {x + int64_t(m) * K, x + int64_t(m + 1) * K};
        tile<2, NR>(xr, wr, K, out);
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < nr; ++j) y[int64_t(m + i) * w.N + nb + r0 + j] = out[i][j];
      }
      if (m < M) {
        const float* xr[1] = {x + int64_t(m) * K};
        tile<1, NR>(xr, wr, K, out);
        for (int j = 0; j < nr; ++j) y[int64_t(m) * w.N + nb + r0 + j] = out[0][j];
      }
    }
  }
}

template <FpMode MD>
void run_mode(const float* x, int M, const FpView& w, float* y) {
  if (M > 4) {
    parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) { buffered<MD>(x, M, w, y, int(n0), int(n1)); });
    return;
  }
  parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: return fused<MD, 1>(x, w, y, int(n0), int(n1));
      case 2: return fused<MD, 2>(x, w, y, int(n0), int(n1));
      case 3: return fused<MD, 3>(x, w, y, int(n0), int(n1));
      default: return fused<MD, 4>(x, w, y, int(n0), int(n1));
    }
  });
}

}  // namespace

void fpm_avx2_run(const float* x, int M, const FpView& w, float* y) {
  if (M <= 0 || w.N <= 0) return;
  switch (w.mode) {
    case FpMode::Mxfp4: return run_mode<FpMode::Mxfp4>(x, M, w, y);
    case FpMode::Nvfp4: return run_mode<FpMode::Nvfp4>(x, M, w, y);
    case FpMode::Mxfp8: return run_mode<FpMode::Mxfp8>(x, M, w, y);
  }
}

}  // namespace mixbits
