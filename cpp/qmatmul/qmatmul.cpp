// MixedQMatmul: argument checks, graph construction, and the CPU evaluation
// that gathers x through the permutation and hands raw views to a backend.
#include "qmatmul/qmatmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "common/convert.h"
#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "qmatmul_host.h"
#include "qmatmul_int8/kernel.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("qmatmul: " + msg);
}

}  // namespace

const std::vector<std::string>& activation_names() {
  static const std::vector<std::string> names{"float", "int8", "int16", "int8-all"};
  return names;
}

bool activations_valid(Activations act) {
  return int(act) >= 0 && size_t(act) < activation_names().size();
}

const char* activation_name(Activations act) {
  return activations_valid(act) ? activation_names()[size_t(act)].c_str() : "?";
}

int activation_code_bits(Activations act) {
  return act == Activations::Int16 ? 16 : act == Activations::Int8 || act == Activations::Int8All ? 8 : 0;
}

std::string activations_refusal(Activations act) {
  std::string names;
  for (size_t i = 0; i < activation_names().size(); ++i)
    names += (i ? ", " : "") + std::to_string(i) + " (" + activation_names()[i] + ")";
  return "activations must be one of " + names + ", got " + std::to_string(int(act));
}

int activation_int_max_m(Activations act) {
  if (activation_code_bits(act) == 0) return 0;
  return act == Activations::Int8All ? std::numeric_limits<int>::max() : kInt8MaxM;
}

QmmRun select_qmm_int(Activations act, Backend backend) {
  switch (activation_code_bits(act)) {
    case 8: return select_qmm_int8(backend);
    case 16: return select_qmm_int16(backend);
    default: return nullptr;
  }
}

void run_int_rows(QmmRun fn, const float* x, int M, const QMatView& w, float* y) {
  for (int m0 = 0; m0 < M; m0 += kInt8MaxM)
    fn(x + int64_t(m0) * w.K, std::min(kInt8MaxM, M - m0), w, y + int64_t(m0) * w.N);
}

mx::array mixed_qmatmul(const mx::array& x, const std::optional<mx::array>& perm,
                        const std::vector<mx::array>& packed,
                        const std::vector<SegSpec>& segs, Backend backend,
                        mx::StreamOrDevice s, Activations act) {
  if (segs.empty()) fail("at least one segment is required");
  if (!activations_valid(act)) fail(activations_refusal(act));
  if (packed.size() != 3 * segs.size())
    fail("expected 3 arrays (wq, scales, biases) per segment, got " +
         std::to_string(packed.size()) + " for " +
         std::to_string(segs.size()) + " segments");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (!is_float_dtype(x.dtype()))
    fail("x must be float32, float16 or bfloat16");
  // Sizes in int64: k * bits overflows int32 from 2^28 columns at 8 bits,
  // and the segments' K must still fit MLX's int32 shapes.
  int64_t K = 0;
  int N = -1;
  mx::Dtype sdt = packed[1].dtype();
  for (size_t i = 0; i < segs.size(); ++i) {
    const SegSpec& sg = segs[i];
    std::string tag = "segment " + std::to_string(i) + ": ";
    if (sg.bits != 2 && sg.bits != 3 && sg.bits != 4 && sg.bits != 5 &&
        sg.bits != 6 && sg.bits != 8)
      fail(tag + "bits must be one of 2,3,4,5,6,8, got " +
           std::to_string(sg.bits));
    if (sg.group_size != 32 && sg.group_size != 64 && sg.group_size != 128)
      fail(tag + "group_size must be 32, 64 or 128, got " +
           std::to_string(sg.group_size));
    if (sg.k <= 0 || sg.k % sg.group_size != 0)
      fail(tag + "column count " + std::to_string(sg.k) +
           " is not a positive multiple of group_size " +
           std::to_string(sg.group_size));
    const mx::array& wq = packed[3 * i];
    const mx::array& sc = packed[3 * i + 1];
    const mx::array& bi = packed[3 * i + 2];
    if (wq.dtype() != mx::uint32) fail(tag + "wq must be uint32");
    if (wq.ndim() != 2) fail(tag + "wq must be 2-D, got " + shape_str(wq));
    if (N < 0) N = wq.shape(0);
    int64_t words = int64_t(sg.k) * sg.bits / 32;
    if (wq.shape(0) != N || wq.shape(1) != words)
      fail(tag + "wq shape " + shape_str(wq) + " != (" + std::to_string(N) +
           ", " + std::to_string(words) + ")");
    int64_t groups = sg.k / sg.group_size;
    for (const mx::array* a : {&sc, &bi}) {
      const char* nm = (a == &sc) ? "scales" : "biases";
      if (!is_float_dtype(a->dtype()))
        fail(tag + nm + " must be float32, float16 or bfloat16");
      if (a->dtype() != sdt)
        fail(tag + nm + " dtype differs from segment 0's scales");
      if (a->ndim() != 2 || a->shape(0) != N || a->shape(1) != groups)
        fail(tag + nm + " shape " + shape_str(*a) + " != (" +
             std::to_string(N) + ", " + std::to_string(groups) + ")");
    }
    K += sg.k;
    if (K > std::numeric_limits<int32_t>::max())
      fail("the segments cover more than 2^31 - 1 columns");
  }
  if (x.shape(-1) != K)
    fail("x has " + std::to_string(x.shape(-1)) +
         " input features but the segments cover K=" + std::to_string(K));
  if (perm) {
    if (perm->dtype() != mx::int32 && perm->dtype() != mx::uint32)
      fail("perm must be int32 or uint32");
    if (perm->ndim() != 1 || perm->shape(0) != K)
      fail("perm shape " + shape_str(*perm) + " != (" + std::to_string(K) +
           ",)");
  }
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::gpu) {
    // The GPU has one kernel per shape; a CPU backend name would be ignored
    // there, so it is refused, as is what the Metal kernels cannot index.
    if (backend != Backend::Auto)
      fail("backend= chooses a CPU kernel; on the GPU leave it unset");
    if (act != Activations::Float)
      fail(std::string("activations='") + activation_name(act) +
           "' is a CPU contract; the GPU kernels take float x");
    const std::string why = metal_host::qmm_gpu_refusal(
        int64_t(x.size()) / int64_t(K), N, K);
    if (!why.empty()) fail(why);
  } else {
    select_qmm(backend);  // throws now, not inside the graph, if unavailable
    select_qmm_int(act, backend);
  }

  // The Metal kernels index every input as a dense matrix; a copy happens
  // here, in the graph (eval_gpu may only use MLX_API symbols, and the GPU
  // copy helpers are not), for inputs not known to be dense already. The
  // CPU path takes every input as it is and reads strided ones itself
  // (eval_cpu), so it adds no graph node per input.
  const bool gpu = stream.device == mx::Device::gpu;
  auto input = [&](const mx::array& a) { return gpu ? dense_input(a, stream) : a; };
  // On the CPU an attention output transposed and reshaped back (o_proj's
  // x) is read from the array it views.
  const mx::array src = gpu ? input(x) : through_views(x);
  std::vector<mx::array> inputs{src};
  if (perm) inputs.push_back(input(*perm));
  for (const auto& a : packed) inputs.push_back(input(a));
  mx::Shape out_shape = x.shape();
  out_shape.back() = N;
  return mx::array(out_shape, x.dtype(),
                   std::make_shared<MixedQMatmul>(stream, segs, bool(perm), backend, act,
                                                  viewed_shape(x, src)),
                   std::move(inputs));
}

