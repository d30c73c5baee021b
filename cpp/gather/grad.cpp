// Derivatives of MixedGatherQMM from MLX's public ops, as for MixedQMatmul
// (qmatmul/grad.cpp): dx through a dense W and gather_mm, scattered back to
// x's batches; the scales/biases gradients from G[e] = Σ_{i: rhs[i]=e}
// dy[i]ᵀ·x[lhs[i]][perm], a segmented matmul over the rows sorted by expert
// (never a [P, N, K] intermediate per output matrix).
#include <stdexcept>

#include "gather/gather.h"

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
  for (int i = 0; i < a.ndim() - 2; ++i) p *= a.shape(i);
  return p;
}

[[noreturn]] void no_grad(const char* fn, const char* what) {
  throw std::runtime_error(std::string("[MixedGatherQMM::") + fn +
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

std::vector<mx::array> MixedGatherQMM::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums, const std::vector<mx::array>&) {
  auto s = stream();
  Parts p = split(primals, has_perm_);
  const mx::array& dy = cotangents[0];
  const int M = p.x.shape(-2), K = p.x.shape(-1), N = dy.shape(-1);
  const int P = int(p.lhs.size());
  const int Bx = int(batch_size(p.x)), Bw = int(batch_size(p.packed[0]));
  auto lflat = mx::reshape(p.lhs, {P}, s);
  auto rflat = mx::reshape(p.rhs, {P}, s);

  std::optional<mx::array> G;
  auto outer = [&]() -> const mx::array& {
    if (!G) {
      // Rows sorted by expert, so each expert's rows are one contiguous
      // segment of the contraction axis.
      auto order = mx::argsort(rflat, s);
      auto dys = mx::take(mx::reshape(mx::astype(dy, mx::float32, s), {P, M, N}, s),
                          order, 0, s);
      auto xp = mx::reshape(
          mx::astype(grad::permute_cols(p.x, p.perm, s), mx::float32, s),
          {Bx, M, K}, s);
      auto xs = mx::take(xp, mx::take(lflat, order, s), 0, s);
      auto counts = mx::scatter_add_axis(
          mx::zeros({Bw}, mx::uint32, s), rflat,
          mx::full({P}, mx::array(uint32_t(M)), s), 0, s);
      auto ends = mx::cumsum(counts, 0, false, true, s);
      auto bounds = mx::stack({mx::subtract(ends, counts, s), ends}, -1, s);
      auto g = mx::segmented_mm(
          mx::transpose(mx::reshape(dys, {P * M, N}, s), s),
          mx::reshape(xs, {P * M, K}, s), bounds, s);
      mx::Shape shape = p.packed[0].shape();
      shape.back() = K;
      G = mx::reshape(g, shape, s);
    }
    return *G;
  };

  std::vector<mx::array> out;
  for (int arg : argnums) {
    if (const char* what = undifferentiable(arg, primals.size(), has_perm_))
      no_grad("vjp", what);
    if (arg == 0) {
      // float32: MLX's CPU gather_mm takes nothing else.
      auto W = mx::astype(grad::dequantize_all(p.packed, segs_, s), mx::float32, s);
      W = mx::reshape(W, {Bw, N, K}, s);
      auto g = mx::gather_mm(mx::astype(dy, mx::float32, s), W, std::nullopt,
                             p.rhs, false, s);
      g = mx::reshape(grad::unpermute_cols(g, p.perm, s), {P, 1, M, K}, s);
      auto dx = mx::scatter_add(mx::zeros({Bx, M, K}, g.dtype(), s), lflat, g, 0, s);
      out.push_back(mx::astype(mx::reshape(dx, p.x.shape(), s), p.x.dtype(), s));
      continue;
    }
    const size_t i = size_t(arg - (has_perm_ ? 2 : 1));
    out.push_back(i % 3 == 1
                      ? grad::scales_grad(outer(), p.packed, segs_, i / 3, s)
                      : grad::biases_grad(outer(), p.packed, segs_, i / 3, s));
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

}  // namespace mixbits
