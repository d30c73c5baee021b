// Host side of the Metal transposed quantized matmul (qmatmul_t.metal), in
// plain C++: the one launch of a product, its parameters (the segment
// table, filled by qmatmul_host.h's fill_segment_table as the forward's),
// grid and buffers. Used by MixedQMatmulT::eval_gpu (cpp/qmatmul/metal.cpp)
// on macOS and by the emulator harness (tests/metal/harness_t.cpp) on
// Linux, so the launch logic the Mac runs is the one the tests exercise.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_args.h"
#include "qmatmul_host.h"
#include "qmatmul_t_params.h"

namespace mixbits::metal_host {

static_assert(sizeof(MbQmmFusedParams) == (8 + 4 * MB_QMM_MAX_SEGS) * sizeof(int),
              "MbQmmFusedParams is plain ints, laid out alike in Metal and C++");
static_assert(MB_QT_THREADS == MB_QT_CHUNKS * MB_QT_SLICES &&
                  MB_QT_COLS == MB_QT_CHUNKS * MB_QT_CHUNK_COLS && MB_QT_COLS % 128 == 0 &&
                  MB_QT_CHUNKS == 16 && MB_QT_MAX_M <= MB_QT_CHUNKS,
              "qmatmul_t.metal's roles: 16 chunks of 8 columns (a slice is half a "
              "simdgroup, 4 lanes a 32-column run) x 4 row slices per set, blocks of "
              "whole groups");
static_assert(size_t(mb_qt_tg_words(MB_QT_MAX_M, MB_QT_MAX_K, 1, MB_QT_MAX_SETS)) * 4 <=
                      kMaxThreadgroupBytes &&
                  MB_QT_MAX_SETS * MB_QT_THREADS <= 1024,
              "threadgroup memory within Metal's 32 KiB, threads within 1024");
static_assert(MB_QT_WQ0 + 3 * MB_QMM_MAX_SEGS == MB_QT_PARAMS &&
                  MB_QT_PARAMS + 1 == MB_QT_N_BUFFERS && MB_QT_N_BUFFERS <= 31,
              "three slots per segment, the parameter block last, within Metal's 31");

inline int qt_wq_slot(int j) { return MB_QT_WQ0 + 3 * j; }
inline int qt_scales_slot(int j) { return MB_QT_SCALES0 + 3 * j; }
inline int qt_biases_slot(int j) { return MB_QT_BIASES0 + 3 * j; }
constexpr SegmentSlots kQtSegmentSlots{qt_wq_slot, qt_scales_slot, qt_biases_slot, MB_QT_OUT};

struct QtLaunch : Launch {
  MbQmmFusedParams params;
};

// Whether eval_gpu's kernel applies: few rows (MB_QT_MAX_M; above it the
// gradient uses dequantize + GEMM), at most MB_QMM_MAX_SEGS segments (one
// dispatch binds them all: every product the quantizer makes), K within
// the perm check's bit map, and 32-bit parameters. mixed_qmatmul_t refuses
// a GPU stream otherwise.
inline bool qmv_t_gpu_applies(int64_t M, int64_t N, int64_t K, int64_t nseg = 1) {
  const int64_t lim = 0x7fffffff;
  return M <= MB_QT_MAX_M && nseg <= MB_QMM_MAX_SEGS && K <= MB_QT_MAX_K && N <= lim &&
         int64_t(M) * K <= lim;
}

// Threadgroups of the grid: ceil(kseg / (sets * MB_QT_COLS)) per segment.
inline uint32_t qt_blocks(const std::vector<QmmSegment>& segs, int sets = 1) {
  uint32_t b = 0;
  const int cols = sets * MB_QT_COLS;
  for (const auto& s : segs) b += uint32_t((s.k + cols - 1) / cols);
  return b;
}

// Column sets per threadgroup (1, 2 or 4; MbQmvTShape): every threadgroup
// reads all of dy (M x N elements) and, with a perm, all of perm (its
// check), so wider blocks mean fewer re-reads. As the forward GEMV's
// qmv_shape bounds x's: the fewest sets whose re-reads (beyond the one
// read the product needs) are at most 1/16 of W's bytes (packed words,
// scales and biases), else 4; a wider block is taken only when it means
// fewer threadgroups (a segment narrower than the block leaves sets idle).
// At 4096 x 4096, 4-bit g64, float16: M = 1 keeps 1 set (32 threadgroups),
// M = 8 takes 4 (8 threadgroups; 32 read dy 32 times, 22% of the minimum).
inline int qt_sets(int M, int N, const std::vector<QmmSegment>& segs, int act_bytes,
                   int scale_bytes, bool has_perm) {
  int K = 0;
  double wbytes = 0.0;
  for (const auto& s : segs) {
    K += s.k;
    wbytes += double(N) * s.k * s.bits / 8.0 + 2.0 * N * (s.k / s.group_size) * scale_bytes;
  }
  const double per_group = double(M) * N * act_bytes + (has_perm ? 4.0 * K : 0.0);
  int sets = 1;
  for (int c = 1; c <= MB_QT_MAX_SETS; c *= 2) {
    const uint32_t t = qt_blocks(segs, c);
    if (c > 1 && t >= qt_blocks(segs, sets)) break;
    sets = c;
    if ((double(t) - 1.0) * per_group <= wbytes / 16.0) break;
  }
  return sets;
}

// The one launch for dy [M, N] (dense) and the segments. Arguments are
// assumed validated (mixed_qmatmul_t, qmv_t_gpu_applies); N may be 0 (dx
// is then 0).
inline std::vector<QtLaunch> plan_qmv_t(int M, int N, const std::vector<QmmSegment>& segs,
                                        ActType xt, int scale_type, bool has_perm) {
  if (M <= 0 || N < 0 || segs.empty())
    throw std::invalid_argument("plan_qmv_t: empty problem");
  if (segs.size() > size_t(MB_QMM_MAX_SEGS))
    throw std::invalid_argument("plan_qmv_t: more than 8 segments (qmv_t_gpu_applies)");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_qmv_t: unknown scale dtype");
  int K = 0;
  for (const auto& s : segs) {
    if (log2_group(s.group_size) < 0 || s.k % s.group_size != 0)
      throw std::invalid_argument("plan_qmv_t: bad segment");
    K += s.k;
  }
  if (K > MB_QT_MAX_K) throw std::invalid_argument("plan_qmv_t: K past MB_QT_MAX_K");
  const Elem xe = elem_of(xt), se = elem_of(scale_act_type(scale_type));
  QtLaunch l;
  l.kernel = std::string("mixbits_qmv_t_") + act_type_name(xt) + "_" +
             act_type_name(scale_act_type(scale_type));
  l.params = MbQmmFusedParams{};
  MbQmmFusedParams& q = l.params;
  q.M = M;
  q.N = N;
  q.K = K;
  q.has_perm = has_perm ? 1 : 0;
  q.nseg = int(segs.size());
  q.accumulate = 0;
  q.write_out = 1;
  const int sets = qt_sets(std::min(M, int(MB_QT_MAX_M)), N, segs, int(elem_bytes(xe)),
                           int(elem_bytes(se)), has_perm);
  q.qmv_sets = sets;
  l.grid[0] = qt_blocks(segs, sets);
  l.grid[1] = uint32_t((M + MB_QT_MAX_M - 1) / MB_QT_MAX_M);
  l.grid[2] = 1;
  l.group[0] = uint32_t(sets * MB_QT_THREADS);
  l.group[1] = l.group[2] = 1;
  l.threadgroup_bytes =
      size_t(mb_qt_tg_words(std::min(M, int(MB_QT_MAX_M)), K, has_perm ? 1 : 0, sets)) *
      sizeof(float);
  l.params_index = MB_QT_PARAMS;
  l.buffers = {
      {"dy", MB_QT_DY, Dir::In, xe, size_t(M) * size_t(N), -1},
      {"perm", MB_QT_PERM, Dir::In, Elem::I32, has_perm ? size_t(K) : 0,
       has_perm ? -1 : MB_QT_OUT},
      {"out", MB_QT_OUT, Dir::Out, xe, size_t(M) * size_t(K), -1},
  };
  int k0 = 0;
  fill_segment_table(q, l.buffers, segs, 0, segs.size(), size_t(N), se, kQtSegmentSlots, k0);
  // N = 0: dy and W are empty (dx is 0); their slots get the stand-in.
  for (BufferArg& b : l.buffers)
    if (!b.used()) b.stand_in = MB_QT_OUT;
  return {l};
}

}  // namespace mixbits::metal_host
