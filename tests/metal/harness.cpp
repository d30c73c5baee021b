// C entry points (loaded with ctypes by the tests) that launch the Metal
// kernels on the SIMT emulator exactly as the Mac host code does: the
// launch plans come from metal/qmatmul_host.h and metal/kl_host.h (the
// gathered matmul's, metal/gather_host.h, in harness_gather.cpp), the
// kernels are looked up by their [[host_name]], and the buffers are
// allocated, checked and bound from each launch's own description of them
// (Launch::buffers, metal/kernel_args.h), the one cpp/*/metal.cpp binds MLX
// arrays from. The caller's arrays must match that description in size
// (so a test cannot hand a kernel a buffer the primitive never would), and
// every bound pointer, stand-ins included, must be aligned for the element
// type the kernel declares there.
//
// Every input a kernel sees is a copy placed so that it ends at a
// PROT_NONE page: reading past its end faults. Outputs start 16-byte
// aligned (as MLX allocates them, offset 0) and are followed by canary
// bytes up to the guard page, checked after the launch. Outputs and
// threadgroup memory start as NaN, so an element a kernel forgets to
// write, or a threadgroup slot read before it is written, shows. The
// machinery for all of this is in harness_core.h.
#include "kl_host.h"
#include "qmatmul_host.h"
#include "harness_core.h"

namespace {

using namespace mixbits::metal_host;

// ---- qmatmul ---------------------------------------------------------------

// S: storage of x and out; SC: storage of scales and biases. Both kernels
// take x, perm, acc, out, then wq/scales/biases of MB_QMM_MAX_SEGS segments,
// the parameter block and the threadgroup memory.
#define MB_SEG_PARAMS(SC) const uint32_t*, const SC*, const SC*
template <typename S, typename SC>
using QmvFn = void(const S*, const int32_t*, float*, S*,
                   MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                   MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                   MbQmmFusedParams&, float*, uint3, uint, uint, uint, uint);
template <typename S, typename SC>
using QmmFn = void(const S*, const int32_t*, float*, S*,
                   MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                   MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                   MbQmmFusedParams&, float*, uint3, uint, uint);
#undef MB_SEG_PARAMS
static_assert(MB_QMM_MAX_SEGS == 8, "the kernel types above list 8 segments");

// x, perm: user buffers; per segment wq/scales/biases; out receives [M, N].
// Binds exactly what eval_gpu (cpp/qmatmul/metal.cpp) binds: the plan's
// buffers, segment j of launch l at slots qmm_*_slot(j).
template <typename S, typename SC>
void run_qmm(int M, int N, const std::vector<QmmSegment>& segs, ActType at,
             const UserBuf& x, const UserBuf& perm, const std::vector<UserBuf>& wq,
             const std::vector<UserBuf>& scales, const std::vector<UserBuf>& biases,
             int scale_type, const UserBuf& out, QmmPath path,
             const simt::Options& opt) {
  const auto plan = plan_qmm(M, N, segs, at, scale_type, perm.in != nullptr, path);
  // The partial sum (more than MB_QMM_MAX_SEGS segments) is eval_gpu's own
  // temporary; here too.
  std::vector<float> acc_sink(qmm_needs_acc(segs.size()) ? size_t(M) * N : 0);
  Buffers bufs({MB_QMM_X, MB_QMM_PERM, MB_QMM_ACC, MB_QMM_OUT});
  for (const QmmLaunch& l : plan) {
    std::vector<UserBuf> user(MB_QMM_PARAMS);
    user[MB_QMM_X] = x;
    user[MB_QMM_PERM] = perm;
    for (int j = 0; j < l.params.nseg; ++j) {
      const size_t i = size_t(l.first_segment + j);
      user[size_t(qmm_wq_slot(j))] = wq[i];
      user[size_t(qmm_scales_slot(j))] = scales[i];
      user[size_t(qmm_biases_slot(j))] = biases[i];
    }
    if (!acc_sink.empty()) user[MB_QMM_ACC] = {nullptr, acc_sink.data(), acc_sink.size() * 4};
    user[MB_QMM_OUT] = out;
    const std::vector<void*> p = bufs.bind(l, user);
    Guarded smem(std::max<size_t>(l.threadgroup_bytes, 4));
    smem.threadgroup_space();
    MbQmmFusedParams params = l.params;
    simt::Options o = opt;
    o.label = l.kernel;
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
    auto* xs = static_cast<const S*>(p[MB_QMM_X]);
    auto* pp = static_cast<const int32_t*>(p[MB_QMM_PERM]);
    auto* acc = static_cast<float*>(p[MB_QMM_ACC]);
    auto* y = static_cast<S*>(p[MB_QMM_OUT]);
    const uint32_t* w[MB_QMM_MAX_SEGS];
    const SC* sc[MB_QMM_MAX_SEGS];
    const SC* bi[MB_QMM_MAX_SEGS];
    for (int j = 0; j < MB_QMM_MAX_SEGS; ++j) {
      w[j] = static_cast<const uint32_t*>(p[size_t(qmm_wq_slot(j))]);
      sc[j] = static_cast<const SC*>(p[size_t(qmm_scales_slot(j))]);
      bi[j] = static_cast<const SC*>(p[size_t(qmm_biases_slot(j))]);
    }
#define MB_SEG_ARGS(j) w[j], sc[j], bi[j]
#define MB_ALL_SEG_ARGS                                                               \
  MB_SEG_ARGS(0), MB_SEG_ARGS(1), MB_SEG_ARGS(2), MB_SEG_ARGS(3), MB_SEG_ARGS(4), \
      MB_SEG_ARGS(5), MB_SEG_ARGS(6), MB_SEG_ARGS(7)
    if (l.tiled) {
      auto* fn = simt::find_kernel<QmmFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) {
            fn(xs, pp, acc, y, MB_ALL_SEG_ARGS, params, smem.as<float>(),
               u3(t.threadgroup_position_in_grid), t.thread_index_in_threadgroup,
               t.simdgroup_index_in_threadgroup);
          }, o);
    } else {
      auto* fn = simt::find_kernel<QmvFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) {
            fn(xs, pp, acc, y, MB_ALL_SEG_ARGS, params, smem.as<float>(),
               u3(t.threadgroup_position_in_grid), t.thread_index_in_threadgroup,
               t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup,
               t.simdgroups_per_threadgroup);
          }, o);
    }
