// nanobind module mixbits._ext: argument conversion only. Validation with
// user-facing messages lives in python/mixbits/ops.py and in the op builders.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bench/probe.h"
#include "common/parallel.h"
#include "qmatmul/qmatmul.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

NB_MODULE(_ext, m) {
  m.doc() = "mixbits C++ kernels as MLX primitives";

  m.def(
      "qmatmul",
      [](const mx::array& x, const std::optional<mx::array>& perm,
         const std::vector<mx::array>& packed,
         const std::vector<std::tuple<int, int, int>>& segs, int backend) {
        std::vector<mixbits::SegSpec> specs;
        for (auto [b, g, k] : segs) specs.push_back({b, g, k});
        return mixbits::mixed_qmatmul(x, perm, packed, specs,
                                      mixbits::Backend(backend));
      },
      "x"_a, "perm"_a.none(), "packed"_a, "segments"_a, "backend"_a = 0,
      "y = x @ W.T for a mixed-segment quantized W. segments: (bits, "
      "group_size, k) per segment; packed: wq, scales, biases per segment.");

  m.def(
      "qmm_backends",
      [] {
        std::vector<int> out;
        for (auto b : mixbits::available_qmm_backends()) out.push_back(int(b));
        return out;
      },
      "Backends usable on this CPU (1=ref, 2=avx2, 3=neon).");

  m.def("num_threads", &mixbits::num_threads,
        "Worker threads used by the CPU kernels.");
  m.def("set_max_threads", &mixbits::set_max_threads, "n"_a,
        "Cap the worker threads of the CPU kernels (<= 0: no cap).");
  m.def("max_threads", &mixbits::max_threads,
        "Current cap on the worker threads of the CPU kernels.");
  m.def("read_bandwidth_gbps", &mixbits::read_bandwidth_gbps, "nbytes"_a,
        "reps"_a = 5,
        "Benchmark probe: best multithreaded stream-read rate over a buffer "
        "of nbytes, in GB/s.", nb::call_guard<nb::gil_scoped_release>());
}
