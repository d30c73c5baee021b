// The float GEMV kernels of float_matmul: y = x @ W.T for a few rows of x
// (a decode step, a short chunk: M <= gemv_max_rows), reading W in its own
// dtype (float32, float16 or bfloat16) straight from memory. At M = 1 a
// product is bound by reading W once; BLAS would need W in float32, so a
// half W would first be widened (2 bytes read, 4 written, 4 read again per
// element: about 5x the traffic). Larger M goes to BLAS (blas.h), where
// the widening is a few percent of 2M flops per weight.
#pragma once
#include <cstdint>
#include <vector>

#include "common/backend.h"
#include "common/half.h"

namespace mixbits {

// The scalar definition and the AVX2 kernel (8 lanes; AVX-512 adds
// nothing to a memory-bound loop). On arm64 large and small M go to BLAS.
constexpr BackendSet kLinearBackends = backend_set({Backend::Ref, Backend::Avx2});

// Rows of x up to which float_matmul takes the GEMV (when its kernel is
// not the scalar reference), by the weight's dtype. Measured with one
// thread on a Xeon with AVX-512 (bench/bench_float_linear.py, 2816 x 1024
// and 4096 x 4096): OpenBLAS's sgemm is weak at few rows (numpy's own
// reached 8-30 GFLOP/s at M = 2-8, against the GEMV's 28-49 on float32),
// and a half weight must be widened for it first; the GEMV kept ahead
// up to M ~ 16 (float32) and M ~ 32 (float16 / bfloat16).
constexpr int64_t kGemvMaxRowsF32 = 16;
constexpr int64_t kGemvMaxRowsHalf = 32;
inline int64_t gemv_max_rows(DType wt) {
  return wt == DType::f32 ? kGemvMaxRowsF32 : kGemvMaxRowsHalf;
}

// y[m * ldy + n] = sum_k x[m * K + k] * W[n * K + k] for m in [0, M),
// n in [n0, n1): x float32 rows, W (N x K row-major) of dtype wt, y float32.
// Each output's sum is formed the same way whatever n0, n1 and M are (8
// lane partial sums over k in steps of 8, added in a fixed tree, then the
// k tail in order), so the result does not depend on how rows are split
// across threads.
using GemvFn = void (*)(const float* x, int64_t M, const void* w, DType wt, int64_t K,
                        int64_t n0, int64_t n1, float* y, int64_t ldy);

void gemv_ref(const float* x, int64_t M, const void* w, DType wt, int64_t K, int64_t n0,
              int64_t n1, float* y, int64_t ldy);
#if defined(MIXBITS_HAVE_AVX2)
void gemv_avx2(const float* x, int64_t M, const void* w, DType wt, int64_t K, int64_t n0,
               int64_t n1, float* y, int64_t ldy);
#endif

// The kernel for `requested` (Auto: the fastest here); std::invalid_argument
// for a backend this CPU or build lacks.
GemvFn select_gemv(Backend requested, Backend* resolved = nullptr);
std::vector<Backend> available_linear_backends();

}  // namespace mixbits
