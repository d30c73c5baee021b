// Prelude of every mixbits .metal source. On a Mac it pulls in the Metal
// standard library and defines how kernels are instantiated under their
// [[host_name]]; compiled as C++ for the CPU emulator, tests/metal/
// metal_compat.h (included before this) provides the same names.
#pragma once

// twofloat.h's error-free sums, the KL's compensated sums and the NaN / inf
// checks are exact only under IEEE arithmetic: fast math may reassociate
// them away or assume no NaN. mlx_build_metallib passes -fno-fast-math (the
// Metal compiler's own default is fast math on); a build that turns fast
// math on stops here instead of giving wrong numbers. The emulator's g++
// defines the same macro under -ffast-math (tests/metal/test_build_flags.py).
#if defined(__FAST_MATH__)
#error "mixbits' Metal kernels must be compiled without fast math (-fno-fast-math)"
#endif

#if defined(__METAL_VERSION__)
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
#include <metal_stdlib>
using namespace metal;

// One explicit instantiation of kernel template `func`, visible to the host
// as `name` (the host asks the library for this string).
#define MB_INSTANTIATE_KERNEL(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#define MB_UNROLL _Pragma("clang loop unroll(full)")
// The emulator checks that a word pointer made from a byte pointer is
// aligned for its type; Metal requires it and would not say.
#define MB_CHECK_ALIGNED(ptr)
// A threadgroup pointer to T at the same address as threadgroup pointer p
// (the emulator's `threadgroup` is not a type qualifier, so it spells the
// cast without it).
#define MB_TG_CAST(T, p) ((threadgroup T*)(p))

#else

#if !defined(MIXBITS_METAL_EMULATION)
#error "compile .metal sources as C++ only after including tests/metal/metal_compat.h"
#endif
#define MB_UNROLL
#define MB_TG_CAST(T, p) (reinterpret_cast<T*>(p))
// MB_CHECK_ALIGNED: defined by metal_compat.h.

#endif
