// Scalar float16 / bfloat16 <-> float32 conversions shared by every CPU
// kernel. Plain bit manipulation so the scalar reference needs no SIMD and
// no MLX types; the SIMD paths use F16C / NEON instructions instead.
#pragma once
#include <cstdint>
#include <cstring>

namespace mixbits {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

// Bytes per element.
constexpr int dtype_bytes(DType t) { return t == DType::f32 ? 4 : 2; }

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    // Subnormal half: value = man * 2^-24, exact in float32.
    float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t f32_to_f16(float f) {
  // Round to nearest even, with overflow to inf and gradual underflow.
  uint32_t x = f32_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)  // inf or nan
    return uint16_t(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds to inf
  if (ax < 0x38800000u) {  // below the smallest normal half: subnormal
    float v = bits_to_f32(ax) * 16777216.0f;  // scale by 2^24
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1))) m++;
    return uint16_t(sign | m);
  }
  uint32_t r = ax + 0xfff + ((ax >> 13) & 1);
  return uint16_t(sign | ((r - 0x38000000u) >> 13));
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);
  return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

inline float load_as_f32(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_from_f32(void* p, int64_t i, float v, DType t) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = v; break;
    case DType::f16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
  }
}

}  // namespace mixbits
