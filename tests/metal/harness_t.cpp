// C entry point for the transposed quantized matmul (metal/qmatmul_t.metal)
// on the SIMT emulator, launched as MixedQMatmulT::eval_gpu launches it:
// the plan (perm check, one product per segment, unpermute) comes from
// metal/qmatmul_t_host.h and the buffers are allocated, checked and bound
// from its description (harness_core.h; rules in harness.cpp). The three
// scratch buffers are eval_gpu's temporaries; here they are shared between
// the launches and start as NaN / 0xff bytes, so a value one launch
// forgets to write shows in the next.
#include "qmatmul_t_host.h"
#include "harness_core.h"

namespace {

using namespace mixbits::metal_host;

template <typename S, typename SC>
using ProductFn = void(const S*, const uint32_t*, const SC*, const SC*, float*, S*,
                       MbQmvTParams&, float*, uint3, uint);
using CheckFn = void(const int32_t*, int32_t*, int32_t*, MbQmvTParams&, int32_t*, uint);
template <typename S>
using UnpermuteFn = void(const int32_t*, const int32_t*, const int32_t*, const float*, S*,
                         MbQmvTParams&, uint3, uint);

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
  int K = 0;
  for (const auto& s : t.segs) K += s.k;
  std::vector<int32_t> inv(has_perm ? K : 0), status(has_perm ? 1 : 0);
  std::vector<float> z(has_perm ? size_t(t.M) * size_t(K) : 0);
  auto sink = [](auto& v) {
    return UserBuf{v.data(), v.data(), v.size() * sizeof(v[0])};
  };
  Buffers bufs({MB_QT_DY, MB_QT_PERM, MB_QT_INV, MB_QT_STATUS, MB_QT_Z, MB_QT_OUT});
  for (const QtLaunch& l : plan) {
    std::vector<UserBuf> user(MB_QT_PARAMS);
    const auto used = [&](int i) { return l.buffers[size_t(i)].used(); };
    if (used(MB_QT_DY)) user[MB_QT_DY] = t.dy;
    if (used(MB_QT_PERM)) user[MB_QT_PERM] = t.perm;
    if (l.kind == QtKind::Product && used(MB_QT_WQ)) {
      user[MB_QT_WQ] = t.wq[size_t(l.segment)];
      user[MB_QT_SCALES] = t.scales[size_t(l.segment)];
      user[MB_QT_BIASES] = t.biases[size_t(l.segment)];
    }
    if (used(MB_QT_INV)) user[MB_QT_INV] = sink(inv);
    if (used(MB_QT_STATUS)) user[MB_QT_STATUS] = sink(status);
    if (used(MB_QT_Z)) user[MB_QT_Z] = sink(z);
    if (used(MB_QT_OUT)) user[MB_QT_OUT] = t.out;
    const std::vector<void*> p = bufs.bind(l, user);
    Guarded smem(std::max<size_t>(l.threadgroup_bytes, 4));
    smem.threadgroup_space();
    MbQmvTParams params = l.params;
    simt::Options o = opt;
    o.label = l.kernel;
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
    auto* perm = static_cast<int32_t*>(p[MB_QT_PERM]);
    auto* inv_p = static_cast<int32_t*>(p[MB_QT_INV]);
    auto* st_p = static_cast<int32_t*>(p[MB_QT_STATUS]);
    auto* z_p = static_cast<float*>(p[MB_QT_Z]);
    auto* out = static_cast<S*>(p[MB_QT_OUT]);
    if (l.kind == QtKind::PermCheck) {
      auto* fn = simt::find_kernel<CheckFn>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(perm, inv_p, st_p, params, smem.as<int32_t>(), i.thread_index_in_threadgroup);
      }, o);
    } else if (l.kind == QtKind::Product) {
      auto* fn = simt::find_kernel<ProductFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(static_cast<const S*>(p[MB_QT_DY]), static_cast<const uint32_t*>(p[MB_QT_WQ]),
           static_cast<const SC*>(p[MB_QT_SCALES]), static_cast<const SC*>(p[MB_QT_BIASES]),
           z_p, out, params, smem.as<float>(), u3(i.threadgroup_position_in_grid),
           i.thread_index_in_threadgroup);
      }, o);
    } else {
      auto* fn = simt::find_kernel<UnpermuteFn<S>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
        fn(perm, inv_p, st_p, z_p, out, params, u3(i.threadgroup_position_in_grid),
           i.thread_index_in_threadgroup);
      }, o);
    }
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
