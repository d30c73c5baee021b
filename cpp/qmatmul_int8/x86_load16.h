// The 16 rows' scales (or biases) of one group of a repacked block
// (repack.h: [NB, groups, 16]) as 16 float32 lanes: float32 loaded,
// float16 by F16C's convert, bfloat16 widened by a shift, the conversions
// to_f32 makes. One definition for the VNNI GEMV (repacked_vnni.cpp) and
// the prefill panel packers (qmatmul/avx2_panel_r.cpp), which must read a
// block's scales alike.
//
// Include after <immintrin.h> under a target with AVX-512F and F16C (a
// pragma region), like x86.h: internal linkage, one copy per including
// file, compiled for that file's target.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "common/half.h"

namespace mixbits {
namespace {

inline __m512 load16_f32(const void* p, int64_t off, DType t) {
  if (t == DType::f32) return _mm512_loadu_ps(static_cast<const float*>(p) + off);
  const __m256i h = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(p) + off));
  if (t == DType::f16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16
}

}  // namespace
}  // namespace mixbits
