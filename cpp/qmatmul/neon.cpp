// NEON backend (arm64) of the mixed-segment quantized matmul.
//
// Deliberately simple: per (row, group) the codes are unpacked to floats
// with a 64-bit bit reader, then NEON FMAs form sum(q * x) for every
// activation row (the weights are decoded once for all M rows), and the
// affine bias is folded: y += s * sum(q x) + b * sum(x), with sum(x) per
// group computed once per call. Not built or run on the x86 machine this
// project is developed on; the scalar reference covers any CPU where this
// file is not compiled for NEON.
#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "qmatmul/kernel.h"

#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>

namespace mixbits {
namespace {

// Codes [j0, j0 + n) of a row bitstream (LSB-first) as floats.
void unpack_floats(const uint32_t* row, int64_t j0, int n, int bits, float* out) {
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  int64_t bit = j0 * bits;
  // Every group starts on a 32-bit word boundary (group sizes are
  // multiples of 32), so the reader starts at bit 0 of a word.
  const uint32_t* p = row + (bit >> 5);
  uint64_t buf = 0;
  int have = 0;
  for (int i = 0; i < n; ++i) {
    if (have < bits) {
      buf |= uint64_t(*p++) << have;
      have += 32;
    }
    out[i] = float(buf & mask);
    buf >>= bits;
    have -= bits;
  }
}

// sum a[i] * b[i], n a multiple of 8.
float dot8(const float* a, const float* b, int n) {
  float32x4_t s0 = vdupq_n_f32(0.0f), s1 = vdupq_n_f32(0.0f);
  for (int i = 0; i < n; i += 8) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
    s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
  }
  return vaddvq_f32(vaddq_f32(s0, s1));
}

}  // namespace

void qmm_neon_run(const float* x, int M, const QMatView& w, float* y) {
  const int K = w.K, N = w.N;
  // Per-group sums of x, once per call: [M, total groups].
  std::vector<int64_t> goff;
  int64_t ngt = 0;
  for (const SegView& s : w.segs) {
    goff.push_back(ngt);
    ngt += s.groups_per_row();
  }
  std::vector<float> xsum(size_t(M) * ngt);
  for (int m = 0; m < M; ++m)
    for (size_t si = 0; si < w.segs.size(); ++si) {
      const SegView& s = w.segs[si];
      for (int64_t g = 0; g < s.groups_per_row(); ++g) {
        const float* xp = x + int64_t(m) * K + s.k0 + g * s.group_size;
        double acc = 0.0;
        for (int i = 0; i < s.group_size; ++i) acc += xp[i];
        xsum[size_t(m) * ngt + goff[si] + g] = float(acc);
      }
    }
  parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
    float q[128];
    for (int64_t n = n0; n < n1; ++n) {
      for (int m = 0; m < M; ++m) y[int64_t(m) * N + n] = 0.0f;
      for (size_t si = 0; si < w.segs.size(); ++si) {
        const SegView& s = w.segs[si];
        const uint32_t* row = s.wq + n * s.words_per_row();
        const int64_t ng = s.groups_per_row();
        for (int64_t g = 0; g < ng; ++g) {
          const float sc = load_as_f32(s.scales, n * ng + g, w.sdtype);
          const float bi = load_as_f32(s.biases, n * ng + g, w.sdtype);
          unpack_floats(row, g * s.group_size, s.group_size, s.bits, q);
          for (int m = 0; m < M; ++m) {
            const float* xp = x + int64_t(m) * K + s.k0 + g * s.group_size;
            y[int64_t(m) * N + n] += sc * dot8(q, xp, s.group_size) +
                                     bi * xsum[size_t(m) * ngt + goff[si] + g];
          }
        }
      }
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
