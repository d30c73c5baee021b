// Metal kernel of the fused KL divergence over vocabulary-sized logits:
// one threadgroup per row, one pass over both rows (online max /
// log-sum-exp), a simdgroup then threadgroup reduction, one write per row.
//
// For reference logits a and candidate logits b with running shifts ca, cb
// (the maxima seen so far):
//   sa = sum e^(a_i-ca)     sb = sum e^(b_i-cb)
//   t  = sum e^(a_i-ca) ((a_i-ca) - (b_i-cb))
//   KL(P||Q) = t/sa - log sa + log sb
// Nothing of size |logit| cancels: only differences a_i - ca, b_i - cb enter.
// This is the state of the CPU kernel (cpp/kl/kernel.h), in float32, with
// its three modes (kl_params.h): in FIXED_SHIFT ca is the given row max and
// never moves; in PROBS a holds weights w_i ~ p_i, sa = sum w,
// t = sum w (-(b_i - cb)) and KL = negH + t/sa + log sb.
//
// One deliberate difference from the CPU kernel: a finite reference value
// against b_i = -inf makes KL = +inf here even when its weight underflows
// float32 (p_i > 0 exactly when a_i is finite).
#include "kl_params.h"
#include "mixbits_metal.h"
#include "quant_utils.h"

// "No index" in the argmax reduction (larger than any column).
#define MB_KL_NO_INDEX 0x7fffffff

struct MbKlState {
  float ca, sa, t;    // reference side
  float cb, sb;       // candidate side
  float maxa, maxb;   // row maxima (NaN never enters) ...
  int arga, argb;     // ... and their first index, -1 if none
  uint32_t flags;     // MbKlStatus bits
};

inline MbKlState mb_kl_empty() {
  const float ninf = -INFINITY;
  MbKlState s = {ninf, 0.0f, 0.0f, ninf, 0.0f, ninf, ninf, -1, -1, 0u};
  return s;
}

// Raise the reference shift to c: every weight scales by r = e^(ca-c) and
// every (a_i - ca) drops by (c - ca).
inline void mb_kl_rebase_a(thread MbKlState& s, float c) {
  if (!(c > s.ca)) return;
  if (s.ca == -INFINITY) {  // no mass yet: sa = t = 0
    s.ca = c;
    return;
  }
  const float r = metal::exp(s.ca - c);
  // t = +inf (some p_i > 0 where q_i = 0) must stay +inf even if r is 0.
  if (!isinf(s.t)) s.t = r * (s.t - s.sa * (c - s.ca));
  s.sa *= r;
  s.ca = c;
}

// Raise the candidate shift to c: sb scales by e^(cb-c) and every
// -(b_i - cb) grows by d = c - cb, so t grows by sa * d.
inline void mb_kl_rebase_b(thread MbKlState& s, float c) {
  if (!(c > s.cb)) return;
  if (s.cb == -INFINITY) {  // b all -inf so far: sb = 0, t is 0 or +inf
    s.cb = c;
    return;
  }
  const float d = c - s.cb;
  s.t += s.sa * d;
  s.sb *= metal::exp(-d);
  s.cb = c;
}

inline void mb_kl_add(thread MbKlState& s, float a, float b, int i, int mode) {
  if (mode == MB_KL_MODE_LOGITS && a > s.maxa) { s.maxa = a; s.arga = i; }
  if (b > s.maxb) { s.maxb = b; s.argb = i; }
  uint32_t f = 0u;
  if (isnan(a)) f |= MB_KL_NAN_REF;
  if (isnan(b)) f |= MB_KL_NAN_LOGITS;
  if (a == INFINITY) f |= MB_KL_POSINF_REF;
  if (b == INFINITY) f |= MB_KL_POSINF_LOGITS;
  if (mode == MB_KL_MODE_PROBS && a < 0.0f) f |= MB_KL_NEG_WEIGHT;
  if (f != 0u) {  // the row's result is NaN; keep the sums finite
    s.flags |= f;
    return;
  }
  if (b > s.cb) mb_kl_rebase_b(s, b);
  if (b != -INFINITY) s.sb += metal::exp(b - s.cb);
  float w, xa;
  if (mode == MB_KL_MODE_PROBS) {
    if (!(a > 0.0f)) return;  // p_i = 0 contributes nothing
    w = a;
    xa = 0.0f;
  } else {
    if (a == -INFINITY) return;  // p_i = 0 contributes nothing
    if (mode == MB_KL_MODE_LOGITS && a > s.ca) mb_kl_rebase_a(s, a);
    xa = a - s.ca;
    w = metal::exp(xa);
  }
  s.sa += w;
  // q_i = 0 where p_i > 0: KL is +inf.
  s.t += (b == -INFINITY) ? INFINITY : w * (xa - (b - s.cb));
}

// Merge the states of all lanes: common shifts first (simd_max), then plain
// sums; argmax = smallest index among lanes holding the maximum.
inline MbKlState mb_kl_simd_reduce(MbKlState s) {
  mb_kl_rebase_a(s, simd_max(s.ca));
  mb_kl_rebase_b(s, simd_max(s.cb));
  s.sa = simd_sum(s.sa);
  s.sb = simd_sum(s.sb);
  s.t = simd_sum(s.t);
  const float ma = simd_max(s.maxa);
  const int ia = simd_min(s.maxa == ma ? s.arga : MB_KL_NO_INDEX);
  const float mb = simd_max(s.maxb);
  const int ib = simd_min(s.maxb == mb ? s.argb : MB_KL_NO_INDEX);
  s.maxa = ma;
  s.maxb = mb;
  s.arga = ia == MB_KL_NO_INDEX ? -1 : ia;
  s.argb = ib == MB_KL_NO_INDEX ? -1 : ib;
  s.flags = simd_or(s.flags);
  return s;
}

