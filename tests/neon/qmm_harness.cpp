// Runs the quantized-matmul CPU kernels of an aarch64 build on cases that
// the Python tests write (tests/test_qmatmul_neon_emulated.py): the
// buffers are the real packed codes, scales and biases of mixbits /
// mx.quantize, byte for byte. Built for aarch64 and run under qemu-user.
//
//   qmm_harness CASES OUT NAME[,NAME...]
//
// CASES: "MBQ1", u32 count, then per case: i32 kind (0 y = x·Wᵀ, 1 dx =
// dy·W), M, N, K, scale dtype (DType), segment count; per segment bits,
// group size, k; the float32 input ([M, K] for kind 0, [M, N] for 1); per
// segment the codes, scales and biases as MLX stores them. OUT gets, per
// case, one float32 output per NAME of that kind, in the order given.
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "qmatmul/kernel.h"
#include "qmatmul_int8/kernel.h"

#include "harness_io.h"

using namespace mixbits;

const char* const kHarnessName = "qmm_harness";

namespace {

struct Kernel {
  const char* name;
  int kind;
  QmmRun fwd;
  QmmTRun t;
};

// Every kernel an aarch64 build can select, by the name the tests use.
const Kernel kKernels[] = {
    {"ref", 0, qmm_ref_run, nullptr},
    {"neon", 0, qmm_neon_run, nullptr},
    {"int8_ref", 0, qmm_int8_ref_run, nullptr},
    {"int8", 0, select_qmm_int8(Backend::Auto), nullptr},
    {"int16_ref", 0, qmm_int16_ref_run, nullptr},
    {"int16", 0, select_qmm_int16(Backend::Auto), nullptr},
    {"t_ref", 1, nullptr, qmm_t_ref_run},
    {"t_neon", 1, nullptr, select_qmm_t(Backend::Neon)},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) die("usage: qmm_harness CASES OUT NAME[,NAME...]");
  Reader r = read_case_file(argv[1], "MBQ1");
  const int count = r.i32();

  std::vector<const Kernel*> picked;
  for (std::string names = argv[3]; !names.empty();) {
    const size_t comma = names.find(',');
    const std::string name = names.substr(0, comma);
    names = comma == std::string::npos ? "" : names.substr(comma + 1);
    const Kernel* k = nullptr;
    for (const Kernel& c : kKernels)
      if (name == c.name) k = &c;
    if (!k) die(("unknown kernel " + name).c_str());
    picked.push_back(k);
  }

  FILE* out = std::fopen(argv[2], "wb");
  if (!out) die("cannot open the output file");
  for (int c = 0; c < count; ++c) {
    const int kind = r.i32(), M = r.i32();
    QMatView w;
    w.N = r.i32();
    w.K = r.i32();
    w.sdtype = DType(r.i32());
    const int nseg = r.i32();
    const int esz = w.sdtype == DType::f32 ? 4 : 2;
    int k0 = 0;
    for (int s = 0; s < nseg; ++s) {
      SegView v{};
      v.bits = r.i32();
      v.group_size = r.i32();
      v.k = r.i32();
      v.k0 = k0;
      k0 += v.k;
      w.segs.push_back(v);
    }
    if (k0 != w.K) die("segments do not cover K");
    const int64_t in_cols = kind == 0 ? w.K : w.N, out_cols = kind == 0 ? w.N : w.K;
    // Copies with the alignment the extension's MLX buffers have.
    std::vector<float> in(size_t(M) * in_cols);
    std::memcpy(in.data(), r.take(in.size() * 4), in.size() * 4);
    std::vector<std::vector<uint32_t>> codes(nseg);
    std::vector<std::vector<uint16_t>> halves(2 * nseg);
    std::vector<std::vector<float>> floats(2 * nseg);
    for (int s = 0; s < nseg; ++s) {
      SegView& v = w.segs[s];
      codes[s].resize(size_t(w.N) * v.words_per_row());
      std::memcpy(codes[s].data(), r.take(codes[s].size() * 4), codes[s].size() * 4);
      v.wq = codes[s].data();
      const size_t ns = size_t(w.N) * v.groups_per_row();
      const void* sb[2];
      for (int j = 0; j < 2; ++j) {
        const char* p = r.take(ns * esz);
        if (esz == 4) {
          floats[2 * s + j].resize(ns);
          std::memcpy(floats[2 * s + j].data(), p, ns * 4);
          sb[j] = floats[2 * s + j].data();
        } else {
          halves[2 * s + j].resize(ns);
          std::memcpy(halves[2 * s + j].data(), p, ns * 2);
          sb[j] = halves[2 * s + j].data();
        }
      }
      v.scales = sb[0];
      v.biases = sb[1];
    }
    for (const Kernel* k : picked) {
      if (k->kind != kind) continue;
      // Poisoned, so an output a kernel forgets to write shows as NaN.
      std::vector<float> y(size_t(M) * out_cols, std::numeric_limits<float>::quiet_NaN());
      if (kind == 0) k->fwd(in.data(), M, w, y.data());
      else k->t(in.data(), M, w, y.data());
      std::fwrite(y.data(), 4, y.size(), out);
    }
  }
  std::fclose(out);
  return 0;
}
