// The int8-activation contract of the quantized matmul (activations="int8")
// and the signatures its CPU kernels implement.
//
// Contract (ggml's Q8 idea on MLX's layout). For every activation row and
// every weight group g (the segment's group size G, columns in the stored,
// permuted order):
//   amax_g = max |x_i|,  d_g = amax_g / 127,  id_g = 127 / amax_g   (float32)
//   x8_i   = round_half_even(x_i * id_g)    (float32 product; |x8| <= 127)
//   ix_g   = sum_i x8_i,  iq_g = sum_i q_i * x8_i        (exact integers)
//   y      = sum_g d_g * (s_g * iq_g + b_g * ix_g)
// i.e. y is the exact dot product of the dequantized weights (s*q + b) with
// the quantized activations d*x8, rounded to float. A group with amax below
// 2^-119 (d would be subnormal, 127/amax may overflow) counts as zero.
// The scalar reference (ref.cpp) evaluates this sum in float64; a SIMD
// kernel equals it up to float rounding of its partial sums.
// Error against the float product: |x_i - d_g*x8_i| <= d_g/2 (plus a few
// ulps of x_i from d_g*id_g != 1), so
//   |y - x.w| <= sum_g (d_g/2) * sum_{i in g} |w_i|       (bench/INT8.md).
//
// Rows with an infinite or NaN x never reach these kernels: the caller
// (qmatmul.cpp) runs such calls on the float path, which has MLX's IEEE
// semantics.
#pragma once
#include <cstdint>
#include <vector>

#include "common/half.h"
#include "qmatmul/kernel.h"
#include "qmatmul_int8/table.h"

namespace mixbits {

// Largest M that runs on the int8 kernels; larger calls (prefill) take the
// float path, whose dequantized-tile GEMM is faster there.
constexpr int kInt8MaxM = 16;
// Groups with max|x| below this count as zero (2^-119: d = amax/127 stays a
// normal float and 127/amax finite).
constexpr float kInt8MinAmax = 1.50463276905252801e-36f;  // 2^-119

// x quantized once per call, per segment (natural column order).
struct Int8Acts {
  // Per segment s: x8[s] [M, k_s], d[s], ix[s], xs[s] [M, groups_s];
  // xs = d * ix (float32), the activation sum the bias multiplies.
  std::vector<std::vector<int8_t>> x8;
  std::vector<std::vector<float>> d, xs;
  std::vector<std::vector<int32_t>> ix;
};

// The contract's quantization of x ([M, K] float32, already permuted).
void int8_quantize(const float* x, int M, const QMatView& w, Int8Acts& a);

// Reference: the contract evaluated in float64 (exact integer sums).
void qmm_int8_ref(const Int8Acts& a, int M, const QMatView& w, float* y,
                  int n0, int n1);

// QmmRun-shaped entry points (quantize once, then all N outputs).
void qmm_int8_ref_run(const float* x, int M, const QMatView& w, float* y);
#if defined(MIXBITS_HAVE_AVX2)
// AVX2 only (maddubs/madd), even where the CPU has VNNI.
void qmm_int8_avx2_run(const float* x, int M, const QMatView& w, float* y);
// The widest integer dot this CPU has (VNNI where present, else AVX2).
void qmm_int8_best_run(const float* x, int M, const QMatView& w, float* y);
#endif
QmmRun select_qmm_int8(Backend requested);

}  // namespace mixbits
