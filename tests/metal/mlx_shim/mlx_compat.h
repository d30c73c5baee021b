// What MLX's own Metal kernel headers (quantized.h and the steel GEMM
// headers it uses, from the installed mlx package) need beyond
// metal_compat.h to compile as C++ for the SIMT emulator. Include this
// first, then MLX's headers (mlx_emu.py puts tests/metal/mlx_shim/stub ahead of
// the package's include directory: empty <metal_*> headers and a
// type_traits.h, see there).
//
// Deliberately not included: MLX's kernels/utils.h (with bf16_math.h,
// complex.h): it is written against Metal's builtins (__metal_fabs, ...)
// and would need most of the Metal standard library. What quantized.h and
// steel's headers take from it is restated below with utils.h's meaning:
// METAL_FUNC, ConditionalType, Limits (affine_quantize only), the complex
// type steel's mma.h names (never instantiated) and elem_to_loc (batched
// launches only: never runs here, the harness launches unbatched, as MLX
// does for a 2-D weight).
#pragma once
#include "metal_compat.h"

// In MLX's headers `threadgroup` qualifies struct members (BlockLoader's
// dst) and pointer parameters, where metal_compat.h's `register` is not
// allowed; none of the headers compiled here uses a [[threadgroup(i)]]
// attribute (steel's gemm.h does; it is not included). MLX's kernels also
// declare function-local `threadgroup T Xs[...]` arrays, which this would
// make private to each fiber: the harness therefore never launches those
// [[kernel]] wrappers, it calls their *_impl with threadgroup memory it owns.
#undef threadgroup
#define threadgroup

#define METAL_FUNC inline __attribute__((always_inline))

namespace metal {
// The Metal type traits MLX's steel headers name in namespace metal.
using std::enable_if_t;
using std::is_integral;
using std::is_same;
using std::is_same_v;
using std::is_floating_point;
using std::is_floating_point_v;
using std::remove_cv_t;
using std::bool_constant;
using std::integral_constant;
using std::conditional_t;
template <typename T>
using remove_addrspace_t = std::remove_cv_t<T>;
// Metal's generic vector template (vec<half, 2> is half2).
template <typename T, int N>
using vec = metal_compat_detail::vec<T, N>;
}  // namespace metal

namespace metal_compat_detail {
// Compound assignments MLX uses on short2 tile sizes.
template <typename T, int N>
vec<T, N>& operator-=(vec<T, N>& a, const vec<T, N>& b) {
  for (int i = 0; i < N; ++i) a[i] -= b[i];
  return a;
}
}  // namespace metal_compat_detail

// Named by steel's mma.h (its complex BlockMMA); never instantiated here.
struct complex64_t {
  float real = 0, imag = 0;
  complex64_t() = default;
  complex64_t(float r, float i) : real(r), imag(i) {}
};

// utils.h's ConditionalType and Limits (the parts quantized.h names).
template <bool condition, typename T, typename U>
struct ConditionalType {
  using type = U;
};
template <typename T, typename U>
struct ConditionalType<true, T, U> {
  using type = T;
};
template <typename T>
struct Limits {
  static constexpr T max = std::numeric_limits<T>::has_infinity
                               ? std::numeric_limits<T>::infinity()
                               : std::numeric_limits<T>::max();
  static constexpr T min = std::numeric_limits<T>::has_infinity
                               ? -std::numeric_limits<T>::infinity()
                               : std::numeric_limits<T>::lowest();
};

// Quadgroup sum (qmv_quad, not launched here): lanes 4q..4q+3 of the
// simdgroup, built on the simdgroup shuffle like the hardware's.
template <typename T>
T quad_sum(T x) {
  x += simd_shuffle_xor(x, 1);
  x += simd_shuffle_xor(x, 2);
  return x;
}

// utils.h's elem_to_loc (the batched kernels' offset of element `elem` of
// an ndim array); declared for quantized.h's adjust_matrix_offsets.
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(uint elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += IdxT(elem % uint(shape[i])) * IdxT(strides[i]);
    elem /= uint(shape[i]);
  }
  return loc;
}
