// AVX2 + FMA + F16C backend of the mixed-segment quantized matmul.
//
// Decode. Codes are read 32 at a time (a "unit": every group size is a
// multiple of 32, so a unit never straddles a group or a segment). Each of
// the 8 lanes gets a 32-bit window of the row's bitstream holding 4
// consecutive codes: lane i holds codes 4i..4i+3 at bit offsets
// s_i + k*bits (s_i = 4 for odd lanes of 3- and 5-bit rows, else 0).
// Extraction k is then a single AND with a per-lane mask and an int->float
// convert: lane i yields code(4i+k) * 2^(s_i + k*bits). No shifts: the
// power of two is divided out of the activations instead, once per call
// (exact in float). So x is re-ordered per unit into "decode order"
// (position 8k+i holds column 4i+k) and pre-scaled per segment.
//
// Regimes, chosen by M (see kSmallM):
//  - small M (batch-1 and decoding): every weight is decoded once into a
//    vector of floats and FMA'd against up to 8 (4 with 16 lanes)
//    activation rows; the affine bias is folded:
//    y = sum_g s_g * (sum q x) + b_g * (sum x), sum x per group computed
//    once per call.
//  - larger M (prefill): tiles of W are dequantized (s*q + b) into an
//    L2-resident float buffer and a register-blocked micro-kernel (4x3
//    with 8 lanes, 6x4 with 16) runs over them, so decode cost is
//    amortized over all M rows.
//
// On CPUs that also have AVX-512F (checked at run time) the 16-lane
// versions run; MIXBITS_QMM_ISA=avx2 forces the 8-lane ones. Both are
// compiled in this file: the 16-lane functions carry a target attribute.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "qmatmul/kernel.h"

namespace mixbits {
namespace {

constexpr int kUnit = 32;    // codes per decode unit
// Above this M, the dequantized-tile GEMM path (measured crossovers here:
// 16-24 rows with the 8-lane kernels, 32-48 with the 16-lane ones).
constexpr int kSmallM = 16;
constexpr int kSmallM512 = 40;
constexpr int kMaxMB = 8;    // activation rows per pass of the small path
constexpr int kMaxMB512 = 4; // the same for the 16-lane small-path kernel
constexpr int kKC = 1024;    // GEMM: columns per dequantized tile
constexpr int kNB = 48;      // GEMM: W rows per dequantized tile
// GEMM: x rows per pass over a tile. Blocks of 96 rows (x in L2) were
// measured slower here than one pass over all rows, so blocking is off.
constexpr int kMB = 1 << 20;

// ------------------------------------------------------------ decode

constexpr int lane_shift(int B, int i) { return ((B & 1) && (i & 1)) ? 4 : 0; }

// Bit position of code (4i+k) inside lane i's window; the 8-bit top code
// is shifted down instead of masked (its mask would hit the sign bit).
constexpr int code_exp(int B, int k, int i) {
  return (B == 8 && k == 3) ? 0 : lane_shift(B, i) + k * B;
}

constexpr int lane_mask(int B, int k, int i) {
  return int(((1u << B) - 1u) << code_exp(B, k, i));
}

template <int B>
inline __m256i load_unit(const uint8_t* p);

// 2-bit: 8 bytes, lane i = byte i.
template <>
inline __m256i load_unit<2>(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
// 4-bit: 16 bytes, lane i = bytes 2i..2i+1.
template <>
inline __m256i load_unit<4>(const uint8_t* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
}
// 8-bit: 32 bytes, lane i = word i.
template <>
inline __m256i load_unit<8>(const uint8_t* p) {
  return _mm256_loadu_si256((const __m256i*)p);
}
// 3-bit: 12 bytes; lanes start at bytes 0,1,3,4 | 6,7,9,10 (2 bytes each).
// The two halves are loaded separately so no load leaves the unit.
template <>
inline __m256i load_unit<3>(const uint8_t* p) {
  const __m128i lo = _mm_loadl_epi64((const __m128i*)p);
  const __m128i hi = _mm_loadl_epi64((const __m128i*)(p + 4));
  const __m256i ctrl = _mm256_setr_epi8(
      0, 1, -1, -1, 1, 2, -1, -1, 3, 4, -1, -1, 4, 5, -1, -1,  //
      2, 3, -1, -1, 3, 4, -1, -1, 5, 6, -1, -1, 6, 7, -1, -1);
  return _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), ctrl);
}
// 5-bit: 20 bytes; lanes start at bytes 0,2,5,7 | 10,12,15,17 (3 bytes).
template <>
inline __m256i load_unit<5>(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)p);
  const __m128i hi = _mm_loadu_si128((const __m128i*)(p + 4));
  const __m256i ctrl = _mm256_setr_epi8(
      0, 1, 2, -1, 2, 3, 4, -1, 5, 6, 7, -1, 7, 8, 9, -1,  //
      6, 7, 8, -1, 8, 9, 10, -1, 11, 12, 13, -1, 13, 14, 15, -1);
  return _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), ctrl);
}
// 6-bit: 24 bytes; lanes start at bytes 3i (3 bytes each).
template <>
inline __m256i load_unit<6>(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)p);
  const __m128i hi = _mm_loadu_si128((const __m128i*)(p + 8));
  const __m256i ctrl = _mm256_setr_epi8(
      0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  //
      4, 5, 6, -1, 7, 8, 9, -1, 10, 11, 12, -1, 13, 14, 15, -1);
  return _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), ctrl);
}

