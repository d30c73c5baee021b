// MixedGatherQMM: argument checks in MLX's words, graph construction, and
// the CPU evaluation (the Metal one is in metal.cpp). The CPU path groups the output matrices by weight
// batch (expert) and runs the existing per-row qmatmul backends once per
// expert on all of that expert's rows, so each expert's weights are decoded
// once per call however many tokens chose it.
#include "gather/gather.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "common/convert.h"
#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "gather/experts.h"
#include "gather_host.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[gather_qmm] " + msg);
}

mx::Shape batch_of(const mx::array& a) {
  return mx::Shape(a.shape().begin(), a.shape().end() - 2);
}

// Segment checks of mixed_qmatmul, with a batch shape shared by every
// array; returns (N, K).
std::pair<int, int64_t> check_weights(const std::vector<mx::array>& packed,
                                      const std::vector<SegSpec>& segs) {
  if (segs.empty()) fail("at least one segment is required");
  if (packed.size() != 3 * segs.size())
    fail("expected 3 arrays (wq, scales, biases) per segment");
  const mx::Shape wb = packed[0].ndim() >= 2 ? batch_of(packed[0]) : mx::Shape{};
  const mx::Dtype sdt = packed[1].dtype();
  int N = -1;
  int64_t K = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const SegSpec& sg = segs[i];
    const std::string tag = "segment " + std::to_string(i) + ": ";
    if (sg.bits != 2 && sg.bits != 3 && sg.bits != 4 && sg.bits != 5 &&
        sg.bits != 6 && sg.bits != 8)
      fail(tag + "bits must be one of 2,3,4,5,6,8");
    if (sg.group_size != 32 && sg.group_size != 64 && sg.group_size != 128)
      fail(tag + "group_size must be 32, 64 or 128");
    if (sg.k <= 0 || sg.k % sg.group_size != 0)
      fail(tag + "column count is not a positive multiple of group_size");
    const mx::array& wq = packed[3 * i];
    if (wq.ndim() < 2)
      fail("Input must have at least two dimensions but got input with shape " +
           shape_str(wq) + ".");
    if (wq.dtype() != mx::uint32)
      fail(tag + "The weight matrix should be uint32.");
    if (N < 0) N = wq.shape(-2);
    const int64_t words = int64_t(sg.k) * sg.bits / 32;
    const int64_t groups = sg.k / sg.group_size;
    for (int r = 0; r < 3; ++r) {
      const mx::array& a = packed[3 * i + r];
      const char* nm = r == 0 ? "weight" : r == 1 ? "scales" : "biases";
      if (a.ndim() < 2 || batch_of(a) != wb)
        fail(tag + "Weight, scales and biases should have the same batch "
             "shape; " + nm + " has shape " + shape_str(a) + ".");
      if (r > 0 && !is_float_dtype(a.dtype()))
        fail(tag + nm + " must be float32, float16 or bfloat16");
      if (r > 0 && a.dtype() != sdt)
        fail(tag + nm + " dtype differs from segment 0's scales");
      const int64_t cols = r == 0 ? words : groups;
      if (a.shape(-2) != N || a.shape(-1) != cols)
        fail(tag + nm + " shape " + shape_str(a) + " does not end in (" +
             std::to_string(N) + ", " + std::to_string(cols) + ")");
    }
    K += sg.k;
    if (K > std::numeric_limits<int32_t>::max())
      fail("the segments cover more than 2^31 - 1 columns");
  }
  return {N, K};
}

}  // namespace

mx::array indices_or_default(const std::optional<mx::array>& idx,
                             const mx::Shape& batch, mx::StreamOrDevice s) {
  if (idx) {
    if (!mx::issubdtype(idx->dtype(), mx::integer))
      fail("Got indices with invalid dtype. Indices must be integral.");
    return mx::astype(*idx, mx::uint32, s);
  }
  const int64_t total = prod(batch, 0, batch.size());
  if (total > std::numeric_limits<int32_t>::max())
    fail("the batch has more than 2^31 - 1 matrices");
  return mx::reshape(mx::arange(int(total), mx::uint32, s), batch, s);
}

namespace {

// Whether MixedGatherQMM::eval_gpu (cpp/gather/metal.cpp) can run this
// problem: this build has the Metal kernels (not so with an MLX built for
// another GPU backend, whose eval_gpu would only throw), the counts fit its
// 32-bit parameters, and x and W hold a matrix each (an empty batch binds
// no buffer). Every dtype the builder admits has a kernel. Elsewhere
// mixed_gather_qmm composes MLX ops.
bool gpu_kernel_runs(const mx::array& x, const mx::array& wq0, const mx::array& li) {
#ifdef _METAL_
  const int64_t bx = prod(x.shape(), 0, x.ndim() - 2);
  const int64_t bw = prod(wq0.shape(), 0, wq0.ndim() - 2);
  return bx > 0 && bw > 0 &&
         metal_host::gather_gpu_refusal(int64_t(li.size()), x.shape(-2), bx, bw).empty();
#else
  (void)x, (void)wq0, (void)li;
  return false;
#endif
}

}  // namespace

