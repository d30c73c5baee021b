// RepackedGatherQMM: checks, graph node and CPU evaluation: the gathered
// driver of gather.cpp (gather_cpu_eval) with each expert's rows run as
// RepackedQMatmul runs a matrix (run_repacked).
#include "gather/repacked.h"

#include <stdexcept>
#include <string>

#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "gather/experts.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmatmul_int8/repacked_qmatmul.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[gather_qmm] repacked stack: " + msg);
}

}  // namespace

mx::array repacked_gather_qmm(const mx::array& x, const std::optional<mx::array>& perm,
                              const std::vector<mx::array>& packed_r,
                              const std::vector<SegSpec>& segs, int n,
                              std::optional<mx::array> lhs, std::optional<mx::array> rhs,
                              Backend backend, mx::StreamOrDevice s, Activations act) {
  if (packed_r.empty() || packed_r[0].ndim() < 4)
    fail("expected (experts..., blocks, words, 16) arrays, 3 per segment");
  const mx::Shape batch(packed_r[0].shape().begin(), packed_r[0].shape().end() - 3);
  if (x.ndim() < 2)
    fail("x must have at least two dimensions (..., M, K), got shape " + shape_str(x));
  check_repacked(x, perm, packed_r, segs, n, act, batch);
  auto stream = repacked_stream(s, backend, act);
  auto li = indices_or_default(lhs, mx::Shape(x.shape().begin(), x.shape().end() - 2), stream);
  auto ri = indices_or_default(rhs, batch, stream);
  auto bc = mx::broadcast_arrays({li, ri}, stream);  // MLX's shape errors
  // No contiguous nodes (a CPU layout: eval_cpu reads strided inputs); x
  // is read through the expert MLP's expand_dims, and the SwiGLU before
  // the down projection runs inside this node.
  const mx::array src = through_views(x);
  std::vector<mx::array> inputs;
  auto prologue = take_input(src, inputs);
  if (perm) inputs.push_back(*perm);
  for (const auto& a : packed_r) inputs.push_back(dense_input(a, stream));  // evaluated: as is
  inputs.push_back(bc[0]);
  inputs.push_back(bc[1]);
  mx::Shape out_shape = bc[0].shape();
  out_shape.push_back(x.shape(-2));
  out_shape.push_back(n);
  return mx::array(std::move(out_shape), x.dtype(),
                   std::make_shared<RepackedGatherQMM>(stream, segs, bool(perm), n, backend, act,
                                                       viewed_shape(x, src), std::move(prologue)),
                   std::move(inputs));
}

std::vector<mx::Shape> RepackedGatherQMM::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[inputs.size() - 2].shape();
  s.push_back(read_shape(inputs[0], prologue_, viewed_, "gather_qmm").end()[-2]);
  s.push_back(n_);
  return {s};
}

void RepackedGatherQMM::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  enc.dispatch([all = inputs, out = std::move(task_out), segs = segs_, has_perm = has_perm_,
                N = n_, k = kernels_for(act_, backend_), pro = prologue_,
                viewed = viewed_]() mutable {
    // gather_cpu_eval indexes x, perm and the indices densely: x (its
    // producer's output, or the array it views) as x's shape, the others
    // as they are, each its own buffer or a row-major copy.
    std::vector<char> xstore;
    const mx::array x = run_input(pro, all, 0, xstore);
    std::vector<std::vector<char>> bufs(4);
    std::vector<mx::array> inputs{dense_as(x, viewed ? *viewed : x.shape(), bufs[0])};
    inputs.insert(inputs.end(), all.begin() + input_count(pro), all.end());
    if (has_perm) inputs[1] = dense_as(inputs[1], inputs[1].shape(), bufs[1]);
    const size_t li = inputs.size() - 2, ri = inputs.size() - 1;
    inputs[li] = dense_as(inputs[li], inputs[li].shape(), bufs[2]);
    inputs[ri] = dense_as(inputs[ri], inputs[ri].shape(), bufs[3]);
    const int first = has_perm ? 2 : 1;
    const mx::array& wq0 = inputs[first];
    const int64_t Bw = prod(wq0.shape(), 0, wq0.ndim() - 3);
    std::vector<const void*> arrays;
    for (size_t i = 0; i < 3 * segs.size(); ++i) arrays.push_back(inputs[first + i].data<void>());
    const DType sdt = to_dtype(inputs[first + 1].dtype());
    gather_cpu_eval(inputs, has_perm, N, Bw, k.fn_int ? activation_int_max_m(k.act) : 0, out,
                    [&](int64_t e, QmmPath path, const float* xf, int rows, float* y) {
                      run_repacked(k, path, xf, rows, repacked_view(segs, N, sdt, arrays, e), y);
                    });
  });
}

void RepackedGatherQMM::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  refuse_repacked_gpu();
}

}  // namespace mixbits
