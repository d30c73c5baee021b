// The CPU backends every op chooses from: one enum, one availability check
// and one error message for all of them (qmatmul, its int8 contract and
// transposed product, gather, kl, attn, act).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace mixbits {

// Python's backend= names these by string (ops.py via _backends.py, which
// reads backend_names() from the extension); the numbers are the enum
// values that cross the bindings.
//  - Avx2: kernels that use AVX2 + FMA + F16C, 8-lane, on any CPU that has
//    them (also on an AVX-512 CPU: how tests and benchmarks check what an
//    AVX2-only CPU runs).
//  - Avx512: an op's kernels that also use AVX-512 where it has them
//    (16-lane float qmatmul and its transposed product; VNNI int8 dots when
//    the CPU has AVX512-VNNI, else the AVX2 ones).
//  - Auto: the first of Avx512, Avx2, Neon, Ref the op has and the CPU runs.
enum class Backend : int { Auto = 0, Ref = 1, Avx2 = 2, Neon = 3, Avx512 = 4 };
constexpr int kNumBackends = 5;

// A set of backends, one bit per enum value.
using BackendSet = uint32_t;
constexpr BackendSet backend_bit(Backend b) { return BackendSet(1) << int(b); }
constexpr BackendSet backend_set(std::initializer_list<Backend> bs) {
  BackendSet s = 0;
  for (Backend b : bs) s |= backend_bit(b);
  return s;
}

// "auto", "ref", "avx2", "neon", "avx512", indexed by enum value.
const std::vector<std::string>& backend_names();
const char* backend_name(Backend b);

// The backends this build and CPU can run (CPUID, resolved once).
BackendSet cpu_backends();

// Those of `implemented` (an op's kernels) this CPU runs, fastest last
// (ref first), for tests and benchmarks to iterate over.
std::vector<Backend> available_backends(BackendSet implemented);

// The concrete backend an op with kernels `implemented` runs for
// `requested`: Auto is the fastest available; a named backend must be
// implemented and runnable here, else std::invalid_argument
// "<op>: backend '<name>' is not available on this CPU (available: ...)".
Backend resolve_backend(const char* op, Backend requested, BackendSet implemented);

}  // namespace mixbits
