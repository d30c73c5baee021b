// Tiled kernel of the mixed-segment quantized matmul y = x · Wᵀ, for more
// than MB_QMV_MAX_M rows of x, in the pattern of MLX's steel BlockMMA /
// qmm_t: the threadgroup stages a tile of x and a tile of W (dequantized)
// in threadgroup memory and its simdgroups multiply them with 8x8
// simdgroup matrices. ONE dispatch computes the whole product: the kernel
// walks the segment table (MbQmmFusedParams, qmatmul_params.h) with the
// accumulators in registers, each segment decoded by a template for its
// width (MB_QMM_SWITCH_BITS, once per segment); instantiated per activation
// dtype x scale dtype only.
#include "mixbits_metal.h"
#include "qmatmul_common.h"
#include "qmm_tile_segment.h"

// Threadgroup = 4 simdgroups (128 threads); grid = (ceil(N / 32),
// ceil(M / 32)); one 32 x 32 block of outputs per threadgroup, simdgroup
// (simd_gid / 2, simd_gid % 2) owning a 16 x 16 block of it (2 x 2
// simdgroup_float8x8 accumulators; an 8-row fragment wholly past M, in
// the last block, is neither multiplied nor stored). Loader role of thread
// lid: row lid / 4 of both tiles, columns (lid % 4) * 8 .. + 7. At the end
// the accumulators go through threadgroup memory (the x tile's space) so
// that each thread stores 8 outputs with bounds checks. Buffers:
// qmatmul_params.h (MbQmmBuffer); slots of segments past p.nseg are bound
// to a stand-in and never read.
template <typename IO, typename SC, int BM>
[[kernel]] void mb_qmm(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    device float* acc_buf [[buffer(2)]],
    device typename IO::storage* out [[buffer(3)]],
    const device uint32_t* wq0 [[buffer(4)]],
    const device typename SC::storage* scales0 [[buffer(5)]],
    const device typename SC::storage* biases0 [[buffer(6)]],
    const device uint32_t* wq1 [[buffer(7)]],
    const device typename SC::storage* scales1 [[buffer(8)]],
    const device typename SC::storage* biases1 [[buffer(9)]],
    const device uint32_t* wq2 [[buffer(10)]],
    const device typename SC::storage* scales2 [[buffer(11)]],
    const device typename SC::storage* biases2 [[buffer(12)]],
    const device uint32_t* wq3 [[buffer(13)]],
    const device typename SC::storage* scales3 [[buffer(14)]],
    const device typename SC::storage* biases3 [[buffer(15)]],
    const device uint32_t* wq4 [[buffer(16)]],
    const device typename SC::storage* scales4 [[buffer(17)]],
    const device typename SC::storage* biases4 [[buffer(18)]],
    const device uint32_t* wq5 [[buffer(19)]],
    const device typename SC::storage* scales5 [[buffer(20)]],
    const device typename SC::storage* biases5 [[buffer(21)]],
    const device uint32_t* wq6 [[buffer(22)]],
    const device typename SC::storage* scales6 [[buffer(23)]],
    const device typename SC::storage* biases6 [[buffer(24)]],
    const device uint32_t* wq7 [[buffer(25)]],
    const device typename SC::storage* scales7 [[buffer(26)]],
    const device typename SC::storage* biases7 [[buffer(27)]],
    constant MbQmmFusedParams& p [[buffer(28)]],
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
  constexpr int BN = mb_qmm_bn(BM);
  static_assert(BM * BN == 32 * 32 && (BM == 16 || BM == 32), "4 simdgroups of 16 x 16");
  const int n0 = int(tid.x) * BN;
  const int m0 = int(tid.y) * BM;
  const int lrow = int(lid) / 4;
  const int xm = m0 + lrow;
  const bool x_in = lrow < BM && xm < p.M;
  const int mrows = min(BM, p.M - m0);  // rows of x in this block (the last may be partial)
  const device typename IO::storage* xrow = x + size_t(x_in ? xm : 0) * size_t(p.K);

  simdgroup_float8x8 c[4];
  MB_UNROLL for (int i = 0; i < 4; ++i) c[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  constexpr int TILE = mb_qmm_buffer_floats(BM, sizeof(typename IO::storage),
                                            sizeof(typename MbWTile<IO, SC>::type));
  // The first step's perm entries (later ones are staged a step ahead);
  // without a perm there is nothing to wait for.
  if (p.has_perm) {
    if (lid < uint(MB_QMM_BK)) {
      smem[2 * TILE + int(lid)] = as_type<float>(mb_perm_col(perm, 1, p.K, p.seg[0].k0 + int(lid)));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  int step = 0;  // over all segments: picks the tile buffer
  for (int s = 0; s < p.nseg; ++s) {
#define MB_QMM_SEG(B)                                                                          \
  mb_qmm_segment<IO, SC, B, BM>(xrow, x_in, perm, (const device uint8_t*)wqs[s], scs[s], bis[s], p, \
                            p.seg[s], smem, n0, lid, simd_gid, mrows, step, c)
    MB_QMM_SWITCH_BITS(p.seg[s].bits, MB_QMM_SEG)
#undef MB_QMM_SEG
  }

  // Stage the outputs, [BM][BN + 4], in the tile buffer the last step did
  // not use (every thread finished reading it before the last step's
  // barrier); each thread then stores 8 consecutive outputs of one row.
  constexpr int CS = BN + 4;
  static_assert(BM * CS <= TILE, "the output tile fits one tile buffer");
  threadgroup float* ct = smem + (step & 1) * TILE;
  const int sm = 16 * (int(simd_gid) / (BN / 16));
  const int sn = 16 * (int(simd_gid) % (BN / 16));
  MB_UNROLL for (int i = 0; i < 2; ++i) {
    if (sm + 8 * i < mrows) {  // fragments past M: never multiplied, never stored
      MB_UNROLL for (int j = 0; j < 2; ++j) {
        simdgroup_store(c[2 * i + j], ct, CS, ulong2(ulong(sn + 8 * j), ulong(sm + 8 * i)));
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int orow = int(lid) / (BN / 8);
  const int ocol = (int(lid) % (BN / 8)) * 8;
  const int om = m0 + orow;
  MB_UNROLL for (int i = 0; i < 8; ++i) {
    const int n = n0 + ocol + i;
    if (om < p.M && n < p.N) {
      mb_qmm_store<IO>(acc_buf, out, p, size_t(om) * size_t(p.N) + size_t(n),
                       ct[orow * CS + ocol + i]);
    }
  }
}

#define MB_QMM_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_qmm, io, sc, 32)
MB_QMM_FUSED_LADDER(MB_QMM_INST, "qmm")
#define MB_QMM16_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_qmm, io, sc, 16)
MB_QMM_FUSED_LADDER(MB_QMM16_INST, "qmm16")
