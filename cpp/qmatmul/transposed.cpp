// MixedQMatmulT: graph construction, CPU evaluation and derivatives of the
// transposed product dx = dy · W, un-permuted (transposed.h).
#include "qmatmul/transposed.h"

#include <limits>
#include <stdexcept>
#include <string>

#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#ifdef _METAL_
#include "qmatmul_t_host.h"
#endif

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("qmatmul (transposed): " + msg);
}

int total_k(const std::vector<SegSpec>& segs) {
  int k = 0;
  for (const auto& sg : segs) k += sg.k;
  return k;
}

}  // namespace

bool qmatmul_t_gpu_runs(int64_t M, int64_t N, int64_t K, int64_t nseg) {
#ifdef _METAL_
  return M > 0 && metal_host::qmv_t_gpu_applies(M, N, K, nseg);
#else
  (void)M, (void)N, (void)K, (void)nseg;
  return false;
#endif
}

mx::array mixed_qmatmul_t(const mx::array& dy,
                          const std::optional<mx::array>& perm,
                          const std::vector<mx::array>& packed,
                          const std::vector<SegSpec>& segs, Backend backend,
                          mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (segs.empty() || packed.size() != 3 * segs.size())
    fail("expected 3 arrays (wq, scales, biases) per segment");
  if (dy.ndim() < 1) fail("dy must have at least one dimension");
  if (!is_float_dtype(dy.dtype())) fail("dy must be float32, float16 or bfloat16");
  const int N = packed[0].shape(0);
  if (dy.shape(-1) != N)
    fail("dy has " + std::to_string(dy.shape(-1)) + " columns but W has N=" +
         std::to_string(N) + " rows");
  const int K = total_k(segs);
  if (stream.device == mx::Device::cpu) {
    select_qmm_t(backend);  // throws now, not inside the graph, if unavailable
  } else {
    int64_t M = 1;
    for (int i = 0; i + 1 < int(dy.ndim()); ++i) M *= dy.shape(i);
    if (!qmatmul_t_gpu_runs(M, N, K, int64_t(segs.size())))
      fail("no GPU kernel for this problem (" + std::to_string(M) + " rows, " +
           std::to_string(segs.size()) + " segments, K=" + std::to_string(K) +
           "; see qmatmul_t_gpu_runs); on the GPU the gradient is "
           "dequantize + matmul there");
  }
  if (perm && (perm->ndim() != 1 || perm->shape(0) != K ||
               (perm->dtype() != mx::int32 && perm->dtype() != mx::uint32)))
    fail("perm must be int32 or uint32 of shape (" + std::to_string(K) + ",)");
  // The kernels read dense row-major buffers.
  std::vector<mx::array> inputs{dense_input(dy, stream)};
  if (perm) inputs.push_back(dense_input(*perm, stream));
  for (const auto& a : packed) inputs.push_back(dense_input(a, stream));
  mx::Shape out_shape = dy.shape();
  out_shape.back() = K;
  return mx::array(out_shape, dy.dtype(),
                   std::make_shared<MixedQMatmulT>(stream, segs, bool(perm), backend),
                   std::move(inputs));
}

std::vector<mx::Shape> MixedQMatmulT::output_shapes(
    const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.back() = total_k(segs_);
  return {s};
}

bool MixedQMatmulT::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const MixedQMatmulT&>(other);
  return segs_ == o.segs_ && has_perm_ == o.has_perm_ && backend_ == o.backend_;
}

