// Lives in a file built without -mavx2, so the check itself never executes
// an AVX instruction.
#include "common/cpu.h"

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
#endif
    return c;
  }();
  return isa;
}

}  // namespace mixbits