mx::array MixedQMatmul::as_x(const mx::array& in) {
  return as_viewed(in, viewed_, stream());
}

std::vector<mx::Shape> MixedQMatmul::output_shapes(
    const std::vector<mx::array>& inputs) {
  mx::Shape s = input_shape(inputs[0], viewed_, "qmatmul");
  s.back() = inputs[has_perm_ ? 2 : 1].shape(0);
  return {s};
}

bool MixedQMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const MixedQMatmul&>(other);
  return segs_ == o.segs_ && has_perm_ == o.has_perm_ && backend_ == o.backend_ &&
         act_ == o.act_ && viewed_ == o.viewed_;
}

void MixedQMatmul::eval_cpu(const std::vector<mx::array>& inputs,
                            mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);

  // Capturing the arrays keeps their buffers alive until the task has run.
  enc.dispatch([inputs, out = std::move(task_out),
                segs = segs_, has_perm = has_perm_,
                fn = select_qmm(backend_),
                fn8 = select_qmm_int(act_, backend_),
                int_max_m = activation_int_max_m(act_)]() mutable {
    const int first = has_perm ? 2 : 1;
    // perm and the weights in row-major order (their own buffers unless a
    // caller passed a strided view; x is read through its strides).
    std::vector<std::vector<char>> copies(inputs.size());
    auto dense = [&](size_t i) { return row_major(inputs[i], copies[i]); };
    QMatView w;
    w.N = inputs[first].shape(0);
    w.sdtype = to_dtype(inputs[first + 1].dtype());
    int k0 = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      const size_t j = first + 3 * i;
      w.segs.push_back({segs[i].bits, segs[i].group_size, k0, segs[i].k,
                        static_cast<const uint32_t*>(dense(j)), dense(j + 1), dense(j + 2)});
      k0 += segs[i].k;
    }
    w.K = k0;
    const int32_t* perm = has_perm ? static_cast<const int32_t*>(dense(1)) : nullptr;
    qmatmul_cpu_eval(inputs[0], perm, w.K, w.N, fn8 ? int_max_m : 0, out,
                     [&](QmmPath path, const float* xf, int M, float* y) {
                       if (path == QmmPath::Int) return run_int_rows(fn8, xf, M, w, y);
                       (path == QmmPath::IeeeRef ? qmm_ref_run : fn)(xf, M, w, y);
                     });
  });
}

