// The forward GEMM's W panels (avx2_panel.cpp) packed straight from the
// row-interleaved layout of qmatmul_int8/repack.h, so that a repacked
// layer's prefill (the float contract, calls above the small-M kernels'
// rows) reads its weight as stored instead of un-repacking all of it into
// MLX's layout on every call.
//
// Why no transpose: a repacked block is 16 W rows with word j of all 16 in
// one 64-byte line, so one load and a shift and a mask per code give the
// code of one column for the 16 rows, lane r = row r: already one row of a
// panel ([kc][pw], lane = W row). pack_w16 dequantizes 16 rows of MLX's
// layout row-major instead and transposes them.
//
// Both rows: the 16-lane packers take a block as one register, the 8-lane
// ones (AVX2) as two halves of 8 rows, each 32 bytes of the block's line.
//
// Bit for bit the panels pack_w16 (pack_w8) builds from MLX's layout, so the result
// is bit for bit the original layout's (same micro-kernel, same FMA order):
//  - the same value per (row, column): fma(q, s, b), rounded once.
//    dequant_tile computes fma(q*2^e, s*2^-e, b): the same exact product
//    (the powers of two cancel while s*2^-e is a normal float, i.e. for
//    |s| >= 2^-110), the same single rounding;
//  - the same panel row per column: column 4i+k of a 32-column unit goes to
//    row 8k+i, the decode order x is packed in (avx2_decode.h).
#include <algorithm>
#include <cstdint>

#include "qmatmul/avx2_decode.h"
#include "qmatmul/avx2_table.h"
#include "qmatmul_int8/repack.h"
#include "common/x86_half.h"

// The scale loader the VNNI GEMV uses too, compiled for MIXBITS_AVX512's
// target so the packers below can inline it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include "qmatmul_int8/x86_load16.h"
#pragma GCC pop_options

namespace mixbits {
namespace {

static_assert(kRepackRows == 16, "a block is one register of float lanes");

// Panel row of column c of a unit-aligned run of columns (decode order).
constexpr int decode_pos(int c) { return (c & ~31) | ((c & 3) << 3) | ((c >> 2) & 7); }

// One panel row: 16 codes dequantized, s*q + b with one rounding.
MIXBITS_AVX512 inline void put(__m512i q, __m512 sv, __m512 bv, float* row) {
  _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sv, bv));
}

// One group of G columns of a 2-, 4- or 8-bit block: wq at the group's
// first word (16 rows each), dst at the panel row of its first column.
// Word j holds columns j*CPW + t at bits t*B (MLX's words, unchanged).
template <int B, int G>
MIXBITS_AVX512 inline void group_words(const uint32_t* wq, __m512 sv, __m512 bv, float* dst,
                                       int pw) {
  constexpr int CPW = 32 / B;
  const __m512i mask = _mm512_set1_epi32((1 << B) - 1);
  for (int j = 0; j < G / CPW; ++j) {
    const __m512i v = _mm512_loadu_si512(wq + j * kRepackRows);
#pragma GCC unroll 16
    for (int t = 0; t < CPW; ++t)
      put(_mm512_and_si512(_mm512_srli_epi32(v, t * B), mask), sv, bv,
          dst + int64_t(decode_pos(j * CPW + t)) * pw);
  }
}

// The same for the split layouts (3, 5, 6 bits; repack.h): per chunk of 32
// codes B words, LB low-plane words (LB-bit codes, CW per word, code i of
// a word at bits LB*i) then B - LB high-plane words (the bits above LB of
// code c at split_hpos(B, c) of word split_hword(B, c)).
template <int B, int G>
MIXBITS_AVX512 inline void group_split(const uint32_t* wq, __m512 sv, __m512 bv, float* dst,
                                       int pw) {
  constexpr int LB = split_low_bits(B), HB = B - LB, CW = 32 / LB;
  const __m512i mlo = _mm512_set1_epi32((1 << LB) - 1);
  const __m512i mhi = _mm512_set1_epi32(((1 << HB) - 1) << LB);
  for (int ch = 0; ch < G / 32; ++ch) {
    const uint32_t* w = wq + ch * B * kRepackRows;
    __m512i lw[LB], hw[HB];
    for (int i = 0; i < LB; ++i) lw[i] = _mm512_loadu_si512(w + i * kRepackRows);
    for (int i = 0; i < HB; ++i) hw[i] = _mm512_loadu_si512(w + (LB + i) * kRepackRows);
#pragma GCC unroll 32
    for (int c = 0; c < 32; ++c) {
      // The high bits moved from split_hpos(B, c) to bit LB (either way).
      const int sh = split_hpos(B, c) - LB;
      const __m512i h = hw[split_hword(B, c)];
      const __m512i hi =
          _mm512_and_si512(sh >= 0 ? _mm512_srli_epi32(h, sh) : _mm512_slli_epi32(h, -sh), mhi);
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(lw[c / CW], LB * (c % CW)), mlo);
      put(_mm512_or_si512(lo, hi), sv, bv, dst + int64_t(ch * 32 + decode_pos(c)) * pw);
    }
  }
}

