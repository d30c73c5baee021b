// Forward GEMM for large M (prefill), BLIS-style: a tile of W (rows x kc
// columns) is dequantized and packed into column panels that stay in L2,
// x is packed once per call into row micro-panels that stay in L1, and an
// outer-product micro-kernel runs over them.
//
// Why outer products (lanes along N) rather than the dot-product kernel of
// avx2_gemm.cpp (lanes along K): no horizontal sums at the end of every kc
// block (they cost 10-15% at kc = 256-512), and the store of a block of y
// is a plain vector add. The price is a transpose when W is packed, paid
// once per weight and amortized over all M rows (M > 40).
//
// Both rows have one: 16-lane panels of 48 W rows against 8 x rows
// (24 zmm accumulators), and 8-lane panels of 16 W rows against 6 x rows
// (12 of AVX2's 16 ymm registers, the shape of BLIS's Haswell sgemm). The
// AVX2 row had the dot-product tiles of avx2_gemm.cpp here before; the
// panels run at their speed and read repacked weights in place
// (avx2_panel_r.cpp), where the tiles had to un-repack W on every call.
//
// Layouts (p: column within the kc block, in decode order, see
// avx2_decode.h; x is packed in the same order, so the sum is unchanged):
//  - W panel: [kc][pw] floats, lane j = W row (panel start + j); rows past
//    the tile are zeros.
//  - x micro-panel: [kc][mr] floats, x rows m..m+mr; rows past M are zeros.
// Each y element is a sequential FMA chain over p inside a kc block, added
// to y once per block: the same order wherever the element falls in the
// tiling, so results do not depend on the thread count.
#include <algorithm>

#include "qmatmul/avx2_decode.h"
#include "qmatmul/avx2_table.h"

namespace mixbits {
namespace {

// ------------------------------------------------------------ packing W

// 16x16 transpose, the same idea with 128-bit lane shuffles at the end.
MIXBITS_AVX512 inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i+k], 128-bit lane L: rows 4i..4i+3 at column 4L+k.
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

// Dequantizes rows [n+r0, n+r0+L) (zeros past nr) of the tile into the
// L1 scratch scr (L rows of kPKC floats), row-major.
template <int L>
inline void dequant_rows(const SegView& s, DType sdt, DequantFn dq, int n, int nr,
                         int r0, int c0, int c1, float* scr) {
  const int rows = std::max(0, std::min(L, nr - r0));
  if (rows > 0) dq(s, sdt, n + r0, rows, c0, c1, scr, kPKC);
  for (int r = rows; r < L; ++r)
    for (int p = 0; p < c1 - c0; ++p) scr[r * kPKC + p] = 0.0f;
}

// Rows [n, n+nr) x columns [c0, c1) of a segment into panels of pw rows
// (dst: ceil(nr/pw) panels of kc*pw floats, 64-byte aligned): 16 rows at a
// time are dequantized row-major into an L1 scratch, then transposed.
MIXBITS_AVX512 void pack_w16(const SegView& s, DType sdt, DequantFn dq, int n, int nr,
                             int c0, int c1, float* dst, int pw) {
  const int kc = c1 - c0;
  alignas(64) float scr[16 * kPKC];
  const int nrp = (nr + pw - 1) / pw * pw;
  for (int r0 = 0; r0 < nrp; r0 += 16) {
    dequant_rows<16>(s, sdt, dq, n, nr, r0, c0, c1, scr);
    float* panel = dst + int64_t(r0 / pw) * kc * pw + r0 % pw;
    for (int p = 0; p < kc; p += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_load_ps(scr + i * kPKC + p);
      transpose16(v);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(panel + (p + i) * pw, v[i]);
    }
  }
}

// 8x8 transpose of AVX2 registers: r[i] lane j becomes r[j] lane i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i+k], 128-bit lane L: rows 4i..4i+3 at column 4L+k.
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// pack_w16's 8-lane twin: 8 rows at a time dequantized row-major into an
// L1 scratch, then transposed into the panels (dst 64-byte aligned, pw a
// multiple of 8, so every store is aligned).
void pack_w8(const SegView& s, DType sdt, DequantFn dq, int n, int nr, int c0, int c1,
             float* dst, int pw) {
  const int kc = c1 - c0;
  alignas(32) float scr[8 * kPKC];
  const int nrp = (nr + pw - 1) / pw * pw;
  for (int r0 = 0; r0 < nrp; r0 += 8) {
    dequant_rows<8>(s, sdt, dq, n, nr, r0, c0, c1, scr);
    float* panel = dst + int64_t(r0 / pw) * kc * pw + r0 % pw;
    for (int p = 0; p < kc; p += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_load_ps(scr + i * kPKC + p);
      transpose8(v);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(panel + (p + i) * pw, v[i]);
    }
  }
}

// ------------------------------------------------------------ micro-kernels

// y[i, j] += sum_p xp[p*MR + i] * wp[p*pw + j] for i < mr, j < nc, with
// pw = NR*16: MR broadcasts of x and NR loads of W per MR*NR FMAs; MR*NR
// accumulators (<= 28 of the 32 zmm registers).
template <int MR, int NR>
MIXBITS_AVX512 void panel512(const float* xp, const float* wp, int kc, float* y, int ldy,
                             int mr, int nc) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int p = 0; p < kc; ++p) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_load_ps(wp + j * 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_set1_ps(xp[i]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);
    }
    wp += NR * 16;
    xp += MR;
  }
  for (int j = 0; j < NR; ++j) {
    const int left = nc - j * 16;
    if (left <= 0) break;
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    for (int i = 0; i < MR; ++i) {
      if (i >= mr) break;
      float* yp = y + int64_t(i) * ldy + j * 16;
      _mm512_mask_storeu_ps(yp, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, yp), acc[i][j]));
    }
  }
}

