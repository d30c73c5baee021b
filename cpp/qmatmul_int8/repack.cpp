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

void split3(const uint32_t* src, int64_t nwords, uint32_t* dst) {
  for (int64_t j = 0; j < nwords; j += 3) {
    uint32_t l[2] = {0, 0}, h = 0;
    for (int c = 0; c < 32; ++c) {
      const int bit = 3 * c, w = bit / 32, o = bit % 32;
      uint64_t two = uint64_t(src[j + w]) | (w + 1 < 3 ? uint64_t(src[j + w + 1]) << 32 : 0);
      const uint32_t code = uint32_t(two >> o) & 7u;
      l[c / 16] |= (code & 3u) << (2 * (c % 16));
      h |= (code >> 2) << split3_hpos(c);
    }
    dst[j] = l[0];
    dst[j + 1] = l[1];
    dst[j + 2] = h;
  }
}

void merge3(const uint32_t* src, int64_t nwords, uint32_t* dst) {
  for (int64_t j = 0; j < nwords; j += 3) {
    uint32_t out[3] = {0, 0, 0};
    for (int c = 0; c < 32; ++c) {
      const uint32_t code = ((src[j + c / 16] >> (2 * (c % 16))) & 3u) |
                            (((src[j + 2] >> split3_hpos(c)) & 1u) << 2);
      const int bit = 3 * c, w = bit / 32, o = bit % 32;
      out[w] |= code << o;
      if (o > 29) out[w + 1] |= code >> (32 - o);
    }
    dst[j] = out[0];
    dst[j + 1] = out[1];
    dst[j + 2] = out[2];
  }
}

void deinterleave_rows(const void* src, int64_t N, int64_t cols, size_t itemsize, void* dst) {
  shuffle_any<false>(src, N, cols, itemsize, dst);
}

}  // namespace mixbits
