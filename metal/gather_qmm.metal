// Tiled gathered kernel of the mixed-segment quantized matmul, for expert
// stacks with many output rows (an MoE layer's prefill):
//   out[i] = x[lhs[i]] · W[rhs[i]]ᵀ,
// the output matrices' rows taken as one flat list of pairs·M rows (row
// r = i·M + m). The gathered GEMV (gather_qmv.metal) reads an expert's
// weights once per pass over up to 8 of its rows; here a threadgroup
// computes a 32 × 32 block of outputs with the dense tiled kernel's K walk
// (mb_qmm_segment, qmm_tile_segment.h: double-buffered x and dequantized W
// tiles in threadgroup memory, one barrier per 32-column step, the perm
// entries staged a step ahead, 8 × 8 simdgroup matrices), so an expert's
// weight tile is read once per 32 rows that use it. With the pairs sorted
// by expert (mlx-lm sorts them for prefill) the 32 rows of a block mostly
// share one expert; a block walks the runs of equal rhs among its rows in
// order (its lhs and rhs entries staged once in threadgroup memory), each
// run one pass over every segment of the table with the run's rows packed
// at the top of the x tile, so the pass multiplies only the 8-row fragments
// that hold them (a run of 8 rows: 1 of the tile's 4, not all 4) and
// stores each packed row to its place. Unsorted indices stay correct (more
// runs, more passes). Rows whose lhs or rhs is out of range get NaN (the
// CPU primitive's rule), without reading x or W.
//
// As the dense kernels and the gathered GEMV, ONE dispatch computes the
// whole product: the kernel walks the segment table (MbGatherFusedParams,
// gather_params.h, the GEMV's parameter block and buffer slots) and
// accumulates in registers, with no float32 partial sum between segments
// (past MB_QMM_MAX_SEGS segments the host splits the product into
// dispatches that pass one, as for the dense kernels); each segment is
// decoded by a template for its width (MB_QMM_SWITCH_BITS, once per segment
// and run). Instantiated per activation dtype x scale dtype only.
#include "mixbits_metal.h"
#include "gather_params.h"
#include "qmatmul_common.h"
#include "qmm_tile_segment.h"

