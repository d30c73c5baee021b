// Stands in for MLX's steel/utils/type_traits.h under the emulator (found
// first on the include path, so MLX's own headers include this one).
//
// Why not MLX's: it specialises pointer_element for `thread T*`, `device T*`,
// `constant T*` and `threadgroup T*`, four distinct types in Metal; with the
// address spaces compiled away (metal_compat.h) they are all `T*`, so the
// four specialisations collide. The rest of the file is restated here with
// the same names and meaning (std's traits underneath).
#pragma once
#include <type_traits>

namespace metal {

template <typename T>
struct is_empty : std::is_empty<T> {};
template <typename T>
constexpr bool is_empty_v = is_empty<T>::value;

template <typename... Ts>
using void_t = std::void_t<Ts...>;

template <class T>
struct is_static : std::bool_constant<std::is_empty_v<std::remove_cv_t<T>>> {};

template <typename T>
struct pointer_element {};
template <typename T>
struct pointer_element<T*> {
  using type = std::remove_cv_t<T>;
};
template <typename T>
using pointer_element_t = typename pointer_element<std::remove_cv_t<T>>::type;

}  // namespace metal
