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
// are. 3, 5, 6 bits: MLX's bitstream (32 codes per B words, LSB first,
// codes straddling words) is rewritten per row and per chunk of 32 codes
// into B words of "planes" (split_planes; merge_planes is the exact
// inverse, so the memory is the same) before the interleave: LB low-plane
// words in MLX's LB-bit layout (LB = 2 for 3 bits, 4 for 5 and 6), read by
// the LB-bit kernel's shift and mask, then B - LB high-plane words holding
// the code bits above LB, placed so that one shift of a high word and one
// mask line its bits up with exactly the codes a shift of a low word gave
// (split_hshift below), for either activation width; code = low | high.
//   3 bits: L0, L1 (low 2 bits of codes 0..15, 16..31, code i of a word at
//           bits 2i), H: bit 2 of code h*16 + 4p + k (h = 0, 1; p, k =
//           0..3) at bit 8p + (2 + 4h + k) % 8 (split3_hpos).
//   5 bits: L0..L3 (low 4 bits of codes 8w..8w+7, code i at bits 4i), H:
//           bit 4 of code 8w + 2p + k (w, p = 0..3; k = 0, 1) at bit
//           8p + (4 + 2w + k) % 8.
//   6 bits: L0..L3 as for 5, H0 (codes 0..15), H1 (codes 16..31): bits 4-5
//           of code 8w + 2p + k at bits 8p + (4 + 2(2(w%2) + k)) % 8 (and
//           the next one) of H<w/2> (split56_hpos).
// Why byte i / 2 for code i of a low word: shift k of a 4-bit word puts
// code 2e + k in byte e (int8, k = 0, 1) or code 4e + k in half e (int16,
// k = 0..3): the codes of one shift are 2 (int8) or 4 (int16) indices
// apart, so with code i's high bits in byte i / 2 they are one byte or
// one 16-bit half apart, the elements' spacing, and one 32-bit shift moves
// all of them onto bit 4 of their elements. The bit within the byte tells
// apart the (w, k) whose codes share a byte: 8 for 5 bits, 4 per high
// word for 6; the 4 + ... makes shift 0 of word 0 need no shift of H.
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
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}
// Whether a segment's words are rewritten into planes (above).
constexpr bool repack_splits(int bits) { return bits == 3 || bits == 5 || bits == 6; }
// Bits of a code in the low plane (the width whose kernel reads it).
constexpr int split_low_bits(int bits) { return bits == 3 ? 2 : bits == 5 || bits == 6 ? 4 : bits; }

