// The contract between the gathered kernels (gather_qmv.metal, the GEMV;
// gather_qmm.metal, the tiled one) and the host code that launches them
// (gather_host.h, cpp/gather/metal.cpp): buffer indices and the
// per-dispatch parameter blocks. Plain ints only, so the structs have one
// layout in Metal and in C++.
#pragma once
#include "qmatmul_params.h"

// Both gathered kernels walk the segment table themselves, as the dense
// kernels do: ONE dispatch computes the whole product
//   out[i] = x[lhs[i]] · W[rhs[i]]ᵀ,  i < pairs,
// for x [x_batches, M, K] and each segment's arrays [w_batches, N, ...]
// (MixedGatherQMM's inputs, dense; acc and out [pairs, M, N]), over up to
// MB_QMM_MAX_SEGS segments (each its own bits, group size and column range
// in q.seg, each with its own stacked arrays), accumulating in registers;
// more segments are split into dispatches of MB_QMM_MAX_SEGS that pass a
// float32 partial sum (q.accumulate, q.write_out), as the dense kernels do.
// q describes one x matrix against one weight matrix as for the dense
// matmul; q.qmv_sets is 1 (the GEMV's one lane set; the tiled kernel
// ignores it).
struct MbGatherFusedParams {
  MbQmmFusedParams q;
  int x_batches;  // lhs[i] >= x_batches: output matrix i is NaN
  int w_batches;  // rhs[i] >= w_batches: output matrix i is NaN
  int pairs;      // entries of lhs and rhs (output matrices)
  int block_rows; // flat output rows per threadgroup: <= MB_QMV_MAX_M (GEMV),
                  // MB_QMM_BM (tiled)
  int chained;    // GEMV: a run of equal rhs belongs whole to the block it
                  // starts in, past the block's end (the host sets it for
                  // sorted pairs); 0: each block walks its own rows only.
                  // The tiled kernel ignores it.
};

// The GEMV's threadgroup memory before x's staging, in floats: the rhs
// window (MB_GQMV_RHS_WINDOW entries: the row before the block, its rows,
// then as many again, where a run that starts in the block may go on),
// then the lhs entries of one pass (MB_QMV_MAX_M rows), padded to 32.
constexpr int MB_GQMV_RHS_WINDOW = 2 * MB_QMV_MAX_M + 1;
constexpr int MB_GQMV_IDX_FLOATS = 32;
static_assert(MB_GQMV_RHS_WINDOW + MB_QMV_MAX_M <= MB_GQMV_IDX_FLOATS,
              "the GEMV's index staging fits before x's");

// Threadgroup memory of the tiled gathered kernel (gather_qmm.metal), in
// floats: the dense tiled kernel's with 32-row blocks (two tile buffers,
// two steps' perm entries), then the block's rhs and lhs entries, one per
// flat output row (staged once; its runs are walked from them).
constexpr int mb_gather_qmm_tg_floats(int x_bytes, int w_bytes) {
  return mb_qmm_tg_floats(MB_QMM_BM, x_bytes, w_bytes) + 2 * MB_QMM_BM;
}

// Both gathered kernels' buffer indices (gather_qmv.metal, the GEMV, and
// gather_qmm.metal, the tiled one): the fixed slots, three per segment
// (slots 6 .. 29), the parameter block last (Metal's 31 slots, all used).
enum MbGatherQmvBuffer {
  MB_GQMV_X = 0,        // activations [x_batches, M, K]
  MB_GQMV_PERM = 1,     // int32 [K]; bound to out when there is no perm
  MB_GQMV_LHS = 2,      // uint32 [pairs]
  MB_GQMV_RHS = 3,      // uint32 [pairs]
  MB_GQMV_ACC = 4,      // float32 [pairs, M, N]; bound to out when unused
  MB_GQMV_OUT = 5,      // [pairs, M, N] activation dtype
  MB_GQMV_WQ0 = 6,      // segment 0: uint32 [w_batches, N, kseg*bits/32]
  MB_GQMV_SCALES0 = 7,  // segment 0: [w_batches, N, kseg/group_size]
  MB_GQMV_BIASES0 = 8,  // segment 0: [w_batches, N, kseg/group_size]
  MB_GQMV_WQ1 = 9,
  MB_GQMV_SCALES1 = 10,
  MB_GQMV_BIASES1 = 11,
  MB_GQMV_WQ2 = 12,
  MB_GQMV_SCALES2 = 13,
  MB_GQMV_BIASES2 = 14,
  MB_GQMV_WQ3 = 15,
  MB_GQMV_SCALES3 = 16,
  MB_GQMV_BIASES3 = 17,
  MB_GQMV_WQ4 = 18,
  MB_GQMV_SCALES4 = 19,
  MB_GQMV_BIASES4 = 20,
  MB_GQMV_WQ5 = 21,
  MB_GQMV_SCALES5 = 22,
  MB_GQMV_BIASES5 = 23,
  MB_GQMV_WQ6 = 24,
  MB_GQMV_SCALES6 = 25,
  MB_GQMV_BIASES6 = 26,
  MB_GQMV_WQ7 = 27,
  MB_GQMV_SCALES7 = 28,
  MB_GQMV_BIASES7 = 29,
  MB_GQMV_PARAMS = 30,  // MbGatherFusedParams
};
