// OpenBLAS's sgemm, found at run time: float_matmul's large-M path. The
// library is the one numpy already loads (mixbits/float_linear.py names
// its file); nothing is linked at build time, so the extension builds and
// imports without it and float_matmul falls back to its own kernel.
#pragma once
#include <cstdint>
#include <string>

namespace mixbits {

// dlopen `path` and look up its CBLAS sgemm under the names OpenBLAS
// builds export (numpy's scipy_openblas64_ first: 64-bit integers, symbols
// prefixed scipy_ and suffixed 64_; then scipy's 32-bit one, then a plain
// libopenblas). Returns "" when loaded (or already loaded), else why not.
// The first library that loads stays for the process.
std::string load_blas(const std::string& path);

// Whether load_blas succeeded, and the loaded library's file and sgemm symbol.
bool blas_loaded();
std::string blas_description();

// Row-major C (M x N, ldc) = op(A) @ op(B) + beta * C, float32, on the
// calling thread when a SingleThreadedBlas is alive (float_matmul's
// case), else on the library's own threads. Requires blas_loaded().
void blas_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
                int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// While one is alive, OpenBLAS runs each call on its caller's thread; the
// library's own count comes back when the last one goes. float_matmul
// threads over fixed column blocks itself: OpenBLAS's threaded driver
// sums K in blocks whose edges depend on its thread count (a float32
// 300 x 515 x 1031 product differed in the last bits between 1 and 2
// threads), and a model's results must not depend on the machine's load.
// The count is numpy's too (one library): restored, not left at 1.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;
};

// The library's thread count, and setting it (benchmarks: numpy's sgemm
// on as many threads as mixbits uses); 0 / no-op without a BLAS.
int blas_threads();
void set_blas_threads(int n);

}  // namespace mixbits
