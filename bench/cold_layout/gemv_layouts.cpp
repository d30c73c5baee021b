// The repacked 4-bit g64 M = 1 VNNI GEMV loop (a standalone copy of
// cpp/qmatmul_int8/repacked_vnni.cpp's, random codes) on two layouts, cold:
// consecutive calls rotate over copies filling >= 256 MiB. "Three arrays"
// is mixbits' repacked layout (codes, scales, biases apart); "one stream"
// puts each group's 16 scales and 16 biases after its 8 code words. Each
// layout runs twice: the full loop, and "loads only" (the same loads and
// prefetches, each word XORed into an accumulator instead of decoded and
// multiplied): the memory system's ceiling for this access pattern, so
// full / loads-only says whether the cold loop is bound by compute or by
// the reads. Same instructions on both layouts, other addresses; the full
// loops' outputs are compared bit for bit.
// bench/README.md, "M = 1 on cold weights". AVX512-VNNI CPUs only.
//
//   c++ -O2 -std=c++17 bench/cold_layout/gemv_layouts.cpp -o /tmp/gemv_layouts
//   /tmp/gemv_layouts N K [prefetch bytes ahead, default 16384; 0: none]
//   HUGE_PAGES=1 /tmp/gemv_layouts ...   # buffers on 2 MiB pages (Linux THP)
#include <immintrin.h>
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <ctime>
#include <vector>
#include <algorithm>
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
constexpr int R = 16, G = 64, WG = 8;  // 4-bit g64: 8 words per group
template <bool ONE, bool LOADS_ONLY>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
void gemv(const char* base, const uint16_t* sc, const uint16_t* bi, int NB, int ng, const int8_t* xq,
          const float* d, const float* xs, float* y, int ahead) {
  const int64_t wblock = int64_t(ng) * WG * R * 4, gbytes = WG * R * 4 + 2 * R * 2;
  for (int b = 0; b < NB; ++b) {
    __m512 accf = _mm512_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      const char* gp = ONE ? base + (int64_t(b) * ng + g) * gbytes : base + b * wblock + int64_t(g) * WG * R * 4;
      __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 8
      for (int jw = 0; jw < WG; ++jw) {
        const __m512i w = _mm512_loadu_si512(gp + jw * 64);
        if (ahead) _mm_prefetch(gp + jw * 64 + ahead, _MM_HINT_T1);
        if (LOADS_ONLY) {
          acc[jw % 4] = _mm512_xor_si512(acc[jw % 4], w);
          continue;
        }
        const int j = g * WG + jw;
        for (int k = 0; k < 2; ++k) {
          const __m512i c = _mm512_and_si512(k ? _mm512_srli_epi32(w, 4) : w, _mm512_set1_epi32(0x0F0F0F0F));
          int32_t quad; std::memcpy(&quad, xq + j * 8 + k * 4, 4);
          acc[(jw * 2 + k) % 4] = _mm512_dpbusd_epi32(acc[(jw * 2 + k) % 4], c, _mm512_set1_epi32(quad));
        }
      }
      if (ONE && ahead) _mm_prefetch(gp + WG * R * 4 + ahead, _MM_HINT_T1);
      const __m256i sh = ONE ? _mm256_loadu_si256((const __m256i*)(gp + WG * R * 4))
                             : _mm256_loadu_si256((const __m256i*)(sc + (int64_t(b) * ng + g) * R));
      const __m256i bh = ONE ? _mm256_loadu_si256((const __m256i*)(gp + WG * R * 4 + 32))
                             : _mm256_loadu_si256((const __m256i*)(bi + (int64_t(b) * ng + g) * R));
      const __m512 s16 = _mm512_cvtph_ps(sh), b16 = _mm512_cvtph_ps(bh);
      const __m512i iq = _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));
      accf = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iq), _mm512_mul_ps(s16, _mm512_set1_ps(d[g])), accf);
      accf = _mm512_fmadd_ps(b16, _mm512_set1_ps(xs[g]), accf);
    }
    _mm512_storeu_ps(y + b * R, accf);
  }
}
// 2 MiB-aligned, whole 2 MiB pages; with HUGE_PAGES set, advised as
// transparent huge pages before the first write (so they fault in huge).
static char* alloc(size_t n) {
  const size_t page = size_t(2) << 20, size = (n + page - 1) / page * page;
  char* p = static_cast<char*>(aligned_alloc(page, size));
  if (std::getenv("HUGE_PAGES")) madvise(p, size, MADV_HUGEPAGE);
  return p;
}
int main(int argc, char** argv) {
  if (argc < 3) { std::fprintf(stderr, "usage: gemv_layouts N K [ahead]\n"); return 2; }
  const int N = atoi(argv[1]), K = atoi(argv[2]), ahead = argc > 3 ? atoi(argv[3]) : 16384;
  const int NB = N / R, ng = K / G;
  const size_t wbytes = size_t(NB) * ng * WG * R * 4, sbytes = size_t(NB) * ng * R * 2;
  const size_t per = wbytes + 2 * sbytes;
  const int copies = std::max<size_t>(1, (size_t(256) << 20) / per + 1);
  std::vector<char*> A(copies), B(copies); std::vector<uint16_t*> S(copies), Bi(copies);
  srand(1);
  std::vector<char> w(wbytes); for (auto& c : w) c = rand();
  std::vector<uint16_t> s(sbytes / 2), bb(sbytes / 2);
  for (auto& v : s) v = 0x3c00 + (rand() & 0xff);
  for (auto& v : bb) v = 0xbc00 + (rand() & 0xff);
  for (int c = 0; c < copies; ++c) {
    A[c] = alloc(wbytes); memcpy(A[c], w.data(), wbytes);
    S[c] = (uint16_t*)alloc(sbytes); memcpy(S[c], s.data(), sbytes);
    Bi[c] = (uint16_t*)alloc(sbytes); memcpy(Bi[c], bb.data(), sbytes);
    B[c] = alloc(per);
    for (int64_t gi = 0; gi < int64_t(NB) * ng; ++gi) {
      const int b = gi / ng, g = gi % ng;
      char* dst = B[c] + gi * (WG * R * 4 + 64);
      memcpy(dst, A[c] + int64_t(b) * ng * WG * R * 4 + int64_t(g) * WG * R * 4, WG * R * 4);
      memcpy(dst + WG * R * 4, S[c] + gi * R, 32); memcpy(dst + WG * R * 4 + 32, Bi[c] + gi * R, 32);
    }
  }
  std::vector<int8_t> xq(K); for (auto& v : xq) v = rand() % 200 - 100;
  std::vector<float> d(ng, 0.01f), xs(ng, 0.5f), ya(N), yb(N);
  // Median GB/s of 200 calls, call r on copy r % copies.
  auto rate = [&](auto&& call) {
    std::vector<double> t;
    for (int r = 0; r < 200; ++r) {
      const double t0 = cpu();
      call(r % copies);
      t.push_back(cpu() - t0);
    }
    std::sort(t.begin(), t.end());
    return per / t[100] / 1e9;
  };
  const int8_t* q = xq.data(); const float* dd = d.data(); const float* xx = xs.data();
  std::printf("%dx%d, %d copies, prefetch %d B ahead, %s pages; GB/s (median of 200 calls)\n", N, K,
              copies, ahead, std::getenv("HUGE_PAGES") ? "2 MiB" : "default");
  for (int round = 0; round < 3; ++round) {
    const double a2 = rate([&](int c) { gemv<false, false>(A[c], S[c], Bi[c], NB, ng, q, dd, xx, ya.data(), ahead); });
    const double a0 = rate([&](int c) { gemv<false, true>(A[c], S[c], Bi[c], NB, ng, q, dd, xx, ya.data(), ahead); });
    const double b2 = rate([&](int c) { gemv<true, false>(B[c], nullptr, nullptr, NB, ng, q, dd, xx, yb.data(), ahead); });
    const double b0 = rate([&](int c) { gemv<true, true>(B[c], nullptr, nullptr, NB, ng, q, dd, xx, yb.data(), ahead); });
    gemv<false, false>(A[0], S[0], Bi[0], NB, ng, q, dd, xx, ya.data(), ahead);
    gemv<true, false>(B[0], nullptr, nullptr, NB, ng, q, dd, xx, yb.data(), ahead);
    std::printf("  three arrays: full %.1f, loads only %.1f | one stream: full %.1f, loads only %.1f | same y: %d\n",
                a2, a0, b2, b0, memcmp(ya.data(), yb.data(), size_t(N) * 4) == 0);
  }
}
