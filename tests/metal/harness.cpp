// C entry points (loaded with ctypes by the tests) that launch the Metal
// kernels on the SIMT emulator exactly as the Mac host code does: the
// launch plans come from metal/qmatmul_host.h and metal/kl_host.h, the
// kernels are looked up by their [[host_name]], buffers are bound by index.
//
// Every buffer a kernel sees is a copy placed so that it ends at a
// PROT_NONE page: reading or writing past its end faults. Outputs and
// threadgroup memory start as NaN, so an element a kernel forgets to
// write, or a threadgroup slot read before it is written, shows.
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kl_host.h"
#include "qmatmul_host.h"
#include "simt.h"
// Last: defines the address-space macros.
#include "metal_compat.h"

namespace {

using namespace mixbits::metal_host;

class Guarded {
 public:
  explicit Guarded(size_t bytes) : bytes_(bytes) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t body = (bytes + page - 1) / page * page;
    total_ = body + page;
    void* p = mmap(nullptr, total_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("harness: mmap failed");
    base_ = static_cast<char*>(p);
    mprotect(base_ + body, page, PROT_NONE);
    data_ = base_ + body - bytes;
  }
  Guarded(size_t bytes, const void* src) : Guarded(bytes) {
    if (bytes) std::memcpy(data_, src, bytes);
  }
  ~Guarded() { munmap(base_, total_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  template <typename T>
  T* as() { return reinterpret_cast<T*>(data_); }
  void fill_nan_f32() {
    float* f = as<float>();
    for (size_t i = 0; i < bytes_ / 4; ++i) f[i] = std::numeric_limits<float>::quiet_NaN();
  }
  void fill_bytes(unsigned char v) { std::memset(data_, v, bytes_); }
  size_t bytes() const { return bytes_; }

 private:
  char* base_ = nullptr;
  char* data_ = nullptr;
  size_t bytes_ = 0, total_ = 0;
};

simt::Options options(int order, uint64_t seed) {
  simt::Options o;
  o.order = order == 0 ? simt::Order::Forward
          : order == 1 ? simt::Order::Reverse
                       : simt::Order::Shuffle;
  o.seed = seed;
  return o;
}

simt::Dim3 dim(const uint32_t v[3]) { return {v[0], v[1], v[2]}; }
uint3 u3(const simt::Dim3& d) { return uint3(d.x, d.y, d.z); }

int report(const char* msg, char* err, int errlen) {
  if (err && errlen > 0) {
    std::strncpy(err, msg, size_t(errlen) - 1);
    err[errlen - 1] = 0;
  }
  return 1;
}

// A kernel that touches a guard page raises SIGSEGV; instead of taking the
// test process down, the handler jumps back to the entry point, which
// reports the fault as an error (the interrupted launch's memory leaks).
thread_local sigjmp_buf* g_fault_jump = nullptr;
thread_local void* g_fault_addr = nullptr;

void on_fault(int sig, siginfo_t* si, void*) {
  if (g_fault_jump) {
    g_fault_addr = si->si_addr;
    siglongjmp(*g_fault_jump, 1);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

template <typename F>
int guarded_call(F&& f, char* err, int errlen) {
  static thread_local std::vector<char> altstack(1 << 16);
  stack_t ss{}, old_ss{};
  ss.ss_sp = altstack.data();
  ss.ss_size = altstack.size();
  sigaltstack(&ss, &old_ss);  // the fault may be a fiber stack overflow
  struct sigaction sa{}, old_segv{}, old_bus{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigjmp_buf jb;
  volatile int rc = 0;
  if (sigsetjmp(jb, 1) == 0) {
    g_fault_jump = &jb;
    try {
      f();
    } catch (const std::exception& e) {
      rc = report(e.what(), err, errlen);
    }
  } else {
    simt::abandon_dispatch();
    char msg[160];
    std::snprintf(msg, sizeof msg,
                  "kernel accessed memory out of bounds (fault at %p, a guard "
                  "page after a buffer or a fiber stack)", g_fault_addr);
    rc = report(msg, err, errlen);
  }
  g_fault_jump = nullptr;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaltstack(&old_ss, nullptr);
  return rc;
}

// ---- qmatmul ---------------------------------------------------------------

template <typename S>
using QmvFn = void(const S*, const int32_t*, const uint32_t*, const uint8_t*,
                   const uint8_t*, float*, S*, MbQmmParams&, uint3, uint, uint);
template <typename S>
using QmmFn = void(const S*, const int32_t*, const uint32_t*, const uint8_t*,
                   const uint8_t*, float*, S*, MbQmmParams&, float*, uint3,
                   uint);

template <typename S>
void run_qmm(int M, int N, const std::vector<QmmSegment>& segs, ActType at,
             const void* x, const int32_t* perm, const uint32_t* const* wq,
             const void* const* scales, const void* const* biases,
             int scale_type, void* out, QmmPath path, const simt::Options& opt) {
  int K = 0;
  for (const auto& s : segs) K += s.k;
  const size_t sbytes = scale_type == MB_SCALE_F32 ? 4 : 2;
  Guarded gx(size_t(M) * K * sizeof(S), x);
  std::unique_ptr<Guarded> gp;
  if (perm) gp = std::make_unique<Guarded>(size_t(K) * 4, perm);
  Guarded gout(size_t(M) * N * sizeof(S));
  gout.fill_bytes(0xff);  // NaN in every float format
  std::unique_ptr<Guarded> gacc;
  if (qmm_needs_acc(segs.size())) {
    gacc = std::make_unique<Guarded>(size_t(M) * N * 4);
    gacc->fill_nan_f32();
  }
  Guarded smem(size_t(MB_QMM_TG_FLOATS) * 4);

  const auto plan = plan_qmm(M, N, segs, at, scale_type, perm != nullptr, path);
  for (const QmmLaunch& l : plan) {
    const QmmSegment& s = segs[l.segment];
    const size_t words = size_t(N) * s.k * s.bits / 32;
    const size_t groups = size_t(N) * (s.k / s.group_size);
    Guarded gw(words * 4, wq[l.segment]);
    Guarded gs(groups * sbytes, scales[l.segment]);
    Guarded gb(groups * sbytes, biases[l.segment]);
    MbQmmParams p = l.params;
    // Unbound-in-Metal slots get another buffer of the launch, as the host does.
    const int32_t* pp = gp ? gp->as<int32_t>() : reinterpret_cast<const int32_t*>(gx.as<S>());
    float* acc = gacc ? gacc->as<float>() : reinterpret_cast<float*>(gout.as<S>());
    simt::Options o = opt;
    if (l.threadgroup_bytes > smem.bytes())
      throw std::runtime_error("harness: threadgroup memory larger than planned");
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
    if (l.tiled) {
      auto* fn = simt::find_kernel<QmmFn<S>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) {
            fn(gx.as<S>(), pp, gw.as<uint32_t>(), gs.as<uint8_t>(),
               gb.as<uint8_t>(), acc, gout.as<S>(), p, smem.as<float>(),
               u3(t.threadgroup_position_in_grid), t.thread_index_in_threadgroup);
          }, o);
    } else {
      auto* fn = simt::find_kernel<QmvFn<S>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) {
            fn(gx.as<S>(), pp, gw.as<uint32_t>(), gs.as<uint8_t>(),
               gb.as<uint8_t>(), acc, gout.as<S>(), p,
               u3(t.threadgroup_position_in_grid),
               t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
          }, o);
    }
  }
  std::memcpy(out, gout.as<S>(), gout.bytes());
}

// ---- KL ----------------------------------------------------------------------

template <typename SA, typename SB>
using KlFn = void(const SA*, const SB*, const float*, float*, int32_t*,
                  int32_t*, float*, int32_t*, float*, MbKlParams&, float*,
                  uint3, uint, uint, uint, uint, uint);

template <typename SA, typename SB>
void run_kl(int rows, int V, ActType ta, ActType tb, int mode, const void* a,
            const void* b, const float* row_param, int threads, float* kl,
            int32_t* status, int32_t* arg_q, float* lse_q, int32_t* arg_ref,
            float* lse_ref, const simt::Options& opt) {
  const KlLaunch l = plan_kl(rows, V, ta, tb, mode, threads);
  Guarded ga(size_t(rows) * V * sizeof(SA), a);
  Guarded gb(size_t(rows) * V * sizeof(SB), b);
  std::unique_ptr<Guarded> gp;
  if (row_param) gp = std::make_unique<Guarded>(size_t(rows) * 4, row_param);
  // Unused row parameter: Metal binds the reference buffer there.
  const float* pp = gp ? gp->as<float>() : reinterpret_cast<const float*>(ga.as<SA>());
  Guarded gkl(size_t(rows) * 4), glq(size_t(rows) * 4), glr(size_t(rows) * 4);
  Guarded gaq(size_t(rows) * 4), gar(size_t(rows) * 4), gst(size_t(rows) * 4);
  for (Guarded* g : {&gkl, &glq, &glr}) g->fill_nan_f32();
  for (Guarded* g : {&gaq, &gar, &gst}) g->fill_bytes(0xab);
  Guarded smem(l.threadgroup_bytes);
  MbKlParams p = l.params;
  auto* fn = simt::find_kernel<KlFn<SA, SB>>(l.kernel);
  simt::Options o = opt;
  o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
  simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
      [&](const simt::ThreadIds& t) {
        fn(ga.as<SA>(), gb.as<SB>(), pp, gkl.as<float>(), gst.as<int32_t>(),
           gaq.as<int32_t>(), glq.as<float>(), gar.as<int32_t>(),
           glr.as<float>(), p, smem.as<float>(),
           u3(t.threadgroup_position_in_grid), t.thread_index_in_threadgroup,
           t.threads_per_threadgroup.x, t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup, t.simdgroups_per_threadgroup);
      }, o);
  std::memcpy(kl, gkl.as<float>(), size_t(rows) * 4);
  std::memcpy(status, gst.as<int32_t>(), size_t(rows) * 4);
  std::memcpy(arg_q, gaq.as<int32_t>(), size_t(rows) * 4);
  std::memcpy(lse_q, glq.as<float>(), size_t(rows) * 4);
  std::memcpy(arg_ref, gar.as<int32_t>(), size_t(rows) * 4);
  std::memcpy(lse_ref, glr.as<float>(), size_t(rows) * 4);
}

template <typename SA>
void run_kl_b(ActType tb, int rows, int V, ActType ta, int mode, const void* a,
              const void* b, const float* rp, int threads, float* o0,
              int32_t* o1, int32_t* o2, float* o3, int32_t* o4, float* o5,
              const simt::Options& opt) {
  if (tb == ActType::F32)
    run_kl<SA, float>(rows, V, ta, tb, mode, a, b, rp, threads, o0, o1, o2, o3, o4, o5, opt);
  else if (tb == ActType::F16)
    run_kl<SA, half>(rows, V, ta, tb, mode, a, b, rp, threads, o0, o1, o2, o3, o4, o5, opt);
  else
    run_kl<SA, uint16_t>(rows, V, ta, tb, mode, a, b, rp, threads, o0, o1, o2, o3, o4, o5, opt);
}

// ---- selftest kernels -----------------------------------------------------------

using StFn = void(const float*, float*, float*, uint3, uint, uint, uint, uint);

}  // namespace

extern "C" {

// x: [M, K] of act type xtype (0 f32, 1 f16, 2 bf16); perm: int32 [K] or
// null; per segment wq/scales/biases; out: [M, N] of xtype.
// path: 0 auto, 1 GEMV, 2 tiled. order: 0 forward, 1 reverse, 2 shuffle.
int mbemu_qmm(int M, int N, int nseg, const int* bits, const int* group_size,
              const int* k, int xtype, const void* x, const int32_t* perm,
              const uint32_t* const* wq, const void* const* scales,
              const void* const* biases, int scale_type, void* out, int path,
              int order, uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    std::vector<QmmSegment> segs;
    for (int i = 0; i < nseg; ++i) segs.push_back({bits[i], group_size[i], k[i]});
    const simt::Options o = options(order, seed);
    const auto p = QmmPath(path);
    const auto at = ActType(xtype);
    if (xtype == 0)
      run_qmm<float>(M, N, segs, at, x, perm, wq, scales, biases, scale_type, out, p, o);
    else if (xtype == 1)
      run_qmm<half>(M, N, segs, at, x, perm, wq, scales, biases, scale_type, out, p, o);
    else
      run_qmm<uint16_t>(M, N, segs, at, x, perm, wq, scales, biases, scale_type, out, p, o);
  }, err, errlen);
}

