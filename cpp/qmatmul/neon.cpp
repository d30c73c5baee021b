// NEON backend (arm64) of the mixed-segment quantized matmul, y = x · Wᵀ.
//
// Per (row, group) the codes are decoded 16 at a time (neon_decode.h) to
// float32 once, then every activation row takes a dot product with them:
// y += s · Σ q·x + b · Σ x, Σ x per group computed once per call. One
// kernel per (bits, group size) from a table, as the x86 rows.
//
// Checked under qemu-user (tests/test_qmatmul_neon_emulated.py): results
// only. Its speed on Apple cores is not measured.
#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "qmatmul/kernel.h"

#if defined(__ARM_NEON) && defined(__aarch64__)
#include "qmatmul/neon_decode.h"

namespace mixbits {
namespace {

// Σ a[i]·b[i] over G floats, G a multiple of 16.
template <int G>
inline float dot(const float* a, const float* b) {
  float32x4_t s[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
  for (int i = 0; i < G; i += 16)
    for (int r = 0; r < 4; ++r) s[r] = vfmaq_f32(s[r], vld1q_f32(a + i + 4 * r), vld1q_f32(b + i + 4 * r));
  return vaddvq_f32(vaddq_f32(vaddq_f32(s[0], s[1]), vaddq_f32(s[2], s[3])));
}

// Rows [n0, n1) of one segment for all M activation rows. xsum: [M, groups]
// of this segment.
template <int B, int G>
void seg_rows(const SegView& s, DType sdt, const float* x, int M, int K, const float* xsum,
              int n0, int n1, float* y, int N) {
  const int ng = s.k / G;
  alignas(16) float q[G];
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(s.wq + int64_t(n) * s.words_per_row());
    for (int g = 0; g < ng; ++g) {
      const float sc = load_as_f32(s.scales, int64_t(n) * ng + g, sdt);
      const float bi = load_as_f32(s.biases, int64_t(n) * ng + g, sdt);
      for (int j = 0; j < G / 16; ++j) {
        float32x4_t f[4];
        neon::widen(neon::decode16<B>(row, int64_t(g) * (G / 16) + j), f);
        for (int r = 0; r < 4; ++r) vst1q_f32(q + 16 * j + 4 * r, f[r]);
      }
      for (int m = 0; m < M; ++m)
        y[int64_t(m) * N + n] += sc * dot<G>(q, x + int64_t(m) * K + s.k0 + g * G) +
                                 bi * xsum[int64_t(m) * ng + g];
    }
  }
}

using SegFn = void (*)(const SegView&, DType, const float*, int, int, const float*, int, int,
                       float*, int);

template <int B>
constexpr SegFn kRow[3] = {seg_rows<B, 32>, seg_rows<B, 64>, seg_rows<B, 128>};

// [bits][0: g32, 1: g64, 2: g128]
constexpr const SegFn* kTable[9] = {nullptr, nullptr, kRow<2>, kRow<3>, kRow<4>,
                                    kRow<5>,  kRow<6>,  nullptr, kRow<8>};


}  // namespace

void qmm_neon_run(const float* x, int M, const QMatView& w, float* y) {
  const int K = w.K, N = w.N;
  // Per-group sums of x, once per call, per segment: [M, groups].
  std::vector<std::vector<float>> xsum(w.segs.size());
  for (size_t si = 0; si < w.segs.size(); ++si) {
    const SegView& s = w.segs[si];
    const int64_t ng = s.groups_per_row();
    xsum[si].resize(size_t(M) * ng);
    for (int m = 0; m < M; ++m)
      for (int64_t g = 0; g < ng; ++g) {
        const float* xp = x + int64_t(m) * K + s.k0 + g * s.group_size;
        double acc = 0.0;
        for (int i = 0; i < s.group_size; ++i) acc += xp[i];
        xsum[si][size_t(m) * ng + g] = float(acc);
      }
  }
  parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
    for (int m = 0; m < M; ++m) std::fill(y + int64_t(m) * N + n0, y + int64_t(m) * N + n1, 0.0f);
    for (size_t si = 0; si < w.segs.size(); ++si) {
      const SegView& s = w.segs[si];
      kTable[s.bits][group_size_col(s.group_size)](s, w.sdtype, x, M, K, xsum[si].data(), int(n0),
                                             int(n1), y, N);
    }
  });
}

}  // namespace mixbits

#else  // built for an arm64 target without NEON: the reference stands in

namespace mixbits {
void qmm_neon_run(const float* x, int M, const QMatView& w, float* y) {
  qmm_ref_run(x, M, w, y);
}
}  // namespace mixbits

#endif
