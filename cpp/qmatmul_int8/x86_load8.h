// Eight rows' scales (or biases) of one group of a repacked block (repack.h:
// [NB, groups, 16]; one 256-bit half of the 16) as 8 float32 lanes: float32
// loaded, float16 by F16C's convert, bfloat16 widened by a shift, the
// conversions to_f32 makes. One definition for the AVX2 GEMV
// (avx2_repacked.cpp) and the AVX2 prefill panel packers
// (qmatmul/avx2_panel_r.cpp), which must read a block's scales alike; the
// 16-lane twin is x86_load16.h.
//
// Include in files built with -mavx2 -mf16c (no target region: these must
// inline into AVX2 code): internal linkage, one copy per including file.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "common/half.h"

namespace mixbits {
namespace {

inline __m256 load8_f32(const void* p, int64_t off, DType t) {
  if (t == DType::f32) return _mm256_loadu_ps(static_cast<const float*>(p) + off);
  const __m128i h = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(p) + off));
  if (t == DType::f16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16
}

}  // namespace
}  // namespace mixbits
