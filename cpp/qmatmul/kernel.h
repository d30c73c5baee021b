// Backend-neutral description of a mixed-segment quantized matrix and the
// signature every CPU backend (ref, avx2, neon) implements. No MLX types
// here, so kernels can be tested and benchmarked on raw buffers.
#pragma once
#include <cstdint>
#include <vector>

#include "common/backend.h"
#include "common/half.h"

namespace mixbits {

// One K-segment, stored exactly as MLX stores a quantized matrix.
struct SegView {
  int bits;        // 2,3,4,5,6,8
  int group_size;  // 32,64,128
  int k0;          // first input column (in the permuted order)
  int k;           // number of columns
  const uint32_t* wq;    // [N, k*bits/32], LSB-first bitstream per row
  const void* scales;    // [N, k/group_size], dtype = QMatView::sdtype
  const void* biases;    // same shape and dtype as scales
  int64_t words_per_row() const { return int64_t(k) * bits / 32; }
  int64_t groups_per_row() const { return k / group_size; }
};

// The column of a per-ISA kernel table ([bits][column]) for a group size:
// 0 for g32, 1 for g64, 2 for g128 (the only sizes the builders accept).
constexpr int group_size_col(int group_size) {
  return group_size == 32 ? 0 : group_size == 64 ? 1 : 2;
}

struct QMatView {
  int N = 0;
  int K = 0;
  DType sdtype = DType::f32;
  std::vector<SegView> segs;
  // The segments' arrays in the row-interleaved layout of
  // qmatmul_int8/repack.h instead (wq [NB, words, 16], 3/5/6-bit words split;
  // scales, biases [NB, groups, 16]): the same values in 16-row blocks.
  // Only a kernel select_qmm_repacked returned reads such a view.
  bool repacked = false;
};

// y[m, n] = sum_k x[m, k] * W[n, k] for rows m < M and outputs n in [n0, n1).
// x is float32 [M, K], already gathered through the permutation; y is
// float32 [M, N] (row stride N). Every backend has this signature.
using QmmFn = void (*)(const float* x, int M, const QMatView& w, float* y,
                       int n0, int n1);

void qmm_ref(const float* x, int M, const QMatView& w, float* y, int n0,
             int n1);

// A whole evaluation: y = x · Wᵀ over all M rows and N outputs, float32 in
// and out. A backend does its once-per-call work here (activations
// re-ordered for its decode, per-group sums of x) and then splits the
// outputs over threads with parallel_for.
using QmmRun = void (*)(const float* x, int M, const QMatView& w, float* y);

void qmm_ref_run(const float* x, int M, const QMatView& w, float* y);
#if defined(MIXBITS_HAVE_AVX2)
// Rows of the x86 kernel table (avx2_table.h): 8-lane, and 16-lane for
// CPUs with AVX-512F.
void qmm_avx2_run(const float* x, int M, const QMatView& w, float* y);
void qmm_avx512_run(const float* x, int M, const QMatView& w, float* y);
#endif
#if defined(MIXBITS_HAVE_NEON)
void qmm_neon_run(const float* x, int M, const QMatView& w, float* y);
#endif

// A float-contract kernel that reads a repacked QMatView in place, for
// calls of more than min_m rows; it runs the prefill GEMM whatever the row
// count, so its result is bit for bit what `run` gives on MLX's layout
// wherever `run` takes that GEMM too (above the row's small_m), and equal
// to float rounding below. run null: the backend has none, and the caller
// un-repacks W into MLX's layout first.
struct QmmRepacked {
  QmmRun run = nullptr;
  int min_m = 0;
  // Bit widths whose repacked segments it reads, at every group size (bit
  // b set: b bits); a view with any other segment is un-repacked instead.
  uint32_t bits_read = 0;
  bool reads(const QMatView& w) const {
    for (const SegView& s : w.segs)
      if (!(bits_read >> s.bits & 1u)) return false;
    return true;
  }
};
QmmRepacked select_qmm_repacked(Backend requested);
#if defined(MIXBITS_HAVE_AVX2)
QmmRepacked qmm_avx2_repacked();
QmmRepacked qmm_avx512_repacked();
#endif

// The transposed product, the gradient of y = x · Wᵀ wrt x:
// dx[m, k] = sum_n dy[m, n] * W[n, k] for rows m < M and all K columns (in
// the permuted order: the caller un-permutes). dy is float32 [M, N], dense;
// dx is float32 [M, K] (row stride K). Backends split the K output columns
// over threads, so no two threads write the same dx element.
using QmmTRun = void (*)(const float* dy, int M, const QMatView& w, float* dx);

// The scalar reference for dx columns [k0, k1), float64 sums.
void qmm_t_ref(const float* dy, int M, const QMatView& w, float* dx, int k0,
               int k1);
void qmm_t_ref_run(const float* dy, int M, const QMatView& w, float* dx);
#if defined(MIXBITS_HAVE_AVX2)
void qmm_t_avx2_run(const float* dy, int M, const QMatView& w, float* dx);
void qmm_t_avx512_run(const float* dy, int M, const QMatView& w, float* dx);
#endif
#if defined(MIXBITS_HAVE_NEON)
void qmm_t_neon_run(const float* dy, int M, const QMatView& w, float* dx);
#endif

// The backends with float-contract kernels, both directions.
constexpr BackendSet kQmmBackends =
    backend_set({Backend::Ref, Backend::Avx2, Backend::Avx512, Backend::Neon});

// The kernel for `requested` on this CPU (resolve_backend: throws
// std::invalid_argument if it is forced but unavailable; Auto picks the
// fastest). One choice serves both directions: select_qmm_t(b) is the
// transposed kernel of the backend select_qmm(b) runs.
QmmRun select_qmm(Backend requested);
QmmTRun select_qmm_t(Backend requested);
// Whether the CPU gradient wrt x takes the transposed kernel for
// `requested` rather than MLX's dequantize + matmul: yes where it is x86
// SIMD (AVX2, AVX-512) or the caller forced a backend. Auto on arm64 keeps
// MLX's matmul (Accelerate's sgemm on macOS): the NEON transposed kernel
// is checked under qemu but its speed against Accelerate is unmeasured.
bool prefer_qmm_t(Backend requested);
// Backends usable on this machine, for tests and benchmarks.
std::vector<Backend> available_qmm_backends();

// Extract code j (0-based) of a row bitstream: the LSB-first layout MLX uses.
inline uint32_t unpack_code(const uint32_t* row, int64_t j, int bits) {
  int64_t bit = j * bits;
  int64_t w = bit >> 5;
  int sh = int(bit & 31);
  uint64_t v = row[w] >> sh;
  if (sh + bits > 32) v |= uint64_t(row[w + 1]) << (32 - sh);
  return uint32_t(v) & ((1u << bits) - 1u);
}

}  // namespace mixbits
