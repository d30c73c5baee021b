// Host side of the Metal KL kernel, in plain C++: kernel name, parameters
// and grid. Used by cpp/kl/metal.cpp on macOS and by the emulator tests.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kl_params.h"
#include "qmatmul_host.h"  // ActType, Launch

namespace mixbits::metal_host {

struct KlLaunch : Launch {
  MbKlParams params;
};

inline std::string kl_kernel_name(ActType ref, ActType logits) {
  return std::string("mixbits_kl_") + act_type_name(ref) + "_" +
         act_type_name(logits);
}

// One threadgroup per row. `threads` (a multiple of 32, at most 1024) is a
// knob for tests; the default is MB_KL_THREADS.
inline KlLaunch plan_kl(int rows, int V, ActType ref, ActType logits,
                        int mode, int threads = MB_KL_THREADS) {
  if (rows <= 0 || V <= 0) throw std::invalid_argument("plan_kl: empty problem");
  if (threads <= 0 || threads % 32 != 0 || threads > 1024)
    throw std::invalid_argument("plan_kl: threads must be a multiple of 32 <= 1024");
  if (mode < MB_KL_MODE_LOGITS || mode > MB_KL_MODE_PROBS)
    throw std::invalid_argument("plan_kl: unknown mode");
  KlLaunch l;
  l.kernel = kl_kernel_name(ref, logits);
  l.params.rows = rows;
  l.params.V = V;
  l.params.mode = mode;
  l.grid[0] = uint32_t(rows);
  l.grid[1] = l.grid[2] = 1;
  l.group[0] = uint32_t(threads);
  l.group[1] = l.group[2] = 1;
  l.threadgroup_bytes = size_t(MB_KL_TG_FLOATS) * sizeof(float);
  return l;
}

}  // namespace mixbits::metal_host