#undef MB_ALL_SEG_ARGS
#undef MB_SEG_ARGS
  }
  bufs.finish();
}

// The instantiation for x dtype `xtype` (0 f32, 1 f16, 2 bf16) and scale
// dtype `scale_type` (MbScaleType).
template <typename S>
void run_qmm_x(int scale_type, int M, int N, const std::vector<QmmSegment>& segs,
               ActType at, const UserBuf& x, const UserBuf& perm,
               const std::vector<UserBuf>& w, const std::vector<UserBuf>& s,
               const std::vector<UserBuf>& b, const UserBuf& out, QmmPath path,
               const simt::Options& o) {
  if (scale_type == MB_SCALE_F32)
    run_qmm<S, float>(M, N, segs, at, x, perm, w, s, b, scale_type, out, path, o);
  else if (scale_type == MB_SCALE_F16)
    run_qmm<S, half>(M, N, segs, at, x, perm, w, s, b, scale_type, out, path, o);
  else
    run_qmm<S, uint16_t>(M, N, segs, at, x, perm, w, s, b, scale_type, out, path, o);
}

void run_qmm_typed(int xtype, int scale_type, int M, int N,
                   const std::vector<QmmSegment>& segs, ActType at, const UserBuf& x,
                   const UserBuf& perm, const std::vector<UserBuf>& w,
                   const std::vector<UserBuf>& s, const std::vector<UserBuf>& b,
                   const UserBuf& out, QmmPath path, const simt::Options& o) {
  if (xtype == 0)
    run_qmm_x<float>(scale_type, M, N, segs, at, x, perm, w, s, b, out, path, o);
  else if (xtype == 1)
    run_qmm_x<half>(scale_type, M, N, segs, at, x, perm, w, s, b, out, path, o);
  else
    run_qmm_x<uint16_t>(scale_type, M, N, segs, at, x, perm, w, s, b, out, path, o);
}

// ---- KL ----------------------------------------------------------------------

template <typename SA, typename SB>
using KlFn = void(const SA*, const SB*, const float*, float*, int32_t*,
                  int32_t*, float*, int32_t*, float*, MbKlParams&, float*,
                  uint3, uint3, uint, uint, uint, uint);

