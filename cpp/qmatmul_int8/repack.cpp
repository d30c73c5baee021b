// Building the row-interleaved layout (repack.h) and its exact inverse: a
// copy of elements, no arithmetic, so repack followed by unrepack returns
// the input bit for bit.
#include "qmatmul_int8/repack.h"

#include <cstring>
#include <stdexcept>

namespace mixbits {

namespace {

// Elements copied as integers of their width (2 or 4 bytes: uint32 codes,
// f16/bf16/f32 scales), so the loops compile to plain moves.
template <class E, bool kToBlocks>
void shuffle(const void* src, int64_t N, int64_t cols, void* dst) {
  const E* s = static_cast<const E*>(src);
  E* d = static_cast<E*>(dst);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / kRepackRows, r = n % kRepackRows;
    const int64_t row = n * cols, blk = b * cols * kRepackRows + r;
    for (int64_t c = 0; c < cols; ++c) {
      if constexpr (kToBlocks) d[blk + c * kRepackRows] = s[row + c];
      else d[row + c] = s[blk + c * kRepackRows];
    }
  }
}

template <bool kToBlocks>
void shuffle_any(const void* src, int64_t N, int64_t cols, size_t itemsize, void* dst) {
  if (itemsize == 2) return shuffle<uint16_t, kToBlocks>(src, N, cols, dst);
  if (itemsize == 4) return shuffle<uint32_t, kToBlocks>(src, N, cols, dst);
  throw std::invalid_argument("repack: elements must be 2 or 4 bytes wide");
}

}  // namespace

void interleave_rows(const void* src, int64_t N, int64_t cols, size_t itemsize, void* dst) {
  const int64_t NB = repack_blocks(N);
  std::memset(dst, 0, size_t(NB) * kRepackRows * cols * itemsize);  // padding rows
  shuffle_any<true>(src, N, cols, itemsize, dst);
}

namespace {

// Code c (0..31) of a chunk of B words of MLX's bitstream (LSB first; a
// code may straddle two words), and its inverse (out zeroed by the caller).
inline uint32_t chunk_code(const uint32_t* w, int B, int c) {
  const int bit = B * c, i = bit / 32, o = bit % 32;
  const uint64_t two = uint64_t(w[i]) | (i + 1 < B ? uint64_t(w[i + 1]) << 32 : 0);
  return uint32_t(two >> o) & ((1u << B) - 1u);
}
inline void put_code(uint32_t* w, int B, int c, uint32_t code) {
  const int bit = B * c, i = bit / 32, o = bit % 32;
  w[i] |= code << o;
  if (o + B > 32) w[i + 1] |= code >> (32 - o);
}

}  // namespace

void split_planes(int B, const uint32_t* src, int64_t nwords, uint32_t* dst) {
  const int LB = split_low_bits(B), CW = 32 / LB;
  for (int64_t j = 0; j < nwords; j += B) {
    uint32_t out[8] = {};
    for (int c = 0; c < 32; ++c) {
      const uint32_t code = chunk_code(src + j, B, c);
      out[c / CW] |= (code & ((1u << LB) - 1u)) << (LB * (c % CW));
      out[LB + split_hword(B, c)] |= (code >> LB) << split_hpos(B, c);
    }
    for (int i = 0; i < B; ++i) dst[j + i] = out[i];
  }
}

namespace {

// merge_planes for one width: with B a constant and the code loop unrolled
// every position below is a constant, a few shifts and masks per code
// (the runtime-B loop cost ~12 ns per code, the whole of a repacked
// node's un-repack for 5/6 bits: 4-8x the matmul itself at a prompt).
template <int B>
void merge_planes_b(const uint32_t* src, int64_t nwords, uint32_t* dst) {
  constexpr int LB = split_low_bits(B), CW = 32 / LB;
  constexpr uint32_t hmask = (1u << (B - LB)) - 1u;
  for (int64_t j = 0; j < nwords; j += B) {
    uint32_t out[B] = {};
#pragma GCC unroll 32
    for (int c = 0; c < 32; ++c) {
      const uint32_t lo = (src[j + c / CW] >> (LB * (c % CW))) & ((1u << LB) - 1u);
      const uint32_t hi = (src[j + LB + split_hword(B, c)] >> split_hpos(B, c)) & hmask;
      put_code(out, B, c, lo | (hi << LB));
    }
    for (int i = 0; i < B; ++i) dst[j + i] = out[i];
  }
}

}  // namespace

void merge_planes(int B, const uint32_t* src, int64_t nwords, uint32_t* dst) {
  switch (B) {
    case 3: return merge_planes_b<3>(src, nwords, dst);
    case 5: return merge_planes_b<5>(src, nwords, dst);
    case 6: return merge_planes_b<6>(src, nwords, dst);
    default: throw std::invalid_argument("merge_planes: bits must be 3, 5 or 6");
  }
}

void deinterleave_rows(const void* src, int64_t N, int64_t cols, size_t itemsize, void* dst) {
  shuffle_any<false>(src, N, cols, itemsize, dst);
}

}  // namespace mixbits
