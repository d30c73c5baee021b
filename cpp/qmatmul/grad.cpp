// Derivatives of MixedQMatmul, written with MLX's public ops (dequantize,
// matmul, take, scatter_add_axis, sum), except the backward product dy·W on
// a CPU stream: MLX's CPU matmul is a reference BLAS on Linux (~1.7 GFLOP/s
// against ~68 for OpenBLAS here), so there it runs the backend's transposed
// kernel through the packed weights (MixedQMatmulT, transposed.h). On a GPU
// stream the same node runs Metal kernels for few rows of dy (decode-sized
// calls); for more, MLX's matmul is fast: dequantize + matmul.
#include <algorithm>
#include <stdexcept>

#include "qmatmul/qmatmul.h"
#include "qmatmul/transposed.h"

namespace mixbits {

namespace grad {

namespace {

// Columns [k0, k0 + k) of the last axis, any leading dimensions.
mx::array cols(const mx::array& a, int k0, int k, mx::StreamOrDevice s) {
  mx::Shape start(a.ndim(), 0), stop = a.shape();
  start.back() = k0;
  stop.back() = k0 + k;
  return mx::slice(a, start, stop, s);
}

int seg_k0(const std::vector<SegSpec>& segs, size_t i) {
  int k0 = 0;
  for (size_t j = 0; j < i; ++j) k0 += segs[j].k;
  return k0;
}

// G's columns of segment i regrouped as (..., N, groups, group_size).
mx::array seg_groups(const mx::array& G, const std::vector<SegSpec>& segs,
                     size_t i, mx::StreamOrDevice s) {
  const SegSpec& sg = segs[i];
  return mx::unflatten(cols(G, seg_k0(segs, i), sg.k, s), -1,
                       {sg.k / sg.group_size, sg.group_size}, s);
}

}  // namespace

mx::array dequantize_all(const std::vector<mx::array>& packed,
                         const std::vector<SegSpec>& segs,
                         mx::StreamOrDevice s) {
  std::vector<mx::array> parts;
  for (size_t i = 0; i < segs.size(); ++i)
    parts.push_back(mx::dequantize(packed[3 * i], packed[3 * i + 1],
                                   packed[3 * i + 2], segs[i].group_size,
                                   segs[i].bits, "affine", std::nullopt,
                                   std::nullopt, s));
  return parts.size() == 1 ? parts[0] : mx::concatenate(parts, -1, s);
}

mx::array permute_cols(const mx::array& x, const std::optional<mx::array>& perm,
                       mx::StreamOrDevice s) {
  return perm ? mx::take(x, *perm, -1, s) : x;
}

mx::array unpermute_cols(const mx::array& g, const std::optional<mx::array>& perm,
                         mx::StreamOrDevice s) {
  if (!perm) return g;
  // A scatter-add, not a gather through argsort(perm): it is the exact
  // transpose of take() even if perm repeats a column.
  auto idx = mx::broadcast_to(*perm, g.shape(), s);
  return mx::scatter_add_axis(mx::zeros_like(g, s), idx, g, -1, s);
}

mx::array scales_grad(const mx::array& G, const std::vector<mx::array>& packed,
                      const std::vector<SegSpec>& segs, size_t i,
                      mx::StreamOrDevice s) {
  const mx::array& wq = packed[3 * i];
  const mx::array& sc = packed[3 * i + 1];
  // The integer codes q as floats: dequantize with scale 1 and bias 0.
  auto q = mx::dequantize(wq, mx::ones(sc.shape(), mx::float32, s),
                          mx::zeros(sc.shape(), mx::float32, s),
                          segs[i].group_size, segs[i].bits, "affine",
                          std::nullopt, std::nullopt, s);
  q = mx::unflatten(q, -1, {segs[i].k / segs[i].group_size, segs[i].group_size}, s);
  auto g = mx::sum(mx::multiply(seg_groups(G, segs, i, s), q, s), -1, false, s);
  return mx::astype(g, sc.dtype(), s);
}

mx::array biases_grad(const mx::array& G, const std::vector<mx::array>& packed,
                      const std::vector<SegSpec>& segs, size_t i,
                      mx::StreamOrDevice s) {
  auto g = mx::sum(seg_groups(G, segs, i, s), -1, false, s);
  return mx::astype(g, packed[3 * i + 2].dtype(), s);
}

}  // namespace grad

namespace {

// Which input an argnum names: x, the permutation, or segment `seg`'s
// wq (role 0), scales (1) or biases (2).
struct Arg {
  enum Kind { X, Perm, Seg } kind;
  size_t seg = 0;
  int role = 0;
};

Arg classify(int arg, bool has_perm) {
  if (arg == 0) return {Arg::X};
  if (has_perm && arg == 1) return {Arg::Perm};
  const int i = arg - (has_perm ? 2 : 1);
  return {Arg::Seg, size_t(i / 3), i % 3};
}

// MLX raises std::runtime_error (Python RuntimeError) for the quantized
// weights of its QuantizedMatmul; the same here, and for the permutation.
[[noreturn]] void no_grad(const char* fn, const Arg& a) {
  throw std::runtime_error(
      std::string("[MixedQMatmul::") + fn + "] no gradient wrt " +
      (a.kind == Arg::Perm ? "the permutation." : "the quantized weights."));
}

}  // namespace

std::vector<mx::array> MixedQMatmul::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums, const std::vector<mx::array>&) {
  auto s = stream();
  const mx::array x = as_x(primals[0]);
  const mx::array& dy = cotangents[0];
  const std::optional<mx::array> perm =
      has_perm_ ? std::optional<mx::array>(primals[1]) : std::nullopt;
  const std::vector<mx::array> packed(primals.begin() + (has_perm_ ? 2 : 1),
                                      primals.end());
  // G = dyᵀ·x[perm] over all rows, float32 (shared by every scales/biases
  // gradient; built only if one is asked for).
  std::optional<mx::array> G;
  auto outer = [&]() -> const mx::array& {
    if (!G) {
      const int N = dy.shape(-1), K = x.shape(-1);
      auto d2 = mx::reshape(mx::astype(dy, mx::float32, s), {-1, N}, s);
      auto x2 = mx::reshape(
          mx::astype(grad::permute_cols(x, perm, s), mx::float32, s), {-1, K}, s);
      G = mx::matmul(mx::transpose(d2, s), x2, s);
    }
    return *G;
  };
  std::vector<mx::array> out;
  for (int arg : argnums) {
    const Arg a = classify(arg, has_perm_);
    if (a.kind == Arg::X) {
      // dy·W, un-permuted, through the packed weights where a kernel
      // applies: on a CPU stream the backend's transposed kernel; on a GPU
      // stream the Metal one for few rows of dy (qmatmul_t_gpu_runs: at
      // most MB_QT_MAX_M = 8; above it MLX's GEMM on the dequantized W
      // wins, as it re-decodes nothing per row). Decided here, from the
      // stream, so a graph never holds a node its device cannot run.
      const int64_t M = int64_t(dy.size()) / std::max(1, dy.shape(-1));
      const bool use_t = s.device == mx::Device::cpu
                             ? prefer_qmm_t(backend_)
                             : qmatmul_t_gpu_runs(M, dy.shape(-1), x.shape(-1),
                                                  int64_t(segs_.size()));
      auto dx = use_t
                    ? mixed_qmatmul_t(dy, perm, packed, segs_, backend_, s)
                    : grad::unpermute_cols(
                          mx::matmul(dy,
                                     mx::astype(grad::dequantize_all(packed, segs_, s),
                                                dy.dtype(), s),
                                     s),
                          perm, s);
      // Shaped as the node's input (the root of x's views, if it is one).
      out.push_back(mx::reshape(mx::astype(dx, x.dtype(), s), primals[0].shape(), s));
    } else if (a.kind == Arg::Perm || a.role == 0) {
      no_grad("vjp", a);
    } else if (a.role == 1) {
      out.push_back(grad::scales_grad(outer(), packed, segs_, a.seg, s));
    } else {
      out.push_back(grad::biases_grad(outer(), packed, segs_, a.seg, s));
    }
  }
  return out;
}

