// The transposed product dx = dy · W on x86, the gradient wrt x (see
// avx2_table.h for the files). The forward's pieces are reused: a tile
// of W [nb rows x kc columns] is dequantized by dequant_tile (decode order
// along the columns), transposed to [kc x nb] with each row one true column
// of W, and the forward's micro-kernel runs over it with dy as the
// activation block: its inner dimension is now the nb rows of W
// (t_item_avx2). The AVX-512 row runs a broadcast kernel over the
// untransposed tile instead (t_item_avx512, below: faster there). Threads split the K output columns
// (work items of kTKC columns inside one segment), so every dx element has
// one writer and no reduction is needed.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "qmatmul/avx2_decode.h"
#include "qmatmul/avx2_table.h"

namespace mixbits {
namespace {

// Measured here (1 thread, 4-bit g64, M=256/1024, with the 16-lane dot
// micro-kernel): 64 x 1024 ran at 85-92 GFLOP/s, 128 x 256 at 50-58
// (32..256 x 256..2048 tried; chosen by measurement, not a cache model). Long rows amortize the micro-kernel's
// horizontal sums; its few rows of dy stay in L1 across the tile's columns.
// Group size 128 widens a tile to 128 columns.
constexpr int kTKC = 64;     // W columns (dx columns) per tile, at least
constexpr int kTKCMax = 128; // ... and at most (the largest group size)
constexpr int kTNB = 1024;   // W rows per tile: the micro-kernel's inner length

// rows 0..7 of an 8x8 block (row stride lds) -> o[c] = column c.
inline void transpose8x8(const float* src, int64_t lds, __m256 o[8]) {
  __m256 t[8], u[8];
  for (int j = 0; j < 8; j += 2) {
    const __m256 a = _mm256_loadu_ps(src + j * lds), b = _mm256_loadu_ps(src + (j + 1) * lds);
    t[j] = _mm256_unpacklo_ps(a, b);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[j + 1] = _mm256_unpackhi_ps(a, b);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int h = 0; h < 8; h += 4) {  // rows 4h'..4h'+3: columns c | c+4
    u[h + 0] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    o[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    o[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}

// tile: [nbp x kc] (row stride kc) in decode order, rows >= nb already
// zero; T: [kc x ldt], T row c = true column c of the tile. Decode position
// 8k+i of a unit holds column 4i+k, so output vector i of the 8x8 block at
// decode positions 8k..8k+7 is stored to T row 4i+k of the unit.
void transpose_tile(const float* tile, int nbp, int kc, float* T, int ldt) {
  __m256 o[8];
  for (int r = 0; r < nbp; r += 8)
    for (int u = 0; u < kc; u += kUnit)
      for (int k = 0; k < 4; ++k) {
        transpose8x8(tile + int64_t(r) * kc + u + 8 * k, kc, o);
        for (int i = 0; i < 8; ++i)
          _mm256_storeu_ps(T + int64_t(u + 4 * i + k) * ldt + r, o[i]);
      }
}

// dx columns [s.k0 + c0, s.k0 + c1) for all M rows. dy has row stride ldd
// >= round_up(N, 16) with zeros past N, so the micro-kernel's reads past
// the last W row meet zeros in both operands.
}  // namespace

void t_item_avx2(const float* dy, int64_t ldd, int M, const QMatView& w,
                 const QmmTable& t, const TItem& it, float* dx) {
  const SegView& s = w.segs[it.seg];
  const int N = w.N, K = w.K, kc = it.c1 - it.c0;
  thread_local std::vector<float> tile, T;
  tile.resize(size_t(kTNB) * kTKCMax);
  T.resize(size_t(kTKCMax) * kTNB);
  float* out = dx + s.k0 + it.c0;
  for (int m = 0; m < M; ++m) std::fill(out + int64_t(m) * K, out + int64_t(m) * K + kc, 0.0f);
  for (int n0 = 0; n0 < N; n0 += kTNB) {
    const int nb = std::min(kTNB, N - n0), nbp = (nb + 15) / 16 * 16;
    (*t.dequant)[s.bits][group_size_col(s.group_size)](s, w.sdtype, n0, nb, it.c0, it.c1,
                                               tile.data(), kc);
    std::fill(tile.data() + int64_t(nb) * kc, tile.data() + int64_t(nbp) * kc, 0.0f);
    transpose_tile(tile.data(), nbp, kc, T.data(), nbp);
    for (int m = 0; m < M; m += t.mr) {
      const int mr = std::min(t.mr, M - m);
      for (int j = 0; j < kc; j += t.nr) {
        const int nr = std::min(t.nr, kc - j);
        t.micro[mr][nr](dy + int64_t(m) * ldd + n0, int(ldd), T.data() + int64_t(j) * nbp,
                         nbp, nbp, out + int64_t(m) * K + j, K);
      }
    }
  }
}

namespace {

// The 16-lane version (AVX-512 row) skips the transpose: lanes run along
// dx's columns instead, each dy element is broadcast against a row of the
// tile (still in decode order), and accumulators live across the whole
// tile with no horizontal sums, so a tile can be small enough for L1.
// Measured here, 1 thread: 120-125 GFLOP/s on 1536x576 and 576x1536
// (numpy's sgemm: ~105-120) against 90-95 for the transposed tiles with the
// 16-lane dot micro-kernel; 128 rows per tile beat 64/192/256/512 except on
// 49152x576 (256: ~88 against ~80). The same scheme with 8 lanes (6x2
// registers, 8 loads per 12 FMAs) measured slower than the transposed
// tiles (50-57 against 62-75 GFLOP/s), so AVX2-only CPUs keep those.
constexpr int kBNB = 128;  // W rows per tile of the broadcast kernel

// o[i][0..16*NV) += sum_p dy[i*ldd + p] * t[p*ldt + 0..16*NV) for MR rows.
template <int MR, int NV>
MIXBITS_AVX512 void bcast512(const float* dy, int64_t ldd, const float* t, int ldt,
                             int nb, float* o, int ldo) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int p = 0; p < nb; ++p) {
    __m512 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_ps(t + int64_t(p) * ldt + 16 * j);
    for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(dy[i * ldd + p]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(b, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(o + i * ldo + 16 * j,
                       _mm512_add_ps(_mm512_loadu_ps(o + i * ldo + 16 * j), acc[i][j]));
}

// 6 x 64 (24 accumulators, 4 tile loads and 6 broadcasts per 24 FMAs) and
// 6 x 32 for an item of one 32-column group; fewer rows at the end of M.
using BcastFn = void (*)(const float*, int64_t, const float*, int, int, float*, int);
constexpr int kBMR = 6;
template <int NV>
constexpr BcastFn bcast_rows[kBMR + 1] = {nullptr,         bcast512<1, NV>, bcast512<2, NV>,
                                          bcast512<3, NV>, bcast512<4, NV>, bcast512<5, NV>,
                                          bcast512<6, NV>};

}  // namespace

// t_item_avx2 with the broadcast kernel. dx of the item accumulates in
// decode order in `acc` ([M x kc]) and is re-ordered once at the end.
void t_item_avx512(const float* dy, int64_t ldd, int M, const QMatView& w,
                   const QmmTable& t, const TItem& it, float* dx) {
  const SegView& s = w.segs[it.seg];
  const int N = w.N, K = w.K, kc = it.c1 - it.c0;
  thread_local std::vector<float> tile, acc;
  tile.resize(size_t(kBNB) * kTKCMax);
  acc.assign(size_t(M) * kc, 0.0f);
  for (int n0 = 0; n0 < N; n0 += kBNB) {
    const int nb = std::min(kBNB, N - n0);
    (*t.dequant)[s.bits][group_size_col(s.group_size)](s, w.sdtype, n0, nb, it.c0, it.c1,
                                               tile.data(), kc);
    for (int m = 0; m < M; m += kBMR) {
      const int mr = std::min(kBMR, M - m);
      const float* d = dy + int64_t(m) * ldd + n0;
      float* o = acc.data() + int64_t(m) * kc;
      int j = 0;
      for (; j + 64 <= kc; j += 64) bcast_rows<4>[mr](d, ldd, tile.data() + j, kc, nb, o + j, kc);
      if (j < kc) bcast_rows<2>[mr](d, ldd, tile.data() + j, kc, nb, o + j, kc);
    }
  }
  // Decode position 8k+i of a unit holds column 4i+k.
  float* out = dx + s.k0 + it.c0;
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < kc; ++c)
      out[int64_t(m) * K + c] = acc[int64_t(m) * kc + (c & ~31) + 8 * (c & 3) + ((c & 31) >> 2)];
}

void qmm_t_run_table(const QmmTable& t, const float* dy, int M, const QMatView& w, float* dx) {
  const int N = w.N;
  const int64_t ldd = (int64_t(N) + 15) / 16 * 16;
  std::vector<float> padded;
  if (ldd != N) {
    padded.assign(size_t(M) * ldd, 0.0f);
    parallel_for(M, 64, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        std::memcpy(padded.data() + m * ldd, dy + m * N, sizeof(float) * N);
    });
    dy = padded.data();
  }
  std::vector<TItem> items;
  for (size_t si = 0; si < w.segs.size(); ++si) {
    const SegView& s = w.segs[si];
    // Items never split a group: dequant_tile works on whole groups.
    const int width = std::max(kTKC, s.group_size);
    for (int c0 = 0; c0 < s.k; c0 += width)
      items.push_back({int(si), c0, std::min(s.k, c0 + width)});
  }
  parallel_for(int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      t.t_item(dy, ldd, M, w, t, items[i], dx);
  });
}

}  // namespace mixbits
