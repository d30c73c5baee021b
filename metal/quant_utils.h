// Math shared by the Metal kernels and C++: bfloat16 bit conversions, the
// storage types of activations and scales, and the decode of MLX's
// quantized layout.
//
// Usable from Metal, from C++ under the emulator (metal_compat.h), and from
// plain host C++ (address-space qualifiers become empty there).
//
// MLX layout: row n of a quantized matrix is an LSB-first bitstream of
// `bits`-wide codes in uint32 words (equivalently, bytes in little-endian
// order); code j starts at bit j*bits and may straddle two bytes (and two
// words) when bits is 3, 5 or 6. Weight = scale[g] * code + bias[g] with
// g = j / group_size.
#pragma once

#if defined(__METAL_VERSION__) || defined(MIXBITS_METAL_EMULATION)
#define MB_DEVICE device
#define MB_THREAD thread
#define MB_BITCAST(T, x) as_type<T>(x)
#else
#include <cstdint>
#define MB_DEVICE
#define MB_THREAD
#define MB_BITCAST(T, x) __builtin_bit_cast(T, x)
#endif
#ifndef MB_UNROLL
#define MB_UNROLL
#endif

// ---- bfloat16 as raw bits (no native bfloat needed on any Metal version) ----

inline float mb_bf16_to_float(uint16_t b) {
  return MB_BITCAST(float, uint32_t(b) << 16);
}

// Round to nearest even; NaN stays NaN (quietened), as MLX converts.
inline uint16_t mb_float_to_bf16(float f) {
  uint32_t x = MB_BITCAST(uint32_t, f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ---- storage types --------------------------------------------------------------

#if defined(__METAL_VERSION__) || defined(MIXBITS_METAL_EMULATION)

// Storage of x, the output, and the scales/biases: the kernels are templates
// over one of these for the activations and one for the scales (the scale
// dtype may differ from x's; each combination is its own instantiation).
struct MbF32 {
  typedef float storage;
  static float load(storage v) { return v; }
  static storage store(float v) { return v; }
};
struct MbF16 {
  typedef half storage;
  static float load(storage v) { return float(v); }
  static storage store(float v) { return storage(v); }
};
struct MbBF16 {
  typedef uint16_t storage;
  static float load(storage v) { return mb_bf16_to_float(v); }
  static storage store(float v) { return mb_float_to_bf16(v); }
};

#endif

// ---- decode ------------------------------------------------------------------

template <int bits>
inline uint32_t mb_code_mask() {
  return (1u << bits) - 1u;
}

// Values per lane-chunk of the GEMV: 16 codes of `bits` bits are 2*bits
// bytes, so every chunk starts on a byte boundary for every width and lies
// inside one group (16 divides every group size).
#define MB_CHUNK 16

// The word the GEMV reads a chunk with. A chunk starts 2*bits*j bytes into a
// row, and a row is a multiple of 4*bits bytes long (kseg is a multiple of
// 32), so chunks are 4-byte aligned for even widths (read as bits/2 uint32)
// and 2-byte aligned for odd ones (read as `bits` uint16).
template <int bits>
struct MbChunkWord {
  typedef uint32_t type;
};
template <>
struct MbChunkWord<3> {
  typedef uint16_t type;
};
template <>
struct MbChunkWord<5> {
  typedef uint16_t type;
};

template <int bits>
inline constexpr int mb_chunk_words() {
  return 2 * bits / int(sizeof(typename MbChunkWord<bits>::type));
}

// Pre-scale 16 activations so that weights can be *masked, not shifted*:
// code i sits at bit s_i = (i*bits) % W of its W-bit word, so
// (word & mask<<s_i) equals code<<s_i, and multiplying it by x_i / 2^s_i
// gives code*x_i (a power-of-two scale: exact unless x_i / 2^s_i is
// subnormal, i.e. |x_i| < 2^-96 for 32-bit words).
// Returns the plain sum of the 16 activations (for the bias term).
template <int bits>
inline float mb_prescale16(MB_THREAD float* xs) {
  constexpr int W = 8 * int(sizeof(typename MbChunkWord<bits>::type));
  float sum = 0.0f;
  MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
    sum += xs[i];
    const int s = (i * bits) % W;
    xs[i] = xs[i] * (1.0f / float(1u << s));
  }
  return sum;
}

// sum_i code_i * x_i over one chunk of 16 codes held in `w` (the chunk's
// mb_chunk_words<bits>() words, as read from the row), with xs pre-scaled
// by mb_prescale16. A code that straddles into the next word has its high
// part masked there (no shift); that part is worth code_hi << (W - s),
// i.e. xs * 2^s * 2^(W-s) = xs * 2^W.
template <int bits>
inline float mb_qdot16(const MB_THREAD typename MbChunkWord<bits>::type* w,
                       const MB_THREAD float* xs) {
  constexpr int W = 8 * int(sizeof(typename MbChunkWord<bits>::type));
  constexpr uint32_t word_mask = W == 32 ? 0xffffffffu : (1u << W) - 1u;
  constexpr float two_w = W == 32 ? 4294967296.0f : 65536.0f;  // 2^W
  float acc = 0.0f;
  MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
    const int bit = i * bits;
    const int word = bit / W;
    const int s = bit % W;
    const uint32_t lo_mask = (mb_code_mask<bits>() << s) & word_mask;
    acc += float(uint32_t(w[word]) & lo_mask) * xs[i];
    if (s + bits > W) {
      const uint32_t hi_mask = mb_code_mask<bits>() >> (W - s);
      acc += float(uint32_t(w[word + 1]) & hi_mask) * (xs[i] * two_w);
    }
  }
  return acc;
}

// The 8 codes starting at byte `w` (8 codes of `bits` bits are exactly
// `bits` bytes, so the run starts on a byte boundary), shifted out of a
// 64-bit little-endian window. Used by the tiled kernel's dequantize step.
template <int bits>
inline void mb_unpack8(const MB_DEVICE uint8_t* w, MB_THREAD uint32_t* codes) {
  uint64_t v = 0;
  MB_UNROLL for (int b = 0; b < bits; ++b) v |= uint64_t(w[b]) << (8 * b);
  MB_UNROLL for (int i = 0; i < 8; ++i) {
    codes[i] = uint32_t(v >> (i * bits)) & mb_code_mask<bits>();
  }
}

// The tiled kernel's 4-byte decode: a BK = 32 step of one row is exactly
// `bits` aligned uint32 words (32 codes), shared by the row's 4 loader
// threads; thread j's 8 codes start at bit 8 j bits of the step, i.e. in
// word (8 j bits) / 32 at bit s = (8 j bits) % 32, and end in the next word
// at the latest (s + 8 bits <= 64 for every width). lo and hi are those two
// words (hi unused, may be anything, when the run ends in lo).
template <int bits>
inline void mb_unpack8_words(uint32_t lo, uint32_t hi, int s, MB_THREAD uint32_t* codes) {
  const uint64_t v = ((uint64_t(hi) << 32) | uint64_t(lo)) >> s;
  MB_UNROLL for (int i = 0; i < 8; ++i) {
    codes[i] = uint32_t(v >> (i * bits)) & mb_code_mask<bits>();
  }
}
