// C entry point for the gathered quantized matmul (metal/gather_qmv.metal,
// the GEMV, and metal/gather_qmm.metal, the tiled kernel) on the SIMT
// emulator, launched as cpp/gather/metal.cpp launches it: the
// plan comes from metal/gather_host.h and the buffers are allocated, checked
// and bound from its description (harness_core.h; rules in harness.cpp).
#include "gather_host.h"
#include "harness_core.h"

namespace {

using namespace mixbits::metal_host;

// Both kernels: x, perm, lhs, rhs, acc, out, 8 x (wq, scales, biases), the
// parameter block, threadgroup memory, then the GEMV's (group, thread,
// simdgroup, lane, simdgroups per group) or the tiled kernel's (group,
// thread, simdgroup) ids.
#define MB_SEG_PARAMS(SC) const uint32_t*, const SC*, const SC*
#define MB_GATHER_BUFFERS(S, SC)                                                               \
  const S*, const int32_t*, const uint32_t*, const uint32_t*, float*, S*, MB_SEG_PARAMS(SC),  \
      MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),             \
      MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MbGatherFusedParams&, float*
template <typename S, typename SC>
using GatherFn = void(MB_GATHER_BUFFERS(S, SC), uint3, uint, uint, uint, uint);
template <typename S, typename SC>
using GatherTiledFn = void(MB_GATHER_BUFFERS(S, SC), uint3, uint, uint);
#undef MB_GATHER_BUFFERS
#undef MB_SEG_PARAMS
static_assert(MB_QMM_MAX_SEGS == 8, "the kernels' types above list 8 segments");

// The shapes of MixedGatherQMM's inputs, and the caller's buffers by index
// (MB_GQMV_X .. MB_GQMV_OUT) with one wq/scales/biases per segment.
struct GatherProblem {
  int pairs, M, N, x_batches, w_batches;
  bool sorted;
  std::vector<QmmSegment> segs;
  ActType at;
  int scale_type;
  UserBuf x, perm, lhs, rhs, out;
  std::vector<UserBuf> wq, scales, biases;
};

// The plan eval_gpu runs (the GEMV or the tiled kernel: one launch per
// MB_QMM_MAX_SEGS segments), binding what eval_gpu binds (segment j of
// launch l at slots gather_qmv_*_slot(j)).
template <typename S, typename SC>
void run_gather(const GatherProblem& g, const simt::Options& opt) {
  const bool tiled = gather_tiled(g.pairs, g.M, g.sorted, g.w_batches);
  const auto plan =
      tiled ? plan_gather(g.pairs, g.M, g.N, g.x_batches, g.w_batches, g.segs, g.at,
                          g.scale_type, g.perm.in != nullptr, g.sorted)
            : plan_gather_qmv(g.pairs, g.M, g.N, g.x_batches, g.w_batches, g.segs, g.at,
                              g.scale_type, g.perm.in != nullptr, g.sorted);
  std::vector<float> acc_sink(qmm_needs_acc(g.segs.size())
                                  ? size_t(g.pairs) * size_t(g.M) * size_t(g.N) : 0);
  Buffers bufs({MB_GQMV_X, MB_GQMV_PERM, MB_GQMV_LHS, MB_GQMV_RHS, MB_GQMV_ACC, MB_GQMV_OUT});
  for (const GatherLaunch& l : plan) {
    std::vector<UserBuf> user(MB_GQMV_PARAMS);
    user[MB_GQMV_X] = g.x;
    user[MB_GQMV_PERM] = g.perm;
    user[MB_GQMV_LHS] = g.lhs;
    user[MB_GQMV_RHS] = g.rhs;
    for (int j = 0; j < l.params.q.nseg; ++j) {
      const size_t i = size_t(l.first_segment + j);
      user[size_t(gather_qmv_wq_slot(j))] = g.wq[i];
      user[size_t(gather_qmv_scales_slot(j))] = g.scales[i];
      user[size_t(gather_qmv_biases_slot(j))] = g.biases[i];
    }
    if (!acc_sink.empty()) user[MB_GQMV_ACC] = {nullptr, acc_sink.data(), acc_sink.size() * 4};
    user[MB_GQMV_OUT] = g.out;
    const std::vector<void*> p = bufs.bind(l, user);
    MbGatherFusedParams params = l.params;
    const auto* xs = static_cast<const S*>(p[MB_GQMV_X]);
    const auto* pp = static_cast<const int32_t*>(p[MB_GQMV_PERM]);
    const auto* li = static_cast<const uint32_t*>(p[MB_GQMV_LHS]);
    const auto* ri = static_cast<const uint32_t*>(p[MB_GQMV_RHS]);
    auto* acc = static_cast<float*>(p[MB_GQMV_ACC]);
    auto* y = static_cast<S*>(p[MB_GQMV_OUT]);
    const uint32_t* w[MB_QMM_MAX_SEGS];
    const SC* sc[MB_QMM_MAX_SEGS];
    const SC* bi[MB_QMM_MAX_SEGS];
    for (int j = 0; j < MB_QMM_MAX_SEGS; ++j) {
      w[j] = static_cast<const uint32_t*>(p[size_t(gather_qmv_wq_slot(j))]);
      sc[j] = static_cast<const SC*>(p[size_t(gather_qmv_scales_slot(j))]);
      bi[j] = static_cast<const SC*>(p[size_t(gather_qmv_biases_slot(j))]);
    }
    // Threadgroup memory starts as NaN for every group: a read before a
    // write shows up in the results.
    Guarded smem(std::max<size_t>(l.threadgroup_bytes, 4));
    smem.threadgroup_space();
    simt::Options o = opt;
    o.label = l.kernel;
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
#define MB_GATHER_ARGS                                                                       \
  xs, pp, li, ri, acc, y, w[0], sc[0], bi[0], w[1], sc[1], bi[1], w[2], sc[2], bi[2], w[3],   \
      sc[3], bi[3], w[4], sc[4], bi[4], w[5], sc[5], bi[5], w[6], sc[6], bi[6], w[7], sc[7],  \
      bi[7], params, smem.as<float>(), u3(t.threadgroup_position_in_grid),                    \
      t.thread_index_in_threadgroup, t.simdgroup_index_in_threadgroup
    if (l.tiled) {
      auto* fn = simt::find_kernel<GatherTiledFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) { fn(MB_GATHER_ARGS); }, o);
    } else {
      auto* fn = simt::find_kernel<GatherFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) {
            fn(MB_GATHER_ARGS, t.thread_index_in_simdgroup, t.simdgroups_per_threadgroup);
          }, o);
    }