QmmPath qmm_path(const float* xf, int64_t n, int64_t rows, int int_max_m) {
  // The SIMD backends fold the bias (y = s*sum(q*x) + b*sum(x)): with an
  // infinite x that gives inf - inf = NaN for the whole row, where MLX's
  // dequantize-then-multiply gives +-inf (NaN only where the weight is 0).
  // Such rows are rare, so the whole call then takes the unfused scalar
  // reference, which has MLX's IEEE semantics. The scan is O(M*K), noise
  // next to the O(M*N*K) product, once the compiler vectorizes it.
  // The integer contracts are defined for finite x only (amax of a group with
  // an inf or NaN means nothing): such calls take the float path, so
  // activations='int8'/'int16' have exactly the float path's IEEE behaviour.
  std::atomic<bool> has_inf{false}, has_nan{false};
  parallel_for(n, 1 << 16, [&](int64_t i0, int64_t i1) {
    // First whether the range has any inf/NaN (all exponent bits set), in
    // integer ops a compiler vectorizes; the rare range that does is
    // scanned element by element.
    uint32_t special = 0;
    for (int64_t i = i0; i < i1; ++i) {
      uint32_t b;
      std::memcpy(&b, xf + i, 4);
      special |= uint32_t((b & 0x7f800000u) == 0x7f800000u);
    }
    if (!special) return;
    for (int64_t i = i0; i < i1; ++i)
      if (!std::isfinite(xf[i])) {
        (std::isinf(xf[i]) ? has_inf : has_nan).store(true, std::memory_order_relaxed);
        if (has_inf.load(std::memory_order_relaxed)) return;
      }
  });
  if (rows <= int_max_m && !has_inf.load() && !has_nan.load()) return QmmPath::Int;
  return has_inf.load() ? QmmPath::IeeeRef : QmmPath::Float;
}

void qmatmul_cpu_eval(const mx::array& x, const int32_t* perm, int K, int N, int int_max_m,
                      mx::array& out, const QmmPathFn& run) {
  const int64_t M = x.size() / K;
  if (M == 0 || N == 0) return;

  // x may be strided (a view or a transpose): read it element by element
  // into a dense float32 buffer, gathered through the permutation.
  std::vector<float> xf(size_t(M) * K);
  const DType xt = to_dtype(x.dtype());
  // An x whose last axis is not K is an array the node's x views
  // (through_views): its row-major elements, K at a time, are the rows.
  std::vector<char> xbuf;
  const bool viewed = x.shape(-1) != K;
  const int nd = viewed ? 1 : x.ndim();
  const int64_t kstride = viewed ? 1 : x.strides()[nd - 1];
  const char* xbase = viewed ? static_cast<const char*>(row_major(x, xbuf)) : x.data<char>();
  const size_t isz = x.itemsize();
  bool perm_ok = true;
  if (perm)
    for (int k = 0; k < K; ++k)
      perm_ok &= (perm[k] >= 0 && perm[k] < K);
  parallel_for(M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int64_t off = viewed ? m * K : 0, rem = m;
      for (int d = nd - 2; d >= 0; --d) {
        off += (rem % x.shape(d)) * x.strides()[d];
        rem /= x.shape(d);
      }
      const void* row = xbase + off * int64_t(isz);
      float* dst = xf.data() + m * K;
      // One loop per dtype (no per-element switch); a contiguous float32
      // row without a permutation is a plain copy.
      auto gather = [&](auto load) {
        if (perm) {
          for (int k = 0; k < K; ++k)
            dst[k] = load(int64_t(perm_ok ? perm[k] : 0) * kstride);
        } else {
          for (int k = 0; k < K; ++k) dst[k] = load(int64_t(k) * kstride);
        }
      };
      if (!perm && kstride == 1) {
        widen_to_f32(row, 0, K, xt, dst);  // a copy for float32
      } else if (xt == DType::f32) {
        const float* r = static_cast<const float*>(row);
        gather([r](int64_t i) { return r[i]; });
      } else if (xt == DType::f16) {
        const uint16_t* r = static_cast<const uint16_t*>(row);
        gather([r](int64_t i) { return f16_to_f32(r[i]); });
      } else {
        const uint16_t* r = static_cast<const uint16_t*>(row);
        gather([r](int64_t i) { return bf16_to_f32(r[i]); });
      }
    }
  });
  const DType ot = to_dtype(out.dtype());
  float* y = nullptr;
  std::vector<float> yf;
  if (ot == DType::f32) {
    y = out.data<float>();
  } else {
    yf.resize(size_t(M) * N);
    y = yf.data();
  }
  const QmmPath path = qmm_path(xf.data(), int64_t(M) * K, M, int_max_m);
  if (!perm_ok) {
    // Never silent garbage: a broken permutation poisons the output.
    std::fill(y, y + M * N, std::numeric_limits<float>::quiet_NaN());
  } else {
    // The backend splits the outputs over threads; each worker runs all M
    // rows on its slice, so every weight is decoded once per call.
    run(path, xf.data(), int(M), y);
  }
  if (ot != DType::f32) {
    void* o = out.data<void>();
    parallel_for(M * N, 1 << 14, [&](int64_t i0, int64_t i1) {
      narrow_from_f32(y + i0, i1 - i0, ot, o, i0);
    });
  }
}

#ifndef _METAL_
void MixedQMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("qmatmul: this build of mixbits has no GPU kernels");
}
#endif

}  // namespace mixbits
