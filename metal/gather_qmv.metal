// Gathered GEMV of the mixed-segment quantized matmul, the Metal kernel of
// MixedGatherQMM (mx.gather_qmm(..., transpose=True) for expert stacks):
//   out[i] = x[lhs[i]] · W[rhs[i]]ᵀ
// over the output matrices' rows taken as one flat list of pairs·M rows
// (row f = i·M + m). As for the dense matmul's other kernels, the host
// launches one dispatch per K-segment (gather_host.h), so the kernel is
// specialized for one activation dtype, scale dtype, bit width and group
// size, and the segments meet in a float32 partial sum.
//
// A threadgroup takes a block of gp.block_rows (<= MB_QMV_MAX_M) flat rows
// and 4S rows of W, like the dense GEMV (qmatmul_gemv.metal: x staged in
// threadgroup memory, shared by all S simdgroups). The block's lhs and rhs
// entries are read once, into threadgroup memory; the block is walked in
// runs of equal rhs (one expert), and each run is one pass over the
// segment (mb_qmv_segment, qmv_rows.h) for all its rows at once, so an
// expert's weights are read once per run, not once per row. The host makes
// the blocks 8 rows when the pairs are sorted by expert (a run is then
// every row of the block with that expert) and one output matrix (M rows,
// one expert) otherwise. Rows whose lhs or rhs is out of range get NaN (the
// CPU primitive's rule) without reading x or W.
#include "mixbits_metal.h"
#include "gather_params.h"
#include "qmv_rows.h"

// Threadgroup = S simdgroups x 32 lanes (S = 8, 16, 32: qmv_simdgroups);
// grid = (ceil(N / 4S), ceil(pairs·M / block_rows)). Threadgroup memory:
// the block's lhs and rhs entries (16 uints), then x staged for
// min(block_rows, pairs·M) rows (gather_host.h sizes it).
template <typename IO, typename SC, int bits, int group_size>
[[kernel]] void mb_gather_qmv(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    const device uint32_t* wq [[buffer(2)]],
    const device typename SC::storage* scales [[buffer(3)]],
    const device typename SC::storage* biases [[buffer(4)]],
    const device uint32_t* lhs [[buffer(5)]],
    const device uint32_t* rhs [[buffer(6)]],
    device float* acc_buf [[buffer(7)]],
    device typename IO::storage* out [[buffer(8)]],
    constant MbGatherParams& gp [[buffer(9)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]],
    uint nsimd [[simdgroups_per_threadgroup]]) {
  constant MbQmmParams& p = gp.q;
  constexpr int R = MB_QMV_ROWS_PER_SIMDGROUP;
  constexpr int group_shift = group_size == 32 ? 5 : group_size == 64 ? 6 : 7;
  static_assert((1 << group_shift) == group_size, "group size 32, 64 or 128");
  // The block's lhs and rhs entries, as float bits (as_type).
  threadgroup float* blk_x = smem;                  // [MB_QMV_MAX_M]
  threadgroup float* blk_w = smem + MB_QMV_MAX_M;   // [MB_QMV_MAX_M]
  threadgroup float* xt = smem + 2 * MB_QMV_MAX_M;  // [rows][MB_QMV_BLOCK]

  // A simdgroup past N still stages x and meets the barriers: it computes
  // row N - 1 and stores nothing.
  const int row0 = int(tid.x) * int(nsimd) * R + int(simd_gid) * R;
  const bool active = row0 < p.N;
  const int r0 = active ? row0 : p.N - 1;
  const int last = min(R - 1, p.N - 1 - r0);

  const int rows = gp.pairs * p.M;
  const int f0 = int(tid.y) * gp.block_rows;
  const int nb = min(gp.block_rows, rows - f0);
  if (int(lid) < nb) {
    const int pair = (f0 + int(lid)) / p.M;
    blk_x[lid] = as_type<float>(lhs[pair]);
    blk_w[lid] = as_type<float>(rhs[pair]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);
  // Runs of equal rhs, the same walk in every thread (threadgroup memory
  // only), so the barriers inside mb_qmv_segment stay uniform.
  for (int s = 0; s < nb;) {
    const uint32_t e = as_type<uint32_t>(blk_w[s]);
    int t = s + 1;
    while (t < nb && as_type<uint32_t>(blk_w[t]) == e) ++t;
    const int len = t - s;
    if (e < uint32_t(gp.w_batches)) {
      long xrow[MB_QMV_MAX_M];
      MB_UNROLL for (int j = 0; j < MB_QMV_MAX_M; ++j) {
        const uint32_t xi = j < len ? as_type<uint32_t>(blk_x[s + j]) : 0u;
        xrow[j] = j < len && xi < uint32_t(gp.x_batches)
                      ? (long(xi) * long(p.M) + long((f0 + s + j) % p.M)) * long(p.K)
                      : -1;
      }
      float acc[MB_QMV_MAX_M * R];
      MB_UNROLL for (int i = 0; i < MB_QMV_MAX_M * R; ++i) acc[i] = 0.0f;
      const size_t mat = size_t(e) * size_t(p.N);
      mb_qmv_segment<IO, SC, bits>(x, xrow, perm, p.has_perm, p.K, p.k0, p.kseg, group_shift,
                                   (const device uint8_t*)wq + mat * row_bytes,
                                   scales + mat * groups, biases + mat * groups, xt, len, r0,
                                   last, lid, simd_lid, int(nsimd) * 32, 1, acc);
      MB_UNROLL for (int m = 0; m < MB_QMV_MAX_M; ++m) {
        if (m < len) {
          MB_UNROLL for (int r = 0; r < R; ++r) {
            const float v = simd_sum(acc[m * R + r]);
            if (active && simd_lid == 0 && r <= last) {
              mb_qmm_store<IO>(acc_buf, out, p,
                               size_t(f0 + s + m) * size_t(p.N) + size_t(row0 + r), v);
            }
          }
        }
      }
    } else if (active && simd_lid == 0) {
      for (int m = 0; m < len; ++m) {
        for (int r = 0; r <= last; ++r) {
          mb_qmm_store<IO>(acc_buf, out, p, size_t(f0 + s + m) * size_t(p.N) + size_t(row0 + r),
                           NAN);
        }
      }
    }
    s = t;
  }
}

#define MB_GATHER_QMV_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_gather_qmv, io, sc, bits, gs)
MB_QMM_LADDER(MB_GATHER_QMV_INST, "gather_qmv")
