// Pieces shared by the gathered products' CPU evaluation (gather.cpp,
// transposed.cpp): one expert's slice of a stacked weight as a kernel view,
// and the pairs grouped by expert, so both read the stack the same way.
#pragma once
#include <cstdint>
#include <functional>
#include <numeric>
#include <optional>
#include <vector>

#include "common/mlx_args.h"
#include "qmatmul/kernel.h"
#include "qmatmul/qmatmul.h"

namespace mixbits {

inline int64_t prod(const mx::Shape& s, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= s[i];
  return p;
}

// Expert e of the stacked [E, N, ...] segments whose arrays start at
// inputs[first] (wq, scales, biases per segment).
inline QMatView expert_view(const std::vector<mx::array>& inputs, int first,
                            const std::vector<SegSpec>& segs, int64_t e,
                            int N, int K) {
  QMatView w;
  w.N = N;
  w.K = K;
  w.sdtype = to_dtype(inputs[first + 1].dtype());
  const int64_t ssz = int64_t(inputs[first + 1].itemsize());
  int k0 = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const SegSpec& sg = segs[i];
    const int64_t words = int64_t(sg.k) * sg.bits / 32;
    const int64_t groups = sg.k / sg.group_size;
    w.segs.push_back(
        {sg.bits, sg.group_size, k0, sg.k,
         inputs[first + 3 * i].data<uint32_t>() + e * N * words,
         inputs[first + 3 * i + 1].data<char>() + e * N * groups * ssz,
         inputs[first + 3 * i + 2].data<char>() + e * N * groups * ssz});
    k0 += sg.k;
  }
  return w;
}

// The pairs p < P with keep(p), grouped by expert ridx[p] in index order (a
// counting sort): expert e's pairs are order[start[e] .. start[e + 1]).
struct ByExpert {
  std::vector<int64_t> start, order;
};

template <class Keep>
ByExpert sort_by_expert(const uint32_t* ridx, int64_t P, int64_t Bw, Keep keep) {
  ByExpert g{std::vector<int64_t>(Bw + 1, 0), {}};
  for (int64_t p = 0; p < P; ++p)
    if (keep(p)) ++g.start[ridx[p] + 1];
  std::partial_sum(g.start.begin(), g.start.end(), g.start.begin());
  g.order.resize(g.start[Bw]);
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < P; ++p)
    if (keep(p)) g.order[fill[ridx[p]]++] = p;
  return g;
}

// MLX's indices_or_default: integral indices as uint32, or every batch of
// `batch` in order ("[gather_qmm]" std::invalid_argument otherwise).
mx::array indices_or_default(const std::optional<mx::array>& idx, const mx::Shape& batch,
                             mx::StreamOrDevice s);

// The CPU evaluation of a gathered product, for any weight layout:
// inputs are x [Bx..., M, K], [perm [K]], the weight arrays, then lhs and
// rhs (uint32, one shape); `out` is lhs.shape + [M, N], allocated. Pairs
// with an index (or a perm entry) out of range get NaN rows; the others are
// grouped by expert, their x rows gathered (through perm) into a float32
// block, and run(e, path, xf, rows, y) multiplies expert e's rows, on the
// path qmatmul_cpu_eval would take for them (Int: at most int_max_m finite
// rows; IeeeRef: an inf; else Float).
using ExpertRun = std::function<void(int64_t e, QmmPath path, const float* xf, int rows, float* y)>;
void gather_cpu_eval(const std::vector<mx::array>& inputs, bool has_perm, int N, int64_t Bw,
                     int int_max_m, mx::array& out, const ExpertRun& run);

}  // namespace mixbits
