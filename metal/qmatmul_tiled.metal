// Tiled kernel of the mixed-segment quantized matmul y = x · Wᵀ, for more
// than MB_QMV_MAX_M rows of x, in the pattern of MLX's steel BlockMMA /
// qmm_t: the threadgroup stages a tile of x and a tile of W (dequantized)
// in threadgroup memory and its simdgroups multiply them with 8x8
// simdgroup matrices. One dispatch per K-segment (qmatmul_host.h), so the
// kernel is specialized at compile time for one activation dtype, scale
// dtype, bit width and group size.
#include "mixbits_metal.h"
#include "qmatmul_common.h"

// Threadgroup = 4 simdgroups (128 threads); grid = (ceil(N / 32),
// ceil(M / 32)); one 32 x 32 block of outputs per threadgroup.
//
// Per BK = 32 step, every thread
//  - loads 8 consecutive activations of one x row (gathered through perm;
//    rows past M read 0) into the x tile  xt[BM][S], and
//  - dequantizes 8 consecutive codes of one W row (one run of `bits` bytes,
//    inside one group) into the W tile  wt[BN][S] (rows past N repeat the
//    last row: computed, never stored);
// then, after a barrier, simdgroup (sm, sn) = (simd_gid / 2, simd_gid % 2)
// accumulates its 16 x 16 block of outputs (rows 16 sm.., columns 16 sn..)
// over the step's four 8-column slices: x fragments by plain loads at an
// origin, Wᵀ fragments by transposed loads of W rows (B(k, n) = wt[n][k]).
// Tiles and accumulators are float: the products and sums are exact float
// arithmetic whatever the activation dtype (as MLX accumulates in float).
// At the end the accumulators go through threadgroup memory (the x tile's
// space) so that each thread stores 8 outputs with bounds checks.
template <typename IO, typename SC, int bits, int group_size>
[[kernel]] void mb_qmm(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    const device uint32_t* wq [[buffer(2)]],
    const device typename SC::storage* scales [[buffer(3)]],
    const device typename SC::storage* biases [[buffer(4)]],
    device float* acc [[buffer(5)]],
    device typename IO::storage* out [[buffer(6)]],
    constant MbQmmParams& p [[buffer(7)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]]) {
  constexpr int S = MB_QMM_TILE_STRIDE;
  static_assert(MB_QMM_BK % 8 == 0 && MB_QMM_BK <= 32, "a BK step lies in one group");
  threadgroup float* xt = smem;                  // [BM][S]
  threadgroup float* wt = smem + MB_QMM_BM * S;  // [BN][S]

  const int n0 = int(tid.x) * MB_QMM_BN;
  const int m0 = int(tid.y) * MB_QMM_BM;

  // Loader role: row `lrow` of both tiles, columns lcol .. lcol + 7.
  const int lrow = int(lid) / 4;
  const int lcol = (int(lid) % 4) * 8;
  const int xm = m0 + lrow;
  const bool x_in = xm < p.M;
  const device typename IO::storage* xrow = x + size_t(x_in ? xm : 0) * size_t(p.K);
  const size_t wn = size_t(min(n0 + lrow, p.N - 1));
  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);
  const device uint8_t* wrow = (const device uint8_t*)wq + wn * row_bytes;

  // MMA role: this simdgroup's 16 x 16 block of the tile.
  const int sm = 16 * int(simd_gid / 2);
  const int sn = 16 * int(simd_gid % 2);
  simdgroup_float8x8 c[2][2];
  MB_UNROLL for (int i = 0; i < 2; ++i) {
    MB_UNROLL for (int j = 0; j < 2; ++j) {
      c[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }

  for (int kt = 0; kt < p.kseg; kt += MB_QMM_BK) {
    const int c0 = p.k0 + kt + lcol;
    MB_UNROLL for (int i = 0; i < 8; ++i) {
      xt[lrow * S + lcol + i] = x_in ? mb_load_x<IO>(xrow, perm, p, c0 + i) : 0.0f;
    }
    uint32_t codes[8];
    mb_unpack8<bits>(wrow + size_t(kt + lcol) * bits / 8, codes);
    const size_t gi = wn * groups + size_t((kt + lcol) / group_size);
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
    // The next step overwrites the tiles: wait until everyone has read them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Stage the outputs in the x tile's space (free after the last barrier).
  threadgroup float* ct = xt;  // [BM][S]
  MB_UNROLL for (int i = 0; i < 2; ++i) {
    MB_UNROLL for (int j = 0; j < 2; ++j) {
      simdgroup_store(c[i][j], ct, S, ulong2(ulong(sn + 8 * j), ulong(sm + 8 * i)));
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int m = m0 + lrow;
  MB_UNROLL for (int i = 0; i < 8; ++i) {
    const int n = n0 + lcol + i;
    if (m < p.M && n < p.N) {
      mb_qmm_store<IO>(acc, out, p, size_t(m) * size_t(p.N) + size_t(n),
                       ct[lrow * S + lcol + i]);
    }
  }
}

#define MB_QMM_INST(name, io, sc, bits, gs) \
  MB_INSTANTIATE_KERNEL(name, mb_qmm, io, sc, bits, gs)
MB_QMM_LADDER(MB_QMM_INST, "qmm")
