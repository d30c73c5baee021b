// The contract between the transposed quantized-matmul kernel
// (qmatmul_t.metal) and the host code that launches it (qmatmul_t_host.h,
// cpp/qmatmul/metal.cpp: MixedQMatmulT::eval_gpu): buffer indices, the
// work split and the parameter block. Plain ints only, so the structs have
// one layout in Metal and in C++.
//
// The product is dx = dy · W, un-permuted, for dy [M, N] and the [N, K]
// mixed-segment W (the gradient of y = x[:, perm] · Wᵀ wrt x):
//   z[m, k]          = sum_n dy[m, n] * W[n, k]      (k in packed order)
//   dx[m, perm[k]]  += z[m, k]                       (perm a permutation)
// ONE dispatch computes it, whatever the segment count and with the
// permutation: the segments split the OUTPUT columns (K of W), so each
// threadgroup owns one 128-column block of one segment (its bits and
// group size from the segment table, MbQmmFusedParams of
// qmatmul_params.h, as the forward's) for every row of dy, and stores its
// columns straight to dx -- through perm when there is one (a scatter:
// no float32 z round trip, no second dispatch). Each threadgroup checks
// the whole perm itself (a K-bit map in threadgroup memory), so all agree
// on the CPU primitive's three cases without a launch between them.
#pragma once
#include "qmatmul_params.h"

// What the perm check finds; the CPU primitive's three cases
// (cpp/qmatmul/transposed.cpp).
enum MbPermStatus {
  MB_PERM_BIJECTIVE = 0,    // dx[m, perm[k]] = z[m, k]
  MB_PERM_REPEATS = 1,      // in range, some j hit twice: repeated columns sum
  MB_PERM_OUT_OF_RANGE = 2, // some entry outside [0, K): every row NaN
};

// Buffer indices ([[buffer(i)]]): the fixed slots, three per segment (8
// segments: slots 3 .. 26), the parameter block (MbQmmFusedParams) last.
enum MbQmvTBuffer {
  MB_QT_DY = 0,        // [M, N] dy's dtype
  MB_QT_PERM = 1,      // int32 [K]; bound to out when there is no perm
  MB_QT_OUT = 2,       // [M, K] dy's dtype: dx
  MB_QT_WQ0 = 3,       // segment 0: uint32 [N, kseg*bits/32]
  MB_QT_SCALES0 = 4,   // segment 0: [N, kseg/group_size]
  MB_QT_BIASES0 = 5,   // segment 0: [N, kseg/group_size]
  MB_QT_WQ1 = 6,
  MB_QT_SCALES1 = 7,
  MB_QT_BIASES1 = 8,
  MB_QT_WQ2 = 9,
  MB_QT_SCALES2 = 10,
  MB_QT_BIASES2 = 11,
  MB_QT_WQ3 = 12,
  MB_QT_SCALES3 = 13,
  MB_QT_BIASES3 = 14,
  MB_QT_WQ4 = 15,
  MB_QT_SCALES4 = 16,
  MB_QT_BIASES4 = 17,
  MB_QT_WQ5 = 18,
  MB_QT_SCALES5 = 19,
  MB_QT_BIASES5 = 20,
  MB_QT_WQ6 = 21,
  MB_QT_SCALES6 = 22,
  MB_QT_BIASES6 = 23,
  MB_QT_WQ7 = 24,
  MB_QT_SCALES7 = 25,
  MB_QT_BIASES7 = 26,
  MB_QT_PARAMS = 27,   // MbQmmFusedParams (accumulate, write_out, qmv_sets unused)
};

enum MbQmvTShape {
  MB_QT_N_BUFFERS = 28,
  // A threadgroup owns `sets` x MB_QT_COLS columns of one segment for all M
  // rows of dy (sets = MbQmmFusedParams::qmv_sets, 1, 2 or 4: qt_sets in
  // qmatmul_t_host.h; the gathered kernel runs 1). Set v (threads 64 v ..
  // 64 v + 63, two simdgroups) owns columns 128 v .. 128 v + 127 of the
  // block: 16 chunks of 8 codes (byte-aligned for every width and inside
  // one group) x 4 row slices. Thread t of a set decodes chunk t % 16 of
  // rows n = t / 16 + 4 i once and applies it to every row of dy, so each
  // packed word of the block is read once per call. The 4 chunks of a
  // 32-column run (`bits` aligned uint32 words of a row) load them as
  // words, one or two per lane, and hand them round by simd_shuffle; a
  // slice's 16 lanes (half a simdgroup) share one load of each group's
  // scale and bias the same way. dy is staged in threadgroup memory,
  // MB_QT_STAGE_ROWS rows of n at a time, for every set: read once per
  // threadgroup however many columns it owns.
  MB_QT_CHUNK_COLS = 8,
  MB_QT_CHUNKS = 16,
  MB_QT_SLICES = 4,
  MB_QT_THREADS = 64,   // per set
  MB_QT_COLS = 128,     // per set
  MB_QT_MAX_SETS = 4,
  MB_QT_STAGE_ROWS = 256,
  // Up to this many rows of dy, the gradient on a GPU stream runs this
  // kernel; above it, dequantize + MLX's GEMM (grad.cpp). Every row is in
  // registers (8 x 8 sums per thread).
  MB_QT_MAX_M = 8,
  // The perm check's bit map: K <= MB_QT_MAX_K columns (2048 words, 8 KiB).
  MB_QT_MAX_K = 65536,
};

// Threadgroup memory of the dense kernel, in 4-byte words: dy's stage
// [MB_QT_STAGE_ROWS][M] floats, which the sums' reduction [M][sets * COLS]
// reuses once the products are done, the threads' check flags, the
// block's perm entries, then (with a perm) the K-bit map.
constexpr int mb_qt_max(int a, int b) { return a > b ? a : b; }
constexpr int mb_qt_red_words(int M, int sets) {
  return M * mb_qt_max(sets * MB_QT_COLS, MB_QT_STAGE_ROWS);
}
constexpr int mb_qt_map_words(int K) { return (K + 31) / 32; }
// (Rounded up to 4 words: Metal takes threadgroup memory in 16-byte units.)
constexpr int mb_qt_tg_words(int M, int K, int has_perm, int sets) {
  return (mb_qt_red_words(M, sets) + sets * (MB_QT_THREADS + MB_QT_COLS) +
          (has_perm ? mb_qt_map_words(K) : 0) + 3) / 4 * 4;
}
