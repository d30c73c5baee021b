// MixedGatherQMMT: graph construction and CPU evaluation of the gathered
// transposed product (transposed.h). Like the forward, the pairs are
// grouped by expert so each expert's weights are decoded once per call
// however many rows chose it (a MoE layer has M = 1 per pair: one kernel
// call per pair would decode an expert per routed token). The Metal
// evaluation is in cpp/gather/metal.cpp.
#include "gather/transposed.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "common/parallel.h"
#include "gather/experts.h"
#include "gather_t_host.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

bool gather_qmm_t_gpu_runs(int64_t pairs, int64_t M, int64_t N, int64_t K,
                           int64_t x_batches, int64_t w_batches, int64_t nseg) {
#ifdef _METAL_
  return metal_host::gather_qmv_t_gpu_applies(pairs, M, N, K, x_batches, w_batches, nseg);
#else
  (void)pairs, (void)M, (void)N, (void)K, (void)x_batches, (void)w_batches, (void)nseg;
  return false;
#endif
}

mx::array mixed_gather_qmm_t(const mx::array& dy,
                             const std::optional<mx::array>& perm,
                             const std::vector<mx::array>& packed,
                             const std::vector<SegSpec>& segs,
                             const mx::array& lhs, const mx::array& rhs,
                             const mx::Shape& x_shape, Backend backend,
                             mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::cpu) {
    select_qmm_t(backend);  // throws now, not inside the graph, if unavailable
  } else {
    const int64_t M = x_shape[x_shape.size() - 2], K = x_shape.back();
    const int64_t Bx = prod(x_shape, 0, x_shape.size() - 2);
    const int64_t Bw = prod(packed[0].shape(), 0, packed[0].ndim() - 2);
    if (!gather_qmm_t_gpu_runs(int64_t(lhs.size()), M, packed[0].shape(-2), K, Bx, Bw,
                               int64_t(segs.size())))
      throw std::invalid_argument(
          "[gather_qmm] no GPU kernel for this transposed product (see "
          "gather_qmm_t_gpu_runs); on the GPU the gradient is dequantize + "
          "gather_mm there");
  }
  std::vector<mx::array> inputs{dense_input(dy, stream)};
  if (perm) inputs.push_back(dense_input(*perm, stream));
  for (const auto& a : packed) inputs.push_back(dense_input(a, stream));
  inputs.push_back(dense_input(lhs, stream));
  inputs.push_back(dense_input(rhs, stream));
  return mx::array(x_shape, dy.dtype(),
                   std::make_shared<MixedGatherQMMT>(stream, segs, bool(perm),
                                                     backend, x_shape),
                   std::move(inputs));
}

bool MixedGatherQMMT::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const MixedGatherQMMT&>(other);
  return segs_ == o.segs_ && has_perm_ == o.has_perm_ &&
         backend_ == o.backend_ && x_shape_ == o.x_shape_;
}

