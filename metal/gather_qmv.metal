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
// threadgroup memory, shared by all S simdgroups). Its rows are walked in
// runs of equal rhs (one expert), each run in passes of up to MB_QMV_MAX_M
// rows, and each pass is one walk of the segments (mb_qmv_segment,
// qmv_rows.h) for all its rows at once, so an expert's weights are read
// once per pass, not once per row. The host makes the blocks 8 rows when
// the pairs are sorted by expert and then chains them (gp.chained): a run
// belongs whole to the block it starts in, even past the block's end, so
// the 8-row blocks never split an expert's rows between two reads of its
// weights (they did: 64 sorted pairs over 47 experts read 50 experts'
// weights). Unsorted, a block is one output matrix (M rows, one expert).
// Index entries are staged in threadgroup memory, read once per
// threadgroup: rhs of the block's rows, the row before and the 8 after
// (chained; a longer run reads on), lhs of the rows a pass computes. Rows
// whose lhs or rhs is out of range get NaN (the CPU primitive's rule)
// without reading x or W.
#include "mixbits_metal.h"
#include "gather_params.h"
#include "qmv_rows.h"

// Buffers: gather_params.h (MbGatherQmvBuffer); slots of segments past
// q.nseg are bound to a stand-in and never read.
// Threadgroup = S simdgroups x 32 lanes (S = 8, 16, 32: qmv_simdgroups);
// grid = (ceil(N / 4S), ceil(pairs·M / block_rows)). Threadgroup memory:
// MB_GQMV_IDX_FLOATS of index entries (gather_params.h), then x staged for
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
  constexpr int WIN = MB_GQMV_RHS_WINDOW;
  // Index entries as float bits (as_type): the rhs window (rows wbase ..
  // wbase + WIN - 1), then the lhs entries of a pass's rows.
  threadgroup float* win = smem;                      // [WIN]
  threadgroup float* pass_lhs = smem + WIN;           // [MB_QMV_MAX_M]
  threadgroup float* xt = smem + MB_GQMV_IDX_FLOATS;  // [rows][MB_QMV_BLOCK]

  // A simdgroup past N still stages x and meets the barriers: it computes
  // row N - 1 and stores nothing.
  const int row0 = int(tid.x) * int(nsimd) * R + int(simd_gid) * R;
  const bool active = row0 < p.N;
  const int r0 = active ? row0 : p.N - 1;
  const int last = min(R - 1, p.N - 1 - r0);

  const int M = p.M;
  const int rows = gp.pairs * M;
  const int f0 = int(tid.y) * gp.block_rows;
  const int nb = min(gp.block_rows, rows - f0);
  const bool chained = gp.chained != 0;
  // Chained, the block owns the runs that start in its rows f0 .. f0 + nb
  // - 1, each whole (a run may go on past f0 + nb; one that started before
  // f0 is the block before's), so one pass over an expert's weights serves
  // up to MB_QMV_MAX_M rows of its run wherever the blocks split it. The
  // window first holds row f0 - 1 (is f0 a run's start?), then the block's
  // rows and MB_QMV_MAX_M more; a run that goes on past them moves it.
  // Unchained, the block walks its own rows: the window holds them, and
  // their lhs entries are staged with them (the pass staging below is for
  // chained blocks).
  int wbase = chained ? f0 - 1 : f0;
  {
    const int wlen = chained ? min(WIN, rows - wbase) : nb;
    const int f = wbase + int(lid);
    if (int(lid) < wlen && f >= 0) win[lid] = as_type<float>(rhs[f / M]);
    if (!chained && int(lid) < nb) pass_lhs[lid] = as_type<float>(lhs[f / M]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // The walk reads threadgroup memory only and is the same in every thread,
  // so the barriers inside it and inside mb_qmv_segment stay uniform.
#define MB_GQMV_RHS_AT(f) as_type<uint32_t>(win[(f) - wbase])
  int a = f0;  // the first run's start
  if (chained) {
    while (a < f0 + nb && a > 0 && MB_GQMV_RHS_AT(a) == MB_GQMV_RHS_AT(a - 1)) ++a;
  }
  const int run_limit = chained ? rows : f0 + nb;
  while (a < f0 + nb) {
    const uint32_t e = MB_GQMV_RHS_AT(a);
    int t = a + 1;  // the run is rows a .. t - 1
    while (t < run_limit) {
      if (t - wbase >= WIN) {  // chained only: move the window to rows t ..
        threadgroup_barrier(mem_flags::mem_threadgroup);
        wbase = t;
        if (int(lid) < min(WIN, rows - t)) win[lid] = as_type<float>(rhs[(t + int(lid)) / M]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      if (MB_GQMV_RHS_AT(t) != e) break;
      ++t;
    }
    // Passes of up to MB_QMV_MAX_M rows, each one walk of the segments.
    for (int ps = a; ps < t; ps += MB_QMV_MAX_M) {
      const int len = min(int(MB_QMV_MAX_M), t - ps);
      if (e < uint32_t(gp.w_batches)) {
        if (chained) {
          // The last pass read pass_lhs before mb_qmv_segment's barriers.
          if (int(lid) < len) pass_lhs[lid] = as_type<float>(lhs[(ps + int(lid)) / M]);
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        const int lbase = chained ? ps : f0;  // pass_lhs[j]: row lbase + j
        long xrow[MB_QMV_MAX_M];
        MB_UNROLL for (int j = 0; j < MB_QMV_MAX_M; ++j) {
          const uint32_t xi = j < len ? as_type<uint32_t>(pass_lhs[ps - lbase + j]) : 0u;
          xrow[j] = j < len && xi < uint32_t(gp.x_batches)
                        ? (long(xi) * long(M) + long((ps + j) % M)) * long(p.K)
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
                                 size_t(ps + m) * size_t(p.N) + size_t(row0 + r), v);
              }
            }
          }
        }
      } else if (active && simd_lid == 0) {
        for (int m = 0; m < len; ++m) {
          for (int r = 0; r <= last; ++r) {
            mb_qmm_store<IO>(acc_buf, out, p, size_t(ps + m) * size_t(p.N) + size_t(row0 + r),
                             NAN);
          }
        }
      }
    }
    a = t;
  }
#undef MB_GQMV_RHS_AT
}

#define MB_GATHER_QMV_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_gather_qmv, io, sc)
MB_QMM_FUSED_LADDER(MB_GATHER_QMV_INST, "gather_qmv")
