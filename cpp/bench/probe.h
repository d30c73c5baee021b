// Memory-bandwidth probe for the benchmarks: the rate at which all worker
// threads together can stream-read a buffer, the roofline for batch-1
// (memory-bound) kernels measured in the same run.
#pragma once
#include <cstdint>

namespace mixbits {

// Best-of-`reps` read bandwidth in GB/s (1e9 bytes/s) over a buffer of
// `nbytes`, read by parallel_for's threads (capped by set_max_threads).
double read_bandwidth_gbps(int64_t nbytes, int reps);

}  // namespace mixbits
