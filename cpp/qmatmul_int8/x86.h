// x86 kernels of the integer-activation contracts, written once over a dot
// policy `D` and included by avx2.cpp (maddubs + madd; madd on 16-bit
// codes) and vnni.cpp (vpdpbusd; vpdpwssd). Weight codes are decoded 32 at
// a time (a unit; every group size is a multiple of 32) into 32 unsigned
// bytes, in the order x86_int8_col gives; the activations were put in the
// same order once per call, so a unit is one integer dot of 32 code pairs
// (int8: bytes into 8 int32 lanes; int16: widened to 16-bit pairs).
// Per group: one int->float convert and one FMA with s_g*d_g per (W row,
// x row); the bias term is sum_g b_g * (d_g * ix_g), a float dot per row.
//
// Include after <immintrin.h> under the target the including file needs.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "common/x86_prefetch.h"
#include "qmatmul_int8/table.h"

namespace mixbits {
// Internal linkage: each including file gets its own copy compiled for its
// target, never merged by the linker with another file's.
namespace {

// ------------------------------------------------------------ decode

// Shuffle and multiplier constants of the 3/5/6-bit decoder: code j of a
// unit sits at bit j*B; its 16-bit window (bytes b, b+1 of the loaded lane)
// times 2^(16-B-sh) puts the code in the top B bits, a shift brings it down.
// Vector A holds codes 0..7 | 16..23, vector B codes 8..15 | 24..31, so
// packus(A, B) gives the 32 codes in natural order.
constexpr int hi_off(int B) { return B == 6 ? 8 : 4; }  // byte of the high load

template <int B>
struct Dec16 {
  alignas(32) int8_t ctrl[2][32];
  alignas(32) int16_t mul[2][16];
  constexpr Dec16() : ctrl(), mul() {
    for (int v = 0; v < 2; ++v)
      for (int t = 0; t < 16; ++t) {
        const int lane = t / 8;
        const int j = lane * 16 + v * 8 + (t % 8);
        const int o = j * B, sh = o & 7;
        const int b = (o >> 3) - (lane ? hi_off(B) : 0);
        ctrl[v][2 * t] = int8_t(b);
        ctrl[v][2 * t + 1] = int8_t(sh + B > 8 ? b + 1 : -1);
        mul[v][t] = int16_t(1 << (16 - B - sh));
      }
  }
};

template <int B>
inline __m256i decode(const uint8_t* p) {
  if constexpr (B == 2) {
    int64_t t;
    std::memcpy(&t, p, 8);
    const __m256i v = _mm256_srlv_epi64(_mm256_set1_epi64x(t), _mm256_setr_epi64x(0, 2, 4, 6));
    return _mm256_and_si256(v, _mm256_set1_epi8(3));
  } else if constexpr (B == 4) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
  } else if constexpr (B == 8) {
    return _mm256_loadu_si256((const __m256i*)p);
  } else {
    static constexpr Dec16<B> k{};
    // Two loads that stay inside the unit's 4B bytes (as the float decoder).
    const __m128i lo = B == 3 ? _mm_loadl_epi64((const __m128i*)p) : _mm_loadu_si128((const __m128i*)p);
    const __m128i hi = B == 3 ? _mm_loadl_epi64((const __m128i*)(p + hi_off(B)))
                              : _mm_loadu_si128((const __m128i*)(p + hi_off(B)));
    const __m256i v = _mm256_set_m128i(hi, lo);
    __m256i a = _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i*)k.ctrl[0]));
    __m256i b = _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i*)k.ctrl[1]));
    a = _mm256_srli_epi16(_mm256_mullo_epi16(a, _mm256_load_si256((const __m256i*)k.mul[0])), 16 - B);
    b = _mm256_srli_epi16(_mm256_mullo_epi16(b, _mm256_load_si256((const __m256i*)k.mul[1])), 16 - B);
    return _mm256_packus_epi16(a, b);
  }
}

