// Gathered GEMV of the mixed-segment quantized matmul, the Metal kernel of
// MixedGatherQMM (mx.gather_qmm(..., transpose=True) for expert stacks):
//   out[i] = x[lhs[i]] · W[rhs[i]]ᵀ
// with every output matrix computed as the dense GEMV computes one x row
// against one matrix (mb_qmv_rows, qmv_rows.h), after moving x, W, scales
// and biases to the matrices the pair's indices name. As for the dense
// matmul, the host launches one dispatch per K-segment (gather_host.h), so
// the kernel is specialized for one activation dtype, scale dtype, bit
// width and group size, and the segments meet in a float32 partial sum.
#include "mixbits_metal.h"
#include "gather_params.h"
#include "qmv_rows.h"

// Threadgroup = 2 simdgroups x 32 lanes; grid = (M, ceil(N / 8), pairs):
// threadgroup (m, j, i) computes outputs 8 j .. 8 j + 7 of row m of output
// matrix i. An index out of range makes the whole matrix NaN (the CPU
// primitive's rule) without reading x or W: the test is uniform over the
// threadgroup, so no simdgroup is split by it.
template <typename IO, typename SC, int bits, int group_size>
[[kernel]] void mb_gather_qmv(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    const device uint32_t* wq [[buffer(2)]],
    const device typename SC::storage* scales [[buffer(3)]],
    const device typename SC::storage* biases [[buffer(4)]],
    const device uint32_t* lhs [[buffer(5)]],
    const device uint32_t* rhs [[buffer(6)]],
    device float* acc [[buffer(7)]],
    device typename IO::storage* out [[buffer(8)]],
    constant MbGatherParams& gp [[buffer(9)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  constant MbQmmParams& p = gp.q;
  const int m = int(tid.x);
  const size_t pair = size_t(tid.z);
  const int row0 = int(tid.y) * MB_GATHER_QMV_ROWS_PER_GROUP +
                   int(simd_gid) * MB_QMV_ROWS_PER_SIMDGROUP;
  if (row0 >= p.N) return;  // the whole simdgroup (no barrier in this kernel)
  const int last = min(int(MB_QMV_ROWS_PER_SIMDGROUP) - 1, p.N - 1 - row0);
  const size_t out0 = (pair * size_t(p.M) + size_t(m)) * size_t(p.N) + size_t(row0);

  const uint xi = lhs[pair];
  const uint wi = rhs[pair];
  if (xi >= uint(gp.x_batches) || wi >= uint(gp.w_batches)) {
    if (simd_lid == 0) {
      for (int r = 0; r <= last; ++r) mb_qmm_store<IO>(acc, out, p, out0 + size_t(r), NAN);
    }
    return;
  }

  // Matrix wi of this segment: N rows of kseg*bits/8 bytes (a multiple of
  // 4, so every matrix starts 4-byte aligned), and N rows of groups.
  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);
  const device uint8_t* w = (const device uint8_t*)wq + size_t(wi) * size_t(p.N) * row_bytes;
  const size_t g0 = size_t(wi) * size_t(p.N) * groups;
  const device typename IO::storage* xrow =
      x + (size_t(xi) * size_t(p.M) + size_t(m)) * size_t(p.K);

  float v[MB_QMV_ROWS_PER_SIMDGROUP];
  mb_qmv_rows<IO, SC, bits, group_size>(xrow, perm, w, scales + g0, biases + g0, p, row0,
                                        last, simd_lid, v);
  MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
    if (simd_lid == 0 && r <= last) mb_qmm_store<IO>(acc, out, p, out0 + size_t(r), v[r]);
  }
}

#define MB_GATHER_QMV_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_gather_qmv, io, sc, bits, gs)
MB_QMM_LADDER(MB_GATHER_QMV_INST, "gather_qmv")
