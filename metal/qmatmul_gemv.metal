// GEMV kernel of the mixed-segment quantized matmul y = x · Wᵀ, for few
// rows of x (M <= MB_QMV_MAX_M), in the style of MLX's qmv_fast.
//
// W is a list of K-segments, each stored exactly as MLX stores a quantized
// matrix (see quant_utils.h). ONE dispatch computes the whole product: the
// kernel walks the segment table (MbQmmFusedParams, qmatmul_params.h), each
// segment with its own bit width and group size, and accumulates in
// registers. It is instantiated per activation dtype x scale dtype only; the
// decode is a template per width, picked once per segment
// (MB_QMM_SWITCH_BITS). The tiled kernel for more rows is in
// qmatmul_tiled.metal.
#include "mixbits_metal.h"
#include "qmv_rows.h"

// Threadgroup = S simdgroups x 32 lanes, S = 8, 16 or 32, each simdgroup in
// H = p.qmv_sets sets of 32 / H lanes (1, 2 or 4), as the host picks
// (qmv_shape: the more rows per threadgroup, the fewer threadgroups re-read
// x); grid = (ceil(N / 4SH), ceil(M / 8)). Each set owns 4 consecutive
// output rows (a simdgroup 4H) and computes them for the threadgroup's up
// to MB_QMV_MAX_M rows of x (acc: 8 x 4 floats per lane), so at M <= 8 (the
// only M the host sends here by default) each row of W is read once per
// call whatever M, and the staged x serves 4SH rows of W. Buffers:
// qmatmul_params.h (MbQmmBuffer); slots of segments past p.nseg are bound to
// a stand-in and never read.
template <typename IO, typename SC>
[[kernel]] void mb_qmv(
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
    threadgroup float* xt [[threadgroup(0)]],
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
  constexpr int R = MB_QMV_ROWS_PER_SIMDGROUP;
  const int H = p.qmv_sets;
  const int L = 32 / H;  // lanes per set
  const int row0 = (int(tid.x) * int(nsimd) + int(simd_gid)) * R * H + int(simd_lid) / L * R;
  // A set past N still stages x and meets the barriers and shuffles: it
  // computes row N - 1 and stores nothing. Rows past N otherwise repeat the
  // last.
  const bool active = row0 < p.N;
  const int r0 = active ? row0 : p.N - 1;
  const int last = min(R - 1, p.N - 1 - r0);
  const int m0 = int(tid.y) * MB_QMV_MAX_M;
  const int rows_x = min(int(MB_QMV_MAX_M), p.M - m0);

  float acc[MB_QMV_MAX_M * R];
  MB_UNROLL for (int i = 0; i < MB_QMV_MAX_M * R; ++i) acc[i] = 0.0f;
  long xrow[MB_QMV_MAX_M];
  MB_UNROLL for (int m = 0; m < MB_QMV_MAX_M; ++m) xrow[m] = long(m0 + m) * long(p.K);

  for (int s = 0; s < p.nseg; ++s) {
#define MB_QMV_SEG(B)                                                                  \
  mb_qmv_segment<IO, SC, B>(x, xrow, perm, p.has_perm, p.K, p.seg[s].k0, p.seg[s].kseg, \
                            p.seg[s].group_shift, (const device uint8_t*)wqs[s], scs[s],   \
                            bis[s], xt, rows_x, r0, last, lid, simd_lid, int(nsimd) * 32,  \
                            H, acc)
    MB_QMM_SWITCH_BITS(p.seg[s].bits, MB_QMV_SEG)
#undef MB_QMV_SEG
  }

  MB_UNROLL for (int m = 0; m < MB_QMV_MAX_M; ++m) {
    if (m < rows_x) {
      MB_UNROLL for (int r = 0; r < R; ++r) {
        const float v = mb_qmv_set_sum(acc[m * R + r], H);
        if (active && simd_lid % uint(L) == 0 && r <= last) {
          mb_qmm_store<IO>(acc_buf, out, p, size_t(m0 + m) * size_t(p.N) + size_t(row0 + r), v);
        }
      }
    }
  }
}

#define MB_QMV_INST(name, io, sc) MB_INSTANTIATE_KERNEL(name, mb_qmv, io, sc)
MB_QMM_FUSED_LADDER(MB_QMV_INST, "qmv")
