// Small helpers the op builders share for argument checks: dtype tests and
// conversion to the kernels' DType, and shapes printed as Python does.
#pragma once
#include <sstream>
#include <string>

#include "common/half.h"
#include "mlx/array.h"

namespace mixbits {

inline bool is_float_dtype(mlx::core::Dtype t) {
  namespace mx = mlx::core;
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// The kernels' element type for a float MLX dtype (checked by the caller).
inline DType to_dtype(mlx::core::Dtype t) {
  namespace mx = mlx::core;
  if (t == mx::float16) return DType::f16;
  if (t == mx::bfloat16) return DType::bf16;
  return DType::f32;
}

// "(3, 4)" or "(5,)", as a Python user reads shapes in messages.
inline std::string shape_str(const mlx::core::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

inline std::string shape_str(const mlx::core::array& a) { return shape_str(a.shape()); }

}  // namespace mixbits
