// dlopen/dlsym of OpenBLAS (see blas.h). CBLAS's enum values are fixed by
// the standard (row-major 101, no-trans 111, trans 112); OpenBLAS passes
// them as ints. The integer width of dimensions is the build's: 64-bit for
// the *64_ symbols, 32-bit otherwise.
#include "linear/blas.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <stdexcept>

namespace mixbits {

namespace {

using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                         const float*, int64_t, float, float*, int64_t);
using Sgemm32 = void (*)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t,
                         const float*, int32_t, float, float*, int32_t);
using SetThreads = void (*)(int);
using GetThreads = int (*)();

struct Names {
  const char* sgemm;
  const char* set_threads;
  const char* get_threads;
  bool ilp64;
};

// Most likely first: numpy >= 2's wheel, older numpy wheels, scipy's
// wheel, a system OpenBLAS.
constexpr Names kNames[] = {
    {"scipy_cblas_sgemm64_", "scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_", true},
    {"cblas_sgemm64_", "openblas_set_num_threads64_", "openblas_get_num_threads64_", true},
    {"scipy_cblas_sgemm", "scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads", false},
    {"cblas_sgemm", "openblas_set_num_threads", "openblas_get_num_threads", false},
};

struct Blas {
  std::mutex mu;
  std::atomic<bool> loaded{false};
  Sgemm64 sgemm64 = nullptr;
  Sgemm32 sgemm32 = nullptr;
  SetThreads set_threads = nullptr;
  GetThreads get_threads = nullptr;
  std::string description;
  // SingleThreadedBlas: how many are alive, and the count to restore.
  std::mutex single_mu;
  int single_users = 0;
  int saved_threads = 0;
};

Blas& blas() {
  static Blas b;
  return b;
}

}  // namespace

std::string load_blas(const std::string& path) {
  Blas& b = blas();
  std::lock_guard<std::mutex> lock(b.mu);
  if (b.loaded) return "";
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    return e ? e : "dlopen failed";
  }
  for (const Names& n : kNames) {
    void* f = dlsym(h, n.sgemm);
    if (!f) continue;
    if (n.ilp64)
      b.sgemm64 = reinterpret_cast<Sgemm64>(f);
    else
      b.sgemm32 = reinterpret_cast<Sgemm32>(f);
    b.set_threads = reinterpret_cast<SetThreads>(dlsym(h, n.set_threads));
    b.get_threads = reinterpret_cast<GetThreads>(dlsym(h, n.get_threads));
    if (!b.set_threads || !b.get_threads) {  // its threads could not be held to one
      b.sgemm64 = nullptr;
      b.sgemm32 = nullptr;
      continue;
    }
    b.description = path + ":" + n.sgemm;
    b.loaded = true;
    return "";  // the handle stays open for the process
  }
  dlclose(h);
  return path + " exports no CBLAS sgemm";
}

bool blas_loaded() { return blas().loaded.load(); }

std::string blas_description() {
  Blas& b = blas();
  std::lock_guard<std::mutex> lock(b.mu);
  return b.description;
}

int blas_threads() {
  Blas& b = blas();
  return b.loaded ? b.get_threads() : 0;
}

void set_blas_threads(int n) {
  Blas& b = blas();
  if (b.loaded && n >= 1) b.set_threads(n);
}

SingleThreadedBlas::SingleThreadedBlas() {
  Blas& b = blas();
  std::lock_guard<std::mutex> lock(b.single_mu);
  if (b.single_users++ == 0) {
    b.saved_threads = b.get_threads();
    if (b.saved_threads != 1) b.set_threads(1);
  }
}

SingleThreadedBlas::~SingleThreadedBlas() {
  Blas& b = blas();
  std::lock_guard<std::mutex> lock(b.single_mu);
  if (--b.single_users == 0 && b.saved_threads != 1) b.set_threads(b.saved_threads);
}

void blas_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
                int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  const int ta = trans_a ? kTrans : kNoTrans, tb = trans_b ? kTrans : kNoTrans;
  Blas& b = blas();
  if (b.sgemm64) {
    b.sgemm64(kRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (!b.sgemm32) throw std::runtime_error("float_matmul: no BLAS loaded");
  constexpr int64_t kMax = 2147483647;
  if (M > kMax || N > kMax || K > kMax || lda > kMax || ldb > kMax || ldc > kMax)
    throw std::runtime_error("float_matmul: dimensions exceed the 32-bit BLAS's range");
  b.sgemm32(kRowMajor, ta, tb, int32_t(M), int32_t(N), int32_t(K), 1.0f, A, int32_t(lda), B,
            int32_t(ldb), beta, C, int32_t(ldc));
}

}  // namespace mixbits
