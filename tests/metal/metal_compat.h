// Lets unchanged .metal sources compile as C++20 with g++ and run on the
// SIMT emulator (simt.h). Include this first, then the .metal file.
//
// What it maps:
//  - address spaces device / constant / thread: empty macros; threadgroup:
//    `register`, a no-op storage class in declarations that is also a legal
//    (ignored) attribute token, so `[[threadgroup(0)]]` still parses.
//    Threadgroup memory reaches a kernel as a [[threadgroup(i)]] parameter,
//    which the harness points at one buffer per threadgroup; a
//    function-local `threadgroup T x[n]` would NOT be shared here, so the
//    kernels never declare one (tests/metal/test_emulator.py checks);
//  - [[kernel]], [[buffer(i)]], [[thread_position_in_grid]] ...: unknown
//    attributes, ignored by g++ (warning silenced below); kernel
//    instantiation with [[host_name]] goes through MB_INSTANTIATE_KERNEL,
//    which here registers the instantiation by name in simt's registry;
//  - scalar and vector types (uint, ushort, uchar, half, bfloat, float2..4,
//    uint2..4, ...), as_type, and the metal:: math used by the kernels;
//  - simd_sum / simd_max / simd_min / simd_or / simd_shuffle* / simd_broadcast,
//    the 8x8 simdgroup_matrix operations (simdgroup_load / _store /
//    _multiply_accumulate, in metal_compat_matrix.h) and
//    threadgroup_barrier / simdgroup_barrier: real
//    synchronization points of the emulator, checked for divergence.
#pragma once

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <source_location>
#include <sys/types.h>
#include <type_traits>

#include "simt.h"

#define MIXBITS_METAL_EMULATION 1

#pragma GCC diagnostic ignored "-Wattributes"
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#pragma GCC diagnostic ignored "-Wregister"

// ---- scalar types -----------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