// Codes (4i+k), i = 0..7, as floats times 2^code_exp(B, k, i).
template <int B, int K>
inline __m256 extract(__m256i win) {
  if constexpr (B == 8 && K == 3) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(win, 24));
  } else {
    const __m256i m = _mm256_setr_epi32(
        lane_mask(B, K, 0), lane_mask(B, K, 1), lane_mask(B, K, 2),
        lane_mask(B, K, 3), lane_mask(B, K, 4), lane_mask(B, K, 5),
        lane_mask(B, K, 6), lane_mask(B, K, 7));
    return _mm256_cvtepi32_ps(_mm256_and_si256(win, m));
  }
}

// 2^-code_exp per decode position (8k + i) of a unit.
template <int B>
struct UnitScale {
  float v[kUnit];
  constexpr UnitScale() : v() {
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 8; ++i) {
        float f = 1.0f;
        for (int e = 0; e < code_exp(B, k, i); ++e) f *= 0.5f;
        v[8 * k + i] = f;
      }
  }
};

// ------------------------------------------------------------ helpers

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// n scales or biases from element `off` of src, as float32.
void to_f32(const void* src, int64_t off, int n, DType t, float* dst) {
  int i = 0;
  if (t == DType::f32) {
    std::memcpy(dst, static_cast<const float*>(src) + off, sizeof(float) * n);
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(src) + off;
  if (t == DType::f16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i,
                       _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + i))));
    if (i < n) {  // tail through a padded vector: no per-element branches
      alignas(16) uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      alignas(32) float f[8];
      std::memcpy(h, p + i, sizeof(uint16_t) * (n - i));
      _mm256_store_ps(f, _mm256_cvtph_ps(_mm_load_si128((const __m128i*)h)));
      std::memcpy(dst + i, f, sizeof(float) * (n - i));
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    for (; i < n; ++i) dst[i] = bf16_to_f32(p[i]);
  }
}

float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Column c of a row, in decode order: position 8k+i of a unit <- 4i+k.
// `scale` (32 floats, or null) multiplies position p of every unit. A unit
// is an 8x4 (i, k) matrix to transpose: 4x4 transposes inside each 128-bit
// half, then one cross-half permute per output row.
inline void to_decode_order(const float* src, int n, float* dst,
                            const float* scale = nullptr) {
  const __m256i ilv = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 sc[4];
  for (int k = 0; k < 4; ++k)
    sc[k] = scale ? _mm256_loadu_ps(scale + 8 * k) : _mm256_set1_ps(1.0f);
  for (int u = 0; u < n; u += kUnit) {
    const __m256 a = _mm256_loadu_ps(src + u), b = _mm256_loadu_ps(src + u + 8);
    const __m256 c = _mm256_loadu_ps(src + u + 16), d = _mm256_loadu_ps(src + u + 24);
    const __m256 t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
    const __m256 t2 = _mm256_unpacklo_ps(c, d), t3 = _mm256_unpackhi_ps(c, d);
    const __m256 r[4] = {
        _mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
        _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int k = 0; k < 4; ++k)
      _mm256_storeu_ps(dst + u + 8 * k,
                       _mm256_mul_ps(_mm256_permutevar8x32_ps(r[k], ilv), sc[k]));
  }
}

// Sums of x over consecutive groups of gs (a multiple of 8) columns.
inline void group_sums(const float* src, int ngroups, int gs, float* out) {
  for (int g = 0; g < ngroups; ++g) {
    __m256 a0 = _mm256_loadu_ps(src), a1 = _mm256_setzero_ps();
    for (int c = 8; c < gs; c += 16) {
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(src + c));
      if (c + 8 < gs) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(src + c + 8));
    }
    out[g] = hsum(_mm256_add_ps(a0, a1));
    src += gs;
  }
}

// Everything one call prepares once and every worker reads.
struct Prepared {
  int M = 0, K = 0;
  std::vector<float> xd;  // [M, K] decode order (GEMM path)
  // Small-M path, per segment: x in decode order times 2^-code_exp
  // ([M, k]) and per-group sums of x ([M, groups]).
  std::vector<std::vector<float>> xq, xs;
};

// ------------------------------------------------------------ small M

