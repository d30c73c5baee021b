// Memory-bandwidth probe for the benchmarks: the rate at which all worker
// threads together can stream-read a buffer, the roofline for batch-1
// (memory-bound) kernels measured in the same run.
#pragma once
#include <cstdint>

namespace mixbits {

// Best-of-`reps` read bandwidth in GB/s (1e9 bytes/s) over a buffer of
// `nbytes`, read by parallel_for's threads (capped by set_max_threads).
double read_bandwidth_gbps(int64_t nbytes, int reps);

// Compute probe for the integer contracts: best-of-`reps` nanoseconds per
// 512-bit vpdpbusd (64 byte multiply-adds) on one thread, 12 independent
// accumulators, register operands: the floor of a batched GEMV whose every
// 64 weight x activation products take one. 0 where the CPU (or build) has
// no AVX512-VNNI.
double int8_dot_ns(int reps);

}  // namespace mixbits
