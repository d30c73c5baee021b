// Software prefetch of a repacked block's code words (repack.h), one per
// word the GEMVs load, shared by the VNNI (repacked_vnni.cpp) and AVX2
// (avx2_repacked.cpp) kernels: they read a block's words as one
// sequential stream and both need the same lead.
//
// Into L2, 16 KiB ahead. A weight larger than L2 streams from L3 or DRAM,
// and the 2 KiB-ahead L1 prefetch used before arrived too late for the
// kernels' pace. One thread, M = 1, EPYC Zen 4, medians of interleaved
// calls, 2 KiB L1 -> 16 KiB L2:
//   VNNI: 4-bit 11008x4096 0.98 -> 0.60 ms, 4096x11008 1.07 -> 0.71,
//         8-bit 11008x4096 2.91 -> 2.28, 5-bit 1.71 -> 1.26;
//   AVX2 (the same CPU, backend="avx2"; no AVX2-only host measured):
//         4-bit 11008x4096 2.46 -> 2.02, 4096x11008 1.78 -> 1.49, 8-bit
//         11008x4096 4.20 -> 3.68, 3-bit 11008x4096 2.86 -> 2.67;
// 8-row calls and 4096x4096 (in cache) unchanged. 2-bit keeps the near L1
// prefetch: four shifts per word make it compute-bound, and there the L2
// hint cost 5-10% at 4096x4096 (VNNI).
//
// Include after <immintrin.h>; _mm_prefetch is SSE, so any x86 target.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace mixbits {
namespace {

template <int B>
inline void prefetch_words(const uint32_t* p) {
  if constexpr (B == 2) _mm_prefetch((const char*)p + 2048, _MM_HINT_T0);
  else _mm_prefetch((const char*)p + 16384, _MM_HINT_T1);
}

}  // namespace
}  // namespace mixbits
