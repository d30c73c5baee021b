// Bulk conversions between float16 / bfloat16 / float32 arrays and float32
// rows, for the kernels whose inputs come in half precision (a float16
// model's attention, norms, rope and matmul activations). F16C on x86
// (chosen once), NEON on arm64, half.h's scalar conversions elsewhere; both give the same
// bits (round to nearest even; NaNs come out quiet, as half.h's do).
#pragma once
#include <cstdint>

#include "common/half.h"

namespace mixbits {

// dst[0..n) = src[off .. off + n) as float32.
void widen_to_f32(const void* src, int64_t off, int64_t n, DType dt, float* dst);
// dst[off .. off + n) = src[0..n) rounded to dt.
void narrow_from_f32(const float* src, int64_t n, DType dt, void* dst, int64_t off);

// The scalar versions (the definition the SIMD ones are checked against);
// these and the SIMD ones take float16 / bfloat16 only.
void widen_to_f32_ref(const void* src, int64_t off, int64_t n, DType dt, float* dst);
void narrow_from_f32_ref(const float* src, int64_t n, DType dt, void* dst, int64_t off);

#if defined(MIXBITS_HAVE_AVX2)
void widen_to_f32_avx2(const void* src, int64_t off, int64_t n, DType dt, float* dst);
void narrow_from_f32_avx2(const float* src, int64_t n, DType dt, void* dst, int64_t off);
#endif
#if defined(MIXBITS_HAVE_NEON) && defined(__aarch64__)
void widen_to_f32_neon(const void* src, int64_t off, int64_t n, DType dt, float* dst);
void narrow_from_f32_neon(const float* src, int64_t n, DType dt, void* dst, int64_t off);
#endif

}  // namespace mixbits