// Rows [n0, n1) (a multiple of R) of one segment against MB activation
// rows; adds into y (row stride ldy). A accumulators per (row, x-row) keep
// enough independent FMA chains in flight when R*MB is small.
//
// With one activation row the group scale is applied to the per-group sum
// (one FMA per group, the decode stays and+cvt+fma per 8 weights). With
// several rows, a per-group accumulator for each would not fit in the 16
// registers, so the decoded weights are multiplied by the scale once and
// then reused for all rows (one extra multiply shared by MB FMAs).
template <int B, int G, int MB, int R, int A>
void gemv_rows(const SegView& s, DType sdt, const float* xq, const float* xs,
               int ldx, int c0, int c1, int n0, int n1, float* y, int ldy) {
  constexpr bool kScaleW = MB >= 2;
  const int row_groups = s.k / G;
  const int ngroups = (c1 - c0) / G;  // groups of this column block
  const int64_t row_bytes = int64_t(s.k) * B / 8;
  // Shift the pointers so that column 0 / group 0 below is c0 / c0 / G.
  xq += c0;
  xs += c0 / G;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(2) * R * ngroups);
  float* sc = scratch.data();
  float* bi = sc + size_t(R) * ngroups;
  for (int n = n0; n < n1; n += R) {
    const uint8_t* rowp[R];
    for (int r = 0; r < R; ++r)
      rowp[r] = reinterpret_cast<const uint8_t*>(s.wq) + int64_t(n + r) * row_bytes +
                int64_t(c0) * B / 8;
    if (ngroups == row_groups) {  // whole rows: R rows of scales are contiguous
      to_f32(s.scales, int64_t(n) * row_groups, R * ngroups, sdt, sc);
      to_f32(s.biases, int64_t(n) * row_groups, R * ngroups, sdt, bi);
    } else {
      for (int r = 0; r < R; ++r) {
        const int64_t goff = int64_t(n + r) * row_groups + c0 / G;
        to_f32(s.scales, goff, ngroups, sdt, sc + r * ngroups);
        to_f32(s.biases, goff, ngroups, sdt, bi + r * ngroups);
      }
    }
    __m256 tot[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_setzero_ps();
    __m256 acc[R][MB][A];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m)
        for (int a = 0; a < A; ++a) acc[r][m][a] = _mm256_setzero_ps();
    for (int g = 0; g < ngroups; ++g) {
      __m256 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm256_broadcast_ss(sc + r * ngroups + g);
#pragma GCC unroll 4
      for (int u = 0; u < G / kUnit; ++u) {
        const int c = g * G + u * kUnit;
        const float* xp = xq + c;
        for (int r = 0; r < R; ++r) {
          const __m256i win = load_unit<B>(rowp[r] + c * B / 8);
          auto step = [&]<int K>() {
            __m256 wf = extract<B, K>(win);
            if constexpr (kScaleW) wf = _mm256_mul_ps(wf, sv[r]);
            for (int m = 0; m < MB; ++m)
              acc[r][m][K % A] = _mm256_fmadd_ps(
                  wf, _mm256_loadu_ps(xp + m * ldx + 8 * K), acc[r][m][K % A]);
          };
          step.template operator()<0>();
          step.template operator()<1>();
          step.template operator()<2>();
          step.template operator()<3>();
        }
      }
      if constexpr (!kScaleW) {
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < MB; ++m) {
            __m256 a = acc[r][m][0];
            if constexpr (A > 1) a = _mm256_add_ps(a, acc[r][m][1]);
            tot[r][m] = _mm256_fmadd_ps(a, sv[r], tot[r][m]);
            for (int i = 0; i < A; ++i) acc[r][m][i] = _mm256_setzero_ps();
          }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        __m256 t = tot[r][m];
        if constexpr (kScaleW) {
          t = acc[r][m][0];
          if constexpr (A > 1) t = _mm256_add_ps(t, acc[r][m][1]);
        }
        y[int64_t(m) * ldy + n + r] +=
            hsum(t) + dot(bi + r * ngroups, xs + m * row_groups, ngroups);
      }
  }
}

// Rows of W stream start to end, what the hardware prefetcher likes best.
// (Walking the segment in column blocks so that the MB rows of x stay in
// L1 was measured slower here, even with software prefetch of the next
// rows: the short strided runs of W cost more than x coming from L2.)
// kBlock is kept so that blocking can be re-tried on other CPUs.
template <int B, int G, int MB>
void gemv_mb(const SegView& s, DType sdt, const float* xq, const float* xs,
             int ldx, int n0, int n1, float* y, int ldy) {
  constexpr int R = MB == 1 ? 4 : (MB <= 3 ? 2 : 1);
  constexpr int A = R * MB <= 4 ? 2 : 1;
  constexpr int kBlock = 1 << 30;
  const int nfull = n0 + (n1 - n0) / R * R;
  for (int c0 = 0; c0 < s.k; c0 += kBlock) {
    const int c1 = std::min(s.k, c0 + kBlock);
    gemv_rows<B, G, MB, R, A>(s, sdt, xq, xs, ldx, c0, c1, n0, nfull, y, ldy);
    if (nfull < n1)
      // Same A as the main rows: same summation order wherever a row falls.
      gemv_rows<B, G, MB, 1, A>(s, sdt, xq, xs, ldx, c0, c1, nfull, n1, y, ldy);
  }
}

template <int B, int G>
void gemv_seg(const SegView& s, DType sdt, const float* xq, const float* xs,
              int ldx, int mb, int n0, int n1, float* y, int ldy) {
  switch (mb) {
#define MIXBITS_MB(V) \
  case V: return gemv_mb<B, G, V>(s, sdt, xq, xs, ldx, n0, n1, y, ldy);
    MIXBITS_MB(1) MIXBITS_MB(2) MIXBITS_MB(3) MIXBITS_MB(4)
    MIXBITS_MB(5) MIXBITS_MB(6) MIXBITS_MB(7) MIXBITS_MB(8)
#undef MIXBITS_MB
  }
}

// The small-M kernel with 16-lane registers, for CPUs that also have
// AVX-512F. One unit's 8-lane window is duplicated into both halves of a
// 16-lane register, so one AND + convert yields extractions k and k+1:
// decode positions 0..15, then 16..31, contiguous in the same x layout.
// The 8-bit top code has its own exponent in the AVX2 layout (shifted, not
// masked), so its half is shifted per lane instead.
#define MIXBITS_AVX512_SMALL __attribute__((target("avx512f,avx2,fma,f16c")))

template <int B, int H>  // H: 0 -> extractions 0,1; 1 -> extractions 2,3
MIXBITS_AVX512_SMALL inline __m512 extract_pair(__m512i w2) {
  constexpr int k0 = 2 * H, k1 = 2 * H + 1;
  if constexpr (B == 8 && H == 1) {
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 24, 24, 24, 24,
                                         24, 24, 24, 24);
    const __m512i m = _mm512_setr_epi32(
        0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000, 0xFF0000,
        0xFF0000, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w2, sh), m));
  } else {
    const __m512i m = _mm512_setr_epi32(
        lane_mask(B, k0, 0), lane_mask(B, k0, 1), lane_mask(B, k0, 2),
        lane_mask(B, k0, 3), lane_mask(B, k0, 4), lane_mask(B, k0, 5),
        lane_mask(B, k0, 6), lane_mask(B, k0, 7), lane_mask(B, k1, 0),
        lane_mask(B, k1, 1), lane_mask(B, k1, 2), lane_mask(B, k1, 3),
        lane_mask(B, k1, 4), lane_mask(B, k1, 5), lane_mask(B, k1, 6),
        lane_mask(B, k1, 7));
    return _mm512_cvtepi32_ps(_mm512_and_si512(w2, m));
  }
}

