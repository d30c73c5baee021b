#include "common/inputs.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#include "mlx/primitives.h"

namespace mixbits {

const void* row_major(const mlx::core::array& a, std::vector<char>& buf) {
  if (a.flags().row_contiguous || a.size() == 0) return a.data<void>();
  // Rare (a sliced, transposed or broadcast view): rows of the last axis
  // one at a time, a plain copy when that axis has unit stride.
  const int nd = a.ndim();
  const size_t isz = a.itemsize();
  const int64_t inner = a.shape(nd - 1);
  const int64_t istride = a.strides()[nd - 1];
  const int64_t rows = int64_t(a.size()) / inner;
  buf.resize(a.size() * isz);
  const char* src = a.data<char>();
  char* dst = buf.data();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0, rem = r;
    for (int d = nd - 2; d >= 0; --d) {
      off += (rem % a.shape(d)) * a.strides()[d];
      rem /= a.shape(d);
    }
    const char* row = src + off * int64_t(isz);
    char* out = dst + r * inner * int64_t(isz);
    if (istride == 1) {
      std::memcpy(out, row, inner * isz);
    } else {
      for (int64_t i = 0; i < inner; ++i)
        std::memcpy(out + i * isz, row + i * istride * int64_t(isz), isz);
    }
  }
  return buf.data();
}

mlx::core::array dense_as(const mlx::core::array& a, const mlx::core::Shape& shape,
                          std::vector<char>& buf) {
  return borrowed(const_cast<void*>(row_major(a, buf)), shape, a.dtype());
}

namespace {

// Whether the lazy view v lists its input's elements in the same row-major
// order. Primitives are told apart by name() (a virtual call): no RTTI of
// MLX's classes, whose type info a macOS libmlx need not export.
bool keeps_order(const mlx::core::array& v) {
  if (!v.has_primitive() || v.inputs().size() != 1) return false;
  const auto& in = v.inputs()[0];
  if (in.dtype() != v.dtype() || in.size() != v.size()) return false;
  const std::string_view n = v.primitive().name();
  if (n == "Reshape" || n == "ExpandDims" || n == "Squeeze" || n == "Flatten" ||
      n == "Unflatten")
    return true;
  if (n != "Transpose") return false;
  // The order is kept when the axes of more than one element stay in order.
  const auto axes = static_cast<const mlx::core::Transpose&>(v.primitive()).state();
  int last = -1;
  for (int a : axes) {
    if (in.shape(a) == 1) continue;
    if (a < last) return false;
    last = a;
  }
  return true;
}

}  // namespace

mlx::core::Shape input_shape(const mlx::core::array& in,
                             const std::optional<mlx::core::Shape>& viewed, const char* op) {
  if (!viewed) return in.shape();
  if (size_t(element_count(*viewed)) != in.size())
    throw std::invalid_argument(
        std::string(op) +
        ": this node reads its input through a reshape/transpose it skipped, and a "
        "shapeless compile cannot replay that on new shapes; compile with shapeless=False");
  return *viewed;
}

mlx::core::array through_views(const mlx::core::array& x) {
  mlx::core::array r = x;
  while (keeps_order(r)) r = r.inputs()[0];
  return r;
}

}  // namespace mixbits