// panel512's 8-lane twin for 6 x rows and pw = 16: 12 accumulators of
// AVX2's 16 ymm registers, the same FMA chain per y element. Named, not
// an array: GCC kept an __m256 acc[6][2] in memory (a store of every
// accumulator on every step, 0.7x the speed).
void panel256_6x2(const float* xp, const float* wp, int kc, float* y, int ldy, int mr,
                  int nc) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int p = 0; p < kc; ++p) {
    const __m256 w0 = _mm256_load_ps(wp), w1 = _mm256_load_ps(wp + 8);
    __m256 xb = _mm256_broadcast_ss(xp);
    a00 = _mm256_fmadd_ps(xb, w0, a00);
    a01 = _mm256_fmadd_ps(xb, w1, a01);
    xb = _mm256_broadcast_ss(xp + 1);
    a10 = _mm256_fmadd_ps(xb, w0, a10);
    a11 = _mm256_fmadd_ps(xb, w1, a11);
    xb = _mm256_broadcast_ss(xp + 2);
    a20 = _mm256_fmadd_ps(xb, w0, a20);
    a21 = _mm256_fmadd_ps(xb, w1, a21);
    xb = _mm256_broadcast_ss(xp + 3);
    a30 = _mm256_fmadd_ps(xb, w0, a30);
    a31 = _mm256_fmadd_ps(xb, w1, a31);
    xb = _mm256_broadcast_ss(xp + 4);
    a40 = _mm256_fmadd_ps(xb, w0, a40);
    a41 = _mm256_fmadd_ps(xb, w1, a41);
    xb = _mm256_broadcast_ss(xp + 5);
    a50 = _mm256_fmadd_ps(xb, w0, a50);
    a51 = _mm256_fmadd_ps(xb, w1, a51);
    wp += 16;
    xp += 6;
  }
  // y += the block, rows < mr and columns < nc only (past them: padding).
  alignas(32) float out[6][16];
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int i = 0; i < 6; ++i) {
    _mm256_store_ps(out[i], acc[i][0]);
    _mm256_store_ps(out[i] + 8, acc[i][1]);
  }
  for (int i = 0; i < mr; ++i) {
    float* yp = y + int64_t(i) * ldy;
    if (nc == 16) {
      _mm256_storeu_ps(yp, _mm256_add_ps(_mm256_loadu_ps(yp), _mm256_load_ps(out[i])));
      _mm256_storeu_ps(yp + 8, _mm256_add_ps(_mm256_loadu_ps(yp + 8), _mm256_load_ps(out[i] + 8)));
    } else {
      for (int c = 0; c < nc; ++c) yp[c] += out[i][c];
    }
  }
}

}  // namespace

extern const GemmRow kGemmAvx2 = {/*lanes=*/8, /*mr=*/6, /*pw=*/16, pack_w8, panel256_6x2,
                                  &kPackRepacked256};
extern const GemmRow kGemmAvx512 = {/*lanes=*/16, /*mr=*/8, /*pw=*/48, pack_w16,
                                    panel512<8, 3>, &kPackRepacked512};

}  // namespace mixbits