mx::array mixed_gather_qmm(const mx::array& x,
                           const std::optional<mx::array>& perm,
                           const std::vector<mx::array>& packed,
                           const std::vector<SegSpec>& segs,
                           std::optional<mx::array> lhs,
                           std::optional<mx::array> rhs, bool sorted,
                           Backend backend, mx::StreamOrDevice s, Activations act) {
  if (!activations_valid(act)) fail(activations_refusal(act));
  auto [N, K] = check_weights(packed, segs);
  if (x.ndim() < 2)
    fail("Input must have at least two dimensions but got input with shape " +
         shape_str(x) + ".");
  if (!is_float_dtype(x.dtype()))
    fail("x must be float32, float16 or bfloat16");
  if (x.shape(-1) != K)
    fail("Last dimension of first input with shape (..., " +
         std::to_string(x.shape(-1)) + ") does not match the expanded "
         "quantized matrix (" + std::to_string(K) + ", " + std::to_string(N) +
         ")");
  if (perm) {
    if (perm->dtype() != mx::int32 && perm->dtype() != mx::uint32)
      fail("perm must be int32 or uint32");
    if (perm->ndim() != 1 || perm->shape(0) != K)
      fail("perm shape " + shape_str(*perm) + " != (" + std::to_string(K) + ",)");
  }
  auto stream = mx::to_stream(s);
  auto li = indices_or_default(lhs, batch_of(x), stream);
  auto ri = indices_or_default(rhs, batch_of(packed[0]), stream);
  auto bc = mx::broadcast_arrays({li, ri}, stream);  // MLX's shape errors
  li = bc[0];
  ri = bc[1];

  if (stream.device == mx::Device::gpu) {
    if (backend != Backend::Auto)
      fail("backend= chooses a CPU kernel; on the GPU leave it unset");
    if (act != Activations::Float)
      fail(std::string("activations='") + activation_name(act) +
           "' is a CPU contract; the GPU kernels take float x");
    if (!gpu_kernel_runs(x, packed[0], li)) {
      // Dense weights and MLX's gather_mm, which MLX also differentiates
      // itself; float32 as on the CPU path (MLX's CPU gather_mm has no other
      // type).
      auto W = mx::astype(grad::dequantize_all(packed, segs, stream), mx::float32, stream);
      auto xp = mx::astype(grad::permute_cols(x, perm, stream), mx::float32, stream);
      auto y = mx::gather_mm(xp, mx::swapaxes(W, -1, -2, stream), li, ri, sorted, stream);
      return mx::astype(y, x.dtype(), stream);
    }
  } else {
    select_qmm(backend);  // throw now, not inside the graph, if unavailable
    select_qmm_int(act, backend);
  }

  // Both evaluations read every input as a dense row-major buffer (the
  // Metal kernel cannot do otherwise, and eval_gpu may only use MLX_API
  // symbols, which exclude MLX's GPU copy helpers), so the node holds the
  // same arrays on either device.
  std::vector<mx::array> inputs{dense_input(x, stream)};
  if (perm) inputs.push_back(dense_input(*perm, stream));
  for (const auto& a : packed) inputs.push_back(dense_input(a, stream));
  inputs.push_back(dense_input(li, stream));
  inputs.push_back(dense_input(ri, stream));
  mx::Shape out_shape = li.shape();
  out_shape.push_back(x.shape(-2));
  out_shape.push_back(N);
  return mx::array(std::move(out_shape), x.dtype(),
                   std::make_shared<MixedGatherQMM>(stream, segs, bool(perm),
                                                    backend, sorted, act),
                   std::move(inputs));
}

mx::array mixed_batched_qmm(const mx::array& x,
                            const std::optional<mx::array>& perm,
                            const std::vector<mx::array>& packed,
                            const std::vector<SegSpec>& segs, Backend backend,
                            mx::StreamOrDevice s, Activations act) {
  if (!packed.empty() && packed[0].ndim() > 2 && x.ndim() < 3)
    // MLX silently multiplies by the first matrix of the batch here; a
    // refusal is kinder than a result that ignores the rest of w.
    throw std::invalid_argument(
        "[quantized_matmul] w has batch dimensions " +
        shape_str(batch_of(packed[0])) + " but x has shape " + shape_str(x) +
        "; give x batch dimensions (e.g. x[None]) to broadcast against them.");
  return mixed_gather_qmm(x, perm, packed, segs, std::nullopt, std::nullopt,
                          false, backend, s, act);
}

std::vector<mx::Shape> MixedGatherQMM::output_shapes(
    const std::vector<mx::array>& inputs) {
  const mx::array& li = inputs[inputs.size() - 2];
  mx::Shape s = li.shape();
  s.push_back(inputs[0].shape(-2));
  s.push_back(inputs[has_perm_ ? 2 : 1].shape(-2));
  return {s};
}

bool MixedGatherQMM::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const MixedGatherQMM&>(other);
  return segs_ == o.segs_ && has_perm_ == o.has_perm_ &&
         backend_ == o.backend_ && sorted_ == o.sorted_ && act_ == o.act_;
}

