// AVX2 side of the fused search (search.h): 8 groups' elements per vector,
// the same float32 steps as the scalar reference (division, round to nearest
// even, clip, separate multiply and add: this file is built with
// -ffp-contract=off) and numpy's pairwise float64 sum, whose 8 lanes are two
// __m256d accumulators here.
#include <immintrin.h>

#include <vector>

#include "quant_search/search.h"

namespace mixbits::search_detail {

namespace {

// numpy's pairwise sum of float32 terms e[0..n) widened to float64, n % 8 == 0.
inline double block_sum(const float* e, int64_t n) {
  if (n > 128) {
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return block_sum(e, n2) + block_sum(e + n2, n - n2);
  }
  __m256d r0 = _mm256_cvtps_pd(_mm_loadu_ps(e));
  __m256d r1 = _mm256_cvtps_pd(_mm_loadu_ps(e + 4));
  for (int64_t i = 8; i < n; i += 8) {
    r0 = _mm256_add_pd(r0, _mm256_cvtps_pd(_mm_loadu_ps(e + i)));
    r1 = _mm256_add_pd(r1, _mm256_cvtps_pd(_mm_loadu_ps(e + i + 4)));
  }
  alignas(32) double r[8];
  _mm256_store_pd(r, r0);
  _mm256_store_pd(r + 4, r1);
  return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

}  // namespace

void trials_avx2(const SearchGroups& g, int64_t C, const float* cs, const float* cb,
                 const float* ds, const float* db, int32_t idx0, double* best_err,
                 int32_t* best_idx, uint8_t* codes) {
  const int64_t gs = g.gs, ng = g.R * g.G;
  const int64_t nv = gs - gs % 8;
  std::vector<float> c(gs), e(gs);
  const __m256 lo = _mm256_set1_ps(g.qlo), hi = _mm256_set1_ps(g.qhi), off = _mm256_set1_ps(g.qoff);
  for (int64_t i = 0; i < ng; ++i) {
    const float* t = g.t + i * gs;
    const float* x = g.x + i * gs;
    const float* h = g.h + (i % g.G) * gs;
    for (int64_t j = 0; j < C; ++j) {
      const int64_t p = j * ng + i;
      const float s = cs[p], b = cb[p], sd = ds[p], bd = db[p];
      const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
      const __m256 vsd = _mm256_set1_ps(sd), vbd = _mm256_set1_ps(bd);
      double err;
      if (gs % 8 == 0 && gs <= 128) {
        // numpy's 8 pairwise lanes, kept in two registers: lane j sums the
        // terms k = j mod 8 in order, then ((0+1)+(2+3))+((4+5)+(6+7)).
        __m256d r0 = _mm256_setzero_pd(), r1 = _mm256_setzero_pd();
        for (int64_t k = 0; k < gs; k += 8) {
          __m256 y = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + k), vb), vs);
          y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          y = _mm256_max_ps(lo, y);  // NaN in y is returned as it is
          y = _mm256_min_ps(hi, y);
          y = _mm256_add_ps(y, off);
          _mm256_storeu_ps(c.data() + k, y);
          const __m256 what = _mm256_add_ps(_mm256_mul_ps(vsd, y), vbd);
          const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(t + k), what);
          const __m256 e8 = _mm256_mul_ps(_mm256_loadu_ps(h + k), _mm256_mul_ps(d, d));
          const __m256d e0 = _mm256_cvtps_pd(_mm256_castps256_ps128(e8));
          const __m256d e1 = _mm256_cvtps_pd(_mm256_extractf128_ps(e8, 1));
          // the first terms start the lanes (as numpy's r[j] = a[j]); terms
          // are >= +0, so 0 + a == a
          r0 = k ? _mm256_add_pd(r0, e0) : e0;
          r1 = k ? _mm256_add_pd(r1, e1) : e1;
        }
        alignas(32) double r[8];
        _mm256_store_pd(r, r0);
        _mm256_store_pd(r + 4, r1);
        err = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
      } else {
        for (int64_t k = 0; k < nv; k += 8) {
          __m256 y = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + k), vb), vs);
          y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          y = _mm256_max_ps(lo, y);
          y = _mm256_min_ps(hi, y);
          y = _mm256_add_ps(y, off);
          _mm256_storeu_ps(c.data() + k, y);
          const __m256 what = _mm256_add_ps(_mm256_mul_ps(vsd, y), vbd);
          const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(t + k), what);
          _mm256_storeu_ps(e.data() + k, _mm256_mul_ps(_mm256_loadu_ps(h + k), _mm256_mul_ps(d, d)));
        }
        for (int64_t k = nv; k < gs; ++k) {  // group sizes off the 8-lane grid
          float y = __builtin_nearbyintf((x[k] - b) / s);
          y = y < g.qlo ? g.qlo : y;
          y = y > g.qhi ? g.qhi : y;
          c[k] = y + g.qoff;
          const float d = t[k] - (sd * c[k] + bd);
          e[k] = h[k] * (d * d);
        }
        if (gs % 8 == 0)
          err = block_sum(e.data(), gs);
        else
          err = pairwise_sum([&](int64_t k) { return double(e[k]); }, 0, gs);
      }
      if (best_idx[i] < 0 || err < best_err[i]) {
        best_err[i] = err;
        best_idx[i] = idx0 + int32_t(j);
        uint8_t* o = codes + i * gs;
        for (int64_t k = 0; k < gs; ++k) o[k] = uint8_t(int(c[k]));
      }
    }
  }
}

