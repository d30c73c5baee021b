// NEON transposed product dx = dy · W (the gradient wrt x) on arm64.
//
// Threads split the K output columns in blocks of 16 (one decode16 of a
// row; a segment starts on a group boundary, so a block never straddles
// two segments): every dx element has one writer. Per block, kTN rows of W
// are decoded and dequantized (s·q + b, float32) into a small buffer once,
// then dy is swept four rows at a time with sixteen accumulators in
// registers: each buffered row of W feeds 4 × 4 FMAs.
//
// Checked under qemu-user (tests/test_qmatmul_neon_emulated.py); speed on
// Apple cores is not measured, so the gradient on arm64 keeps MLX's
// dequantize + matmul unless "neon" is forced (prefer_qmm_t).
#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "qmatmul/kernel.h"

#if defined(__ARM_NEON) && defined(__aarch64__)
#include "qmatmul/neon_decode.h"

namespace mixbits {
namespace {

constexpr int kTN = 64;  // rows of W per buffered tile (4 KB of floats)

// dx[:, 16·j .. 16·j + 16) of segment s (columns relative to the segment).
template <int B>
void block(const float* dy, int M, int N, const SegView& s, DType sdt, int64_t j, float* dx,
           int ldx) {
  const int64_t ng = s.groups_per_row(), g = j * 16 / s.group_size;
  alignas(16) float wt[kTN][16];
  float* out = dx + s.k0 + 16 * j;
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < 16; ++i) out[int64_t(m) * ldx + i] = 0.0f;
  for (int n0 = 0; n0 < N; n0 += kTN) {
    const int nt = std::min(kTN, N - n0);
    for (int r = 0; r < nt; ++r) {
      const int64_t n = n0 + r;
      const uint8_t* row = reinterpret_cast<const uint8_t*>(s.wq + n * s.words_per_row());
      const float32x4_t sc = vdupq_n_f32(load_as_f32(s.scales, n * ng + g, sdt));
      const float32x4_t bi = vdupq_n_f32(load_as_f32(s.biases, n * ng + g, sdt));
      float32x4_t q[4];
      neon::widen(neon::decode16<B>(row, j), q);
      // s·q then + b, two roundings as mx.dequantize: an element it makes
      // exactly 0 stays 0 here (a fused multiply-add would leave s·q - b's
      // rounding error, a nonzero gradient through a zero weight).
      for (int v = 0; v < 4; ++v) vst1q_f32(wt[r] + 4 * v, vaddq_f32(vmulq_f32(q[v], sc), bi));
    }
    for (int m0 = 0; m0 < M; m0 += 4) {
      const int mt = std::min(4, M - m0);
      float32x4_t acc[4][4];
      for (int a = 0; a < mt; ++a)
        for (int v = 0; v < 4; ++v) acc[a][v] = vld1q_f32(out + int64_t(m0 + a) * ldx + 4 * v);
      for (int r = 0; r < nt; ++r) {
        float32x4_t w[4];
        for (int v = 0; v < 4; ++v) w[v] = vld1q_f32(wt[r] + 4 * v);
        for (int a = 0; a < mt; ++a) {
          const float d = dy[int64_t(m0 + a) * N + n0 + r];
          for (int v = 0; v < 4; ++v) acc[a][v] = vfmaq_n_f32(acc[a][v], w[v], d);
        }
      }
      for (int a = 0; a < mt; ++a)
        for (int v = 0; v < 4; ++v) vst1q_f32(out + int64_t(m0 + a) * ldx + 4 * v, acc[a][v]);
    }
  }
}

using BlockFn = void (*)(const float*, int, int, const SegView&, DType, int64_t, float*, int);
constexpr BlockFn kBlock[9] = {nullptr,  nullptr,  block<2>, block<3>, block<4>,
                               block<5>, block<6>, nullptr,  block<8>};

}  // namespace

void qmm_t_neon_run(const float* dy, int M, const QMatView& w, float* dx) {
  // Work items: (segment, 16-column block), in column order.
  std::vector<std::pair<int, int64_t>> items;
  for (size_t si = 0; si < w.segs.size(); ++si)
    for (int64_t j = 0; j < w.segs[si].k / 16; ++j) items.push_back({int(si), j});
  parallel_for(int64_t(items.size()), 2, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const SegView& s = w.segs[items[i].first];
      kBlock[s.bits](dy, M, w.N, s, w.sdtype, items[i].second, dx, w.K);
    }
  });
}

}  // namespace mixbits

#else  // an arm64 target without NEON: the reference stands in

namespace mixbits {
void qmm_t_neon_run(const float* dy, int M, const QMatView& w, float* dx) {
  qmm_t_ref_run(dy, M, w, dx);
}
}  // namespace mixbits

#endif
