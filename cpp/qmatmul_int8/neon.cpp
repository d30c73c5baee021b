// NEON kernels of the integer-activation contracts (kernel.h): codes decoded
// 16 at a time (qmatmul/neon_decode.h, natural order, so x needs no
// re-ordering), integer dots per group, one float epilogue per group:
// y += s·(d·iq) + b·xs.
//   int8:  SDOT where the compiler targets the dot-product extension (every
//          Apple M core), else SMULL + SADALP. 8-bit codes do not fit a
//          signed byte: they enter as c - 128 and 128·ix is added back.
//   int16: SMLAL on codes widened to 16 bits.
// Checked under qemu-user with and without the dot-product extension
// (tests/test_qmatmul_neon_emulated.py); speed on Apple cores not measured.
#include "qmatmul_int8/kernel.h"

#if defined(__ARM_NEON) && defined(__aarch64__)
#include <algorithm>

#include "common/parallel.h"
#include "qmatmul/neon_decode.h"

namespace mixbits {
namespace {

// acc + the 16 products codes·x in int32 lanes (which lane holds which
// product differs by type; only the lanes' sum is used).
template <int B>
inline int32x4_t dot16(int32x4_t acc, uint8x16_t c, const int8_t* x) {
  const int8x16_t xv = vld1q_s8(x);
  const int8x16_t cs = B == 8 ? vreinterpretq_s8_u8(veorq_u8(c, vdupq_n_u8(0x80)))
                              : vreinterpretq_s8_u8(c);
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, cs, xv);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(cs), vget_low_s8(xv)));
  return vpadalq_s16(acc, vmull_high_s8(cs, xv));
#endif
}

template <int B>
inline int32x4_t dot16(int32x4_t acc, uint8x16_t c, const int16_t* x) {
  const int16x8_t lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(c)));
  const int16x8_t hi = vreinterpretq_s16_u16(vmovl_high_u8(c));
  const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
  acc = vmlal_s16(acc, vget_low_s16(lo), vget_low_s16(x0));
  acc = vmlal_high_s16(acc, lo, x0);
  acc = vmlal_s16(acc, vget_low_s16(hi), vget_low_s16(x1));
  return vmlal_high_s16(acc, hi, x1);
}

// Rows [n0, n1) of segment si for all M (<= kInt8MaxM) activation rows.
template <class T, int B, int G>
void seg_rows(const IntActs<T>& a, size_t si, const SegView& s, DType sdt, int M, int n0, int n1,
              float* y, int N) {
  // The signed-byte offset of 8-bit codes, added back per group as 128·ix.
  constexpr int32_t kOffset = std::is_same_v<T, int8_t> && B == 8 ? 128 : 0;
  const int ng = s.k / G;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(s.wq + int64_t(n) * s.words_per_row());
    for (int g = 0; g < ng; ++g) {
      int32x4_t acc[kInt8MaxM];
      for (int m = 0; m < M; ++m) acc[m] = vdupq_n_s32(0);
      for (int j = 0; j < G / 16; ++j) {
        const uint8x16_t c = neon::decode16<B>(row, int64_t(g) * (G / 16) + j);
        const T* xp = a.xq[si].data() + g * G + 16 * j;
        for (int m = 0; m < M; ++m) acc[m] = dot16<B>(acc[m], c, xp + int64_t(m) * s.k);
      }
      const float sc = load_as_f32(s.scales, int64_t(n) * ng + g, sdt);
      const float bi = load_as_f32(s.biases, int64_t(n) * ng + g, sdt);
      for (int m = 0; m < M; ++m) {
        const int64_t gi = int64_t(m) * ng + g;
        const int32_t iq = vaddvq_s32(acc[m]) + kOffset * a.ix[si][gi];
        y[int64_t(m) * N + n] += sc * (a.d[si][gi] * float(iq)) + bi * a.xs[si][gi];
      }
    }
  }
}

template <class T>
using SegFn = void (*)(const IntActs<T>&, size_t, const SegView&, DType, int, int, int, float*, int);

template <class T, int B>
constexpr SegFn<T> kRow[3] = {seg_rows<T, B, 32>, seg_rows<T, B, 64>, seg_rows<T, B, 128>};

// [bits][0: g32, 1: g64, 2: g128]
template <class T>
constexpr const SegFn<T>* kTable[9] = {nullptr,      nullptr,      kRow<T, 2>, kRow<T, 3>, kRow<T, 4>,
                                       kRow<T, 5>, kRow<T, 6>, nullptr,      kRow<T, 8>};

template <class T>
void run(const float* x, int M, const QMatView& w, float* y) {
  IntActs<T> a;
  int_quantize(x, M, w, a);
  const int N = w.N;
  parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
    for (int m = 0; m < M; ++m) std::fill(y + int64_t(m) * N + n0, y + int64_t(m) * N + n1, 0.0f);
    for (size_t si = 0; si < w.segs.size(); ++si) {
      const SegView& s = w.segs[si];
      kTable<T>[s.bits][group_size_col(s.group_size)](a, si, s, w.sdtype, M, int(n0), int(n1), y, N);
    }
  });
}

}  // namespace

void qmm_int8_neon_run(const float* x, int M, const QMatView& w, float* y) {
  run<int8_t>(x, M, w, y);
}
void qmm_int16_neon_run(const float* x, int M, const QMatView& w, float* y) {
  run<int16_t>(x, M, w, y);
}

}  // namespace mixbits

#else  // an arm64 target without NEON: the reference stands in

namespace mixbits {
void qmm_int8_neon_run(const float* x, int M, const QMatView& w, float* y) {
  qmm_int8_ref_run(x, M, w, y);
}
void qmm_int16_neon_run(const float* x, int M, const QMatView& w, float* y) {
  qmm_int16_ref_run(x, M, w, y);
}
}  // namespace mixbits

#endif
