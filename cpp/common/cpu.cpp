// Lives in a file built without -mavx2, so the check itself never executes
// an AVX instruction.
#include "common/cpu.h"

#include <cstdlib>
#include <cstring>

namespace mixbits {

bool cpu_has_avx2() { return cpu_isa().avx2; }

const CpuIsa& cpu_isa() {
  static const CpuIsa isa = [] {
    CpuIsa c;
#if defined(MIXBITS_HAVE_AVX2)
    c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    c.avx512f = c.avx2 && __builtin_cpu_supports("avx512f");
    c.avx512vnni = c.avx512f && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni");
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
    c.avxvnni = c.avx2 && __builtin_cpu_supports("avxvnni");
#endif
    // MIXBITS_ISA=avx2 holds the kernels to AVX2 + FMA + F16C, as on a CPU
    // without AVX-512 or AVX-VNNI: every "auto" choice then takes the AVX2
    // rows, so one host can test and time what such a CPU runs. Read once,
    // here; the Python package refuses any value but native and avx2 at
    // import (mixbits/_backends.py), so a typo never silently runs native.
    if (const char* cap = std::getenv("MIXBITS_ISA"); cap && std::strcmp(cap, "avx2") == 0)
      c.avx512f = c.avx512vnni = c.avxvnni = false;
#endif
    return c;
  }();
  return isa;
}

}  // namespace mixbits