void MixedQMatmulT::eval_cpu(const std::vector<mx::array>& inputs,
                             mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  // Capturing the arrays keeps their buffers alive until the task has run.
  enc.dispatch([inputs, out = std::move(task_out), segs = segs_,
                has_perm = has_perm_, fn = select_qmm_t(backend_)]() mutable {
    const mx::array& dy = inputs[0];
    const int first = has_perm ? 2 : 1;
    QMatView w;
    w.N = inputs[first].shape(0);
    w.sdtype = to_dtype(inputs[first + 1].dtype());
    int k0 = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      w.segs.push_back({segs[i].bits, segs[i].group_size, k0, segs[i].k,
                        inputs[first + 3 * i].data<uint32_t>(),
                        inputs[first + 3 * i + 1].data<void>(),
                        inputs[first + 3 * i + 2].data<void>()});
      k0 += segs[i].k;
    }
    w.K = k0;
    const int64_t N = w.N, K = w.K, M = int64_t(out.size()) / K;
    if (M == 0) return;
    // No special case for inf or NaN in dy (unlike the forward): the
    // transposed kernels multiply by the dequantized W, no folded bias, so
    // they have a dense matmul's IEEE behaviour.
    const DType dt = to_dtype(dy.dtype()), ot = to_dtype(out.dtype());
    std::vector<float> dyf, zf;
    const float* d = nullptr;
    if (dt == DType::f32) {
      d = dy.data<float>();
    } else {
      dyf.resize(size_t(M * N));
      const void* src = dy.data<void>();
      parallel_for(M * N, 1 << 14, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) dyf[i] = load_as_f32(src, i, dt);
      });
      d = dyf.data();
    }
    const int32_t* perm = has_perm ? inputs[1].data<int32_t>() : nullptr;
    float* z = nullptr;
    if (ot == DType::f32) {
      z = out.data<float>();
    } else {
      zf.resize(size_t(M * K));
      z = zf.data();
    }
    fn(d, int(M), w, z);
    if (perm) {
      // In place, row by row through a K-float copy (no second M x K
      // buffer). A true permutation (all the Python layer makes) is undone
      // by a gather through its inverse, which has no read-modify-write
      // chain through perm: 1.4-1.9 ms on 1024 x 1536 against 27 ms for the
      // product, where the scatter-add below took about 6 ms. That remains
      // for repeated columns (they sum, in float32, rounded once); an
      // out-of-range index poisons the row with NaN.
      bool ok = true;
      for (int64_t k = 0; k < K; ++k) ok &= perm[k] >= 0 && perm[k] < K;
      std::vector<int32_t> inv(ok ? K : 0, -1);
      bool bijective = ok;
      for (int64_t k = 0; ok && k < K; ++k) {
        bijective &= inv[perm[k]] < 0;
        inv[perm[k]] = int32_t(k);
      }
      parallel_for(M, 16, [&](int64_t m0, int64_t m1) {
        std::vector<float> row(K);
        for (int64_t m = m0; m < m1; ++m) {
          float* zr = z + m * K;
          std::copy(zr, zr + K, row.begin());
          if (bijective) {
            for (int64_t j = 0; j < K; ++j) zr[j] = row[inv[j]];
            continue;
          }
          std::fill(zr, zr + K, ok ? 0.0f : std::numeric_limits<float>::quiet_NaN());
          if (ok)
            for (int64_t k = 0; k < K; ++k) zr[perm[k]] += row[k];
        }
      });
    }
    if (ot != DType::f32) {
      void* o = out.data<void>();
      parallel_for(M * K, 1 << 14, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) store_from_f32(o, i, z[i], ot);
      });
    }
  });
}

#ifndef _METAL_
// The Metal kernels are in cpp/qmatmul/metal.cpp; mixed_qmatmul_t never
// builds this node on a GPU stream without them (qmatmul_t_gpu_runs).
void MixedQMatmulT::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[MixedQMatmulT] this build of mixbits has no GPU kernels");
}
#endif

namespace {

// The inputs after dy: the permutation, if any, and the packed weights.
struct Parts {
  std::optional<mx::array> perm;
  std::vector<mx::array> packed;
};

Parts split(const std::vector<mx::array>& in, bool has_perm) {
  const size_t first = has_perm ? 2 : 1;
  return {has_perm ? std::optional<mx::array>(in[1]) : std::nullopt,
          std::vector<mx::array>(in.begin() + first, in.end())};
}

[[noreturn]] void no_grad(const char* fn, bool perm) {
  throw std::runtime_error(std::string("[MixedQMatmulT::") + fn + "] no gradient wrt " +
                           (perm ? "the permutation." : "the quantized weights."));
}

}  // namespace

