// Gathered transposed product, the Metal kernels of MixedGatherQMMT (the
// gradient of the gathered matmul wrt x on a GPU stream):
//   dx[lhs[i]] += dy[i] · W[rhs[i]], un-permuted to x's column order
// for few rows per matrix (M <= MB_QT_MAX_M: MoE layers have M = 1).
// Whatever the segment count (gather_t_params.h; the host plan in
// gather_t_host.h): ONE product dispatch over every segment, whose decode,
// sums and stores are the dense transposed kernel's (qmv_t_cols.h), after
// a launch grouping the pairs by dx matrix, or, for few pairs, alone:
// fused, each threadgroup groups them itself. Instantiated per dy dtype x
// scale dtype.
#include "mixbits_metal.h"
#include "gather_t_params.h"
#include "qmv_t_cols.h"

// One threadgroup of MB_GT_GROUP_THREADS. With a perm, first its case, as
// the CPU primitive sees it: inv[perm[k]] = k (racing whole 32-bit stores:
// one wins, and every loser then sees inv[perm[k]] != k), an entry out of
// range (compared as unsigned: a uint32 entry >= 2^31 read as int32 bits is
// out of range) or repeated. Then a counting sort of the pairs by dx
// matrix: order[bounds[b-1] .. bounds[b]) (bounds[-1] = 0) are the pairs
// with lhs = b in index order, for b <= x_batches, the last bin holding
// every lhs out of range. Thread t owns bins b0 .. b1 - 1 and alone writes
// their bounds and order slots, so no atomics are needed and the grouping
// is the same on every run. A pair whose lhs or rhs is out of range turns
// the status to MB_PERM_OUT_OF_RANGE, and the product writes NaN.
template <typename Index>
[[kernel]] void mb_gather_t_group(
    const device int32_t* perm [[buffer(1)]],
    const device Index* lhs [[buffer(3)]],
    const device Index* rhs [[buffer(4)]],
    device int32_t* index [[buffer(5)]],
    constant MbGatherTParams& gp [[buffer(30)]],
    threadgroup int32_t* counts [[threadgroup(0)]],
    uint lid [[thread_index_in_threadgroup]]) {
  device int32_t* bounds = index + mb_gt_bounds_at();
  device int32_t* order = index + mb_gt_order_at(gp.x_batches);
  int32_t pst = MB_PERM_BIJECTIVE;
  if (gp.q.has_perm) {
    device int32_t* inv = index + mb_gt_inv_at(gp.x_batches, gp.pairs);
    const uint K = uint(gp.q.K);
    for (uint j = lid; j < K; j += MB_GT_GROUP_THREADS) inv[j] = -1;
    threadgroup_barrier(mem_flags::mem_device);
    for (uint k = lid; k < K; k += MB_GT_GROUP_THREADS) {
      const uint j = uint(perm[k]);
      if (j >= K) pst = MB_PERM_OUT_OF_RANGE;
      else inv[j] = int32_t(k);
    }
    threadgroup_barrier(mem_flags::mem_device);
    for (uint k = lid; k < K; k += MB_GT_GROUP_THREADS) {
      const uint j = uint(perm[k]);
      if (j < K && inv[j] != int32_t(k)) pst = max(pst, int32_t(MB_PERM_REPEATS));
    }
    counts[lid] = pst;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int t = 0; t < MB_GT_GROUP_THREADS; ++t) pst = max(pst, counts[t]);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // counts is reused below
  }

  const uint bins = uint(gp.x_batches) + 1;
  const uint per = (bins + MB_GT_GROUP_THREADS - 1) / MB_GT_GROUP_THREADS;
  const uint b0 = min(lid * per, bins), b1 = min(b0 + per, bins);
  const uint P = uint(gp.pairs), last = uint(gp.x_batches);

  for (uint b = b0; b < b1; ++b) bounds[b] = 0;
  bool bad = false;
  int32_t mine = 0;
  for (uint i = 0; i < P; ++i) {
    const uint b = min(uint(lhs[i]), last);
    bad = bad || b == last || uint(rhs[i]) >= uint(gp.w_batches);
    if (b >= b0 && b < b1) {
      bounds[b] += 1;
      ++mine;
    }
  }
  counts[lid] = mine;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Exclusive scan: bounds[b] = first slot of bin b.
  int32_t next = 0;
  for (uint t = 0; t < lid; ++t) next += counts[t];
  for (uint b = b0; b < b1; ++b) {
    const int32_t c = bounds[b];
    bounds[b] = next;
    next += c;
  }
  // Placing a pair advances its bin's slot, so each bounds[b] ends as the
  // end of bin b (the start of bin b + 1).
  for (uint i = 0; i < P; ++i) {
    const uint b = min(uint(lhs[i]), last);
    if (b >= b0 && b < b1) order[bounds[b]++] = int32_t(i);
  }
  // Every thread read every index (and perm entry), so each knows the
  // status; one writes it.
  if (lid == 0) index[0] = bad ? int32_t(MB_PERM_OUT_OF_RANGE) : pst;
}

