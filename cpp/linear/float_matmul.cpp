// FloatMatmul: argument checks, the CPU evaluation (GEMV or blocked BLAS,
// see float_matmul.h) and derivatives.
#include "linear/float_matmul.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/convert.h"
#include "common/cpu_task.h"
#include "common/grads.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "linear/blas.h"
#include "linear/kernel.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/transforms.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("float_matmul: " + msg);
}

// A = a's rows: R x C; the product is M x K times K x N.
struct Dims {
  int64_t R, C, M, K, N;
};

Dims dims_of(const mx::Shape& a, const mx::Shape& b, bool ta, bool tb) {
  Dims d{};
  d.C = a.back();
  d.R = 1;
  for (size_t i = 0; i + 1 < a.size(); ++i) d.R *= a[i];
  d.M = ta ? d.C : d.R;
  d.K = ta ? d.R : d.C;
  d.N = tb ? b[0] : b[1];
  return d;
}

mx::Shape out_shape(const mx::Shape& a, int64_t N, bool ta) {
  if (ta) return {a.back(), int(N)};
  mx::Shape s(a.begin(), a.end() - 1);
  s.push_back(int(N));
  return s;
}

// The same product from MLX's ops: the definition the jvp differentiates.
mx::array mlx_float_matmul(const mx::array& a, const mx::array& b,
                           const std::optional<mx::array>& bias, bool ta, bool tb, mx::Stream s) {
  const Dims d = dims_of(a.shape(), b.shape(), ta, tb);
  mx::array a2 = mx::reshape(a, {int(d.R), int(d.C)}, s);
  mx::array y = mx::matmul(ta ? mx::transpose(a2, s) : a2, tb ? mx::transpose(b, s) : b, s);
  if (bias) y = mx::add(y, *bias, s);
  return mx::reshape(y, out_shape(a.shape(), d.N, ta), s);
}

// All n elements at src (dtype t) as float32: src itself for float32,
// else widened into buf (rows of `row` elements in parallel).
const float* as_f32(const void* src, int64_t n, int64_t row, DType t, std::vector<float>& buf) {
  if (t == DType::f32) return static_cast<const float*>(src);
  buf.resize(size_t(n));
  row = std::max<int64_t>(row, 1);
  const int64_t rows = (n + row - 1) / row;
  parallel_for(rows, std::max<int64_t>(1, (1 << 16) / row), [&](int64_t r0, int64_t r1) {
    const int64_t b = r0 * row, e = std::min(n, r1 * row);
    widen_to_f32(src, b, e - b, t, buf.data() + b);
  });
  return buf.data();
}

// x @ W.T by the GEMV kernel: x float32 rows (M x K), W (N x K) of wt; the
// output rows are split across threads by column groups of 8.
void run_gemv(GemvFn gemv, const float* x, int64_t M, const void* w, DType wt, int64_t K,
              int64_t N, const float* bias, DType ot, void* o) {
  std::vector<float> tmp;
  float* y = static_cast<float*>(o);
  if (ot != DType::f32) {
    tmp.resize(size_t(M * N));
    y = tmp.data();
  }
  const int64_t groups = (N + 7) / 8;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(8 * K * M, 1));
  parallel_for(groups, grain, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 8, n1 = std::min(N, g1 * 8);
    gemv(x, M, w, wt, K, n0, n1, y, N);
    for (int64_t m = 0; m < M; ++m) {
      if (bias)
        for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
      if (ot != DType::f32) narrow_from_f32(y + m * N + n0, n1 - n0, ot, o, m * N + n0);
    }
  });
}

// Columns of op(B) per BLAS call. A function of K, N and B's dtype only,
// never of the thread count: each block is one single-threaded sgemm, so
// every output is summed the same way however many threads share the
// blocks. Up to 8 blocks to share (threads of a larger machine), but at
// least 256 columns: sgemm packs A once per call, about 1 / (2 * columns)
// of the work (at 1024 x 1024 x 256, 4 blocks ran at ~90% of one call).
// A half B is widened block by block: at most ~4 MiB of float32 then, so
// the block is still in the outer caches when sgemm packs it.
int64_t block_columns(int64_t K, int64_t N, bool half) {
  auto round16 = [](int64_t v) { return (v + 15) / 16 * 16; };
  int64_t nb = round16((N + 7) / 8);
  if (half) nb = std::min(nb, round16((int64_t(1) << 20) / std::max<int64_t>(K, 1)));
  return std::min(N, std::max<int64_t>(256, nb));
}

