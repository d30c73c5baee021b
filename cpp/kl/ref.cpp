// Scalar reference of the KL chunk: plain loops, double-precision exp and
// sums. Also the portable fallback on CPUs without a SIMD backend.
#include <cmath>

#include "kl/kernel.h"

namespace mixbits {

void kl_chunk_ref(KLMode mode, const KLChunk& c, KLState& st) {
  const bool logits = mode == KLMode::Logits;
  const bool probs = mode == KLMode::Probs;
  // Pass 1: maxima (first index wins ties), NaN and sign checks.
  float ma = kNegInf, mb = kNegInf;
  int64_t ia = -1, ib = -1;
  for (int64_t i = 0; i < c.n; ++i) {
    float a = load_as_f32(c.a, i, c.at);
    float b = load_as_f32(c.b, i, c.bt);
    if (std::isnan(a)) st.flags |= kNanRef;
    if (std::isnan(b)) st.flags |= kNanLogits;
    if (probs && a < 0) st.flags |= kNegWeight;
    if (logits && a > ma) ma = a, ia = i;
    if (b > mb) mb = b, ib = i;
  }
  if (logits && ma > st.maxa) st.maxa = ma, st.arga = c.offset + ia;
  if (mb > st.maxb) st.maxb = mb, st.argb = c.offset + ib;
  if (logits) kl_rebase_a(st, ma);
  kl_rebase_b(st, mb);
  // A side or b side with nothing finite yet shifts by 0: every exp is 0.
  const double ca = st.ca == kNegInf ? 0.0 : double(st.ca);
  const double cb = st.cb == kNegInf ? 0.0 : double(st.cb);
  // Pass 2: the sums.
  double sa = 0, sb = 0, t = 0;
  for (int64_t i = 0; i < c.n; ++i) {
    double a = load_as_f32(c.a, i, c.at);
    double b = load_as_f32(c.b, i, c.bt);
    double xb = b - cb;
    sb += std::exp(xb);
    if (probs) {
      if (a > 0) sa += a, t -= a * xb;
    } else {
      double xa = a - ca;
      double w = std::exp(xa);
      // w == 0 (masked or underflowed) contributes nothing, even if b = -inf.
      if (w > 0) sa += w, t += w * (xa - xb);
    }
  }
  st.sa += sa;
  st.sb += sb;
  st.t += t;
}

}  // namespace mixbits