// A unit's window in both 8-lane halves. For 2-, 4- and 8-bit rows the
// bytes are broadcast by the load itself (a load-port operation) before
// widening, which saves the cross-lane insert of the generic path.
template <int B>
MIXBITS_AVX512_SMALL inline __m512i load_unit2(const uint8_t* p) {
  if constexpr (B == 2) {
    const __m128i b = _mm_castpd_si128(_mm_loaddup_pd((const double*)p));
    return _mm512_cvtepu8_epi32(b);
  } else if constexpr (B == 4) {
    return _mm512_cvtepu16_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p)));
  } else if constexpr (B == 8) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
  } else {
    const __m256i win = load_unit<B>(p);
    return _mm512_inserti64x4(_mm512_castsi256_si512(win), win, 1);
  }
}

template <int B, int G, int MB, int R, int A>
MIXBITS_AVX512_SMALL void gemv_rows512(const SegView& s, DType sdt, const float* xq,
                                       const float* xs, int ldx, int n0, int n1,
                                       float* y, int ldy) {
  constexpr bool kScaleW = MB >= 2;  // as in gemv_rows
  const int ngroups = s.k / G;
  const int64_t row_bytes = int64_t(s.k) * B / 8;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(2) * R * ngroups);
  float* sc = scratch.data();
  float* bi = sc + size_t(R) * ngroups;
  for (int n = n0; n < n1; n += R) {
    const uint8_t* rowp[R];
    for (int r = 0; r < R; ++r)
      rowp[r] = reinterpret_cast<const uint8_t*>(s.wq) + int64_t(n + r) * row_bytes;
    // R consecutive rows of scales (biases) are contiguous: one conversion.
    to_f32(s.scales, int64_t(n) * ngroups, R * ngroups, sdt, sc);
    to_f32(s.biases, int64_t(n) * ngroups, R * ngroups, sdt, bi);
    __m512 tot[R][MB], acc[R][MB][A];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        tot[r][m] = _mm512_setzero_ps();
        for (int a = 0; a < A; ++a) acc[r][m][a] = _mm512_setzero_ps();
      }
    for (int g = 0; g < ngroups; ++g) {
      __m512 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm512_set1_ps(sc[r * ngroups + g]);
#pragma GCC unroll 4
      for (int u = 0; u < G / kUnit; ++u) {
        const int c = g * G + u * kUnit;
        const float* xp = xq + c;
        // Decode the unit of all R rows first, then each activation load
        // feeds R FMAs.
        __m512 v0[R], v1[R];
        for (int r = 0; r < R; ++r) {
          const __m512i w2 = load_unit2<B>(rowp[r] + c * B / 8);
          v0[r] = extract_pair<B, 0>(w2);
          v1[r] = extract_pair<B, 1>(w2);
          if constexpr (kScaleW) {
            v0[r] = _mm512_mul_ps(v0[r], sv[r]);
            v1[r] = _mm512_mul_ps(v1[r], sv[r]);
          }
        }
        for (int m = 0; m < MB; ++m) {
          const __m512 x0 = _mm512_loadu_ps(xp + m * ldx);
          const __m512 x1 = _mm512_loadu_ps(xp + m * ldx + 16);
          for (int r = 0; r < R; ++r) {
            acc[r][m][0] = _mm512_fmadd_ps(v0[r], x0, acc[r][m][0]);
            acc[r][m][A - 1] = _mm512_fmadd_ps(v1[r], x1, acc[r][m][A - 1]);
          }
        }
      }
      if constexpr (!kScaleW) {
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < MB; ++m) {
            __m512 a = acc[r][m][0];
            if constexpr (A > 1) a = _mm512_add_ps(a, acc[r][m][1]);
            tot[r][m] = _mm512_fmadd_ps(a, sv[r], tot[r][m]);
            for (int i = 0; i < A; ++i) acc[r][m][i] = _mm512_setzero_ps();
          }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        __m512 t = tot[r][m];
        if constexpr (kScaleW) {
          t = acc[r][m][0];
          if constexpr (A > 1) t = _mm512_add_ps(t, acc[r][m][1]);
        }
        y[int64_t(m) * ldy + n + r] += _mm512_reduce_add_ps(t) +
                                       dot(bi + r * ngroups, xs + m * ngroups, ngroups);
      }
  }
}

template <int B, int G, int MB>
void gemv_mb512(const SegView& s, DType sdt, const float* xq, const float* xs,
                int ldx, int n0, int n1, float* y, int ldy) {
  // 32 registers hold R*MB*A accumulators, 2R decoded vectors and 2
  // activation vectors. Several W rows per pass so each activation load
  // (from L2 when MB rows of x exceed L1) feeds R FMAs.
  constexpr int R = MB <= 4 ? 4 : (MB <= 6 ? 3 : 2);
  constexpr int A = MB <= 2 ? 2 : 1;
  const int nfull = n0 + (n1 - n0) / R * R;
  gemv_rows512<B, G, MB, R, A>(s, sdt, xq, xs, ldx, n0, nfull, y, ldy);
  if (nfull < n1)  // same A: same summation order wherever a row falls
    gemv_rows512<B, G, MB, 1, A>(s, sdt, xq, xs, ldx, nfull, n1, y, ldy);
}

