// Runs the NEON KL chunk against the scalar reference on random and
// adversarial rows. Built for aarch64 and run under qemu-user by
// tests/test_kl_neon_emulated.py; prints one line per failure and exits 1.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kl/kernel.h"

using namespace mixbits;

static int failures = 0;

static void check(const char* what, KLMode mode, DType at, DType bt,
                  const std::vector<float>& a, const std::vector<float>& b,
                  float param, int64_t split) {
  const int64_t V = int64_t(a.size());
  std::vector<uint16_t> ah(V), bh(V);
  auto enc = [](DType t, const std::vector<float>& x, std::vector<uint16_t>& h)
      -> const void* {
    if (t == DType::f32) return x.data();
    for (size_t i = 0; i < x.size(); ++i)
      h[i] = t == DType::f16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
    return h.data();
  };
  const void* pa = enc(at, a, ah);
  const void* pb = enc(bt, b, bh);
  const int asz = at == DType::f32 ? 4 : 2, bsz = bt == DType::f32 ? 4 : 2;
  KLRowResult r[2];
  for (int k = 0; k < 2; ++k) {
    KLChunkFn fn = k ? kl_chunk_neon : kl_chunk_ref;
    KLState st;
    if (mode == KLMode::FixedShift) st.ca = param;
    for (int64_t k0 = 0; k0 < V; k0 += split) {
      KLState part;
      part.ca = st.ca;
      if (mode == KLMode::Logits) part.ca = kNegInf;
      int64_t n = std::min(split, V - k0);
      KLChunk c{static_cast<const char*>(pa) + k0 * asz, at,
                static_cast<const char*>(pb) + k0 * bsz, bt, n, k0};
      fn(mode, c, part);
      if (k0 == 0) st = part; else kl_merge(mode, st, part);
    }
    r[k] = kl_finalize(mode, st, double(param));
  }
  bool ok = r[0].status == r[1].status && r[0].argmax_q == r[1].argmax_q &&
            (mode != KLMode::Logits || r[0].argmax_ref == r[1].argmax_ref);
  if (ok && r[0].status == 0) {
    double want = r[0].kl, got = r[1].kl;
    if (std::isinf(want)) ok = got == want;
    else ok = std::fabs(got - want) <= 2e-6 + 2e-5 * std::fabs(want);
    ok = ok && std::fabs(r[0].lse_q - r[1].lse_q) <= 1e-5 * (1 + std::fabs(r[0].lse_q));
  }
  if (!ok) {
    ++failures;
    std::printf("FAIL %s mode=%d at=%d bt=%d V=%lld: ref kl=%g st=%d arg=%d/%d, neon kl=%g st=%d arg=%d/%d\n",
                what, int(mode), int(at), int(bt), (long long)V, r[0].kl, r[0].status,
                r[0].argmax_q, r[0].argmax_ref, r[1].kl, r[1].status, r[1].argmax_q,
                r[1].argmax_ref);
  }
}

int main() {
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  int cases = 0;
  for (int64_t V : {1, 3, 8, 1023, 1024, 1025, 5000}) {
    for (int kind = 0; kind < 6; ++kind) {
      std::vector<float> a(V), b(V);
      for (int64_t i = 0; i < V; ++i) a[i] = 3 * nd(g), b[i] = a[i] + 0.3f * nd(g);
      const char* what = "random";
      if (kind == 1) { what = "neginf"; for (int64_t i = 0; i < V; i += 3) a[i] = b[i] = kNegInf; if (V > 1) b[1] = kNegInf; }
      if (kind == 2) { what = "huge"; for (auto& x : a) x *= 3000; for (auto& x : b) x *= 3000; }
      if (kind == 3) { what = "nan"; b[V / 2] = NAN; }
      if (kind == 4) { what = "ties"; for (auto& x : a) x = 1; for (auto& x : b) x = 2; }
      if (kind == 5) { what = "rising"; for (int64_t i = 0; i < V; ++i) a[i] = b[i] = float(i) / 50; }
      for (DType at : {DType::f32, DType::f16, DType::bf16})
        for (DType bt : {DType::f32, DType::f16}) {
          for (int64_t split : {V, int64_t(700)}) {
            check(what, KLMode::Logits, at, bt, a, b, 0, split);
            // FixedShift with the row max; Probs with softmax weights.
            float m = kNegInf;
            for (float x : a) m = std::max(m, x);
            if (kind != 2 && std::isfinite(m)) {
              check(what, KLMode::FixedShift, at, bt, a, b, m, split);
              std::vector<float> w(V);
              double s = 0;
              for (int64_t i = 0; i < V; ++i) s += (w[i] = std::exp(a[i] - m));
              check(what, KLMode::Probs, DType::f32, bt, w, b, -1.0f, split);
            }
            cases += 3;
          }
        }
    }
  }
  // The vector exp itself.
  std::vector<float> x(20000), y(20000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = -87.3f + 88.0f * float(i) / x.size();
  kl_exp_neon(x.data(), y.data(), int64_t(x.size()));
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i)
    worst = std::max(worst, std::fabs(y[i] / std::exp(double(x[i])) - 1));
  if (worst > 2e-7) { ++failures; std::printf("FAIL exp rel err %g\n", worst); }
  std::printf("%d cases, %d failures, exp rel err %.3g\n", cases, failures, worst);
  return failures ? 1 : 0;
}