void run_blas(bool ta, bool tb, const float* A, const Dims& d, const void* B, DType bt,
              const float* bias, DType ot, void* o) {
  const int64_t M = d.M, N = d.N, K = d.K, lda = d.C;
  const int64_t nb = block_columns(K, N, bt != DType::f32), blocks = (N + nb - 1) / nb;
  SingleThreadedBlas single;
  parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> wblk(bt == DType::f32 ? 0 : size_t(nb * K));
    std::vector<float> cblk(ot == DType::f32 ? 0 : size_t(M * nb));
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * nb, w = std::min(nb, N - n0);
      const float* bp;
      int64_t ldb;
      if (bt == DType::f32) {
        bp = static_cast<const float*>(B) + (tb ? n0 * K : n0);
        ldb = tb ? K : N;
      } else if (tb) {  // rows n0.. of B: one contiguous run
        widen_to_f32(B, n0 * K, w * K, bt, wblk.data());
        bp = wblk.data();
        ldb = K;
      } else {  // columns n0.. of B (K x N): w per row
        for (int64_t k = 0; k < K; ++k) widen_to_f32(B, k * N + n0, w, bt, wblk.data() + k * w);
        bp = wblk.data();
        ldb = w;
      }
      float* c = ot == DType::f32 ? static_cast<float*>(o) + n0 : cblk.data();
      const int64_t ldc = ot == DType::f32 ? N : w;
      if (bias)
        for (int64_t m = 0; m < M; ++m) std::copy(bias + n0, bias + n0 + w, c + m * ldc);
      blas_sgemm(ta, tb, M, w, K, A, lda, bp, ldb, bias ? 1.0f : 0.0f, c, ldc);
      if (ot != DType::f32)
        for (int64_t m = 0; m < M; ++m) narrow_from_f32(c + m * ldc, w, ot, o, m * N + n0);
    }
  });
}

// The node's output: inputs a, b[, bias], out allocated.
void evaluate(const std::vector<mx::array>& in, mx::array& out, bool ta, bool tb, Backend backend,
              MatmulPath path) {
  const Dims d = dims_of(in[0].shape(), in[1].shape(), ta, tb);
  if (d.M == 0 || d.N == 0) return;
  const DType at = to_dtype(in[0].dtype()), bt = to_dtype(in[1].dtype()), ot = to_dtype(out.dtype());
  void* o = out.data<void>();
  std::vector<char> abuf, bbuf, cbuf;
  const void* A = row_major(in[0], abuf);
  const void* B = row_major(in[1], bbuf);
  std::vector<float> bias_f;
  if (in.size() > 2) {
    bias_f.resize(size_t(d.N));
    widen_to_f32(row_major(in[2], cbuf), 0, d.N, to_dtype(in[2].dtype()), bias_f.data());
  }
  const float* bias = bias_f.empty() ? nullptr : bias_f.data();
  if (d.K == 0) {  // an empty sum: the bias, or zeros
    std::vector<float> row(size_t(d.N), 0.0f);
    if (bias) row = bias_f;
    for (int64_t m = 0; m < d.M; ++m) narrow_from_f32(row.data(), d.N, ot, o, m * d.N);
    return;
  }
  Backend kb;
  const GemvFn gemv = select_gemv(backend, &kb);
  bool use_gemv = path == MatmulPath::Gemv;
  if (path == MatmulPath::Auto)
    use_gemv = !blas_loaded() || (!ta && tb && d.M <= gemv_max_rows(bt) && kb != Backend::Ref);
  std::vector<float> af;
  const float* Af = as_f32(A, d.R * d.C, d.C, at, af);
  if (!use_gemv) {
    run_blas(ta, tb, Af, d, B, bt, bias, ot, o);
    return;
  }
  // The GEMV takes x @ W.T: A.T and B.T are laid out that way first (in
  // float32) when the product is another one (no BLAS here, or asked for).
  std::vector<float> xt, wt;
  const float* x = Af;
  if (ta) {
    xt.resize(size_t(d.M * d.K));
    for (int64_t k = 0; k < d.K; ++k)
      for (int64_t m = 0; m < d.M; ++m) xt[size_t(m * d.K + k)] = Af[k * d.M + m];
    x = xt.data();
  }
  const void* w = B;
  DType wtype = bt;
  if (!tb) {
    std::vector<float> bf;
    const float* Bf = as_f32(B, d.K * d.N, d.N, bt, bf);
    wt.resize(size_t(d.N * d.K));
    for (int64_t k = 0; k < d.K; ++k)
      for (int64_t n = 0; n < d.N; ++n) wt[size_t(n * d.K + k)] = Bf[k * d.N + n];
    w = wt.data();
    wtype = DType::f32;
  }
  run_gemv(gemv, x, d.M, w, wtype, d.K, d.N, bias, ot, o);
}

}  // namespace