// Threadgroup (t, b): one 128-column block of one segment (t as in the
// dense kernel) of every row of dx matrix b, summed over the pairs of bin
// b in order; grid = (sum over segments of ceil(kseg / 128), x_batches).
// Fused (gp.fused), the threadgroup finds them itself: the perm's case by
// the dense kernel's K-bit map, then every lhs and rhs, 64 pairs at a
// time, the pairs with lhs = b listed in index order (the grouping's
// order: the same sums to the bit) with their experts in threadgroup
// memory; else from the grouping's bins and status. A
// dx matrix no pair names gets zeros. The status's cases as the dense
// kernel's: NaN over dx columns k0 + block .. for a bad index or perm
// entry; a perm with repeats: the dx columns j = k0 + block + c computed
// one by one (sum over the k with perm[k] = j, in k order, of z, each a
// column of W walked row by row, summed over the bin's pairs).
template <typename IO, typename SC>
[[kernel]] void mb_gather_qmv_t(
    const device typename IO::storage* dy [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    device typename IO::storage* out [[buffer(2)]],
    const device uint32_t* lhs [[buffer(3)]],
    const device uint32_t* rhs [[buffer(4)]],
    const device int32_t* index [[buffer(5)]],
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
    constant MbGatherTParams& gp [[buffer(30)]],
    threadgroup float* tg [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  constant MbQmmFusedParams& p = gp.q;
  const device uint32_t* wqs[MB_QMM_MAX_SEGS] = {wq0, wq1, wq2, wq3, wq4, wq5, wq6, wq7};
  const device typename SC::storage* scs[MB_QMM_MAX_SEGS] = {
      scales0, scales1, scales2, scales3, scales4, scales5, scales6, scales7};
  const device typename SC::storage* bis[MB_QMM_MAX_SEGS] = {
      biases0, biases1, biases2, biases3, biases4, biases5, biases6, biases7};
  int block = 0;
  const int s = mb_qt_find_block(p, int(tid.x), 1, block);
  const int bits = p.seg[s].bits, gshift = p.seg[s].group_shift, kseg = p.seg[s].kseg;
  const int kc0 = p.seg[s].k0 + block;
  const int ncols = min(int(MB_QT_COLS), kseg - block);
  const int M = p.M, N = p.N, K = p.K;
  const uint b = tid.y;
  const size_t row0 = size_t(b) * size_t(M);  // dx row of m = 0
  const size_t mat = size_t(M) * size_t(N);   // one dy matrix
  threadgroup float* red = tg;  // dy's stage, then [M][COLS]
  threadgroup int32_t* cols = MB_TG_CAST(int32_t, tg + mb_qt_red_words(M, 1));
  // Fused: the threads' flags, the matrix's pairs and their experts, the map.
  threadgroup int32_t* flags = cols + MB_QT_COLS;
  threadgroup int32_t* mine = flags + MB_QT_THREADS;
  threadgroup int32_t* mine_e = mine + MB_GT_FUSED_MAX_PAIRS;
  threadgroup uint32_t* map = MB_TG_CAST(uint32_t, mine_e + MB_GT_FUSED_MAX_PAIRS);
  const bool fused = gp.fused != 0;
  const device int32_t* bounds = index + mb_gt_bounds_at();
  const device int32_t* order = index + mb_gt_order_at(gp.x_batches);
  int j0 = 0, j1 = 0;
  int32_t status = MB_PERM_BIJECTIVE;
  if (fused) {
    // The grouping's work for this threadgroup's matrix b, in it: the perm's
    // case (the dense kernel's K-bit map), bad indices anywhere, and the
    // pairs with lhs = b in index order (as the grouping orders them, so
    // the sums are the same), listed in threadgroup memory with their
    // experts.
    int32_t st = MB_PERM_BIJECTIVE;
    if (p.has_perm) {
      const int words = mb_qt_map_words(K);
      for (int w = int(lid); w < words; w += MB_QT_THREADS) map[w] = 0u;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int k = int(lid); k < K; k += MB_QT_THREADS) {
        const uint32_t j = uint32_t(perm[k]);
        if (j >= uint32_t(K)) {
          st = MB_PERM_OUT_OF_RANGE;
        } else {
          const uint32_t bit = 1u << (j & 31u);
          if (mb_tg_fetch_or(&map[j >> 5], bit) & bit) st = max(st, int32_t(MB_PERM_REPEATS));
        }
      }
    }
    const int P = gp.pairs;
    int count = 0;
    for (int c0 = 0; c0 < P; c0 += MB_QT_THREADS) {
      const int i = c0 + int(lid);
      int match = 0;
      uint32_t e = 0;
      if (i < P) {
        const uint32_t l = lhs[i];
        e = rhs[i];
        if (l >= uint32_t(gp.x_batches) || e >= uint32_t(gp.w_batches))
          st = MB_PERM_OUT_OF_RANGE;
        match = l == b ? 1 : 0;
      }
      flags[lid] = match;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      int before = 0, all = 0;
      for (int t = 0; t < MB_QT_THREADS; ++t) {
        const int f = flags[t];
        before += t < int(lid) ? f : 0;
        all += f;
      }
      if (match) {
        mine[count + before] = i;
        mine_e[count + before] = int32_t(e);
      }
      count += all;
      threadgroup_barrier(mem_flags::mem_threadgroup);  // flags is reused
    }
    flags[lid] = st;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int t = 0; t < MB_QT_THREADS; ++t) status = max(status, flags[t]);
    j1 = count;
  } else {
    j0 = b == 0 ? 0 : bounds[b - 1];
    j1 = bounds[b];
    status = index[0];
  }

  if (status == MB_PERM_OUT_OF_RANGE) {
    // A bad index or perm entry: NaN everywhere, as the CPU primitive;
    // nothing is read through the indices.
    for (int idx = int(lid); idx < M * MB_QT_COLS; idx += MB_QT_THREADS) {
      const int m = idx / MB_QT_COLS, c = idx % MB_QT_COLS;
      if (c < ncols) out[(row0 + size_t(m)) * size_t(K) + size_t(kc0 + c)] = IO::store(NAN);
    }
    return;
  }
  if (status == MB_PERM_REPEATS) {
    for (int c = int(lid); c < ncols; c += MB_QT_THREADS) {
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
        for (int jj = j0; jj < j1; ++jj) {
          const size_t i = size_t(fused ? mine[jj] : order[jj]);
          const size_t e = size_t(fused ? uint32_t(mine_e[jj]) : rhs[i]);
#define MB_GT_COLUMN(B)                                                                     \
  mb_qt_column<IO, SC, B>(dy + i * mat, M, N, wqs[ks] + e * size_t(N) * row_words,         \
                          row_words, scs[ks] + e * size_t(N) * groups,                      \
                          bis[ks] + e * size_t(N) * groups, groups, p.seg[ks].group_shift,  \
                          col, z)
          MB_QMM_SWITCH_BITS(p.seg[ks].bits, MB_GT_COLUMN)
#undef MB_GT_COLUMN
        }
        MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) v[m] += z[m];
      }
      for (int m = 0; m < M; ++m) {
        out[(row0 + size_t(m)) * size_t(K) + size_t(j)] = IO::store(v[m]);
      }
    }
    return;
  }

  if (p.has_perm) {
    for (int c = int(lid); c < ncols; c += MB_QT_THREADS) cols[c] = perm[kc0 + c];
  }  // (read after mb_qt_finish's barrier)
  const int chunk = int(lid) % MB_QT_CHUNKS;
  const int slice = int(lid) / MB_QT_CHUNKS;
  const int col = block + MB_QT_CHUNK_COLS * chunk;  // first column, in the segment
  const ushort quad = ushort(simd_lid & ~3u);         // its 32-column run's lanes
  float acc[MB_QT_MAX_M * MB_QT_CHUNK_COLS];
  float bsum[MB_QT_MAX_M];
  MB_UNROLL for (int i = 0; i < MB_QT_MAX_M * MB_QT_CHUNK_COLS; ++i) acc[i] = 0.0f;
  MB_UNROLL for (int m = 0; m < MB_QT_MAX_M; ++m) bsum[m] = 0.0f;
  {
    const size_t row_words = size_t(kseg) * size_t(bits) / 32;
    const size_t groups = size_t(kseg >> gshift);
    const size_t mat_words = size_t(N) * row_words, mat_groups = size_t(N) * groups;
    const bool on = col < kseg;
    const device uint32_t* w0 = wqs[s] + (on ? size_t(col & ~31) * bits / 32 : 0);
    const bool lead = mb_qt_group_lead(chunk, gshift);
    const ushort src = mb_qt_group_src(simd_lid, gshift);
    const size_t g = size_t(on ? col >> gshift : 0);
    for (int jj = j0; jj < j1; ++jj) {
      const size_t i = size_t(fused ? mine[jj] : order[jj]);
      const size_t e = size_t(fused ? uint32_t(mine_e[jj]) : rhs[i]);
#define MB_GT_ACC(B)                                                                    \
  mb_qt_accumulate<IO, SC, B>(dy + i * mat, M, N, w0 + e * mat_words, row_words,       \
                              scs[s] + e * mat_groups, bis[s] + e * mat_groups, groups, g, \
                              on, lead, src, quad, slice, lid, MB_QT_THREADS, red, acc, bsum)
      MB_QMM_SWITCH_BITS(bits, MB_GT_ACC)
#undef MB_GT_ACC
    }
  }
  mb_qt_finish<IO>(red, acc, bsum, M, 1, lid, ncols, p.has_perm != 0, cols, kc0, K, row0, out);
}

#define MB_GATHER_QMV_T_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_gather_qmv_t, io, sc)
MB_QMM_FUSED_LADDER(MB_GATHER_QMV_T_INST, "gather_qmv_t")
MB_INSTANTIATE_KERNEL("mixbits_gather_t_group", mb_gather_t_group, uint32_t)
