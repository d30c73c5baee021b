// VNNI int8-activation kernels: vpdpbusd (u8 codes x s8 activations, four
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
struct DotVnni512 {
  static constexpr int kMaxMB = 8;  // 32 registers: 2*R*MB + MB <= 24
  template <int MB>
  static constexpr int rows_per_pass() { return MB <= 2 ? 4 : MB <= 4 ? 2 : 1; }
  template <int B>
  static __m256i dot(__m256i acc, __m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(acc, w, x);
  }
};
}  // namespace

const I8Table& int8_table_vnni() {
  static const I8Table t = make_table<DotVnni512>("avx512vnni");
  return t;
}
}  // namespace mixbits
#pragma GCC pop_options
#endif
