// C entry point for the fp-mode GEMV (metal/fp_qmv.metal) on the SIMT
// emulator, launched as FpQMatmul::eval_gpu launches it: the launch (kernel
// name, grid, parameters, buffers) comes from metal/fp_qmv_host.h and the
// buffers are allocated, checked and bound from its description
// (harness_core.h; rules in harness.cpp).
#include "fp_qmv_host.h"
#include "harness_core.h"

namespace {

using namespace mixbits::metal_host;

template <typename S>
using FpQmvFn = void(const S*, const uint32_t*, const uint8_t*, S*, MbFpQmvParams&, uint3, uint,
                     uint);

template <typename S>
void run_fp(const FpQmvLaunch& l, const std::vector<UserBuf>& user, const simt::Options& opt) {
  Buffers bufs({});
  const std::vector<void*> p = bufs.bind(l, user);
  MbFpQmvParams params = l.params;
  simt::Options o = opt;
  o.label = l.kernel;
  auto* fn = simt::find_kernel<FpQmvFn<S>>(l.kernel);
  simt::dispatch_threadgroups(dim(l.grid), dim(l.group), [&](const simt::ThreadIds& i) {
    fn(static_cast<const S*>(p[MB_FPQ_X]), static_cast<const uint32_t*>(p[MB_FPQ_WQ]),
       static_cast<const uint8_t*>(p[MB_FPQ_SCALES]), static_cast<S*>(p[MB_FPQ_OUT]), params,
       u3(i.threadgroup_position_in_grid), i.simdgroup_index_in_threadgroup,
       i.thread_index_in_simdgroup);
  }, o);
  bufs.finish();
}

}  // namespace

extern "C" {

// FpQMatmul's inputs as the primitive holds them: x [M, K] of xtype (0
// float32, 1 float16, 2 bfloat16), wq uint32 [N, K*bits/32], scales uint8
// [N, K/group]; out [M, N] of xtype. Sizes in bytes, checked against the
// launch's buffer description.
int mbemu_fp_qmv(int M, int N, int K, int mode, int xtype, const void* x, size_t x_bytes,
                 const void* wq, size_t wq_bytes, const void* scales, size_t scales_bytes,
                 void* out, size_t out_bytes, int order, uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    const FpQmvLaunch l = plan_fp_qmv(M, N, K, mode, ActType(xtype));
    std::vector<UserBuf> user(MB_FPQ_PARAMS);
    user[MB_FPQ_X] = {x, nullptr, x_bytes};
    user[MB_FPQ_WQ] = {wq, nullptr, wq_bytes};
    user[MB_FPQ_SCALES] = {scales, nullptr, scales_bytes};
    user[MB_FPQ_OUT] = {nullptr, out, out_bytes};
    const simt::Options o = options(order, seed);
    if (xtype == 0) run_fp<float>(l, user, o);
    else if (xtype == 1) run_fp<half>(l, user, o);
    else run_fp<uint16_t>(l, user, o);
  }, err, errlen);
}

// The kernel FpQMatmul::eval_gpu launches (name into `name`), or an error
// when the GEMV does not take the problem.
int mbemu_fp_qmv_kernel(int M, int N, int K, int mode, int xtype, char* name, int namelen,
                        char* err, int errlen) {
  return guarded_call([&] {
    const std::string n = plan_fp_qmv(M, N, K, mode, ActType(xtype)).kernel;
    std::snprintf(name, size_t(namelen), "%s", n.c_str());
  }, err, errlen);
}

}  // extern "C"
