#include "common/convert.h"

#include <cstring>

#include "common/cpu.h"

namespace mixbits {

void widen_to_f32_ref(const void* src, int64_t off, int64_t n, DType dt, float* dst) {
  const uint16_t* p = static_cast<const uint16_t*>(src) + off;
  if (dt == DType::f16)
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(p[i]);
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(p[i]);
}

void narrow_from_f32_ref(const float* src, int64_t n, DType dt, void* dst, int64_t off) {
  uint16_t* p = static_cast<uint16_t*>(dst) + off;
  if (dt == DType::f16)
    for (int64_t i = 0; i < n; ++i) p[i] = f32_to_f16(src[i]);
  else
    for (int64_t i = 0; i < n; ++i) p[i] = f32_to_bf16(src[i]);
}

namespace {

using WidenFn = void (*)(const void*, int64_t, int64_t, DType, float*);
using NarrowFn = void (*)(const float*, int64_t, DType, void*, int64_t);

struct Converters {
  WidenFn widen = widen_to_f32_ref;
  NarrowFn narrow = narrow_from_f32_ref;
};

const Converters& converters() {
  static const Converters c = [] {
    Converters k;
#if defined(MIXBITS_HAVE_AVX2)
    if (cpu_has_avx2()) k = {widen_to_f32_avx2, narrow_from_f32_avx2};
#elif defined(MIXBITS_HAVE_NEON) && defined(__aarch64__)
    k = {widen_to_f32_neon, narrow_from_f32_neon};
#endif
    return k;
  }();
  return c;
}

}  // namespace

// float32 is a copy on every CPU; the per-ISA versions take half types only.
void widen_to_f32(const void* src, int64_t off, int64_t n, DType dt, float* dst) {
  if (dt == DType::f32)
    std::memcpy(dst, static_cast<const float*>(src) + off, sizeof(float) * size_t(n));
  else
    converters().widen(src, off, n, dt, dst);
}

void narrow_from_f32(const float* src, int64_t n, DType dt, void* dst, int64_t off) {
  if (dt == DType::f32)
    std::memcpy(static_cast<float*>(dst) + off, src, sizeof(float) * size_t(n));
  else
    converters().narrow(src, n, dt, dst, off);
}

}  // namespace mixbits
