// Runs the fp-mode matmul kernels of an aarch64 build (cpp/fpmatmul) on
// cases the Python tests write (tests/test_fp_modes_kernel.py): codes and
// scales exactly as mx.quantize stores them. Built for aarch64, run under
// qemu-user.
//
//   fpm_harness CASES OUT
//
// CASES: "MBF1", u32 count, then per case: i32 mode (FpMode), transpose
// (1: y = x·Wᵀ, 0: y = x·W), M, N, K (W stored [N, K]); the float32 x
// ([M, K] or [M, N]); the codes [N, K*bits/32] (uint32) and the scales
// [N, K/group] (uint8). OUT gets per case y ([M, N] or [M, K]) float32 of
// the reference, then of the NEON kernel (Backend::Auto's choice).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "fpmatmul/kernel.h"
#include "harness_io.h"

using namespace mixbits;

const char* const kHarnessName = "fpm_harness";

int main(int argc, char** argv) {
  if (argc != 3) die("usage: fpm_harness CASES OUT");
  Reader r = read_case_file(argv[1], "MBF1");
  const int count = r.i32();
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) die("cannot open the output file");
  const FpmRun kernels[2][2] = {{fpm_t_ref_run, select_fpm_t(Backend::Auto)},
                                {fpm_ref_run, select_fpm(Backend::Auto)}};
  if (kernels[1][1] != fpm_neon_run || kernels[0][1] != fpm_t_neon_run)
    die("Auto did not select the NEON kernels");
  for (int c = 0; c < count; ++c) {
    FpView w;
    w.mode = FpMode(r.i32());
    const int transpose = r.i32() != 0;
    const int M = r.i32();
    w.N = r.i32();
    w.K = r.i32();
    const int64_t in = transpose ? w.K : w.N, out_cols = transpose ? w.N : w.K;
    std::vector<float> x(size_t(M) * in);
    std::memcpy(x.data(), r.take(x.size() * 4), x.size() * 4);
    std::vector<uint32_t> wq(size_t(w.N) * w.words_per_row());
    std::memcpy(wq.data(), r.take(wq.size() * 4), wq.size() * 4);
    std::vector<uint8_t> sc(size_t(w.N) * w.groups_per_row());
    std::memcpy(sc.data(), r.take(sc.size()), sc.size());
    w.wq = wq.data();
    w.scales = sc.data();
    for (FpmRun k : kernels[transpose]) {
      // Poisoned, so an output a kernel forgets to write shows as NaN.
      std::vector<float> y(size_t(M) * out_cols, std::numeric_limits<float>::quiet_NaN());
      k(x.data(), M, w, y.data());
      std::fwrite(y.data(), 4, y.size(), out);
    }
  }
  std::fclose(out);
  return 0;
}