bool lsq_sums_avx2(const SearchGroups& g, const uint8_t* codes, double* out) {
  const int64_t gs = g.gs, ng = g.R * g.G;
  if (gs % 8 || gs > 128) return false;  // numpy's order in registers needs 8 | gs <= 128
  const __m256d off = _mm256_set1_pd(double(g.qoff));
  for (int64_t i = 0; i < ng; ++i) {
    const float* t = g.t + i * gs;
    const float* h = g.h + (i % g.G) * gs;
    const uint8_t* q = codes + i * gs;
    __m256d a[5][2] = {};  // set by the first 8 terms (gs >= 8)
    for (int64_t k = 0; k < gs; k += 8) {
      const __m256 hf = _mm256_loadu_ps(h + k), tf = _mm256_loadu_ps(t + k);
      const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
      const __m256 qf = _mm256_cvtepi32_ps(qi);  // 0..255: exact
      for (int half = 0; half < 2; ++half) {
        const __m128 h4 = half ? _mm256_extractf128_ps(hf, 1) : _mm256_castps256_ps128(hf);
        const __m128 t4 = half ? _mm256_extractf128_ps(tf, 1) : _mm256_castps256_ps128(tf);
        const __m128 q4 = half ? _mm256_extractf128_ps(qf, 1) : _mm256_castps256_ps128(qf);
        const __m256d hd = _mm256_cvtps_pd(h4), td = _mm256_cvtps_pd(t4);
        const __m256d qd = _mm256_add_pd(_mm256_cvtps_pd(q4), off);
        const __m256d hq = _mm256_mul_pd(hd, qd);
        const __m256d v[5] = {hd, hq, _mm256_mul_pd(hq, qd), _mm256_mul_pd(hd, td), _mm256_mul_pd(hq, td)};
        for (int s = 0; s < 5; ++s) a[s][half] = k ? _mm256_add_pd(a[s][half], v[s]) : v[s];
      }
    }
    for (int s = 0; s < 5; ++s) {
      alignas(32) double r[8];
      _mm256_store_pd(r, a[s][0]);
      _mm256_store_pd(r + 4, a[s][1]);
      out[i * 5 + s] = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    }
  }
  return true;
}

}  // namespace mixbits::search_detail
