// x86 backends of the mixed-segment quantized matmul: the two table rows
// (8-lane AVX2, 16-lane AVX-512F) and the forward driver they share. The
// kernels live in the files avx2_table.h lists; the decode scheme is
// described in avx2_decode.h.
//
// Regimes, chosen by M against the row's small_m:
//  - small M (batch-1 and decoding): every weight is decoded once and
//    FMA'd against max_mb rows of x per pass (avx2_gemv*.cpp);
//  - larger M (prefill): tiles of W are dequantized into L2-resident
//    packed panels and the row's outer-product micro-kernel runs over them
//    against x packed once per call (avx2_panel.cpp). A repacked view
//    (QMatView::repacked, a repacked layer's prefill) takes the same
//    driver with the row's pack_r packers (avx2_panel_r.cpp) from
//    kInt8MaxM + 1 rows on: the other regimes have no reader for it.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "qmatmul/avx2_decode.h"
#include "qmatmul/avx2_table.h"
#include "qmatmul_int8/kernel.h"

namespace mixbits {

extern const QmmTable kQmmAvx2 = {
    "avx2", /*small_m=*/10, /*max_mb=*/8, &kGemvAvx2, &kDequantAvx2,
    /*mr=*/4, /*nr=*/3, kMicroAvx2, &kGemmAvx2, t_item_avx2};
// The 16-lane small-M kernel is measured fastest in passes of at most 4
// rows (4 W rows x 4 x-rows of accumulators); more rows per pass run out of
// registers, and re-decoding W per pass is cheaper than spilling.
extern const QmmTable kQmmAvx512 = {
    "avx512", /*small_m=*/40, /*max_mb=*/4, &kGemvAvx512, &kDequantAvx2,
    /*mr=*/6, /*nr=*/4, kMicroAvx512, &kGemmAvx512, t_item_avx512};

namespace {

// Forward GEMM: W rows per packed tile (kPKC columns), a multiple of every
// row's panel width; the tile (384 KB) stays in L2 while all of x streams
// past it. 96..480 rows x 256..768 columns tried; differences were within
// this shared machine's noise except kc = 256 (slower). The AVX2 row
// measured the same: kc 256, or each W panel against every x micro-panel
// (BLIS's order), were no faster anywhere and 0.8x at 4096x4096, M = 512.
constexpr int kPNB = 192;

// A float buffer with 64-byte aligned data (whole cache lines, aligned
// vector loads of the packed panels).
struct AlignedBuf {
  std::vector<float> v;
  float* get(size_t n) {
    v.resize(n + 16);
    const uintptr_t a = reinterpret_cast<uintptr_t>(v.data());
    return v.data() + ((64 - a % 64) % 64) / sizeof(float);
  }
};

// Everything one call prepares once and every worker reads.
struct Prepared {
  int M = 0, K = 0;
  // Forward GEMM: x packed per kc block of each segment (avx2_panel.cpp):
  // the block at column kg (width kc) starts at xp + Mp*kg and holds Mp/mr
  // micro-panels of kc*mr floats; Mp = M rounded up to mr, rows past M zero.
  int Mp = 0;
  AlignedBuf xpb;
  float* xp = nullptr;
  // Small-M path, per segment: x in decode order times 2^-code_exp
  // ([M, k]) and per-group sums of x ([M, groups]).
  std::vector<std::vector<float>> xq, xs;
};

// Each segment's kernels from the row, looked up once per call. pack is
// the row's panel packer for the segment's layout (w.repacked).
struct SegKernels {
  GemvFn gemv;
  DequantFn dequant;
  PackWFn pack;
};

const float* unit_scale(int bits) {
  static constexpr UnitScale<2> u2{};
  static constexpr UnitScale<3> u3{};
  static constexpr UnitScale<4> u4{};
  static constexpr UnitScale<5> u5{};
  static constexpr UnitScale<6> u6{};
  static constexpr UnitScale<8> u8{};
  switch (bits) {
    case 2: return u2.v;
    case 3: return u3.v;
    case 4: return u4.v;
    case 5: return u5.v;
    case 6: return u6.v;
    default: return u8.v;
  }
}

void small_slice(const QmmTable& t, const Prepared& pr, const QMatView& w,
                 const std::vector<SegKernels>& ks, float* y, int n0, int n1) {
  const int N = w.N;
  for (int m0 = 0; m0 < pr.M; m0 += t.max_mb) {
    const int mb = std::min(t.max_mb, pr.M - m0);
    for (int m = 0; m < mb; ++m)
      std::fill(y + int64_t(m0 + m) * N + n0, y + int64_t(m0 + m) * N + n1, 0.0f);
    for (size_t si = 0; si < w.segs.size(); ++si) {
      const SegView& s = w.segs[si];
      const int ng = s.k / s.group_size;
      ks[si].gemv(s, w.sdtype, pr.xq[si].data() + int64_t(m0) * s.k,
                  pr.xs[si].data() + int64_t(m0) * ng, s.k, mb, n0, n1,
                  y + int64_t(m0) * N, N);
    }
  }
}

// x rows of micro-panels [b0, b1) into pr.xp, for every kc block.
void pack_x(const GemmRow& g, const float* x, const QMatView& w, Prepared& pr, int b0,
            int b1) {
  const int K = pr.K, mr = g.mr;
  std::vector<float> row(kPKC);
  for (const SegView& s : w.segs)
    for (int c0 = 0; c0 < s.k; c0 += kPKC) {
      const int kc = std::min(kPKC, s.k - c0), kg = s.k0 + c0;
      for (int b = b0; b < b1; ++b) {
        float* panel = pr.xp + int64_t(pr.Mp) * kg + int64_t(b) * mr * kc;
        for (int i = 0; i < mr; ++i) {
          const int m = b * mr + i;
          if (m < pr.M)
            to_decode_order(x + int64_t(m) * K + kg, kc, row.data());
          else
            std::fill(row.begin(), row.end(), 0.0f);
          for (int p = 0; p < kc; ++p) panel[p * mr + i] = row[p];
        }
      }
    }
}

// Outputs [n0, n1) for all M rows: per kc block of each segment, tiles of
// kPNB W rows are packed, then every x micro-panel (L1) runs against every
// W panel of the tile (L2). n0 and every tile start are multiples of the
// panel width, hence of a repacked block's 16 rows.
void panel_slice(const QmmTable& t, const Prepared& pr, const QMatView& w,
                 const std::vector<SegKernels>& ks, float* y, int n0, int n1) {
  const GemmRow& g = *t.gemm;
  const int N = w.N, M = pr.M;
  thread_local AlignedBuf tileb;
  float* tile = tileb.get(size_t(kPNB) * kPKC);
  for (int m = 0; m < M; ++m)
    std::fill(y + int64_t(m) * N + n0, y + int64_t(m) * N + n1, 0.0f);
  for (size_t si = 0; si < w.segs.size(); ++si) {
    const SegView& s = w.segs[si];
    for (int c0 = 0; c0 < s.k; c0 += kPKC) {
      const int c1 = std::min(s.k, c0 + kPKC), kc = c1 - c0;
      const float* xb = pr.xp + int64_t(pr.Mp) * (s.k0 + c0);
      for (int nt = n0; nt < n1; nt += kPNB) {
        const int nb = std::min(kPNB, n1 - nt);
        ks[si].pack(s, w.sdtype, ks[si].dequant, nt, nb, c0, c1, tile, g.pw);
        for (int m = 0; m < M; m += g.mr) {
          const float* xpanel = xb + int64_t(m) * kc;
          const int mr = std::min(g.mr, M - m);
          for (int q = 0; q < nb; q += g.pw)
            g.micro(xpanel, tile + int64_t(q) * kc, kc, y + int64_t(m) * N + nt + q, N, mr,
                    std::min(g.pw, nb - q));
        }
      }
    }
  }
}

void run_table(const QmmTable& t, const float* x, int M, const QMatView& w, float* y) {
  Prepared pr;
  pr.M = M;
  pr.K = w.K;
  const int K = w.K;
  // A repacked view is read only by the panel packers, also below small_m
  // (the small-M kernels have no reader for it; padding x to the
  // micro-panel's rows beats un-repacking W on every call).
  const PackWCols* pack_r = t.gemm->pack_r;
  std::vector<SegKernels> ks;
  for (const SegView& s : w.segs) {
    const int c = group_size_col(s.group_size);
    const PackWFn pack = !w.repacked ? t.gemm->pack : pack_r ? (*pack_r)[s.bits][c] : nullptr;
    if (w.repacked && !pack)
      throw std::logic_error(std::string("qmatmul ") + t.name + ": no repacked reader for " +
                             std::to_string(s.bits) + "-bit segments");
    ks.push_back({(*t.gemv)[s.bits][c], (*t.dequant)[s.bits][c], pack});
  }

  if (M <= t.small_m && !w.repacked) {
    pr.xq.resize(w.segs.size());
    pr.xs.resize(w.segs.size());
    for (size_t si = 0; si < w.segs.size(); ++si) {
      const SegView& s = w.segs[si];
      const int ng = s.k / s.group_size;
      const float* us = unit_scale(s.bits);
      pr.xq[si].resize(size_t(M) * s.k);
      pr.xs[si].resize(size_t(M) * ng);
      for (int m = 0; m < M; ++m) {
        const float* src = x + int64_t(m) * K + s.k0;
        float* dq = pr.xq[si].data() + int64_t(m) * s.k;
        to_decode_order(src, s.k, dq, us);
        group_sums(src, ng, s.group_size, pr.xs[si].data() + int64_t(m) * ng);
      }
    }
    parallel_for(w.N, 16, [&](int64_t n0, int64_t n1) {
      small_slice(t, pr, w, ks, y, int(n0), int(n1));
    });
  } else {
    const GemmRow& g = *t.gemm;
    pr.Mp = (M + g.mr - 1) / g.mr * g.mr;
    pr.xp = pr.xpb.get(size_t(pr.Mp) * K);
    parallel_for(pr.Mp / g.mr, 4, [&](int64_t b0, int64_t b1) {
      pack_x(g, x, w, pr, int(b0), int(b1));
    });
    // Slices of whole panels, so a thread boundary never splits one.
    const int np = (w.N + g.pw - 1) / g.pw;
    parallel_for(np, 2, [&](int64_t p0, int64_t p1) {
      panel_slice(t, pr, w, ks, y, int(p0) * g.pw, std::min<int>(w.N, int(p1) * g.pw));
    });
  }
}

// The row's float kernel for repacked views, where it has panel packers
// for them: calls of more than kInt8MaxM rows (prefill; the integer
// contracts' limit) take the panels. Fewer rows under the float contract
// un-repack, so they stay bit for bit the small-M kernels' result on MLX's
// layout: repacking changes no float-contract decode bit.
QmmRepacked qmm_repacked_of(const QmmTable& t, QmmRun run) {
  if (!t.gemm->pack_r) return {};
  uint32_t bits = 0;
  for (int b = 0; b < 9; ++b) {
    const auto& cols = (*t.gemm->pack_r)[b];
    if (cols[0] && cols[1] && cols[2]) bits |= 1u << b;
  }
  return {run, kInt8MaxM, bits};
}

}  // namespace

void qmm_avx2_run(const float* x, int M, const QMatView& w, float* y) {
  run_table(kQmmAvx2, x, M, w, y);
}
void qmm_avx512_run(const float* x, int M, const QMatView& w, float* y) {
  run_table(kQmmAvx512, x, M, w, y);
}
QmmRepacked qmm_avx2_repacked() { return qmm_repacked_of(kQmmAvx2, qmm_avx2_run); }
QmmRepacked qmm_avx512_repacked() { return qmm_repacked_of(kQmmAvx512, qmm_avx512_run); }
void qmm_t_avx2_run(const float* dy, int M, const QMatView& w, float* dx) {
  qmm_t_run_table(kQmmAvx2, dy, M, w, dx);
}
void qmm_t_avx512_run(const float* dy, int M, const QMatView& w, float* dx) {
  qmm_t_run_table(kQmmAvx512, dy, M, w, dx);
}

}  // namespace mixbits
