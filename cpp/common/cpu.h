// Run-time CPU feature checks for the SIMD backends.
#pragma once

namespace mixbits {

// AVX2 + FMA + F16C: what every cpp/*/avx2.cpp is compiled for (they are
// built with -mavx2 -mfma -mf16c, so the compiler may use any of the three
// anywhere in them). False on builds without the AVX2 files.
bool cpu_has_avx2();

}  // namespace mixbits
