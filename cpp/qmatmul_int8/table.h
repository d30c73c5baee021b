// Plain-data arguments of the per-ISA int8 kernels and their tables. Only
// <cstdint> and half.h: the VNNI file is compiled under a target pragma and
// must not instantiate library templates that other files could link to.
#pragma once
#include <cstdint>

#include "common/half.h"

namespace mixbits {

struct I8Seg {
  const uint8_t* wq;  // row n starts at wq + n * row_bytes
  int64_t row_bytes;
  const void* scales;
  const void* biases;
  DType sdt;
  int k, ngroups;
};

// MB activation rows of one segment, in the kernel's code order.
struct I8X {
  const void* xq;    // int8_t or int16_t codes (the table's); row m at xq + m * ldx
  int ldx;
  const float* d;    // row m at d + m * ldg (per group)
  const float* xs;   // d * ix, same layout
  int ldg;
};

// y[m * ldy + n] += segment contribution for m < mb, n in [n0, n1).
// scratch: at least 32 * ngroups floats.
using I8Fn = void (*)(const I8Seg&, const I8X&, int mb, int n0, int n1,
                      float* y, int ldy, float* scratch);

// One ISA's kernels, one per (bits, group size): a row per ISA, looked up
// once per segment per call.
// x rows from which the int8 VNNI kernels put W rows in vector lanes
// (x86.h rows8); fewer rows keep lanes along columns. Measured here (one
// thread, 4096x4096 ... 11008x4096, 2/4-bit): rows8 is 1.1-1.6x faster at
// 8 rows, 1.0-1.45x at 4, and up to 1.8x slower at 2 (the transpose of
// 8 decoded units is then paid for too few dot products).
constexpr int kRows8MinMB = 4;

struct I8Table {
  const char* name;
  int max_mb;       // activation rows per pass
  I8Fn fn[9][3];    // [bits][0: g32, 1: g64, 2: g128]; null if unsupported
};
#if defined(MIXBITS_HAVE_AVX2)
const I8Table& int8_table_avx2();
const I8Table& int8_table_vnni();     // AVX512-VNNI + VL; call only if present
const I8Table& int16_table_avx2();
const I8Table& int16_table_vnni();    // AVX512-VNNI + VL (512-bit); likewise
#endif

// Byte position p (0..31) of a 32-code unit holds column x86_int8_col(B, p)
// of the unit: the order the x86 decoders produce the codes in (the int16
// kernels widen those bytes in place, so their activations use it too).
constexpr int x86_int8_col(int B, int p) {
  if (B == 2) return 4 * (p & 7) + (p >> 3);   // byte j, bit pair k -> 8k + j
  if (B == 4) return p < 16 ? 2 * p : 2 * (p - 16) + 1;  // low nibbles, then high
  return p;                                     // 3,5,6,8: natural order
}

}  // namespace mixbits
