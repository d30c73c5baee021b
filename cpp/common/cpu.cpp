// Lives in a file built without -mavx2, so the check itself never executes
// an AVX instruction.
#include "common/cpu.h"

namespace mixbits {

bool cpu_has_avx2() {
#if defined(MIXBITS_HAVE_AVX2)
  static const bool ok = __builtin_cpu_supports("avx2") &&
                         __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

}  // namespace mixbits
