// NEON versions of common/convert.h, 4 values per step (vcvt between
// float16 and float32 rounds to nearest even, as half.h does); the tails
// use half.h's scalar conversions. Checked under qemu-user against them
// (tests/neon/convert_harness.cpp); their speed is a Mac's to measure.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "common/convert.h"

namespace mixbits {

void widen_to_f32_neon(const void* src, int64_t off, int64_t n, DType dt, float* dst) {
  const uint16_t* p = static_cast<const uint16_t*>(src) + off;
  int64_t i = 0;
  if (dt == DType::f16) {
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + i))));
    for (; i < n; ++i) dst[i] = f16_to_f32(p[i]);
  } else {
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + i), 16)));
    for (; i < n; ++i) dst[i] = bf16_to_f32(p[i]);
  }
}

void narrow_from_f32_neon(const float* src, int64_t n, DType dt, void* dst, int64_t off) {
  uint16_t* p = static_cast<uint16_t*>(dst) + off;
  int64_t i = 0;
  if (dt == DType::f16) {
    // vcvt keeps a NaN's payload; half.h gives sign | 0x7e00 for every NaN.
    const uint16x4_t quiet = vdup_n_u16(0x7e00), sign = vdup_n_u16(0x8000);
    for (; i + 4 <= n; i += 4) {
      const float32x4_t v = vld1q_f32(src + i);
      const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(v));
      const uint16x4_t num = vmovn_u32(vceqq_f32(v, v));  // all ones where not NaN
      vst1_u16(p + i, vbsl_u16(num, h, vorr_u16(vand_u16(h, sign), quiet)));
    }
    for (; i < n; ++i) p[i] = f32_to_f16(src[i]);
  } else {
    for (; i < n; ++i) p[i] = f32_to_bf16(src[i]);  // not on a hot path yet
  }
}

}  // namespace mixbits
#endif
