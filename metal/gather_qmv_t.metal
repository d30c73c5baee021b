// Gathered transposed product, the Metal kernels of MixedGatherQMMT (the
// gradient of the gathered matmul wrt x on a GPU stream):
//   dx[lhs[i]] += dy[i] · W[rhs[i]], un-permuted to x's column order
// for few rows per matrix (M <= MB_QT_MAX_M: MoE layers have M = 1). The
// launch sequence and buffers are in gather_t_params.h, the host plan in
// gather_t_host.h; the perm check and the unpermute are qmatmul_t.metal's.
// The product's decode and reduction are the dense transposed kernel's
// (qmv_t_cols.h); it is launched once per K-segment and specialized for its
// bits, group size, dy dtype and scale dtype.
#include "mixbits_metal.h"
#include "gather_t_params.h"
#include "qmv_t_cols.h"

// One threadgroup of MB_GT_GROUP_THREADS: a counting sort of the pairs by
// dx matrix. Afterwards order[bounds[b-1] .. bounds[b]) (bounds[-1] = 0)
// are the pairs with lhs = b in index order, for b <= x_batches, the last
// bin holding every lhs out of range. Thread t owns bins b0 .. b1 - 1 and
// alone writes their bounds and order slots, so no atomics are needed and
// the grouping is the same on every run. A pair whose lhs or rhs is out of
// range turns the status to MB_PERM_OUT_OF_RANGE (kept over the perm
// check's result when there is one), and the product writes NaN.
template <typename Index>
[[kernel]] void mb_gather_t_group(
    device int32_t* status [[buffer(6)]],
    const device Index* lhs [[buffer(9)]],
    const device Index* rhs [[buffer(10)]],
    device int32_t* order [[buffer(11)]],
    device int32_t* bounds [[buffer(12)]],
    constant MbGatherTParams& p [[buffer(13)]],
    threadgroup int32_t* counts [[threadgroup(0)]],
    uint lid [[thread_index_in_threadgroup]]) {
  const uint bins = uint(p.x_batches) + 1;
  const uint per = (bins + MB_GT_GROUP_THREADS - 1) / MB_GT_GROUP_THREADS;
  const uint b0 = min(lid * per, bins), b1 = min(b0 + per, bins);
  const uint P = uint(p.pairs), last = uint(p.x_batches);

  for (uint b = b0; b < b1; ++b) bounds[b] = 0;
  bool bad = false;
  int32_t mine = 0;
  for (uint i = 0; i < P; ++i) {
    const uint b = min(uint(lhs[i]), last);
    bad = bad || b == last || uint(rhs[i]) >= uint(p.w_batches);
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
  // Every thread read every index, so each knows `bad`; one writes it.
  if (lid == 0) {
    const int32_t st = bad ? int32_t(MB_PERM_OUT_OF_RANGE) : int32_t(MB_PERM_BIJECTIVE);
    status[0] = p.q.has_perm ? max(status[0], st) : st;
  }
}

// Threadgroup (block, m, b): columns block*128 .. of row m of dx matrix b
// (one segment), summed over the pairs of bin b in order; grid =
// (ceil(kseg / 128), M, x_batches). A dx matrix no pair names gets zeros.
template <typename IO, typename SC, int bits, int group_size>
[[kernel]] void mb_gather_qmv_t(
    const device typename IO::storage* dy [[buffer(0)]],
    const device uint32_t* wq [[buffer(2)]],
    const device typename SC::storage* scales [[buffer(3)]],
    const device typename SC::storage* biases [[buffer(4)]],
    const device int32_t* status [[buffer(6)]],
    device float* z [[buffer(7)]],
    device typename IO::storage* out [[buffer(8)]],
    const device uint32_t* rhs [[buffer(10)]],
    const device int32_t* order [[buffer(11)]],
    const device int32_t* bounds [[buffer(12)]],
    constant MbGatherTParams& gp [[buffer(13)]],
    threadgroup float* red [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]]) {
  constant MbQmvTParams& p = gp.q;
  const int m = int(tid.y);
  const uint b = tid.z;
  const int block = int(tid.x) * MB_QT_COLS;
  const int chunk = int(lid) % MB_QT_CHUNKS;
  const int slice = int(lid) / MB_QT_CHUNKS;
  const int col = block + MB_CHUNK * chunk;  // first column, in the segment

  float acc[MB_CHUNK];
  MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) acc[i] = 0.0f;
  float bsum = 0.0f;
  if (status[0] == MB_PERM_OUT_OF_RANGE) {
    // A bad index (or perm entry): NaN everywhere, as the CPU primitive;
    // nothing is read through the indices.
    bsum = NAN;
  } else if (col < p.kseg) {
    const size_t row_bytes = size_t(p.kseg) * bits / 8;
    const size_t groups = size_t(p.kseg / group_size);
    const size_t mat_bytes = size_t(p.N) * row_bytes, mat_groups = size_t(p.N) * groups;
    const device uint8_t* w0 = (const device uint8_t*)wq + size_t(col) * bits / 8;
    const int j1 = bounds[b];
    for (int j = b == 0 ? 0 : bounds[b - 1]; j < j1; ++j) {
      const size_t i = size_t(order[j]);
      const size_t e = size_t(rhs[i]);
      mb_qmv_t_accumulate<IO, SC, bits, group_size>(
          dy + (i * size_t(p.M) + size_t(m)) * size_t(p.N), w0 + e * mat_bytes,
          scales + e * mat_groups, biases + e * mat_groups, p.N, row_bytes, groups,
          size_t(col / group_size), slice, acc, bsum);
    }
  }
  mb_qmv_t_finish<IO>(red, acc, bsum, slice, chunk, lid, block, p,
                      size_t(b) * size_t(p.M) + size_t(m), z, out);
}

#define MB_GATHER_QMV_T_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_gather_qmv_t, io, sc, bits, gs)
MB_QMM_LADDER(MB_GATHER_QMV_T_INST, "gather_qmv_t")
MB_INSTANTIATE_KERNEL("mixbits_gather_t_group", mb_gather_t_group, uint32_t)
