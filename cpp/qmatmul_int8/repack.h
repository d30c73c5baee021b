// Row-interleaved ("repacked") storage of a quantized segment, for the
// batch-1 integer-activation GEMV (issue 16): built once per layer, read by
// repacked_vnni.cpp's, avx2_repacked.cpp's and neon_repacked.cpp's kernels
// with W rows in vector lanes and no transpose.
//
// Layout, per segment (N rows, `words` uint32 per row, `ng` groups per row),
// with R = kRepackRows rows per block and NB = ceil(N / R) blocks:
//   wq_r     uint32 [NB, words, R]: wq_r[b, j, r] = wq[b*R + r, j]
//   scales_r        [NB, ng, R]     (the scales' dtype): likewise per group
//   biases_r        [NB, ng, R]
// so one 64-byte load gives word j of 16 rows, and one vector load gives the
// 16 rows' scales of a group. Rows b*R + r >= N (the last block's padding)
// hold zeros: zero codes, scales and biases give y = 0 there, and the
// kernels store only the N real rows. Padding costs (NB*R - N) rows of
// codes, scales and biases; nothing when R divides N (every shape of a
// Llama/Qwen layer).
//
// 2, 4, 8 bits: codes never straddle a 32-bit word; the kernel gets a code
// with one shift and one mask per word, and wq_r holds MLX's words as they
// are. 3 bits: MLX's bitstream (32 codes per 3 words, LSB first, codes
// straddling words) is rewritten per row and per chunk of 32 codes into 3
// words (split3; merge3 is the exact inverse, so the memory is the same)
// before the interleave:
//   word 0 (L0): low 2 bits of codes 0..15, code i at bits 2i (MLX's 2-bit
//                layout, read by the 2-bit kernel's shift and mask)
//   word 1 (L1): the same for codes 16..31
//   word 2 (H):  bit 2 of every code, code h*16 + 4p + k (h = 0, 1;
//                p, k = 0..3) at bit 8p + (2 + 4h + k) % 8 (split3_hpos)
// so, for either activation width, one shift of H and & of bit 2 of each
// lane element gives the high bits of exactly the codes a shift of L0 / L1
// gave (split3_hshift below), and code = low | high.
// 5 and 6 bits are refused by the builder (python: ValueError).
//
// Plain data only (like table.h): repacked_vnni.cpp includes it under a
// target pragma.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/half.h"

namespace mixbits {

// 16 int32 lanes of a 512-bit vector: one lane per W row. Fixed for every
// CPU (the layout is a storage format; a 256-bit kernel would take two
// halves of a block).
constexpr int kRepackRows = 16;

// Blocks of kRepackRows rows holding n rows (the last one padded).
constexpr int64_t repack_blocks(int64_t n) { return (n + kRepackRows - 1) / kRepackRows; }

constexpr bool repack_supports_bits(int bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 8;
}

// Bit of word H holding bit 2 of chunk code c (0..31), see above.
constexpr int split3_hpos(int c) {
  return 8 * ((c % 16) / 4) + (2 + 4 * (c / 16) + c % 4) % 8;
}
// How far right (negative: left) the kernels shift word H so that bit 2 of
// each lane element holds the high bit of the code that shift 2k of word
// L<h> put in that element: the one definition both ISAs' kernels use.
constexpr int split3_hshift(int h, int k) { return split3_hpos(16 * h + k) - 2; }
// ... and that one shift serves every element of the word, for byte
// (int8) and 16-bit (int16) elements.
constexpr bool split3_hshift_ok(int code_bytes) {
  const int S = 4 * code_bytes, P = 4 / code_bytes, EB = 8 * code_bytes;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < S; ++k)
      for (int e = 0; e < P; ++e)
        if (split3_hpos(16 * h + e * S + k) - e * EB - 2 != split3_hshift(h, k)) return false;
  return true;
}
static_assert(split3_hshift_ok(1) && split3_hshift_ok(2), "3-bit high-bit placement");
// 3-bit words, row-major: MLX's chunks of 3 words -> (L0, L1, H) and back.
// nwords is a multiple of 3; a row of a 3-bit segment is whole chunks.
void split3(const uint32_t* src, int64_t nwords, uint32_t* dst);
void merge3(const uint32_t* src, int64_t nwords, uint32_t* dst);

