// GEMV of y = x · Wᵀ for few rows of x (M <= MB_FPQ_MAX_M) with W in one of
// MLX's floating-point quantization modes, exactly as mx.quantize stores it:
//   mxfp4: e2m1 codes, 32 per e8m0 scale byte;
//   nvfp4: e2m1 codes, 16 per e4m3 scale byte;
//   mxfp8: e4m3 codes, 32 per e8m0 scale byte.
// Codes are packed LSB first in uint32 words, scales one uint8 per group.
//
// The decoded weight is code value × scale, one float32 product that is
// exact (at most 4 significant bits each): the value mx.dequantize gives,
// so an inf scale (e8m0 255) times a zero code is NaN here as there. The
// weight is formed before it meets x (not scale × Σ code·x, which would
// turn those NaNs into infs). Sums in float32.
//
// Layout in the style of MLX's qmv_fast: threadgroup = 2 simdgroups x 32
// lanes, grid = (M, ceil(N / 8)); each simdgroup owns 4 consecutive output
// rows of x row tid.x. Lane l walks K in chunks of 16 columns starting at
// 16 l, stepping 512, loads its 16 activations once and reads each row's
// chunk as whole uint32 words (2 for 4-bit codes, 4 for 8-bit). A chunk
// lies in one group (groups are 16 or 32 columns, chunks start at multiples
// of 16), so one scale byte per row per chunk. One simd_sum per row at the
// end. K need only be a multiple of 16: lanes past the end add nothing.
#include "mixbits_metal.h"
#include "quant_utils.h"
#include "fp_qmv_params.h"

// e2m1: bit 3 the sign, then 2 exponent bits and 1 mantissa bit (bias 1).
constant float kMbE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// e4m3 (bias 7, no infinities, 0x7f / 0xff NaN) by bit placement: a normal
// code's 4 exponent and 3 mantissa bits go under float's exponent field with
// the bias moved from 7 to 127; a subnormal (exponent 0) is m/8 · 2^-6,
// computed as m · 2^-9 so no float subnormal is ever formed.
inline float mb_e4m3(uint32_t c) {
  const uint32_t mag = c & 0x7fu;
  float v = (mag >> 3) == 0 ? float(mag) * (1.0f / 512.0f)
                            : as_type<float>((mag + (120u << 3)) << 20);
  v = mag == 0x7fu ? NAN : v;
  return as_type<float>(as_type<uint32_t>(v) | ((c & 0x80u) << 24));
}

// e8m0 as MLX decodes it: 2^(s-127) in float; 255 is 2^128 = inf (the
// exponent field all ones), 0 the subnormal 2^-127.
inline float mb_e8m0(uint32_t s) {
  return s == 0 ? as_type<float>(0x00400000u) : as_type<float>(s << 23);
}

template <int mode>
inline float mb_fp_scale(uint8_t s) {
  return mode == MB_FP_NVFP4 ? mb_e4m3(s) : mb_e8m0(s);
}

template <typename IO, int mode>
[[kernel]] void mb_fp_qmv(
    const device typename IO::storage* x [[buffer(0)]],
    const device uint32_t* wq [[buffer(1)]],
    const device uint8_t* scales [[buffer(2)]],
    device typename IO::storage* out [[buffer(3)]],
    constant MbFpQmvParams& p [[buffer(4)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  constexpr int bits = mode == MB_FP_MXFP8 ? 8 : 4;
  constexpr int group = mode == MB_FP_NVFP4 ? 16 : 32;
  constexpr int per_word = 32 / bits;
  constexpr int n_words = MB_FPQ_CHUNK / per_word;
  constexpr uint32_t mask = (1u << bits) - 1u;

  const int m = int(tid.x);
  const int row0 = int(tid.y) * MB_FPQ_ROWS_PER_GROUP + int(simd_gid) * MB_FPQ_ROWS_PER_SIMDGROUP;
  // The whole simdgroup leaves together (no barrier here), so the simd_sum
  // below always has all 32 lanes.
  if (row0 >= p.N) return;
  // Rows past N are computed again from the last valid row, not stored.
  const int last = min(int(MB_FPQ_ROWS_PER_SIMDGROUP) - 1, p.N - 1 - row0);
  const size_t row_words = size_t(p.K) / per_word;
  const size_t groups = size_t(p.K / group);
  const device typename IO::storage* xrow = x + size_t(m) * size_t(p.K);

  float result[MB_FPQ_ROWS_PER_SIMDGROUP];
  MB_UNROLL for (int r = 0; r < MB_FPQ_ROWS_PER_SIMDGROUP; ++r) result[r] = 0.0f;
  float xs[MB_FPQ_CHUNK];

  for (int k = int(simd_lid) * MB_FPQ_CHUNK; k < p.K; k += 32 * MB_FPQ_CHUNK) {
    MB_UNROLL for (int i = 0; i < MB_FPQ_CHUNK; ++i) xs[i] = IO::load(xrow[k + i]);
    MB_UNROLL for (int r = 0; r < MB_FPQ_ROWS_PER_SIMDGROUP; ++r) {
      const size_t n = size_t(row0 + min(r, last));
      const device uint32_t* wp = wq + n * row_words + size_t(k / per_word);
      const float s = mb_fp_scale<mode>(scales[n * groups + size_t(k / group)]);
      float acc = 0.0f;
      MB_UNROLL for (int j = 0; j < n_words; ++j) {
        const uint32_t w = wp[j];
        MB_UNROLL for (int i = 0; i < per_word; ++i) {
          const uint32_t c = (w >> (bits * i)) & mask;
          const float v = bits == 8 ? mb_e4m3(c) : kMbE2m1[c];
          acc += xs[j * per_word + i] * (v * s);
        }
      }
      result[r] += acc;
    }
  }
  MB_UNROLL for (int r = 0; r < MB_FPQ_ROWS_PER_SIMDGROUP; ++r) {
    result[r] = simd_sum(result[r]);
    if (simd_lid == 0 && r <= last)
      out[size_t(m) * size_t(p.N) + size_t(row0 + r)] = IO::store(result[r]);
  }
}

// mixbits_fp_qmv_<mode>_<x dtype> (fp_qmv_host.h's fp_qmv_kernel_name).
#define MB_FPQ_INST_MODE(mname, mode)                                           \
  MB_INSTANTIATE_KERNEL("mixbits_fp_qmv_" mname "_float32", mb_fp_qmv, MbF32, mode)   \
  MB_INSTANTIATE_KERNEL("mixbits_fp_qmv_" mname "_float16", mb_fp_qmv, MbF16, mode)   \
  MB_INSTANTIATE_KERNEL("mixbits_fp_qmv_" mname "_bfloat16", mb_fp_qmv, MbBF16, mode)
MB_FPQ_INST_MODE("mxfp4", MB_FP_MXFP4)
MB_FPQ_INST_MODE("nvfp4", MB_FP_NVFP4)
MB_FPQ_INST_MODE("mxfp8", MB_FP_MXFP8)