// ------------------------------------------------------------ helpers

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// n scales or biases from element `off`, as float32.
inline void to_f32(const void* src, int64_t off, int n, DType t, float* dst) {
  if (t == DType::f32) {
    std::memcpy(dst, static_cast<const float*>(src) + off, sizeof(float) * n);
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(src) + off;
  int i = 0;
  if (t == DType::f16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + i))));
    // The tail (n % 8 values) one at a time with F16C's scalar convert: a
    // padded vector here cost two libc memcpy calls per call (~7% of a
    // 576x576 GEMV, which converts 18 groups per row).
    for (; i < n; ++i) dst[i] = _cvtsh_ss(p[i]);
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    for (; i < n; ++i) {
      const uint32_t u = uint32_t(p[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
  }
}

// 8x8 transpose of 32-bit elements: t[q] lane r = v[r] lane q.
inline void transpose8_epi32(const __m256i v[8], __m256i t[8]) {
  __m256i a[8], b[8];
  for (int i = 0; i < 4; ++i) {  // pairs of rows: lanes (q, q+1 | q+4, q+5) interleaved
    a[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)  // quads of rows: one column per 128-bit half
    for (int h = 0; h < 2; ++h) {
      b[4 * i + 2 * h] = _mm256_unpacklo_epi64(a[4 * i + h], a[4 * i + 2 + h]);
      b[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(a[4 * i + h], a[4 * i + 2 + h]);
    }
  for (int q = 0; q < 4; ++q) {  // b[q]: rows 0-3, b[4 + q]: rows 4-7 of columns q | q + 4
    t[q] = _mm256_permute2x128_si256(b[q], b[4 + q], 0x20);
    t[q + 4] = _mm256_permute2x128_si256(b[q], b[4 + q], 0x31);
  }
}

inline float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ------------------------------------------------------------ dot policies

// What the 256-bit policies share: 8 int32 lanes per unit, 8 float lanes
// across groups. A policy D adds Code, XV, load_x, kMaxMB,
// rows_per_pass<MB>() and dot<B>(acc, decoded codes, activations).
struct Lanes256 {
  // Whether dot's int32 lane j sums exactly code bytes 4j..4j+3 times
  // activation bytes 4j..4j+3 (true for vpdpbusd), which rows8 needs.
  static constexpr bool kRowLanes = false;
  using Acc = __m256i;
  using F = __m256;
  static Acc zero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  // acc + float(a) * s: a group's integer dot into the float sum.
  static F fma(Acc a, float s, F acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(s), acc);
  }
  static float fsum(F v) { return hsum(v); }
};

// Byte activation codes, 32 per unit.
struct Int8Lanes256 : Lanes256 {
  using Code = int8_t;
  using XV = __m256i;
  static XV load_x(const Code* p) { return _mm256_loadu_si256((const __m256i*)p); }
};

// ------------------------------------------------------------ rows

// Rows [n0, n1) (a multiple of R) against MB activation rows. R*MB integer
// accumulators per group and as many float ones across groups.
template <int B, int G, int MB, int R, class D>
void rows(const I8Seg& s, const I8X& x, int n0, int n1, float* y, int ldy, float* scratch) {
  using Code = typename D::Code;
  const Code* xq = static_cast<const Code*>(x.xq);
  const int ng = s.ngroups;
  float* sc = scratch;
  float* bi = scratch + R * ng;
  for (int n = n0; n < n1; n += R) {
    const uint8_t* rowp[R];
    for (int r = 0; r < R; ++r) rowp[r] = s.wq + int64_t(n + r) * s.row_bytes;
    to_f32(s.scales, int64_t(n) * ng, R * ng, s.sdt, sc);  // R rows are contiguous
    to_f32(s.biases, int64_t(n) * ng, R * ng, s.sdt, bi);
    typename D::F accf[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) accf[r][m] = D::fzero();
    for (int g = 0; g < ng; ++g) {
      typename D::Acc acci[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acci[r][m] = D::zero();
#pragma GCC unroll 4
      for (int u = 0; u < G / 32; ++u) {
        const int c = g * G + u * 32;
        typename D::XV xv[MB];
        for (int m = 0; m < MB; ++m) xv[m] = D::load_x(xq + int64_t(m) * x.ldx + c);
        for (int r = 0; r < R; ++r) {
          prefetch_row_unit<B>(rowp[r] + c * B / 8);
          const __m256i wv = decode<B>(rowp[r] + c * B / 8);
          for (int m = 0; m < MB; ++m) acci[r][m] = D::template dot<B>(acci[r][m], wv, xv[m]);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const float dm = x.d[int64_t(m) * x.ldg + g];
        for (int r = 0; r < R; ++r) accf[r][m] = D::fma(acci[r][m], sc[r * ng + g] * dm, accf[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m)
        y[int64_t(m) * ldy + n + r] +=
            D::fsum(accf[r][m]) + dot(bi + r * ng, x.xs + int64_t(m) * x.ldg, ng);
  }
}

// Rows [n0, n1) (a multiple of 8) against MB activation rows, with vector
// lanes along W rows instead of columns: the 8 rows' decoded units are
// transposed so that lane r of vector q holds row r's codes 4q..4q+3, and
// each x quad is broadcast to all lanes. The per-group epilogue (convert,
// scale, bias) then runs once per 8 rows instead of once per row, and no
// horizontal sums remain: at MB >= 2 that epilogue is what limits rows().
// Only for policies whose dot keeps 4-byte lanes (D::kRowLanes).
template <int B, int G, int MB, class D>
void rows8(const I8Seg& s, const I8X& x, int n0, int n1, float* y, int ldy, float* scratch) {
  constexpr int A = MB <= 4 ? 2 : 1;  // accumulator sets: hide vpdpbusd latency at small MB
  const int8_t* xq = static_cast<const int8_t*>(x.xq);
  const int ng = s.ngroups;
  float* sc = scratch;             // [8][ng] as stored
  float* bi = scratch + 8 * ng;
  float* sct = scratch + 16 * ng;  // [ng][8]: one vector per group
  float* bit = scratch + 24 * ng;
  for (int n = n0; n < n1; n += 8) {
    const uint8_t* rowp[8];
    for (int r = 0; r < 8; ++r) rowp[r] = s.wq + int64_t(n + r) * s.row_bytes;
    to_f32(s.scales, int64_t(n) * ng, 8 * ng, s.sdt, sc);
    to_f32(s.biases, int64_t(n) * ng, 8 * ng, s.sdt, bi);
    for (int g = 0; g < ng; ++g)
      for (int r = 0; r < 8; ++r) {
        sct[g * 8 + r] = sc[r * ng + g];
        bit[g * 8 + r] = bi[r * ng + g];
      }
    __m256 accf[MB];
    for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      __m256i acci[A][MB];
      for (int a = 0; a < A; ++a)
        for (int m = 0; m < MB; ++m) acci[a][m] = _mm256_setzero_si256();
      for (int u = 0; u < G / 32; ++u) {
        const int c = g * G + u * 32;
        __m256i w[8], t[8];
        for (int r = 0; r < 8; ++r) w[r] = decode<B>(rowp[r] + c * B / 8);
        transpose8_epi32(w, t);
        for (int q = 0; q < 8; ++q)
          for (int m = 0; m < MB; ++m) {
            int32_t quad;
            std::memcpy(&quad, xq + int64_t(m) * x.ldx + c + 4 * q, 4);
            acci[q % A][m] = D::template dot<B>(acci[q % A][m], t[q], _mm256_set1_epi32(quad));
          }
      }
      const __m256 s8 = _mm256_loadu_ps(sct + g * 8), b8 = _mm256_loadu_ps(bit + g * 8);
      for (int m = 0; m < MB; ++m) {
        __m256i iq = acci[0][m];
        if constexpr (A > 1) iq = _mm256_add_epi32(iq, acci[1][m]);
        const __m256 sd = _mm256_mul_ps(s8, _mm256_set1_ps(x.d[int64_t(m) * x.ldg + g]));
        accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iq), sd, accf[m]);
        accf[m] = _mm256_fmadd_ps(b8, _mm256_set1_ps(x.xs[int64_t(m) * x.ldg + g]), accf[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      float* yp = y + int64_t(m) * ldy + n;
      _mm256_storeu_ps(yp, _mm256_add_ps(_mm256_loadu_ps(yp), accf[m]));
    }
  }
}

template <int B, int G, int MB, class D>
void rows_mb(const I8Seg& s, const I8X& x, int n0, int n1, float* y, int ldy, float* scratch) {
  if constexpr (D::kRowLanes && MB >= kRows8MinMB) {
    // The caller hands out row ranges aligned to 8 (dispatch.cpp), so which
    // rows take the tail kernel depends on N only, never on the threads.
    const int n8 = n0 + (n1 - n0) / 8 * 8;
    rows8<B, G, MB, D>(s, x, n0, n8, y, ldy, scratch);
    if (n8 < n1) rows<B, G, MB, 1, D>(s, x, n8, n1, y, ldy, scratch);
    return;
  }
  constexpr int R = D::template rows_per_pass<MB>();
  const int nfull = n0 + (n1 - n0) / R * R;
  rows<B, G, MB, R, D>(s, x, n0, nfull, y, ldy, scratch);
  if (nfull < n1) rows<B, G, MB, 1, D>(s, x, nfull, n1, y, ldy, scratch);
}

template <int B, int G, class D>
void seg_kernel(const I8Seg& s, const I8X& x, int mb, int n0, int n1, float* y, int ldy,
                float* scratch) {
  switch (mb) {
    case 1: return rows_mb<B, G, 1, D>(s, x, n0, n1, y, ldy, scratch);
    case 2: return rows_mb<B, G, 2, D>(s, x, n0, n1, y, ldy, scratch);
    case 3: return rows_mb<B, G, 3, D>(s, x, n0, n1, y, ldy, scratch);
    case 4: return rows_mb<B, G, 4, D>(s, x, n0, n1, y, ldy, scratch);
  }
  if constexpr (D::kMaxMB > 4) {
    switch (mb) {
      case 5: return rows_mb<B, G, 5, D>(s, x, n0, n1, y, ldy, scratch);
      case 6: return rows_mb<B, G, 6, D>(s, x, n0, n1, y, ldy, scratch);
      case 7: return rows_mb<B, G, 7, D>(s, x, n0, n1, y, ldy, scratch);
      case 8: return rows_mb<B, G, 8, D>(s, x, n0, n1, y, ldy, scratch);
    }
  }
}

template <class D>
constexpr I8Table make_table(const char* name) {
  I8Table t{name, D::kMaxMB, {}};
#define MIXBITS_I8_ROW(B) \
  t.fn[B][0] = seg_kernel<B, 32, D>; t.fn[B][1] = seg_kernel<B, 64, D>; t.fn[B][2] = seg_kernel<B, 128, D>;
  MIXBITS_I8_ROW(2) MIXBITS_I8_ROW(3) MIXBITS_I8_ROW(4)
  MIXBITS_I8_ROW(5) MIXBITS_I8_ROW(6) MIXBITS_I8_ROW(8)
#undef MIXBITS_I8_ROW
  return t;
}

}  // namespace
}  // namespace mixbits
