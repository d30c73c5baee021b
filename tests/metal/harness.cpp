// C entry points (loaded with ctypes by the tests) that launch the Metal
// kernels on the SIMT emulator exactly as the Mac host code does: the
// launch plans come from metal/qmatmul_host.h, metal/gather_host.h and
// metal/kl_host.h, the
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
#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gather_host.h"
#include "kl_host.h"
#include "qmatmul_host.h"
#include "simt.h"
// Last: defines the address-space macros.
#include "metal_compat.h"

namespace {

using namespace mixbits::metal_host;

class Guarded {
 public:
  // `align` > 1: start aligned to it, the slack up to the guard page filled
  // with a canary (see canary_intact).
  explicit Guarded(size_t bytes, size_t align = 1) : bytes_(bytes) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t span = (bytes + align - 1) / align * align;
    const size_t body = (span + page - 1) / page * page;
    total_ = body + page;
    void* p = mmap(nullptr, total_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("harness: mmap failed");
    base_ = static_cast<char*>(p);
    mprotect(base_ + body, page, PROT_NONE);
    data_ = base_ + body - span;
    slack_ = span - bytes;
    std::memset(data_ + bytes, kCanary, slack_);
  }
  Guarded(size_t bytes, const void* src) : Guarded(bytes) {
    if (bytes) std::memcpy(data_, src, bytes);
  }
  ~Guarded() { munmap(base_, total_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  template <typename T>
  T* as() { return reinterpret_cast<T*>(data_); }
  void* data() { return data_; }
  void fill_nan_f32() {
    float* f = as<float>();
    for (size_t i = 0; i < bytes_ / 4; ++i) f[i] = std::numeric_limits<float>::quiet_NaN();
  }
  void fill_bytes(unsigned char v) { std::memset(data_, v, bytes_); }
  size_t bytes() const { return bytes_; }
  bool canary_intact() const {
    for (size_t i = 0; i < slack_; ++i)
      if (static_cast<unsigned char>(data_[bytes_ + i]) != kCanary) return false;
    return true;
  }

 private:
  static constexpr unsigned char kCanary = 0x5a;
  char* base_ = nullptr;
  char* data_ = nullptr;
  size_t bytes_ = 0, total_ = 0, slack_ = 0;
};

// What the caller (Python) supplies for one buffer index: input data, or
// where an output goes; `bytes` its size. Null for a slot it leaves empty.
struct UserBuf {
  const void* in = nullptr;
  void* out = nullptr;
  size_t bytes = 0;
};

// The buffers of a sequence of launches, built from their descriptions.
// Buffers listed in `shared` (x, acc, out ... of a multi-dispatch matmul)
// are allocated once and seen by every launch; the others per launch.
class Buffers {
 public:
  explicit Buffers(std::vector<int> shared) : shared_(std::move(shared)) {}

  // Pointers by buffer index for launch `l`, given the caller's buffers
  // for this launch by index.
  std::vector<void*> bind(const Launch& l, const std::vector<UserBuf>& user) {
    per_launch_.clear();
    std::vector<void*> ptr(l.buffers.size(), nullptr);
    for (const BufferArg& b : l.buffers) {
      const UserBuf u = size_t(b.index) < user.size() ? user[size_t(b.index)] : UserBuf{};
      if (!b.used()) {
        if (u.in || u.out)
          fail(l, b, "the caller supplies data for a slot this launch does not use");
        continue;
      }
      const size_t want = b.count * elem_bytes(b.elem);
      if (u.bytes != want || (b.dir == Dir::In ? !u.in : !u.out))
        fail(l, b, "the caller supplies " + std::to_string(u.bytes) + " bytes, the launch binds " +
                       std::to_string(want));
      Guarded* g = nullptr;
      if (is_shared(b.index) && shared_bufs_.count(b.index)) {
        g = shared_bufs_[b.index].get();
        if (g->bytes() != want) fail(l, b, "differs from an earlier launch's");
      } else {
        auto fresh = b.dir == Dir::In ? std::make_unique<Guarded>(want, u.in)
                                      : std::make_unique<Guarded>(want, 16);
        if (b.dir == Dir::Out) {
          if (b.elem == Elem::F32) fresh->fill_nan_f32();
          else fresh->fill_bytes(0xff);  // NaN in f16/bf16; -1 in ints
          outputs_.push_back({fresh.get(), u.out});
        }
        g = fresh.get();
        if (is_shared(b.index)) shared_bufs_[b.index] = std::move(fresh);
        else if (b.dir == Dir::Out) owned_outputs_.push_back(std::move(fresh));
        else per_launch_.push_back(std::move(fresh));
      }
      ptr[size_t(b.index)] = g->data();
    }
    for (const BufferArg& b : l.buffers) {
      if (!b.used()) {
        if (b.stand_in < 0 || !ptr[size_t(b.stand_in)])
          fail(l, b, "unused slot without a bound stand-in");
        ptr[size_t(b.index)] = ptr[size_t(b.stand_in)];
      }
      if (reinterpret_cast<uintptr_t>(ptr[size_t(b.index)]) % elem_bytes(b.elem) != 0)
        fail(l, b, "bound at an address not aligned for its element type");
    }
    return ptr;
  }

  // After the last launch: every output back to the caller.
  void finish() {
    for (auto& [g, dst] : outputs_) {
      if (!g->canary_intact())
        throw std::runtime_error("harness: a kernel wrote past the end of an output");
      std::memcpy(dst, g->data(), g->bytes());
    }
  }

 private:
  bool is_shared(int i) const {
    return std::find(shared_.begin(), shared_.end(), i) != shared_.end();
  }
  [[noreturn]] static void fail(const Launch& l, const BufferArg& b, const std::string& m) {
    throw std::runtime_error("harness: " + l.kernel + ": " + describe(b) + ": " + m);
  }
  std::vector<int> shared_;
  std::map<int, std::unique_ptr<Guarded>> shared_bufs_;
  std::vector<std::unique_ptr<Guarded>> per_launch_;
  std::vector<std::unique_ptr<Guarded>> owned_outputs_;
  std::vector<std::pair<Guarded*, void*>> outputs_;
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

// S: storage of x and out; SC: storage of scales and biases.
template <typename S, typename SC>
using QmvFn = void(const S*, const int32_t*, const uint32_t*, const SC*, const SC*,
                   float*, S*, MbQmmParams&, uint3, uint, uint);
template <typename S, typename SC>
using QmmFn = void(const S*, const int32_t*, const uint32_t*, const SC*, const SC*,
                   float*, S*, MbQmmParams&, float*, uint3, uint, uint);

// x, perm: user buffers; per segment wq/scales/biases; out receives [M, N].
template <typename S, typename SC>
void run_qmm(int M, int N, const std::vector<QmmSegment>& segs, ActType at,
             const UserBuf& x, const UserBuf& perm, const std::vector<UserBuf>& wq,
             const std::vector<UserBuf>& scales, const std::vector<UserBuf>& biases,
             int scale_type, const UserBuf& out, QmmPath path,
             const simt::Options& opt) {
  const auto plan = plan_qmm(M, N, segs, at, scale_type, perm.in != nullptr, path);
  // The partial sum is eval_gpu's own temporary; here too.
  std::vector<float> acc_sink(qmm_needs_acc(segs.size()) ? size_t(M) * N : 0);
  Buffers bufs({MB_QMM_X, MB_QMM_PERM, MB_QMM_ACC, MB_QMM_OUT});
  for (const QmmLaunch& l : plan) {
    std::vector<UserBuf> user(MB_QMM_PARAMS);
    user[MB_QMM_X] = x;
    user[MB_QMM_PERM] = perm;
    user[MB_QMM_WQ] = wq[size_t(l.segment)];
    user[MB_QMM_SCALES] = scales[size_t(l.segment)];
    user[MB_QMM_BIASES] = biases[size_t(l.segment)];
    if (!acc_sink.empty()) user[MB_QMM_ACC] = {nullptr, acc_sink.data(), acc_sink.size() * 4};
    user[MB_QMM_OUT] = out;
    const std::vector<void*> p = bufs.bind(l, user);
    Guarded smem(std::max<size_t>(l.threadgroup_bytes, 4));
    MbQmmParams params = l.params;
    simt::Options o = opt;
    o.group_start = [&](const simt::Dim3&) { smem.fill_nan_f32(); };
    auto* xs = static_cast<const S*>(p[MB_QMM_X]);
    auto* pp = static_cast<const int32_t*>(p[MB_QMM_PERM]);
    auto* w = static_cast<const uint32_t*>(p[MB_QMM_WQ]);
    auto* sc = static_cast<const SC*>(p[MB_QMM_SCALES]);
    auto* bi = static_cast<const SC*>(p[MB_QMM_BIASES]);
    auto* acc = static_cast<float*>(p[MB_QMM_ACC]);
    auto* y = static_cast<S*>(p[MB_QMM_OUT]);
    if (l.tiled) {
      auto* fn = simt::find_kernel<QmmFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) {
            fn(xs, pp, w, sc, bi, acc, y, params, smem.as<float>(),
               u3(t.threadgroup_position_in_grid), t.thread_index_in_threadgroup,
               t.simdgroup_index_in_threadgroup);
          }, o);
    } else {
      auto* fn = simt::find_kernel<QmvFn<S, SC>>(l.kernel);
      simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
          [&](const simt::ThreadIds& t) {
            fn(xs, pp, w, sc, bi, acc, y, params,
               u3(t.threadgroup_position_in_grid),
               t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
          }, o);
    }
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

// ---- gathered qmatmul --------------------------------------------------------

template <typename S, typename SC>
using GatherFn = void(const S*, const int32_t*, const uint32_t*, const SC*, const SC*,
                      const uint32_t*, const uint32_t*, float*, S*, MbGatherParams&, uint3,
                      uint, uint);

// The shapes of MixedGatherQMM's inputs, and the caller's buffers by index
// (MB_GATHER_X .. MB_GATHER_OUT) with one wq/scales/biases per segment.
struct GatherProblem {
  int pairs, M, N, x_batches, w_batches;
  std::vector<QmmSegment> segs;
  ActType at;
  int scale_type;
  UserBuf x, perm, lhs, rhs, out;
  std::vector<UserBuf> wq, scales, biases;
};

template <typename S, typename SC>
void run_gather(const GatherProblem& g, const simt::Options& opt) {
  const auto plan = plan_gather_qmv(g.pairs, g.M, g.N, g.x_batches, g.w_batches, g.segs, g.at,
                                    g.scale_type, g.perm.in != nullptr);
  std::vector<float> acc_sink(qmm_needs_acc(g.segs.size())
                                  ? size_t(g.pairs) * size_t(g.M) * size_t(g.N) : 0);
  Buffers bufs({MB_GATHER_X, MB_GATHER_PERM, MB_GATHER_LHS, MB_GATHER_RHS, MB_GATHER_ACC,
                MB_GATHER_OUT});
  for (const GatherLaunch& l : plan) {
    const size_t i = size_t(l.segment);
    std::vector<UserBuf> user(MB_GATHER_PARAMS);
    user[MB_GATHER_X] = g.x;
    user[MB_GATHER_PERM] = g.perm;
    user[MB_GATHER_WQ] = g.wq[i];
    user[MB_GATHER_SCALES] = g.scales[i];
    user[MB_GATHER_BIASES] = g.biases[i];
    user[MB_GATHER_LHS] = g.lhs;
    user[MB_GATHER_RHS] = g.rhs;
    if (!acc_sink.empty()) user[MB_GATHER_ACC] = {nullptr, acc_sink.data(), acc_sink.size() * 4};
    user[MB_GATHER_OUT] = g.out;
    const std::vector<void*> p = bufs.bind(l, user);
    MbGatherParams params = l.params;
    auto* fn = simt::find_kernel<GatherFn<S, SC>>(l.kernel);
    simt::dispatch_threadgroups(dim(l.grid), dim(l.group),
        [&](const simt::ThreadIds& t) {
          fn(static_cast<const S*>(p[MB_GATHER_X]), static_cast<const int32_t*>(p[MB_GATHER_PERM]),
             static_cast<const uint32_t*>(p[MB_GATHER_WQ]),
             static_cast<const SC*>(p[MB_GATHER_SCALES]),
             static_cast<const SC*>(p[MB_GATHER_BIASES]),
             static_cast<const uint32_t*>(p[MB_GATHER_LHS]),
             static_cast<const uint32_t*>(p[MB_GATHER_RHS]),
             static_cast<float*>(p[MB_GATHER_ACC]), static_cast<S*>(p[MB_GATHER_OUT]), params,
             u3(t.threadgroup_position_in_grid), t.simdgroup_index_in_threadgroup,
             t.thread_index_in_simdgroup);
        }, opt);
  }
  bufs.finish();
}

template <typename S>
void run_gather_x(const GatherProblem& g, const simt::Options& o) {
  if (g.scale_type == MB_SCALE_F32) run_gather<S, float>(g, o);
  else if (g.scale_type == MB_SCALE_F16) run_gather<S, half>(g, o);
  else run_gather<S, uint16_t>(g, o);
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
  MbKlParams params = l.params;
  auto* fn = simt::find_kernel<KlFn<SA, SB>>(l.kernel);
  simt::Options o = opt;
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

// MixedGatherQMM's inputs as the primitive holds them: x [x_batches, M, K]
// of xtype; perm int32 [K] or null; per segment the stacked wq, scales,
// biases (w_batches matrices of N rows); lhs, rhs uint32 [pairs]; out
// [pairs, M, N] of xtype. Sizes in bytes, checked against the launch's
// buffer description.
int mbemu_gather_qmv(int pairs, int M, int N, int x_batches, int w_batches, int nseg,
                     const int* bits, const int* group_size, const int* k, int xtype,
                     const void* x, size_t x_bytes, const int32_t* perm, size_t perm_bytes,
                     const void* const* wq, const size_t* wq_bytes,
                     const void* const* scales, const size_t* scales_bytes,
                     const void* const* biases, const size_t* biases_bytes, int scale_type,
                     const uint32_t* lhs, size_t lhs_bytes, const uint32_t* rhs,
                     size_t rhs_bytes, void* out, size_t out_bytes, int order,
                     uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    GatherProblem g{pairs, M, N, x_batches, w_batches, {}, ActType(xtype), scale_type,
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
    simt::Options o = options(order, seed);
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

// Every [[host_name]] the libraries registered (for the name checks).
int mbemu_kernel_count() { return int(simt::kernel_count()); }

}  // extern "C"
