// C entry point for the gathered transposed product (metal/gather_qmv_t.metal,
// with qmatmul_t.metal's perm check and unpermute) on the SIMT emulator,
// launched as MixedGatherQMMT::eval_gpu launches it: the plan comes from
// metal/gather_t_host.h and the buffers are allocated, checked and bound
// from its description (harness_core.h; rules in harness.cpp). The scratch
// buffers (inverse, status, z, order, bounds) are eval_gpu's temporaries;
// here they are shared between the launches and start poisoned, so a value
// one launch forgets to write shows in the next or fails the run.
#include "gather_t_host.h"
#include "harness_core.h"

namespace {

using namespace mixbits::metal_host;

using CheckFn = void(const int32_t*, int32_t*, int32_t*, MbQmvTParams&, int32_t*, uint);
template <typename S>
using UnpermuteFn = void(const int32_t*, const int32_t*, const int32_t*, const float*, S*,
                         MbQmvTParams&, uint3, uint);
using GroupFn = void(int32_t*, const uint32_t*, const uint32_t*, int32_t*, int32_t*,
                     MbGatherTParams&, int32_t*, uint);
template <typename S, typename SC>
using ProductFn = void(const S*, const uint32_t*, const SC*, const SC*, const int32_t*, float*,
                       S*, const uint32_t*, const int32_t*, const int32_t*, MbGatherTParams&,
                       float*, uint3, uint);

// MixedGatherQMMT's inputs (dy, perm, the stacked segments, lhs, rhs) and
// dx, by the caller's buffers.
struct GtProblem {
  int pairs, M, N, x_batches, w_batches;
  std::vector<QmmSegment> segs;
  ActType at;
  int scale_type;
  UserBuf dy, perm, lhs, rhs, out;
  std::vector<UserBuf> wq, scales, biases;
};

template <typename S, typename SC>
void run_gt(const GtProblem& t, const simt::Options& opt) {
  const bool has_perm = t.perm.in != nullptr;
  const auto plan = plan_gather_qmv_t(t.pairs, t.M, t.N, t.x_batches, t.w_batches, t.segs,
                                      t.at, t.scale_type, has_perm);
  int K = 0;
  for (const auto& s : t.segs) K += s.k;
  std::vector<int32_t> inv(has_perm ? K : 0), status(1), order(size_t(t.pairs)),
      bounds(size_t(t.x_batches) + 1);
  std::vector<float> z(has_perm ? size_t(t.x_batches) * t.M * size_t(K) : 0);
  auto sink = [](auto& v) {
    return UserBuf{v.data(), v.data(), v.size() * sizeof(v[0])};
  };
  Buffers bufs({MB_GT_DY, MB_GT_PERM, MB_GT_INV, MB_GT_STATUS, MB_GT_Z, MB_GT_OUT, MB_GT_LHS,
                MB_GT_RHS, MB_GT_ORDER, MB_GT_BOUNDS});
  for (const GatherTLaunch& l : plan) {
    std::vector<UserBuf> user(MB_GT_PARAMS);
    const auto used = [&](int i) {
      return size_t(i) < l.buffers.size() && l.buffers[size_t(i)].used();
    };
    if (used(MB_GT_DY)) user[MB_GT_DY] = t.dy;
    if (used(MB_GT_PERM)) user[MB_GT_PERM] = t.perm;
    if (l.kind == GtKind::Product) {
      user[MB_GT_WQ] = t.wq[size_t(l.segment)];
      user[MB_GT_SCALES] = t.scales[size_t(l.segment)];
      user[MB_GT_BIASES] = t.biases[size_t(l.segment)];
    }
    if (used(MB_GT_INV)) user[MB_GT_INV] = sink(inv);
    if (used(MB_GT_STATUS)) user[MB_GT_STATUS] = sink(status);
    if (used(MB_GT_Z)) user[MB_GT_Z] = sink(z);
    if (used(MB_GT_OUT)) user[MB_GT_OUT] = t.out;
    if (used(MB_GT_LHS)) user[MB_GT_LHS] = t.lhs;
    if (used(MB_GT_RHS)) user[MB_GT_RHS] = t.rhs;
    if (used(MB_GT_ORDER)) user[MB_GT_ORDER] = sink(order);
    if (used(MB_GT_BOUNDS)) user[MB_GT_BOUNDS] = sink(bounds);
    const std::vector<void*> p = bufs.bind(l, user);
    auto at = [&](int i) { return size_t(i) < p.size() ? p[size_t(i)] : nullptr; };
    Guarded smem(std::max<size_t>(l.threadgroup_bytes, 4));
    smem.threadgroup_space();
    simt::Options o = opt;
    o.label = l.kernel;
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
    auto* perm = static_cast<int32_t*>(at(MB_GT_PERM));
    auto* inv_p = static_cast<int32_t*>(at(MB_GT_INV));
    auto* st_p = static_cast<int32_t*>(at(MB_GT_STATUS));
    auto* z_p = static_cast<float*>(at(MB_GT_Z));
    auto* out = static_cast<S*>(at(MB_GT_OUT));
    if (l.kind == GtKind::PermCheck) {
      MbQmvTParams q = l.params.q;
      auto* fn = simt::find_kernel<CheckFn>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(perm, inv_p, st_p, q, smem.as<int32_t>(), i.thread_index_in_threadgroup);
      }, o);
    } else if (l.kind == GtKind::Unpermute) {
      MbQmvTParams q = l.params.q;
      auto* fn = simt::find_kernel<UnpermuteFn<S>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(perm, inv_p, st_p, z_p, out, q, u3(i.threadgroup_position_in_grid),
           i.thread_index_in_threadgroup);
      }, o);
    } else if (l.kind == GtKind::Group) {
      MbGatherTParams params = l.params;
      auto* fn = simt::find_kernel<GroupFn>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(st_p, static_cast<const uint32_t*>(at(MB_GT_LHS)),
           static_cast<const uint32_t*>(at(MB_GT_RHS)), static_cast<int32_t*>(at(MB_GT_ORDER)),
           static_cast<int32_t*>(at(MB_GT_BOUNDS)), params, smem.as<int32_t>(),
           i.thread_index_in_threadgroup);
      }, o);
    } else {
      MbGatherTParams params = l.params;
      auto* fn = simt::find_kernel<ProductFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(static_cast<const S*>(at(MB_GT_DY)), static_cast<const uint32_t*>(at(MB_GT_WQ)),
           static_cast<const SC*>(at(MB_GT_SCALES)), static_cast<const SC*>(at(MB_GT_BIASES)),
           st_p, z_p, out, static_cast<const uint32_t*>(at(MB_GT_RHS)),
           static_cast<const int32_t*>(at(MB_GT_ORDER)),
           static_cast<const int32_t*>(at(MB_GT_BOUNDS)), params, smem.as<float>(),
           u3(i.threadgroup_position_in_grid), i.thread_index_in_threadgroup);
      }, o);
    }
  }
  bufs.finish();
}

