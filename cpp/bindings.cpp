// nanobind module mixbits._ext: argument conversion only. Validation with
// user-facing messages lives in python/mixbits/ops.py and in the op builders.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <nanobind/ndarray.h>

#include <algorithm>
#include <atomic>

#include "act/act.h"
#include "attn/attn.h"
#include "cache/kv_write.h"
#include "linear/blas.h"
#include "linear/float_matmul.h"
#include "linear/kernel.h"
#include "norm/rms_norm.h"
#include "rope/rope.h"
#include "bench/probe.h"
#include "common/backend.h"
#include "fpmatmul/fpmatmul.h"
#include "gather/gather.h"
#include "gather/transposed.h"
#include "common/parallel.h"
#include "kl/kl.h"
#include "qmatmul/qmatmul.h"
#include "qmatmul/transposed.h"
#include "qmatmul_int8/kernel.h"
#include "qmatmul_int8/repacked_qmatmul.h"
#include "gather/repacked.h"
#include "common/convert.h"
#include "common/cpu.h"
#include "quant_error/quant_error.h"
#include "quant_search/search.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

NB_MODULE(_ext, m) {
  m.doc() = "mixbits C++ kernels as MLX primitives";

  // backend= arguments below are common/backend.h's enum values; Python maps
  // names to them with this list (python/mixbits/_backends.py).
  m.def("backend_names", &mixbits::backend_names,
        "Backend names indexed by the enum value the ops' backend= takes.");

  // activations= arguments: qmatmul.h's Activations enum values; Python's
  // mixbits.ops.ACTIVATIONS maps names to them with this list.
  m.def("activation_names", &mixbits::activation_names,
        "Numeric contract names indexed by the enum value the ops' activations= takes.");

  m.def(
      "qmatmul",
      [](const mx::array& x, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed,
         const std::vector<std::tuple<int, int, int>>& segs, int backend,
         int activations) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        return mixbits::mixed_qmatmul(x, perm, packed, specs,
                                      mixbits::Backend(backend), {},
                                      mixbits::Activations(activations));
      },
      "x"_a, "perm"_a.none(), "packed"_a, "segments"_a, "backend"_a = 0,
      "activations"_a = 0,
      "y = x @ W.T for a mixed-segment quantized W. segments: (bits, "
      "group_size, k) per segment; packed: wq, scales, biases per segment; "
      "activations: an index of activation_names() (x quantized per group for the "
      "integer contracts: int8/int16 up to 16 rows, int8-all at every M).");

  m.def(
      "repacked_qmatmul_group",
      [](const mx::array& x,
         const std::vector<std::tuple<std::vector<mx::array>,
                                      std::vector<std::tuple<int, int, int>>, int>>& members,
         int backend, int activations) {
        std::vector<mixbits::RepackedMember> ms;
        for (const auto& [packed, segs, n] : members) {
          std::vector<mixbits::SegSpec> specs;
          for (auto [b, g, k] : segs) specs.push_back({b, g, k});
          ms.push_back({packed, specs, n});
        }
        return mixbits::repacked_qmatmul_group(x, ms, mixbits::Backend(backend), {},
                                               mixbits::Activations(activations));
      },
      "x"_a, "members"_a, "backend"_a = 0, "activations"_a = 1,
      "[x @ W.T for each repacked W] in one node; members: (packed_r, segments, n).");

  m.def(
      "repacked_qmatmul",
      [](const mx::array& x, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed_r,
         const std::vector<std::tuple<int, int, int>>& segs, int n, int backend,
         int activations) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        return mixbits::repacked_qmatmul(x, perm, packed_r, specs, n,
                                         mixbits::Backend(backend), {},
                                         mixbits::Activations(activations));
      },
      "x"_a, "perm"_a.none(), "packed_r"_a, "segments"_a, "n"_a, "backend"_a = 0,
      "activations"_a = 1,
      "y = x @ W.T with W row-interleaved (qmatmul_int8/repack.h); "
      "packed_r: wq_r, scales_r, biases_r per segment; n: output rows.");
  m.def("weighted_quant_error", &mixbits::weighted_quant_error, "wq"_a, "scales"_a, "biases"_a,
        "w"_a, "weight"_a, "bits"_a, "group_size"_a,
        "sum(weight * (s*q + b - w)**2) over one segment's rows, as a float64 "
        "(evaluated now); w and weight float32 (R, k).");
  m.def(
      "repacked_gather_qmatmul",
      [](const mx::array& x, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed_r,
         const std::vector<std::tuple<int, int, int>>& segs, int n,
         const std::optional<mx::array>& lhs, const std::optional<mx::array>& rhs, int backend,
         int activations) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        return mixbits::repacked_gather_qmm(x, perm, packed_r, specs, n, lhs, rhs,
                                            mixbits::Backend(backend), {},
                                            mixbits::Activations(activations));
      },
      "x"_a, "perm"_a.none(), "packed_r"_a, "segments"_a, "n"_a, "lhs_indices"_a.none(),
      "rhs_indices"_a.none(), "backend"_a = 0, "activations"_a = 1,
      "gather_qmatmul on an expert stack whose experts are row-interleaved.");
  m.def("repack_segment", &mixbits::repack_segment, "wq"_a, "scales"_a, "biases"_a,
        "bits"_a, "group_size"_a,
        "One segment in MLX's layout -> (wq_r, scales_r, biases_r), 16 rows "
        "interleaved per block (evaluated now).");
  m.def("unrepack_segment", &mixbits::unrepack_segment, "wq_r"_a, "scales_r"_a,
        "biases_r"_a, "n"_a, "bits"_a, "The exact inverse of repack_segment.");
  m.def("line_aligned_stack", &mixbits::line_aligned_stack, "parts"_a,
        "parts stacked along a new first dim, the data starting on a 64-byte line.");
  m.def("repacked_kernels", &mixbits::repacked_kernels_available,
        "Whether this CPU has the repacked layout's kernels (AVX512-VNNI or AVX2).");
  m.def(
      "repacked_float_min_m",
      [](int backend) -> std::optional<int> {
        const mixbits::QmmRepacked r = mixbits::select_qmm_repacked(mixbits::Backend(backend));
        if (!r.run) return std::nullopt;
        return r.min_m;
      },
      "backend"_a,
      "Float-contract calls on a repacked weight with more rows than this read the blocks "
      "in place (the AVX-512 panel packers); None: every such call un-repacks W first.");
  m.def(
      "repacked_float_bits",
      [](int backend) {
        const mixbits::QmmRepacked r = mixbits::select_qmm_repacked(mixbits::Backend(backend));
        std::vector<int> bits;
        for (int b = 0; b < 32; ++b)
          if (r.run && (r.bits_read >> b & 1u)) bits.push_back(b);
        return bits;
      },
      "backend"_a,
      "Bit widths whose repacked segments those calls read in place (a weight with a "
      "segment of another width is un-repacked).");
  m.def(
      "repack_planes",
      [](int bits) -> std::optional<std::tuple<int, std::vector<int>, std::vector<int>>> {
        if (!mixbits::repack_splits(bits)) return std::nullopt;
        std::vector<int> word(32), pos(32);
        for (int c = 0; c < 32; ++c) {
          word[c] = mixbits::split_hword(bits, c);
          pos[c] = mixbits::split_hpos(bits, c);
        }
        return std::make_tuple(mixbits::split_low_bits(bits), word, pos);
      },
      "bits"_a,
      "For a width whose repacked words are split into planes (3, 5, 6; repack.h): "
      "(low-plane bits, high word of each of a chunk's 32 codes, its bit there); None "
      "for widths kept as MLX's words.");
  m.def(
      "int_quantize_row",
      [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> x, int group_size,
         int width) {
        const int64_t n = int64_t(x.shape(0));
        if (group_size < 1 || n % group_size != 0 || (width != 8 && width != 16))
          throw nb::value_error("x's length must be a multiple of group_size; width 8 or 16");
        // One row, one segment: what int_quantize reads of a weight's view.
        mixbits::QMatView v;
        v.N = 1;
        v.K = int(n);
        v.segs.push_back({4, group_size, 0, int(n), nullptr, nullptr, nullptr});
        auto run = [&](auto tag) {
          mixbits::IntActs<decltype(tag)> a;
          mixbits::int_quantize(x.data(), 1, v, a);
          return std::make_tuple(std::vector<int>(a.xq[0].begin(), a.xq[0].end()), a.d[0],
                                 std::vector<int>(a.ix[0].begin(), a.ix[0].end()), a.xs[0]);
        };
        return width == 8 ? run(int8_t{}) : run(int16_t{});
      },
      "x"_a, "group_size"_a, "width"_a,
      "The integer contracts' quantization (kernel.h's int_quantize) of one row of finite "
      "float32 x: (codes, d, ix, xs) per group.");
  // quantizers/search.py's fused per-group search (quant_search/search.h).
  // Shapes are checked in Python (search.py's _search_chunk); only sizes here.
  m.def(
      "search_trials",
      [](nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> t,
         nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> h,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> cs,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> cb,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> ds,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> db, float qlo,
         float qhi, float qoff, int idx0,
         nb::ndarray<double, nb::ndim<1>, nb::c_contig, nb::device::cpu> best_err,
         nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> best_idx,
         nb::ndarray<uint8_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> codes, bool simd) {
        mixbits::SearchGroups g;
        g.R = int64_t(t.shape(0)), g.G = int64_t(t.shape(1)), g.gs = int64_t(t.shape(2));
        const int64_t ng = g.R * g.G, C = int64_t(cs.shape(0));
        for (size_t d = 0; d < 3; ++d)
          if (x.shape(d) != t.shape(d) || codes.shape(d) != t.shape(d))
            throw nb::value_error("search_trials: t, x and codes differ in shape");
        if (int64_t(h.shape(0)) != g.G || int64_t(h.shape(1)) != g.gs)
          throw nb::value_error("search_trials: h must be [G, gs]");
        for (auto* a : {&cs, &cb, &ds, &db})
          if (int64_t(a->shape(0)) != C || int64_t(a->shape(1)) != ng)
            throw nb::value_error("search_trials: parameters must be [C, R*G]");
        if (int64_t(best_err.shape(0)) != ng || int64_t(best_idx.shape(0)) != ng)
          throw nb::value_error("search_trials: best_err, best_idx must be [R*G]");
        if (g.gs < 1) throw nb::value_error("search_trials: empty groups");
        g.t = t.data(), g.x = x.data(), g.h = h.data();
        g.qlo = qlo, g.qhi = qhi, g.qoff = qoff;
        nb::gil_scoped_release unlocked;
        mixbits::search_trials(g, C, cs.data(), cb.data(), ds.data(), db.data(), idx0,
                               best_err.data(), best_idx.data(), codes.data(), simd);
      },
      "t"_a, "x"_a, "h"_a, "cs"_a, "cb"_a, "ds"_a, "db"_a, "qlo"_a, "qhi"_a, "qoff"_a, "idx0"_a,
      "best_err"_a, "best_idx"_a, "codes"_a, "simd"_a,
      "Per group, candidates' codes clip(rint((x-cb)/cs), qlo, qhi)+qoff and weighted error "
      "against t (decoded ds*c+db); keeps the strictly better (in place). simd=False: the "
      "scalar reference.");
  m.def(
      "search_lsq_sums",
      [](nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> t,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> h,
         nb::ndarray<const uint8_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> codes,
         float qoff, nb::ndarray<double, nb::ndim<2>, nb::c_contig, nb::device::cpu> out,
         bool simd) {
        mixbits::SearchGroups g;
        g.R = int64_t(t.shape(0)), g.G = int64_t(t.shape(1)), g.gs = int64_t(t.shape(2));
        for (size_t d = 0; d < 3; ++d)
          if (codes.shape(d) != t.shape(d))
            throw nb::value_error("search_lsq_sums: t and codes differ in shape");
        if (int64_t(h.shape(0)) != g.G || int64_t(h.shape(1)) != g.gs)
          throw nb::value_error("search_lsq_sums: h must be [G, gs]");
        if (int64_t(out.shape(0)) != g.R * g.G || out.shape(1) != 5)
          throw nb::value_error("search_lsq_sums: out must be [R*G, 5]");
        g.t = t.data(), g.h = h.data(), g.qoff = qoff;
        nb::gil_scoped_release unlocked;
        mixbits::search_lsq_sums(g, codes.data(), out.data(), simd);
      },
      "t"_a, "h"_a, "codes"_a, "qoff"_a, "out"_a, "simd"_a,
      "Per group: sum h, h q, h q q, h t, h q t (q = codes + qoff), float64 in numpy's order.");
  // The bulk half-precision conversions: simd=False the scalar definition,
  // True the version the kernels run on this CPU (F16C / NEON, else the same).
  m.def(
      "narrow_from_f32",
      [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> x, int dtype,
         bool simd) {
        if (dtype != 1 && dtype != 2) throw nb::value_error("dtype: 1 (float16) or 2 (bfloat16)");
        std::vector<uint16_t> h(x.shape(0));
        (simd ? mixbits::narrow_from_f32 : mixbits::narrow_from_f32_ref)(
            x.data(), int64_t(x.shape(0)), mixbits::DType(dtype), h.data(), 0);
        return std::vector<int>(h.begin(), h.end());
      },
      "x"_a, "dtype"_a, "simd"_a,
      "float32 values as float16 (dtype 1) / bfloat16 (2) bit patterns (common/convert.h).");
  m.def(
      "widen_to_f32",
      [](nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> h, int dtype,
         bool simd) {
        if (dtype != 1 && dtype != 2) throw nb::value_error("dtype: 1 (float16) or 2 (bfloat16)");
        std::vector<float> out(h.shape(0));
        (simd ? mixbits::widen_to_f32 : mixbits::widen_to_f32_ref)(
            h.data(), 0, int64_t(h.shape(0)), mixbits::DType(dtype), out.data());
        return out;
      },
      "bits"_a, "dtype"_a, "simd"_a, "The inverse direction of narrow_from_f32.");
  m.def(
      "repacked_gemm_min_m",
      [](int backend) -> std::optional<int> {
        const mixbits::RTable* t = mixbits::select_repacked(false, mixbits::Backend(backend));
        const int m = t ? mixbits::repacked_gemm_min_m(*t) : 0;
        if (m <= 0) return std::nullopt;
        return m;
      },
      "backend"_a,
      "activations='int8-all' calls of at least this many rows on a repacked weight run the "
      "blocked int8 GEMM; None: they never do (no GEMM on this CPU/backend, or off by default: "
      "the GEMV in passes of 8 rows).");
  m.def("set_repacked_gemm_min_m", &mixbits::set_repacked_gemm_min_m, "n"_a,
        "Override the rows from which that GEMM runs, for this process (0: never; < 0: the "
        "default); for tests and crossover measurements.");
  m.def("repack_rows", []() { return mixbits::kRepackRows; },
        "Rows interleaved per block of the repacked layout.");

  m.def(
      "gather_qmatmul",
      [](const mx::array& x, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed,
         const std::vector<std::tuple<int, int, int>>& segs,
         const std::optional<mx::array>& lhs,
         const std::optional<mx::array>& rhs, bool sorted, int backend, int activations) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        return mixbits::mixed_gather_qmm(x, perm, packed, specs, lhs, rhs,
                                         sorted, mixbits::Backend(backend), {},
                                         mixbits::Activations(activations));
      },
      "x"_a, "perm"_a.none(), "packed"_a, "segments"_a, "lhs_indices"_a.none(),
      "rhs_indices"_a.none(), "sorted_indices"_a = false, "backend"_a = 0, "activations"_a = 0,
      "out[i] = x[lhs[i]] @ W[rhs[i]].T over the batches of x and of a "
      "mixed-segment W with leading batch dims (mx.gather_qmm's meaning).");

  m.def(
      "gather_qmatmul_node_inputs",
      [](const mx::array& x, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed,
         const std::vector<std::tuple<int, int, int>>& segs,
         const std::optional<mx::array>& lhs,
         const std::optional<mx::array>& rhs) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        auto y = mixbits::mixed_gather_qmm(x, perm, packed, specs, lhs, rhs, false,
                                           mixbits::Backend::Auto, mx::Device::cpu);
        return std::make_tuple(std::string(y.primitive().name()), y.inputs());
      },
      "x"_a, "perm"_a.none(), "packed"_a, "segments"_a, "lhs_indices"_a.none(),
      "rhs_indices"_a.none(),
      "For the Metal emulator tests: the name of the primitive gather_qmatmul "
      "builds and the arrays it gives it (unevaluated), built on the CPU; a "
      "GPU stream with the Metal kernel builds the node from the same arrays.");

  m.def(
      "qmatmul_t_node",
      [](const mx::array& dy, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed,
         const std::vector<std::tuple<int, int, int>>& segs) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        auto dx = mixbits::mixed_qmatmul_t(dy, perm, packed, specs,
                                           mixbits::Backend::Auto, mx::Device::cpu);
        return std::make_tuple(std::string(dx.primitive().name()), dx.inputs(), dx);
      },
      "dy"_a, "perm"_a.none(), "packed"_a, "segments"_a,
      "For the Metal emulator tests: the transposed product dx = dy @ W, "
      "un-permuted (MixedQMatmulT, the gradient wrt x), built on the CPU: "
      "the primitive's name, the arrays it is given (unevaluated) and its "
      "output; a GPU stream builds the node from the same arrays.");

  m.def(
      "gather_qmatmul_t_node",
      [](const mx::array& dy, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed,
         const std::vector<std::tuple<int, int, int>>& segs, const mx::array& lhs,
         const mx::array& rhs, const std::vector<int>& x_shape) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        auto dx = mixbits::mixed_gather_qmm_t(dy, perm, packed, specs, lhs, rhs,
                                              mx::Shape(x_shape.begin(), x_shape.end()),
                                              mixbits::Backend::Auto, mx::Device::cpu);
        return std::make_tuple(std::string(dx.primitive().name()), dx.inputs(), dx);
      },
      "dy"_a, "perm"_a.none(), "packed"_a, "segments"_a, "lhs"_a, "rhs"_a, "x_shape"_a,
      "For the Metal emulator tests: the gathered transposed product dx[lhs[i]] "
      "+= dy[i] @ W[rhs[i]], un-permuted (MixedGatherQMMT, the gradient wrt x), "
      "built on the CPU from a MixedGatherQMM node's dense uint32 indices: the "
      "primitive's name, the arrays it is given (unevaluated) and its output; a "
      "GPU stream builds the node from the same arrays.");

  m.def(
      "batched_qmatmul",
      [](const mx::array& x, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed,
         const std::vector<std::tuple<int, int, int>>& segs, int backend, int activations) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        return mixbits::mixed_batched_qmm(x, perm, packed, specs,
                                          mixbits::Backend(backend), {},
                                          mixbits::Activations(activations));
      },
      "x"_a, "perm"_a.none(), "packed"_a, "segments"_a, "backend"_a = 0, "activations"_a = 0,
      "x @ W.T with W's leading batch dims broadcast against x's, as "
      "mx.quantized_matmul(..., transpose=True).");

  m.def(
      "swiglu",
      [](const mx::array& gate, const mx::array& up, int backend) {
        return mixbits::swiglu(gate, up, mixbits::Backend(backend));
      },
      "gate"_a, "up"_a, "backend"_a = 0,
      "silu(gate) * up, float32, CPU.");

  m.def(
      "rms_norm",
      [](const mx::array& x, const mx::array& w, float eps) {
        return mixbits::rms_norm(x, w, eps);
      },
      "x"_a, "weight"_a, "eps"_a,
      "mx.fast.rms_norm(x, weight, eps) as one CPU node (float32/16, bfloat16).");

  m.def(
      "float_matmul",
      [](const mx::array& a, const mx::array& b, std::optional<mx::array> bias, bool trans_a,
         bool trans_b, int backend, int path) {
        return mixbits::float_matmul(a, b, bias, trans_a, trans_b, mixbits::Backend(backend),
                                     mixbits::MatmulPath(path));
      },
      "a"_a, "b"_a, "bias"_a.none() = nb::none(), "trans_a"_a = false, "trans_b"_a = true,
      "backend"_a = 0, "path"_a = 0,
      "op(A) @ op(B) + bias in float32/16, bfloat16 on the CPU (A: a's rows); path 0 auto, "
      "1 GEMV, 2 BLAS.");
  m.def(
      "float_matmul_backends",
      [] {
        std::vector<int> out;
        for (auto b : mixbits::available_linear_backends()) out.push_back(int(b));
        return out;
      },
      "GEMV backends of float_matmul usable on this CPU (backend_names() indices).");
  m.def("float_matmul_gemv_max_rows",
        [](bool half) { return mixbits::gemv_max_rows(half ? mixbits::DType::f16 : mixbits::DType::f32); },
        "half"_a, "Rows of x up to which float_matmul's auto path takes the GEMV, by weight dtype.");
  m.def("load_blas", &mixbits::load_blas, "path"_a,
        "dlopen a CBLAS (OpenBLAS) for float_matmul: '' when loaded, else why not.");
  m.def("blas_loaded", &mixbits::blas_loaded, "Whether float_matmul has a BLAS.");
  m.def("blas_threads", &mixbits::blas_threads, "The loaded BLAS's thread count (0: none).");
  m.def("set_blas_threads", &mixbits::set_blas_threads, "n"_a,
        "Set the loaded BLAS's own thread count (numpy's too: one library).");
  m.def("blas_description", &mixbits::blas_description,
        "The loaded BLAS's file and sgemm symbol ('' when none).");

  m.def(
      "rope",
      [](const mx::array& x, const mx::array& offset, int dims, bool traditional, float base,
         float scale) { return mixbits::rope(x, offset, dims, traditional, base, scale); },
      "x"_a, "offset"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a,
      "mx.fast.rope(x, dims, ...) with an integer-array offset, as one CPU node.");

  m.def(
      "act_backends",
      [] {
        std::vector<int> out;
        for (auto b : mixbits::available_act_backends()) out.push_back(int(b));
        return out;
      },
      "Activation backends usable on this CPU (backend_names() indices).");

  m.def(
      "causal_attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v,
         float scale, int backend, const std::optional<mx::array>& kv_len) {
        return mixbits::causal_attention(q, k, v, scale,
                                         mixbits::Backend(backend), {}, kv_len);
      },
      "q"_a, "k"_a, "v"_a, "scale"_a, "backend"_a = 0, "kv_len"_a.none() = nb::none(),
      "softmax(scale q k^T, causal) v for q [B,H,T,D], k/v [B,Hk,S,D], "
      "float32, CPU; with kv_len only keys [0, kv_len) of k/v exist.");

  m.def(
      "kv_write",
      [](const mx::array& buf, const mx::array& x, const mx::array& slot) {
        return mixbits::kv_write(buf, x, slot);
      },
      "buf"_a, "x"_a, "slot"_a,
      "buf [B, H, S, D] with row `slot` of each (b, h) set to x's [B, H, 1, D] (in buf's "
      "dtype), in place when nothing else holds buf; x may be read through views; CPU.");

  m.def(
      "attn_backends",
      [] {
        std::vector<int> out;
        for (auto b : mixbits::available_attn_backends()) out.push_back(int(b));
        return out;
      },
      "Attention backends usable on this CPU (backend_names() indices).");

  m.def(
      "fp_qmatmul",
      [](const mx::array& x, const mx::array& wq, const mx::array& scales, int mode, bool transpose,
         int backend) {
        if (mode < 0 || mode > 2) throw std::invalid_argument("fp_qmatmul: mode must be 0, 1 or 2");
        return mixbits::fp_qmatmul(x, wq, scales, mixbits::FpMode(mode), transpose,
                                   mixbits::Backend(backend));
      },
      "x"_a, "wq"_a, "scales"_a, "mode"_a, "transpose"_a = true, "backend"_a = 0,
      "y = x @ W.T (transpose) or x @ W on the CPU for W in an fp mode of mx.quantize "
      "(mode: 0 mxfp4, 1 nvfp4, 2 mxfp8), w and scales 2-D as MLX stores them.");

  m.def(
      "fpm_backends",
      [] {
        std::vector<int> out;
        for (auto b : mixbits::available_backends(mixbits::kFpmBackends)) out.push_back(int(b));
        return out;
      },
      "fp-mode matmul backends usable on this CPU (backend_names() indices).");

  m.def(
      "qmm_backends",
      [] {
        std::vector<int> out;
        for (auto b : mixbits::available_qmm_backends()) out.push_back(int(b));
        return out;
      },
      "Quantized-matmul backends usable on this CPU (backend_names() indices).");

  m.def(
      "kl_divergence",
      [](const mx::array& ref, const mx::array& logits,
         const std::optional<mx::array>& row_param, int mode, int backend) {
        return mixbits::kl_divergence(ref, logits, row_param,
                                      mixbits::KLMode(mode),
                                      mixbits::Backend(backend));
      },
      "ref"_a, "logits"_a, "row_param"_a.none(), "mode"_a = 0, "backend"_a = 0,
      "Per-row KL(P_ref || Q) over the last axis: [kl, status, argmax_q, "
      "lse_q, argmax_ref, lse_ref]. mode 0 logits, 1 fixed shift, 2 probs.");
  m.def(
      "kl_backends",
      [] {
        std::vector<int> out;
        for (auto b : mixbits::available_kl_backends()) out.push_back(int(b));
        return out;
      },
      "KL backends usable on this CPU (backend_names() indices).");
  m.def(
      "kl_vector_exp",
      [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> x,
         nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu> y,
         int backend) {
        if (x.shape(0) != y.shape(0))
          throw std::invalid_argument("kl_vector_exp: x and y differ in length");
        mixbits::kl_vector_exp(mixbits::Backend(backend), x.data(), y.data(),
                               int64_t(x.shape(0)));
      },
      "x"_a, "y"_a, "backend"_a = 0, "y[:] = exp(x) with the KL kernel's exp.");
  m.def(
      "kl_exp_seconds",
      [](int64_t n, int backend) {
        return mixbits::kl_exp_seconds(mixbits::Backend(backend), n);
      },
      "n_exps"_a, "backend"_a = 0,
      "Seconds for all threads to evaluate n_exps cache-resident exps.");

  m.def("num_threads", &mixbits::num_threads,
        "Worker threads used by the CPU kernels.");
  m.def("set_max_threads", &mixbits::set_max_threads, "n"_a,
        "Cap the worker threads of the CPU kernels (<= 0: no cap).");
  m.def("max_threads", &mixbits::max_threads,
        "Current cap on the worker threads of the CPU kernels.");
  m.def(
      "parallel_for_visits",
      [](std::vector<int64_t> sizes, int64_t grain, int jobs, int spin) {
        // Runs `jobs` back-to-back parallel_for calls, job j over
        // [0, sizes[j % len]), and counts how often each item was visited.
        // Many tiny jobs of changing chunk counts in a row are what exposed
        // the pool's race: a claim late from a job of few chunks ran as a
        // chunk of the next, larger job. `spin` busy steps per item give the
        // workers time to join.
        int64_t most = 0;
        for (int64_t s : sizes) most = std::max(most, s);
        std::vector<std::atomic<int>> hits(static_cast<size_t>(most));
        for (int j = 0; j < jobs && !sizes.empty(); ++j)
          mixbits::parallel_for(sizes[size_t(j) % sizes.size()], grain,
                                [&](int64_t b, int64_t e) {
                                  for (int64_t i = b; i < e; ++i) {
                                    for (volatile int k = 0; k < spin; ++k) {
                                    }
                                    hits[size_t(i)].fetch_add(
                                        1, std::memory_order_relaxed);
                                  }
                                });
        std::vector<int> out(hits.size());
        for (size_t i = 0; i < hits.size(); ++i) out[i] = hits[i].load();
        return out;
      },
      "sizes"_a, "grain"_a, "jobs"_a, "spin"_a = 0,
      "Thread-pool check: per-item visit counts over `jobs` parallel_for "
      "calls of the given sizes in turn.",
      nb::call_guard<nb::gil_scoped_release>());
  m.def("read_bandwidth_gbps", &mixbits::read_bandwidth_gbps, "nbytes"_a,
        "reps"_a = 5,
        "Benchmark probe: best multithreaded stream-read rate over a buffer "
        "of nbytes, in GB/s.", nb::call_guard<nb::gil_scoped_release>());
  m.def("int8_dot_ns", &mixbits::int8_dot_ns, "reps"_a = 5,
        "Benchmark probe: ns per 512-bit vpdpbusd (64 byte multiply-adds), one thread; "
        "0.0 without AVX512-VNNI.", nb::call_guard<nb::gil_scoped_release>());
}
