// The tiled kernels' K walk over one segment (mb_qmm_segment) and the W
// tile's element type (MbWTile), shared by the dense tiled kernel
// (qmatmul_tiled.metal) and the gathered one (gather_qmm.metal): both walk
// a segment table (MbQmmFusedParams) one segment after another with the
// accumulators in registers. Included by .metal sources only (after
// mixbits_metal.h).
#pragma once
#include "qmatmul_common.h"

// One segment of width `bits`, BK = 32 columns per step, for a BM x BN
// block of outputs (32 x 32, or 16 x 64 for 9 .. 16 rows of x). The tiles
// are double-buffered: step t (counted over all segments: `step`) fills
// buffer t % 2 (x tile xt[BM][S], W tile wt[BN][S]), meets ONE barrier,
// and multiplies from it; step t + 1 fills the other buffer, which every
// thread finished reading before that barrier, so no second barrier is
// needed to protect the tiles, and fast threads load the next step while
// slow ones still multiply. Per step, thread lid (row lid / 4 of the
// tiles, columns (lid % 4) * 8 ..)
//  - if its row is one of the BM, loads 8 consecutive activations of one x
//    row into the x tile (rows without x_in -- past M, or the gathered
//    kernel's rows outside the run -- read 0); with a perm, through the
//    step's 32 perm entries, staged (double-buffered too, pt[2][BK]) by
//    threads 0 .. 31 one step ahead, so each entry is read once per step,
//    not once per row of x;
//  - dequantizes 8 consecutive codes of each of its BN / 32 W rows (rows
//    lid / 4 + 32 t; inside one group) into the W tile (rows past N repeat
//    the last row: computed, never stored), the row's step read as `bits`
//    uint32 words shared by its 4 loader threads through simd_shuffle;
// then, after the barrier, simdgroup (sm, sn) accumulates its 16 x 16
// block of outputs over the step's four 8-column slices, skipping each of
// its two 8-row x fragments that lies wholly at or past `rows` (the rows
// of the x tile that hold x: a partial last block of the dense kernel, a
// short run of one expert's rows in the gathered one; the fragment's
// accumulators stay 0 and its MMAs are not issued): x fragments by
// lane loads (each lane its two elements of the fragment, thread_elements,
// converted to float), Wᵀ fragments the same way from W rows
// (B(k, n) = wt[n][k]). Steps are contiguous across segments (the next
// step's columns are always the next 32 of the permuted order). The x tile
// holds x as stored (IO::storage: float, or the 2-byte half / bfloat16
// bits -- exact, and half the threadgroup bytes of a float tile); the W
// tile holds W as mx.dequantize gives it in the scales' dtype: float16
// when x and the scales are float16 (MbWTile: half the bytes of a float
// tile, the value rounded as mx.dequantize rounds it), else float (for
// float16 x with float32 or bfloat16 scales too). Fragments and
// accumulators are float: products of the tiles' elements are exact and
// sums float arithmetic whatever the dtypes (as MLX accumulates in float).
template <typename IO, typename SC>
struct MbWTile {  // float W tile: s q + b as float
  typedef float type;
  static float dequant(float s, uint32_t q, float b) { return s * float(q) + b; }
};
// x and scales float16: the W tile is float16 and holds exactly what
// mx.dequantize gives in float16, which rounds s q to float16 and then the
// sum with b: half(half(s q) + b). s q is exact in float (11 x 8 bits) and
// the float sum of two halves rounds to the same half as the exact sum
// (a float rounding cannot make a half tie), so this is that value.
template <>
struct MbWTile<MbF16, MbF16> {
  typedef half type;
  static half dequant(float s, uint32_t q, float b) { return half(float(half(s * float(q))) + b); }
};

