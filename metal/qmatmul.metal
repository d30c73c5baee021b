// Metal kernels of the mixed-segment quantized matmul y = x · Wᵀ.
//
// W is a list of K-segments, each stored exactly as MLX stores a quantized
// matrix (see quant_utils.h); the host launches one dispatch per segment
// (qmatmul_params.h), so every kernel here is specialized at compile time
// for one bit width and group size. Two kernels:
//  - mb_qmv: GEMV for few rows of x, in the style of MLX's qmv_fast;
//  - mb_qmm: a tiled kernel staging x and dequantized W in threadgroup
//    memory, for larger M.
#include "mixbits_metal.h"
#include "qmatmul_params.h"
#include "quant_utils.h"

// Finishes one output: adds the partial sum of earlier segments and stores
// either the final value or the new partial sum.
template <typename IO>
inline void mb_qmm_store(device float* acc, device typename IO::storage* out,
                         constant MbQmmParams& p, size_t idx, float v) {
  if (p.accumulate) v += acc[idx];
  if (p.write_out) {
    out[idx] = IO::store(v);
  } else {
    acc[idx] = v;
  }
}

// Activation column c of row `xrow` (c in permuted order). A perm entry
// outside [0, K) reads NaN rather than out-of-bounds memory, so a broken
// permutation poisons the output (as the CPU path does) instead of reading
// garbage.
template <typename IO>
inline float mb_load_x(const device typename IO::storage* xrow,
                       const device int32_t* perm, constant MbQmmParams& p,
                       int c) {
  if (!p.has_perm) return IO::load(xrow[c]);
  const uint32_t pc = uint32_t(perm[c]);
  return pc < uint32_t(p.K) ? IO::load(xrow[pc]) : NAN;
}

// GEMV. Threadgroup = 2 simdgroups x 32 lanes; grid = (M, ceil(N / 8)).
// Each simdgroup owns 4 consecutive output rows; each lane walks the
// segment in chunks of 16 columns (lane l starts at 16 l, steps 512), loads
// and pre-scales its 16 activations once, and dots them with the 4 rows'
// codes by masking bytes (mb_qdot16). One simd_sum per row at the end.
// The bias is folded: sum_j (s q_j + b) x_j = s sum q_j x_j + b sum x_j.
template <typename IO, int bits, int group_size>
[[kernel]] void mb_qmv(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    const device uint32_t* wq [[buffer(2)]],
    const device uint8_t* scales [[buffer(3)]],
    const device uint8_t* biases [[buffer(4)]],
    device float* acc [[buffer(5)]],
    device typename IO::storage* out [[buffer(6)]],
    constant MbQmmParams& p [[buffer(7)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  const int m = int(tid.x);
  const int row0 = int(tid.y) * MB_QMV_ROWS_PER_GROUP +
                   int(simd_gid) * MB_QMV_ROWS_PER_SIMDGROUP;
  // The whole simdgroup leaves together (no barrier in this kernel), so the
  // simd_sum below always has all 32 lanes.
  if (row0 >= p.N) return;
  // Rows past N reuse the last valid row's weights (no bounds check in the
  // inner loop) and are not stored.
  const int last = min(int(MB_QMV_ROWS_PER_SIMDGROUP) - 1, p.N - 1 - row0);

  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);
  const device uint8_t* wbytes = (const device uint8_t*)wq;
  const device typename IO::storage* xrow = x + size_t(m) * size_t(p.K);

  float result[MB_QMV_ROWS_PER_SIMDGROUP] = {0.0f, 0.0f, 0.0f, 0.0f};
  float xs[MB_CHUNK];

  for (int k = int(simd_lid) * MB_CHUNK; k < p.kseg; k += 32 * MB_CHUNK) {
    const int c0 = p.k0 + k;
    MB_UNROLL for (int i = 0; i < MB_CHUNK; ++i) {
      const int c = c0 + i;
      xs[i] = mb_load_x<IO>(xrow, perm, p, c);
    }
    const float xsum = mb_prescale16<bits>(xs);
    const size_t g = size_t(k / group_size);
    MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
      const size_t n = size_t(row0 + min(r, last));
      const device uint8_t* w = wbytes + n * row_bytes + size_t(k) * bits / 8;
      const float s = mb_load_scale(scales, n * groups + g, p.scale_type);
      const float b = mb_load_scale(biases, n * groups + g, p.scale_type);
      result[r] += s * mb_qdot16<bits>(w, xs) + b * xsum;
    }
  }

  MB_UNROLL for (int r = 0; r < MB_QMV_ROWS_PER_SIMDGROUP; ++r) {
    const float v = simd_sum(result[r]);
    if (simd_lid == 0 && r <= last) {
      mb_qmm_store<IO>(acc, out, p, size_t(m) * size_t(p.N) + size_t(row0 + r), v);
    }
  }
}

