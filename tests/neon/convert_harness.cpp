// Runs common/convert.h's NEON conversions against the scalar ones: every
// float16 / bfloat16 bit pattern widened, and edge and random float32
// values narrowed to float16, at lengths that leave every tail. Built for
// aarch64 and run under qemu-user by tests/test_convert_neon_emulated.py;
// prints one line per failure and the count.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/convert.h"

using namespace mixbits;

int main() {
  int failures = 0;
  std::vector<uint16_t> bits(65536);
  for (int i = 0; i < 65536; ++i) bits[size_t(i)] = uint16_t(i);
  for (DType dt : {DType::f16, DType::bf16}) {
    for (int64_t off : {0, 1, 3}) {
      const int64_t n = 65536 - off;
      std::vector<float> a(n), b(n);
      widen_to_f32_ref(bits.data(), off, n, dt, a.data());
      widen_to_f32_neon(bits.data(), off, n, dt, b.data());
      for (int64_t i = 0; i < n; ++i) {
        const bool same = std::isnan(a[i]) ? std::isnan(b[i]) : std::memcmp(&a[i], &b[i], 4) == 0;
        if (!same && failures++ < 20) std::printf("widen dt=%d bits=%04x\n", int(dt), bits[off + i]);
      }
    }
  }
  std::vector<float> x = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.99f, 65520.0f,
                          -65520.0f, 1e30f, 6.1035156e-05f, 3.0517578e-05f, 5.9604645e-08f,
                          2.9802322e-08f, 2.9802326e-08f, 1.0f + 4.8828125e-04f, 1e-45f, -1e-40f};
  uint32_t payload[] = {0x7f800001u, 0xffc01234u, 0x7fbfffffu};
  for (uint32_t u : payload) {
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-30, 17);
  for (int i = 0; i < 20000; ++i) x.push_back(nd(rng) * std::ldexp(1.0f, ex(rng)));
  for (int i = 0; i < 4000; ++i)  // halfway between two float16 values
    x.push_back((float(i % 2048 + 1) + 0.5f) * std::ldexp(1.0f, ex(rng) - 10));
  for (int64_t off : {0, 1, 2, 3}) {
    const int64_t n = int64_t(x.size()) - off;
    std::vector<uint16_t> a(n), b(n);
    narrow_from_f32_ref(x.data() + off, n, DType::f16, a.data(), 0);
    narrow_from_f32_neon(x.data() + off, n, DType::f16, b.data(), 0);
    for (int64_t i = 0; i < n; ++i)
      if (a[i] != b[i] && failures++ < 40)
        std::printf("narrow %a: %04x vs %04x\n", double(x[off + i]), a[i], b[i]);
  }
  std::printf("convert: %d failures\n", failures);
  return failures ? 1 : 0;
}
