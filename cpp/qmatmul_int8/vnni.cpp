// VNNI integer-activation kernels. int8: vpdpbusd (u8 codes x s8 activations, four
// products summed straight into int32 lanes, no int16 saturation, so 8-bit
// codes need no widening). AVX512-VNNI with AVX512VL: 256-bit vectors, 32
// registers. (AVX-VNNI, the VEX form on Alder Lake and later, would be the
// same source under another pragma in its own file; not written yet.)
//
// This file is not built with -mavx2 (CMake gives that to avx2.cpp only):
// each variant is a target pragma region, and reached only after
// cpu_isa() saw the feature. Only plain-data headers are included under
// the pragmas (see table.h).
#if defined(MIXBITS_HAVE_AVX2)
#include <immintrin.h>

#include "qmatmul_int8/table.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#include "qmatmul_int8/x86.h"

namespace mixbits {
namespace {
struct DotVnni512 : Int8Lanes256 {
  static constexpr bool kRowLanes = true;  // vpdpbusd: lane j = bytes 4j..4j+3
  static constexpr int kMaxMB = 8;  // 32 registers: 2*R*MB + MB <= 24
  template <int MB>
  static constexpr int rows_per_pass() { return MB <= 2 ? 4 : MB <= 4 ? 2 : 1; }
  template <int B>
  static __m256i dot(__m256i acc, __m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(acc, w, x);
  }
};
// int16 activations: the 32 byte codes widened to one zmm of 16-bit codes,
// vpdpwssd (pairs of 16-bit products into 16 int32 lanes): one instruction
// per unit and x row, as the int8 policy's 256-bit vpdpbusd.
struct DotVnni512I16 {
  static constexpr bool kRowLanes = false;  // 16 lanes of 16-bit pairs
  using Code = int16_t;
  using XV = __m512i;
  using Acc = __m512i;
  using F = __m512;
  static constexpr int kMaxMB = 8;  // as the int8 policy: 2*R*MB + MB <= 24 zmm
  template <int MB>
  static constexpr int rows_per_pass() { return MB <= 2 ? 4 : MB <= 4 ? 2 : 1; }
  static XV load_x(const Code* p) { return _mm512_loadu_si512((const void*)p); }
  static Acc zero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fma(Acc a, float s, F acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(s), acc);
  }
  static float fsum(F v) { return _mm512_reduce_add_ps(v); }
  template <int B>
  static Acc dot(Acc acc, __m256i w, XV x) {
    return _mm512_dpwssd_epi32(acc, _mm512_cvtepu8_epi16(w), x);
  }
};

}  // namespace

const I8Table& int8_table_vnni() {
  static const I8Table t = make_table<DotVnni512>("avx512vnni");
  return t;
}

const I8Table& int16_table_vnni() {
  static const I8Table t = make_table<DotVnni512I16>("avx512vnni");
  return t;
}
}  // namespace mixbits
#pragma GCC pop_options
#endif