// The walk both widths' packers share (plain code: it inlines into either
// target). Rows [n, n+nr) x columns [c0, c1) into panels of pw rows, [kc][pw]
// each, as pack_w16 and pack_w8 lay them out: for each group of each
// 16-row block, group(at, wq, pg) with the block's scale/bias offset, its
// first word and the panel row of its first column. n and pw are multiples
// of 16 (the driver's panel slices), so each 16 lanes of a panel are
// exactly one block; blocks wholly past nr are zeros, as pack_w* writes
// them (a block's own padding rows hold zero codes, scales and biases:
// zeros too). The micro-kernel stores only nr rows.
template <int B, int G, class Group>
inline void walk_blocks(const SegView& s, int n, int nr, int c0, int c1, float* dst, int pw,
                        const Group& group) {
  const int kc = c1 - c0;
  const int64_t words = s.words_per_row(), ng = s.k / G;
  const int nrp = (nr + pw - 1) / pw * pw;
  for (int r0 = 0; r0 < nrp; r0 += kRepackRows) {
    float* panel = dst + int64_t(r0 / pw) * kc * pw + r0 % pw;
    if (r0 >= nr) {
      for (int p = 0; p < kc; ++p) std::fill_n(panel + int64_t(p) * pw, kRepackRows, 0.0f);
      continue;
    }
    const int64_t b = (n + r0) / kRepackRows;
    for (int g = c0 / G; g < c1 / G; ++g)
      group((b * ng + g) * kRepackRows,
            s.wq + (b * words + int64_t(g) * G * B / 32) * kRepackRows,
            panel + int64_t(g * G - c0) * pw);  // g*G - c0: a multiple of 32
  }
}

// One group of one block, 16 lanes. Scalar arguments only: it is called
// from walk_blocks' lambda, which does not carry pack_r16's target.
template <int B, int G>
MIXBITS_AVX512 void group16(const SegView& s, DType sdt, int64_t at, const uint32_t* wq,
                            float* pg, int pw) {
  const __m512 sv = load16_f32(s.scales, at, sdt), bv = load16_f32(s.biases, at, sdt);
  if constexpr (repack_splits(B))
    group_split<B, G>(wq, sv, bv, pg, pw);
  else
    group_words<B, G>(wq, sv, bv, pg, pw);
}

// PackWFn for a repacked segment (dq unused), 16 lanes.
template <int B, int G>
MIXBITS_AVX512 void pack_r16(const SegView& s, DType sdt, DequantFn, int n, int nr, int c0,
                             int c1, float* dst, int pw) {
  walk_blocks<B, G>(s, n, nr, c0, c1, dst, pw, [&](int64_t at, const uint32_t* wq, float* pg) {
    group16<B, G>(s, sdt, at, wq, pg, pw);
  });
}

template <int B>
constexpr PackWFn pack_col[3] = {pack_r16<B, 32>, pack_r16<B, 64>, pack_r16<B, 128>};

// ------------------------------------------------------------ 8 lanes (AVX2)

// put, group_words and group_split for one 8-row half of a block: wq at
// the half's first word, dst at its first lane of the panel row.
inline void put8(__m256i q, __m256 sv, __m256 bv, float* row) {
  _mm256_store_ps(row, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sv, bv));
}

