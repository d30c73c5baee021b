// Scalar reference of the integer-activation contracts (kernel.h): the
// quantization every backend uses, and the product evaluated exactly
// (integer sums, float64 for the rest). The oracle the SIMD kernels are
// tested against, and the fallback on CPUs without them.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/parallel.h"
#include "qmatmul_int8/kernel.h"

namespace mixbits {

namespace {

// 1.5 * 2^23: for |v| <= 2^22, (v + kRoundHalfEven) - kRoundHalfEven is v
// rounded to an integer, ties to even, under the default rounding mode
// (the sum lies in [2^23, 2^24), where the float spacing is 1): what
// nearbyint gives, in plain adds a compiler vectorizes (nearbyint is a
// library call on baseline x86-64). This file is compiled with
// -ffp-contract=off, so x * id stays a float32 product, as the contract says.
constexpr float kRoundHalfEven = 12582912.0f;

// One group of G finite values: the contract's codes into q; returns
// {d, ix}. Written as flat loops over the group (the largest |x| as the
// largest magnitude's bits, which order like the values for finite
// floats) so that the compiler vectorizes them: at a prompt's hundreds of
// rows the quantization is O(M*K) next to the kernels' O(M*N*K)/64.
template <class T>
__attribute__((always_inline)) inline float quantize_group(const float* x, int G, T* q,
                                                           int32_t& sum) {
  constexpr float Q = kIntQMax<T>;
  uint32_t abits = 0;
  for (int i = 0; i < G; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    b &= 0x7fffffffu;
    abits = b > abits ? b : abits;
  }
  float amax;
  std::memcpy(&amax, &abits, 4);
  if (!(amax >= kIntMinAmax<T>)) {  // zero (or negligible) group
    for (int i = 0; i < G; ++i) q[i] = 0;
    sum = 0;
    return 0.0f;
  }
  const float id = Q / amax;
  int32_t s = 0;
  for (int i = 0; i < G; ++i) {
    // The float32 product then round-half-even: what cvtps_epi32 does
    // under the default rounding mode. |x * id| <= Q * (1 + 2^-23)^2.
    float v = (x[i] * id + kRoundHalfEven) - kRoundHalfEven;
    v = v < -Q ? -Q : v > Q ? Q : v;
    q[i] = T(v);
    s += int32_t(v);
  }
  sum = s;
  return amax / Q;
}

// One row's groups of a segment. The same source compiled for AVX-512 and
// AVX2 besides the baseline on x86 (GCC/clang target_clones: the loader
// picks one per CPU, once), so the loops above run 16 or 8 lanes wide
// where the CPU has them: the same operations, so the same codes.
#if defined(MIXBITS_HAVE_AVX2) && defined(__GNUC__)
#define MIXBITS_QUANTIZE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MIXBITS_QUANTIZE_CLONES
#endif
template <class T>
__attribute__((always_inline)) inline void quantize_row(const float* xr, int G, int ng, T* q,
                                                        float* d, int32_t* ix, float* xs) {
  for (int g = 0; g < ng; ++g) {
    int32_t sum;
    d[g] = quantize_group<T>(xr + g * G, G, q + g * G, sum);
    ix[g] = sum;
    xs[g] = d[g] * float(sum);
  }
}
MIXBITS_QUANTIZE_CLONES void quantize_row_i8(const float* xr, int G, int ng, int8_t* q, float* d,
                                             int32_t* ix, float* xs) {
  quantize_row(xr, G, ng, q, d, ix, xs);
}
MIXBITS_QUANTIZE_CLONES void quantize_row_i16(const float* xr, int G, int ng, int16_t* q,
                                              float* d, int32_t* ix, float* xs) {
  quantize_row(xr, G, ng, q, d, ix, xs);
}

}  // namespace

template <class T>
void int_quantize(const float* x, int M, const QMatView& w, IntActs<T>& a) {
  const size_t ns = w.segs.size();
  a.xq.resize(ns);
  a.d.resize(ns);
  a.xs.resize(ns);
  a.ix.resize(ns);
  for (size_t si = 0; si < ns; ++si) {
    const SegView& s = w.segs[si];
    const int G = s.group_size, ng = s.k / G;
    a.xq[si].resize(size_t(M) * s.k);
    a.d[si].resize(size_t(M) * ng);
    a.xs[si].resize(size_t(M) * ng);
    a.ix[si].resize(size_t(M) * ng);
  }
  // Rows over threads (each row is quantized on its own).
  parallel_for(M, 16, [&](int64_t m0, int64_t m1) {
    for (size_t si = 0; si < ns; ++si) {
      const SegView& s = w.segs[si];
      const int G = s.group_size, ng = s.k / G;
      for (int64_t m = m0; m < m1; ++m) {
        const float* xr = x + m * w.K + s.k0;
        T* q = a.xq[si].data() + m * s.k;
        const int64_t g0 = m * ng;
        if constexpr (sizeof(T) == 1)
          quantize_row_i8(xr, G, ng, q, &a.d[si][g0], &a.ix[si][g0], &a.xs[si][g0]);
        else
          quantize_row_i16(xr, G, ng, q, &a.d[si][g0], &a.ix[si][g0], &a.xs[si][g0]);
      }
    }
  });
}

template <class T>
void qmm_int_ref(const IntActs<T>& a, int M, const QMatView& w, float* y, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < M; ++m) {
      double acc = 0.0;
      for (size_t si = 0; si < w.segs.size(); ++si) {
        const SegView& s = w.segs[si];
        const int G = s.group_size, ng = s.k / G;
        const uint32_t* row = s.wq + int64_t(n) * s.words_per_row();
        const T* xq = a.xq[si].data() + int64_t(m) * s.k;
        for (int g = 0; g < ng; ++g) {
          int64_t iq = 0;
          for (int i = 0; i < G; ++i)
            iq += int64_t(unpack_code(row, int64_t(g) * G + i, s.bits)) * xq[g * G + i];
          const int64_t gi = int64_t(m) * ng + g;
          const double sc = load_as_f32(s.scales, int64_t(n) * ng + g, w.sdtype);
          const double bi = load_as_f32(s.biases, int64_t(n) * ng + g, w.sdtype);
          acc += double(a.d[si][gi]) * (sc * double(iq) + bi * double(a.ix[si][gi]));
        }
      }
      y[int64_t(m) * w.N + n] = float(acc);
    }
  }
}

template void int_quantize(const float*, int, const QMatView&, IntActs<int8_t>&);
template void int_quantize(const float*, int, const QMatView&, IntActs<int16_t>&);

namespace {
template <class T>
void ref_run(const float* x, int M, const QMatView& w, float* y) {
  IntActs<T> a;
  int_quantize(x, M, w, a);
  parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) {
    qmm_int_ref(a, M, w, y, int(n0), int(n1));
  });
}
}  // namespace

void qmm_int8_ref_run(const float* x, int M, const QMatView& w, float* y) {
  ref_run<int8_t>(x, M, w, y);
}
void qmm_int16_ref_run(const float* x, int M, const QMatView& w, float* y) {
  ref_run<int16_t>(x, M, w, y);
}

}  // namespace mixbits
