// Scalar reference of the integer-activation contracts (kernel.h): the
// quantization every backend uses, and the product evaluated exactly
// (integer sums, float64 for the rest). The oracle the SIMD kernels are
// tested against, and the fallback on CPUs without them.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "common/cpu.h"
#include "common/parallel.h"
#include "qmatmul_int8/kernel.h"

namespace mixbits {

template <class T>
void int_quantize_groups_ref(const float* x, int ng, int G, T* q, float* d, int32_t* ix, float* xs) {
  constexpr float Q = kIntQMax<T>;
  for (int g = 0; g < ng; ++g, x += G, q += G) {
    // x is finite here (the callers route inf/NaN rows to the float path),
    // so a plain comparison is max|x| exactly; std::fmax is a libm call per
    // element on x86.
    float amax = 0.0f;
    for (int i = 0; i < G; ++i) {
      const float a = std::fabs(x[i]);
      amax = a > amax ? a : amax;
    }
    if (!(amax >= kIntMinAmax<T>)) {  // zero (or negligible) group
      std::fill(q, q + G, T(0));
      d[g] = 0.0f;
      ix[g] = 0;
      xs[g] = 0.0f;
      continue;
    }
    const float id = Q / amax;
    int32_t sum = 0;
    for (int i = 0; i < G; ++i) {
      // The float32 product then round-half-even: what cvtps_epi32 does
      // under the default rounding mode. |x * id| <= Q * (1 + 2^-23)^2.
      float v = std::nearbyint(x[i] * id);
      v = v < -Q ? -Q : (v > Q ? Q : v);
      q[i] = T(v);
      sum += int32_t(v);
    }
    d[g] = amax / Q;
    ix[g] = sum;
    xs[g] = d[g] * float(sum);
  }
}

namespace {
// The group quantizer this CPU runs, chosen once; every version gives the
// scalar one's codes and scales bit for bit (tests/test_int_quantize.py).
template <class T>
IntQuantizeGroupsFn<T> groups_fn() {
#if defined(MIXBITS_HAVE_AVX2)
  if (cpu_has_avx2()) return &int_quantize_groups_avx2<T>;
#endif
  return &int_quantize_groups_ref<T>;
}
}  // namespace

template <class T>
void int_quantize(const float* x, int M, const QMatView& w, IntActs<T>& a) {
  static const IntQuantizeGroupsFn<T> groups = groups_fn<T>();
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
    for (int m = 0; m < M; ++m) {
      const int64_t gi = int64_t(m) * ng;
      groups(x + int64_t(m) * w.K + s.k0, ng, G, a.xq[si].data() + int64_t(m) * s.k,
             a.d[si].data() + gi, a.ix[si].data() + gi, a.xs[si].data() + gi);
    }
  }
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
template void int_quantize_groups_ref(const float*, int, int, int8_t*, float*, int32_t*, float*);
template void int_quantize_groups_ref(const float*, int, int, int16_t*, float*, int32_t*, float*);

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
