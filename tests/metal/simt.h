// A CPU SIMT emulator for running Metal compute kernels (compiled as C++ with
// metal_compat.h) on Linux.
//
// Every thread of a threadgroup is a fiber (ucontext with its own stack); the
// threads of one threadgroup run concurrently in the sense that matters for
// a kernel: they interleave only at synchronization points, and every
// synchronization point (simdgroup op, barrier) waits for the threads it
// names, exactly as on the GPU. Threadgroups run one after another.
//
// The emulator is strict where the GPU would silently misbehave:
//  - a simdgroup op that some lanes of the simdgroup never reach (they
//    finished, or wait elsewhere), or lanes meeting at different simd ops,
//    raises simt::Error naming the source lines;
//  - a threadgroup_barrier not reached by every thread of the threadgroup
//    (some returned early, or wait at another barrier) raises simt::Error.
// Between synchronization points the order in which threads run is
// configurable (forward, reverse, shuffled), and a simdgroup whose lanes
// all reached a simd op runs on at once, before any other thread (a legal
// GPU schedule: simdgroups are independent between barriers), so a missing
// barrier shows up as a wrong result rather than depending on luck.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

namespace simt {

constexpr int kSimdWidth = 32;
constexpr int kMaxThreadsPerGroup = 1024;
// Largest value a simdgroup op can exchange per lane (float4 / uint4, and a
// lane's share of three 8x8 float simdgroup matrices, fit).
constexpr size_t kMaxSimdValueBytes = 32;

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
  uint32_t count() const { return x * y * z; }
};

// Every thread-position attribute Metal offers, for one thread.
struct ThreadIds {
  Dim3 threadgroup_position_in_grid;
  Dim3 thread_position_in_threadgroup;
  Dim3 thread_position_in_grid;
  Dim3 threads_per_threadgroup;
  Dim3 threadgroups_per_grid;
  uint32_t thread_index_in_threadgroup = 0;
  uint32_t simdgroup_index_in_threadgroup = 0;
  uint32_t thread_index_in_simdgroup = 0;
  uint32_t simdgroups_per_threadgroup = 0;
  uint32_t threads_per_simdgroup = kSimdWidth;
};

enum class Order { Forward, Reverse, Shuffle };

struct Options {
  Order order = Order::Shuffle;
  uint64_t seed = 0x5eed;
  size_t stack_bytes = 128 * 1024;
  // Called before each threadgroup starts (e.g. to poison threadgroup
  // memory, whose contents are undefined at that point on the GPU).
  std::function<void(const Dim3& threadgroup)> group_start;
  // Names the dispatch in the traffic log (the kernel's host_name).
  std::string label;
};

using Body = std::function<void(const ThreadIds&)>;

// Runs `body` once per thread of a grid of `groups` threadgroups of `threads`
// threads each (Metal's dispatchThreadgroups). Throws simt::Error on a
// synchronization fault; rethrows an exception thrown by a kernel thread.
void dispatch_threadgroups(Dim3 groups, Dim3 threads, const Body& body,
                           const Options& opt = {});

// Forgets a dispatch that was interrupted by a fault handler jumping out of
// it (its fibers are abandoned, their memory leaked), so the next dispatch
// can start.
void abandon_dispatch();

// ---- used by metal_compat.h from inside kernel threads -------------------

// True while the calling code runs as an emulated kernel thread.
bool in_kernel();

// Threadgroup barrier: returns when every thread of the threadgroup reached
// the same barrier.
void barrier(const std::source_location& loc);

// Simdgroup rendezvous: deposits `size` bytes from `value`, waits until every
// lane of the simdgroup reached the same op (same `op` name and call site),
// and returns the lane-indexed slots (slot i at base + i * kMaxSimdValueBytes)
// and the number of lanes in this simdgroup. Valid until the lane's next
// simd op.
const unsigned char* simd_rendezvous(const char* op, const void* value,
                                     size_t size, int* lanes,
                                     const std::source_location& loc);

// The calling thread's lane index (for simd ops that need it).
uint32_t current_lane();

// ---- traffic counters -------------------------------------------------------
//
// Metal's address spaces are empty macros here, so a device pointer is a raw
// C++ pointer; the kernels' translation units are instead compiled with
// GCC's ThreadSanitizer instrumentation (metal_emu.py), which calls a hook
// (__tsan_readN / __tsan_writeN, defined in simt.cpp) before every memory
// access with its address and width. The hook counts an access made by a
// kernel thread into a range the harness tracked: a device buffer or the
// threadgroup memory. Stack, constant parameters and emulator state are not
// tracked, so they are not counted. Barriers, simdgroup barriers and MMAs
// are counted where they are modelled (here and metal_compat_matrix.h).

enum class Space : uint8_t { Device, Threadgroup };

// Widths a load or store is counted under: 1, 2, 4, 8, 16 bytes, other.
constexpr int kWidths = 6;

struct Traffic {
  std::string label;
  Dim3 grid, group;
  uint64_t threads = 0;
  uint64_t device_read[kWidths] = {}, device_write[kWidths] = {};  // bytes
  // Distinct device bytes read / written in this dispatch: the traffic if
  // every repeated access hit a cache (a lower bound on DRAM traffic).
  uint64_t unique_read = 0, unique_write = 0;
  uint64_t tg_read = 0, tg_write = 0;                                // bytes
  uint64_t barriers = 0;       // threadgroup barriers, once per threadgroup
  uint64_t simd_barriers = 0;  // simdgroup barriers, once per simdgroup
  uint64_t mma = 0;            // 8x8x8 simdgroup multiply-accumulates
};

// Starts (clearing the log) or stops recording one Traffic per dispatch.
void traffic_begin();
void traffic_end();
const std::vector<Traffic>& traffic_log();
// Tracks [p, p + bytes) as memory of `space` until untrack(p).
void track(const void* p, size_t bytes, Space space);
void untrack(const void* p);
// Called by lane 0 of a simdgroup (metal_compat_matrix.h / metal_compat.h).
void count_mma();
void count_simd_barrier();

// ---- kernel registry: [[host_name]] instantiations register here ---------

void register_kernel_raw(const char* name, void* fn, const std::type_info& t);
void* find_kernel_raw(const std::string& name, const std::type_info& t);
size_t kernel_count();

template <typename Fn>
bool register_kernel(const char* name, Fn* fn) {
  register_kernel_raw(name, reinterpret_cast<void*>(fn), typeid(Fn*));
  return true;
}

// The kernel instantiated under `name` with signature Fn; throws if no such
// name exists or it was instantiated with another signature.
template <typename Fn>
Fn* find_kernel(const std::string& name) {
  return reinterpret_cast<Fn*>(find_kernel_raw(name, typeid(Fn*)));
}

}  // namespace simt