std::vector<mx::array> MixedQMatmul::jvp(const std::vector<mx::array>& primals,
                                         const std::vector<mx::array>& tangents,
                                         const std::vector<int>& argnums) {
  auto s = stream();
  const mx::array x = as_x(primals[0]);
  const std::optional<mx::array> perm =
      has_perm_ ? std::optional<mx::array>(primals[1]) : std::nullopt;
  const std::vector<mx::array> packed(primals.begin() + (has_perm_ ? 2 : 1),
                                      primals.end());
  // W is linear in (scales, biases) for fixed codes, so the weight's tangent
  // for segment i is dequantize(wq_i, ds_i, db_i), a missing one being 0.
  std::vector<std::optional<mx::array>> dsb(packed.size());
  std::optional<mx::array> dx;
  for (size_t j = 0; j < argnums.size(); ++j) {
    const Arg a = classify(argnums[j], has_perm_);
    if (a.kind == Arg::X) dx = as_x(tangents[j]);
    else if (a.kind == Arg::Perm || a.role == 0) no_grad("jvp", a);
    else dsb[3 * a.seg + a.role] = tangents[j];
  }
  std::optional<mx::array> y;
  auto add = [&](mx::array t) { y = y ? mx::add(*y, t, s) : t; };
  if (dx) add(mixed_qmatmul(*dx, perm, packed, segs_, backend_, s));
  std::optional<mx::array> xp;
  int k0 = 0;
  for (size_t i = 0; i < segs_.size(); k0 += segs_[i].k, ++i) {
    auto& ds = dsb[3 * i + 1];
    auto& db = dsb[3 * i + 2];
    if (!ds && !db) continue;
    const mx::array& sc = packed[3 * i + 1];
    auto dW = mx::dequantize(packed[3 * i], ds ? *ds : mx::zeros_like(sc, s),
                             db ? *db : mx::zeros_like(sc, s),
                             segs_[i].group_size, segs_[i].bits, "affine",
                             std::nullopt, std::nullopt, s);
    if (!xp) xp = mx::astype(grad::permute_cols(x, perm, s), mx::float32, s);
    mx::Shape start(xp->ndim(), 0), stop = xp->shape();
    start.back() = k0;
    stop.back() = k0 + segs_[i].k;
    auto xs = mx::slice(*xp, start, stop, s);
    add(mx::matmul(xs, mx::transpose(mx::astype(dW, mx::float32, s), s), s));
  }
  return {mx::astype(*y, x.dtype(), s)};
}

std::pair<std::vector<mx::array>, std::vector<int>> MixedQMatmul::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  for (size_t i = 1; i < axes.size(); ++i)
    if (axes[i] >= 0)
      throw std::runtime_error(
          "[MixedQMatmul::vmap] only x can be vmapped, not the weights.");
  // x's own leading dimensions are already batch dimensions of the product:
  // the vmapped axis becomes the first of them.
  mx::array x = axes[0] >= 0 ? mx::moveaxis(inputs[0], axes[0], 0, stream()) : as_x(inputs[0]);
  if (axes[0] >= 0 && viewed_) {  // each batch entry holds one x's elements in row-major order
    mx::Shape shape{x.shape(0)};
    shape.insert(shape.end(), viewed_->begin(), viewed_->end());
    x = mx::reshape(x, shape, stream());
  }
  const std::optional<mx::array> perm =
      has_perm_ ? std::optional<mx::array>(inputs[1]) : std::nullopt;
  const std::vector<mx::array> packed(inputs.begin() + (has_perm_ ? 2 : 1),
                                      inputs.end());
  return {{mixed_qmatmul(x, perm, packed, segs_, backend_, stream(), act_)},
          {axes[0] >= 0 ? 0 : -1}};
}

}  // namespace mixbits
