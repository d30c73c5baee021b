// The contract between the quantized-matmul kernels (qmatmul_gemv.metal,
// qmatmul_tiled.metal) and the host code that launches them (qmatmul_host.h,
// cpp/qmatmul/metal.cpp): buffer indices, tile shapes and the per-dispatch
// parameter block (MbQmmFusedParams: also the gathered kernels', inside
// MbGatherFusedParams). Plain ints only, so the struct has one layout in
// Metal and in C++.
#pragma once

// dtype of scales and biases. It may differ from x's; it picks the kernel
// instantiation (qmm_kernel_name), the kernels never switch on it.
enum MbScaleType { MB_SCALE_F32 = 0, MB_SCALE_F16 = 1, MB_SCALE_BF16 = 2 };

// The dense kernels (qmatmul_gemv.metal, qmatmul_tiled.metal) loop over the
// segments themselves: ONE dispatch computes the whole product
//   y[m, n] = sum_s sum_{j < kseg_s} x[m, col(k0_s + j)] * W_s[n, j]
// accumulating in registers, for up to MB_QMM_MAX_SEGS segments, each with
// its own bits and group size from this table (runtime values: the kernels
// are instantiated per activation and scale dtype only). A product with more
// segments is split into dispatches of MB_QMM_MAX_SEGS segments that pass a
// float32 partial sum (accumulate / write_out; the gathered kernels alike).
struct MbQmmSeg {
  int bits;         // 2, 3, 4, 5, 6 or 8
  int group_shift;  // log2(group size): 5, 6 or 7
  int k0;           // first column, in permuted order
  int kseg;         // columns (a multiple of the group size)
};

struct MbQmmFusedParams {
  int M;            // rows of x (leading dims flattened)
  int N;            // output features
  int K;            // columns of x (all segments of the product)
  int has_perm;     // gather x through perm
  int nseg;         // segments of this dispatch, 1 .. MB_QMM_MAX_SEGS
  int accumulate;   // add acc[m, n] (float32) to the result
  int write_out;    // 1: store to out (activation dtype); 0: store to acc
  int qmv_sets;     // GEMV: lane sets per simdgroup, 1, 2 or 4 (qmv_shape);
                    // the tiled kernel ignores it. Keeps seg[] 16-byte aligned.
  MbQmmSeg seg[8];  // MB_QMM_MAX_SEGS; entries past nseg unused
};

// Buffer indices ([[buffer(i)]]) of the dense kernels: the fixed slots, three
// per segment (8 segments: slots 4 .. 27), the parameter block last (Metal
// allows 31 slots).
enum MbQmmBuffer {
  MB_QMM_X = 0,       // activations [M, K]
  MB_QMM_PERM = 1,    // int32 [K]; bound to out when there is no perm
  MB_QMM_ACC = 2,     // float32 [M, N]; bound to out when unused
  MB_QMM_OUT = 3,     // [M, N] activation dtype
  MB_QMM_WQ0     = 4,  // segment 0: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES0 = 5,  // segment 0: [N, kseg/group_size]
  MB_QMM_BIASES0 = 6,  // segment 0: [N, kseg/group_size]
  MB_QMM_WQ1     = 7,  // segment 1: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES1 = 8,  // segment 1: [N, kseg/group_size]
  MB_QMM_BIASES1 = 9,  // segment 1: [N, kseg/group_size]
  MB_QMM_WQ2     = 10, // segment 2: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES2 = 11, // segment 2: [N, kseg/group_size]
  MB_QMM_BIASES2 = 12, // segment 2: [N, kseg/group_size]
  MB_QMM_WQ3     = 13, // segment 3: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES3 = 14, // segment 3: [N, kseg/group_size]
  MB_QMM_BIASES3 = 15, // segment 3: [N, kseg/group_size]
  MB_QMM_WQ4     = 16, // segment 4: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES4 = 17, // segment 4: [N, kseg/group_size]
  MB_QMM_BIASES4 = 18, // segment 4: [N, kseg/group_size]
  MB_QMM_WQ5     = 19, // segment 5: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES5 = 20, // segment 5: [N, kseg/group_size]
  MB_QMM_BIASES5 = 21, // segment 5: [N, kseg/group_size]
  MB_QMM_WQ6     = 22, // segment 6: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES6 = 23, // segment 6: [N, kseg/group_size]
  MB_QMM_BIASES6 = 24, // segment 6: [N, kseg/group_size]
  MB_QMM_WQ7     = 25, // segment 7: uint32 [N, kseg*bits/32]
  MB_QMM_SCALES7 = 26, // segment 7: [N, kseg/group_size]
  MB_QMM_BIASES7 = 27, // segment 7: [N, kseg/group_size]
  MB_QMM_PARAMS  = 28, // MbQmmFusedParams
};

