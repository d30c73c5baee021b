// NEON decode of MLX's packed codes: 16 consecutive codes of one row (a
// row's bitstream is LSB-first, so codes i..i+15 of a group occupy 2·B
// bytes starting at byte i·B/8) into one uint8x16_t, in natural order.
// Shared by the float, integer and transposed NEON kernels, so the three
// read the layout one way.
//
// Any width: a table lookup puts the two bytes that hold code i into u16
// lane i, a per-lane shift right drops the bits below it, a mask the bits
// above, and the low bytes of the two u16 vectors are the 16 codes (3
// instructions per 8 codes). 8 and 4 bits have direct forms.
#pragma once
#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>
#include <cstring>

namespace mixbits::neon {

template <int B>
struct CodeTable {
  uint8_t idx[2][16];   // bytes of u16 lane i (low, high) for codes 0-7, 8-15
  int16_t shift[2][8];  // minus the bit offset of code i in its low byte
  constexpr CodeTable() : idx{}, shift{} {
    for (int i = 0; i < 16; ++i) {
      const int bit = B * i;
      idx[i / 8][2 * (i % 8)] = uint8_t(bit >> 3);
      idx[i / 8][2 * (i % 8) + 1] = uint8_t((bit >> 3) + 1);
      shift[i / 8][i % 8] = int16_t(-(bit & 7));
    }
  }
};

// Codes [16·j, 16·j + 16) of the row that starts at `row`.
template <int B>
inline uint8x16_t decode16(const uint8_t* row, int64_t j) {
  const uint8_t* p = row + j * 2 * B;
  if constexpr (B == 8) {
    return vld1q_u8(p);
  } else if constexpr (B == 4) {
    const uint8x8_t v = vld1_u8(p);
    const uint8x8_t lo = vand_u8(v, vdup_n_u8(0x0F)), hi = vshr_n_u8(v, 4);
    return vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi));
  } else {
    static constexpr CodeTable<B> t;
    // Exactly 2·B bytes: the last group of the last row ends the buffer.
    uint8_t buf[16] = {};
    std::memcpy(buf, p, 2 * B);
    const uint8x16_t bytes = vld1q_u8(buf);
    const uint16x8_t mask = vdupq_n_u16((1u << B) - 1);
    uint16x8_t h[2];
    for (int k = 0; k < 2; ++k) {
      const uint16x8_t pair = vreinterpretq_u16_u8(vqtbl1q_u8(bytes, vld1q_u8(t.idx[k])));
      h[k] = vandq_u16(vshlq_u16(pair, vld1q_s16(t.shift[k])), mask);
    }
    return vuzp1q_u8(vreinterpretq_u8_u16(h[0]), vreinterpretq_u8_u16(h[1]));
  }
}

// The 16 codes as four float32x4_t.
inline void widen(uint8x16_t c, float32x4_t f[4]) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(c)), hi = vmovl_high_u8(c);
  f[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
  f[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
  f[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
  f[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
}

}  // namespace mixbits::neon
#endif
