// A tiny persistent thread pool for kernel loops. One job at a time: a
// caller that finds the pool busy (another Python thread, or a nested call)
// runs its loop inline, so concurrent callers never oversubscribe the cores.
#pragma once
#include <cstdint>
#include <functional>

namespace mixbits {

// Worker count (including the caller); MIXBITS_NUM_THREADS overrides it.
int num_threads();

// Caps the threads parallel_for uses (1 = run inline; <= 0 restores the
// default). For tests that compare threaded and single-thread results, and
// for callers that manage their own threads.
void set_max_threads(int n);
int max_threads();

// Runs fn(begin, end) over [0, n) split into contiguous chunks of at least
// `grain` items, on up to num_threads() threads; returns when all are done.
void parallel_for(int64_t n, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace mixbits
