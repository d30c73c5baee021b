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
// This is the state of the CPU kernel (cpp/kl/kernel.h) with its three
// modes (kl_params.h): in FIXED_SHIFT ca is the given row max and never
// moves; in PROBS a holds weights w_i ~ p_i, sa = sum w,
// t = sum w (-(b_i - cb)) and KL = negH + t/sa + log sb, negH given per row
// as a float32 pair hi + lo.
//
// Accuracy: the CPU keeps sa, sb, t in double. Here they are two-floats
// (twofloat.h): each term is a float, as on the CPU, but the sums, the
// rebase factors e^(old shift - new shift), the lane merges and the final
// logs are carried to ~1e-10, so the result is as accurate as the CPU's
// (bench/KL.md has the figures).
//
// One deliberate difference from the CPU kernel: a finite reference value
// against b_i = -inf makes KL = +inf here even when its weight underflows
// float32 (p_i > 0 exactly when a_i is finite).
#include "kl_params.h"
#include "mixbits_metal.h"
#include "quant_utils.h"
#include "twofloat.h"

// "No index" in the argmax reduction (larger than any column).
#define MB_KL_NO_INDEX 0x7fffffff

struct MbKlState {
  float ca;           // reference shift
  MbDF sa, t;         // reference side sums
  float cb;           // candidate shift
  MbDF sb;            // candidate side sum
  float maxa, maxb;   // row maxima (NaN never enters) ...
  int arga, argb;     // ... and their first index, -1 if none
  uint32_t flags;     // MbKlStatus bits
  uint32_t tinf;      // 1: some p_i > 0 where q_i = 0, KL = +inf (kept
                      // outside t: inf would poison the two-float sums)
};

inline MbKlState mb_kl_empty() {
  const float ninf = -INFINITY;
  MbKlState s = {ninf, mb_df(0.0f), mb_df(0.0f), ninf, mb_df(0.0f),
                 ninf, ninf, -1, -1, 0u, 0u};
  return s;
}

// Raise the reference shift to c: every weight scales by r = e^(ca-c) and
// every (a_i - ca) drops by (c - ca): t = r (t - sa (c - ca)), sa = r sa.
// c - ca is taken exactly (a two-float), r to ~1e-10.
inline void mb_kl_rebase_a(thread MbKlState& s, float c) {
  if (!(c > s.ca)) return;
  if (s.ca == -INFINITY) {  // no mass yet: sa = t = 0
    s.ca = c;
    return;
  }
  const MbDF d = mb_two_sum(c, -s.ca);
  const MbDF r = mb_df_exp(mb_df_neg(d));
  s.t = mb_df_mul(r, mb_df_add(s.t, mb_df_neg(mb_df_mul(s.sa, d))));
  s.sa = mb_df_mul(r, s.sa);
  s.ca = c;
}

// Raise the candidate shift to c: sb scales by e^(cb-c) and every
// -(b_i - cb) grows by d = c - cb, so t grows by sa * d.
inline void mb_kl_rebase_b(thread MbKlState& s, float c) {
  if (!(c > s.cb)) return;
  if (s.cb == -INFINITY) {  // b all -inf so far: sb = 0, t is 0 (or tinf)
    s.cb = c;
    return;
  }
  const MbDF d = mb_two_sum(c, -s.cb);
  s.t = mb_df_add(s.t, mb_df_mul(s.sa, d));
  s.sb = mb_df_mul(mb_df_exp(mb_df_neg(d)), s.sb);
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
  if (b != -INFINITY) s.sb = mb_df_add_f(s.sb, metal::precise::exp(b - s.cb));
  float w, xa;
  if (mode == MB_KL_MODE_PROBS) {
    if (!(a > 0.0f)) return;  // p_i = 0 contributes nothing
    w = a;
    xa = 0.0f;
  } else {
    if (a == -INFINITY) return;  // p_i = 0 contributes nothing
    if (mode == MB_KL_MODE_LOGITS && a > s.ca) mb_kl_rebase_a(s, a);
    xa = a - s.ca;
    w = metal::precise::exp(xa);
  }
  s.sa = mb_df_add_f(s.sa, w);
  // q_i = 0 where p_i > 0: KL is +inf.
  if (b == -INFINITY) {
    s.tinf = 1u;
  } else {
    s.t = mb_df_add_f(s.t, w * (xa - (b - s.cb)));
  }
}

// Two states at the same shifts: their sums add.
inline void mb_kl_add_sums(thread MbKlState& s, MbDF sa, MbDF t, MbDF sb) {
  s.sa = mb_df_add(s.sa, sa);
  s.t = mb_df_add(s.t, t);
  s.sb = mb_df_add(s.sb, sb);
}

// Merge the states of all lanes: common shifts first (simd_max), then the
// two-float sums pairwise over a butterfly (a plain simd_sum would round
// each half separately); argmax = smallest index among lanes holding the
// maximum. Needs all 32 lanes (the threadgroup is a multiple of 32).
inline MbKlState mb_kl_simd_reduce(MbKlState s) {
  mb_kl_rebase_a(s, simd_max(s.ca));
  mb_kl_rebase_b(s, simd_max(s.cb));
  MB_UNROLL for (ushort off = 16; off > 0; off /= 2) {
    const MbDF sa = {simd_shuffle_xor(s.sa.hi, off), simd_shuffle_xor(s.sa.lo, off)};
    const MbDF t = {simd_shuffle_xor(s.t.hi, off), simd_shuffle_xor(s.t.lo, off)};
    const MbDF sb = {simd_shuffle_xor(s.sb.hi, off), simd_shuffle_xor(s.sb.lo, off)};
    mb_kl_add_sums(s, sa, t, sb);
  }
  const float ma = simd_max(s.maxa);
  const int ia = simd_min(s.maxa == ma ? s.arga : MB_KL_NO_INDEX);
  const float mb = simd_max(s.maxb);
  const int ib = simd_min(s.maxb == mb ? s.argb : MB_KL_NO_INDEX);
  s.maxa = ma;
  s.maxb = mb;
  s.arga = ia == MB_KL_NO_INDEX ? -1 : ia;
  s.argb = ib == MB_KL_NO_INDEX ? -1 : ib;
  s.flags = simd_or(s.flags);
  s.tinf = simd_or(s.tinf);
  return s;
}

