// Derivatives of MixedGatherQMM and of its CPU gradient MixedGatherQMMT.
// dx runs the transposed kernel through the packed weights (transposed.h)
// wherever MixedQMatmul's gradient does (prefer_qmm_t), and on a GPU stream
// through the Metal kernels where they apply (gather_qmm_t_gpu_runs: at
// most MB_QT_MAX_M rows per matrix, 32-bit counts, a build with Metal);
// elsewhere (Auto on arm64, more rows, no Metal) a dense W and MLX's
// gather_mm, scattered back to x's batches. The scales/biases
// gradients come from G[e] = Σ_{i: rhs[i]=e} dy[i]ᵀ·x[lhs[i]][perm], a
// segmented matmul over the rows sorted by expert (never a [P, N, K]
// intermediate per output matrix).
#include <stdexcept>

#include "gather/gather.h"
#include "gather/transposed.h"

namespace mixbits {

namespace {

struct Parts {
  mx::array x;
  std::optional<mx::array> perm;
  std::vector<mx::array> packed;
  mx::array lhs, rhs;
};

Parts split(const std::vector<mx::array>& in, bool has_perm) {
  const size_t first = has_perm ? 2 : 1;
  return {in[0],
          has_perm ? std::optional<mx::array>(in[1]) : std::nullopt,
          std::vector<mx::array>(in.begin() + first, in.end() - 2),
          in[in.size() - 2], in[in.size() - 1]};
}

int64_t batch_size(const mx::array& a) {
  int64_t p = 1;
  for (int i = 0; i < int(a.ndim()) - 2; ++i) p *= a.shape(i);
  return p;
}

[[noreturn]] void no_grad(const char* fn, const char* what) {
  throw std::runtime_error(std::string("[MixedGatherQMM::") + fn +
                           "] no gradient wrt " + what + ".");
}

[[noreturn]] void no_grad_t(const char* fn, const char* what) {
  throw std::runtime_error(std::string("[MixedGatherQMMT::") + fn +
                           "] no gradient wrt " + what + ".");
}

// Which input an argnum names, for the messages and the dispatch.
const char* undifferentiable(int arg, size_t n_inputs, bool has_perm) {
  if (arg >= int(n_inputs) - 2) return "the indices";
  if (has_perm && arg == 1) return "the permutation";
  if (arg > 0 && (arg - (has_perm ? 2 : 1)) % 3 == 0) return "the quantized weights";
  return nullptr;
}

}  // namespace

namespace gather_grad {

mx::array dense_dx(const mx::array& dy, const mx::array& W,
                   const std::optional<mx::array>& perm, const mx::array& lhs,
                   const mx::array& rhs, const mx::Shape& x_shape,
                   mx::StreamOrDevice s) {
  const int M = x_shape[x_shape.size() - 2], K = x_shape.back();
  const int N = dy.shape(-1), P = int(lhs.size());
  int Bx = 1;
  for (size_t i = 0; i + 2 < x_shape.size(); ++i) Bx *= x_shape[i];
  // float32: MLX's CPU gather_mm takes nothing else.
  auto Wf = mx::reshape(mx::astype(W, mx::float32, s), {-1, N, K}, s);
  auto g = mx::gather_mm(mx::astype(dy, mx::float32, s), Wf, std::nullopt, rhs,
                         false, s);
  g = mx::reshape(grad::unpermute_cols(g, perm, s), {P, 1, M, K}, s);
  auto dx = mx::scatter_add(mx::zeros({Bx, M, K}, mx::float32, s),
                            mx::reshape(lhs, {P}, s), g, 0, s);
  return mx::reshape(dx, x_shape, s);
}

mx::array expert_outer(const mx::array& dy, const mx::array& a,
                       const std::optional<mx::array>& perm,
                       const std::vector<mx::array>& packed,
                       const mx::array& lhs, const mx::array& rhs,
                       mx::StreamOrDevice s) {
  const int M = a.shape(-2), K = a.shape(-1), N = dy.shape(-1);
  const int P = int(lhs.size());
  const int Bx = int(batch_size(a)), Bw = int(batch_size(packed[0]));
  auto lflat = mx::reshape(lhs, {P}, s);
  auto rflat = mx::reshape(rhs, {P}, s);
  // Rows sorted by expert, so each expert's rows are one contiguous
  // segment of the contraction axis.
  auto order = mx::argsort(rflat, s);
  auto dys = mx::take(mx::reshape(mx::astype(dy, mx::float32, s), {P, M, N}, s),
                      order, 0, s);
  auto ap = mx::reshape(
      mx::astype(grad::permute_cols(a, perm, s), mx::float32, s), {Bx, M, K}, s);
  auto as = mx::take(ap, mx::take(lflat, order, s), 0, s);
  auto counts = mx::scatter_add_axis(
      mx::zeros({Bw}, mx::uint32, s), rflat,
      mx::full({P}, mx::array(uint32_t(M)), s), 0, s);
  auto ends = mx::cumsum(counts, 0, false, true, s);
  auto bounds = mx::stack({mx::subtract(ends, counts, s), ends}, -1, s);
  auto g = mx::segmented_mm(mx::transpose(mx::reshape(dys, {P * M, N}, s), s),
                            mx::reshape(as, {P * M, K}, s), bounds, s);
  mx::Shape shape = packed[0].shape();
  shape.back() = K;
  return mx::reshape(g, shape, s);
}

}  // namespace gather_grad

std::vector<mx::array> MixedGatherQMM::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums, const std::vector<mx::array>&) {
  auto s = stream();
  Parts p = split(primals, has_perm_);
  const mx::array& dy = cotangents[0];
  std::optional<mx::array> G;  // shared by every scales/biases gradient
  std::vector<mx::array> out;
  for (int arg : argnums) {
    if (const char* what = undifferentiable(arg, primals.size(), has_perm_))
      no_grad("vjp", what);
    if (arg == 0) {
      // The device is the stream's, decided here, so a graph never holds a
      // node its device cannot run.
      const int M = p.x.shape(-2), K = p.x.shape(-1);
      const bool use_t =
          s.device == mx::Device::cpu
              ? prefer_qmm_t(backend_)
              : gather_qmm_t_gpu_runs(int64_t(p.lhs.size()), M, p.packed[0].shape(-2), K,
                                      batch_size(p.x), batch_size(p.packed[0]),
                                      int64_t(segs_.size()));
      auto dx = use_t
                    ? mixed_gather_qmm_t(dy, p.perm, p.packed, segs_, p.lhs,
                                         p.rhs, p.x.shape(), backend_, s)
                    : gather_grad::dense_dx(
                          dy, grad::dequantize_all(p.packed, segs_, s), p.perm,
                          p.lhs, p.rhs, p.x.shape(), s);
      out.push_back(mx::astype(dx, p.x.dtype(), s));
      continue;
    }
    if (!G)
      G = gather_grad::expert_outer(dy, p.x, p.perm, p.packed, p.lhs, p.rhs, s);
    const size_t i = size_t(arg - (has_perm_ ? 2 : 1));
    out.push_back(i % 3 == 1 ? grad::scales_grad(*G, p.packed, segs_, i / 3, s)
                             : grad::biases_grad(*G, p.packed, segs_, i / 3, s));
  }
  return out;
}

