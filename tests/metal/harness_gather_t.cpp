// C entry point for the gathered transposed product (metal/gather_qmv_t.metal)
// on the SIMT emulator,
// launched as MixedGatherQMMT::eval_gpu launches it: the plan comes from
// metal/gather_t_host.h and the buffers are allocated, checked and bound
// from its description (harness_core.h; rules in harness.cpp). The index
// scratch (status, bounds, order, inverse) is eval_gpu's temporary; here
// it is shared between the launches and starts poisoned, so a value the
// grouping forgets to write shows in the product or fails the run.
#include "gather_t_host.h"
#include "harness_core.h"

namespace {

using namespace mixbits::metal_host;

using GroupFn = void(const int32_t*, const uint32_t*, const uint32_t*, int32_t*,
                     MbGatherTParams&, int32_t*, uint);
#define MB_SEG_PARAMS(SC) const uint32_t*, const SC*, const SC*
template <typename S, typename SC>
using ProductFn = void(const S*, const int32_t*, S*, const uint32_t*, const uint32_t*,
                       const int32_t*,
                       MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                       MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                       MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MbGatherTParams&, float*, uint3,
                       uint, uint);
#undef MB_SEG_PARAMS
static_assert(MB_QMM_MAX_SEGS == 8, "the product's type above lists 8 segments");

// MixedGatherQMMT's inputs (dy, perm, the stacked segments, lhs, rhs) and
// dx, by the caller's buffers.
struct GtProblem {
  int pairs, M, N, x_batches, w_batches;
  std::vector<QmmSegment> segs;
  ActType at;
  int scale_type;
  UserBuf dy, perm, lhs, rhs, out;
  std::vector<UserBuf> wq, scales, biases;
  int fuse;  // plan_gather_qmv_t's: -1 the host's choice, 0 / 1 forced
};

template <typename S, typename SC>
void run_gt(const GtProblem& t, const simt::Options& opt) {
  const bool has_perm = t.perm.in != nullptr;
  const auto plan = plan_gather_qmv_t(t.pairs, t.M, t.N, t.x_batches, t.w_batches, t.segs,
                                      t.at, t.scale_type, has_perm, t.fuse);
  int K = 0;
  for (const auto& s : t.segs) K += s.k;
  std::vector<int32_t> index(gt_index_words(t.pairs, t.x_batches, K, has_perm));
  Buffers bufs({MB_GT_DY, MB_GT_PERM, MB_GT_OUT, MB_GT_LHS, MB_GT_RHS, MB_GT_INDEX});
  for (const GatherTLaunch& l : plan) {
    std::vector<UserBuf> user(MB_GT_PARAMS);
    const auto used = [&](int i) { return l.buffers[size_t(i)].used(); };
    if (used(MB_GT_DY)) user[MB_GT_DY] = t.dy;
    if (used(MB_GT_PERM)) user[MB_GT_PERM] = t.perm;
    if (used(MB_GT_OUT)) user[MB_GT_OUT] = t.out;
    if (used(MB_GT_LHS)) user[MB_GT_LHS] = t.lhs;
    if (used(MB_GT_RHS)) user[MB_GT_RHS] = t.rhs;
    // The index scratch is eval_gpu's temporary: written by the grouping
    // (poisoned before it), read by the product.
    if (used(MB_GT_INDEX))
      user[MB_GT_INDEX] = {index.data(), index.data(), index.size() * sizeof(int32_t)};
    if (l.kind == GtKind::Product) {
      for (int j = 0; j < l.params.q.nseg; ++j) {
        user[size_t(gt_wq_slot(j))] = t.wq[size_t(j)];
        user[size_t(gt_scales_slot(j))] = t.scales[size_t(j)];
        user[size_t(gt_biases_slot(j))] = t.biases[size_t(j)];
      }
    }
    const std::vector<void*> p = bufs.bind(l, user);
    Guarded smem(std::max<size_t>(l.threadgroup_bytes, 4));
    smem.threadgroup_space();
    simt::Options o = opt;
    o.label = l.kernel;
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
    MbGatherTParams params = l.params;
    auto* perm = static_cast<const int32_t*>(p[MB_GT_PERM]);
    auto* idx = static_cast<int32_t*>(p[MB_GT_INDEX]);
    auto* rhs = static_cast<const uint32_t*>(p[MB_GT_RHS]);
    if (l.kind == GtKind::Group) {
      auto* fn = simt::find_kernel<GroupFn>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(perm, static_cast<const uint32_t*>(p[MB_GT_LHS]), rhs, idx, params,
           smem.as<int32_t>(), i.thread_index_in_threadgroup);
      }, o);
    } else {
      const uint32_t* w[MB_QMM_MAX_SEGS];
      const SC* sc[MB_QMM_MAX_SEGS];
      const SC* bi[MB_QMM_MAX_SEGS];
      for (int j = 0; j < MB_QMM_MAX_SEGS; ++j) {
        w[j] = static_cast<const uint32_t*>(p[size_t(gt_wq_slot(j))]);
        sc[j] = static_cast<const SC*>(p[size_t(gt_scales_slot(j))]);
        bi[j] = static_cast<const SC*>(p[size_t(gt_biases_slot(j))]);
      }
      auto* fn = simt::find_kernel<ProductFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(static_cast<const S*>(p[MB_GT_DY]), perm, static_cast<S*>(p[MB_GT_OUT]),
           static_cast<const uint32_t*>(p[MB_GT_LHS]), rhs, idx,
           w[0], sc[0], bi[0], w[1], sc[1], bi[1], w[2], sc[2], bi[2], w[3], sc[3], bi[3],
           w[4], sc[4], bi[4], w[5], sc[5], bi[5], w[6], sc[6], bi[6], w[7], sc[7], bi[7],
           params, smem.as<float>(), u3(i.threadgroup_position_in_grid),
           i.thread_index_in_threadgroup, i.thread_index_in_simdgroup);
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
// launches' buffer descriptions. fuse: -1 the plan's choice, 0 the
// grouping launch and the product, 1 the fused product alone.
int mbemu_gather_t(int pairs, int M, int N, int x_batches, int w_batches, int nseg,
                   const int* bits, const int* group_size, const int* k, int xtype,
                   const void* dy, size_t dy_bytes, const int32_t* perm, size_t perm_bytes,
                   const void* const* wq, const size_t* wq_bytes, const void* const* scales,
                   const size_t* scales_bytes, const void* const* biases,
                   const size_t* biases_bytes, int scale_type, const uint32_t* lhs,
                   size_t lhs_bytes, const uint32_t* rhs, size_t rhs_bytes, void* out,
                   size_t out_bytes, int fuse, int order, uint64_t seed, char* err,
                   int errlen) {
  return guarded_call([&] {
    GtProblem t{pairs, M, N, x_batches, w_batches, {}, ActType(xtype), scale_type,
                {dy, nullptr, dy_bytes}, {perm, nullptr, perm ? perm_bytes : 0},
                {lhs, nullptr, lhs_bytes}, {rhs, nullptr, rhs_bytes},
                {nullptr, out, out_bytes}, {}, {}, {}, fuse};
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
                           int64_t w_batches, int64_t nseg) {
  return gather_qmv_t_gpu_applies(pairs, M, N, K, x_batches, w_batches, nseg) ? 1 : 0;
}

// Whether the fused product can take the problem (gt_fusable: the pairs
// its threadgroups list, the perm's K-bit map), what the tests ask before
// forcing the fused plan.
int mbemu_gather_t_fusable(int pairs, int K, int has_perm) {
  return gt_fusable(pairs, K, has_perm != 0) ? 1 : 0;
}

}  // extern "C"
