// Software prefetch of quantized weights for the x86 batch-1 kernels: one
// policy for every kernel that streams W once per call. Into L2, 16 KiB
// ahead. A weight larger than L2 streams from L3 or DRAM, and without a
// prefetch, or with the 2 KiB-ahead L1 one used before, its loads arrived
// too late for the kernels' pace. Measured one thread, M = 1, EPYC Zen 4,
// medians of interleaved or alternating runs (ms):
//   repacked VNNI (qmatmul_int8/repacked_vnni.cpp), was L1 2 KiB:
//     4-bit 11008x4096 0.98 -> 0.60, 4096x11008 1.07 -> 0.71,
//     8-bit 11008x4096 2.91 -> 2.28, 5-bit 1.71 -> 1.26;
//   repacked AVX2 (avx2_repacked.cpp, backend="avx2" on the same CPU; no
//     AVX2-only host measured): 4-bit 11008x4096 2.46 -> 2.02, 4096x11008
//     1.78 -> 1.49, 8-bit 11008x4096 4.20 -> 3.68, 3-bit 2.86 -> 2.67;
//   int8 on MLX's layout (qmatmul_int8/x86.h), had none: 4-bit 11008x4096
//     2.3-3.6 -> 1.2-2.5, 8-bit 3.2-4.0 -> 1.6-2.8, 3-bit 3.2-4.6 -> 2.0-2.4;
//   the float contract's GEMVs (qmatmul/avx2_gemv*.cpp), had none: 4-bit
//     11008x4096 4.0-4.6 -> 2.8-3.3, 8-bit 4.5-5.6 -> 2.9-3.5, 3-bit
//     4.3-5.1 -> 2.9-3.8, 2-bit 3.1-3.8 -> 2.4-2.7 (AVX-512 row).
// 8-row calls and 4096x4096 (in cache) unchanged. The repacked 2-bit
// kernels keep a near L1 prefetch: four shifts per word make them
// compute-bound, and there the L2 hint cost 5-10% at 4096x4096 (VNNI).
//
// Include after <immintrin.h>; _mm_prefetch is SSE, so any x86 target.
// Internal linkage: one copy per including file, compiled for its target.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace mixbits {
namespace {

constexpr int kPrefetchAhead = 16384;  // into L2
constexpr int kPrefetchNear = 2048;    // into L1: the repacked 2-bit kernels

// A repacked block's code word (qmatmul_int8/repack.h: one sequential
// stream of 64-byte words per block), one call per word.
template <int B>
inline void prefetch_words(const uint32_t* p) {
  if constexpr (B == 2) _mm_prefetch((const char*)p + kPrefetchNear, _MM_HINT_T0);
  else _mm_prefetch((const char*)p + kPrefetchAhead, _MM_HINT_T1);
}

// A row-major weight read a unit of 32 B-bit codes at a time (p: the unit's
// first byte), several rows per pass: consecutive rows are contiguous, so
// prefetching each row ahead runs over the rows of the next passes. Once
// per 64-byte line: only the units that start in a line's first 4*B bytes.
template <int B>
inline void prefetch_row_unit(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 63) < uintptr_t(4 * B))
    _mm_prefetch((const char*)p + kPrefetchAhead, _MM_HINT_T1);
}

// Bytes [0, n) of a row-major weight's row that a tile packer will read
// soon (the GEMM's dequant_tile, qmatmul/avx2_gemm.cpp), one prefetch per
// line into L1. The packer reads a kc-column span of each row in turn,
// row stride K*B/8 bytes: a few lines, then a jump, which the hardware's
// stream prefetchers do not follow, and every row's first load waited on
// DRAM (83% of dequant_tile's samples on that load, 15% of a 4096^2,
// M = 128 GEMM).
inline void prefetch_span(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}

}  // namespace
}  // namespace mixbits