#undef MB_GATHER_ARGS
  }
  bufs.finish();
}

template <typename S>
void run_gather_x(const GatherProblem& g, const simt::Options& o) {
  if (g.scale_type == MB_SCALE_F32) run_gather<S, float>(g, o);
  else if (g.scale_type == MB_SCALE_F16) run_gather<S, half>(g, o);
  else run_gather<S, uint16_t>(g, o);
}

}  // namespace

extern "C" {

// MixedGatherQMM's inputs as the primitive holds them: x [x_batches, M, K]
// of xtype; perm int32 [K] or null; per segment the stacked wq, scales,
// biases (w_batches matrices of N rows); lhs, rhs uint32 [pairs]; out
// [pairs, M, N] of xtype; sorted: the node's sorted_indices. Sizes in bytes, checked against the launch's
// buffer description.
int mbemu_gather(int pairs, int M, int N, int x_batches, int w_batches, int nseg,
                     const int* bits, const int* group_size, const int* k, int xtype,
                     const void* x, size_t x_bytes, const int32_t* perm, size_t perm_bytes,
                     const void* const* wq, const size_t* wq_bytes,
                     const void* const* scales, const size_t* scales_bytes,
                     const void* const* biases, const size_t* biases_bytes, int scale_type,
                     const uint32_t* lhs, size_t lhs_bytes, const uint32_t* rhs,
                     size_t rhs_bytes, void* out, size_t out_bytes, int sorted, int order,
                     uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    GatherProblem g{pairs, M, N, x_batches, w_batches, sorted != 0, {}, ActType(xtype), scale_type,
                    {x, nullptr, x_bytes}, {perm, nullptr, perm ? perm_bytes : 0},
                    {lhs, nullptr, lhs_bytes}, {rhs, nullptr, rhs_bytes},
                    {nullptr, out, out_bytes}, {}, {}, {}};
    for (int i = 0; i < nseg; ++i) {
      g.segs.push_back({bits[i], group_size[i], k[i]});
      g.wq.push_back({wq[i], nullptr, wq_bytes[i]});
      g.scales.push_back({scales[i], nullptr, scales_bytes[i]});
      g.biases.push_back({biases[i], nullptr, biases_bytes[i]});
    }
    const simt::Options o = options(order, seed);
    if (xtype == 0) run_gather_x<float>(g, o);
    else if (xtype == 1) run_gather_x<half>(g, o);
    else run_gather_x<uint16_t>(g, o);
  }, err, errlen);
}

// The kernel eval_gpu launches for a problem of this shape (the plan's
// first launch; a 4-bit, group-32, float32 segment stands in) with
// w_batches experts.
int mbemu_gather_kernel(int pairs, int M, int sorted, int w_batches, char* name, int len,
                        char* err, int errlen) {
  return guarded_call([&] {
    const bool srt = sorted != 0;
    const std::string k =
        gather_tiled(pairs, M, srt, w_batches)
            ? plan_gather(pairs, M, 8, 1, w_batches, {{4, 32, 32}}, ActType(0), MB_SCALE_F32,
                          false, srt).at(0).kernel
            : plan_gather_qmv(pairs, M, 8, 1, w_batches, {{4, 32, 32}}, ActType(0),
                              MB_SCALE_F32, false, srt).at(0).kernel;
    std::snprintf(name, size_t(len), "%s", k.c_str());
  }, err, errlen);
}

}  // extern "C"
