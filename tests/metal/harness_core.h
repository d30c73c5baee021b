// The emulator harness's machinery, shared by its entry points
// (harness.cpp: qmatmul, KL, selftest; harness_gather.cpp: the gathered
// qmatmul): guarded buffers, buffers bound from a launch's own
// description (metal/kernel_args.h), and a call that turns a kernel's
// fault or exception into an error message. See harness.cpp for the rules.
// Internal linkage: each entry-point file gets its own copy.
#pragma once
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

#include "kernel_args.h"
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
    simt::track(data_, bytes_, simt::Space::Device);  // counted as device memory
  }
  Guarded(size_t bytes, const void* src) : Guarded(bytes) {
    if (bytes) std::memcpy(data_, src, bytes);
  }
  ~Guarded() {
    simt::untrack(data_);
    munmap(base_, total_);
  }
  // This buffer is a threadgroup's memory, not a device buffer (counters).
  Guarded& threadgroup_space() {
    simt::untrack(data_);
    simt::track(data_, bytes_, simt::Space::Threadgroup);
    return *this;
  }
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
  // Outputs start as a NaN with a payload that neither arithmetic nor the
  // kernels' NAN produce (those give the canonical quiet NaN), so an element
  // a kernel never wrote is told apart from a NaN it stored on purpose (an
  // index out of range): Buffers::finish refuses the former.
  void fill_poison(Elem e) {
    const size_t w = elem_bytes(e), n = bytes_ / w;
    for (size_t i = 0; i < n; ++i) std::memcpy(data_ + i * w, poison(e), w);
  }
  size_t count_poison(Elem e) const {
    const size_t w = elem_bytes(e), n = bytes_ / w;
    size_t c = 0;
    for (size_t i = 0; i < n; ++i) c += std::memcmp(data_ + i * w, poison(e), w) == 0;
    return c;
  }
  static const void* poison(Elem e) {
    static const uint32_t f32 = 0x7fe5a5a5u;  // also the int32/uint32 pattern
    static const uint16_t f16 = 0x7e5au, bf16 = 0x7fdau;
    return e == Elem::F16 ? static_cast<const void*>(&f16)
         : e == Elem::BF16 ? static_cast<const void*>(&bf16) : static_cast<const void*>(&f32);
  }
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
          fresh->fill_poison(b.elem);
          outputs_.push_back({fresh.get(), u.out, b.elem, l.kernel + ": " + describe(b)});
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
    for (auto& o : outputs_) {
      if (!o.buf->canary_intact())
        throw std::runtime_error("harness: a kernel wrote past the end of an output");
      if (const size_t n = o.buf->count_poison(o.elem))
        throw std::runtime_error("harness: " + o.what + ": " + std::to_string(n) +
                                 " elements never written");
      std::memcpy(o.dst, o.buf->data(), o.buf->bytes());
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
  struct Output {
    Guarded* buf;
    void* dst;
    Elem elem;
    std::string what;
  };
  std::vector<Output> outputs_;
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

}  // namespace