template <int B, int G>
void gemv_seg512(const SegView& s, DType sdt, const float* xq, const float* xs,
                 int ldx, int mb, int n0, int n1, float* y, int ldy) {
  switch (mb) {
#define MIXBITS_MB(V) \
  case V: return gemv_mb512<B, G, V>(s, sdt, xq, xs, ldx, n0, n1, y, ldy);
    MIXBITS_MB(1) MIXBITS_MB(2) MIXBITS_MB(3) MIXBITS_MB(4)
    MIXBITS_MB(5) MIXBITS_MB(6) MIXBITS_MB(7) MIXBITS_MB(8)
#undef MIXBITS_MB
  }
}

// ------------------------------------------------------------ large M

// Dequantizes rows [n, n+nr) x columns [c0, c1) (group-aligned) of one
// segment into dst (row stride ld), in decode order: w = s*q + b.
template <int B, int G>
void dequant_tile(const SegView& s, DType sdt, int n, int nr, int c0, int c1,
                  float* dst, int ld) {
  static constexpr UnitScale<B> us{};
  const int ngroups = s.k / G;
  const int64_t row_bytes = int64_t(s.k) * B / 8;
  const int g0 = c0 / G, g1 = c1 / G;
  float sc[kKC / 32], bi[kKC / 32];
  for (int r = 0; r < nr; ++r) {
    const uint8_t* rowp =
        reinterpret_cast<const uint8_t*>(s.wq) + int64_t(n + r) * row_bytes;
    to_f32(s.scales, int64_t(n + r) * ngroups + g0, g1 - g0, sdt, sc);
    to_f32(s.biases, int64_t(n + r) * ngroups + g0, g1 - g0, sdt, bi);
    float* d = dst + int64_t(r) * ld - c0;
    for (int g = g0; g < g1; ++g) {
      const __m256 sv = _mm256_set1_ps(sc[g - g0]);
      const __m256 bv = _mm256_set1_ps(bi[g - g0]);
      const __m256 s0 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 0));
      const __m256 s1 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 8));
      const __m256 s2 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 16));
      const __m256 s3 = _mm256_mul_ps(sv, _mm256_loadu_ps(us.v + 24));
      for (int u = 0; u < G / kUnit; ++u) {
        const int c = g * G + u * kUnit;
        const __m256i win = load_unit<B>(rowp + c * B / 8);
        _mm256_storeu_ps(d + c + 0, _mm256_fmadd_ps(extract<B, 0>(win), s0, bv));
        _mm256_storeu_ps(d + c + 8, _mm256_fmadd_ps(extract<B, 1>(win), s1, bv));
        _mm256_storeu_ps(d + c + 16, _mm256_fmadd_ps(extract<B, 2>(win), s2, bv));
        _mm256_storeu_ps(d + c + 24, _mm256_fmadd_ps(extract<B, 3>(win), s3, bv));
      }
    }
  }
}

// y[i, j] += sum_p x[i, p] * w[j, p] for an MR x NR block, lanes along p.
template <int MR, int NR>
void micro(const float* x, int ldx, const float* w, int ldw, int kc, float* y,
           int ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int p = 0; p < kc; p += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] += hsum(acc[i][j]);
}

// The same micro-kernel with 16-lane registers, for CPUs that also have
// AVX-512F (checked at run time; only this function uses it). 32 registers
// allow a 6x4 block: 24 accumulators, 10 loads per 24 FMAs.
#define MIXBITS_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
template <int MR, int NR>
MIXBITS_AVX512 void micro512(const float* x, int ldx, const float* w, int ldw,
                             int kc, float* y, int ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int p = 0; p < kc; p += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  // Four sums at once: fold to 8 lanes, then a horizontal-add tree. Tails
  // (NR < 4) run the same tree on zeros, so every output is summed in the
  // same order whatever block it falls in (threaded == single-thread).
  for (int i = 0; i < MR; ++i) {
    __m256 h[4];
    for (int j = 0; j < 4; ++j)
      h[j] = j < NR ? _mm256_add_ps(_mm512_castps512_ps256(acc[i][j]),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                        _mm512_castps_pd(acc[i][j]), 1)))
                    : _mm256_setzero_ps();
    const __m256 t =
        _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    if constexpr (NR == 4) {
      _mm_storeu_ps(y + i * ldy, _mm_add_ps(_mm_loadu_ps(y + i * ldy), s4));
    } else {
      alignas(16) float r[4];
      _mm_store_ps(r, s4);
      for (int j = 0; j < NR; ++j) y[i * ldy + j] += r[j];
    }
  }
}

using MicroFn = void (*)(const float*, int, const float*, int, int, float*, int);
template <int MR>
constexpr MicroFn micro_row[4] = {nullptr, micro<MR, 1>, micro<MR, 2>, micro<MR, 3>};
constexpr const MicroFn* micro_table[5] = {nullptr, micro_row<1>, micro_row<2>,
                                           micro_row<3>, micro_row<4>};
template <int MR>
constexpr MicroFn micro512_row[5] = {nullptr, micro512<MR, 1>, micro512<MR, 2>,
                                     micro512<MR, 3>, micro512<MR, 4>};
constexpr const MicroFn* micro512_table[7] = {
    nullptr,          micro512_row<1>, micro512_row<2>, micro512_row<3>,
    micro512_row<4>, micro512_row<5>, micro512_row<6>};

