// Run-time CPU feature checks for the SIMD backends.
#pragma once

namespace mixbits {

// AVX2 + FMA + F16C: what every cpp/*/avx2.cpp is compiled for (they are
// built with -mavx2 -mfma -mf16c, so the compiler may use any of the three
// anywhere in them). False on builds without the AVX2 files.
bool cpu_has_avx2();

// What this CPU can run, resolved once on first use (CPUID, and the
// MIXBITS_ISA=avx2 cap read at the same moment, never per call), so a
// kernel choice costs a load per call.
struct CpuIsa {
  bool avx2 = false;        // AVX2 + FMA + F16C (see cpu_has_avx2)
  bool avx512f = false;     // 16-lane float kernels
  bool avx512vnni = false;  // AVX512-VNNI + AVX512VL: vpdpbusd on 256 bits
  bool avxvnni = false;     // AVX-VNNI (VEX vpdpbusd; Alder Lake and later)
};
const CpuIsa& cpu_isa();

}  // namespace mixbits