// user: the caller's buffers by index (MB_KL_A .. MB_KL_LSE_REF).
template <typename SA, typename SB>
void run_kl(int rows, int V, ActType ta, ActType tb, int mode, int threads,
            const std::vector<UserBuf>& user, const simt::Options& opt) {
  const KlLaunch l = plan_kl(rows, V, ta, tb, mode, threads);
  Buffers bufs({});
  const std::vector<void*> p = bufs.bind(l, user);
  Guarded smem(l.threadgroup_bytes);
  smem.threadgroup_space();
  MbKlParams params = l.params;
  auto* fn = simt::find_kernel<KlFn<SA, SB>>(l.kernel);
  simt::Options o = opt;
  o.label = l.kernel;
  o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
  simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
      [&](const simt::ThreadIds& t) {
        fn(static_cast<const SA*>(p[MB_KL_A]), static_cast<const SB*>(p[MB_KL_B]),
           static_cast<const float*>(p[MB_KL_ROW_PARAM]), static_cast<float*>(p[MB_KL_OUT]),
           static_cast<int32_t*>(p[MB_KL_STATUS]), static_cast<int32_t*>(p[MB_KL_ARG_Q]),
           static_cast<float*>(p[MB_KL_LSE_Q]), static_cast<int32_t*>(p[MB_KL_ARG_REF]),
           static_cast<float*>(p[MB_KL_LSE_REF]), params, smem.as<float>(),
           u3(t.threadgroup_position_in_grid), u3(t.threads_per_threadgroup),
           t.thread_index_in_threadgroup, t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup, t.simdgroups_per_threadgroup);
      }, o);
  bufs.finish();
}

template <typename SA>
void run_kl_b(ActType tb, int rows, int V, ActType ta, int mode, int threads,
              const std::vector<UserBuf>& user, const simt::Options& opt) {
  if (tb == ActType::F32)
    run_kl<SA, float>(rows, V, ta, tb, mode, threads, user, opt);
  else if (tb == ActType::F16)
    run_kl<SA, half>(rows, V, ta, tb, mode, threads, user, opt);
  else
    run_kl<SA, uint16_t>(rows, V, ta, tb, mode, threads, user, opt);
}

// ---- selftest kernels -----------------------------------------------------------

using StFn = void(const float*, float*, float*, uint3, uint, uint3, uint, uint);

}  // namespace

