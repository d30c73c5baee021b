// The per-group parameter search of python/mixbits/quantizers/search.py,
// fused: for each group, every candidate (scale, bias) pair's codes, its
// weighted squared error and the keep-if-strictly-better choice, with the
// group held in L1, instead of numpy's several N x K temporaries per trial.
//
// The arithmetic is numpy's, step for step, so the choice and the codes are
// bit-identical to the numpy reference (search.py's *_reference path):
//   codes  c = clip(rint((x - cb) / cs), qlo, qhi) + qoff      (float32)
//   decode what = ds * c + db         (float32 multiply, then add: no FMA)
//   error  sum_k double(h_k * ((t_k - what_k)^2))   float32 terms summed in
//          float64 in numpy's pairwise order (8 lanes, blocks of <= 128)
// The least-squares sums of the Lloyd step are float64 products summed in the
// same order. Everything that rounds parameters to the storage dtype stays
// in numpy (per group, cheap).
#pragma once
#include <cstdint>

namespace mixbits {

struct SearchGroups {
  const float* t = nullptr;  // [R, G, gs] the target the error is measured on
  const float* x = nullptr;  // [R, G, gs] what the codes are computed from
  const float* h = nullptr;  // [G, gs] weights of the error (>= 0)
  int64_t R = 0;
  int64_t G = 0;
  int64_t gs = 0;
  float qlo = 0, qhi = 0, qoff = 0;  // affine: 0, 2^bits - 1, 0; ternary: -1, 1, 1
};

// Candidates c = 0..C-1, each four float32 arrays [C, R*G] (code scale, code
// bias, decode scale, decode bias). For each group, in candidate order: its
// error replaces best_err (and its codes, and best_idx = idx0 + c) where
// best_idx < 0 (unset: taken whatever its value, as numpy's first) or the
// error is strictly below best_err (NaN never is).
void search_trials(const SearchGroups& g, int64_t C, const float* cs, const float* cb,
                   const float* ds, const float* db, int32_t idx0, double* best_err,
                   int32_t* best_idx, uint8_t* codes, bool simd);

// Per group, from codes q = codes + qoff (float64): sum h, sum h q,
// sum h q q, sum h t, sum h q t, each a float64 product ((h*q)*q, (h*q)*t)
// summed in numpy's order; out [R*G, 5].
void search_lsq_sums(const SearchGroups& g, const uint8_t* codes, double* out, bool simd);

// numpy's pairwise float64 sum (npy_pairwise_sum) of the n terms a(i0 ..
// i0 + n - 1).
template <class Term>
inline double pairwise_sum(const Term& a, int64_t i0, int64_t n) {
  if (n < 8) {
    double r = -0.0;  // as numpy
    for (int64_t i = 0; i < n; ++i) r += a(i0 + i);
    return r;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a(i0 + j);
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a(i0 + i + j);
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a(i0 + i);
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, i0, n2) + pairwise_sum(a, i0 + n2, n - n2);
}

namespace search_detail {
void trials_avx2(const SearchGroups& g, int64_t C, const float* cs, const float* cb,
                 const float* ds, const float* db, int32_t idx0, double* best_err,
                 int32_t* best_idx, uint8_t* codes);
bool lsq_sums_avx2(const SearchGroups& g, const uint8_t* codes, double* out);  // false: not handled
}

}  // namespace mixbits