void gather_cpu_eval(const std::vector<mx::array>& inputs, bool has_perm, int N, int64_t Bw,
                     int int_max_m, mx::array& out, const ExpertRun& run) {
  const mx::array& x = inputs[0];
  const mx::array& li = inputs[inputs.size() - 2];
  const mx::array& ri = inputs[inputs.size() - 1];
  const int M = x.shape(-2), K = x.shape(-1);
  const int64_t P = li.size();
  const int64_t Bx = prod(x.shape(), 0, x.ndim() - 2);
  if (P == 0 || M == 0 || N == 0) return;
  const uint32_t* lidx = li.data<uint32_t>();
  const uint32_t* ridx = ri.data<uint32_t>();
  const int32_t* perm = has_perm ? inputs[1].data<int32_t>() : nullptr;
  const DType xt = to_dtype(x.dtype()), ot = to_dtype(out.dtype());
  void* o = out.data<void>();

  // An index or permutation entry out of range poisons its output rows
  // with NaN (never a read out of bounds, never silent garbage).
  bool perm_ok = true;
  if (perm)
    for (int k = 0; k < K; ++k) perm_ok &= perm[k] >= 0 && perm[k] < K;
  auto good = [&](int64_t p) { return perm_ok && lidx[p] < Bx && ridx[p] < Bw; };
  std::vector<int64_t> bad;
  for (int64_t p = 0; p < P; ++p)
    if (!good(p)) bad.push_back(p);
  // Output matrices per expert.
  const ByExpert g = sort_by_expert(ridx, P, Bw, good);
  const auto& start = g.start;
  const auto& order = g.order;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t p : bad)
    for (int64_t i = 0; i < int64_t(M) * N; ++i)
      store_from_f32(o, p * M * N + i, nan, ot);

  // Rows per backend call: all of an expert's rows (one decode of its
  // weights) up to a cap that bounds the float32 staging buffers.
  const int64_t per_call = std::max<int64_t>(1, 8192 / std::max(M, 1));
  struct Call { int64_t expert, first, count; };  // a slice of `order`
  std::vector<Call> calls;
  for (int64_t e = 0; e < Bw; ++e)
    for (int64_t c0 = start[e]; c0 < start[e + 1]; c0 += per_call)
      calls.push_back({e, c0, std::min(per_call, start[e + 1] - c0)});
  std::vector<float> xf, yf;
  for (const auto& [e, c0, cnt] : calls) {
    // This expert's rows: x[lhs[p]] for each of its p, gathered through
    // the permutation into one dense float32 block.
    const int64_t rows = cnt * M;
    xf.resize(size_t(rows) * K);
    yf.resize(size_t(rows) * N);
    const int64_t* ps = order.data() + c0;
    parallel_for(rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t src = (int64_t(lidx[ps[r / M]]) * M + r % M) * K;
        float* dst = xf.data() + r * K;
        if (perm)
          for (int k = 0; k < K; ++k) dst[k] = load_as_f32(x.data<void>(), src + perm[k], xt);
        else
          widen_to_f32(x.data<void>(), src, K, xt, dst);
      }
    });
    // The path qmatmul would take for these rows (qmm_path): the integer
    // contract for at most int_max_m finite rows of this expert's.
    const QmmPath path = qmm_path(xf.data(), int64_t(xf.size()), rows, int_max_m);
    run(e, path, xf.data(), int(rows), yf.data());
    // Rows converted in bulk (convert.h): per element, the dtype dispatch
    // was 5.6% of an MoE decode token's CPU time (bench_moe_decode.py).
    parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        narrow_from_f32(yf.data() + r * N, N, ot, o, (ps[r / M] * M + r % M) * N);
      }
    });
  }
}

void MixedGatherQMM::eval_cpu(const std::vector<mx::array>& inputs,
                              mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);

  enc.dispatch([inputs, out = std::move(task_out), segs = segs_,
                has_perm = has_perm_, fn = select_qmm(backend_),
                fn_int = select_qmm_int(act_, backend_),
                int_max_m = activation_int_max_m(act_)]() mutable {
    const int first = has_perm ? 2 : 1;
    const mx::array& wq0 = inputs[first];
    const int K = inputs[0].shape(-1), N = wq0.shape(-2);
    const int64_t Bw = prod(wq0.shape(), 0, wq0.ndim() - 2);
    gather_cpu_eval(inputs, has_perm, N, Bw, fn_int ? int_max_m : 0, out,
                    [&](int64_t e, QmmPath path, const float* xf, int rows, float* y) {
                      const QMatView w = expert_view(inputs, first, segs, e, N, K);
                      if (path == QmmPath::Int) return run_int_rows(fn_int, xf, rows, w, y);
                      (path == QmmPath::IeeeRef ? qmm_ref_run : fn)(xf, rows, w, y);
                    });
  });
}

#ifndef _METAL_
void MixedGatherQMM::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  // Without Metal mixed_gather_qmm composes MLX ops on a GPU stream;
  // reaching this means a node built for the CPU was scheduled on the GPU.
  throw std::runtime_error("[gather_qmm] this build of mixbits has no GPU kernels");
}
#endif

}  // namespace mixbits