extern "C" {

// x: [M, K] of act type xtype (0 f32, 1 f16, 2 bf16); perm: int32 [K] or
// null; per segment wq/scales/biases with their sizes in bytes; out: [M, N]
// of xtype. Sizes are checked against the launch's buffer description.
// path: 0 auto, 1 GEMV, 2 tiled. order: 0 forward, 1 reverse, 2 shuffle.
int mbemu_qmm(int M, int N, int nseg, const int* bits, const int* group_size,
              const int* k, int xtype, const void* x, size_t x_bytes,
              const int32_t* perm, size_t perm_bytes, const void* const* wq,
              const size_t* wq_bytes, const void* const* scales,
              const size_t* scales_bytes, const void* const* biases,
              const size_t* biases_bytes, int scale_type, void* out,
              size_t out_bytes, int path, int order, uint64_t seed, char* err,
              int errlen) {
  return guarded_call([&] {
    std::vector<QmmSegment> segs;
    std::vector<UserBuf> w, s, b;
    for (int i = 0; i < nseg; ++i) {
      segs.push_back({bits[i], group_size[i], k[i]});
      w.push_back({wq[i], nullptr, wq_bytes[i]});
      s.push_back({scales[i], nullptr, scales_bytes[i]});
      b.push_back({biases[i], nullptr, biases_bytes[i]});
    }
    const simt::Options o = options(order, seed);
    const auto p = QmmPath(path);
    const auto at = ActType(xtype);
    const UserBuf ux{x, nullptr, x_bytes}, up{perm, nullptr, perm ? perm_bytes : 0};
    const UserBuf uo{nullptr, out, out_bytes};
    run_qmm_typed(xtype, scale_type, M, N, segs, at, ux, up, w, s, b, uo, p, o);
  }, err, errlen);
}

// ta, tb: dtypes of reference and logits (0 f32, 1 f16, 2 bf16). bufs[i],
// bytes[i]: the buffer for index i (MB_KL_A .. MB_KL_LSE_REF; inputs read,
// outputs written), null/0 for a slot left empty (the row parameter in
// LOGITS mode). Sizes are checked against the launch's buffer description,
// which is the CPU primitive's: in PROBS mode the row parameter is
// float32 [rows, 2].
int mbemu_kl(int rows, int V, int ta, int tb, int mode, int threads,
             void* const* bufs, const size_t* bytes, int order, uint64_t seed,
             char* err, int errlen) {
  return guarded_call([&] {
    const simt::Options o = options(order, seed);
    std::vector<UserBuf> user(MB_KL_PARAMS);
    for (int i = 0; i < MB_KL_PARAMS; ++i) {
      if (i <= MB_KL_ROW_PARAM) user[size_t(i)] = {bufs[i], nullptr, bytes[i]};
      else user[size_t(i)] = {nullptr, bufs[i], bytes[i]};
    }
    const auto a_t = ActType(ta), b_t = ActType(tb);
    if (a_t == ActType::F32)
      run_kl_b<float>(b_t, rows, V, a_t, mode, threads, user, o);
    else if (a_t == ActType::F16)
      run_kl_b<half>(b_t, rows, V, a_t, mode, threads, user, o);
    else
      run_kl_b<uint16_t>(b_t, rows, V, a_t, mode, threads, user, o);
  }, err, errlen);
}

// Runs a selftest.metal kernel over `groups` threadgroups of `threads`
// threads; `in` has groups*threads floats, `out` out_len floats.
int mbemu_selftest(const char* name, int groups, int threads, const float* in,
                   float* out, int out_len, int order, uint64_t seed,
                   char* err, int errlen) {
  return guarded_call([&] {
    auto* fn = simt::find_kernel<StFn>(name);
    Guarded gin(size_t(groups) * threads * 4, in);
    Guarded gout(size_t(out_len) * 4);
    gout.fill_nan_f32();
    Guarded tg(size_t(threads) * 4);
    tg.threadgroup_space();
    simt::Options o = options(order, seed);
    o.label = name;
    o.group_start = [&](const simt::Dim3&) { tg.fill_nan_f32(); };
    simt::dispatch_threadgroups({uint32_t(groups), 1, 1}, {uint32_t(threads), 1, 1},
        [&](const simt::ThreadIds& t) {
          fn(gin.as<float>(), gout.as<float>(), tg.as<float>(),
             u3(t.threadgroup_position_in_grid), t.thread_index_in_threadgroup,
             u3(t.threads_per_threadgroup), t.simdgroup_index_in_threadgroup,
             t.thread_index_in_simdgroup);
        }, o);
    std::memcpy(out, gout.as<float>(), size_t(out_len) * 4);
  }, err, errlen);
}

// Traffic counters (simt.h): begin clears the log and records one entry
// per dispatch until end; record i fills vals (kTrafficFields uint64:
// threads, grid x y z, group x y z, device read bytes by width 1 2 4 8 16
// other, device write bytes likewise, threadgroup read, threadgroup write,
// barriers, simdgroup barriers, MMAs, unique device bytes read, written)
// and its label; returns 0, or 1 for a bad index or size.
void mbemu_traffic_begin() { simt::traffic_begin(); }
void mbemu_traffic_end() { simt::traffic_end(); }
int mbemu_traffic_records() { return int(simt::traffic_log().size()); }
int mbemu_traffic_record(int i, uint64_t* vals, int nvals, char* label, int len) {
  const auto& log = simt::traffic_log();
  if (i < 0 || size_t(i) >= log.size() || nvals != 26) return 1;
  const simt::Traffic& t = log[size_t(i)];
  uint64_t* v = vals;
  *v++ = t.threads;
  for (const simt::Dim3& d : {t.grid, t.group}) {
    *v++ = d.x;
    *v++ = d.y;
    *v++ = d.z;
  }
  for (int w = 0; w < simt::kWidths; ++w) *v++ = t.device_read[w];
  for (int w = 0; w < simt::kWidths; ++w) *v++ = t.device_write[w];
  *v++ = t.tg_read;
  *v++ = t.tg_write;
  *v++ = t.barriers;
  *v++ = t.simd_barriers;
  *v++ = t.mma;
  *v++ = t.unique_read;
  *v++ = t.unique_write;
  report(t.label.c_str(), label, len);
  return 0;
}

// Every [[host_name]] the libraries registered (for the name checks).
int mbemu_kernel_count() { return int(simt::kernel_count()); }

}  // extern "C"