std::vector<mx::array> MixedGatherQMM::jvp(const std::vector<mx::array>& primals,
                                           const std::vector<mx::array>& tangents,
                                           const std::vector<int>& argnums) {
  auto s = stream();
  Parts p = split(primals, has_perm_);
  const int M = p.x.shape(-2), K = p.x.shape(-1);
  const int N = p.packed[0].shape(-2);
  const int Bx = int(batch_size(p.x)), Bw = int(batch_size(p.packed[0]));
  std::vector<std::optional<mx::array>> dsb(p.packed.size());
  std::optional<mx::array> y;
  auto add = [&](mx::array t) { y = y ? mx::add(*y, t, s) : t; };
  for (size_t j = 0; j < argnums.size(); ++j) {
    const int arg = argnums[j];
    if (const char* what = undifferentiable(arg, primals.size(), has_perm_))
      no_grad("jvp", what);
    if (arg == 0)
      add(mixed_gather_qmm(tangents[j], p.perm, p.packed, segs_, p.lhs, p.rhs,
                           sorted_, backend_, s));
    else
      dsb[size_t(arg - (has_perm_ ? 2 : 1))] = tangents[j];
  }
  // W is linear in (scales, biases) for fixed codes: each segment's weight
  // tangent is dequantize(wq, ds, db), multiplied like the forward.
  auto xp = mx::reshape(
      mx::astype(grad::permute_cols(p.x, p.perm, s), mx::float32, s), {Bx, M, K}, s);
  int k0 = 0;
  for (size_t i = 0; i < segs_.size(); k0 += segs_[i].k, ++i) {
    auto& ds = dsb[3 * i + 1];
    auto& db = dsb[3 * i + 2];
    if (!ds && !db) continue;
    const mx::array& sc = p.packed[3 * i + 1];
    auto dW = mx::dequantize(p.packed[3 * i], ds ? *ds : mx::zeros_like(sc, s),
                             db ? *db : mx::zeros_like(sc, s),
                             segs_[i].group_size, segs_[i].bits, "affine",
                             std::nullopt, std::nullopt, s);
    dW = mx::reshape(mx::astype(dW, mx::float32, s), {Bw, N, segs_[i].k}, s);
    auto xs = mx::slice(xp, {0, 0, k0}, {Bx, M, k0 + segs_[i].k}, s);
    add(mx::gather_mm(xs, mx::swapaxes(dW, -1, -2, s), p.lhs, p.rhs, false, s));
  }
  return {mx::astype(*y, p.x.dtype(), s)};
}

