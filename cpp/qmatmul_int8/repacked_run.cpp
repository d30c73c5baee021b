// The integer contracts on repacked segments (repack.h), free of MLX so the
// aarch64 harness (tests/neon/repacked_harness.cpp) runs exactly what the
// extension runs: the table choice per CPU, x quantized by int_quantize
// (the one definition) and put in the kernels' order (repacked_x_col), then
// blocks of 16 rows split over threads. RepackedQMatmul (repacked_qmatmul.cpp)
// calls these.
#include <algorithm>
#include <atomic>

#include "common/cpu.h"
#include "common/parallel.h"
#include "qmatmul_int8/kernel.h"

namespace mixbits {

namespace {
std::atomic<int> g_gemm_min_m{-1};  // -1: each table's own
// dst[u*CPW + p] = src[u*CPW + col[p]] for units [u0, u1) (pointers in
// locals: byte stores through a captured vector would make the compiler
// reload everything per element).
template <int CPW, class T>
void gather_units(const T* src, T* dst, const int* col, int64_t u0, int64_t u1) {
  int c[CPW];
  for (int p = 0; p < CPW; ++p) c[p] = col[p];
  for (int64_t u = u0; u < u1; ++u) {
    const T* s = src + u * CPW;
    T* d = dst + u * CPW;
    for (int p = 0; p < CPW; ++p) d[p] = s[c[p]];
  }
}

}  // namespace

int repacked_gemm_min_m(const RTable& t) {
  if (!t.gemm[4][1]) return 0;
  const int o = g_gemm_min_m.load(std::memory_order_relaxed);
  return o >= 0 ? o : t.gemm_min_m;
}

void set_repacked_gemm_min_m(int n) { g_gemm_min_m.store(n < 0 ? -1 : n); }

const RTable* select_repacked(bool int16, Backend backend) {
#if defined(MIXBITS_HAVE_AVX2)
  // As for the original layout: avx512 (and auto) run the widest integer
  // dot this CPU has, VNNI where present, else the AVX2 kernels.
  const CpuIsa& isa = cpu_isa();
  if (!isa.avx2) return nullptr;
  if (isa.avx512vnni && (backend == Backend::Auto || backend == Backend::Avx512))
    return int16 ? &repacked_int16_table_vnni() : &repacked_int8_table_vnni();
  if (backend == Backend::Auto || backend == Backend::Avx512 || backend == Backend::Avx2)
    return int16 ? &repacked_int16_table_avx2() : &repacked_int8_table_avx2();
  return nullptr;
#elif defined(MIXBITS_HAVE_NEON) && defined(__ARM_NEON) && defined(__aarch64__)
  // One table per build: whether it uses SDOT is fixed at compile time, as
  // for neon.cpp (every Apple M core has it).
  if (backend == Backend::Auto || backend == Backend::Neon)
    return int16 ? &repacked_int16_table_neon() : &repacked_int8_table_neon();
  return nullptr;
#else
  (void)int16;
  (void)backend;
  return nullptr;
#endif
}

template <class T>
void repacked_int_run(const RTable& t, const float* xf, int M, const QMatView& shape,
                      const RSeg* rsegs, float* y) {
  IntActs<T> a;
  int_quantize(xf, M, shape, a);  // reads only the segments' columns and groups
  const size_t nseg = shape.segs.size();
  for (size_t si = 0; si < nseg; ++si) {
    const int B = shape.segs[si].bits, cpw = repacked_x_span(B);
    int col[32];  // the unit's gather, computed once (O(M*K) moves follow)
    bool identity = true;
    for (int p = 0; p < cpw; ++p) identity &= (col[p] = repacked_x_col(B, sizeof(T), p)) == p;
    if (identity) continue;  // 8-bit int8 words: natural order
    std::vector<T>& v = a.xq[si];
    std::vector<T> out(v.size());
    const T* src = v.data();
    T* dst = out.data();
    parallel_for(int64_t(v.size() / cpw), 1024, [&](int64_t u0, int64_t u1) {
      switch (cpw) {  // a fixed unit length (32 / B, or 32): the loop over it unrolls
        case 4: return gather_units<4>(src, dst, col, u0, u1);
        case 8: return gather_units<8>(src, dst, col, u0, u1);
        case 16: return gather_units<16>(src, dst, col, u0, u1);
        case 32: return gather_units<32>(src, dst, col, u0, u1);
      }
    });
    v.swap(out);
  }
  const int N = shape.N;
  const int64_t NB = repack_blocks(N);
  // Many rows: the table's GEMM, if it has one for every segment, in one
  // pass (its result is the passes' bit for bit).
  const int gemm_min_m = repacked_gemm_min_m(t);
  bool gemm = gemm_min_m > 0 && M >= gemm_min_m;
  for (const SegView& s : shape.segs) gemm = gemm && t.gemm[s.bits][group_size_col(s.group_size)];
  const int pass = gemm ? M : kRepackMaxMB;
  parallel_for(NB, 4, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRepackRows, n1 = std::min<int64_t>(N, b1 * kRepackRows);
    for (int m0 = 0; m0 < M; m0 += pass) {
      const int mb = std::min(pass, M - m0);
      for (int m = 0; m < mb; ++m)
        std::fill(y + int64_t(m0 + m) * N + n0, y + int64_t(m0 + m) * N + n1, 0.0f);
      for (size_t si = 0; si < nseg; ++si) {
        const SegView& s = shape.segs[si];
        const int ng = s.k / s.group_size;
        const RX xv{a.xq[si].data() + int64_t(m0) * s.k, s.k, a.d[si].data() + int64_t(m0) * ng,
                    a.xs[si].data() + int64_t(m0) * ng, ng, a.ix[si].data() + int64_t(m0) * ng};
        (gemm ? t.gemm : t.fn)[s.bits][group_size_col(s.group_size)](
            rsegs[si], xv, mb, int(b0), int(b1), N, y + int64_t(m0) * N, N);
      }
    }
  });
}

template void repacked_int_run<int8_t>(const RTable&, const float*, int, const QMatView&,
                                       const RSeg*, float*);
template void repacked_int_run<int16_t>(const RTable&, const float*, int, const QMatView&,
                                        const RSeg*, float*);

}  // namespace mixbits
