// Gathered GEMV of the mixed-segment quantized matmul, the Metal kernel of
// MixedGatherQMM (mx.gather_qmm(..., transpose=True) for expert stacks):
//   out[i] = x[lhs[i]] · W[rhs[i]]ᵀ
// over the output matrices' rows taken as one flat list of pairs·M rows
// (row f = i·M + m). As the dense kernels do, ONE dispatch computes the
// whole product: the kernel walks the segment table (MbGatherFusedParams,
// gather_params.h: up to MB_QMM_MAX_SEGS segments, each with its own
// stacked arrays) and accumulates in registers, each segment decoded by a
// template for its width (MB_QMM_SWITCH_BITS, once per segment and run);
// instantiated per activation dtype x scale dtype only.
//
// A threadgroup takes a block of gp.block_rows (<= MB_QMV_MAX_M) flat rows
// and 4S rows of W, like the dense GEMV (qmatmul_gemv.metal: x staged in
// threadgroup memory, shared by all S simdgroups). The block's lhs and rhs
// entries are read once, into threadgroup memory; the block is walked in
// runs of equal rhs (one expert), and each run is one pass over the
// segments (mb_qmv_segment, qmv_rows.h) for all its rows at once, so an
// expert's weights are read once per run, not once per row. The host makes
// the blocks 8 rows when the pairs are sorted by expert (a run is then
// every row of the block with that expert) and one output matrix (M rows,
// one expert) otherwise. Rows whose lhs or rhs is out of range get NaN (the
// CPU primitive's rule) without reading x or W.
#include "mixbits_metal.h"
#include "gather_params.h"
#include "qmv_rows.h"

// Buffers: gather_params.h (MbGatherQmvBuffer); slots of segments past
// q.nseg are bound to a stand-in and never read.
// Threadgroup = S simdgroups x 32 lanes (S = 8, 16, 32: qmv_simdgroups);
// grid = (ceil(N / 4S), ceil(pairs·M / block_rows)). Threadgroup memory:
// the block's lhs and rhs entries (16 uints), then x staged for
// min(block_rows, pairs·M) rows (gather_host.h sizes it).
template <typename IO, typename SC>
[[kernel]] void mb_gather_qmv(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    const device uint32_t* lhs [[buffer(2)]],
    const device uint32_t* rhs [[buffer(3)]],
    device float* acc_buf [[buffer(4)]],
    device typename IO::storage* out [[buffer(5)]],
    const device uint32_t* wq0 [[buffer(6)]],
    const device typename SC::storage* scales0 [[buffer(7)]],
    const device typename SC::storage* biases0 [[buffer(8)]],
    const device uint32_t* wq1 [[buffer(9)]],
    const device typename SC::storage* scales1 [[buffer(10)]],
    const device typename SC::storage* biases1 [[buffer(11)]],
    const device uint32_t* wq2 [[buffer(12)]],
    const device typename SC::storage* scales2 [[buffer(13)]],
    const device typename SC::storage* biases2 [[buffer(14)]],
    const device uint32_t* wq3 [[buffer(15)]],
    const device typename SC::storage* scales3 [[buffer(16)]],
    const device typename SC::storage* biases3 [[buffer(17)]],
    const device uint32_t* wq4 [[buffer(18)]],
    const device typename SC::storage* scales4 [[buffer(19)]],
    const device typename SC::storage* biases4 [[buffer(20)]],
    const device uint32_t* wq5 [[buffer(21)]],
    const device typename SC::storage* scales5 [[buffer(22)]],
    const device typename SC::storage* biases5 [[buffer(23)]],
    const device uint32_t* wq6 [[buffer(24)]],
    const device typename SC::storage* scales6 [[buffer(25)]],
    const device typename SC::storage* biases6 [[buffer(26)]],
    const device uint32_t* wq7 [[buffer(27)]],
    const device typename SC::storage* scales7 [[buffer(28)]],
    const device typename SC::storage* biases7 [[buffer(29)]],
    constant MbGatherFusedParams& gp [[buffer(30)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]],
    uint nsimd [[simdgroups_per_threadgroup]]) {
  const device uint32_t* wqs[MB_QMM_MAX_SEGS] = {wq0, wq1, wq2, wq3, wq4, wq5, wq6, wq7};
  const device typename SC::storage* scs[MB_QMM_MAX_SEGS] = {
      scales0, scales1, scales2, scales3, scales4, scales5, scales6, scales7};
  const device typename SC::storage* bis[MB_QMM_MAX_SEGS] = {
      biases0, biases1, biases2, biases3, biases4, biases5, biases6, biases7};
  constant MbQmmFusedParams& p = gp.q;
  constexpr int R = MB_QMV_ROWS_PER_SIMDGROUP;
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
      const size_t mat = size_t(e) * size_t(p.N);  // expert e's first row
      for (int sg = 0; sg < p.nseg; ++sg) {
        constant MbQmmSeg& g = p.seg[sg];
        const size_t groups = size_t(g.kseg) >> g.group_shift;
#define MB_GQMV_SEG(B)                                                                       \
  mb_qmv_segment<IO, SC, B>(x, xrow, perm, p.has_perm, p.K, g.k0, g.kseg, g.group_shift,      \
                            (const device uint8_t*)wqs[sg] + mat * (size_t(g.kseg) * B / 8), \
                            scs[sg] + mat * groups, bis[sg] + mat * groups, xt, len, r0, last, \
                            lid, simd_lid, int(nsimd) * 32, 1, acc)
        MB_QMM_SWITCH_BITS(g.bits, MB_GQMV_SEG)
#undef MB_GQMV_SEG
      }
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

#define MB_GATHER_QMV_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_gather_qmv, io, sc)
MB_QMM_FUSED_LADDER(MB_GATHER_QMV_INST, "gather_qmv")