// 16-lane kernels (small-M rows, 6x4 micro-kernel) when the CPU has
// AVX-512F, else the 8-lane ones (4x3 micro-kernel). MIXBITS_QMM_ISA=avx2
// forces the 8-lane ones; it is read per call, so tests check both on a
// CPU that has AVX-512.
struct MicroPick {
  int mr, nr;
  const MicroFn* const* table;
};
bool use_avx512() {
  static const bool has512 = __builtin_cpu_supports("avx512f");
  const char* isa = std::getenv("MIXBITS_QMM_ISA");
  return has512 && !(isa && std::strcmp(isa, "avx2") == 0);
}
MicroPick pick_micro() {
  if (use_avx512()) return {6, 4, micro512_table};
  return {4, 3, micro_table};
}

// ------------------------------------------------------------ ladder

using GemvFn = void (*)(const SegView&, DType, const float*, const float*, int,
                        int, int, int, float*, int);
using DequantFn = void (*)(const SegView&, DType, int, int, int, int, float*, int);

struct SegFns {
  GemvFn gemv;
  GemvFn gemv512;
  DequantFn dequant;
};

template <int B, int G>
constexpr SegFns make_fns() {
  return {gemv_seg<B, G>, gemv_seg512<B, G>, dequant_tile<B, G>};
}

template <int B>
constexpr SegFns pick_g(int gs) {
  return gs == 32 ? make_fns<B, 32>() : gs == 64 ? make_fns<B, 64>() : make_fns<B, 128>();
}

SegFns seg_fns(int bits, int gs) {
  switch (bits) {
    case 2: return pick_g<2>(gs);
    case 3: return pick_g<3>(gs);
    case 4: return pick_g<4>(gs);
    case 5: return pick_g<5>(gs);
    case 6: return pick_g<6>(gs);
    default: return pick_g<8>(gs);
  }
}

const float* unit_scale(int bits) {
  static constexpr UnitScale<2> u2{};
  static constexpr UnitScale<3> u3{};
  static constexpr UnitScale<4> u4{};
  static constexpr UnitScale<5> u5{};
  static constexpr UnitScale<6> u6{};
  static constexpr UnitScale<8> u8{};
  switch (bits) {
    case 2: return u2.v;
    case 3: return u3.v;
    case 4: return u4.v;
    case 5: return u5.v;
    case 6: return u6.v;
    default: return u8.v;
  }
}

// ------------------------------------------------------------ slices

void small_slice(const Prepared& pr, const QMatView& w,
                 const std::vector<SegFns>& fns, bool wide, float* y, int n0, int n1) {
  const int N = w.N;
  // The 16-lane kernel is measured fastest in passes of at most 4 rows
  // (4 W rows x 4 x-rows of accumulators); more rows per pass run out of
  // registers, and re-decoding W per pass is cheaper than spilling.
  const int step = wide ? kMaxMB512 : kMaxMB;
  for (int m0 = 0; m0 < pr.M; m0 += step) {
    const int mb = std::min(step, pr.M - m0);
    for (int m = 0; m < mb; ++m)
      std::fill(y + int64_t(m0 + m) * N + n0, y + int64_t(m0 + m) * N + n1, 0.0f);
    for (size_t si = 0; si < w.segs.size(); ++si) {
      const SegView& s = w.segs[si];
      const int ng = s.k / s.group_size;
      (wide ? fns[si].gemv512 : fns[si].gemv)(
                   s, w.sdtype, pr.xq[si].data() + int64_t(m0) * s.k,
                   pr.xs[si].data() + int64_t(m0) * ng, s.k, mb, n0, n1,
                   y + int64_t(m0) * N, N);
    }
  }
}

void gemm_slice(const Prepared& pr, const QMatView& w,
                const std::vector<SegFns>& fns, float* y, int n0, int n1) {
  const int N = w.N, M = pr.M, K = pr.K;
  const MicroPick mk = pick_micro();
  thread_local std::vector<float> tile;
  tile.resize(size_t(kNB) * kKC);
  for (int m = 0; m < M; ++m)
    std::fill(y + int64_t(m) * N + n0, y + int64_t(m) * N + n1, 0.0f);
  for (size_t si = 0; si < w.segs.size(); ++si) {
    const SegView& s = w.segs[si];
    for (int c0 = 0; c0 < s.k; c0 += kKC) {
      const int c1 = std::min(s.k, c0 + kKC), kc = c1 - c0;
      // x rows in blocks that stay in L2 next to the tile; the tile is
      // dequantized again per block (cheap next to kMB rows of FMAs).
      for (int mb0 = 0; mb0 < M; mb0 += kMB) {
      const int mb1 = std::min(M, mb0 + kMB);
      for (int nt = n0; nt < n1; nt += kNB) {
        const int nb = std::min(kNB, n1 - nt);
        fns[si].dequant(s, w.sdtype, nt, nb, c0, c1, tile.data(), kKC);
        const float* xb = pr.xd.data() + s.k0 + c0;
        for (int m = mb0; m < mb1; m += mk.mr) {
          const int mr = std::min(mk.mr, mb1 - m);
          for (int j = 0; j < nb; j += mk.nr) {
            const int nr = std::min(mk.nr, nb - j);
            mk.table[mr][nr](xb + int64_t(m) * K, K, tile.data() + j * kKC, kKC, kc,
                             y + int64_t(m) * N + nt + j, N);
          }
        }
      }
      }
    }
  }
}

// kSmallM, or MIXBITS_QMM_SMALL_M to re-measure the crossover on a CPU.
int small_m_limit(bool wide) {
  static const int v = [] {
    const char* e = std::getenv("MIXBITS_QMM_SMALL_M");
    return e && std::atoi(e) > 0 ? std::atoi(e) : 0;
  }();
  return v ? v : (wide ? kSmallM512 : kSmallM);
}

}  // namespace

