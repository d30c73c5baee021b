// The table decoder of the fp-mode codes for the NEON kernels (neon.cpp,
// neon_t.cpp): a group's values are the 16 signed e2m1 values, or the 256
// e4m3 ones, times its scale, the same float products as the reference.
#pragma once
#include <cstdint>

#include "fpmatmul/kernel.h"

namespace mixbits {
namespace {

struct Tables {
  float e2m1[16];
  float e4m3[256];
  float e8m0[256];
};

const Tables& tables() {
  static const Tables t = [] {
    Tables s;
    for (int i = 0; i < 16; ++i) s.e2m1[i] = e2m1_value(uint32_t(i));
    for (int i = 0; i < 256; ++i) {
      s.e4m3[i] = e4m3_value(uint32_t(i));
      s.e8m0[i] = e8m0_value(uint32_t(i));
    }
    return s;
  }();
  return t;
}

// Groups [g0, g1) of row n of W, decoded into dst[0 .. (g1-g0)·group).
inline void decode_span(const FpView& w, int n, int64_t g0, int64_t g1, float* dst) {
  const Tables& t = tables();
  const int G = fp_mode_group(w.mode);
  const uint32_t* row = w.wq + int64_t(n) * w.words_per_row();
  const uint8_t* srow = w.scales + int64_t(n) * w.groups_per_row();
  for (int64_t g = g0; g < g1; ++g) {
    const float s = w.mode == FpMode::Nvfp4 ? t.e4m3[srow[g]] : t.e8m0[srow[g]];
    float* d = dst + (g - g0) * G;
    if (w.mode == FpMode::Mxfp8) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(row) + g * G;
      for (int i = 0; i < G; ++i) d[i] = t.e4m3[p[i]] * s;
    } else {
      float tab[16];
      for (int i = 0; i < 16; ++i) tab[i] = t.e2m1[i] * s;
      const uint32_t* p = row + g * (G / 8);
      for (int i = 0; i < G; ++i) d[i] = tab[(p[i >> 3] >> (4 * (i & 7))) & 15];
    }
  }
}

}  // namespace
}  // namespace mixbits