// Tiled. Threadgroup = 128 threads; grid = (ceil(N / 32), ceil(M / 32)).
// Per BK = 32 step: every thread loads 8 consecutive activations of one x
// row (gathered through perm) and dequantizes 8 consecutive codes of one W
// row (one run of `bits` bytes, one group) into threadgroup memory; after a
// barrier each thread accumulates a 2 x 4 block of outputs
// (rows tm, tm + 16; columns tn + 8 j) from the staged tiles.
template <typename IO, int bits, int group_size>
[[kernel]] void mb_qmm(
    const device typename IO::storage* x [[buffer(0)]],
    const device int32_t* perm [[buffer(1)]],
    const device uint32_t* wq [[buffer(2)]],
    const device uint8_t* scales [[buffer(3)]],
    const device uint8_t* biases [[buffer(4)]],
    device float* acc [[buffer(5)]],
    device typename IO::storage* out [[buffer(6)]],
    constant MbQmmParams& p [[buffer(7)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]]) {
  constexpr int S = MB_QMM_TILE_STRIDE;
  threadgroup float* xt = smem;                 // [BM][S]
  threadgroup float* wt = smem + MB_QMM_BM * S;  // [BN][S]

  const int n0 = int(tid.x) * MB_QMM_BN;
  const int m0 = int(tid.y) * MB_QMM_BM;

  // Loader role: row `lrow` of both tiles, columns lcol .. lcol + 7.
  const int lrow = int(lid) / 4;
  const int lcol = (int(lid) % 4) * 8;
  const int xm = m0 + lrow;
  const bool x_in = xm < p.M;
  const device typename IO::storage* xrow = x + size_t(x_in ? xm : 0) * size_t(p.K);
  // Rows of W past N load the last row (kept in bounds, never stored).
  const size_t wn = size_t(min(n0 + lrow, p.N - 1));
  const size_t row_bytes = size_t(p.kseg) * bits / 8;
  const size_t groups = size_t(p.kseg / group_size);
  const device uint8_t* wrow = (const device uint8_t*)wq + wn * row_bytes;

  // Compute role.
  const int tm = int(lid) / 8;
  const int tn = int(lid) % 8;
  float accv[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};

  for (int kt = 0; kt < p.kseg; kt += MB_QMM_BK) {
    const int c0 = p.k0 + kt + lcol;
    MB_UNROLL for (int i = 0; i < 8; ++i) {
      const int c = c0 + i;
      xt[lrow * S + lcol + i] = x_in ? mb_load_x<IO>(xrow, perm, p, c) : 0.0f;
    }
    uint32_t codes[8];
    mb_unpack8<bits>(wrow + size_t(kt + lcol) * bits / 8, codes);
    const size_t gi = wn * groups + size_t((kt + lcol) / group_size);
    const float s = mb_load_scale(scales, gi, p.scale_type);
    const float b = mb_load_scale(biases, gi, p.scale_type);
    MB_UNROLL for (int i = 0; i < 8; ++i) {
      wt[lrow * S + lcol + i] = s * float(codes[i]) + b;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int kk = 0; kk < MB_QMM_BK; ++kk) {
      const float a0 = xt[tm * S + kk];
      const float a1 = xt[(tm + 16) * S + kk];
      MB_UNROLL for (int j = 0; j < 4; ++j) {
        const float w = wt[(tn + 8 * j) * S + kk];
        accv[0][j] += a0 * w;
        accv[1][j] += a1 * w;
      }
    }
    // The next step overwrites the tiles: wait until everyone has read them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  MB_UNROLL for (int i = 0; i < 2; ++i) {
    const int m = m0 + tm + 16 * i;
    MB_UNROLL for (int j = 0; j < 4; ++j) {
      const int n = n0 + tn + 8 * j;
      if (m < p.M && n < p.N) {
        mb_qmm_store<IO>(acc, out, p, size_t(m) * size_t(p.N) + size_t(n), accv[i][j]);
      }
    }
  }
}

// Host names: mixbits_{qmv,qmm}_{float32,float16,bfloat16}_b{bits}_g{gs}
// (built the same way in qmatmul_host.h).
#define MB_QMM_INSTANTIATE(tname, io, bits, gs)                                \
  MB_INSTANTIATE_KERNEL("mixbits_qmv_" #tname "_b" #bits "_g" #gs, mb_qmv, io, \
                        bits, gs)                                              \
  MB_INSTANTIATE_KERNEL("mixbits_qmm_" #tname "_b" #bits "_g" #gs, mb_qmm, io, \
                        bits, gs)

#define MB_QMM_INSTANTIATE_GROUPS(tname, io, bits) \
  MB_QMM_INSTANTIATE(tname, io, bits, 32)          \
  MB_QMM_INSTANTIATE(tname, io, bits, 64)          \
  MB_QMM_INSTANTIATE(tname, io, bits, 128)

#define MB_QMM_INSTANTIATE_BITS(tname, io)   \
  MB_QMM_INSTANTIATE_GROUPS(tname, io, 2)    \
  MB_QMM_INSTANTIATE_GROUPS(tname, io, 3)    \
  MB_QMM_INSTANTIATE_GROUPS(tname, io, 4)    \
  MB_QMM_INSTANTIATE_GROUPS(tname, io, 5)    \
  MB_QMM_INSTANTIATE_GROUPS(tname, io, 6)    \
  MB_QMM_INSTANTIATE_GROUPS(tname, io, 8)

MB_QMM_INSTANTIATE_BITS(float32, MbF32)
MB_QMM_INSTANTIATE_BITS(float16, MbF16)
MB_QMM_INSTANTIATE_BITS(bfloat16, MbBF16)
