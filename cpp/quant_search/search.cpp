// Scalar reference of the fused search (search.h) and the ISA dispatch.
// Built with -ffp-contract=off (CMakeLists.txt): s*c + b rounds twice, as
// numpy's decode does.
#include "quant_search/search.h"

#include <cmath>
#include <vector>

#include "common/cpu.h"

namespace mixbits {

namespace {

void trials_ref(const SearchGroups& g, int64_t C, const float* cs, const float* cb,
                const float* ds, const float* db, int32_t idx0, double* best_err,
                int32_t* best_idx, uint8_t* codes) {
  const int64_t gs = g.gs, ng = g.R * g.G;
  std::vector<float> c(gs), e(gs);
  for (int64_t i = 0; i < ng; ++i) {
    const float* t = g.t + i * gs;
    const float* x = g.x + i * gs;
    const float* h = g.h + (i % g.G) * gs;
    for (int64_t j = 0; j < C; ++j) {
      const int64_t p = j * ng + i;
      const float s = cs[p], b = cb[p], sd = ds[p], bd = db[p];
      for (int64_t k = 0; k < gs; ++k) {
        float y = (x[k] - b) / s;
        y = std::nearbyint(y);  // round half to even, as np.rint
        y = y < g.qlo ? g.qlo : y;  // np.clip: NaN stays NaN
        y = y > g.qhi ? g.qhi : y;
        c[k] = y + g.qoff;
        const float what = sd * c[k] + bd;
        const float d = t[k] - what;
        e[k] = h[k] * (d * d);
      }
      const double err = pairwise_sum([&](int64_t k) { return double(e[k]); }, 0, gs);
      if (best_idx[i] < 0 || err < best_err[i]) {
        best_err[i] = err;
        best_idx[i] = idx0 + int32_t(j);
        for (int64_t k = 0; k < gs; ++k) codes[i * gs + k] = uint8_t(int(c[k]));
      }
    }
  }
}

}  // namespace

void search_trials(const SearchGroups& g, int64_t C, const float* cs, const float* cb,
                   const float* ds, const float* db, int32_t idx0, double* best_err,
                   int32_t* best_idx, uint8_t* codes, bool simd) {
#ifdef MIXBITS_HAVE_AVX2
  if (simd && cpu_isa().avx2) {
    search_detail::trials_avx2(g, C, cs, cb, ds, db, idx0, best_err, best_idx, codes);
    return;
  }
#endif
  (void)simd;
  trials_ref(g, C, cs, cb, ds, db, idx0, best_err, best_idx, codes);
}

void search_lsq_sums(const SearchGroups& g, const uint8_t* codes, double* out, bool simd) {
#ifdef MIXBITS_HAVE_AVX2
  if (simd && cpu_isa().avx2 && search_detail::lsq_sums_avx2(g, codes, out)) return;
#endif
  (void)simd;
  const int64_t gs = g.gs, ng = g.R * g.G;
  std::vector<double> hq(gs);
  for (int64_t i = 0; i < ng; ++i) {
    const float* t = g.t + i * gs;
    const float* h = g.h + (i % g.G) * gs;
    const uint8_t* q = codes + i * gs;
    for (int64_t k = 0; k < gs; ++k) hq[k] = double(h[k]) * (double(q[k]) + double(g.qoff));
    double* o = out + i * 5;
    o[0] = pairwise_sum([&](int64_t k) { return double(h[k]); }, 0, gs);
    o[1] = pairwise_sum([&](int64_t k) { return hq[k]; }, 0, gs);
    o[2] = pairwise_sum([&](int64_t k) { return hq[k] * (double(q[k]) + double(g.qoff)); }, 0, gs);
    o[3] = pairwise_sum([&](int64_t k) { return double(h[k]) * double(t[k]); }, 0, gs);
    o[4] = pairwise_sum([&](int64_t k) { return hq[k] * double(t[k]); }, 0, gs);
  }
}

}  // namespace mixbits