mx::array float_matmul(const mx::array& a, const mx::array& b, const std::optional<mx::array>& bias,
                       bool trans_a, bool trans_b, Backend backend, MatmulPath path,
                       mx::StreamOrDevice s) {
  if (!is_float_dtype(a.dtype())) fail("a must be float32, float16 or bfloat16");
  if (!is_float_dtype(b.dtype())) fail("b must be float32, float16 or bfloat16");
  if (a.ndim() < 1) fail("a must have at least one axis");
  if (b.ndim() != 2) fail("b must be 2-D, got shape " + shape_str(b));
  const Dims d = dims_of(a.shape(), b.shape(), trans_a, trans_b);
  const int64_t kb = trans_b ? b.shape(1) : b.shape(0);
  if (kb != d.K)
    fail("inner sizes differ: " + std::string(trans_a ? "a's rows" : "a's last axis") + " give K = " +
         std::to_string(d.K) + ", b " + shape_str(b) + (trans_b ? " (transposed)" : "") +
         " gives " + std::to_string(kb));
  if (trans_a && a.ndim() != 2) fail("with trans_a, a must be 2-D, got shape " + shape_str(a));
  std::vector<mx::array> inputs{a, b};
  mx::Dtype out = mx::promote_types(a.dtype(), b.dtype());
  if (bias) {
    if (!is_float_dtype(bias->dtype())) fail("bias must be float32, float16 or bfloat16");
    if (bias->ndim() != 1 || bias->shape(0) != d.N)
      fail("bias must have shape (" + std::to_string(d.N) + ",), got " + shape_str(*bias));
    out = mx::promote_types(out, bias->dtype());
    inputs.push_back(*bias);
  }
  if (path == MatmulPath::Blas && !blas_loaded()) fail("path 'blas' asked for, but no BLAS is loaded");
  select_gemv(backend);  // an unavailable backend is refused here, not at eval
  return mx::array(out_shape(a.shape(), d.N, trans_a), out,
                   std::make_shared<FloatMatmul>(mx::to_stream(s), trans_a, trans_b, backend, path),
                   std::move(inputs));
}

std::vector<mx::Shape> FloatMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  const Dims d = dims_of(inputs[0].shape(), inputs[1].shape(), ta_, tb_);
  return {out_shape(inputs[0].shape(), d.N, ta_)};
}

bool FloatMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FloatMatmul&>(other);
  return ta_ == o.ta_ && tb_ == o.tb_ && backend_ == o.backend_ && path_ == o.path_;
}

void FloatMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  enc.dispatch([inputs, o = std::move(task_out), ta = ta_, tb = tb_, backend = backend_,
                path = path_]() mutable { evaluate(inputs, o, ta, tb, backend, path); });
}

void FloatMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("float_matmul: CPU only; on the GPU use mx.matmul");
}

// With A = a's rows and Y = op(A) @ op(B) (+ bias), the cotangent G of Y:
//   no trans_a: dA = G @ op(B).T,          d op(B) = A.T @ G
//   trans_a:    dA = op(B) @ G.T (A is K x M), d op(B) = A @ G
// and dB = d op(B) or its transpose; each is one float_matmul.
std::vector<mx::array> FloatMatmul::vjp(const std::vector<mx::array>& primals,
                                        const std::vector<mx::array>& cotangents,
                                        const std::vector<int>& argnums,
                                        const std::vector<mx::array>&) {
  const auto s = stream();
  const mx::array& a = primals[0];
  const mx::array& b = primals[1];
  const mx::array& g = cotangents[0];
  const Dims d = dims_of(a.shape(), b.shape(), ta_, tb_);
  const mx::array a2 = mx::reshape(a, {int(d.R), int(d.C)}, s);
  const mx::array g2 = mx::reshape(g, {int(d.M), int(d.N)}, s);
  auto fm = [&](const mx::array& x, const mx::array& y, bool tx, bool ty) {
    return float_matmul(x, y, std::nullopt, tx, ty, backend_, path_, s);
  };
  std::vector<mx::array> out;
  for (int arg : argnums) {
    if (arg == 0) {
      mx::array da = ta_ ? (tb_ ? fm(b, g2, true, true) : fm(b, g2, false, true))
                         : (tb_ ? fm(g, b, false, false) : fm(g, b, false, true));
      out.push_back(mx::astype(mx::reshape(da, a.shape(), s), a.dtype(), s));
    } else if (arg == 1) {
      mx::array db = ta_ ? (tb_ ? fm(g2, a2, true, true) : fm(a2, g2, false, false))
                         : (tb_ ? fm(g2, a2, true, false) : fm(a2, g2, true, false));
      out.push_back(mx::astype(db, b.dtype(), s));
    } else {
      out.push_back(mx::astype(mx::sum(g2, 0, false, s), primals[2].dtype(), s));
    }
  }
  return out;
}

std::vector<mx::array> FloatMatmul::jvp(const std::vector<mx::array>& primals,
                                        const std::vector<mx::array>& tangents,
                                        const std::vector<int>& argnums) {
  const auto s = stream();
  const bool ta = ta_, tb = tb_;
  auto f = [ta, tb, s](const std::vector<mx::array>& p) {
    std::optional<mx::array> bias;
    if (p.size() > 2) bias = p[2];
    return std::vector<mx::array>{mlx_float_matmul(p[0], p[1], bias, ta, tb, s)};
  };
  return mx::jvp(f, primals, full_tangents(primals, tangents, argnums, s)).second;
}

}  // namespace mixbits