// a: [rows, V] of type ta, b: [rows, V] of type tb (0 f32, 1 f16, 2 bf16);
// row_param: float32 [rows] or null; outputs in the primitive's order.
int mbemu_kl(int rows, int V, int ta, int tb, int mode, const void* a,
             const void* b, const float* row_param, int threads, float* kl,
             int32_t* status, int32_t* arg_q, float* lse_q, int32_t* arg_ref,
             float* lse_ref, int order, uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    const simt::Options o = options(order, seed);
    const auto a_t = ActType(ta), b_t = ActType(tb);
    if (a_t == ActType::F32)
      run_kl_b<float>(b_t, rows, V, a_t, mode, a, b, row_param, threads, kl, status, arg_q, lse_q, arg_ref, lse_ref, o);
    else if (a_t == ActType::F16)
      run_kl_b<half>(b_t, rows, V, a_t, mode, a, b, row_param, threads, kl, status, arg_q, lse_q, arg_ref, lse_ref, o);
    else
      run_kl_b<uint16_t>(b_t, rows, V, a_t, mode, a, b, row_param, threads, kl, status, arg_q, lse_q, arg_ref, lse_ref, o);
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
    simt::Options o = options(order, seed);
    o.group_start = [&](const simt::Dim3&) { tg.fill_nan_f32(); };
    simt::dispatch_threadgroups({uint32_t(groups), 1, 1}, {uint32_t(threads), 1, 1},
        [&](const simt::ThreadIds& t) {
          fn(gin.as<float>(), gout.as<float>(), tg.as<float>(),
             u3(t.threadgroup_position_in_grid), t.thread_index_in_threadgroup,
             t.threads_per_threadgroup.x, t.simdgroup_index_in_threadgroup,
             t.thread_index_in_simdgroup);
        }, o);
    std::memcpy(out, gout.as<float>(), size_t(out_len) * 4);
  }, err, errlen);
}

// Every [[host_name]] the libraries registered (for the name checks).
int mbemu_kernel_count() { return int(simt::kernel_count()); }

}  // extern "C"
