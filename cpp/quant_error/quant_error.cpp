// See quant_error.h. A plain loop templated on the bit width: with BITS
// known, the code positions inside a 32-code chunk (BITS words) are
// constants, so the decode unrolls into shifts and masks the compiler
// vectorizes, for the widths whose codes straddle words (3, 5, 6) too.
#include "quant_error/quant_error.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "mlx/transforms.h"

namespace mixbits {
namespace mx = mlx::core;

namespace {

constexpr int kChunk = 32;       // codes per BITS words
constexpr int64_t kRowBlock = 8;  // rows per partial sum

// Code i (< 32) of a chunk of BITS words.
template <int BITS>
inline uint32_t chunk_code(const uint32_t* c, int i) {
  const int bit = i * BITS, wd = bit / 32, sh = bit % 32;
  uint64_t v = c[wd] >> sh;
  if (sh + BITS > 32) v |= uint64_t(c[wd + 1]) << (32 - sh);
  return uint32_t(v) & ((1u << BITS) - 1u);
}

template <int BITS>
double rows_error(const uint32_t* wq, const void* sc, const void* bi, DType sdt, const float* w,
                  const float* f, int64_t r0, int64_t r1, int64_t k, int gs) {
  const int64_t words = k * BITS / 32, ng = k / gs;
  double total = 0.0;
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* row = wq + r * words;
    const float* wr = w + r * k;
    const float* fr = f + r * k;
    for (int64_t g = 0; g < ng; ++g) {
      const float s = load_as_f32(sc, r * ng + g, sdt), b = load_as_f32(bi, r * ng + g, sdt);
      float acc = 0.0f;  // one group: at most 128 terms in float
      for (int c0 = 0; c0 < gs; c0 += kChunk) {
        const int64_t j0 = g * gs + c0;
        const uint32_t* chunk = row + j0 / kChunk * BITS;
        float d[kChunk];
#pragma GCC unroll 32
        for (int i = 0; i < kChunk; ++i) d[i] = s * float(chunk_code<BITS>(chunk, i)) + b - wr[j0 + i];
        for (int i = 0; i < kChunk; ++i) acc += fr[j0 + i] * d[i] * d[i];
      }
      total += acc;
    }
  }
  return total;
}

using RowsFn = double (*)(const uint32_t*, const void*, const void*, DType, const float*,
                          const float*, int64_t, int64_t, int64_t, int);

RowsFn rows_fn(int bits) {
  switch (bits) {
    case 2: return rows_error<2>;
    case 3: return rows_error<3>;
    case 4: return rows_error<4>;
    case 5: return rows_error<5>;
    case 6: return rows_error<6>;
    case 8: return rows_error<8>;
    default:
      throw std::invalid_argument("quant_error: bits must be 2, 3, 4, 5, 6 or 8, got " +
                                  std::to_string(bits));
  }
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("quant_error: " + what);
}

}  // namespace

double weighted_quant_error(const mx::array& wq, const mx::array& scales, const mx::array& biases,
                            const mx::array& w, const mx::array& weight, int bits,
                            int group_size) {
  const RowsFn fn = rows_fn(bits);
  check(group_size == 32 || group_size == 64 || group_size == 128,
        "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  check(w.ndim() == 2 && w.dtype() == mx::float32,
        "w must be 2-D float32, got " + shape_str(w));
  const int64_t R = w.shape(0), k = w.shape(1);
  check(k % group_size == 0, "w's " + std::to_string(k) + " columns are not whole groups of " +
                                 std::to_string(group_size));
  check(weight.dtype() == mx::float32 && weight.shape() == w.shape(),
        "weight must be float32 of w's shape " + shape_str(w) + ", got " + shape_str(weight));
  check(wq.dtype() == mx::uint32 && wq.ndim() == 2 && wq.shape(0) == R &&
            wq.shape(1) == k * bits / 32,
        "wq must be uint32 (" + std::to_string(R) + ", " + std::to_string(k * bits / 32) +
            "), got " + shape_str(wq));
  for (const mx::array* a : {&scales, &biases})
    check(a->ndim() == 2 && a->shape(0) == R && a->shape(1) == k / group_size &&
              is_float_dtype(a->dtype()) && a->dtype() == scales.dtype(),
          "scales and biases must be (" + std::to_string(R) + ", " +
              std::to_string(k / group_size) + ") in one float dtype, got " + shape_str(*a));
  mx::array q = wq, s = scales, b = biases, x = w, f = weight;
  mx::eval({q, s, b, x, f});
  std::vector<char> bufs[5];
  const auto* qp = static_cast<const uint32_t*>(row_major(q, bufs[0]));
  const void* sp = row_major(s, bufs[1]);
  const void* bp = row_major(b, bufs[2]);
  const auto* xp = static_cast<const float*>(row_major(x, bufs[3]));
  const auto* fp = static_cast<const float*>(row_major(f, bufs[4]));
  const DType sdt = to_dtype(s.dtype());
  const int64_t nblocks = (R + kRowBlock - 1) / kRowBlock;
  std::vector<double> part(size_t(nblocks), 0.0);
  parallel_for(nblocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      part[blk] = fn(qp, sp, bp, sdt, xp, fp, blk * kRowBlock,
                     std::min(R, (blk + 1) * kRowBlock), k, group_size);
  });
  double total = 0.0;
  for (double v : part) total += v;
  return total;
}

}  // namespace mixbits