enum MbQmmShape {
  // Segments one dispatch of the dense kernels takes (buffer slots above).
  MB_QMM_MAX_SEGS = 8,
  MB_QMM_N_BUFFERS = 29,
  // GEMV (qmv): 8 to 32 simdgroups x 32 lanes (the host picks:
  // qmv_simdgroups), 4 output rows per simdgroup; each lane reads 16
  // consecutive codes per step, a simdgroup 512 columns. (As many
  // simdgroups, hence threads, per output row as MLX's qmv; every simdgroup
  // of a threadgroup shares one staging of x, so the more per threadgroup,
  // the fewer times x is read.)
  MB_QMV_MIN_SIMDGROUPS = 8,
  MB_QMV_MAX_SIMDGROUPS = 32,
  MB_QMV_ROWS_PER_SIMDGROUP = 4,
  // ... per set of lanes: a simdgroup may run as 1, 2 or 4 sets of 32, 16
  // or 8 lanes, each set its own 4 rows (qmv_shape), so a threadgroup of 32
  // simdgroups covers up to 512 rows of W per staging of x.
  MB_QMV_MAX_SETS = 4,
  // Every row of x (M <= MB_QMV_MAX_M) is handled by the same threadgroup,
  // so each weight is read once per call. x is staged, gathered through
  // perm, as float in threadgroup memory one block of MB_QMV_BLOCK columns
  // (one simdgroup step) at a time: [rows of x][MB_QMV_BLOCK] (the host
  // sizes it for min(M, 8) rows).
  MB_QMV_BLOCK = 512,
  MB_QMV_TG_FLOATS = 8 * 512,
  // Up to this many rows of x, GEMV is used; above it, the tiled kernel.
  MB_QMV_MAX_M = 8,
  // Tiled (qmm): a BM x BN block of outputs per threadgroup of 4
  // simdgroups (2 x 2, each a 16 x 16 block: 2 x 2 simdgroup_float8x8
  // accumulators), K walked in steps of BK = 32 (the smallest group size,
  // so one BK step of one row lies in one group). Each step stages x and
  // dequantized W in threadgroup memory as float, rows padded by 4 floats
  // (16 bytes, as MLX pads) to spread banks and keep rows 16-byte aligned,
  // in two buffers (double-buffered: one barrier per step); the output
  // tile is staged in the buffer the last step did not use.
  MB_QMM_BM = 32,
  MB_QMM_BN = 32,
  MB_QMM_BK = 32,
  MB_QMM_SIMDGROUPS = 4,
  MB_QMM_THREADS = 128,
  MB_QMM_TILE_STRIDE = 36,
  // After the two buffers: the BK perm entries of a step (int bits), staged
  // once per step instead of loaded by every thread that reads x, also
  // double-buffered.
  MB_QMM_TG_FLOATS = 2 * (32 + 32) * 36 + 2 * 32,
  // 9 .. 16 rows of x: a 16 x 64 block per threadgroup (same 4 simdgroups,
  // side by side), so at least half of the MMA rows are real rows from
  // M = 9 (a 32-row tile uses 9 / 32 of them there).
  MB_QMM16_MAX_M = 16,
  MB_QMM16_BM = 16,
  MB_QMM16_BN = 64,
  MB_QMM16_TG_FLOATS = 2 * (16 + 64) * 36 + 2 * 32,
};

// Columns of a tiled block with BM rows: 4 simdgroups of 16 x 16.
constexpr int mb_qmm_bn(int bm) { return 32 * 32 / bm; }

// The tiled kernel's x tile holds x as stored (float, or the 2-byte half /
// bfloat16 bits: exact, half the threadgroup bytes of float), rows of
// BK + 16 / x_bytes elements (16 bytes of padding, as MLX pads its tiles).
// Its W tile holds W as mx.dequantize gives it: float16 (2 bytes) when x and
// the scales are float16, else float (4 bytes; rows of BK + 4 =
// MB_QMM_TILE_STRIDE floats).
constexpr int mb_qmm_xstride(int x_bytes) { return MB_QMM_BK + 16 / x_bytes; }
constexpr int mb_qmm_wstride(int w_bytes) { return MB_QMM_BK + 16 / w_bytes; }
// Floats of a tile of `rows` rows of `bytes`-byte elements (16-byte rows).
constexpr int mb_qmm_tile_floats(int rows, int bytes) {
  return (rows * (MB_QMM_BK + 16 / bytes) * bytes + 3) / 4;
}
// One tile buffer in floats: the x tile [BM][XS], then the W tile [BN][WS].
constexpr int mb_qmm_buffer_floats(int bm, int x_bytes, int w_bytes = 4) {
  return mb_qmm_tile_floats(bm, x_bytes) + mb_qmm_tile_floats(mb_qmm_bn(bm), w_bytes);
}
// Threadgroup memory of the dense tiled kernels: two buffers, then two
// steps' BK perm entries.
constexpr int mb_qmm_tg_floats(int bm, int x_bytes, int w_bytes = 4) {
  return 2 * mb_qmm_buffer_floats(bm, x_bytes, w_bytes) + 2 * MB_QMM_BK;
}
