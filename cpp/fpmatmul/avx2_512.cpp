// The fp-mode matmul of the Avx512 backend (CPUs with AVX-512F; built with
// the AVX2 files and reached only after the CPUID check, through function
// target attributes). Calls of more than 4 x rows (prompts) run 16-lane
// tiles: avx2.cpp's scheme with e2m1 as one permute of the group's 16
// signed values times its scale, e4m3 through float16 as in
// avx2_decode.h, each output summing 16-column chunks into two
// accumulators (even, odd chunks) and one reduction. Calls of up to 4 rows
// (decode steps) run the 8-lane kernel: a 16-lane version of its fused
// loop measured slower at M = 1 (one thread, Xeon host, 4096x4096: mxfp4
// 1.51 vs 1.65 ms, nvfp4 1.63 vs 2.04, mxfp8 1.74 vs 2.14), where the tiles
// are 1.5-1.7x faster at M = 32 and 256. So up to 4 rows this backend is
// bit for bit the Avx2 one, and above it sums in another order (float
// rounding apart); neither depends on the blocking or the threads.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "fpmatmul/avx2_decode.h"
#include "fpmatmul/kernel.h"

#define MIXBITS_FP512 __attribute__((target("avx512f,avx2,fma,f16c")))

namespace mixbits {

namespace {

// The signed e2m1 values, by code.
constexpr float kE2m1Signed[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 16 codes of two words: lane i gets tab[code_i] (permutexvar reads the
// low 4 bits).
MIXBITS_FP512 inline __m512 e2m1x16(const uint32_t* p, __m512 tab) {
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(int(p[0]))),
                                           _mm256_set1_epi32(int(p[1])), 1);
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(words, shifts), tab);
}

// 16 e4m3 codes times 2^-8 (avx2_decode.h's e4m3x16, one 16-lane widening).
MIXBITS_FP512 inline __m512 e4m3x16_512(const uint8_t* p) {
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(int16_t(0xbfff)));
  const __m256i e_m = _mm256_set1_epi16(0x3f80);
  h = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, e_m), e_m));
  return _mm512_cvtph_ps(h);
}

// Group g of a row, decoded into v[0 .. group/16).
template <FpMode MD>
MIXBITS_FP512 inline void decode_group16(const uint32_t* row, const uint8_t* srow, int64_t g, __m512* v) {
  constexpr int G = fp_mode_group(MD);
  constexpr int kGroupBytes = G * fp_mode_bits(MD) / 8;
  const ScaleTables& t = scale_tables();
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + g * kGroupBytes;
  if ((reinterpret_cast<uintptr_t>(bytes) & 63) < uintptr_t(kGroupBytes))
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchAhead, _MM_HINT_T1);
  if constexpr (MD == FpMode::Mxfp8) {
    const uint8_t sb = srow[g];
    // 2^8 · scale exact below byte 247 (as avx2_decode.h's decode_group)
    const __m512 sc = _mm512_set1_ps(sb < 247 ? 256.0f * t.e8m0[sb] : t.e8m0[sb]);
    for (int i = 0; i < G / 16; ++i) {
      __m512 f = e4m3x16_512(bytes + 16 * i);
      if (sb >= 247) f = _mm512_mul_ps(f, _mm512_set1_ps(256.0f));
      v[i] = _mm512_mul_ps(f, sc);
    }
  } else {
    const float s = MD == FpMode::Nvfp4 ? t.e4m3[srow[g]] : t.e8m0[srow[g]];
    const __m512 tab = _mm512_mul_ps(_mm512_loadu_ps(kE2m1Signed), _mm512_set1_ps(s));
    const uint32_t* p = row + g * (G / 8);
    for (int i = 0; i < G / 16; ++i) v[i] = e2m1x16(p + 2 * i, tab);
  }
}

