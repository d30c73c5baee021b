#include "common/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace mixbits {

namespace {

// One parallel_for's chunks. It lives on the caller's stack; a worker
// joins it under mu_ (active_) and the caller returns only after every
// worker that joined has left. Before, the counters were the pool's own: a
// worker late from one job could take a claim from the old counter,
// compare it with the next job's chunk count and run (and count) a chunk
// twice, so done never equalled the count and the caller waited forever
// (a CI run hung this way in tests/test_measure_cli.py).
struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
  int64_t done = 0;  // guarded by Pool::mu_
};

class Pool {
 public:
  explicit Pool(int n) : size_(n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }

  // Returns false (and does nothing) when another job holds the pool.
  bool try_run(int64_t nchunks,
               const std::function<void(int64_t)>& chunk_fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    Job job{&chunk_fn, nchunks};
    {
      std::lock_guard<std::mutex> lk(mu_);
      cur_ = &job;
      ++epoch_;
    }
    cv_.notify_all();
    work(job);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return job.done == job.n && active_ == 0; });
    cur_ = nullptr;
    return true;
  }

 private:
  void work(Job& j) {
    int64_t finished = 0;
    for (int64_t c; (c = j.next.fetch_add(1)) < j.n;) {
      (*j.fn)(c);
      ++finished;
    }
    if (finished) {
      std::lock_guard<std::mutex> lk(mu_);
      j.done += finished;
      if (j.done == j.n) done_cv_.notify_all();
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      Job* j;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (epoch_ != seen && cur_); });
        if (stop_) return;
        seen = epoch_;
        j = cur_;
        ++active_;
      }
      work(*j);
      {
        std::lock_guard<std::mutex> lk(mu_);
        --active_;
      }
      done_cv_.notify_all();
    }
  }

  int size_;
  std::vector<std::thread> workers_;
  std::mutex busy_, mu_;
  std::condition_variable cv_, done_cv_;
  Job* cur_ = nullptr;  // the running job, guarded by mu_
  int active_ = 0;      // workers inside cur_, guarded by mu_
  uint64_t epoch_ = 0;
  bool stop_ = false;
};

Pool& pool() {
  static Pool p(num_threads());
  return p;
}

}  // namespace

int num_threads() {
  static int n = [] {
    if (const char* e = std::getenv("MIXBITS_NUM_THREADS")) {
      int v = std::atoi(e);
      if (v > 0) return v;
    }
    return int(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

namespace {
std::atomic<int> g_max_threads{0};
}

void set_max_threads(int n) { g_max_threads.store(n > 0 ? n : 0); }

int max_threads() {
  int cap = g_max_threads.load();
  return cap > 0 ? std::min(cap, num_threads()) : num_threads();
}

void parallel_for(int64_t n, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t nthreads = std::min<int64_t>(max_threads(), (n + grain - 1) / grain);
  if (nthreads <= 1) {
    fn(0, n);
    return;
  }
  // A few chunks per thread balances uneven cores without much overhead.
  int64_t nchunks = std::min<int64_t>(nthreads * 4, (n + grain - 1) / grain);
  int64_t step = (n + nchunks - 1) / nchunks;
  std::function<void(int64_t)> chunk = [&](int64_t c) {
    int64_t b = c * step, e = std::min(n, b + step);
    if (b < e) fn(b, e);
  };
  if (!pool().try_run(nchunks, chunk)) fn(0, n);
}

}  // namespace mixbits