// Metal's bfloat: stored as the top 16 bits of a float32, round to nearest
// even on conversion, arithmetic through float.
struct bfloat {
  uint16_t bits = 0;
  bfloat() = default;
  bfloat(float f) {
    uint32_t x = std::bit_cast<uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
      bits = uint16_t((x >> 16) | 0x40);
    else
      bits = uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
  operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
};

// ---- vector types -------------------------------------------------------------
namespace metal_compat_detail {

template <typename T, int N>
struct vec;

#define MB_VEC_OPS(N)                                                        \
  T& operator[](int i) { return (&x)[i]; }                                   \
  const T& operator[](int i) const { return (&x)[i]; }                       \
  friend vec operator+(vec a, const vec& b) {                                \
    for (int i = 0; i < N; ++i) a[i] += b[i];                                \
    return a;                                                                \
  }                                                                          \
  friend vec operator-(vec a, const vec& b) {                                \
    for (int i = 0; i < N; ++i) a[i] -= b[i];                                \
    return a;                                                                \
  }                                                                          \
  friend vec operator*(vec a, const vec& b) {                                \
    for (int i = 0; i < N; ++i) a[i] *= b[i];                                \
    return a;                                                                \
  }                                                                          \
  friend vec operator/(vec a, const vec& b) {                                \
    for (int i = 0; i < N; ++i) a[i] /= b[i];                                \
    return a;                                                                \
  }                                                                          \
  friend vec operator*(vec a, T s) {                                         \
    for (int i = 0; i < N; ++i) a[i] *= s;                                   \
    return a;                                                                \
  }                                                                          \
  friend vec operator*(T s, vec a) { return a * s; }                         \
  vec& operator+=(const vec& b) { return *this = *this + b; }                \
  vec& operator*=(const vec& b) { return *this = *this * b; }

template <typename T>
struct vec<T, 2> {
  T x{}, y{};
  vec() = default;
  vec(T a, T b) : x(a), y(b) {}
  explicit vec(T s) : x(s), y(s) {}
  MB_VEC_OPS(2)
};
template <typename T>
struct vec<T, 3> {
  T x{}, y{}, z{};
  vec() = default;
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  explicit vec(T s) : x(s), y(s), z(s) {}
  MB_VEC_OPS(3)
};
template <typename T>
struct vec<T, 4> {
  T x{}, y{}, z{}, w{};
  vec() = default;
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  explicit vec(T s) : x(s), y(s), z(s), w(s) {}
  MB_VEC_OPS(4)
};
#undef MB_VEC_OPS

}  // namespace metal_compat_detail

#define MB_VEC_TYPES(T, name)                                  \
  typedef metal_compat_detail::vec<T, 2> name##2;              \
  typedef metal_compat_detail::vec<T, 3> name##3;              \
  typedef metal_compat_detail::vec<T, 4> name##4;
MB_VEC_TYPES(float, float)
MB_VEC_TYPES(half, half)
MB_VEC_TYPES(int, int)
MB_VEC_TYPES(uint, uint)
MB_VEC_TYPES(short, short)
MB_VEC_TYPES(ushort, ushort)
MB_VEC_TYPES(uchar, uchar)
MB_VEC_TYPES(ulong, ulong)
#undef MB_VEC_TYPES

// ---- the metal namespace --------------------------------------------------------
namespace metal {

template <typename To, typename From>
inline To as_type(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return std::bit_cast<To>(v);
}

template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }

inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float log2(float x) { return std::log2(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float rint(float x) { return std::rint(x); }
inline float ldexp(float x, int e) { return std::ldexp(x, e); }
inline float pow(float a, float b) { return std::pow(a, b); }
inline float tanh(float x) { return std::tanh(x); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }

namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace precise

template <typename T>
struct numeric_limits : std::numeric_limits<T> {};

// ---- synchronization --------------------------------------------------------------

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2,
                       mem_texture = 4 };

inline void threadgroup_barrier(
    mem_flags, std::source_location loc = std::source_location::current()) {
  simt::barrier(loc);
}

inline void simdgroup_barrier(
    mem_flags, std::source_location loc = std::source_location::current()) {
  int n;
  char dummy = 0;
  simt::simd_rendezvous("simdgroup_barrier", &dummy, 1, &n, loc);
  if (simt::current_lane() == 0) simt::count_simd_barrier();
}

namespace compat_detail {

template <typename T>
struct Gathered {
  T v[simt::kSimdWidth];
  int n;
};

template <typename T>
Gathered<T> gather(const char* op, const T& x, const std::source_location& loc) {
  static_assert(std::is_trivially_copyable_v<T>);
  static_assert(sizeof(T) <= simt::kMaxSimdValueBytes);
  Gathered<T> g;
  const unsigned char* s = simt::simd_rendezvous(op, &x, sizeof(T), &g.n, loc);
  for (int i = 0; i < g.n; ++i)
    std::memcpy(&g.v[i], s + size_t(i) * simt::kMaxSimdValueBytes, sizeof(T));
  return g;
}

// Pairwise tree, as a hardware reduction would combine lanes.
template <typename T, typename F>
T tree(Gathered<T> g, F f) {
  for (int w = 1; w < g.n; w *= 2)
    for (int i = 0; i + w < g.n; i += 2 * w) g.v[i] = f(g.v[i], g.v[i + w]);
  return g.v[0];
}

}  // namespace compat_detail

#define MB_SIMD_LOC std::source_location loc = std::source_location::current()

template <typename T>
T simd_sum(T x, MB_SIMD_LOC) {
  return compat_detail::tree(compat_detail::gather("simd_sum", x, loc),
                             [](T a, T b) { return T(a + b); });
}
template <typename T>
T simd_max(T x, MB_SIMD_LOC) {
  return compat_detail::tree(compat_detail::gather("simd_max", x, loc),
                             [](T a, T b) { return metal::max(a, b); });
}
template <typename T>
T simd_min(T x, MB_SIMD_LOC) {
  return compat_detail::tree(compat_detail::gather("simd_min", x, loc),
                             [](T a, T b) { return metal::min(a, b); });
}
template <typename T>
T simd_or(T x, MB_SIMD_LOC) {
  return compat_detail::tree(compat_detail::gather("simd_or", x, loc),
                             [](T a, T b) { return T(a | b); });
}
template <typename T>
T simd_and(T x, MB_SIMD_LOC) {
  return compat_detail::tree(compat_detail::gather("simd_and", x, loc),
                             [](T a, T b) { return T(a & b); });
}

namespace compat_detail {
[[noreturn]] inline void bad_lane(const char* op, long lane, int n,
                                  const std::source_location& loc) {
  throw simt::Error(std::string("simt: ") + op + " at line " +
                    std::to_string(loc.line()) + " reads lane " +
                    std::to_string(lane) + " of a " + std::to_string(n) +
                    "-lane simdgroup");
}
}  // namespace compat_detail

template <typename T>
T simd_shuffle(T x, ushort lane, MB_SIMD_LOC) {
  auto g = compat_detail::gather("simd_shuffle", x, loc);
  if (lane >= g.n || lane >= simt::kSimdWidth)
    compat_detail::bad_lane("simd_shuffle", lane, g.n, loc);
  return g.v[lane];
}
template <typename T>
T simd_broadcast(T x, ushort lane, MB_SIMD_LOC) {
  auto g = compat_detail::gather("simd_broadcast", x, loc);
  if (lane >= g.n || lane >= simt::kSimdWidth)
    compat_detail::bad_lane("simd_broadcast", lane, g.n, loc);
  return g.v[lane];
}
// Lanes past the end keep their own value, as Metal specifies.
template <typename T>
T simd_shuffle_down(T x, ushort delta, MB_SIMD_LOC) {
  auto g = compat_detail::gather("simd_shuffle_down", x, loc);
  uint32_t me = simt::current_lane();
  return me + delta < uint32_t(g.n) ? g.v[me + delta] : x;
}
template <typename T>
T simd_shuffle_up(T x, ushort delta, MB_SIMD_LOC) {
  auto g = compat_detail::gather("simd_shuffle_up", x, loc);
  uint32_t me = simt::current_lane();
  return me >= delta ? g.v[me - delta] : x;
}
template <typename T>
T simd_shuffle_xor(T x, ushort mask, MB_SIMD_LOC) {
  auto g = compat_detail::gather("simd_shuffle_xor", x, loc);
  uint32_t src = simt::current_lane() ^ mask;
  return src < uint32_t(g.n) ? g.v[src] : x;
}

#undef MB_SIMD_LOC

}  // namespace metal

#include "metal_compat_matrix.h"

using namespace metal;

// ---- kernel instantiation ---------------------------------------------------------
#define MB_COMPAT_CAT_(a, b) a##b
#define MB_COMPAT_CAT(a, b) MB_COMPAT_CAT_(a, b)
// [[host_name(name)]] instantiation -> registration under `name`.
#define MB_INSTANTIATE_KERNEL(name, func, ...)                       \
  static const bool MB_COMPAT_CAT(mb_kernel_registered_, __COUNTER__) = \
      ::simt::register_kernel(name, &func<__VA_ARGS__>);

// ---- alignment of reinterpreted pointers ---------------------------------------
// A kernel that reads words through a pointer made from a byte pointer
// states the alignment it relies on; Metal requires it silently, x86 does not
// care, so the emulator checks it.
#define MB_CHECK_ALIGNED(ptr) ::metal_compat_detail::check_aligned(ptr, #ptr, __LINE__)
namespace metal_compat_detail {
template <typename T>
inline void check_aligned(const T* p, const char* what, int line) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0)
    throw simt::Error(std::string("simt: ") + what + " at line " + std::to_string(line) +
                      " is not aligned for its " + std::to_string(sizeof(T)) + "-byte type");
}
}  // namespace metal_compat_detail

// ---- address spaces (last: after every standard header) -------------------------
#define device
#define threadgroup register
#define constant
#define thread
