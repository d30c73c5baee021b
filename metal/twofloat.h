// Two-float ("double-float") arithmetic for the Metal KL kernel: a value is
// an unevaluated sum hi + lo of two floats with |lo| <= ulp(hi)/2, about 48
// significant bits. Apple GPUs have no float64; the CPU kernel keeps its
// sums in double, and these let the GPU kernel match its accuracy (see
// bench/KL.md).
//
// Correctness depends on IEEE float rounding without reassociation: the
// metallib is compiled with -fno-fast-math (mlx_build_metallib's default),
// and products use an explicit fma, which FMA contraction cannot change.
// Usable from Metal, from C++ under the emulator, and from plain C++.
#pragma once

#if defined(__METAL_VERSION__) || defined(MIXBITS_METAL_EMULATION)
#define MB_FMA(a, b, c) metal::fma(a, b, c)
#define MB_RINT(x) metal::rint(x)
#define MB_LDEXP(x, e) metal::ldexp(x, e)
#define MB_AS_UINT(x) as_type<uint32_t>(x)
#define MB_AS_FLOAT(x) as_type<float>(x)
#else
#include <cmath>
#include <cstdint>
#define MB_FMA(a, b, c) std::fma(a, b, c)
#define MB_RINT(x) std::rint(x)
#define MB_LDEXP(x, e) std::ldexp(x, e)
#define MB_AS_UINT(x) __builtin_bit_cast(uint32_t, x)
#define MB_AS_FLOAT(x) __builtin_bit_cast(float, x)
#endif

struct MbDF {
  float hi, lo;
};

inline MbDF mb_df(float hi) {
  MbDF r = {hi, 0.0f};
  return r;
}

// a + b exactly, as hi + lo (Knuth's TwoSum; any magnitudes).
inline MbDF mb_two_sum(float a, float b) {
  const float s = a + b;
  const float bb = s - a;
  MbDF r = {s, (a - (s - bb)) + (b - bb)};
  return r;
}

// Renormalize when |a| >= |b| (Dekker's FastTwoSum).
inline MbDF mb_fast_two_sum(float a, float b) {
  const float s = a + b;
  MbDF r = {s, b - (s - a)};
  return r;
}

// a * b exactly, as hi + lo.
inline MbDF mb_two_prod(float a, float b) {
  const float p = a * b;
  MbDF r = {p, MB_FMA(a, b, -p)};
  return r;
}

// x + f: the running sums add one float term per element.
inline MbDF mb_df_add_f(MbDF x, float f) {
  const MbDF s = mb_two_sum(x.hi, f);
  return mb_fast_two_sum(s.hi, s.lo + x.lo);
}

inline MbDF mb_df_add(MbDF x, MbDF y) {
  const MbDF s = mb_two_sum(x.hi, y.hi);
  const MbDF t = mb_two_sum(x.lo, y.lo);
  MbDF r = mb_fast_two_sum(s.hi, s.lo + t.hi);
  return mb_fast_two_sum(r.hi, r.lo + t.lo);
}

inline MbDF mb_df_neg(MbDF x) {
  MbDF r = {-x.hi, -x.lo};
  return r;
}

inline MbDF mb_df_mul(MbDF x, MbDF y) {
  const MbDF p = mb_two_prod(x.hi, y.hi);
  return mb_fast_two_sum(p.hi, p.lo + (x.hi * y.lo + x.lo * y.hi));
}

inline MbDF mb_df_div(MbDF x, MbDF y) {
  const float q1 = x.hi / y.hi;
  // remainder x - q1 * y, exactly enough for the second quotient digit
  const MbDF p = mb_two_prod(q1, y.hi);
  const float r = ((x.hi - p.hi) - p.lo + x.lo) - q1 * y.lo;
  return mb_fast_two_sum(q1, r / y.hi);
}

