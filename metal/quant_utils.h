// Math shared by the Metal kernels and C++: bfloat16 bit conversions, the
// storage types of activations, and the decode of MLX's quantized layout.
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

#include "qmatmul_params.h"  // MbScaleType

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

// ---- scale/bias loads: the scale dtype is a runtime argument ----------------

#if defined(__METAL_VERSION__) || defined(MIXBITS_METAL_EMULATION)

// Element i of a float32/float16/bfloat16 array given as raw bytes.
inline float mb_load_scale(const device uint8_t* base, size_t i, int type) {
  if (type == MB_SCALE_F32) return ((const device float*)base)[i];
  if (type == MB_SCALE_F16) return float(((const device half*)base)[i]);
  return mb_bf16_to_float(((const device uint16_t*)base)[i]);
}

// Storage of x and the output: the kernels are templates over one of these.
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

// Pre-scale 16 activations so that weights can be *masked, not shifted*:
// code i sits at bit s_i = (i*bits) % 8 of its byte, so (byte & mask<<s_i)
// equals code<<s_i, and multiplying it by x_i / 2^s_i gives code*x_i.
// Returns the plain sum of the 16 activations (for the bias term).
template <int bits>
inline float mb_prescale16(MB_THREAD float* xs) {
  float sum = 0.0f;
  MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
    sum += xs[i];
    const int s = (i * bits) & 7;
    xs[i] = xs[i] * (1.0f / float(1 << s));
  }
  return sum;
}

// sum_i code_i * x_i over one chunk of 16 codes starting at byte `w`, with xs
// pre-scaled by mb_prescale16. A code that straddles into the next byte has
// its high part masked there (no shift); that part is worth
// code_hi << (8 - s), i.e. xs * 2^s * 2^(8-s) = xs * 256.
template <int bits>
inline float mb_qdot16(const MB_DEVICE uint8_t* w, const MB_THREAD float* xs) {
  float acc = 0.0f;
  MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
    const int bit = i * bits;
    const int byte = bit >> 3;
    const int s = bit & 7;
    const uint32_t lo_mask = (mb_code_mask<bits>() << s) & 0xffu;
    acc += float(w[byte] & lo_mask) * xs[i];
    if (s + bits > 8) {
      const uint32_t hi_mask = mb_code_mask<bits>() >> (8 - s);
      acc += float(w[byte + 1] & hi_mask) * (xs[i] * 256.0f);
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