inline void mb_kl_stash(threadgroup float* dst, MbKlState s) {
  dst[0] = s.ca; dst[1] = s.sa.hi; dst[2] = s.sa.lo; dst[3] = s.t.hi;
  dst[4] = s.t.lo; dst[5] = s.cb; dst[6] = s.sb.hi; dst[7] = s.sb.lo;
  dst[8] = s.maxa; dst[9] = s.maxb;
  dst[10] = as_type<float>(s.arga);
  dst[11] = as_type<float>(s.argb);
  dst[12] = as_type<float>(s.flags);
  dst[13] = as_type<float>(s.tinf);
}

inline MbKlState mb_kl_unstash(const threadgroup float* src) {
  MbKlState s;
  s.ca = src[0]; s.sa.hi = src[1]; s.sa.lo = src[2]; s.t.hi = src[3];
  s.t.lo = src[4]; s.cb = src[5]; s.sb.hi = src[6]; s.sb.lo = src[7];
  s.maxa = src[8]; s.maxb = src[9];
  s.arga = as_type<int>(src[10]);
  s.argb = as_type<int>(src[11]);
  s.flags = as_type<uint32_t>(src[12]);
  s.tinf = as_type<uint32_t>(src[13]);
  return s;
}

// The row's results from its reduced state: everything in two-float until
// the final rounding, since log sa, log sb, t/sa (and negH) are each ~10
// and cancel to a KL that may be 1e-4.
inline void mb_kl_finish(MbKlState s, int mode, MbDF negh, size_t row,
                         device float* kl, device int32_t* status,
                         device int32_t* arg_q, device float* lse_q,
                         device int32_t* arg_ref, device float* lse_ref) {
  uint32_t flags = s.flags;
  if (!(s.sa.hi > 0.0f)) flags |= MB_KL_EMPTY_REF;
  if (!(s.sb.hi > 0.0f)) flags |= MB_KL_EMPTY_LOGITS;
  const float nan = NAN;
  status[row] = int32_t(flags);
  arg_q[row] = s.argb < 0 ? 0 : s.argb;
  arg_ref[row] = mode != MB_KL_MODE_LOGITS ? -1 : (s.arga < 0 ? 0 : s.arga);
  if (flags) {
    kl[row] = lse_q[row] = lse_ref[row] = nan;
    return;
  }
  const MbDF lsb = mb_df_log(s.sb);
  const MbDF lsa = mb_df_log(s.sa);
  const MbDF cross = mb_df_div(s.t, s.sa);
  const MbDF d = mode == MB_KL_MODE_PROBS
                     ? mb_df_add(negh, mb_df_add(cross, lsb))
                     : mb_df_add(cross, mb_df_add(lsb, mb_df_neg(lsa)));
  const float v = d.hi + d.lo;
  // KL >= 0; a tiny negative is rounding.
  kl[row] = s.tinf ? INFINITY : (v > 0.0f ? v : 0.0f);
  lse_q[row] = mb_df_add_f(lsb, s.cb).hi;
  lse_ref[row] = mode == MB_KL_MODE_PROBS ? nan : mb_df_add_f(lsa, s.ca).hi;
}

// Grid = (rows) threadgroups of any multiple of 32 threads up to 1024
// (the host uses MB_KL_THREADS, fewer if the pipeline allows fewer).
// Position and size attributes are all uint3: Metal requires the ones
// declared as vectors to have the same number of components.
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
    uint3 tsize [[threads_per_threadgroup]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]],
    uint nsimd [[simdgroups_per_threadgroup]]) {
  const size_t row = size_t(tid.x);
  const int nthreads = int(tsize.x);
  const device typename IOA::storage* ar = a + row * size_t(p.V);
  const device typename IOB::storage* br = b + row * size_t(p.V);
  const int mode = p.mode;

  MbKlState s = mb_kl_empty();
  MbDF negh = mb_df(0.0f);
  // Row parameters, laid out as the CPU primitive's (kl_params.h).
  if (mode == MB_KL_MODE_FIXED_SHIFT) s.ca = row_param[row];
  if (mode == MB_KL_MODE_PROBS) {
    s.ca = 0.0f;  // weights are not shifted
    negh = mb_two_sum(row_param[MB_KL_PROBS_PARAM_WORDS * row],
                      row_param[MB_KL_PROBS_PARAM_WORDS * row + 1]);
  }
  // Consecutive threads read consecutive elements (coalesced); each thread
  // sees its elements in increasing index order, so `>` keeps the first
  // index of a maximum.
  for (int i = int(lid); i < p.V; i += nthreads) {
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
  mb_kl_finish(s, mode, negh, row, kl, status, arg_q, lse_q, arg_ref, lse_ref);
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
