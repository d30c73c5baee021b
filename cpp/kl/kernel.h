// Backend-neutral pieces of the fused KL-divergence kernel: the running
// per-row state every backend updates, how two states merge, and how a
// finished state becomes KL / log-sum-exp / status. No MLX types here.
//
// For one row with reference logits a and candidate logits b:
//   KL(P||Q) = sum_i p_i ((a_i - A) - (b_i - B)),  A = lse(a), B = lse(b).
// Written around running shifts ca, cb (the maxima seen so far) so nothing
// overflows and nothing of size |logit| cancels:
//   sa = sum e^(a_i-ca)            sb = sum e^(b_i-cb)
//   t  = sum e^(a_i-ca) ((a_i-ca) - (b_i-cb))
//   KL = t/sa - log sa + log sb.
// When a shift grows the sums are rebased exactly (see rebase_a/rebase_b),
// so a row can be cut into blocks and chunks in any way and merged.
//
// Probs mode takes the reference as non-negative weights w_i proportional to
// p_i (precomputed once for a sweep) plus negH = sum p log p per row:
//   sa = sum w,  t = sum w (-(b_i - cb)),  KL = negH + t/sa + log sb.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/half.h"

#include "common/backend.h"
namespace mixbits {

enum class KLMode : int {
  Logits = 0,      // a = reference logits; its max is found in the pass
  FixedShift = 1,  // a = reference logits, ca fixed per row (its known max)
  Probs = 2,       // a = reference weights w >= 0; negH given per row
};

constexpr BackendSet kKLBackends = backend_set({Backend::Ref, Backend::Avx2, Backend::Neon});

// Status bits reported per row; any bit set makes that row's KL NaN.
enum KLStatus : uint32_t {
  kNanRef = 1,        // NaN in the reference
  kNanLogits = 2,     // NaN in the candidate logits
  kPosInfRef = 4,     // +inf in the reference logits
  kPosInfLogits = 8,  // +inf in the candidate logits
  kEmptyRef = 16,     // reference row has no probability mass (all -inf / 0)
  kEmptyLogits = 32,  // candidate row is all -inf
  kNegWeight = 64,    // Probs mode: a negative reference weight
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct KLState {
  float ca = kNegInf;  // shift of the reference side (fixed unless Logits)
  float cb = kNegInf;  // shift of the candidate side
  double sa = 0, sb = 0, t = 0;
  float maxa = kNegInf, maxb = kNegInf;  // row maxima and their first index
  int64_t arga = -1, argb = -1;
  uint32_t flags = 0;
};

// One contiguous piece of a row: elements [offset, offset + n) of both.
struct KLChunk {
  const void* a;  // reference logits or weights, already offset
  DType at;
  const void* b;  // candidate logits, already offset
  DType bt;
  int64_t n;
  int64_t offset;  // index of the first element within the row (argmax)
};

// Every backend implements this: fold one chunk into the state.
using KLChunkFn = void (*)(KLMode mode, const KLChunk& c, KLState& st);

// Move the reference shift up to `c` (Logits mode), keeping sa and t exact:
// each term's weight scales by r = e^(ca-c) and its value drops by (c-ca).
inline void kl_rebase_a(KLState& s, float c) {
  if (!(c > s.ca)) return;
  if (s.ca == kNegInf) {  // nothing with mass yet: sa = t = 0
    s.ca = c;
    return;
  }
  double r = std::exp(double(s.ca) - double(c));
  if (s.sa > 0) s.t = r * (s.t - s.sa * (double(c) - double(s.ca)));
  s.sa *= r;
  s.ca = c;
}

// Move the candidate shift up to `c`: sb scales by e^(cb-c); every term's
// -(b-cb) grows by (c-cb), so t grows by sa*(c-cb).
inline void kl_rebase_b(KLState& s, float c) {
  if (!(c > s.cb)) return;
  if (s.cb == kNegInf) {  // b all -inf so far: sb = 0, t is 0 or +inf
    s.cb = c;
    return;
  }
  double d = double(c) - double(s.cb);
  if (s.sa > 0) s.t += s.sa * d;
  s.sb *= std::exp(-d);
  s.cb = c;
}

// Folds `y` (a later piece of the same row) into `x`.
inline void kl_merge(KLMode mode, KLState& x, const KLState& y) {
  KLState yy = y;
  if (mode == KLMode::Logits) {
    float ca = std::max(x.ca, yy.ca);
    kl_rebase_a(x, ca);
    kl_rebase_a(yy, ca);
  }
  float cb = std::max(x.cb, yy.cb);
  kl_rebase_b(x, cb);
  kl_rebase_b(yy, cb);
  x.sa += yy.sa;
  x.sb += yy.sb;
  x.t += yy.t;
  if (yy.maxa > x.maxa) x.maxa = yy.maxa, x.arga = yy.arga;
  if (yy.maxb > x.maxb) x.maxb = yy.maxb, x.argb = yy.argb;
  x.flags |= yy.flags;
}

struct KLRowResult {
  float kl, lse_q, lse_ref;
  int32_t argmax_q, argmax_ref;
  int32_t status;
};

inline KLRowResult kl_finalize(KLMode mode, KLState s, double negh) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  KLRowResult r{};
  // "No mass" is only reported for rows without NaN (NaN sums compare
  // false, and a NaN row may have had all its finite lanes masked).
  if (s.sa <= 0 && !(s.flags & kNanRef)) s.flags |= kEmptyRef;
  if (s.sb <= 0 && !(s.flags & kNanLogits)) s.flags |= kEmptyLogits;
  if (s.maxb == std::numeric_limits<float>::infinity()) s.flags |= kPosInfLogits;
  if (mode == KLMode::Logits &&
      s.maxa == std::numeric_limits<float>::infinity())
    s.flags |= kPosInfRef;
  r.status = int32_t(s.flags);
  r.argmax_q = int32_t(s.argb < 0 ? 0 : s.argb);
  r.argmax_ref = int32_t(s.arga < 0 ? 0 : s.arga);
  if (s.flags) {
    r.kl = r.lse_q = r.lse_ref = nan;
    return r;
  }
  double lsb = std::log(s.sb);
  double kl = mode == KLMode::Probs ? negh + s.t / s.sa + lsb
                                    : s.t / s.sa - std::log(s.sa) + lsb;
  // KL >= 0 exactly; a tiny negative is rounding of two nearly equal sides.
  r.kl = kl > 0 ? float(kl) : 0.0f;
  r.lse_q = float(double(s.cb) + lsb);
  r.lse_ref = mode == KLMode::Probs ? nan : float(double(s.ca) + std::log(s.sa));
  return r;
}

// Backends.
void kl_chunk_ref(KLMode mode, const KLChunk& c, KLState& st);
#if defined(MIXBITS_HAVE_AVX2)
void kl_chunk_avx2(KLMode mode, const KLChunk& c, KLState& st);
void kl_exp_avx2(const float* x, float* y, int64_t n);
double kl_exp_sum_avx2(const float* x, int64_t n, int64_t reps);
#endif
#if defined(MIXBITS_HAVE_NEON)
void kl_chunk_neon(KLMode mode, const KLChunk& c, KLState& st);
void kl_exp_neon(const float* x, float* y, int64_t n);
double kl_exp_sum_neon(const float* x, int64_t n, int64_t reps);
#endif

// The chunk function for `requested` on this CPU; throws if it is forced but
// unavailable. Auto picks the fastest available.
KLChunkFn select_kl(Backend requested);
std::vector<Backend> available_kl_backends();

// The backend's vectorized exp (for accuracy tests): y = e^x elementwise.
void kl_vector_exp(Backend backend, const float* x, float* y, int64_t n);
// Seconds for all worker threads to evaluate `n_exps` exps in total with the
// backend's vectorized exp on cache-resident data (the exp-throughput bound).
double kl_exp_seconds(Backend backend, int64_t n_exps);

}  // namespace mixbits
