// Swiglu: checks and the CPU evaluation (contiguous element ranges in
// parallel; strided inputs are copied first). The kernels' choice is
// dispatch.cpp's.
#include "act/act.h"

#include <stdexcept>
#include <string>

#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

mx::array swiglu(const mx::array& gate, const mx::array& up,
                 Backend backend, mx::StreamOrDevice s) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32)
    throw std::invalid_argument("swiglu: gate and up must be float32");
  if (gate.shape() != up.shape())
    throw std::invalid_argument("swiglu: gate shape " + shape_str(gate) +
                                " differs from up shape " + shape_str(up));
  select_swiglu(backend);  // throws now if unavailable
  auto stream = mx::to_stream(s);
  // No contiguous node: gate and up are usually lazy (a matmul's output),
  // so their layout is known only in eval_cpu, which copies a strided one.
  return mx::array(gate.shape(), mx::float32,
                   std::make_shared<Swiglu>(stream, backend), {gate, up});
}

bool Swiglu::is_equivalent(const mx::Primitive& other) const {
  return backend_ == static_cast<const Swiglu&>(other).backend_;
}

namespace {

// silu(gate) * up at y (float32, gate's element count).
void swiglu_all(const std::vector<mx::array>& inputs, float* y, SwigluFn fn) {
  std::vector<char> gbuf, ubuf;
  const float* g = static_cast<const float*>(row_major(inputs[0], gbuf));
  const float* u = static_cast<const float*>(row_major(inputs[1], ubuf));
  // 32 Ki elements per task: enough to hide the hand-off, small enough
  // that both cores get work on a single token's MLP.
  parallel_for(int64_t(inputs[0].size()), 32768, [&](int64_t i0, int64_t i1) {
    fn(g + i0, u + i0, y + i0, i1 - i0);
  });
}

}  // namespace

void Swiglu::compute(const std::vector<mx::array>& inputs, const mx::Shape&, mx::Dtype,
                     void* dst) const {
  swiglu_all(inputs, static_cast<float*>(dst), select_swiglu(backend_));
}

void Swiglu::eval_cpu(const std::vector<mx::array>& inputs,
                      std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  enc.dispatch([inputs, o = std::move(task_out), fn = select_swiglu(backend_)]() mutable {
    swiglu_all(inputs, o.data<float>(), fn);
  });
}

void Swiglu::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("swiglu: CPU only; on the GPU use nn.silu(gate) * up");
}

}  // namespace mixbits
