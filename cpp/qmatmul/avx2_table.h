// The x86 kernels of the float quantized matmul as a table: one row per
// ISA (8-lane AVX2, 16-lane AVX-512F), columns per (bits, group size), as
// qmatmul_int8's I8Table. A call picks its row once (the backend chose the
// entry point) and each segment's kernels once from the row; the drivers
// (avx2.cpp forward, avx2_t.cpp transposed) have no ISA branches.
//
// Files: avx2_decode.h (bit layout and shared helpers), avx2_gemv.cpp and
// avx2_gemv512.cpp (small M: decode once, FMA against every x row),
// avx2_panel.cpp (large M forward: packed dequantized W panels + outer-
// product micro-kernels), avx2_panel_r.cpp (the same panels packed from the
// repacked layout), avx2_gemm.cpp (the row-major dequantized tiles
// and dot-product micro-kernels of the transposed product, avx2_t.cpp),
// avx2.cpp (the rows and the forward driver). All are compiled with -mavx2 -mfma -mf16c; the
// 16-lane functions carry a target attribute and are reached only through
// the AVX-512 row, which dispatch.cpp selects only where CPUID has avx512f.
#pragma once
#include <cstdint>

#include "common/half.h"
#include "qmatmul/kernel.h"

namespace mixbits {

constexpr int kKC = 1024;  // largest column block dequant_tile takes (GEMM tiles)
// Forward GEMM: columns per packed block (avx2_panel.cpp). 512 keeps an
// 8-row x micro-panel at 16 KB (L1); 256 and 384 measured slower here.
constexpr int kPKC = 512;

// Small M: segment rows [n0, n1) against mb <= QmmTable::max_mb rows of x,
// prepared per segment by the driver (xq: decode order times 2^-code_exp,
// xs: per-group sums; row stride ldx / ngroups); adds into y (stride ldy).
using GemvFn = void (*)(const SegView& s, DType sdt, const float* xq, const float* xs,
                        int ldx, int mb, int n0, int n1, float* y, int ldy);
// Rows [n, n+nr) x columns [c0, c1) (group aligned, c1 - c0 <= kKC) of one
// segment, dequantized (s*q + b) into dst (row stride ld) in decode order.
using DequantFn = void (*)(const SegView& s, DType sdt, int n, int nr, int c0, int c1,
                           float* dst, int ld);
// y[i, j] += sum_p x[i, p] * w[j, p] for an mr x nr block (p < kc).
using MicroFn = void (*)(const float* x, int ldx, const float* w, int ldw, int kc,
                         float* y, int ldy);

// Forward GEMM (avx2_panel.cpp). Packs rows [n, n+nr) x columns [c0, c1)
// (c1 - c0 <= kPKC) of a segment, dequantized with dq, into panels of pw
// W rows, [c1-c0][pw] floats each, rows past nr zero; dst 64-byte aligned.
using PackWFn = void (*)(const SegView& s, DType sdt, DequantFn dq, int n, int nr, int c0,
                         int c1, float* dst, int pw);
// y[i, j] += sum_p xp[p*mr_max + i] * wp[p*pw + j] for i < mr, j < nc: an
// x micro-panel (rows past M zero) against one W panel.
using PanelFn = void (*)(const float* xp, const float* wp, int kc, float* y, int ldy,
                         int mr, int nc);
// Packers that read the row-interleaved layout (qmatmul_int8/repack.h;
// dq unused) into the same panels, bit for bit, by [bits][group-size
// column]: no un-repack of the weight per call. Null where no bits.
using PackWCols = PackWFn[9][3];
struct GemmRow {
  int lanes;  // floats per register
  int mr;     // x rows per micro-panel
  int pw;     // W rows per panel (a multiple of lanes and of kRepackRows)
  PackWFn pack;
  PanelFn micro;
  const PackWCols* pack_r;  // null: the row reads MLX's layout only
};

// Columns of a row: [bits][0: g32, 1: g64, 2: g128], null where no bits.
using GemvCols = GemvFn[9][3];
using DequantCols = DequantFn[9][3];

struct QmmTable;
// One work item of the transposed product: dx columns [s.k0 + c0, s.k0 +
// c1) of segment `seg` for all M rows (see avx2_t.cpp).
struct TItem {
  int seg, c0, c1;  // segment-local columns, group aligned, c1 - c0 <= kTKCMax
};
using TItemFn = void (*)(const float* dy, int64_t ldd, int M, const QMatView& w,
                         const QmmTable& t, const TItem& it, float* dx);

struct QmmTable {
  const char* name;
  // M <= small_m takes the small-M kernels, larger M the packed panels
  // (measured crossovers here: 10-11 rows with the 8-lane kernels against
  // the 6x16 panels, 32-48 with the 16-lane ones).
  int small_m;
  int max_mb;  // x rows per pass of the small-M kernels
  const GemvCols* gemv;
  const DequantCols* dequant;  // the same (8-lane) decoder in both rows
  int mr, nr;                  // largest micro-kernel block
  const MicroFn* const* micro; // micro[mr][nr], 1 <= mr, nr (transposed product)
  const GemmRow* gemm;         // forward, M > small_m (and repacked views)
  TItemFn t_item;
};

// Kernel columns, defined in the kernel files.
extern const GemvCols kGemvAvx2;     // avx2_gemv.cpp
extern const GemvCols kGemvAvx512;   // avx2_gemv512.cpp
extern const DequantCols kDequantAvx2;            // avx2_gemm.cpp
extern const MicroFn* const kMicroAvx2[5];        // avx2_gemm.cpp, 4 x 3
extern const MicroFn* const kMicroAvx512[7];      // avx2_gemm.cpp, 6 x 4
extern const GemmRow kGemmAvx2;     // avx2_panel.cpp
extern const GemmRow kGemmAvx512;   // avx2_panel.cpp
extern const PackWCols kPackRepacked256;  // avx2_panel_r.cpp
extern const PackWCols kPackRepacked512;  // avx2_panel_r.cpp
void t_item_avx2(const float* dy, int64_t ldd, int M, const QMatView& w,
                 const QmmTable& t, const TItem& it, float* dx);     // avx2_t.cpp
void t_item_avx512(const float* dy, int64_t ldd, int M, const QMatView& w,
                   const QmmTable& t, const TItem& it, float* dx);   // avx2_t.cpp

// The two rows (avx2.cpp).
extern const QmmTable kQmmAvx2;
extern const QmmTable kQmmAvx512;

// The transposed product through a row (avx2_t.cpp).
void qmm_t_run_table(const QmmTable& t, const float* dy, int M, const QMatView& w, float* dx);

}  // namespace mixbits
