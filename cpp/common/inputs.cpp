#include "common/inputs.h"

#include <cstring>

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

}  // namespace mixbits
