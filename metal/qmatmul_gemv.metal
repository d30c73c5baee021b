// GEMV kernel of the mixed-segment quantized matmul y = x · Wᵀ, for few
// rows of x (M <= MB_QMV_MAX_M), in the style of MLX's qmv_fast.
//
// W is a list of K-segments, each stored exactly as MLX stores a quantized
// matrix (see quant_utils.h); the host launches one dispatch per segment
// (qmatmul_params.h, qmatmul_host.h), so the kernel is specialized at
// compile time for one activation dtype, scale dtype, bit width and group
// size. The tiled kernel for more rows is in qmatmul_tiled.metal.
#include "mixbits_metal.h"
#include "qmv_rows.h"

// Threadgroup = 2 simdgroups x 32 lanes; grid = (M, ceil(N / 8)).
// Each simdgroup owns 4 consecutive output rows of x row tid.x and computes
// them with mb_qmv_rows (qmv_rows.h, where the decode and dot are).
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
  const int m = int(tid.x);
  const int row0 = int(tid.y) * MB_QMV_ROWS_PER_GROUP +
                   int(simd_gid) * MB_QMV_ROWS_PER_SIMDGROUP;
  // The whole simdgroup leaves together (no barrier in this kernel), so the
  // simd_sum in mb_qmv_rows always has all 32 lanes.
  if (row0 >= p.N) return;
  // Rows past N are computed from the last valid row and not stored.
  const int last = min(int(MB_QMV_ROWS_PER_SIMDGROUP) - 1, p.N - 1 - row0);

  float v[MB_QMV_ROWS_PER_SIMDGROUP];
  mb_qmv_rows<IO, SC, bits, group_size>(x + size_t(m) * size_t(p.K), perm,
                                        (const device uint8_t*)wq, scales, biases,
                                        p, row0, last, simd_lid, v);
  MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
    if (simd_lid == 0 && r <= last) {
      mb_qmm_store<IO>(acc, out, p, size_t(m) * size_t(p.N) + size_t(row0 + r), v[r]);
    }
  }
}

#define MB_QMV_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_qmv, io, sc, bits, gs)
MB_QMM_LADDER(MB_QMV_INST, "qmv")
