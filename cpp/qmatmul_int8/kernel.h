// The integer-activation contracts of the quantized matmul
// (activations="int8" and "int16") and the signatures their CPU kernels
// implement. The two differ only in the width of the activation codes
// (T = int8_t, Q = 127; T = int16_t, Q = 32767).
//
// Contract (ggml's Q8 idea on MLX's layout). For every activation row and
// every weight group g (the segment's group size G, columns in the stored,
// permuted order):
//   amax_g = max |x_i|,  d_g = amax_g / Q,  id_g = Q / amax_g       (float32)
//   xq_i   = round_half_even(x_i * id_g)    (float32 product; |xq| <= Q)
//   ix_g   = sum_i xq_i,  iq_g = sum_i q_i * xq_i        (exact integers)
//   y      = sum_g d_g * (s_g * iq_g + b_g * ix_g)
// i.e. y is the exact dot product of the dequantized weights (s*q + b) with
// the quantized activations d*xq, rounded to float. A group with amax below
// kIntMinAmax<T> (d would be subnormal, Q/amax may overflow) counts as zero.
// The scalar reference (ref.cpp) evaluates this sum in float64; a SIMD
// kernel equals it up to float rounding of its partial sums.
// Error against the float product: |x_i - d_g*xq_i| <= d_g/2 (plus a few
// ulps of x_i from d_g*id_g != 1), so
//   |y - x.w| <= sum_g (d_g/2) * sum_{i in g} |w_i|       (bench/INT8.md).
// int16 codes make d 258x smaller: the same integer dots (16-bit pairs
// instead of bytes) at a quarter-million-fold smaller squared error, which
// is what a model's KL needs where int8's per-group scale is too coarse
// (activations with outlier channels).
//
// Rows with an infinite or NaN x never reach these kernels: the caller
// (qmatmul.cpp) runs such calls on the float path, which has MLX's IEEE
// semantics.
#pragma once
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/half.h"
#include "qmatmul/kernel.h"
#include "qmatmul_int8/repack.h"
#include "qmatmul_int8/table.h"

namespace mixbits {

// Largest M that runs on the integer kernels; larger calls (prefill) take the
// float path, whose dequantized-tile GEMM is faster there.
constexpr int kInt8MaxM = 16;
// The largest code Q of the contract with codes of type T.
template <class T>
constexpr float kIntQMax = float(std::numeric_limits<T>::max());
// Groups with max|x| below this count as zero: d = amax/Q stays a normal
// float and Q/amax finite (2^-119 for Q = 127, 2^-111 for Q = 32767).
template <class T>
constexpr float kIntMinAmax = std::is_same_v<T, int8_t> ? 1.50463276905252801e-36f   // 2^-119
                                                        : 3.85185988877447171e-34f;  // 2^-111

// x quantized once per call, per segment (natural column order).
template <class T>
struct IntActs {
  // Per segment s: xq[s] [M, k_s], d[s], ix[s], xs[s] [M, groups_s];
  // xs = d * ix (float32), the activation sum the bias multiplies.
  std::vector<std::vector<T>> xq;
  std::vector<std::vector<float>> d, xs;
  std::vector<std::vector<int32_t>> ix;
};

// The contract's quantization of x ([M, K] float32, already permuted): the
// one definition every backend uses.
template <class T>
void int_quantize(const float* x, int M, const QMatView& w, IntActs<T>& a);

// Reference: the contract evaluated in float64 (exact integer sums).
template <class T>
void qmm_int_ref(const IntActs<T>& a, int M, const QMatView& w, float* y, int n0, int n1);

// QmmRun-shaped entry points (quantize once, then all N outputs).
void qmm_int8_ref_run(const float* x, int M, const QMatView& w, float* y);
void qmm_int16_ref_run(const float* x, int M, const QMatView& w, float* y);
#if defined(MIXBITS_HAVE_AVX2)
// AVX2 only (maddubs/madd), even where the CPU has VNNI.
void qmm_int8_avx2_run(const float* x, int M, const QMatView& w, float* y);
void qmm_int16_avx2_run(const float* x, int M, const QMatView& w, float* y);
// The widest integer dot this CPU has (VNNI where present, else AVX2).
void qmm_int8_best_run(const float* x, int M, const QMatView& w, float* y);
void qmm_int16_best_run(const float* x, int M, const QMatView& w, float* y);
#endif
#if defined(MIXBITS_HAVE_NEON)
void qmm_int8_neon_run(const float* x, int M, const QMatView& w, float* y);
void qmm_int16_neon_run(const float* x, int M, const QMatView& w, float* y);
#endif
QmmRun select_qmm_int8(Backend requested);
QmmRun select_qmm_int16(Backend requested);

// The repacked layout (repack.h; repacked_run.cpp). The kernel table this
// build and CPU run for int8 (int16 = false) or int16 codes under
// `backend`, or null where calls on a repacked weight un-repack it.
const RTable* select_repacked(bool int16, Backend backend);
// Rows from which int8 calls on a repacked weight take the table's GEMM
// (t.gemm_min_m unless overridden); 0: never (no GEMM, or not by default).
// set_repacked_gemm_min_m(n) overrides the tables' value for the process
// (n = 0: never, n < 0: restore): for tests (the GEMM against the GEMV's
// passes, bit for bit) and for measuring the crossover in one run, as
// set_max_threads; never read from the environment.
int repacked_gemm_min_m(const RTable& t);
void set_repacked_gemm_min_m(int n);
// The contract on repacked segments: x quantized once, its codes put in
// repacked_x_col order, blocks of 16 rows over threads; rsegs[i] is
// shape.segs[i] repacked (shape's wq/scales/biases are not read).
template <class T>
void repacked_int_run(const RTable& t, const float* x, int M, const QMatView& shape,
                      const RSeg* rsegs, float* y);

}  // namespace mixbits
