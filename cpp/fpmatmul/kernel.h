// CPU kernels of y = x · Wᵀ for MLX's floating-point quantization modes
// (mx.quantize(w, mode=...)): mxfp4 (e2m1 codes, 32 per e8m0 scale),
// nvfp4 (e2m1 codes, 16 per e4m3 scale) and mxfp8 (e4m3 codes, 32 per e8m0
// scale). No MLX types here, so the kernels build for the qemu harness too.
//
// The decoded weight is code value × scale, one float32 product that is
// exact (a code has at most 4 significant bits, a scale at most 4), the
// value mx.dequantize(..., dtype=float32) gives bit for bit, including its
// edge cases: e8m0 255 is 2^128 = inf (MLX computes exp2 in float, not the
// OCP NaN), e8m0 0 is the subnormal 2^-127, e4m3 0x7f / 0xff are NaN.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/backend.h"

namespace mixbits {

enum class FpMode : int { Mxfp4 = 0, Nvfp4 = 1, Mxfp8 = 2 };

// The mode's fixed layout (MLX refuses other group sizes / bits in
// mx.quantize; the kernels assume these).
constexpr int fp_mode_bits(FpMode m) { return m == FpMode::Mxfp8 ? 8 : 4; }
constexpr int fp_mode_group(FpMode m) { return m == FpMode::Nvfp4 ? 16 : 32; }
const char* fp_mode_name(FpMode m);

struct FpView {
  FpMode mode = FpMode::Mxfp4;
  int N = 0;
  int K = 0;               // a multiple of the mode's group size
  const uint32_t* wq = nullptr;     // [N, K*bits/32], codes LSB first
  const uint8_t* scales = nullptr;  // [N, K/group]
  int64_t words_per_row() const { return int64_t(K) * fp_mode_bits(mode) / 32; }
  int64_t groups_per_row() const { return K / fp_mode_group(mode); }
};

// The 8 e2m1 magnitudes; bit 3 of a code is the sign.
constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

inline float bits_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline float e2m1_value(uint32_t c) {
  const float v = kE2m1[c & 7];
  return (c & 8) ? -v : v;
}

// e4m3 (bias 7, no infinities): the definition, written out; the SIMD
// kernels' bit tricks are tested against it.
inline float e4m3_value(uint32_t c) {
  const uint32_t e = (c >> 3) & 15, m = c & 7;
  float v;
  if (e == 15 && m == 7) v = bits_f32(0x7fc00000u);                  // NaN
  else if (e == 0) v = float(m) * (1.0f / 512.0f);                     // m/8 · 2^-6
  else v = (1.0f + float(m) / 8.0f) * bits_f32(uint32_t(e + 120) << 23);  // 2^(e-7)
  return (c & 0x80) ? -v : v;
}

// e8m0 as MLX decodes it: 2^(s-127) in float (s = 0 subnormal, 255 inf).
inline float e8m0_value(uint32_t s) {
  if (s == 0) return bits_f32(0x00400000u);
  if (s == 255) return bits_f32(0x7f800000u);
  return bits_f32(s << 23);
}

inline float fp_scale_value(FpMode m, uint8_t s) {
  return m == FpMode::Nvfp4 ? e4m3_value(s) : e8m0_value(s);
}

// Code j of a row: 4 or 8 bits, LSB first, as MLX packs them.
inline uint32_t fp_code(const uint32_t* row, int64_t j, int bits) {
  return bits == 8 ? (row[j >> 2] >> (8 * (j & 3))) & 0xffu
                   : (row[j >> 3] >> (4 * (j & 7))) & 0xfu;
}

// The decoded weight W[n, j] (the value mx.dequantize gives in float32).
inline float fp_weight(const FpView& w, int n, int64_t j) {
  const int bits = fp_mode_bits(w.mode);
  const uint32_t c = fp_code(w.wq + int64_t(n) * w.words_per_row(), j, bits);
  const float s = fp_scale_value(w.mode, w.scales[int64_t(n) * w.groups_per_row() +
                                                  j / fp_mode_group(w.mode)]);
  return (bits == 8 ? e4m3_value(c) : e2m1_value(c)) * s;
}

// y[m, n] = sum_k x[m, k] * W[n, k] for all M rows and N outputs; x float32
// [M, K], y float32 [M, N]. A backend splits the outputs over threads; each
// output's sum is computed in one fixed order whatever the split, so the
// result does not depend on the number of threads.
using FpmRun = void (*)(const float* x, int M, const FpView& w, float* y);

// Scalar reference: float64 sums of the float32 decoded weights.
void fpm_ref(const float* x, int M, const FpView& w, float* y, int n0, int n1);
void fpm_ref_run(const float* x, int M, const FpView& w, float* y);
#if defined(MIXBITS_HAVE_AVX2)
void fpm_avx2_run(const float* x, int M, const FpView& w, float* y);
// For CPUs with AVX-512F (avx2_512.cpp): 16-lane tiles above 4 x rows,
// fpm_avx2_run up to 4.
void fpm_avx512_run(const float* x, int M, const FpView& w, float* y);
#endif
#if defined(MIXBITS_HAVE_NEON)
void fpm_neon_run(const float* x, int M, const FpView& w, float* y);
#endif

// The product with W not transposed: y[M, C] = x[M, R] · W[R, C] with the
// view's N = R rows and K = C columns (groups along C: MLX's layout for
// transpose=False), also the gradient wrt x of y = x · Wᵀ. Backends split
// the C outputs over threads; each output is summed in one fixed order.
using FpmTRun = void (*)(const float* x, int M, const FpView& w, float* y);
void fpm_t_ref_run(const float* x, int M, const FpView& w, float* y);
#if defined(MIXBITS_HAVE_AVX2)
void fpm_t_avx2_run(const float* x, int M, const FpView& w, float* y);
#endif
#if defined(MIXBITS_HAVE_NEON)
void fpm_t_neon_run(const float* x, int M, const FpView& w, float* y);
#endif

constexpr BackendSet kFpmBackends =
    backend_set({Backend::Ref, Backend::Avx2, Backend::Avx512, Backend::Neon});

// The kernel for `requested` (throws std::invalid_argument if a forced
// backend is unavailable here; Auto: the fastest).
FpmRun select_fpm(Backend requested);
// The same backend's kernel of the product with W not transposed.
FpmTRun select_fpm_t(Backend requested);

}  // namespace mixbits
