// The SIMT emulator: one ucontext fiber per kernel thread, a cooperative
// scheduler per threadgroup, and strict checking of every synchronization
// point (see simt.h for the rules).
#include "simt.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

namespace simt {

namespace {

enum class State { Runnable, AtSimd, AtBarrier, Done };

struct Fiber {
  ucontext_t ctx;
  State state = State::Runnable;
  const char* op = nullptr;  // simd op name while State::AtSimd
  std::source_location loc;  // where it waits
  uint64_t simd_seq = 0;     // simd ops completed so far
  ThreadIds ids;
};

// Stacks for every fiber of a threadgroup, each above a PROT_NONE guard page
// so an overflow faults instead of corrupting a neighbour.
class Stacks {
 public:
  Stacks(size_t n, size_t bytes) {
    page_ = size_t(sysconf(_SC_PAGESIZE));
    per_ = (bytes + page_ - 1) / page_ * page_ + page_;
    total_ = per_ * n;
    void* p = mmap(nullptr, total_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw Error("simt: cannot allocate fiber stacks");
    base_ = static_cast<char*>(p);
    for (size_t i = 0; i < n; ++i) mprotect(base_ + i * per_, page_, PROT_NONE);
  }
  ~Stacks() { munmap(base_, total_); }
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;
  char* stack(size_t i) const { return base_ + i * per_ + page_; }
  size_t size() const { return per_ - page_; }

 private:
  char* base_ = nullptr;
  size_t page_ = 0, per_ = 0, total_ = 0;
};

struct Group {
  ucontext_t sched;
  std::vector<Fiber> fibers;
  // Simd exchange slots: [simdgroup][parity][lane][kMaxSimdValueBytes].
  // Two parities: a lane can deposit for op s+1 only after every lane of its
  // simdgroup left op s, so slots of op s are never overwritten while read.
  std::vector<unsigned char> slots;
  const Body* body = nullptr;
  std::exception_ptr error;
  int current = -1;
  uint32_t threads = 0;
};

thread_local Group* g_group = nullptr;

// Traffic counting (simt.h). g_record: the running dispatch's record while
// recording; g_active: the same, but only while a kernel thread runs, so
// the harness's own accesses (poisoning, copying) are never counted.
struct Range {
  uintptr_t lo, size;
  Space space;
  // While recording: per byte of a device buffer, bit 0 read and bit 1
  // written in this dispatch (the unique-byte counts).
  std::vector<uint8_t> seen;
};
bool g_recording = false;
std::vector<Traffic> g_log;
std::vector<Range> g_ranges;
Traffic* g_record = nullptr;
Traffic* g_active = nullptr;

int width_slot(size_t n) {
  switch (n) {
    case 1: return 0;
    case 2: return 1;
    case 4: return 2;
    case 8: return 3;
    case 16: return 4;
    default: return 5;
  }
}

inline void count_access(const void* p, size_t n, bool write) {
  Traffic* t = g_active;
  if (!t) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (Range& r : g_ranges)
    if (a - r.lo < r.size) {
      if (r.space == Space::Threadgroup) {
        (write ? t->tg_write : t->tg_read) += n;
        return;
      }
      (write ? t->device_write : t->device_read)[width_slot(n)] += n;
      const uint8_t bit = write ? 2 : 1;
      uint8_t* s = r.seen.data() + (a - r.lo);
      const size_t m = std::min<size_t>(n, r.size - (a - r.lo));
      for (size_t i = 0; i < m; ++i)
        if (!(s[i] & bit)) {
          s[i] |= bit;
          ++(write ? t->unique_write : t->unique_read);
        }
      return;
    }
}

std::string where(const std::source_location& l) {
  std::ostringstream os;
  const char* f = l.file_name();
  const char* slash = std::strrchr(f, '/');
  os << (slash ? slash + 1 : f) << ":" << l.line();
  return os.str();
}

std::string dim_str(const Dim3& d) {
  std::ostringstream os;
  os << "(" << d.x << "," << d.y << "," << d.z << ")";
  return os.str();
}

bool same_site(const Fiber& a, const Fiber& b) {
  return a.loc.line() == b.loc.line() && a.loc.column() == b.loc.column() &&
         std::strcmp(a.loc.file_name(), b.loc.file_name()) == 0;
}

std::string describe(const Fiber& f) {
  switch (f.state) {
    case State::Done: return "returned";
    case State::AtBarrier: return "waits at threadgroup_barrier " + where(f.loc);
    case State::AtSimd:
      return std::string("waits at ") + f.op + " " + where(f.loc);
    default: return "runnable";
  }
}

void fiber_entry() {
  Group* g = g_group;
  Fiber& f = g->fibers[g->current];
  try {
    (*g->body)(f.ids);
  } catch (...) {
    if (!g->error) g->error = std::current_exception();
  }
  f.state = State::Done;
  // Returning resumes uc_link, the scheduler.
}

Fiber& current_fiber() {
  if (!g_group || g_group->current < 0)
    throw Error("simt: a simdgroup op or barrier was called outside a kernel");
  return g_group->fibers[g_group->current];
}

void yield_to_scheduler(Fiber& f) { swapcontext(&f.ctx, &g_group->sched); }

// Releases simdgroup `s` if every one of its lanes waits at the same simd op
// (throws if they wait at different ones); false if some lane has not
// arrived yet.
bool release_simdgroup(Group& g, uint32_t s, const Dim3& tg) {
  const uint32_t lo = s * kSimdWidth, hi = std::min(g.threads, lo + kSimdWidth);
  for (uint32_t i = lo; i < hi; ++i)
    if (g.fibers[i].state != State::AtSimd) return false;
  const Fiber& a = g.fibers[lo];
  for (uint32_t i = lo; i < hi; ++i) {
    const Fiber& b = g.fibers[i];
    if (!same_site(a, b) || std::strcmp(a.op, b.op) != 0 || a.simd_seq != b.simd_seq) {
      std::ostringstream os;
      os << "simt: lanes of simdgroup " << s << " in threadgroup " << dim_str(tg)
         << " meet at different simd ops: lane 0 at " << a.op << " " << where(a.loc)
         << ", lane " << (i - lo) << " at " << b.op << " " << where(b.loc);
      throw Error(os.str());
    }
  }
  for (uint32_t i = lo; i < hi; ++i) g.fibers[i].state = State::Runnable;
  return true;
}

// Releases lanes and threads waiting at synchronization points that every
// participant has reached. Called when no thread can run; throws on a
// deadlock (a synchronization point that can never complete).
void resolve(Group& g, const Dim3& tg) {
  const uint32_t n = g.threads;
  const uint32_t nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  bool progress = false;
  for (uint32_t s = 0; s < nsimd; ++s) {
    const uint32_t lo = s * kSimdWidth, hi = std::min(n, lo + kSimdWidth);
    int first = -1, waiting = 0;
    for (uint32_t i = lo; i < hi; ++i)
      if (g.fibers[i].state == State::AtSimd) {
        if (first < 0) first = int(i);
        ++waiting;
      }
    if (first < 0) continue;
    const Fiber& a = g.fibers[first];
    std::ostringstream os;
    if (uint32_t(waiting) != hi - lo) {
      os << "simt: " << a.op << " at " << where(a.loc) << " reached by only "
         << waiting << " of " << (hi - lo) << " lanes of simdgroup " << s
         << " in threadgroup " << dim_str(tg) << " (divergent simd op)";
      for (uint32_t i = lo; i < hi; ++i)
        if (g.fibers[i].state != State::AtSimd) {
          os << "; lane " << (i - lo) << " " << describe(g.fibers[i]);
          break;
        }
      throw Error(os.str());
    }
    for (uint32_t i = lo; i < hi; ++i) {
      const Fiber& b = g.fibers[i];
      if (!same_site(a, b) || std::strcmp(a.op, b.op) != 0 ||
          a.simd_seq != b.simd_seq) {
        os << "simt: lanes of simdgroup " << s << " in threadgroup "
           << dim_str(tg) << " meet at different simd ops: lane "
           << (first - int(lo)) << " at " << a.op << " " << where(a.loc)
           << ", lane " << (i - lo) << " at " << b.op << " " << where(b.loc);
        throw Error(os.str());
      }
    }
    for (uint32_t i = lo; i < hi; ++i) g.fibers[i].state = State::Runnable;
    progress = true;
  }
  if (progress) return;

  // No simd op is pending, so every thread still alive waits at a barrier.
  int first = -1;
  uint32_t at_barrier = 0;
  for (uint32_t i = 0; i < n; ++i)
    if (g.fibers[i].state == State::AtBarrier) {
      if (first < 0) first = int(i);
      ++at_barrier;
    }
  const Fiber& a = g.fibers[first];
  if (at_barrier != n) {
    std::ostringstream os;
    os << "simt: threadgroup_barrier at " << where(a.loc) << " reached by "
       << at_barrier << " of " << n << " threads of threadgroup "
       << dim_str(tg) << "; the others returned without reaching it";
    throw Error(os.str());
  }
  for (uint32_t i = 0; i < n; ++i) {
    if (!same_site(a, g.fibers[i])) {
      std::ostringstream os;
      os << "simt: threads of threadgroup " << dim_str(tg)
         << " wait at different barriers: thread " << first << " at "
         << where(a.loc) << ", thread " << i << " at "
         << where(g.fibers[i].loc);
      throw Error(os.str());
    }
  }
  for (uint32_t i = 0; i < n; ++i) g.fibers[i].state = State::Runnable;
  if (g_record) g_record->barriers++;
}

struct GroupGuard {
  ~GroupGuard() {
    g_group = nullptr;
    g_record = g_active = nullptr;
  }
};

}  // namespace

void abandon_dispatch() {
  g_group = nullptr;
  g_record = g_active = nullptr;
}

void traffic_begin() {
  g_log.clear();
  g_recording = true;
}
void traffic_end() {
  g_recording = false;
  for (Range& r : g_ranges) r.seen = {};
}
const std::vector<Traffic>& traffic_log() { return g_log; }

void track(const void* p, size_t bytes, Space space) {
  if (bytes) g_ranges.push_back({reinterpret_cast<uintptr_t>(p), bytes, space, {}});
}
void untrack(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::erase_if(g_ranges, [a](const Range& r) { return r.lo == a; });
}
void count_mma() {
  if (g_record) g_record->mma++;
}
void count_simd_barrier() {
  if (g_record) g_record->simd_barriers++;
}

bool in_kernel() { return g_group && g_group->current >= 0; }

uint32_t current_lane() {
  return current_fiber().ids.thread_index_in_simdgroup;
}

void barrier(const std::source_location& loc) {
  Fiber& f = current_fiber();
  f.state = State::AtBarrier;
  f.loc = loc;
  yield_to_scheduler(f);
}

const unsigned char* simd_rendezvous(const char* op, const void* value,
                                     size_t size, int* lanes,
                                     const std::source_location& loc) {
  Fiber& f = current_fiber();
  if (size > kMaxSimdValueBytes)
    throw Error("simt: simd op value larger than kMaxSimdValueBytes");
  Group& g = *g_group;
  const uint32_t sg = f.ids.simdgroup_index_in_threadgroup;
  const uint32_t lane = f.ids.thread_index_in_simdgroup;
  unsigned char* base =
      g.slots.data() +
      (size_t(sg) * 2 + (f.simd_seq & 1)) * kSimdWidth * kMaxSimdValueBytes;
  std::memcpy(base + lane * kMaxSimdValueBytes, value, size);
  f.state = State::AtSimd;
  f.op = op;
  f.loc = loc;
  yield_to_scheduler(f);
  f.simd_seq++;
  const uint32_t lo = sg * kSimdWidth;
  *lanes = int(std::min<uint32_t>(g.threads - lo, kSimdWidth));
  return base;
}

void dispatch_threadgroups(Dim3 groups, Dim3 threads, const Body& body,
                           const Options& opt) {
  if (g_group) throw Error("simt: nested dispatch from inside a kernel");
  const uint32_t n = threads.count();
  if (n == 0 || n > uint32_t(kMaxThreadsPerGroup))
    throw Error("simt: threads per threadgroup must be in 1..1024, got " +
                std::to_string(n));
  if (groups.count() == 0) return;

  Stacks stacks(n, opt.stack_bytes);
  Group g;
  g.threads = n;
  g.body = &body;
  g.fibers.resize(n);
  const uint32_t nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  g.slots.assign(size_t(nsimd) * 2 * kSimdWidth * kMaxSimdValueBytes, 0);
  std::mt19937_64 rng(opt.seed);
  std::vector<uint32_t> order(n);
  // Puts a list of threads into the configured order.
  auto arrange = [&](std::vector<uint32_t>& v) {
    if (opt.order == Order::Reverse)
      std::reverse(v.begin(), v.end());
    else if (opt.order == Order::Shuffle)
      std::shuffle(v.begin(), v.end(), rng);
  };
  GroupGuard guard;
  g_group = &g;
  if (g_recording) {
    g_log.push_back(Traffic{});
    g_record = &g_log.back();
    g_record->label = opt.label;
    g_record->grid = groups;
    g_record->group = threads;
    g_record->threads = uint64_t(groups.count()) * n;
    for (Range& r : g_ranges)
      if (r.space == Space::Device) r.seen.assign(r.size, 0);
  }

  for (uint32_t gz = 0; gz < groups.z; ++gz)
    for (uint32_t gy = 0; gy < groups.y; ++gy)
      for (uint32_t gx = 0; gx < groups.x; ++gx) {
        const Dim3 tg{gx, gy, gz};
        if (opt.group_start) opt.group_start(tg);
        for (uint32_t i = 0; i < n; ++i) {
          Fiber& f = g.fibers[i];
          f.state = State::Runnable;
          f.simd_seq = 0;
          f.op = nullptr;
          ThreadIds& t = f.ids;
          t.threadgroup_position_in_grid = tg;
          t.thread_position_in_threadgroup = {i % threads.x,
                                              (i / threads.x) % threads.y,
                                              i / (threads.x * threads.y)};
          t.thread_position_in_grid = {
              gx * threads.x + t.thread_position_in_threadgroup.x,
              gy * threads.y + t.thread_position_in_threadgroup.y,
              gz * threads.z + t.thread_position_in_threadgroup.z};
          t.threads_per_threadgroup = threads;
          t.threadgroups_per_grid = groups;
          t.thread_index_in_threadgroup = i;
          t.simdgroup_index_in_threadgroup = i / kSimdWidth;
          t.thread_index_in_simdgroup = i % kSimdWidth;
          t.simdgroups_per_threadgroup = nsimd;
          t.threads_per_simdgroup = kSimdWidth;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = stacks.stack(i);
          f.ctx.uc_stack.ss_size = stacks.size();
          f.ctx.uc_link = &g.sched;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        for (;;) {
          std::iota(order.begin(), order.end(), 0u);
          arrange(order);
          std::deque<uint32_t> queue(order.begin(), order.end());
          while (!queue.empty()) {
            const uint32_t i = queue.front();
            queue.pop_front();
            if (g.fibers[i].state != State::Runnable) continue;
            g.current = int(i);
            g_active = g_record;
            swapcontext(&g.sched, &g.fibers[i].ctx);
            g_active = nullptr;
            g.current = -1;
            if (g.error) std::rethrow_exception(g.error);
            // A simdgroup whose last lane just arrived at a simd op goes on
            // at once, ahead of every other thread: the most adversarial
            // legal schedule for threadgroup memory. A simdgroup that reads
            // what other simdgroups write (e.g. with simdgroup_load) without
            // a threadgroup_barrier in between then reads it before it is
            // written, in every order.
            if (g.fibers[i].state == State::AtSimd) {
              const uint32_t sg = i / kSimdWidth;
              if (release_simdgroup(g, sg, tg)) {
                const uint32_t lo = sg * kSimdWidth;
                std::vector<uint32_t> lanes(std::min(n, lo + kSimdWidth) - lo);
                std::iota(lanes.begin(), lanes.end(), lo);
                arrange(lanes);
                queue.insert(queue.begin(), lanes.begin(), lanes.end());
              }
            }
          }
          bool all_done = true;
          for (const Fiber& f : g.fibers) all_done &= f.state == State::Done;
          if (all_done) break;
          resolve(g, tg);
        }
      }
}

// ---- registry -------------------------------------------------------------

namespace {
struct Entry {
  void* fn;
  const std::type_info* type;
  int count;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}
}  // namespace

void register_kernel_raw(const char* name, void* fn, const std::type_info& t) {
  auto [it, fresh] = registry().try_emplace(name, Entry{fn, &t, 0});
  it->second.count++;
}

void* find_kernel_raw(const std::string& name, const std::type_info& t) {
  auto it = registry().find(name);
  if (it == registry().end())
    throw Error("simt: no kernel instantiated with host_name \"" + name + "\"");
  if (it->second.count != 1)
    throw Error("simt: host_name \"" + name + "\" is instantiated " +
                std::to_string(it->second.count) + " times");
  if (*it->second.type != t)
    throw Error("simt: kernel \"" + name +
                "\" has a different signature than the caller expects");
  return it->second.fn;
}

size_t kernel_count() { return registry().size(); }

}  // namespace simt

// ---- ThreadSanitizer instrumentation hooks --------------------------------
// The kernels' units are compiled with -fsanitize=thread but linked without
// its runtime: these definitions receive the calls (see simt.h). Hidden, so
// the instrumented code calls them directly rather than through the PLT.
#define MB_HOOK extern "C" __attribute__((visibility("hidden"))) void
#define MB_RW_HOOKS(N)                                                              \
  MB_HOOK __tsan_read##N(void* p) { simt::count_access(p, N, false); }              \
  MB_HOOK __tsan_write##N(void* p) { simt::count_access(p, N, true); }              \
  MB_HOOK __tsan_unaligned_read##N(void* p) { simt::count_access(p, N, false); }    \
  MB_HOOK __tsan_unaligned_write##N(void* p) { simt::count_access(p, N, true); }
MB_RW_HOOKS(1)
MB_RW_HOOKS(2)
MB_RW_HOOKS(4)
MB_RW_HOOKS(8)
MB_RW_HOOKS(16)
#undef MB_RW_HOOKS
MB_HOOK __tsan_read_range(void* p, unsigned long n) { simt::count_access(p, n, false); }
MB_HOOK __tsan_write_range(void* p, unsigned long n) { simt::count_access(p, n, true); }
MB_HOOK __tsan_init() {}
MB_HOOK __tsan_func_entry(void*) {}
MB_HOOK __tsan_func_exit() {}
MB_HOOK __tsan_vptr_update(void**, void*) {}
MB_HOOK __tsan_vptr_read(void**) {}
#undef MB_HOOK