template <typename S>
void run_gt_x(const GtProblem& t, const simt::Options& o) {
  if (t.scale_type == MB_SCALE_F32) run_gt<S, float>(t, o);
  else if (t.scale_type == MB_SCALE_F16) run_gt<S, half>(t, o);
  else run_gt<S, uint16_t>(t, o);
}

}  // namespace

extern "C" {

// MixedGatherQMMT's inputs as the primitive holds them: dy [pairs, M, N]
// of xtype; perm int32 [K] or null; per segment the stacked wq, scales,
// biases (w_batches matrices of N rows); lhs, rhs uint32 [pairs]; out (dx)
// [x_batches, M, K] of xtype. Sizes in bytes, checked against the
// launches' buffer descriptions.
int mbemu_gather_t(int pairs, int M, int N, int x_batches, int w_batches, int nseg,
                   const int* bits, const int* group_size, const int* k, int xtype,
                   const void* dy, size_t dy_bytes, const int32_t* perm, size_t perm_bytes,
                   const void* const* wq, const size_t* wq_bytes, const void* const* scales,
                   const size_t* scales_bytes, const void* const* biases,
                   const size_t* biases_bytes, int scale_type, const uint32_t* lhs,
                   size_t lhs_bytes, const uint32_t* rhs, size_t rhs_bytes, void* out,
                   size_t out_bytes, int order, uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    GtProblem t{pairs, M, N, x_batches, w_batches, {}, ActType(xtype), scale_type,
                {dy, nullptr, dy_bytes}, {perm, nullptr, perm ? perm_bytes : 0},
                {lhs, nullptr, lhs_bytes}, {rhs, nullptr, rhs_bytes},
                {nullptr, out, out_bytes}, {}, {}, {}};
    for (int i = 0; i < nseg; ++i) {
      t.segs.push_back({bits[i], group_size[i], k[i]});
      t.wq.push_back({wq[i], nullptr, wq_bytes[i]});
      t.scales.push_back({scales[i], nullptr, scales_bytes[i]});
      t.biases.push_back({biases[i], nullptr, biases_bytes[i]});
    }
    const simt::Options o = options(order, seed);
    if (xtype == 0) run_gt_x<float>(t, o);
    else if (xtype == 1) run_gt_x<half>(t, o);
    else run_gt_x<uint16_t>(t, o);
  }, err, errlen);
}

// Whether eval_gpu's kernels take the problem (gather_qmv_t_gpu_applies,
// what mixed_gather_qmm_t and MixedGatherQMM::vjp ask on a GPU stream).
int mbemu_gather_t_applies(int64_t pairs, int64_t M, int64_t N, int64_t K, int64_t x_batches,
                           int64_t w_batches) {
  return gather_qmv_t_gpu_applies(pairs, M, N, K, x_batches, w_batches) ? 1 : 0;
}

}  // extern "C"