MIXBITS_FP512 inline float reduce16(__m512 a0, __m512 a1) {
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// MR x rows times NR decoded weight rows, the same chunk-to-accumulator rule.
template <int MR, int NR>
MIXBITS_FP512 inline void tile16(const float* const* xr, const float* const* wr, int64_t K,
                                 float (*out)[NR]) {
  __m512 a0[MR][NR], a1[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) a0[i][j] = a1[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(xr[i] + k);
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = _mm512_loadu_ps(wr[j] + k);
      for (int i = 0; i < MR; ++i) a0[i][j] = _mm512_fmadd_ps(wv, xv[i], a0[i][j]);
    }
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(xr[i] + k + 16);
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = _mm512_loadu_ps(wr[j] + k + 16);
      for (int i = 0; i < MR; ++i) a1[i][j] = _mm512_fmadd_ps(wv, xv[i], a1[i][j]);
    }
  }
  if (k < K) {  // a last 16 columns: an even chunk
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = _mm512_loadu_ps(wr[j] + k);
      for (int i = 0; i < MR; ++i) a0[i][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xr[i] + k), a0[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i][j] = reduce16(a0[i][j], a1[i][j]);
}

// Many rows of x: RB rows decoded into a buffer, then 4 x 3 tiles (24
// accumulators of the 32 registers). Chunk c (16 columns) goes to
// accumulator c % 2.
template <FpMode MD>
MIXBITS_FP512 void buffered16(const float* x, int M, const FpView& w, float* y, int n0, int n1) {
  constexpr int G = fp_mode_group(MD), RB = 12, NR = 3, MR = 4;
  const int64_t K = w.K, groups = w.groups_per_row();
  std::vector<float> buf(size_t(RB) * K);
  for (int nb = n0; nb < n1; nb += RB) {
    const int rows = std::min(RB, n1 - nb);
    for (int r = 0; r < rows; ++r) {
      const uint32_t* row = w.wq + int64_t(nb + r) * w.words_per_row();
      const uint8_t* srow = w.scales + int64_t(nb + r) * groups;
      float* dst = buf.data() + int64_t(r) * K;
      for (int64_t g = 0; g < groups; ++g) {
        __m512 v[G / 16];
        decode_group16<MD>(row, srow, g, v);
        for (int c = 0; c < G / 16; ++c) _mm512_storeu_ps(dst + g * G + 16 * c, v[c]);
      }
    }
    for (int r0 = 0; r0 < rows; r0 += NR) {
      const float* wr[NR];
      for (int j = 0; j < NR; ++j) wr[j] = buf.data() + int64_t(std::min(r0 + j, rows - 1)) * K;
      const int nr = std::min(NR, rows - r0);
      float out[MR][NR];
      int m = 0;
      for (; m + MR <= M; m += MR) {
        const float* xr[MR];
        for (int i = 0; i < MR; ++i) xr[i] = x + int64_t(m + i) * K;
        tile16<MR, NR>(xr, wr, K, out);
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < nr; ++j) y[int64_t(m + i) * w.N + nb + r0 + j] = out[i][j];
      }
      for (; m < M; ++m) {
        const float* xr[1] = {x + int64_t(m) * K};
        tile16<1, NR>(xr, wr, K, out);
        for (int j = 0; j < nr; ++j) y[int64_t(m) * w.N + nb + r0 + j] = out[0][j];
      }
    }
  }
}

template <FpMode MD>
void run_mode16(const float* x, int M, const FpView& w, float* y) {
  parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) { buffered16<MD>(x, M, w, y, int(n0), int(n1)); });
}

}  // namespace

void fpm_avx512_run(const float* x, int M, const FpView& w, float* y) {
  if (M <= 0 || w.N <= 0) return;
  if (M <= 4) return fpm_avx2_run(x, M, w, y);  // its fused decode-step path
  switch (w.mode) {
    case FpMode::Mxfp4: return run_mode16<FpMode::Mxfp4>(x, M, w, y);
    case FpMode::Nvfp4: return run_mode16<FpMode::Nvfp4>(x, M, w, y);
    case FpMode::Mxfp8: return run_mode16<FpMode::Mxfp8>(x, M, w, y);
  }
}

}  // namespace mixbits