void MixedGatherQMMT::eval_cpu(const std::vector<mx::array>& inputs,
                               mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);

  enc.dispatch([inputs, out = std::move(task_out), segs = segs_,
                has_perm = has_perm_, fn = select_qmm_t(backend_)]() mutable {
    const mx::array& dy = inputs[0];
    const int first = has_perm ? 2 : 1;
    const mx::array& li = inputs[inputs.size() - 2];
    const mx::array& ri = inputs[inputs.size() - 1];
    const mx::array& wq0 = inputs[first];
    const int64_t M = out.shape(-2), K = out.shape(-1), N = wq0.shape(-2);
    if (out.size() == 0) return;
    const int64_t Bx = int64_t(out.size()) / (M * K);
    const int64_t Bw = prod(wq0.shape(), 0, wq0.ndim() - 2);
    const int64_t P = li.size();
    const uint32_t* lidx = li.data<uint32_t>();
    const uint32_t* ridx = ri.data<uint32_t>();
    const int32_t* perm = has_perm ? inputs[1].data<int32_t>() : nullptr;
    const DType dt = to_dtype(dy.dtype()), ot = to_dtype(out.dtype());

    // dx accumulates in float32, in place when dx is float32; every x
    // matrix no pair reads gets zeros.
    std::vector<float> accbuf;
    float* acc = ot == DType::f32 ? out.data<float>()
                                  : (accbuf.resize(out.size()), accbuf.data());
    std::fill(acc, acc + out.size(), 0.0f);
    auto finish = [&] {
      if (ot == DType::f32) return;
      void* o = out.data<void>();
      parallel_for(out.size(), 1 << 14, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) store_from_f32(o, i, acc[i], ot);
      });
    };

    // The forward poisons a pair's output with NaN when an index is out of
    // range; here an out-of-range lhs has no x matrix to blame, so any bad
    // index (or permutation entry) makes all of dx NaN: never a read out of
    // bounds, never a gradient that silently drops a pair.
    bool ok = true;
    for (int64_t k = 0; perm && k < K; ++k) ok &= perm[k] >= 0 && perm[k] < K;
    for (int64_t p = 0; p < P; ++p) ok &= lidx[p] < Bx && ridx[p] < Bw;
    if (!ok) {
      std::fill(acc, acc + out.size(), std::numeric_limits<float>::quiet_NaN());
      return finish();
    }
    if (P == 0 || N == 0) return finish();

    // A true permutation (all the Python layer makes) is undone by reading
    // through its inverse, so threads can split dx's columns; a repeated
    // entry sums its columns, one thread.
    std::vector<int32_t> inv;
    bool bijective = perm != nullptr;
    if (perm) {
      inv.assign(K, -1);
      for (int64_t k = 0; k < K; ++k) {
        bijective &= inv[perm[k]] < 0;
        inv[perm[k]] = int32_t(k);
      }
    }

    // Pairs per expert, in index order.
    const ByExpert g = sort_by_expert(ridx, P, Bw, [](int64_t) { return true; });
    const auto& start = g.start;
    const auto& order = g.order;

    // Rows per kernel call: all of an expert's rows up to a cap on the
    // float32 staging buffers (rows x (N + K) floats).
    const int64_t per_call = std::max<int64_t>(1, 2048 / M);
    std::vector<float> dyf, zf;
    for (int64_t e = 0; e < Bw; ++e) {
      const QMatView w = expert_view(inputs, first, segs, e, int(N), int(K));
      for (int64_t c0 = start[e]; c0 < start[e + 1]; c0 += per_call) {
        const int64_t cnt = std::min(per_call, start[e + 1] - c0);
        const int64_t* ps = order.data() + c0;
        const int64_t rows = cnt * M;
        dyf.resize(size_t(rows * N));
        zf.resize(size_t(rows * K));
        parallel_for(rows, 16, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t src = (ps[r / M] * M + r % M) * N;
            for (int64_t n = 0; n < N; ++n)
              dyf[r * N + n] = load_as_f32(dy.data<void>(), src + n, dt);
          }
        });
        fn(dyf.data(), int(rows), w, zf.data());
        // Scatter-add into dx[lhs[p]]: each thread owns a range of dx's
        // columns and adds the rows in this fixed order, so pairs sharing
        // an lhs never race and the sum is the same for any thread count.
        auto dst_row = [&](int64_t r) {
          return acc + (int64_t(lidx[ps[r / M]]) * M + r % M) * K;
        };
        if (perm && !bijective) {
          for (int64_t r = 0; r < rows; ++r) {
            float* d = dst_row(r);
            for (int64_t k = 0; k < K; ++k) d[perm[k]] += zf[r * K + k];
          }
          continue;
        }
        parallel_for(K, 256, [&](int64_t j0, int64_t j1) {
          for (int64_t r = 0; r < rows; ++r) {
            float* d = dst_row(r);
            const float* z = zf.data() + r * K;
            if (perm)
              for (int64_t j = j0; j < j1; ++j) d[j] += z[inv[j]];
            else
              for (int64_t j = j0; j < j1; ++j) d[j] += z[j];
          }
        });
      }
    }
    finish();
  });
}

#ifndef _METAL_
// The Metal kernels are in cpp/gather/metal.cpp; mixed_gather_qmm_t never
// builds this node on a GPU stream without them (gather_qmm_t_gpu_runs).
void MixedGatherQMMT::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[MixedGatherQMMT] this build of mixbits has no GPU kernels");
}
#endif

}  // namespace mixbits