// xrow: this thread's row of x (read only where x_in); w, scales, biases:
// the segment's N rows of W (the gathered kernel: its expert's); rows: the
// x tile's rows that may hold x (1 .. BM; the same in every thread);
// step: the steps walked so far (picks the tile buffer, advanced); c: the
// simdgroup's 2 x 2 accumulators.
template <typename IO, typename SC, int bits, int BM>
inline void mb_qmm_segment(const device typename IO::storage* xrow, bool x_in,
                           const device int32_t* perm, const device uint8_t* w,
                           const device typename SC::storage* scales,
                           const device typename SC::storage* biases,
                           constant MbQmmFusedParams& p, constant MbQmmSeg& sg,
                           threadgroup float* smem, int n0, uint lid, uint simd_gid,
                           int rows, thread int& step, thread simdgroup_float8x8* c) {
  constexpr int BN = mb_qmm_bn(BM);
  constexpr int WR = BN / 32;  // W rows per loader thread
  typedef typename IO::storage XT;
  typedef MbWTile<IO, SC> WTile;
  typedef typename WTile::type WT;
  constexpr int XS = mb_qmm_xstride(sizeof(XT));  // x tile row stride
  constexpr int S = mb_qmm_wstride(sizeof(WT));   // W tile row stride
  constexpr int TILE = mb_qmm_buffer_floats(BM, sizeof(XT), sizeof(WT));  // x, then W
  constexpr int XF = mb_qmm_tile_floats(BM, sizeof(XT));  // floats of the x tile
  const int lrow = int(lid) / 4;
  const int lcol = (int(lid) % 4) * 8;
  const size_t row_bytes = size_t(sg.kseg) * bits / 8;
  const size_t groups = size_t(sg.kseg) >> sg.group_shift;
  size_t wn[WR];
  MB_UNROLL for (int t = 0; t < WR; ++t) wn[t] = size_t(min(n0 + lrow + 32 * t, p.N - 1));
  const int sm = 16 * (int(simd_gid) / (BN / 16));
  const int sn = 16 * (int(simd_gid) % (BN / 16));
  // Word loads: this thread is loader j of its row (lanes lane0 .. + 3);
  // its codes start in word q of the step, at bit `shift`. A row's step is
  // 4 bits bytes from a 4-byte aligned row start (kseg is a multiple of 32,
  // so rows are 4 bits-byte multiples): the words are aligned.
  const int j = int(lid) % 4;
  const uint lane0 = (lid % 32u) & ~3u;
  const int q = (8 * j * bits) / 32;
  const int shift = (8 * j * bits) % 32;
  // This lane's two elements of an 8 x 8 fragment (Apple's layout, as MLX's
  // BaseMMAFrag::get_coord): row fr, columns fc and fc + 1.
  const uint lane = lid % 32u;
  const int fr = int(4 * (lane / 16) + (lane / 2) % 4);
  const int fc = int(4 * ((lane / 8) % 2) + 2 * (lane % 2));

  for (int kt = 0; kt < sg.kseg; kt += MB_QMM_BK, ++step) {
    const int buf = step & 1;
    threadgroup XT* xt = MB_TG_CAST(XT, smem + buf * TILE);     // [BM][XS]
    threadgroup WT* wt = MB_TG_CAST(WT, smem + buf * TILE + XF);  // [BN][S]
    threadgroup float* pt = smem + 2 * TILE + buf * MB_QMM_BK;  // [BK] int bits
    const int c0 = sg.k0 + kt + lcol;
    if (lrow < BM) {  // x loader rows (all 32 when BM = 32)
      MB_UNROLL for (int i = 0; i < 8; ++i) {
        XT v = IO::store(0.0f);
        if (x_in) {
          if (p.has_perm) {
            const uint32_t pc = as_type<uint32_t>(pt[lcol + i]);
            v = pc < uint32_t(p.K) ? xrow[pc] : IO::store(NAN);
          } else {
            v = xrow[c0 + i];
          }
        }
        xt[lrow * XS + lcol + i] = v;
      }
    }
    // The step's `bits` words of each of this thread's W rows: loader j (of
    // the row's 4, consecutive lanes) loads words j and j + 4, each word
    // once, and gets the two words its 8 codes lie in from their owners by
    // shuffles (4-byte loads only, every weight byte requested once per
    // tile).
    MB_UNROLL for (int t = 0; t < WR; ++t) {
      const device uint32_t* ws =
          (const device uint32_t*)(w + wn[t] * row_bytes + size_t(kt) * bits / 8);
      MB_CHECK_ALIGNED(ws);
      const uint32_t wa = j < bits ? ws[j] : 0u;
      const uint32_t wb = j + 4 < bits ? ws[j + 4] : 0u;
      const uint32_t sa = simd_shuffle(wa, ushort(lane0 + q % 4));
      const uint32_t sb = simd_shuffle(wb, ushort(lane0 + q % 4));
      const uint32_t ta = simd_shuffle(wa, ushort(lane0 + (q + 1) % 4));
      const uint32_t tb = simd_shuffle(wb, ushort(lane0 + (q + 1) % 4));
      uint32_t codes[8];
      mb_unpack8_words<bits>(q < 4 ? sa : sb, q + 1 < 4 ? ta : tb, shift, codes);
      const size_t gi = wn[t] * groups + (size_t(kt + lcol) >> sg.group_shift);
      const float s = SC::load(scales[gi]);
      const float b = SC::load(biases[gi]);
      MB_UNROLL for (int i = 0; i < 8; ++i) {
        wt[(lrow + 32 * t) * S + lcol + i] = WTile::dequant(s, codes[i], b);
      }
    }
    // The next step's perm entries into the other pt buffer (last read by
    // the previous step's x loads, before the previous barrier).
    const int next = sg.k0 + kt + MB_QMM_BK + int(lid);
    if (p.has_perm && lid < uint(MB_QMM_BK) && next < p.K) {
      smem[2 * TILE + (buf ^ 1) * MB_QMM_BK + int(lid)] =
          as_type<float>(mb_perm_col(perm, 1, p.K, next));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // The simdgroup's x fragments that hold rows of x (uniform over it).
    const bool live0 = sm < rows, live1 = sm + 8 < rows;
    if (live0) {
      MB_UNROLL for (int kk = 0; kk < MB_QMM_BK; kk += 8) {
        simdgroup_float8x8 a[2], bt[2];
        MB_UNROLL for (int i = 0; i < 2; ++i) {
          if (i == 0 || live1) {
            const int o = (sm + 8 * i + fr) * XS + kk + fc;
            a[i].thread_elements()[0] = IO::load(xt[o]);
            a[i].thread_elements()[1] = IO::load(xt[o + 1]);
          }
        }
        // B(k, n) = wt[n][k]: this lane's row fr (k), columns fc, fc + 1 (n).
        MB_UNROLL for (int j = 0; j < 2; ++j) {
          const int o = (sn + 8 * j + fc) * S + kk + fr;
          bt[j].thread_elements()[0] = float(wt[o]);
          bt[j].thread_elements()[1] = float(wt[o + S]);
        }
        MB_UNROLL for (int i = 0; i < 2; ++i) {
          if (i == 0 || live1) {
            MB_UNROLL for (int j = 0; j < 2; ++j) {
              simdgroup_multiply_accumulate(c[2 * i + j], a[i], bt[j], c[2 * i + j]);
            }
          }
        }
      }
    }
  }
}