// MixedGatherQMMT's inputs are laid out as MixedGatherQMM's, dy in x's
// place, so split() and undifferentiable() serve both.
std::vector<mx::array> MixedGatherQMMT::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums, const std::vector<mx::array>&) {
  auto s = stream();
  Parts p = split(primals, has_perm_);  // p.x is dy
  const mx::array& g = cotangents[0];   // x's shape
  std::optional<mx::array> G;
  std::vector<mx::array> out;
  for (int arg : argnums) {
    if (const char* what = undifferentiable(arg, primals.size(), has_perm_))
      no_grad_t("vjp", what);
    if (arg == 0) {
      // dx[lhs[i]] += unpermute(dy[i] · W[rhs[i]]), so d/d(dy)[i] =
      // g[lhs[i]][perm] · W[rhs[i]]ᵀ: the forward gather.
      out.push_back(mx::astype(mixed_gather_qmm(g, p.perm, p.packed, segs_, p.lhs,
                                                p.rhs, false, backend_, s),
                               p.x.dtype(), s));
      continue;
    }
    // dL/dW[e] = Σ_{i: rhs[i]=e} dy[i]ᵀ · g[lhs[i]][perm].
    if (!G)
      G = gather_grad::expert_outer(p.x, g, p.perm, p.packed, p.lhs, p.rhs, s);
    const size_t i = size_t(arg - (has_perm_ ? 2 : 1));
    out.push_back(i % 3 == 1 ? grad::scales_grad(*G, p.packed, segs_, i / 3, s)
                             : grad::biases_grad(*G, p.packed, segs_, i / 3, s));
  }
  return out;
}

std::vector<mx::array> MixedGatherQMMT::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents, const std::vector<int>& argnums) {
  auto s = stream();
  Parts p = split(primals, has_perm_);  // p.x is dy
  std::optional<mx::array> t_dy;
  std::vector<std::optional<mx::array>> dsb(p.packed.size());
  for (size_t j = 0; j < argnums.size(); ++j) {
    const int arg = argnums[j];
    if (const char* what = undifferentiable(arg, primals.size(), has_perm_))
      no_grad_t("jvp", what);
    if (arg == 0) t_dy = tangents[j];
    else dsb[size_t(arg - (has_perm_ ? 2 : 1))] = tangents[j];
  }
  std::optional<mx::array> z;
  if (t_dy)
    z = mixed_gather_qmm_t(*t_dy, p.perm, p.packed, segs_, p.lhs, p.rhs,
                           x_shape_, backend_, s);
  // W is linear in (scales, biases) for fixed codes: the weight tangent is
  // dequantize(wq, ds, db) per segment (zeros where neither is given),
  // multiplied as the dense dx is.
  bool any = false;
  for (const auto& t : dsb) any |= bool(t);
  if (any) {
    std::vector<mx::array> parts;
    for (size_t i = 0; i < segs_.size(); ++i) {
      const mx::array& sc = p.packed[3 * i + 1];
      auto& ds = dsb[3 * i + 1];
      auto& db = dsb[3 * i + 2];
      if (!ds && !db) {
        mx::Shape sh = sc.shape();
        sh.back() = segs_[i].k;
        parts.push_back(mx::zeros(sh, mx::float32, s));
        continue;
      }
      parts.push_back(mx::astype(
          mx::dequantize(p.packed[3 * i], ds ? *ds : mx::zeros_like(sc, s),
                         db ? *db : mx::zeros_like(sc, s), segs_[i].group_size,
                         segs_[i].bits, "affine", std::nullopt, std::nullopt, s),
          mx::float32, s));
    }
    auto dW = parts.size() == 1 ? parts[0] : mx::concatenate(parts, -1, s);
    auto t = mx::astype(gather_grad::dense_dx(p.x, dW, p.perm, p.lhs, p.rhs,
                                              x_shape_, s),
                        p.x.dtype(), s);
    z = z ? mx::add(*z, t, s) : t;
  }
  return {*z};
}

}  // namespace mixbits