void qmm_avx2_run(const float* x, int M, const QMatView& w, float* y) {
  Prepared pr;
  pr.M = M;
  pr.K = w.K;
  const int K = w.K;
  const bool wide = use_avx512();
  const bool small = M <= small_m_limit(wide);
  std::vector<SegFns> fns;
  for (const SegView& s : w.segs) fns.push_back(seg_fns(s.bits, s.group_size));

  if (small) {
    pr.xq.resize(w.segs.size());
    pr.xs.resize(w.segs.size());
    for (size_t si = 0; si < w.segs.size(); ++si) {
      const SegView& s = w.segs[si];
      const int ng = s.k / s.group_size;
      const float* us = unit_scale(s.bits);
      pr.xq[si].resize(size_t(M) * s.k);
      pr.xs[si].resize(size_t(M) * ng);
      for (int m = 0; m < M; ++m) {
        const float* src = x + int64_t(m) * K + s.k0;
        float* dq = pr.xq[si].data() + int64_t(m) * s.k;
        to_decode_order(src, s.k, dq, us);
        group_sums(src, ng, s.group_size, pr.xs[si].data() + int64_t(m) * ng);
      }
    }
    parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) {
      small_slice(pr, w, fns, wide, y, int(n0), int(n1));
    });
  } else {
    pr.xd.resize(size_t(M) * K);
    parallel_for(M, 32, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        to_decode_order(x + m * K, K, pr.xd.data() + m * K);
    });
    parallel_for(w.N, kNB, [&](int64_t n0, int64_t n1) {
      gemm_slice(pr, w, fns, y, int(n0), int(n1));
    });
  }
}

// ------------------------------------------------------------ transposed
//
// dx = dy · W, the gradient wrt x. The forward's pieces are reused: a tile
// of W [nb rows x kc columns] is dequantized by dequant_tile (decode order
// along the columns), transposed to [kc x nb] with each row one true column
// of W, and the forward's micro-kernel runs over it with dy as the
// activation block: its inner dimension is now the nb rows of W. On CPUs
// with AVX-512F a broadcast kernel over the untransposed tile runs instead
// (t_item_bcast, below: faster there). Threads split the K output columns
// (work items of kTKC columns inside one segment), so every dx element has
// one writer and no reduction is needed.

