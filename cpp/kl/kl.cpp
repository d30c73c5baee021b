// KLDivergence: argument checks, graph construction, and the CPU evaluation
// that cuts rows into chunks, runs a backend on them in parallel, merges
// the per-chunk states and writes the per-row results.
#include "kl/kl.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "kl_host.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("kl_divergence: " + msg);
}

mx::Shape lead_shape(const mx::array& a) {
  return mx::Shape(a.shape().begin(), a.shape().end() - 1);
}

// Rows shorter than this are never split; below it the merge and the
// per-chunk overhead outweigh the extra parallelism.
constexpr int64_t kMinSplit = 16384;

}  // namespace

std::vector<mx::array> kl_divergence(const mx::array& ref,
                                     const mx::array& logits,
                                     const std::optional<mx::array>& row_param,
                                     KLMode mode, Backend backend,
                                     mx::StreamOrDevice s) {
  if (ref.ndim() < 1) fail("ref_logits must have at least one dimension");
  if (logits.ndim() < 1) fail("logits must have at least one dimension");
  if (!is_float_dtype(ref.dtype()))
    fail("ref_logits must be float32, float16 or bfloat16");
  if (!is_float_dtype(logits.dtype()))
    fail("logits must be float32, float16 or bfloat16");
  if (ref.shape() != logits.shape())
    fail("ref_logits shape " + shape_str(ref.shape()) +
         " differs from logits shape " + shape_str(logits.shape()));
  const int64_t V = logits.shape(-1);
  if (V < 1) fail("the vocabulary (last) axis must have at least 1 entry");
  if (V > std::numeric_limits<int32_t>::max())
    fail("the vocabulary axis is longer than 2^31-1");
  const bool needs_param = mode != KLMode::Logits;
  if (needs_param != bool(row_param))
    fail(needs_param ? "this mode needs a per-row parameter"
                     : "Logits mode takes no per-row parameter");
  if (row_param) {
    if (row_param->dtype() != mx::float32)
      fail("the per-row parameter must be float32");
    mx::Shape want = lead_shape(logits);
    if (mode == KLMode::Probs) want.push_back(MB_KL_PROBS_PARAM_WORDS);
    if (row_param->shape() != want)
      fail("the per-row parameter has shape " +
           shape_str(row_param->shape()) + ", expected " + shape_str(want));
  }
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::gpu) {
    // The GPU has one kernel; a CPU backend name would be ignored there, so
    // it is refused, as is what the Metal kernel cannot index.
    if (backend != Backend::Auto)
      fail("backend= chooses a CPU kernel; on the GPU leave it unset");
    const std::string why = metal_host::kl_gpu_refusal(logits.size() / V, V);
    if (!why.empty()) fail(why);
  } else {
    select_kl(backend);  // throws now, not inside the graph, if unavailable
  }
  std::vector<mx::array> inputs{dense_input(ref, stream),
                                dense_input(logits, stream)};
  if (row_param) inputs.push_back(dense_input(*row_param, stream));
  mx::Shape lead = lead_shape(logits);
  return mx::array::make_arrays(
      {lead, lead, lead, lead, lead, lead},
      {mx::float32, mx::int32, mx::int32, mx::float32, mx::int32, mx::float32},
      std::make_shared<KLDivergence>(stream, mode, backend), inputs);
}

std::vector<mx::Shape> KLDivergence::output_shapes(
    const std::vector<mx::array>& inputs) {
  mx::Shape lead = lead_shape(inputs[1]);
  return std::vector<mx::Shape>(6, lead);
}

bool KLDivergence::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const KLDivergence&>(other);
  return mode_ == o.mode_ && backend_ == o.backend_;
}

void KLDivergence::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> outs = begin_cpu_task(enc, inputs, outputs);
  // Capturing the arrays keeps their buffers alive until the task has run.
  enc.dispatch([inputs, outs = std::move(outs), mode = mode_,
                fn = select_kl(backend_)]() mutable {
    const mx::array& ref = inputs[0];
    const mx::array& q = inputs[1];
    const int64_t V = q.shape(-1);
    const int64_t M = V ? q.size() / V : 0;
    if (M == 0) return;
    const float* param = inputs.size() > 2 ? inputs[2].data<float>() : nullptr;
    const DType at = to_dtype(ref.dtype()), bt = to_dtype(q.dtype());
    const char* abase = ref.data<char>();
    const char* bbase = q.data<char>();
    const int64_t asz = ref.itemsize(), bsz = q.itemsize();

    // Few long rows: cut each into pieces so every thread has work.
    const int64_t threads = num_threads();
    int64_t nsplit = 1;
    if (M < 4 * threads)
      nsplit = std::clamp<int64_t>((4 * threads + M - 1) / M, 1,
                                   std::max<int64_t>(1, V / kMinSplit));
    const int64_t piece = (V + nsplit - 1) / nsplit;
    nsplit = (V + piece - 1) / piece;

    std::vector<KLState> states(size_t(M * nsplit));
    auto init = [&](int64_t m) {
      KLState st;
      if (mode == KLMode::FixedShift) st.ca = param[m];
      return st;
    };
    parallel_for(M * nsplit, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t m = w / nsplit, k0 = (w % nsplit) * piece;
        const int64_t n = std::min(piece, V - k0);
        KLState st = init(m);
        KLChunk c{abase + (m * V + k0) * asz, at, bbase + (m * V + k0) * bsz,
                  bt, n, k0};
        fn(mode, c, st);
        states[size_t(w)] = st;
      }
    });

    float* kl = outs[0].data<float>();
    int32_t* status = outs[1].data<int32_t>();
    int32_t* argq = outs[2].data<int32_t>();
    float* lseq = outs[3].data<float>();
    int32_t* argr = outs[4].data<int32_t>();
    float* lser = outs[5].data<float>();
    for (int64_t m = 0; m < M; ++m) {
      KLState st = states[size_t(m * nsplit)];
      for (int64_t k = 1; k < nsplit; ++k)
        kl_merge(mode, st, states[size_t(m * nsplit + k)]);
      const double negh = mode == KLMode::Probs
                               ? double(param[2 * m]) + double(param[2 * m + 1])
                               : 0.0;
      KLRowResult r = kl_finalize(mode, st, negh);
      kl[m] = r.kl;
      status[m] = r.status;
      argq[m] = r.argmax_q;
      lseq[m] = r.lse_q;
      argr[m] = mode == KLMode::Logits ? r.argmax_ref : -1;
      lser[m] = r.lse_ref;
    }
  });
}

#ifndef _METAL_
void KLDivergence::eval_gpu(const std::vector<mx::array>&,
                            std::vector<mx::array>&) {
  throw std::runtime_error(
      "kl_divergence: this build of mixbits has no GPU kernels");
}
#endif

}  // namespace mixbits
