// GEMV kernel of the mixed-segment quantized matmul y = x · Wᵀ, for few
// rows of x (M <= MB_QMV_MAX_M), in the style of MLX's qmv_fast.
//
// W is a list of K-segments, each stored exactly as MLX stores a quantized
// matrix (see quant_utils.h); the host launches one dispatch per segment
// (qmatmul_params.h, qmatmul_host.h), so the kernel is specialized at
// compile time for one activation dtype, scale dtype, bit width and group
// size. The tiled kernel for more rows is in qmatmul_tiled.metal.
#include "mixbits_metal.h"
#include "qmatmul_common.h"

// Threadgroup = 2 simdgroups x 32 lanes; grid = (M, ceil(N / 8)).
// Each simdgroup owns 4 consecutive output rows; each lane walks the
// segment in chunks of 16 columns (lane l starts at 16 l, steps 512), loads
// and pre-scales its 16 activations once, and per row reads the chunk's
// 2*bits bytes of codes as whole words (uint32, or uint16 for odd widths:
// MbChunkWord) and dots them with the activations by masking
// (mb_qdot16). One simd_sum per row at the end.
// The bias is folded: sum_j (s q_j + b) x_j = s sum q_j x_j + b sum x_j.
template <typename IO, typename SC, int bits, int group_size>
[[kernel]] void mb_qmv(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    const device uint32_t* wq [[buffer(2)]],
    const device typename SC::storage* scales [[buffer(3)]],
    const device typename SC::storage* biases [[buffer(4)]],
    device float* acc [[buffer(5)]],
    device typename IO::storage* out [[buffer(6)]],
    constant MbQmmParams& p [[buffer(7)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  typedef typename MbChunkWord<bits>::type Word;
  constexpr int n_words = mb_chunk_words<bits>();

  const int m = int(tid.x);
  const int row0 = int(tid.y) * MB_QMV_ROWS_PER_GROUP +
                   int(simd_gid) * MB_QMV_ROWS_PER_SIMDGROUP;
  // The whole simdgroup leaves together (no barrier in this kernel), so the
  // simd_sum below always has all 32 lanes.
  if (row0 >= p.N) return;
  // Rows past N reuse the last valid row's weights (no bounds check in the
  // inner loop) and are not stored.
  const int last = min(int(MB_QMV_ROWS_PER_SIMDGROUP) - 1, p.N - 1 - row0);

  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);
  const device uint8_t* wbytes = (const device uint8_t*)wq;
  const device typename IO::storage* xrow = x + size_t(m) * size_t(p.K);

  float result[MB_QMV_ROWS_PER_SIMDGROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
  float xs[MB_CHUNK];
  Word w[n_words];

  for (int k = int(simd_lid) * MB_CHUNK; k < p.kseg; k += 32 * MB_CHUNK) {
    const int c0 = p.k0 + k;
    MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
      const int c = c0 + i;
      xs[i] = mb_load_x<IO>(xrow, perm, p, c);
    }
    const float xsum = mb_prescale16<bits>(xs);
    const size_t g = size_t(k / group_size);
    MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
      const size_t n = size_t(row0 + min(r, last));
      // Aligned for Word (see MbChunkWord); the emulator checks it.
      const device Word* wp =
          (const device Word*)(wbytes + n * row_bytes + size_t(k) * bits / 8);
      MB_CHECK_ALIGNED(wp);
      MB_UNROLL for (int j = 0; j < n_words; ++j) w[j] = wp[j];
      const float s = SC::load(scales[n * groups + g]);
      const float b = SC::load(biases[n * groups + g]);
      result[r] += s * mb_qdot16<bits>(w, xs) + b * xsum;
    }
  }

  MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
    const float v = simd_sum(result[r]);
    if (simd_lid == 0 && r <= last) {
      mb_qmm_store<IO>(acc, out, p, size_t(m) * size_t(p.N) + size_t(row0 + r), v);
    }
  }
}

#define MB_QMV_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_qmv, io, sc, bits, gs)
MB_QMM_LADDER(MB_QMV_INST, "qmv")
