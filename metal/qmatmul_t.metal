// Transposed product of the mixed-segment quantized matmul, the Metal
// kernel of MixedQMatmulT (the gradient wrt x on a GPU stream):
//   dx = dy · W, un-permuted to x's column order
// for few rows of dy (M <= MB_QT_MAX_M: the vjp of decode-sized calls), in
// ONE dispatch whatever the segment count, the permutation included
// (qmatmul_t_params.h; the host plan in qmatmul_t_host.h). Instantiated
// per dy dtype x scale dtype; each threadgroup's segment gives its bits
// (one switch, uniform over the threadgroup) and group size.
#include "mixbits_metal.h"
#include "qmv_t_cols.h"

// Threadgroup (t, r): one block of sets x 128 columns (whole groups; sets
// = p.qmv_sets, 64 threads each) of one segment, rows 8 r .. 8 r + 7 of dy
// (every row at M <= 8); grid = (sum over segments of ceil(kseg / (128
// sets)), ceil(M / 8)). With a perm,
// every threadgroup first reads all of perm: a K-bit map in threadgroup
// memory finds entries out of range and repeated ones, and the block's own
// entries are kept for the scatter. Then, the CPU primitive's cases:
//   bijective     the block's columns are computed and stored to
//                 dx[m, perm[k]] (each dx column written once in all);
//   out of range  the threadgroup writes NaN over dx columns k0 + block ..
//                 (the blocks tile [0, K), so every element is NaN);
//   repeats       the threadgroup computes dx columns j = k0 + block + c
//                 itself: the sum over the k with perm[k] = j, in k order,
//                 of z[m, k], each z a column of W walked row by row (slow,
//                 but only a hand-built perm gets here).
template <typename IO, typename SC>
[[kernel]] void mb_qmv_t(
    const device typename IO::storage* dy [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    device typename IO::storage* out [[buffer(2)]],
    const device uint32_t* wq0 [[buffer(3)]],
    const device typename SC::storage* scales0 [[buffer(4)]],
    const device typename SC::storage* biases0 [[buffer(5)]],
    const device uint32_t* wq1 [[buffer(6)]],
    const device typename SC::storage* scales1 [[buffer(7)]],
    const device typename SC::storage* biases1 [[buffer(8)]],
    const device uint32_t* wq2 [[buffer(9)]],
    const device typename SC::storage* scales2 [[buffer(10)]],
    const device typename SC::storage* biases2 [[buffer(11)]],
    const device uint32_t* wq3 [[buffer(12)]],
    const device typename SC::storage* scales3 [[buffer(13)]],
    const device typename SC::storage* biases3 [[buffer(14)]],
    const device uint32_t* wq4 [[buffer(15)]],
    const device typename SC::storage* scales4 [[buffer(16)]],
    const device typename SC::storage* biases4 [[buffer(17)]],
    const device uint32_t* wq5 [[buffer(18)]],
    const device typename SC::storage* scales5 [[buffer(19)]],
    const device typename SC::storage* biases5 [[buffer(20)]],
    const device uint32_t* wq6 [[buffer(21)]],
    const device typename SC::storage* scales6 [[buffer(22)]],
    const device typename SC::storage* biases6 [[buffer(23)]],
    const device uint32_t* wq7 [[buffer(24)]],
    const device typename SC::storage* scales7 [[buffer(25)]],
    const device typename SC::storage* biases7 [[buffer(26)]],
    constant MbQmmFusedParams& p [[buffer(27)]],
    threadgroup float* tg [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  const device uint32_t* wqs[MB_QMM_MAX_SEGS] = {wq0, wq1, wq2, wq3, wq4, wq5, wq6, wq7};
  const device typename SC::storage* scs[MB_QMM_MAX_SEGS] = {
      scales0, scales1, scales2, scales3, scales4, scales5, scales6, scales7};
  const device typename SC::storage* bis[MB_QMM_MAX_SEGS] = {
      biases0, biases1, biases2, biases3, biases4, biases5, biases6, biases7};
  const int sets = p.qmv_sets, nthreads = sets * MB_QT_THREADS, width = sets * MB_QT_COLS;
  int block = 0;
  const int s = mb_qt_find_block(p, int(tid.x), sets, block);
  const int bits = p.seg[s].bits, gshift = p.seg[s].group_shift, kseg = p.seg[s].kseg;
  const int kc0 = p.seg[s].k0 + block;  // the block's first packed column
  const int ncols = min(width, kseg - block);
  // Rows m0 .. m0 + M - 1 of dy (grid.y = ceil(p.M / 8): one threadgroup
  // row at the M <= MB_QT_MAX_M eval_gpu sends here).
  const int m0 = int(tid.y) * MB_QT_MAX_M;
  const int M = min(int(MB_QT_MAX_M), p.M - m0), N = p.N, K = p.K;
  dy += size_t(m0) * size_t(N);
  out += size_t(m0) * size_t(K);

  threadgroup float* red = tg;  // dy's stage, then [M][width]
  threadgroup int32_t* flags = MB_TG_CAST(int32_t, tg + mb_qt_red_words(M, sets));
  threadgroup int32_t* cols = flags + nthreads;  // the block's perm entries
  threadgroup uint32_t* map = MB_TG_CAST(uint32_t, cols + width);

  int32_t status = MB_PERM_BIJECTIVE;
  if (p.has_perm) {
    const int words = mb_qt_map_words(K);
    for (int w = int(lid); w < words; w += nthreads) map[w] = 0u;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int32_t st = MB_PERM_BIJECTIVE;
    // Entries compared as unsigned: a uint32 entry >= 2^31 (read as int32
    // bits) is out of range, as on the CPU.
    for (int k = int(lid); k < K; k += nthreads) {
      const uint32_t j = uint32_t(perm[k]);
      if (uint32_t(k - kc0) < uint32_t(ncols)) cols[k - kc0] = int32_t(j);
      if (j >= uint32_t(K)) {
        st = MB_PERM_OUT_OF_RANGE;
      } else {
        const uint32_t bit = 1u << (j & 31u);
        if (mb_tg_fetch_or(&map[j >> 5], bit) & bit) st = max(st, int32_t(MB_PERM_REPEATS));
      }
    }
    flags[lid] = st;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int t = 0; t < nthreads; ++t) status = max(status, flags[t]);
  }

  if (status == MB_PERM_OUT_OF_RANGE) {
    for (int idx = int(lid); idx < M * width; idx += nthreads) {
      const int m = idx / width, c = idx % width;
      if (c < ncols) out[size_t(m) * size_t(K) + size_t(kc0 + c)] = IO::store(NAN);
    }
    return;
  }
  if (status == MB_PERM_REPEATS) {
    for (int c = int(lid); c < ncols; c += nthreads) {
      const int j = kc0 + c;
      float v[MB_QT_MAX_M];
      MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) v[m] = 0.0f;
      for (int k = 0; k < K; ++k) {
        if (perm[k] != j) continue;
        const int ks = mb_qt_segment_of(p, k);
        const int col = k - p.seg[ks].k0;
        const size_t row_words = size_t(p.seg[ks].kseg) * size_t(p.seg[ks].bits) / 32;
        const size_t groups = size_t(p.seg[ks].kseg >> p.seg[ks].group_shift);
        float z[MB_QT_MAX_M];
        MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) z[m] = 0.0f;
#define MB_QT_COLUMN(B)                                                                \
  mb_qt_column<IO, SC, B>(dy, M, N, wqs[ks], row_words, scs[ks], bis[ks], groups,     \
                          p.seg[ks].group_shift, col, z)
        MB_QMM_SWITCH_BITS(p.seg[ks].bits, MB_QT_COLUMN)
#undef MB_QT_COLUMN
        MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) v[m] += z[m];
      }
      for (int m = 0; m < M; ++m) out[size_t(m) * size_t(K) + size_t(j)] = IO::store(v[m]);
    }
    return;
  }

  const int t = int(lid) % MB_QT_THREADS;
  const int chunk = t % MB_QT_CHUNKS, slice = t / MB_QT_CHUNKS;
  // The thread's first column in the segment, and its quad's run's.
  const int col = block + MB_QT_COLS * (int(lid) / MB_QT_THREADS) + MB_QT_CHUNK_COLS * chunk;
  const int run = col & ~31;
  const ushort quad = ushort(simd_lid & ~3u);
  float acc[MB_QT_MAX_M * MB_QT_CHUNK_COLS];
  float bsum[MB_QT_MAX_M];
  MB_UNROLL for (int i = 0; i < MB_QT_MAX_M * MB_QT_CHUNK_COLS; ++i) acc[i] = 0.0f;
  MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) bsum[m] = 0.0f;
  {
    const size_t row_words = size_t(kseg) * size_t(bits) / 32;
    const size_t groups = size_t(kseg >> gshift);
    const bool on = col < kseg;
    const device uint32_t* w = wqs[s] + (on ? size_t(run) * bits / 32 : 0);
#define MB_QT_ACC(B)                                                                         \
  mb_qt_accumulate<IO, SC, B>(dy, M, N, w, row_words, scs[s], bis[s], groups,               \
                              size_t(on ? col >> gshift : 0), on,                           \
                              mb_qt_group_lead(chunk, gshift), mb_qt_group_src(simd_lid, gshift), \
                              quad, slice, lid, nthreads, red, acc, bsum)
    MB_QMM_SWITCH_BITS(bits, MB_QT_ACC)
#undef MB_QT_ACC
  }
  mb_qt_finish<IO>(red, acc, bsum, M, sets, lid, ncols, p.has_perm != 0, cols, kc0, K, 0, out);
}

#define MB_QMV_T_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_qmv_t, io, sc)
MB_QMM_FUSED_LADDER(MB_QMV_T_INST, "qmv_t")