// ln 2 split so that n * MB_LN2_HI is exact for |n| < 2^9.
#define MB_LN2_HI 0.693145751953125f
#define MB_LN2_LO 1.42860682030941723212e-06f
// ln 2 as a two-float (hi = float(ln 2)).
#define MB_LN2_DF_HI 0.693147182464599609375f
#define MB_LN2_DF_LO -1.904654323148236e-09f

// e^x for a two-float x <= 0 (a rebase factor), relative error ~1e-10
// instead of a float exp's few ulps: a rebase multiplies a whole running
// sum, so its error would not average out.
inline MbDF mb_df_exp(MbDF x) {
  if (x.hi < -87.0f) return mb_df(0.0f);  // below the smallest normal scale
  const float n = MB_RINT(x.hi * 1.44269504088896341f);
  // r = x - n ln2 as a two-float: x.hi - n*LN2_HI is exact (Sterbenz), the
  // LN2_LO product exact as a two-float.
  const MbDF nlo = mb_two_prod(n, MB_LN2_LO);
  MbDF r = mb_two_sum(x.hi - n * MB_LN2_HI, -nlo.hi);
  r = mb_fast_two_sum(r.hi, r.lo + (x.lo - nlo.lo));
  // e^r = 1 + r + r^2/2 + tail; |r| <= 0.35, so the tail (<= 0.0075)
  // needs only float precision and r^2/2 a two-float.
  const float z = r.hi;
  const float tail =
      z * z * z *
      (1.0f / 6 + z * (1.0f / 24 + z * (1.0f / 120 + z * (1.0f / 720 +
                  z * (1.0f / 5040 + z * (1.0f / 40320 + z * (1.0f / 362880)))))));
  MbDF h = mb_two_prod(z, z);
  h.hi *= 0.5f;
  h.lo = h.lo * 0.5f + z * r.lo;  // + r.hi * r.lo from the square
  MbDF e = mb_df_add_f(h, tail);
  e = mb_df_add(e, r);
  e = mb_df_add_f(e, 1.0f);
  const int ni = int(n);
  MbDF out = {MB_LDEXP(e.hi, ni), MB_LDEXP(e.lo, ni)};
  return out;
}

// log(x) for a two-float x > 0 (finite), absolute error ~1e-10: the
// finalize step's log-sum-exp terms are ~10 and cancel to a KL of ~1e-3.
inline MbDF mb_df_log(MbDF x) {
  float h = x.hi, l = x.lo;
  int e = 0;
  if (h < 1.17549435e-38f) {  // subnormal: scale into the normal range
    h *= 16777216.0f;
    l *= 16777216.0f;
    e = -24;
  }
  const uint32_t bits = MB_AS_UINT(h);
  e += int((bits >> 23) & 0xffu) - 127;
  float m = MB_AS_FLOAT((bits & 0x7fffffu) | 0x3f800000u);  // [1, 2)
  if (m > 1.41421356f) {
    m *= 0.5f;
    e += 1;
  }
  l = MB_LDEXP(l, -e);
  // log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716; m - 1 is exact.
  const float num = m - 1.0f;
  const MbDF den = mb_two_sum(m, 1.0f);
  const float sh = num / den.hi;
  const float sl = (MB_FMA(-sh, den.hi, num) - sh * den.lo) / den.hi;
  const float z = sh * sh;
  const float tail =
      sh * z *
      (2.0f / 3 + z * (2.0f / 5 + z * (2.0f / 7 + z * (2.0f / 9 + z * (2.0f / 11 +
                  z * (2.0f / 13 + z * (2.0f / 15)))))));
  MbDF r = mb_fast_two_sum(2.0f * sh, 2.0f * sl);
  r = mb_df_add_f(r, tail);
  r = mb_df_add_f(r, l / m);  // log(m + l) = log m + l/m to first order
  const MbDF el = mb_two_prod(float(e), MB_LN2_DF_HI);
  r = mb_df_add(r, el);
  return mb_df_add_f(r, float(e) * MB_LN2_DF_LO);
}