// Threadgroup = 4 simdgroups (128 threads); grid = (ceil(N / 32),
// ceil(pairs·M / 32)). Threadgroup memory as the dense tiled kernel's with
// 32-row blocks, then the block's indices (mb_gather_qmm_tg_floats,
// gather_params.h). Buffers: gather_params.h
// (MbGatherQmvBuffer); slots of segments past q.nseg are bound to a
// stand-in and never read.
template <typename IO, typename SC>
[[kernel]] void mb_gather_qmm(
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
    uint simd_gid [[simdgroup_index_in_threadgroup]]) {
  static_assert(MB_QMM_BK % 8 == 0 && MB_QMM_BK <= 32, "a BK step lies in one group");
  const device uint32_t* wqs[MB_QMM_MAX_SEGS] = {wq0, wq1, wq2, wq3, wq4, wq5, wq6, wq7};
  const device typename SC::storage* scs[MB_QMM_MAX_SEGS] = {
      scales0, scales1, scales2, scales3, scales4, scales5, scales6, scales7};
  const device typename SC::storage* bis[MB_QMM_MAX_SEGS] = {
      biases0, biases1, biases2, biases3, biases4, biases5, biases6, biases7};
  constant MbQmmFusedParams& p = gp.q;
  constexpr int BM = MB_QMM_BM;
  constexpr int BN = MB_QMM_BN;
  constexpr int TILE = mb_qmm_buffer_floats(BM, sizeof(typename IO::storage),
                                            sizeof(typename MbWTile<IO, SC>::type));
  constexpr int CS = BN + 4;
  static_assert(BM * CS <= TILE, "the output tile fits one tile buffer");
  // After the two tile buffers and the perm entries: the block's rhs, then
  // lhs entries, one per flat row (int bits), staged once.
  constexpr int IDX = 2 * TILE + 2 * MB_QMM_BK;
  static_assert(IDX + 2 * BM == mb_gather_qmm_tg_floats(sizeof(typename IO::storage),
                                                        sizeof(typename MbWTile<IO, SC>::type)),
                "gather_params.h sizes this kernel's threadgroup memory");

  const int n0 = int(tid.x) * BN;
  const int r0 = int(tid.y) * BM;
  const int nr = min(BM, gp.pairs * p.M - r0);  // flat rows of this block

  // Loader role: row `lrow` of the x tile (mb_qmm_segment); the same thread
  // stores the output row in row lrow of the staged outputs, columns
  // n0 + lcol .. + 7.
  const int lrow = int(lid) / 4;
  const int lcol = (int(lid) % 4) * 8;

  // MMA role: this simdgroup's 16 x 16 block of the tile.
  const int sm = 16 * (int(simd_gid) / (BN / 16));
  const int sn = 16 * (int(simd_gid) % (BN / 16));

  // The block's indices, rhs then lhs of each flat row, read once (threads
  // 0 .. 63), and the first step's perm entries (threads 64 .. 95; a run's
  // later steps are staged a step ahead by mb_qmm_segment, each run
  // restages them, below).
  if (lid < uint(2 * BM)) {
    const int t = int(lid) % BM;
    const device uint32_t* ix = lid < uint(BM) ? rhs : lhs;
    smem[IDX + int(lid)] = as_type<float>(t < nr ? ix[(r0 + t) / p.M] : 0u);
  } else if (p.has_perm && lid < uint(2 * BM + MB_QMM_BK)) {
    const int t = int(lid) - 2 * BM;
    smem[2 * TILE + t] = as_type<float>(mb_perm_col(perm, 1, p.K, p.seg[0].k0 + t));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
#define MB_GQMM_RHS(t) as_type<uint32_t>(smem[IDX + (t)])
#define MB_GQMM_LHS(t) as_type<uint32_t>(smem[IDX + BM + (t)])

  // The runs of equal rhs among the block's rows: the same walk in every
  // thread, so barriers stay uniform. A run's L rows are packed into rows
  // 0 .. L - 1 of the x tile (thread row lrow holds the run's row lrow), so
  // its MMAs cover ceil(L / 8) 8-row fragments, not the whole 32-row tile:
  // mb_qmm_segment skips the fragments at or past L.
  for (int start = 0; start < nr;) {
    const uint e = MB_GQMM_RHS(start);
    int end = start + 1;
    while (end < nr && MB_GQMM_RHS(end) == e) ++end;
    if (e < uint(gp.w_batches)) {
      const int L = end - start;
      const int frow = r0 + start + lrow;  // this thread's flat row (if lrow < L)
      const uint xi = lrow < L ? MB_GQMM_LHS(start + lrow) : 0u;
      const bool mine = lrow < L && xi < uint(gp.x_batches);
      const device typename IO::storage* xrow =
          x + (size_t(mine ? xi : 0u) * size_t(p.M) + size_t(mine ? frow % p.M : 0)) * size_t(p.K);
      simdgroup_float8x8 c[4];
      MB_UNROLL for (int i = 0; i < 4; ++i) {
        c[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
      const size_t mat = size_t(e) * size_t(p.N);  // expert e's first row
      int step = 0;  // over the run's steps, all segments: picks the tile buffer
      for (int s = 0; s < p.nseg; ++s) {
        constant MbQmmSeg& g = p.seg[s];
        const size_t groups = size_t(g.kseg) >> g.group_shift;
#define MB_GQMM_SEG(B)                                                                      \
  mb_qmm_segment<IO, SC, B, BM>(                                                            \
      xrow, mine, perm, (const device uint8_t*)wqs[s] + mat * (size_t(g.kseg) * B / 8),     \
      scs[s] + mat * groups, bis[s] + mat * groups, p, g, smem, n0, lid, simd_gid, L, step, c)
        MB_QMM_SWITCH_BITS(g.bits, MB_GQMM_SEG)
#undef MB_GQMM_SEG
      }
      // Stage the outputs of the run's fragments, [BM][CS], in the tile
      // buffer the last step did not use (every thread finished reading it
      // before the last step's barrier); each thread then stores its packed
      // row's 8 outputs to the row's place.
      threadgroup float* ct = smem + (step & 1) * TILE;
      MB_UNROLL for (int i = 0; i < 2; ++i) {
        if (sm + 8 * i < L) {
          MB_UNROLL for (int j = 0; j < 2; ++j) {
            simdgroup_store(c[2 * i + j], ct, CS, ulong2(ulong(sn + 8 * j), ulong(sm + 8 * i)));
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (mine) {
        MB_UNROLL for (int i = 0; i < 8; ++i) {
          const int n = n0 + lcol + i;
          if (n < p.N) {
            mb_qmm_store<IO>(acc_buf, out, p, size_t(frow) * size_t(p.N) + size_t(n),
                             ct[lrow * CS + lcol + i]);
          }
        }
      }
      // The next run starts at the first step again: its perm entries into
      // buffer 0 (every read of the perm buffers was before the last step's
      // barrier), and its tiles overwrite ct once every thread has stored.
      if (p.has_perm && lid < uint(MB_QMM_BK)) {
        smem[2 * TILE + int(lid)] = as_type<float>(mb_perm_col(perm, 1, p.K, p.seg[0].k0 + int(lid)));
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    start = end;
  }
  // Rows whose lhs or rhs is out of range: NaN (thread row lrow: flat row
  // r0 + lrow), x and W never read for them.
  if (lrow < nr && (MB_GQMM_RHS(lrow) >= uint(gp.w_batches) ||
                    MB_GQMM_LHS(lrow) >= uint(gp.x_batches))) {
    MB_UNROLL for (int i = 0; i < 8; ++i) {
      const int n = n0 + lcol + i;
      if (n < p.N) {
        mb_qmm_store<IO>(acc_buf, out, p, size_t(r0 + lrow) * size_t(p.N) + size_t(n), NAN);
      }
    }
  }
#undef MB_GQMM_RHS
#undef MB_GQMM_LHS
}

#define MB_GATHER_QMM_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_gather_qmm, io, sc)
MB_QMM_FUSED_LADDER(MB_GATHER_QMM_INST, "gather_qmm")