template <int B, int G>
inline void group_words8(const uint32_t* wq, __m256 sv, __m256 bv, float* dst, int pw) {
  constexpr int CPW = 32 / B;
  const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
  for (int j = 0; j < G / CPW; ++j) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(wq + j * kRepackRows));
#pragma GCC unroll 16
    for (int t = 0; t < CPW; ++t)
      put8(_mm256_and_si256(_mm256_srli_epi32(v, t * B), mask), sv, bv,
           dst + int64_t(decode_pos(j * CPW + t)) * pw);
  }
}

template <int B, int G>
inline void group_split8(const uint32_t* wq, __m256 sv, __m256 bv, float* dst, int pw) {
  constexpr int LB = split_low_bits(B), HB = B - LB, CW = 32 / LB;
  const __m256i mlo = _mm256_set1_epi32((1 << LB) - 1);
  const __m256i mhi = _mm256_set1_epi32(((1 << HB) - 1) << LB);
  for (int ch = 0; ch < G / 32; ++ch) {
    const uint32_t* w = wq + ch * B * kRepackRows;
    __m256i lw[LB], hw[HB];
    for (int i = 0; i < LB; ++i) lw[i] = _mm256_loadu_si256((const __m256i*)(w + i * kRepackRows));
    for (int i = 0; i < HB; ++i)
      hw[i] = _mm256_loadu_si256((const __m256i*)(w + (LB + i) * kRepackRows));
#pragma GCC unroll 32
    for (int c = 0; c < 32; ++c) {
      const int sh = split_hpos(B, c) - LB;
      const __m256i h = hw[split_hword(B, c)];
      const __m256i hi =
          _mm256_and_si256(sh >= 0 ? _mm256_srli_epi32(h, sh) : _mm256_slli_epi32(h, -sh), mhi);
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(lw[c / CW], LB * (c % CW)), mlo);
      put8(_mm256_or_si256(lo, hi), sv, bv, dst + int64_t(ch * 32 + decode_pos(c)) * pw);
    }
  }
}

// The same, 8 lanes: a block's 16 rows are two halves of one panel row.
template <int B, int G>
void pack_r8(const SegView& s, DType sdt, DequantFn, int n, int nr, int c0, int c1, float* dst,
             int pw) {
  walk_blocks<B, G>(s, n, nr, c0, c1, dst, pw, [&](int64_t at, const uint32_t* wq, float* pg) {
    for (int h = 0; h < kRepackRows; h += 8) {
      const __m256 sv = load8_f32(s.scales, at + h, sdt), bv = load8_f32(s.biases, at + h, sdt);
      if constexpr (repack_splits(B))
        group_split8<B, G>(wq + h, sv, bv, pg + h, pw);
      else
        group_words8<B, G>(wq + h, sv, bv, pg + h, pw);
    }
  });
}

template <int B>
constexpr PackWFn pack8_col[3] = {pack_r8<B, 32>, pack_r8<B, 64>, pack_r8<B, 128>};

}  // namespace

// Every width the repacked layout has (repack_supports_bits).
extern const PackWCols kPackRepacked512 = {
    {}, {}, {pack_col<2>[0], pack_col<2>[1], pack_col<2>[2]},
    {pack_col<3>[0], pack_col<3>[1], pack_col<3>[2]},
    {pack_col<4>[0], pack_col<4>[1], pack_col<4>[2]},
    {pack_col<5>[0], pack_col<5>[1], pack_col<5>[2]},
    {pack_col<6>[0], pack_col<6>[1], pack_col<6>[2]},
    {}, {pack_col<8>[0], pack_col<8>[1], pack_col<8>[2]}};

extern const PackWCols kPackRepacked256 = {
    {}, {}, {pack8_col<2>[0], pack8_col<2>[1], pack8_col<2>[2]},
    {pack8_col<3>[0], pack8_col<3>[1], pack8_col<3>[2]},
    {pack8_col<4>[0], pack8_col<4>[1], pack8_col<4>[2]},
    {pack8_col<5>[0], pack8_col<5>[1], pack8_col<5>[2]},
    {pack8_col<6>[0], pack8_col<6>[1], pack8_col<6>[2]},
    {}, {pack8_col<8>[0], pack8_col<8>[1], pack8_col<8>[2]}};

}  // namespace mixbits
