// AVX2 kernel of the fp-mode product with W not transposed (kernel.h's
// FpmTRun): y[M, C] = x[M, R] · W[R, C], W stored as MLX stores it with
// transpose=False (R rows of C codes, groups along C). It is also the
// gradient wrt x of y = x · Wᵀ. Threads split the C output columns in
// blocks (128 columns, wider for few x rows); a block decodes panels of W's
// rows into a float buffer (64 KiB, L2) and multiplies them into 3 x rows ×
// 32 columns at a time. Each output is one float32 FMA chain over r = 0 .. R-1 in order
// (kept in y between panels: a float32 stored and reloaded is the same
// value), so the result depends on neither the blocking nor the threads.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "fpmatmul/avx2_decode.h"
#include "fpmatmul/kernel.h"

namespace mixbits {

namespace {

constexpr int kPrefetchRows = 16;

// Column block and row panel: 128 x 128 for many x rows; for few, wider
// blocks (up to 4096 columns, the threads' share) with fewer rows per panel
// (the buffer stays 64 KiB), so each row's span of codes is a long
// contiguous read. The blocking changes no sum (one chain per output in r
// order), so it may depend on M and the thread count.
struct Blocking {
  int64_t cols;
  int rows;
};

Blocking blocking(int M, int64_t C) {
  const int64_t share = C / (128 * std::max(1, max_threads()));
  const int64_t units = std::max<int64_t>(1, std::min<int64_t>(share, 32 / std::max(1, M)));
  return {128 * units, int(std::max<int64_t>(4, 128 / units))};
}

// y[i, c .. c + 8·NV) += sum over the panel's rows r of x[i, r0 + r] ·
// panel[r, c ..], for MR rows i of x.
template <int MR, int NV>
inline void panel_tile(const float* const* xr, const float* panel, int rows, int pw,
                       float* const* yr) {
  __m256 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_loadu_ps(yr[i] + 8 * v);
  for (int r = 0; r < rows; ++r) {
    const float* p = panel + int64_t(r) * pw;
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(xr[i] + r);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8 * v), xv, acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(yr[i] + 8 * v, acc[i][v]);
}

template <int NV>
void panel_rows(const float* x, int M, int64_t R, int r0, const float* panel, int rows, int pw,
                int c, float* y, int64_t C) {
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

template <FpMode MD>
void columns(const float* x, int M, const FpView& w, float* y, int64_t c0, int64_t c1,
             int panel_rows_n) {
  constexpr int G = fp_mode_group(MD);
  const int64_t R = w.N, C = w.K, groups = w.groups_per_row();
  const int pw = int(c1 - c0);  // a multiple of 16 (the group sizes are)
  for (int m = 0; m < M; ++m) std::fill(y + m * C + c0, y + m * C + c1, 0.0f);
  std::vector<float> panel(size_t(panel_rows_n) * pw);
  for (int r0 = 0; r0 < R; r0 += panel_rows_n) {
    const int rows = int(std::min<int64_t>(panel_rows_n, R - r0));
    for (int r = 0; r < rows; ++r) {
      const uint32_t* row = w.wq + (r0 + r) * w.words_per_row();
      const uint8_t* srow = w.scales + (r0 + r) * groups;
      // The block's span of a row is one or two lines a row stride apart
      // from the last, a pattern the hardware prefetchers do not follow:
      // fetch the span kPrefetchRows rows ahead.
      if (r0 + r + kPrefetchRows < R) {
        const char* ahead = reinterpret_cast<const char*>(row + kPrefetchRows * w.words_per_row()) +
                            c0 * fp_mode_bits(MD) / 8;
        for (int64_t b = 0; b < pw * fp_mode_bits(MD) / 8; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
      float* dst = panel.data() + int64_t(r) * pw;
      for (int64_t g = c0 / G; g < c1 / G; ++g) {
        __m256 v[G / 8];
        decode_group<MD>(row, srow, g, v);
        for (int i = 0; i < G / 8; ++i) _mm256_storeu_ps(dst + (g * G - c0) + 8 * i, v[i]);
      }
    }
    int c = 0;
    for (; c + 32 <= pw; c += 32)
      panel_rows<4>(x, M, R, r0, panel.data() + c, rows, pw, int(c0 + c), y, C);
    if (c < pw)  // a last 16 columns
      panel_rows<2>(x, M, R, r0, panel.data() + c, rows, pw, int(c0 + c), y, C);
  }
}

template <FpMode MD>
void run_mode(const float* x, int M, const FpView& w, float* y) {
  const Blocking bl = blocking(M, w.K);
  const int64_t blocks = (int64_t(w.K) + bl.cols - 1) / bl.cols;
  parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      columns<MD>(x, M, w, y, b * bl.cols, std::min<int64_t>((b + 1) * bl.cols, w.K), bl.rows);
  });
}

}  // namespace

void fpm_t_avx2_run(const float* x, int M, const FpView& w, float* y) {
  if (M <= 0 || w.K <= 0) return;
  switch (w.mode) {
    case FpMode::Mxfp4: return run_mode<FpMode::Mxfp4>(x, M, w, y);
    case FpMode::Nvfp4: return run_mode<FpMode::Nvfp4>(x, M, w, y);
    case FpMode::Mxfp8: return run_mode<FpMode::Mxfp8>(x, M, w, y);
  }
}

}  // namespace mixbits
