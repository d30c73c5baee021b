// Runs the integer-activation contracts: x quantized once per call (ref.cpp's
// int_quantize, the one definition of the quantization), re-ordered into
// the byte order of the x86 decoders, then the outputs split over threads;
// each segment's kernel comes from the ISA's table, chosen once.
#include <algorithm>

#include "common/cpu.h"
#include "common/parallel.h"
#include "qmatmul_int8/kernel.h"

namespace mixbits {

#if defined(MIXBITS_HAVE_AVX2)
namespace {


template <class T>
void run_table(const I8Table& t, const float* x, int M, const QMatView& w, float* y) {
  IntActs<T> a;
  int_quantize(x, M, w, a);
  // The decoders' byte order, per unit of 32 columns (a copy of M*K codes).
  for (size_t si = 0; si < w.segs.size(); ++si) {
    const int B = w.segs[si].bits;
    if (x86_int8_col(B, 1) == 1 && x86_int8_col(B, 31) == 31) continue;
    std::vector<T>& v = a.xq[si];
    T tmp[32];
    for (size_t u = 0; u < v.size(); u += 32) {
      for (int p = 0; p < 32; ++p) tmp[p] = v[u + x86_int8_col(B, p)];
      std::copy(tmp, tmp + 32, v.begin() + u);
    }
  }
  std::vector<I8Seg> segs;
  std::vector<I8Fn> fns;
  int max_ng = 0;
  for (const SegView& s : w.segs) {
    const int ng = s.k / s.group_size;
    segs.push_back({reinterpret_cast<const uint8_t*>(s.wq), int64_t(s.k) * s.bits / 8,
                    s.scales, s.biases, w.sdtype, s.k, ng});
    fns.push_back(t.fn[s.bits][group_size_col(s.group_size)]);
    max_ng = std::max(max_ng, ng);
  }
  const int N = w.N;
  // Ranges of whole 8-row blocks (x86.h rows8): the kernel a row takes, and
  // so its rounding, depends on N only, not on how the rows are split.
  parallel_for((N + 7) / 8, 2, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * 8, n1 = std::min<int64_t>(N, b1 * 8);
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(32) * max_ng);
    for (int m0 = 0; m0 < M; m0 += t.max_mb) {
      const int mb = std::min(t.max_mb, M - m0);
      for (int m = 0; m < mb; ++m)
        std::fill(y + int64_t(m0 + m) * N + n0, y + int64_t(m0 + m) * N + n1, 0.0f);
      for (size_t si = 0; si < segs.size(); ++si) {
        const I8Seg& s = segs[si];
        const I8X xv{a.xq[si].data() + int64_t(m0) * s.k, s.k,
                     a.d[si].data() + int64_t(m0) * s.ngroups,
                     a.xs[si].data() + int64_t(m0) * s.ngroups, s.ngroups};
        fns[si](s, xv, mb, int(n0), int(n1), y + int64_t(m0) * N, N, scratch.data());
      }
    }
  });
}

}  // namespace

void qmm_int8_avx2_run(const float* x, int M, const QMatView& w, float* y) {
  run_table<int8_t>(int8_table_avx2(), x, M, w, y);
}
void qmm_int16_avx2_run(const float* x, int M, const QMatView& w, float* y) {
  run_table<int16_t>(int16_table_avx2(), x, M, w, y);
}

void qmm_int8_best_run(const float* x, int M, const QMatView& w, float* y) {
  static const I8Table& t = cpu_isa().avx512vnni ? int8_table_vnni() : int8_table_avx2();
  run_table<int8_t>(t, x, M, w, y);
}
void qmm_int16_best_run(const float* x, int M, const QMatView& w, float* y) {
  static const I8Table& t = cpu_isa().avx512vnni ? int16_table_vnni() : int16_table_avx2();
  run_table<int16_t>(t, x, M, w, y);
}
#endif

namespace {
// Avx512 (also what Auto picks on an AVX-512 CPU) runs the widest integer
// dot the CPU has: VNNI where present, else the AVX2 table.
constexpr BackendSet kIntBackends =
    backend_set({Backend::Ref, Backend::Avx2, Backend::Avx512, Backend::Neon});
}  // namespace

QmmRun select_qmm_int8(Backend requested) {
  switch (resolve_backend("qmatmul activations='int8'", requested, kIntBackends)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return qmm_int8_avx2_run;
    case Backend::Avx512: return qmm_int8_best_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return qmm_int8_neon_run;
#endif
    default: return qmm_int8_ref_run;
  }
}

QmmRun select_qmm_int16(Backend requested) {
  switch (resolve_backend("qmatmul activations='int16'", requested, kIntBackends)) {
#if defined(MIXBITS_HAVE_AVX2)
    case Backend::Avx2: return qmm_int16_avx2_run;
    case Backend::Avx512: return qmm_int16_best_run;
#endif
#if defined(MIXBITS_HAVE_NEON)
    case Backend::Neon: return qmm_int16_neon_run;
#endif
    default: return qmm_int16_ref_run;
  }
}

}  // namespace mixbits
