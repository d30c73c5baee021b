// C entry point for the transposed quantized matmul (metal/qmatmul_t.metal)
// on the SIMT emulator, launched as MixedQMatmulT::eval_gpu launches it:
// the plan (one launch: every segment, the permutation) comes from
// metal/qmatmul_t_host.h and the buffers are allocated, checked and bound
// from its description (harness_core.h; rules in harness.cpp). dx starts
// poisoned, so an element the kernel forgets to write fails the run.
#include "qmatmul_t_host.h"
#include "harness_core.h"

namespace {

using namespace mixbits::metal_host;

// The kernel's parameters in order: dy, perm, out, three per segment, the
// parameter block, threadgroup memory, then (group, thread, lane) ids.
#define MB_SEG_PARAMS(SC) const uint32_t*, const SC*, const SC*
template <typename S, typename SC>
using ProductFn = void(const S*, const int32_t*, S*, MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                       MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                       MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC), MB_SEG_PARAMS(SC),
                       MbQmmFusedParams&, float*, uint3, uint, uint);
#undef MB_SEG_PARAMS
static_assert(MB_QMM_MAX_SEGS == 8, "the kernel's type above lists 8 segments");

struct TProblem {
  int M, N;
  std::vector<QmmSegment> segs;
  ActType at;
  int scale_type;
  UserBuf dy, perm, out;
  std::vector<UserBuf> wq, scales, biases;
};

template <typename S, typename SC>
void run_t(const TProblem& t, const simt::Options& opt) {
  const bool has_perm = t.perm.in != nullptr;
  const auto plan = plan_qmv_t(t.M, t.N, t.segs, t.at, t.scale_type, has_perm);
  Buffers bufs({MB_QT_DY, MB_QT_PERM, MB_QT_OUT});
  for (const QtLaunch& l : plan) {
    std::vector<UserBuf> user(MB_QT_PARAMS);
    const auto used = [&](int i) { return l.buffers[size_t(i)].used(); };
    if (used(MB_QT_DY)) user[MB_QT_DY] = t.dy;
    if (used(MB_QT_PERM)) user[MB_QT_PERM] = t.perm;
    for (int j = 0; j < l.params.nseg; ++j) {
      if (!used(qt_wq_slot(j))) continue;  // N = 0
      user[size_t(qt_wq_slot(j))] = t.wq[size_t(j)];
      user[size_t(qt_scales_slot(j))] = t.scales[size_t(j)];
      user[size_t(qt_biases_slot(j))] = t.biases[size_t(j)];
    }
    user[MB_QT_OUT] = t.out;
    const std::vector<void*> p = bufs.bind(l, user);
    Guarded smem(std::max<size_t>(l.threadgroup_bytes, 4));
    smem.threadgroup_space();
    MbQmmFusedParams params = l.params;
    simt::Options o = opt;
    o.label = l.kernel;
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
    const uint32_t* w[MB_QMM_MAX_SEGS];
    const SC* sc[MB_QMM_MAX_SEGS];
    const SC* bi[MB_QMM_MAX_SEGS];
    for (int j = 0; j < MB_QMM_MAX_SEGS; ++j) {
      w[j] = static_cast<const uint32_t*>(p[size_t(qt_wq_slot(j))]);
      sc[j] = static_cast<const SC*>(p[size_t(qt_scales_slot(j))]);
      bi[j] = static_cast<const SC*>(p[size_t(qt_biases_slot(j))]);
    }
    const auto* dy = static_cast<const S*>(p[MB_QT_DY]);
    const auto* perm = static_cast<const int32_t*>(p[MB_QT_PERM]);
    auto* out = static_cast<S*>(p[MB_QT_OUT]);
    auto* fn = simt::find_kernel<ProductFn<S, SC>>(l.kernel);
    simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
      fn(dy, perm, out, w[0], sc[0], bi[0], w[1], sc[1], bi[1], w[2], sc[2], bi[2], w[3], sc[3],
         bi[3], w[4], sc[4], bi[4], w[5], sc[5], bi[5], w[6], sc[6], bi[6], w[7], sc[7], bi[7],
         params, smem.as<float>(), u3(i.threadgroup_position_in_grid),
         i.thread_index_in_threadgroup, i.thread_index_in_simdgroup);
    }, o);
  }
  bufs.finish();
}

template <typename S>
void run_t_x(const TProblem& t, const simt::Options& o) {
  if (t.scale_type == MB_SCALE_F32) run_t<S, float>(t, o);
  else if (t.scale_type == MB_SCALE_F16) run_t<S, half>(t, o);
  else run_t<S, uint16_t>(t, o);
}

}  // namespace

extern "C" {

// MixedQMatmulT's inputs as the primitive holds them: dy [M, N] of xtype;
// perm int32 [K] or null; per segment wq, scales, biases of N rows; out
// [M, K] of xtype. Sizes in bytes, checked against the launch's buffer
// description.
int mbemu_qmv_t(int M, int N, int nseg, const int* bits, const int* group_size, const int* k,
                int xtype, const void* dy, size_t dy_bytes, const int32_t* perm,
                size_t perm_bytes, const void* const* wq, const size_t* wq_bytes,
                const void* const* scales, const size_t* scales_bytes,
                const void* const* biases, const size_t* biases_bytes, int scale_type,
                void* out, size_t out_bytes, int order, uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    TProblem t{M, N, {}, ActType(xtype), scale_type, {dy, nullptr, dy_bytes},
               {perm, nullptr, perm ? perm_bytes : 0}, {nullptr, out, out_bytes}, {}, {}, {}};
    for (int i = 0; i < nseg; ++i) {
      t.segs.push_back({bits[i], group_size[i], k[i]});
      t.wq.push_back({wq[i], nullptr, wq_bytes[i]});
      t.scales.push_back({scales[i], nullptr, scales_bytes[i]});
      t.biases.push_back({biases[i], nullptr, biases_bytes[i]});
    }
    const simt::Options o = options(order, seed);
    if (xtype == 0) run_t_x<float>(t, o);
    else if (xtype == 1) run_t_x<half>(t, o);
    else run_t_x<uint16_t>(t, o);
  }, err, errlen);
}

}  // extern "C"
