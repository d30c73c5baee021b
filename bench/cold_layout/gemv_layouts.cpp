// The repacked 4-bit g64 M = 1 VNNI GEMV loop (a standalone copy of
// cpp/qmatmul_int8/repacked_vnni.cpp's, random codes) on two layouts, cold:
// consecutive calls rotate over copies filling >= 256 MiB. "Three arrays"
// is mixbits' repacked layout (codes, scales, biases apart); "one stream"
// puts each group's 16 scales and 16 biases after its 8 code words. Same
// instructions, other addresses; the outputs are compared bit for bit.
// bench/README.md, "M = 1 on cold weights". AVX512-VNNI CPUs only.
//
//   c++ -O2 -std=c++17 bench/cold_layout/gemv_layouts.cpp -o /tmp/gemv_layouts
//   /tmp/gemv_layouts N K [prefetch bytes ahead, default 16384]
#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <ctime>
#include <vector>
#include <algorithm>
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
constexpr int R = 16, G = 64, WG = 8;  // 4-bit g64: 8 words per group
template <bool ONE>
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
        _mm_prefetch(gp + jw * 64 + ahead, _MM_HINT_T1);
        const int j = g * WG + jw;
        for (int k = 0; k < 2; ++k) {
          const __m512i c = _mm512_and_si512(k ? _mm512_srli_epi32(w, 4) : w, _mm512_set1_epi32(0x0F0F0F0F));
          int32_t quad; std::memcpy(&quad, xq + j * 8 + k * 4, 4);
          acc[(jw * 2 + k) % 4] = _mm512_dpbusd_epi32(acc[(jw * 2 + k) % 4], c, _mm512_set1_epi32(quad));
        }
      }
      if (ONE) _mm_prefetch(gp + WG * R * 4 + ahead, _MM_HINT_T1);
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
int main(int argc, char** argv) {
  const int N = atoi(argv[1]), K = atoi(argv[2]), ahead = argc > 3 ? atoi(argv[3]) : 16384;
  const int NB = N / R, ng = K / G;
  const size_t wbytes = size_t(NB) * ng * WG * R * 4, sbytes = size_t(NB) * ng * R * 2;
  const size_t per = wbytes + 2 * sbytes;
  const int copies = std::max<size_t>(1, (size_t(256) << 20) / per + 1);
  std::vector<char*> A(copies), B(copies); std::vector<uint16_t*> S(copies), Bi(copies);
  srand(1);
  std::vector<char> w(wbytes); for (auto& c : w) c = rand();
  std::vector<uint16_t> s(sbytes / 2), bb(sbytes / 2);
  for (auto& v : s) v = 0x3c00 + (rand() & 0xff); for (auto& v : bb) v = 0xbc00 + (rand() & 0xff);
  for (int c = 0; c < copies; ++c) {
    A[c] = (char*)aligned_alloc(64, wbytes); memcpy(A[c], w.data(), wbytes);
    S[c] = (uint16_t*)aligned_alloc(64, sbytes); memcpy(S[c], s.data(), sbytes);
    Bi[c] = (uint16_t*)aligned_alloc(64, sbytes); memcpy(Bi[c], bb.data(), sbytes);
    B[c] = (char*)aligned_alloc(64, per);
    for (int64_t gi = 0; gi < int64_t(NB) * ng; ++gi) {
      const int b = gi / ng, g = gi % ng;
      char* dst = B[c] + gi * (WG * R * 4 + 64);
      memcpy(dst, A[c] + int64_t(b) * ng * WG * R * 4 + int64_t(g) * WG * R * 4, WG * R * 4);
      memcpy(dst + WG * R * 4, S[c] + gi * R, 32); memcpy(dst + WG * R * 4 + 32, Bi[c] + gi * R, 32);
    }
  }
  std::vector<int8_t> xq(K); for (auto& v : xq) v = rand() % 200 - 100;
  std::vector<float> d(ng, 0.01f), xs(ng, 0.5f), ya(N), yb(N);
  for (int round = 0; round < 3; ++round) {
    std::vector<double> ta, tb;
    for (int r = 0; r < 200; ++r) {
      const int c = r % copies;
      double t0 = cpu(); gemv<false>(A[c], S[c], Bi[c], NB, ng, xq.data(), d.data(), xs.data(), ya.data(), ahead); ta.push_back(cpu() - t0);
      t0 = cpu(); gemv<true>(B[(c + copies / 2) % copies], nullptr, nullptr, NB, ng, xq.data(), d.data(), xs.data(), yb.data(), ahead); tb.push_back(cpu() - t0);
    }
    gemv<true>(B[0], nullptr, nullptr, NB, ng, xq.data(), d.data(), xs.data(), yb.data(), ahead);
    gemv<false>(A[0], S[0], Bi[0], NB, ng, xq.data(), d.data(), xs.data(), ya.data(), ahead);
    std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end());
    printf("%dx%d copies %d ahead %d: three arrays %.3f ms (%.1f GB/s), one stream %.3f ms (%.1f GB/s); same y: %d\n", N, K, copies, ahead,
           1e3 * ta[100], per / ta[100] / 1e9, 1e3 * tb[100], per / tb[100] / 1e9, memcmp(ya.data(), yb.data(), N * 4) == 0);
  }
}