// dst[b, c, r] = src[b*R + r, c] for a row-major [N, cols] matrix of
// `itemsize`-byte elements; dst has ceil(N/R)*R*cols elements, padding zero.
void interleave_rows(const void* src, int64_t N, int64_t cols, size_t itemsize, void* dst);
// The exact inverse: src [NB, cols, R] -> dst [N, cols] (padding dropped).
void deinterleave_rows(const void* src, int64_t N, int64_t cols, size_t itemsize, void* dst);

// One repacked segment, for the kernels.
struct RSeg {
  const uint32_t* wq;  // [NB, words, R]
  const void* scales;  // [NB, ngroups, R]
  const void* biases;
  DType sdt;
  int words, ngroups;
};

// MB activation rows of one segment, codes in the repacked kernels' order
// (repacked_x_col).
struct RX {
  const void* xq;    // int8_t or int16_t codes; row m at xq + m * ldx
  int ldx;
  const float* d;    // per group, row m at d + m * ldg
  const float* xs;   // d * ix, same layout
  int ldg;
  const int32_t* ix; // ix itself, same layout (NEON int8: the 8-bit codes' offset)
};

// y[m * ldy + n] += segment contribution, for m < mb and the real rows
// (n < N) of blocks [b0, b1).
using RFn = void (*)(const RSeg&, const RX&, int mb, int b0, int b1, int N, float* y, int ldy);

// Activation rows per kernel pass, and the kernels by [bits][group size
// index 0: g32, 1: g64, 2: g128]; null where bits are not repacked.
constexpr int kRepackMaxMB = 8;
struct RTable {
  RFn fn[9][3];
};
#if defined(MIXBITS_HAVE_AVX2)
// AVX512-VNNI (+VL, BW); call only where cpu_isa().avx512vnni.
const RTable& repacked_int8_table_vnni();
const RTable& repacked_int16_table_vnni();
// AVX2 (avx2_repacked.cpp): the same layout as two 8-row halves per block.
const RTable& repacked_int8_table_avx2();
const RTable& repacked_int16_table_avx2();
#endif
#if defined(MIXBITS_HAVE_NEON)
// arm64 (neon_repacked.cpp): a block as four 4-row vectors; SDOT where the
// compiler targets the dot-product extension, else SMULL + SADALP.
const RTable& repacked_int8_table_neon();
const RTable& repacked_int16_table_neon();
#endif

// Where the repacked kernels read the codes of a 32-bit word: with T the
// activation code type, a word holds 32/B codes, lane element e (byte for
// int8, 16-bit half for int16) of the word shifted right by k*B holds code
// e*S + k (S = 8*sizeof(T)/B shifts per word). The kernels consume, per
// word, shift k = 0..S-1 and elements e = 0..P-1 (P = 4/sizeof(T)), so
// position p = k*P + e of the word's activations holds column
// repacked_x_col(B, code_bytes, p) of the word.
//
// 3 bits: per chunk of 32 codes the kernels consume L0 then L1 as 2-bit
// words (codes 0..15, then 16..31), so position p of a chunk's activations
// holds column 16*(p/16) + repacked_x_col(2, code_bytes, p % 16).
constexpr int repacked_x_col(int B, int code_bytes, int p) {
  if (B == 3) return 16 * (p / 16) + repacked_x_col(2, code_bytes, p % 16);
  const int P = 4 / code_bytes, S = 8 * code_bytes / B;
  return (p % P) * S + p / P;
}
// Activations per group of repacked_x_col positions: 32 for 3 bits, else
// the codes of one word.
constexpr int repacked_x_span(int B) { return B == 3 ? 32 : 32 / B; }

}  // namespace mixbits
