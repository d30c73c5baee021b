// Prints the Metal quantized matmul's launch plans (metal/qmatmul_host.h,
// what cpp/qmatmul/metal.cpp binds on a Mac) as JSON lines, for
// test_launch_layout.py to check against the kernels' own parameter lists.
// Plain C++: no Metal, no emulator. Arguments: M N has_perm x_type
// scale_type path, then bits group_size k per segment.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "qmatmul_host.h"

using namespace mixbits::metal_host;

int main(int argc, char** argv) {
  if (argc < 10 || (argc - 7) % 3 != 0) return 2;
  const int M = std::atoi(argv[1]), N = std::atoi(argv[2]);
  const bool perm = std::atoi(argv[3]) != 0;
  const auto xt = ActType(std::atoi(argv[4]));
  const int st = std::atoi(argv[5]);
  const auto path = QmmPath(std::atoi(argv[6]));
  std::vector<QmmSegment> segs;
  for (int i = 7; i + 2 < argc; i += 3)
    segs.push_back({std::atoi(argv[i]), std::atoi(argv[i + 1]), std::atoi(argv[i + 2])});
  for (const QmmLaunch& l : plan_qmm(M, N, segs, xt, st, perm, path)) {
    const MbQmmFusedParams& q = l.params;
    std::printf("{\"kernel\": \"%s\", \"tiled\": %d, \"first_segment\": %d, \"params_index\": %d, "
                "\"params_bytes\": %zu, \"threadgroup_bytes\": %zu, "
                "\"grid\": [%u, %u, %u], \"group\": [%u, %u, %u], "
                "\"M\": %d, \"N\": %d, \"K\": %d, \"has_perm\": %d, \"nseg\": %d, "
                "\"accumulate\": %d, \"write_out\": %d, \"qmv_sets\": %d, \"seg\": [",
                l.kernel.c_str(), int(l.tiled), l.first_segment, l.params_index, sizeof q,
                l.threadgroup_bytes, l.grid[0], l.grid[1], l.grid[2], l.group[0], l.group[1],
                l.group[2], q.M, q.N, q.K, q.has_perm, q.nseg, q.accumulate, q.write_out,
                q.qmv_sets);
    for (int j = 0; j < MB_QMM_MAX_SEGS; ++j)
      std::printf("%s[%d, %d, %d, %d]", j ? ", " : "", q.seg[j].bits, q.seg[j].group_shift,
                  q.seg[j].k0, q.seg[j].kseg);
    std::printf("], \"buffers\": [");
    for (size_t i = 0; i < l.buffers.size(); ++i) {
      const BufferArg& b = l.buffers[i];
      std::printf("%s{\"name\": \"%s\", \"index\": %d, \"out\": %d, \"elem\": \"%s\", "
                  "\"count\": %zu, \"stand_in\": %d}",
                  i ? ", " : "", b.name, b.index, int(b.dir == Dir::Out), elem_name(b.elem),
                  b.count, b.stand_in);
    }
    std::printf("]}\n");
  }
  return 0;
}
