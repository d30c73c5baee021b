// Host side of the Metal quantized matmul, in plain C++: which kernel runs,
// with which segment table, grid and buffers. One dispatch per product for
// up to MB_QMM_MAX_SEGS segments (the kernels loop over the segments). Used by
// cpp/qmatmul/metal.cpp on macOS and by the emulator tests on Linux, so the
// launch logic the Mac runs is the one the tests exercise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_args.h"
#include "qmatmul_params.h"

namespace mixbits::metal_host {

struct QmmSegment {
  int bits;
  int group_size;
  int k;
};

enum class QmmPath { Auto = 0, Gemv = 1, Tiled = 2 };

struct QmmLaunch : Launch {
  MbQmmFusedParams params;
  int first_segment;  // segments first_segment .. + params.nseg - 1 of the product
  bool tiled;
};

// Buffer slots of segment j of a launch (0 <= j < MB_QMM_MAX_SEGS).
inline int qmm_wq_slot(int j) { return MB_QMM_WQ0 + 3 * j; }
inline int qmm_scales_slot(int j) { return MB_QMM_SCALES0 + 3 * j; }
inline int qmm_biases_slot(int j) { return MB_QMM_BIASES0 + 3 * j; }
static_assert(MB_QMM_SCALES0 == MB_QMM_WQ0 + 1 && MB_QMM_BIASES0 == MB_QMM_WQ0 + 2 &&
                  MB_QMM_WQ7 == MB_QMM_WQ0 + 3 * 7 && MB_QMM_BIASES7 + 1 == MB_QMM_PARAMS &&
                  MB_QMM_PARAMS + 1 == MB_QMM_N_BUFFERS &&
                  MB_QMM_N_BUFFERS <= 31 && MB_QMM_MAX_SEGS == 8 &&
                  sizeof(MbQmmFusedParams) == (8 + 4 * MB_QMM_MAX_SEGS) * sizeof(int),
              "three slots per segment after the fixed ones, within Metal's 31; the "
              "segment table holds MB_QMM_MAX_SEGS entries");

// Threadgroup memory a kernel may use: Metal guarantees 32 KiB on every
// Apple GPU MLX supports (maxThreadgroupMemoryLength).
constexpr size_t kMaxThreadgroupBytes = 32 * 1024;
constexpr size_t kQmmThreadgroupBytes = size_t(MB_QMM_TG_FLOATS) * sizeof(float);
constexpr size_t kQmvThreadgroupBytes = size_t(MB_QMV_TG_FLOATS) * sizeof(float);
static_assert(kQmmThreadgroupBytes <= kMaxThreadgroupBytes &&
                  kQmvThreadgroupBytes <= kMaxThreadgroupBytes,
              "the kernels' tiles exceed 32 KiB of threadgroup memory");
static_assert(MB_QMV_TG_FLOATS == MB_QMV_MAX_M * MB_QMV_BLOCK &&
                  MB_QMV_BLOCK == 32 * 16 && MB_QMV_MAX_SIMDGROUPS * 32 <= 1024,
              "qmatmul_gemv.metal: a block is one simdgroup step (32 lanes x 16 columns), staged for 8 rows of x");

// The GEMV's threadgroups each read all of x (staged once per threadgroup),
// so requested x bytes are (threadgroups along N) x M x K x 2: at 4-bit,
// 8 simdgroups (32 rows of W) add 16 M / (4 x 32) of the weights' bytes --
// 11% at M = 1, 89% at M = 8 (4096 x 4096; the caches catch most of it,
// but it is traffic). More simdgroups per threadgroup divide it, but fewer,
// bigger threadgroups leave cores idle on a large GPU, so the host takes
// the most simdgroups (up to 32, 128 rows of W) that still leave at least
// kQmvMinThreadgroups threadgroups along N (about one per core of the
// largest Apple GPUs), within what the pipeline allows (max_threads:
// maxTotalThreadsPerThreadgroup on the Mac).
// blocks: threadgroups along the other grid axis (blocks of rows of x).
constexpr int kQmvMinThreadgroups = 32;
inline int qmv_simdgroups(int N, int max_threads = 1024, int blocks = 1) {
  int sg = MB_QMV_MAX_SIMDGROUPS;
  while (sg > MB_QMV_MIN_SIMDGROUPS &&
         (sg * 32 > max_threads ||
          int64_t((N + sg * MB_QMV_ROWS_PER_SIMDGROUP - 1) / (sg * MB_QMV_ROWS_PER_SIMDGROUP)) *
                  blocks <
              kQmvMinThreadgroups))
    sg /= 2;
  return sg;
}

// The dense GEMV's threadgroup shape: simdgroups, and lane sets per
// simdgroup (qmv_rows.h: each set of 32 / sets lanes owns 4 rows of W).
struct QmvShape {
  int simdgroups;
  int sets;
  int rows() const { return simdgroups * sets * MB_QMV_ROWS_PER_SIMDGROUP; }
};
// x re-read by the threadgroups may add at most 1 / kQmvRereadShare of W's
// bytes to a call.
constexpr int kQmvRereadShare = 16;
// Starts from qmv_simdgroups' choice (enough threadgroups for the cores),
// then, while the threadgroups' re-reads of x would exceed that share,
// widens the threadgroup: more simdgroups (within max_threads), then more
// lane sets, up to 32 x 4 sets = 512 rows of W, or until one threadgroup
// covers N. Each threadgroup reads tg_x_bytes (its rows of x over K, and
// the perm), so over ceil(N / rows) threadgroups that stays within the
// share when rows x w_row_bytes >= kQmvRereadShare x tg_x_bytes
// (w_row_bytes: codes, scales and biases of one row of W). At 4-bit, group
// 64, float16: rows >= 57 M (x) and >= 57 M + 114 (x and perm), so
// M = 1 keeps the core-count choice and M = 5 .. 8 take 512 rows (fewer
// threadgroups: 8 at N = 4096; the price of reading x fewer times).
inline QmvShape qmv_shape(int N, double tg_x_bytes, double w_row_bytes, int max_threads = 1024,
                          int blocks = 1) {
  QmvShape s{qmv_simdgroups(N, max_threads, blocks), 1};
  while (s.rows() < N && double(s.rows()) * w_row_bytes < kQmvRereadShare * tg_x_bytes) {
    if (s.simdgroups < MB_QMV_MAX_SIMDGROUPS && s.simdgroups * 2 * 32 <= max_threads)
      s.simdgroups *= 2;
    else if (s.sets < MB_QMV_MAX_SETS)
      s.sets *= 2;
    else
      break;
  }
  return s;
}
static_assert(MB_QMV_BLOCK % (16 * 32) == 0 && 16 * (32 / MB_QMV_MAX_SETS) >= 128,
              "qmv_rows.h: a set's trip of 16 columns per lane spans whole groups (<= 128)");

constexpr size_t kQmm16ThreadgroupBytes = size_t(MB_QMM16_TG_FLOATS) * sizeof(float);
static_assert(MB_QMM_TG_FLOATS ==
                      2 * (MB_QMM_BM + MB_QMM_BN) * MB_QMM_TILE_STRIDE + 2 * MB_QMM_BK &&
                  MB_QMM16_TG_FLOATS ==
                      2 * (MB_QMM16_BM + MB_QMM16_BN) * MB_QMM_TILE_STRIDE + 2 * MB_QMM_BK &&
                  mb_qmm_tg_floats(MB_QMM_BM, 4) == MB_QMM_TG_FLOATS &&
                  mb_qmm_tg_floats(MB_QMM16_BM, 4) == MB_QMM16_TG_FLOATS &&
                  mb_qmm_tg_floats(MB_QMM_BM, 2) < MB_QMM_TG_FLOATS &&
                  mb_qmm_tg_floats(MB_QMM16_BM, 2) < MB_QMM16_TG_FLOATS &&
                  mb_qmm_buffer_floats(MB_QMM_BM, 2) % 4 == 0 &&
                  mb_qmm_buffer_floats(MB_QMM16_BM, 2) % 4 == 0 &&
                  mb_qmm_buffer_floats(MB_QMM_BM, 2, 2) % 4 == 0 &&
                  mb_qmm_buffer_floats(MB_QMM16_BM, 2, 2) % 4 == 0 &&
                  mb_qmm_tile_floats(MB_QMM_BM, 2) % 4 == 0 &&
                  mb_qmm_tile_floats(MB_QMM16_BM, 2) % 4 == 0 &&
                  mb_qmm_wstride(4) == MB_QMM_TILE_STRIDE &&
                  MB_QMM_BM * (MB_QMM_BN + 4) <= mb_qmm_buffer_floats(MB_QMM_BM, 2, 2) &&
                  MB_QMM16_BM * (MB_QMM16_BN + 4) <= mb_qmm_buffer_floats(MB_QMM16_BM, 2, 2) &&
                  mb_qmm_bn(MB_QMM_BM) == MB_QMM_BN && mb_qmm_bn(MB_QMM16_BM) == MB_QMM16_BN &&
                  kQmm16ThreadgroupBytes <= kMaxThreadgroupBytes,
              "the tiled kernels' two buffers of x and W tiles, then two steps' perm entries");
static_assert(MB_QMM_TILE_STRIDE >= MB_QMM_BK && MB_QMM_TILE_STRIDE >= MB_QMM_BN &&
                  MB_QMM_TILE_STRIDE % 4 == 0,
              "x and W tiles (and the output tile staged in a buffer) fit, rows 16-byte aligned");
static_assert(MB_QMM_THREADS == 32 * MB_QMM_SIMDGROUPS && MB_QMM_SIMDGROUPS == 4 &&
                  MB_QMM_BM == 32 && MB_QMM_BN == 32 && MB_QMM_THREADS * 8 == MB_QMM_BM * MB_QMM_BK,
              "qmatmul_tiled.metal's roles: 2 x 2 simdgroups of 16 x 16, 8 values per thread");

inline ActType scale_act_type(int scale_type) {
  return scale_type == MB_SCALE_F32   ? ActType::F32
         : scale_type == MB_SCALE_F16 ? ActType::F16
                                      : ActType::BF16;
}

// The tiled kernel's block rows: 16 up to MB_QMM16_MAX_M rows of x, else 32.
inline int qmm_block_rows(int M) { return M <= MB_QMM16_MAX_M ? MB_QMM16_BM : MB_QMM_BM; }

// mixbits_<qmv|qmm|qmm16>_<x dtype>_<scale dtype>, as instantiated by
// MB_QMM_FUSED_LADDER (qmatmul_common.h): one kernel for every segment
// table; qmm16 is the tiled kernel with 16-row blocks.
inline std::string qmm_kernel_name(bool tiled, ActType t, int scale_type, int bm = MB_QMM_BM) {
  const char* kind = !tiled ? "qmv" : bm == MB_QMM16_BM ? "qmm16" : "qmm";
  return std::string("mixbits_") + kind + "_" + act_type_name(t) + "_" +
         act_type_name(scale_act_type(scale_type));
}

inline int log2_group(int gs) {
  return gs == 32 ? 5 : gs == 64 ? 6 : gs == 128 ? 7 : -1;
}

inline bool qmm_uses_tiled(int M, QmmPath path) {
  return path == QmmPath::Tiled || (path == QmmPath::Auto && M > MB_QMV_MAX_M);
}

// Dispatches of one product: one per MB_QMM_MAX_SEGS segments.
inline size_t qmm_dispatches(size_t n_segments) {
  return (n_segments + MB_QMM_MAX_SEGS - 1) / MB_QMM_MAX_SEGS;
}

// Only a product of more than MB_QMM_MAX_SEGS segments passes a float32
// [M, N] partial sum from dispatch to dispatch.
inline bool qmm_needs_acc(size_t n_segments) { return qmm_dispatches(n_segments) > 1; }

// Why the Metal kernels cannot run a problem ("" if they can): their
// parameters are int32. Checked when the graph node is built
// (cpp/qmatmul/qmatmul.cpp), so eval_gpu never meets such a problem.
inline std::string qmm_gpu_refusal(int64_t M, int64_t N, int64_t K) {
  const int64_t lim = 0x7fffffff;
  if (M > lim) return "x has more than 2^31-1 rows for the GPU kernels";
  if (N > lim || K > lim) return "the weight is too large for the GPU kernels";
  return "";
}

// Where segment j's three arrays bind in one kernel family's launch, and the
// slot that stands in for the arrays of unused segments (`out`: freshly
// allocated, so offset 0 and aligned).
struct SegmentSlots {
  int (*wq)(int j);
  int (*scales)(int j);
  int (*biases)(int j);
  int stand_in;
};
constexpr SegmentSlots kQmmSegmentSlots{qmm_wq_slot, qmm_scales_slot, qmm_biases_slot,
                                        MB_QMM_OUT};

// Fills q's K-segment table with segs[first .. first + n - 1] and appends the
// "wq", "scales" and "biases" records of all MB_QMM_MAX_SEGS slots to
// `buffers` (unused ones empty, bound to slots.stand_in). One function for
// the product's launches (plan_qmm) and the gathered kernels'
// (gather_host.h): their kernels read the same table through the same
// MbQmmFusedParams and differ only in the slots and in how many [N, kseg]
// matrices a segment's arrays hold (`mats`: N, or w_batches * N). k0: the
// first segment's column in x, advanced past the n segments.
inline void fill_segment_table(MbQmmFusedParams& q, std::vector<BufferArg>& buffers,
                               const std::vector<QmmSegment>& segs, size_t first, size_t n,
                               size_t mats, Elem scale_elem, const SegmentSlots& slots,
                               int& k0) {
  for (int j = 0; j < MB_QMM_MAX_SEGS; ++j) {
    const bool used = size_t(j) < n;
    const QmmSegment s = used ? segs[first + size_t(j)] : QmmSegment{2, 32, 0};
    if (used) {
      q.seg[j].bits = s.bits;
      q.seg[j].group_shift = log2_group(s.group_size);
      q.seg[j].k0 = k0;
      q.seg[j].kseg = s.k;
      k0 += s.k;
    }
    const size_t groups = used ? mats * size_t(s.k / s.group_size) : 0;
    const int stand = used ? -1 : slots.stand_in;
    buffers.push_back({"wq", slots.wq(j), Dir::In, Elem::U32,
                       used ? mats * size_t(s.k) * s.bits / 32 : 0, stand});
    buffers.push_back({"scales", slots.scales(j), Dir::In, scale_elem, groups, stand});
    buffers.push_back({"biases", slots.biases(j), Dir::In, scale_elem, groups, stand});
  }
}

// The fixed fields of one launch's segment table (fill_segment_table fills
// the entries): the product's shape (M rows of x, N outputs, K columns),
// and where the launch's segments first .. first + n - 1 lie among the
// product's n_total: a launch after the first adds the float32 partial sum,
// only the last writes `out` (qmm_needs_acc). One lane set (qmv_sets = 1):
// plan_qmm's GEMV widens it (qmv_shape), the other kernels ignore it or
// keep 1. For plan_qmm and the gathered kernels' plans alike.
inline MbQmmFusedParams fused_params(int M, int N, int K, bool has_perm, size_t first, size_t n,
                                     size_t n_total) {
  MbQmmFusedParams q{};
  q.M = M;
  q.N = N;
  q.K = K;
  q.has_perm = has_perm ? 1 : 0;
  q.nseg = int(n);
  q.accumulate = first > 0 ? 1 : 0;
  q.write_out = first + n == n_total ? 1 : 0;
  q.qmv_sets = 1;
  return q;
}

// One launch per MB_QMM_MAX_SEGS segments (one for every product the
// quantizer makes), in order. M rows of x (contiguous, K columns), N
// outputs. Arguments are assumed validated (cpp/qmatmul/qmatmul.cpp).
// max_gemv_threads: the GEMV pipeline's maxTotalThreadsPerThreadgroup
// (it bounds qmv_simdgroups).
inline std::vector<QmmLaunch> plan_qmm(int M, int N,
                                       const std::vector<QmmSegment>& segs,
                                       ActType xt, int scale_type,
                                       bool has_perm,
                                       QmmPath path = QmmPath::Auto,
                                       int max_gemv_threads = 1024) {
  if (M <= 0 || N <= 0 || segs.empty())
    throw std::invalid_argument("plan_qmm: empty problem");
  if (scale_type != MB_SCALE_F32 && scale_type != MB_SCALE_F16 && scale_type != MB_SCALE_BF16)
    throw std::invalid_argument("plan_qmm: unknown scale dtype");
  int K = 0;
  for (const auto& s : segs) {
    if (log2_group(s.group_size) < 0 || s.k % s.group_size != 0)
      throw std::invalid_argument("plan_qmm: bad segment");
    K += s.k;
  }
  const bool tiled = qmm_uses_tiled(M, path);
  const bool acc = qmm_needs_acc(segs.size());
  const size_t mk = size_t(M) * size_t(K), mn = size_t(M) * size_t(N);
  const Elem se = elem_of(scale_act_type(scale_type));
  std::vector<QmmLaunch> out;
  int k0 = 0;
  for (size_t first = 0; first < segs.size(); first += MB_QMM_MAX_SEGS) {
    const size_t n = std::min(segs.size() - first, size_t(MB_QMM_MAX_SEGS));
    QmmLaunch l;
    const int bm = qmm_block_rows(M);
    l.kernel = qmm_kernel_name(tiled, xt, scale_type, bm);
    MbQmmFusedParams& q = l.params;
    q = fused_params(M, N, K, has_perm, first, n, segs.size());
    if (tiled) {
      const int bn = mb_qmm_bn(bm);
      l.grid[0] = uint32_t((N + bn - 1) / bn);
      l.grid[1] = uint32_t((M + bm - 1) / bm);
      l.group[0] = MB_QMM_THREADS;
      // x tiles hold x as stored (2-byte activations need half the bytes);
      // W tiles are float16 when x and the scales are (mb_qmm_wtile).
      const bool half_w = xt == ActType::F16 && scale_type == MB_SCALE_F16;
      l.threadgroup_bytes =
          size_t(mb_qmm_tg_floats(bm, xt == ActType::F32 ? 4 : 2, half_w ? 2 : 4)) *
          sizeof(float);
    } else {
      // What each threadgroup reads besides W (x for its rows, over K, and
      // perm) against one row of W, over all segments of the product.
      const int xb = xt == ActType::F32 ? 4 : 2, sb = scale_type == MB_SCALE_F32 ? 4 : 2;
      double w_row = 0;
      for (const auto& sg : segs) w_row += double(sg.k) * sg.bits / 8 + 2.0 * (sg.k / sg.group_size) * sb;
      const double tg_x = double(std::min(M, int(MB_QMV_MAX_M))) * K * xb + (has_perm ? 4.0 * K : 0);
      const QmvShape sh =
          qmv_shape(N, tg_x, w_row, max_gemv_threads, (M + MB_QMV_MAX_M - 1) / MB_QMV_MAX_M);
      const int rows = sh.rows();
      q.qmv_sets = sh.sets;
      l.grid[0] = uint32_t((N + rows - 1) / rows);
      l.grid[1] = uint32_t((M + MB_QMV_MAX_M - 1) / MB_QMV_MAX_M);
      l.group[0] = uint32_t(sh.simdgroups * 32);
      // x staged for the rows of x a threadgroup has (the kernel indexes
      // rows 0 .. min(M, 8) - 1 of it).
      l.threadgroup_bytes = size_t(std::min(M, int(MB_QMV_MAX_M))) * MB_QMV_BLOCK * sizeof(float);
    }
    l.grid[2] = 1;
    l.group[1] = l.group[2] = 1;
    l.first_segment = int(first);
    l.tiled = tiled;
    // Unused slots get `out` (freshly allocated: offset 0, aligned).
    l.buffers = {
        {"x", MB_QMM_X, Dir::In, elem_of(xt), mk, -1},
        {"perm", MB_QMM_PERM, Dir::In, Elem::I32, has_perm ? size_t(K) : 0,
         has_perm ? -1 : MB_QMM_OUT},
        {"acc", MB_QMM_ACC, Dir::Out, Elem::F32, acc ? mn : 0, acc ? -1 : MB_QMM_OUT},
        {"out", MB_QMM_OUT, Dir::Out, elem_of(xt), mn, -1},
    };
    l.params_index = MB_QMM_PARAMS;
    fill_segment_table(q, l.buffers, segs, first, n, size_t(N), se, kQmmSegmentSlots, k0);
    out.push_back(l);
  }
  return out;
}

}  // namespace mixbits::metal_host
