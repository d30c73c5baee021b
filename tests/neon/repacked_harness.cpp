// Runs the repacked-layout integer kernels of an aarch64 build (what
// RepackedQMatmul runs there: select_repacked's table through
// repacked_int_run) on cases that tests/test_repacked_neon_emulated.py
// writes: the buffers are the real wq_r / scales_r / biases_r of the
// extension's repack_segment, byte for byte. Built for aarch64, run under
// qemu-user.
//
//   repacked_harness CASES OUT
//
// CASES: "MBR1", u32 count, then per case: i32 activations (1 int8, 2
// int16), M, N, K, scale dtype (DType), poison (1: the padding rows of the
// last block get nonzero codes, scales and biases, so a kernel that stores
// them corrupts a real output or the guard), segment count; per segment
// bits, group size, k; x float32 [M, K]; per segment wq_r, scales_r,
// biases_r as repack_segment stores them. OUT gets each case's y float32
// [M, N].
//
// Exits 3 if this build offers no repacked table for backend auto / neon
// (or one for ref), 4 if a kernel wrote past y.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "qmatmul_int8/kernel.h"

#include "harness_io.h"

using namespace mixbits;

const char* const kHarnessName = "repacked_harness";

namespace {

// Elements of a [NB, cols, 16] array as 32-bit words (wq_r) or 16/32-bit
// scales, copied into storage of their type's alignment.
template <class E>
std::vector<E> take_array(Reader& r, size_t n) {
  std::vector<E> v(n);
  std::memcpy(v.data(), r.take(n * sizeof(E)), n * sizeof(E));
  return v;
}

// Rows r >= live of the last block of a [NB, cols, 16] array set to `val`.
template <class E>
void poison_tail(std::vector<E>& a, int NB, int cols, int live, E val) {
  for (int c = 0; c < cols; ++c)
    for (int r = live; r < kRepackRows; ++r) a[(size_t(NB - 1) * cols + c) * kRepackRows + r] = val;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) die("usage: repacked_harness CASES OUT");
  // The arm64 build must have its kernels where auto or neon is asked for,
  // and leave ref to the un-repacked path.
  for (bool int16 : {false, true})
    if (!select_repacked(int16, Backend::Auto) || select_repacked(int16, Backend::Auto) !=
        select_repacked(int16, Backend::Neon) || select_repacked(int16, Backend::Ref))
      die("select_repacked does not offer the NEON tables", 3);

  Reader r = read_case_file(argv[1], "MBR1");
  const int count = r.i32();
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) die("cannot open the output file");

  for (int c = 0; c < count; ++c) {
    const int act = r.i32(), M = r.i32();
    QMatView shape;
    shape.N = r.i32();
    shape.K = r.i32();
    shape.sdtype = DType(r.i32());
    const bool poison = r.i32() != 0;
    const int nseg = r.i32();
    const int N = shape.N, NB = int(repack_blocks(N));
    const int live = N - (NB - 1) * kRepackRows;  // real rows of the last block
    int k0 = 0;
    for (int s = 0; s < nseg; ++s) {
      SegView v{};
      v.bits = r.i32();
      v.group_size = r.i32();
      v.k = r.i32();
      v.k0 = k0;
      k0 += v.k;
      shape.segs.push_back(v);
    }
    if (k0 != shape.K) die("segments do not cover K");
    std::vector<float> x = take_array<float>(r, size_t(M) * shape.K);
    std::vector<std::vector<uint32_t>> codes(nseg);
    std::vector<std::vector<uint16_t>> halves(2 * nseg);
    std::vector<std::vector<float>> floats(2 * nseg);
    std::vector<RSeg> rsegs;
    for (int s = 0; s < nseg; ++s) {
      const SegView& v = shape.segs[s];
      const int words = int(int64_t(v.k) * v.bits / 32), ng = v.k / v.group_size;
      codes[s] = take_array<uint32_t>(r, size_t(NB) * words * kRepackRows);
      if (poison) poison_tail<uint32_t>(codes[s], NB, words, live, 0xFFFFFFFFu);
      const void* sb[2];
      for (int j = 0; j < 2; ++j) {
        const size_t n = size_t(NB) * ng * kRepackRows;
        if (shape.sdtype == DType::f32) {
          floats[2 * s + j] = take_array<float>(r, n);
          if (poison) poison_tail<float>(floats[2 * s + j], NB, ng, live, 1.0f);
          sb[j] = floats[2 * s + j].data();
        } else {
          halves[2 * s + j] = take_array<uint16_t>(r, n);
          // 1.0 in f16 / bf16
          if (poison) poison_tail<uint16_t>(halves[2 * s + j], NB, ng, live,
                                            shape.sdtype == DType::f16 ? 0x3C00 : 0x3F80);
          sb[j] = halves[2 * s + j].data();
        }
      }
      rsegs.push_back({codes[s].data(), sb[0], sb[1], shape.sdtype, words, ng});
    }
    // y poisoned (a row the driver forgets shows as NaN), with a guard of
    // finite values after it (a store of a padding row adds to it) that no
    // kernel may touch.
    constexpr size_t kGuard = 64;
    constexpr float kGuardValue = 1234.5f;
    std::vector<float> y(size_t(M) * N + kGuard, kGuardValue);
    std::fill(y.begin(), y.begin() + size_t(M) * N, std::numeric_limits<float>::quiet_NaN());
    const RTable* t = select_repacked(act == 2, Backend::Auto);
    if (act == 2) repacked_int_run<int16_t>(*t, x.data(), M, shape, rsegs.data(), y.data());
    else repacked_int_run<int8_t>(*t, x.data(), M, shape, rsegs.data(), y.data());
    for (size_t i = size_t(M) * N; i < y.size(); ++i)
      if (y[i] != kGuardValue) die("a kernel wrote past the output", 4);
    std::fwrite(y.data(), 4, size_t(M) * N, out);
  }
  std::fclose(out);
  return 0;
}