// Bit of word H holding bit 2 of 3-bit chunk code c (0..31), see above.
constexpr int split3_hpos(int c) {
  return 8 * ((c % 16) / 4) + (2 + 4 * (c / 16) + c % 4) % 8;
}
// The high word (0, or 0..1 for 6 bits) holding the hb (1: 5 bits, 2: 6
// bits) high bits of chunk code c, and their lowest bit there (above).
constexpr int split56_hword(int hb, int c) { return c * hb / 32; }
constexpr int split56_hpos(int hb, int c) {
  return 8 * ((c % 8) / 2) + (4 + hb * (2 * ((c / 8) % (4 / hb)) + c % 2)) % 8;
}
// The high plane of chunk code c of a `bits`-bit segment: its word (0 ..
// bits - LB - 1, after the LB low words) and lowest bit there.
constexpr int split_hword(int bits, int c) { return bits == 3 ? 0 : split56_hword(bits - 4, c); }
constexpr int split_hpos(int bits, int c) {
  return bits == 3 ? split3_hpos(c) : split56_hpos(bits - 4, c);
}
// How far right (negative: left) the kernels shift the high word of low
// word w's codes so that bit LB of each lane element holds the high bits
// of the code that shift k (by k*LB) of low word w put in that element:
// the one definition every ISA's kernels use.
constexpr int split_hshift(int bits, int w, int k) {
  return split_hpos(bits, w * (32 / split_low_bits(bits)) + k) - split_low_bits(bits);
}
// ... and that one shift of one high word serves every element of the
// word, for byte (int8) and 16-bit (int16) elements; and the placement
// is a bijection (no two codes' high bits share a bit).
constexpr bool split_hshift_ok(int bits, int code_bytes) {
  const int LB = split_low_bits(bits), HB = bits - LB, CW = 32 / LB;
  const int S = 8 * code_bytes / LB, P = 4 / code_bytes, EB = 8 * code_bytes;
  for (int w = 0; w < LB; ++w)
    for (int k = 0; k < S; ++k)
      for (int e = 0; e < P; ++e) {
        const int c = w * CW + e * S + k;
        if (split_hword(bits, c) != split_hword(bits, w * CW)) return false;
        if (split_hpos(bits, c) - e * EB - LB != split_hshift(bits, w, k)) return false;
      }
  uint32_t used[2] = {0, 0};
  for (int c = 0; c < 32; ++c) {
    const int pos = split_hpos(bits, c), hw = split_hword(bits, c);
    if (pos < 0 || pos / 8 != (pos + HB - 1) / 8 || pos / 8 > 3 || hw >= HB)
      return false;  // within its word, and within one byte (the mask's)
    const uint32_t field = ((1u << HB) - 1u) << pos;
    if (used[hw] & field) return false;
    used[hw] |= field;
  }
  return true;
}
static_assert(split_hshift_ok(3, 1) && split_hshift_ok(3, 2), "3-bit high-bit placement");
static_assert(split_hshift_ok(5, 1) && split_hshift_ok(5, 2), "5-bit high-bit placement");
static_assert(split_hshift_ok(6, 1) && split_hshift_ok(6, 2), "6-bit high-bit placement");
// `bits`-bit words (repack_splits), row-major: MLX's chunks of `bits` words
// -> the planes (above) and back. nwords is a multiple of bits; a row of
// such a segment is whole chunks (group sizes are multiples of 32).
void split_planes(int bits, const uint32_t* src, int64_t nwords, uint32_t* dst);
void merge_planes(int bits, const uint32_t* src, int64_t nwords, uint32_t* dst);

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
// gemm: the same contribution for any number of rows (mb unbounded), the
// codes of a block decoded once per K-chunk and reused for every x row
// (int8-all prompts); bit for bit fn's result over passes of kRepackMaxMB
// rows (exact integer dots, the same float epilogue in the same order).
// Null where the ISA has none: calls then run fn in passes (as they do
// below gemm_min_m, and at every M where it is 0).
constexpr int kRepackMaxMB = 8;
// Rows from which the VNNI table's gemm takes a call by default; 0: none.
// Measured on this Xeon (AVX512-VNNI, one thread, CPU time, GEMM and GEMV
// passes alternating in one run, 4096x4096 and SmolLM2's 1536x576 /
// 576x1536, 2/4/8 bits, M = 8..128): the passes were as fast or faster at
// every M (passes/GEMM 0.71-1.10, median 0.88). Both issue the same
// vpdpbusd per 64 MACs, the one 512-bit port's limit; the passes' decode
// is one shift and one AND per 8 dots, no more than the GEMM's stores,
// reloads and tile traffic. So the passes run every M here; the GEMM stays
// for CPUs where that balance differs (unmeasured), behind this constant
// and set_repacked_gemm_min_m.
constexpr int kRepackGemmMinM = 0;
struct RTable {
  RFn fn[9][3];
  RFn gemm[9][3];
  int gemm_min_m;  // calls of at least this many rows take gemm
};
#if defined(MIXBITS_HAVE_AVX2)
// AVX512-VNNI (+VL, BW); call only where cpu_isa().avx512vnni.
const RTable& repacked_int8_table_vnni();
const RTable& repacked_int16_table_vnni();
// The int8 prefill GEMM's kernels (repacked_vnni_gemm.cpp) into t.gemm.
void repacked_int8_gemm_vnni(RTable& t);
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
// 3, 5, 6 bits: per chunk of 32 codes the kernels consume the low words
// L0, L1, ... in order as LB-bit words (codes 0..CW-1, then CW..2CW-1, ...;
// CW = 32/LB), so position p of a chunk's activations holds column
// CW*(p/CW) + repacked_x_col(LB, code_bytes, p % CW).
constexpr int repacked_x_col(int B, int code_bytes, int p) {
  if (repack_splits(B)) {
    const int LB = split_low_bits(B), CW = 32 / LB;
    return CW * (p / CW) + repacked_x_col(LB, code_bytes, p % CW);
  }
  const int P = 4 / code_bytes, S = 8 * code_bytes / B;
  return (p % P) * S + p / P;
}
// Activations per group of repacked_x_col positions: 32 (a chunk) where
// the words are split, else the codes of one word.
constexpr int repacked_x_span(int B) { return repack_splits(B) ? 32 : 32 / B; }

// The mask of a B-bit code in every element of a 32-bit word: bytes for
// the int8 contract (code_bytes 1), 16-bit halves for int16 (2).
template <int B, class T>
constexpr uint32_t repack_code_mask() {
  const uint32_t m = (1u << B) - 1u;
  return sizeof(T) == 1 ? m * 0x01010101u : m * 0x00010001u;
}

}  // namespace mixbits