namespace {

// Measured here (1 thread, 4-bit g64, M=256/1024, with the 16-lane dot
// micro-kernel): 64 x 1024 ran at 85-92 GFLOP/s, 128 x 256 at 50-58 (32..256 x 256..2048 tried; chosen by
// measurement, not a cache model). Long rows amortize the micro-kernel's
// horizontal sums; its few rows of dy stay in L1 across the tile's columns.
// Group size 128 widens a tile to 128 columns.
constexpr int kTKC = 64;     // W columns (dx columns) per tile, at least
constexpr int kTKCMax = 128; // ... and at most (the largest group size)
constexpr int kTNB = 1024;   // W rows per tile: the micro-kernel's inner length

// rows 0..7 of an 8x8 block (row stride lds) -> o[c] = column c.
inline void transpose8x8(const float* src, int64_t lds, __m256 o[8]) {
  __m256 t[8], u[8];
  for (int j = 0; j < 8; j += 2) {
    const __m256 a = _mm256_loadu_ps(src + j * lds), b = _mm256_loadu_ps(src + (j + 1) * lds);
    t[j] = _mm256_unpacklo_ps(a, b);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[j + 1] = _mm256_unpackhi_ps(a, b);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int h = 0; h < 8; h += 4) {  // rows 4h'..4h'+3: columns c | c+4
    u[h + 0] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    o[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    o[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}

// tile: [nbp x kc] (row stride kc) in decode order, rows >= nb already
// zero; T: [kc x ldt], T row c = true column c of the tile. Decode position
// 8k+i of a unit holds column 4i+k, so output vector i of the 8x8 block at
// decode positions 8k..8k+7 is stored to T row 4i+k of the unit.
void transpose_tile(const float* tile, int nbp, int kc, float* T, int ldt) {
  __m256 o[8];
  for (int r = 0; r < nbp; r += 8)
    for (int u = 0; u < kc; u += kUnit)
      for (int k = 0; k < 4; ++k) {
        transpose8x8(tile + int64_t(r) * kc + u + 8 * k, kc, o);
        for (int i = 0; i < 8; ++i)
          _mm256_storeu_ps(T + int64_t(u + 4 * i + k) * ldt + r, o[i]);
      }
}

struct TItem {
  int seg, c0, c1;  // segment-local columns, group aligned, c1 - c0 <= kTKCMax
};

// dx columns [s.k0 + c0, s.k0 + c1) for all M rows. dy has row stride ldd
// >= round_up(N, 16) with zeros past N, so the micro-kernel's reads past
// the last W row meet zeros in both operands.
void t_item(const float* dy, int64_t ldd, int M, const QMatView& w,
            const std::vector<SegFns>& fns, const TItem& it, float* dx) {
  const SegView& s = w.segs[it.seg];
  const int N = w.N, K = w.K, kc = it.c1 - it.c0;
  const MicroPick mk = pick_micro();
  thread_local std::vector<float> tile, T;
  tile.resize(size_t(kTNB) * kTKCMax);
  T.resize(size_t(kTKCMax) * kTNB);
  float* out = dx + s.k0 + it.c0;
  for (int m = 0; m < M; ++m) std::fill(out + int64_t(m) * K, out + int64_t(m) * K + kc, 0.0f);
  for (int n0 = 0; n0 < N; n0 += kTNB) {
    const int nb = std::min(kTNB, N - n0), nbp = (nb + 15) / 16 * 16;
    fns[it.seg].dequant(s, w.sdtype, n0, nb, it.c0, it.c1, tile.data(), kc);
    std::fill(tile.data() + int64_t(nb) * kc, tile.data() + int64_t(nbp) * kc, 0.0f);
    transpose_tile(tile.data(), nbp, kc, T.data(), nbp);
    for (int m = 0; m < M; m += mk.mr) {
      const int mr = std::min(mk.mr, M - m);
      for (int j = 0; j < kc; j += mk.nr) {
        const int nr = std::min(mk.nr, kc - j);
        mk.table[mr][nr](dy + int64_t(m) * ldd + n0, int(ldd), T.data() + int64_t(j) * nbp,
                         nbp, nbp, out + int64_t(m) * K + j, K);
      }
    }
  }
}

// The 16-lane version (AVX-512F CPUs) skips the transpose: lanes run along
// dx's columns instead, each dy element is broadcast against a row of the
// tile (still in decode order), and accumulators live across the whole
// tile with no horizontal sums, so a tile can be small enough for L1.
// Measured here, 1 thread: 120-125 GFLOP/s on 1536x576 and 576x1536
// (numpy's sgemm: ~105-120) against 90-95 for the transposed tiles with the
// 16-lane dot micro-kernel; 128 rows per tile beat 64/192/256/512 except on
// 49152x576 (256: ~88 against ~80). The same scheme with 8 lanes (6x2
// registers, 8 loads per 12 FMAs) measured slower than the transposed
// tiles (50-57 against 62-75 GFLOP/s), so AVX2-only CPUs keep those.
constexpr int kBNB = 128;  // W rows per tile of the broadcast kernel

// o[i][0..16*NV) += sum_p dy[i*ldd + p] * t[p*ldt + 0..16*NV) for MR rows.
template <int MR, int NV>
MIXBITS_AVX512 void bcast512(const float* dy, int64_t ldd, const float* t, int ldt,
                             int nb, float* o, int ldo) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int p = 0; p < nb; ++p) {
    __m512 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_ps(t + int64_t(p) * ldt + 16 * j);
    for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(dy[i * ldd + p]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(b, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(o + i * ldo + 16 * j,
                       _mm512_add_ps(_mm512_loadu_ps(o + i * ldo + 16 * j), acc[i][j]));
}

// 6 x 64 (24 accumulators, 4 tile loads and 6 broadcasts per 24 FMAs) and
// 6 x 32 for an item of one 32-column group; fewer rows at the end of M.
using BcastFn = void (*)(const float*, int64_t, const float*, int, int, float*, int);
constexpr int kBMR = 6;
template <int NV>
constexpr BcastFn bcast_rows[kBMR + 1] = {nullptr,         bcast512<1, NV>, bcast512<2, NV>,
                                          bcast512<3, NV>, bcast512<4, NV>, bcast512<5, NV>,
                                          bcast512<6, NV>};

// t_item with the broadcast kernel. dx of the item accumulates in decode
// order in `acc` ([M x kc]) and is re-ordered once at the end.
void t_item_bcast(const float* dy, int64_t ldd, int M, const QMatView& w,
                  const std::vector<SegFns>& fns, const TItem& it, float* dx) {
  const SegView& s = w.segs[it.seg];
  const int N = w.N, K = w.K, kc = it.c1 - it.c0;
  thread_local std::vector<float> tile, acc;
  tile.resize(size_t(kBNB) * kTKCMax);
  acc.assign(size_t(M) * kc, 0.0f);
  for (int n0 = 0; n0 < N; n0 += kBNB) {
    const int nb = std::min(kBNB, N - n0);
    fns[it.seg].dequant(s, w.sdtype, n0, nb, it.c0, it.c1, tile.data(), kc);
    for (int m = 0; m < M; m += kBMR) {
      const int mr = std::min(kBMR, M - m);
      const float* d = dy + int64_t(m) * ldd + n0;
      float* o = acc.data() + int64_t(m) * kc;
      int j = 0;
      for (; j + 64 <= kc; j += 64) bcast_rows<4>[mr](d, ldd, tile.data() + j, kc, nb, o + j, kc);
      if (j < kc) bcast_rows<2>[mr](d, ldd, tile.data() + j, kc, nb, o + j, kc);
    }
  }
  // Decode position 8k+i of a unit holds column 4i+k.
  float* out = dx + s.k0 + it.c0;
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < kc; ++c)
      out[int64_t(m) * K + c] = acc[int64_t(m) * kc + (c & ~31) + 8 * (c & 3) + ((c & 31) >> 2)];
}

}  // namespace

void qmm_t_avx2_run(const float* dy, int M, const QMatView& w, float* dx) {
  const int N = w.N;
  const int64_t ldd = (int64_t(N) + 15) / 16 * 16;
  std::vector<float> padded;
  if (ldd != N) {
    padded.assign(size_t(M) * ldd, 0.0f);
    parallel_for(M, 64, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        std::memcpy(padded.data() + m * ldd, dy + m * N, sizeof(float) * N);
    });
    dy = padded.data();
  }
  std::vector<SegFns> fns;
  std::vector<TItem> items;
  for (size_t si = 0; si < w.segs.size(); ++si) {
    const SegView& s = w.segs[si];
    fns.push_back(seg_fns(s.bits, s.group_size));
    // Items never split a group: dequant_tile works on whole groups.
    const int width = std::max(kTKC, s.group_size);
    for (int c0 = 0; c0 < s.k; c0 += width)
      items.push_back({int(si), c0, std::min(s.k, c0 + width)});
  }
  const bool wide = use_avx512();  // read per call, as the forward does
  parallel_for(int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      (wide ? t_item_bcast : t_item)(dy, ldd, M, w, fns, items[i], dx);
  });
}

}  // namespace mixbits
