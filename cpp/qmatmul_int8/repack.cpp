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
  const int64_t NB = (N + kRepackRows - 1) / kRepackRows;
  std::memset(dst, 0, size_t(NB) * kRepackRows * cols * itemsize);  // padding rows
  shuffle_any<true>(src, N, cols, itemsize, dst);
}

void deinterleave_rows(const void* src, int64_t N, int64_t cols, size_t itemsize, void* dst) {
  shuffle_any<false>(src, N, cols, itemsize, dst);
}

}  // namespace mixbits
