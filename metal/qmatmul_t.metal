// Transposed product of the mixed-segment quantized matmul, the Metal
// kernels of MixedQMatmulT (the gradient wrt x on a GPU stream):
//   dx = dy · W, un-permuted to x's column order
// for few rows of dy (M <= MB_QT_MAX_M: the vjp of decode-sized calls).
// The launch sequence, buffers and work split are in qmatmul_t_params.h;
// the host plan in qmatmul_t_host.h. Like the forward, qmv_t is launched
// once per K-segment and specialized for its bits, group size, dy dtype
// and scale dtype.
#include "mixbits_metal.h"
#include "qmv_t_cols.h"

// z[m, k] = sum_n dy[m, n] (s[n, g] q[n, k] + b[n, g]), g = k / group_size,
// for one 128-column block (whole groups: 128 is a multiple of each group
// size) of one segment and one row m. Grid = (ceil(kseg / 128), M).
// The work split, decode and reduction are qmv_t_cols.h's (shared with the
// gathered product, gather_qmv_t.metal).
template <typename IO, typename SC, int bits, int group_size>
[[kernel]] void mb_qmv_t(
    const device typename IO::storage* dy [[buffer(0)]],
    const device uint32_t* wq [[buffer(2)]],
    const device typename SC::storage* scales [[buffer(3)]],
    const device typename SC::storage* biases [[buffer(4)]],
    device float* z [[buffer(7)]],
    device typename IO::storage* out [[buffer(8)]],
    constant MbQmvTParams& p [[buffer(9)]],
    threadgroup float* red [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]]) {
  const int m = int(tid.y);
  const int block = int(tid.x) * MB_QT_COLS;
  const int chunk = int(lid) % MB_QT_CHUNKS;
  const int slice = int(lid) / MB_QT_CHUNKS;
  const int col = block + MB_CHUNK * chunk;  // first column, in the segment

  float acc[MB_CHUNK];
  MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) acc[i] = 0.0f;
  float bsum = 0.0f;
  // kseg is a multiple of 32, so a chunk is inside the segment or wholly
  // past its end (then the thread only contributes zeros to the sum).
  if (col < p.kseg) {
    const size_t row_bytes = size_t(p.kseg) * bits / 8;
    const size_t groups = size_t(p.kseg / group_size);
    mb_qmv_t_accumulate<IO, SC, bits, group_size>(
        dy + size_t(m) * size_t(p.N), (const device uint8_t*)wq + size_t(col) * bits / 8,
        scales, biases, p.N, row_bytes, groups, size_t(col / group_size), slice, acc, bsum);
  }
  mb_qmv_t_finish<IO>(red, acc, bsum, slice, chunk, lid, block, p, size_t(m), z, out);
}

// One threadgroup of MB_QT_CHECK_THREADS: inv[perm[k]] = k and status[0]
// (MbPermStatus). Entries are compared as unsigned, so a uint32 entry
// >= 2^31 (read as int32 bits) is out of range, as on the CPU. Repeated
// entries race to store their k into one inv slot: whole 32-bit stores, one
// wins, and every loser then sees inv[perm[k]] != k, which is all the
// check needs.
template <typename Index>
[[kernel]] void mb_qmv_t_perm_check(
    const device Index* perm [[buffer(1)]],
    device int32_t* inv [[buffer(5)]],
    device int32_t* status [[buffer(6)]],
    constant MbQmvTParams& p [[buffer(9)]],
    threadgroup int32_t* flags [[threadgroup(0)]],
    uint lid [[thread_index_in_threadgroup]]) {
  const uint K = uint(p.K);
  for (uint j = lid; j < K; j += MB_QT_CHECK_THREADS) inv[j] = -1;
  threadgroup_barrier(mem_flags::mem_device);
  int32_t st = MB_PERM_BIJECTIVE;
  for (uint k = lid; k < K; k += MB_QT_CHECK_THREADS) {
    const uint j = uint(perm[k]);
    if (j >= K) st = MB_PERM_OUT_OF_RANGE;
    else inv[j] = int32_t(k);
  }
  threadgroup_barrier(mem_flags::mem_device);
  for (uint k = lid; k < K; k += MB_QT_CHECK_THREADS) {
    const uint j = uint(perm[k]);
    if (j < K && inv[j] != int32_t(k)) st = max(st, int32_t(MB_PERM_REPEATS));
  }
  flags[lid] = st;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) {
    int32_t all = MB_PERM_BIJECTIVE;
    for (int t = 0; t < MB_QT_CHECK_THREADS; ++t) all = max(all, flags[t]);
    status[0] = all;
  }
}

// dx[m, j] from z and the check's result, one column per thread; grid =
// (ceil(K / 64), M). A permutation (all the Python layer builds) gathers
// through the inverse. The other two cases follow the CPU primitive:
// repeated columns sum in float32 in k order, rounded once (a scan of perm
// per output: slow, but only a hand-built perm gets here); an entry out of
// range makes the row NaN.
template <typename IO>
[[kernel]] void mb_qmv_t_unpermute(
    const device int32_t* perm [[buffer(1)]],
    const device int32_t* inv [[buffer(5)]],
    const device int32_t* status [[buffer(6)]],
    const device float* z [[buffer(7)]],
    device typename IO::storage* out [[buffer(8)]],
    constant MbQmvTParams& p [[buffer(9)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]]) {
  const int j = int(tid.x) * MB_QT_UNPERM_THREADS + int(lid);
  if (j >= p.K) return;
  const size_t row = size_t(tid.y) * size_t(p.K);
  const int32_t st = status[0];
  float v;
  if (st == MB_PERM_BIJECTIVE) {
    v = z[row + size_t(inv[j])];
  } else if (st == MB_PERM_REPEATS) {
    v = 0.0f;
    for (int k = 0; k < p.K; ++k)
      if (perm[k] == j) v += z[row + size_t(k)];
  } else {
    v = NAN;
  }
  out[row + size_t(j)] = IO::store(v);
}

#define MB_QMV_T_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_qmv_t, io, sc, bits, gs)
MB_QMM_LADDER(MB_QMV_T_INST, "qmv_t")
MB_INSTANTIATE_KERNEL("mixbits_qmv_t_perm_check", mb_qmv_t_perm_check, int32_t)
MB_INSTANTIATE_KERNEL("mixbits_qmv_t_unpermute_float32", mb_qmv_t_unpermute, MbF32)
MB_INSTANTIATE_KERNEL("mixbits_qmv_t_unpermute_float16", mb_qmv_t_unpermute, MbF16)
MB_INSTANTIATE_KERNEL("mixbits_qmv_t_unpermute_bfloat16", mb_qmv_t_unpermute, MbBF16)
