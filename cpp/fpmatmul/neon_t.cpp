// NEON kernel of the fp-mode product with W not transposed (kernel.h's
// FpmTRun), arm64: avx2_t.cpp's scheme in 4-lane vectors. Threads split the
// C output columns in blocks of 128; panels of 128 rows of W are decoded
// through neon_decode.h's tables and multiplied into 3 x rows × 32 columns
// at a time. Each output is one float32 FMA chain over r in order (kept in
// y between panels), whatever the blocking or the number of threads.
#include <arm_neon.h>

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "fpmatmul/kernel.h"
#include "fpmatmul/neon_decode.h"

namespace mixbits {

namespace {

constexpr int kColBlock = 128, kRowPanel = 128;

template <int MR, int NV>
inline void panel_tile(const float* const* xr, const float* panel, int rows, int pw,
                       float* const* yr) {
  float32x4_t acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vld1q_f32(yr[i] + 4 * v);
  for (int r = 0; r < rows; ++r) {
    const float* p = panel + int64_t(r) * pw;
    for (int i = 0; i < MR; ++i) {
      const float32x4_t xv = vdupq_n_f32(xr[i][r]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfmaq_f32(acc[i][v], vld1q_f32(p + 4 * v), xv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) vst1q_f32(yr[i] + 4 * v, acc[i][v]);
}

template <int NV>
void panel_rows(const float* x, int M, int64_t R, int r0, const float* panel, int rows, int pw,
                int64_t c, float* y, int64_t C) {
  int m = 0;
  for (; m + 3 <= M; m += 3) {
    const float* xr[3] = {x + m * R + r0, x + (m + 1) * R + r0, x + (m + 2) * R + r0};
    float* yr[3] = {y + m * C + c, y + (m + 1) * C + c, y + (m + 2) * C + c};
    panel_tile<3, NV>(xr, panel, rows, pw, yr);
  }
  for (; m < M; ++m) {
    const float* xr[1] = {x + m * R + r0};
    float* yr[1] = {y + m * C + c};
    panel_tile<1, NV>(xr, panel, rows, pw, yr);
  }
}

void columns(const float* x, int M, const FpView& w, float* y, int64_t c0, int64_t c1) {
  const int G = fp_mode_group(w.mode);
  const int64_t R = w.N, C = w.K;
  const int pw = int(c1 - c0);  // a multiple of 16 (the group sizes are)
  for (int m = 0; m < M; ++m) std::fill(y + m * C + c0, y + m * C + c1, 0.0f);
  std::vector<float> panel(size_t(kRowPanel) * pw);
  for (int r0 = 0; r0 < R; r0 += kRowPanel) {
    const int rows = int(std::min<int64_t>(kRowPanel, R - r0));
    for (int r = 0; r < rows; ++r)
      decode_span(w, r0 + r, c0 / G, c1 / G, panel.data() + int64_t(r) * pw);
    int c = 0;
    for (; c + 32 <= pw; c += 32) panel_rows<8>(x, M, R, r0, panel.data() + c, rows, pw, c0 + c, y, C);
    if (c < pw) panel_rows<4>(x, M, R, r0, panel.data() + c, rows, pw, c0 + c, y, C);
  }
}

}  // namespace

void fpm_t_neon_run(const float* x, int M, const FpView& w, float* y) {
  if (M <= 0 || w.K <= 0) return;
  const int64_t blocks = (int64_t(w.K) + kColBlock - 1) / kColBlock;
  parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      columns(x, M, w, y, b * kColBlock, std::min<int64_t>((b + 1) * kColBlock, w.K));
  });
}

}  // namespace mixbits