inline void mb_kl_stash(threadgroup float* dst, MbKlState s) {
  dst[0] = s.ca; dst[1] = s.sa; dst[2] = s.t; dst[3] = s.cb; dst[4] = s.sb;
  dst[5] = s.maxa; dst[6] = s.maxb;
  dst[7] = as_type<float>(s.arga);
  dst[8] = as_type<float>(s.argb);
  dst[9] = as_type<float>(s.flags);
}

inline MbKlState mb_kl_unstash(const threadgroup float* src) {
  MbKlState s;
  s.ca = src[0]; s.sa = src[1]; s.t = src[2]; s.cb = src[3]; s.sb = src[4];
  s.maxa = src[5]; s.maxb = src[6];
  s.arga = as_type<int>(src[7]);
  s.argb = as_type<int>(src[8]);
  s.flags = as_type<uint32_t>(src[9]);
  return s;
}

// Grid = (rows) threadgroups of any multiple of 32 threads up to 1024
// (the host uses MB_KL_THREADS).
template <typename IOA, typename IOB>
[[kernel]] void mb_kl(
    const device typename IOA::storage* a [[buffer(0)]],
    const device typename IOB::storage* b [[buffer(1)]],
    const device float* row_param [[buffer(2)]],
    device float* kl [[buffer(3)]],
    device int32_t* status [[buffer(4)]],
    device int32_t* arg_q [[buffer(5)]],
    device float* lse_q [[buffer(6)]],
    device int32_t* arg_ref [[buffer(7)]],
    device float* lse_ref [[buffer(8)]],
    constant MbKlParams& p [[buffer(9)]],
    threadgroup float* scratch [[threadgroup(0)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint nthreads [[threads_per_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]],
    uint nsimd [[simdgroups_per_threadgroup]]) {
  const size_t row = size_t(tid.x);
  const device typename IOA::storage* ar = a + row * size_t(p.V);
  const device typename IOB::storage* br = b + row * size_t(p.V);
  const int mode = p.mode;

  MbKlState s = mb_kl_empty();
  if (mode == MB_KL_MODE_FIXED_SHIFT) s.ca = row_param[row];
  if (mode == MB_KL_MODE_PROBS) s.ca = 0.0f;  // weights are not shifted
  // Consecutive threads read consecutive elements (coalesced); each thread
  // sees its elements in increasing index order, so `>` keeps the first
  // index of a maximum.
  for (int i = int(lid); i < p.V; i += int(nthreads)) {
    mb_kl_add(s, IOA::load(ar[i]), IOB::load(br[i]), i, mode);
  }

  s = mb_kl_simd_reduce(s);
  if (simd_lid == 0) mb_kl_stash(scratch + simd_gid * MB_KL_STATE_WORDS, s);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_gid != 0) return;

  s = simd_lid < nsimd ? mb_kl_unstash(scratch + simd_lid * MB_KL_STATE_WORDS)
                       : mb_kl_empty();
  s = mb_kl_simd_reduce(s);
  if (simd_lid != 0) return;

  uint32_t flags = s.flags;
  if (!(s.sa > 0.0f)) flags |= MB_KL_EMPTY_REF;
  if (!(s.sb > 0.0f)) flags |= MB_KL_EMPTY_LOGITS;
  const float lsa = metal::log(s.sa);
  const float lsb = metal::log(s.sb);
  float d = mode == MB_KL_MODE_PROBS ? row_param[row] + s.t / s.sa + lsb
                                     : s.t / s.sa - lsa + lsb;
  d = d > 0.0f ? d : 0.0f;  // KL >= 0; a tiny negative is rounding
  const float nan = NAN;
  kl[row] = flags ? nan : d;
  status[row] = int32_t(flags);
  arg_q[row] = s.argb < 0 ? 0 : s.argb;
  lse_q[row] = flags ? nan : s.cb + lsb;
  arg_ref[row] = mode != MB_KL_MODE_LOGITS ? -1 : (s.arga < 0 ? 0 : s.arga);
  lse_ref[row] = (flags || mode == MB_KL_MODE_PROBS) ? nan : s.ca + lsa;
}

// Host names: mixbits_kl_<reference dtype>_<logits dtype> (kl_host.h).
#define MB_KL_INSTANTIATE(ta, ioa, tb, iob) \
  MB_INSTANTIATE_KERNEL("mixbits_kl_" #ta "_" #tb, mb_kl, ioa, iob)
#define MB_KL_INSTANTIATE_B(ta, ioa)          \
  MB_KL_INSTANTIATE(ta, ioa, float32, MbF32)  \
  MB_KL_INSTANTIATE(ta, ioa, float16, MbF16)  \
  MB_KL_INSTANTIATE(ta, ioa, bfloat16, MbBF16)

MB_KL_INSTANTIATE_B(float32, MbF32)
MB_KL_INSTANTIATE_B(float16, MbF16)
MB_KL_INSTANTIATE_B(bfloat16, MbBF16)
