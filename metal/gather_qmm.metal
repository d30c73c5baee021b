// Tiled gathered kernel of the mixed-segment quantized matmul, for expert
// stacks with many output rows (an MoE layer's prefill):
//   out[i] = x[lhs[i]] · W[rhs[i]]ᵀ,
// the output matrices' rows taken as one flat list of pairs·M rows (row
// r = i·M + m). The gathered GEMV (gather_qmv.metal) reads an expert's
// weights once per row it serves; here a threadgroup computes a 32 × 32
// block of outputs like the dense tiled kernel (qmatmul_tiled.metal: x
// and dequantized W tiles in threadgroup memory, 8 × 8 simdgroup
// matrices), so an expert's weight tile is read once per 32 rows that use
// it. With the pairs sorted by expert (mlx-lm sorts them for prefill) the
// 32 rows of a block mostly share one expert; a block walks the runs of
// equal rhs among its rows in order, each run one pass over K with the
// other rows' activations zeroed and only the run's rows stored. Unsorted
// indices stay correct (more runs, more passes). Rows whose lhs or rhs is
// out of range get NaN (the CPU primitive's rule), without reading x or W.
//
// As for the other kernels the host launches one dispatch per K-segment
// (gather_host.h), and the segments meet in a float32 partial sum.
#include "mixbits_metal.h"
#include "gather_params.h"
#include "qmatmul_common.h"

// Threadgroup = 4 simdgroups (128 threads); grid = (ceil(N / 32),
// ceil(pairs·M / 32)).
template <typename IO, typename SC, int bits, int group_size>
[[kernel]] void mb_gather_qmm(
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
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]]) {
  constant MbQmmParams& p = gp.q;
  constexpr int S = MB_QMM_TILE_STRIDE;
  static_assert(MB_QMM_BK % 8 == 0 && MB_QMM_BK <= 32, "a BK step lies in one group");
  threadgroup float* xt = smem;                  // [BM][S]
  threadgroup float* wt = smem + MB_QMM_BM * S;  // [BN][S]

  const int rows = gp.pairs * p.M;
  const int n0 = int(tid.x) * MB_QMM_BN;
  const int r0 = int(tid.y) * MB_QMM_BM;
  const int r_end = min(r0 + int(MB_QMM_BM), rows);

  // Loader role: row `lrow` of both tiles, columns lcol .. lcol + 7; the
  // same thread stores output row r0 + lrow, columns n0 + lcol .. + 7.
  const int lrow = int(lid) / 4;
  const int lcol = (int(lid) % 4) * 8;
  const int r = r0 + lrow;
  const bool r_in = r < rows;
  const int pair = r_in ? r / p.M : 0;
  const uint xi = r_in ? lhs[pair] : 0u;
  const uint wi = r_in ? rhs[pair] : 0u;
  const bool bad = r_in && (xi >= uint(gp.x_batches) || wi >= uint(gp.w_batches));
  const device typename IO::storage* xrow =
      x + (size_t(bad ? 0u : xi) * size_t(p.M) + size_t(r_in ? r % p.M : 0)) * size_t(p.K);
  const size_t wn = size_t(min(n0 + lrow, p.N - 1));
  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);

  // MMA role: this simdgroup's 16 x 16 block of the tile.
  const int sm = 16 * int(simd_gid / 2);
  const int sn = 16 * int(simd_gid % 2);

  // The runs of equal rhs among rows [r0, r_end): the same walk in every
  // thread (device reads only), so barriers stay uniform.
  for (int start = r0; start < r_end;) {
    const uint e = rhs[start / p.M];
    int end = start + 1;
    while (end < r_end && rhs[end / p.M] == e) ++end;
    if (e < uint(gp.w_batches)) {
      const bool mine = r >= start && r < end && !bad;
      const device uint8_t* wrow =
          (const device uint8_t*)wq + (size_t(e) * size_t(p.N) + wn) * row_bytes;
      const size_t g0 = (size_t(e) * size_t(p.N) + wn) * groups;
      simdgroup_float8x8 c[2][2];
      MB_UNROLL for (int i = 0; i < 2; ++i) {
        MB_UNROLL for (int j = 0; j < 2; ++j) {
          c[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
      }
      for (int kt = 0; kt < p.kseg; kt += MB_QMM_BK) {
        const int c0 = p.k0 + kt + lcol;
        MB_UNROLL for (int i = 0; i < 8; ++i) {
          xt[lrow * S + lcol + i] = mine ? mb_load_x<IO>(xrow, perm, p, c0 + i) : 0.0f;
        }
        uint32_t codes[8];
        mb_unpack8<bits>(wrow + size_t(kt + lcol) * bits / 8, codes);
        const size_t gi = g0 + size_t((kt + lcol) / group_size);
        const float s = SC::load(scales[gi]);
        const float b = SC::load(biases[gi]);
        MB_UNROLL for (int i = 0; i < 8; ++i) {
          wt[lrow * S + lcol + i] = s * float(codes[i]) + b;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        MB_UNROLL for (int kk = 0; kk < MB_QMM_BK; kk += 8) {
          simdgroup_float8x8 a[2], bt[2];
          MB_UNROLL for (int i = 0; i < 2; ++i) {
            simdgroup_load(a[i], xt, S, ulong2(ulong(kk), ulong(sm + 8 * i)));
          }
          MB_UNROLL for (int j = 0; j < 2; ++j) {
            simdgroup_load(bt[j], wt + (sn + 8 * j) * S + kk, S, ulong2(0, 0), true);
          }
          MB_UNROLL for (int i = 0; i < 2; ++i) {
            MB_UNROLL for (int j = 0; j < 2; ++j) {
              simdgroup_multiply_accumulate(c[i][j], a[i], bt[j], c[i][j]);
            }
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      // Stage the outputs in the x tile's space, then each thread stores
      // its row's 8 outputs if the row belongs to this run.
      threadgroup float* ct = xt;  // [BM][S]
      MB_UNROLL for (int i = 0; i < 2; ++i) {
        MB_UNROLL for (int j = 0; j < 2; ++j) {
          simdgroup_store(c[i][j], ct, S, ulong2(ulong(sn + 8 * j), ulong(sm + 8 * i)));
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (mine) {
        MB_UNROLL for (int i = 0; i < 8; ++i) {
          const int n = n0 + lcol + i;
          if (n < p.N) {
            mb_qmm_store<IO>(acc, out, p, size_t(r) * size_t(p.N) + size_t(n),
                             ct[lrow * S + lcol + i]);
          }
        }
      }
      // The next run overwrites the x tile.
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    start = end;
  }
  if (bad) {
    MB_UNROLL for (int i = 0; i < 8; ++i) {
      const int n = n0 + lcol + i;
      if (n < p.N) mb_qmm_store<IO>(acc, out, p, size_t(r) * size_t(p.N) + size_t(n), NAN);
    }
  }
}

#define MB_GATHER_QMM_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_gather_qmm, io, sc, bits, gs)
MB_QMM_LADDER(MB_GATHER_QMM_INST, "gather_qmm")
