// metal/quant_utils.h included by plain host C++ (no Metal, no compat
// header): the decode and bfloat16 helpers, exported for ctypes.
#include <cstdint>
#include <cstring>

#include "quant_utils.h"

namespace {
template <int bits>
void unpack_row_t(const uint8_t* row, int n_codes, uint32_t* codes) {
  for (int j = 0; j < n_codes; j += 8) mb_unpack8<bits>(row + j / 8 * bits, codes + j);
}
// The tiled kernel's decode: per 32-code step, the step's `bits` words; the
// 8 codes of loader thread j from words q, q + 1 (as the kernel gets them
// by shuffles; memcpy: the row need not be aligned here).
template <int bits>
void unpack_row_words_t(const uint8_t* row, int n_codes, uint32_t* codes) {
  for (int k = 0; k < n_codes; k += 32) {
    uint32_t w[bits + 1] = {};
    std::memcpy(w, row + k / 8 * bits, 4 * bits);
    for (int j = 0; j < 4; ++j) {
      const int q = 8 * j * bits / 32, s = 8 * j * bits % 32;
      mb_unpack8_words<bits>(w[q], w[q + 1], s, codes + k + 8 * j);
    }
  }
}
// The GEMV's chunk dot: the chunk read as words (memcpy: the caller's byte
// pointer need not be aligned here), activations pre-scaled.
template <int bits>
float qdot_t(const uint8_t* w, const float* x) {
  typename MbChunkWord<bits>::type words[mb_chunk_words<bits>()];
  std::memcpy(words, w, sizeof words);
  static_assert(sizeof words == 2 * bits, "a chunk is 2*bits bytes");
  float xs[MB_CHUNK];
  for (int i = 0; i < MB_CHUNK; ++i) xs[i] = x[i];
  mb_prescale16<bits>(xs);
  return mb_qdot16<bits>(words, xs);
}
}  // namespace

extern "C" {
int qu_unpack_row(const uint8_t* row, int bits, int n_codes, uint32_t* codes) {
  switch (bits) {
    case 2: unpack_row_t<2>(row, n_codes, codes); return 0;
    case 3: unpack_row_t<3>(row, n_codes, codes); return 0;
    case 4: unpack_row_t<4>(row, n_codes, codes); return 0;
    case 5: unpack_row_t<5>(row, n_codes, codes); return 0;
    case 6: unpack_row_t<6>(row, n_codes, codes); return 0;
    case 8: unpack_row_t<8>(row, n_codes, codes); return 0;
  }
  return 1;
}
int qu_unpack_row_words(const uint8_t* row, int bits, int n_codes, uint32_t* codes) {
  switch (bits) {
    case 2: unpack_row_words_t<2>(row, n_codes, codes); return 0;
    case 3: unpack_row_words_t<3>(row, n_codes, codes); return 0;
    case 4: unpack_row_words_t<4>(row, n_codes, codes); return 0;
    case 5: unpack_row_words_t<5>(row, n_codes, codes); return 0;
    case 6: unpack_row_words_t<6>(row, n_codes, codes); return 0;
    case 8: unpack_row_words_t<8>(row, n_codes, codes); return 0;
  }
  return 1;
}
// sum_i code_i * x_i over the 16 codes starting at byte w.
float qu_qdot16(const uint8_t* w, int bits, const float* x) {
  switch (bits) {
    case 2: return qdot_t<2>(w, x);
    case 3: return qdot_t<3>(w, x);
    case 4: return qdot_t<4>(w, x);
    case 5: return qdot_t<5>(w, x);
    case 6: return qdot_t<6>(w, x);
    default: return qdot_t<8>(w, x);
  }
}
uint16_t qu_f32_to_bf16(float f) { return mb_float_to_bf16(f); }
float qu_bf16_to_f32(uint16_t b) { return mb_bf16_to_float(b); }
}