std::vector<mx::array> MixedQMatmulT::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums, const std::vector<mx::array>&) {
  auto s = stream();
  const mx::array& dy = primals[0];
  const mx::array& g = cotangents[0];
  const auto [perm, packed] = split(primals, has_perm_);
  const int first = has_perm_ ? 2 : 1;
  std::vector<mx::array> out;
  for (int arg : argnums) {
    if (arg == 0) {
      // dx = unpermute(dy · W), so d/d(dy) = g[..., perm] · Wᵀ: the forward.
      out.push_back(mx::astype(mixed_qmatmul(g, perm, packed, segs_, backend_, s),
                               dy.dtype(), s));
      continue;
    }
    if (has_perm_ && arg == 1) no_grad("vjp", true);
    const size_t seg = size_t(arg - first) / 3;
    const int role = (arg - first) % 3;
    if (role == 0) no_grad("vjp", false);
    // dL/dW[n, k] = sum over rows of dy[., n] g[., perm[k]]: the same outer
    // product the forward's scales/biases gradients start from.
    const int N = dy.shape(-1), K = g.shape(-1);
    auto d2 = mx::reshape(mx::astype(dy, mx::float32, s), {-1, N}, s);
    auto g2 = mx::reshape(
        mx::astype(grad::permute_cols(g, perm, s), mx::float32, s), {-1, K}, s);
    auto G = mx::matmul(mx::transpose(d2, s), g2, s);
    out.push_back(role == 1 ? grad::scales_grad(G, packed, segs_, seg, s)
                            : grad::biases_grad(G, packed, segs_, seg, s));
  }
  return out;
}

std::vector<mx::array> MixedQMatmulT::jvp(const std::vector<mx::array>& primals,
                                          const std::vector<mx::array>& tangents,
                                          const std::vector<int>& argnums) {
  auto s = stream();
  const mx::array& dy = primals[0];
  const auto [perm, packed] = split(primals, has_perm_);
  const int first = has_perm_ ? 2 : 1;
  std::optional<mx::array> t_dy;
  std::vector<std::optional<mx::array>> dsb(packed.size());
  for (size_t j = 0; j < argnums.size(); ++j) {
    const int arg = argnums[j];
    if (arg == 0) t_dy = tangents[j];
    else if (has_perm_ && arg == 1) no_grad("jvp", true);
    else if ((arg - first) % 3 == 0) no_grad("jvp", false);
    else dsb[arg - first] = tangents[j];
  }
  std::optional<mx::array> z;
  if (t_dy) z = mixed_qmatmul_t(*t_dy, perm, packed, segs_, backend_, s);
  // W is linear in (scales, biases): segment i's tangent is
  // dy · dequantize(wq_i, ds_i, db_i), zero where neither is given.
  bool any = false;
  for (const auto& t : dsb) any |= bool(t);
  if (any) {
    std::vector<mx::array> parts;
    auto dyf = mx::astype(dy, mx::float32, s);
    for (size_t i = 0; i < segs_.size(); ++i) {
      auto& ds = dsb[3 * i + 1];
      auto& db = dsb[3 * i + 2];
      if (!ds && !db) {
        mx::Shape sh = dy.shape();
        sh.back() = segs_[i].k;
        parts.push_back(mx::zeros(sh, mx::float32, s));
        continue;
      }
      const mx::array& sc = packed[3 * i + 1];
      auto dW = mx::dequantize(packed[3 * i], ds ? *ds : mx::zeros_like(sc, s),
                               db ? *db : mx::zeros_like(sc, s), segs_[i].group_size,
                               segs_[i].bits, "affine", std::nullopt, std::nullopt, s);
      parts.push_back(mx::matmul(dyf, mx::astype(dW, mx::float32, s), s));
    }
    auto t = grad::unpermute_cols(mx::concatenate(parts, -1, s), perm, s);
    t = mx::astype(t, dy.dtype(), s);
    z = z ? mx::add(*z, t, s) : t;
  }
  return {*z};
}

std::pair<std::vector<mx::array>, std::vector<int>> MixedQMatmulT::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  for (size_t i = 1; i < axes.size(); ++i)
    if (axes[i] >= 0)
      throw std::runtime_error(
          "[MixedQMatmulT::vmap] only dy can be vmapped, not the weights.");
  // dy's leading dimensions are batch dimensions of the product already.
  mx::array dy = axes[0] >= 0 ? mx::moveaxis(inputs[0], axes[0], 0, stream())
                              : inputs[0];
  const auto [perm, packed] = split(inputs, has_perm_);
  return {{mixed_qmatmul_t(dy, perm, packed, segs_, backend_, stream())},
          {axes[0] >= 0 ? 0 : -1}};
}

}  // namespace mixbits
