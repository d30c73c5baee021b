// Host side of the Metal KL kernel, in plain C++: kernel name, parameters,
// grid and the buffers it binds. Used by cpp/kl/metal.cpp on macOS and by
// the emulator harness (tests/metal/harness.cpp) on Linux.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernel_args.h"
#include "kl_params.h"

namespace mixbits::metal_host {

struct KlLaunch : Launch {
  MbKlParams params;
};

inline std::string kl_kernel_name(ActType ref, ActType logits) {
  return std::string("mixbits_kl_") + act_type_name(ref) + "_" +
         act_type_name(logits);
}

// float32 words of the row parameter per row (the CPU primitive's layout).
inline int kl_row_param_words(int mode) {
  return mode == MB_KL_MODE_PROBS          ? MB_KL_PROBS_PARAM_WORDS
         : mode == MB_KL_MODE_FIXED_SHIFT ? MB_KL_FIXED_SHIFT_PARAM_WORDS
                                          : 0;
}

// Why the Metal kernel cannot run a problem ("" if it can): one
// threadgroup per row and int32 parameters. Checked when the graph node is
// built (cpp/kl/kl.cpp), so eval_gpu never meets such a problem.
inline std::string kl_gpu_refusal(int64_t rows, int64_t V) {
  const int64_t lim = 0x7fffffff;
  if (rows > lim) return "more than 2^31-1 rows for the GPU kernel";
  if (V > lim) return "the vocabulary axis is longer than 2^31-1";
  return "";
}

// Largest threadgroup the kernel can use when a pipeline allows at most
// `max_threads` (Metal's maxTotalThreadsPerThreadgroup): any multiple of 32
// works, so this never fails on a real GPU (the minimum is 32).
inline int kl_threads_for(unsigned long max_threads) {
  const unsigned long t = max_threads < MB_KL_THREADS ? max_threads : MB_KL_THREADS;
  if (t < 32) throw std::runtime_error("kl_divergence: the GPU allows fewer than 32 threads per threadgroup");
  return int(t / 32 * 32);
}

// One threadgroup per row. `threads` (a multiple of 32, at most 1024) is a
// knob for tests and for pipelines that allow fewer than MB_KL_THREADS.
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
  const size_t n = size_t(rows), nv = n * size_t(V);
  const size_t np = n * size_t(kl_row_param_words(mode));
  // Unused slots get the kl output (offset 0, float32-aligned).
  l.buffers = {
      {"ref", MB_KL_A, Dir::In, elem_of(ref), nv, -1},
      {"logits", MB_KL_B, Dir::In, elem_of(logits), nv, -1},
      {"row_param", MB_KL_ROW_PARAM, Dir::In, Elem::F32, np, np ? -1 : MB_KL_OUT},
      {"kl", MB_KL_OUT, Dir::Out, Elem::F32, n, -1},
      {"status", MB_KL_STATUS, Dir::Out, Elem::I32, n, -1},
      {"argmax_q", MB_KL_ARG_Q, Dir::Out, Elem::I32, n, -1},
      {"lse_q", MB_KL_LSE_Q, Dir::Out, Elem::F32, n, -1},
      {"argmax_ref", MB_KL_ARG_REF, Dir::Out, Elem::I32, n, -1},
      {"lse_ref", MB_KL_LSE_REF, Dir::Out, Elem::F32, n, -1},
  };
  l.params_index = MB_KL_PARAMS;
  return l;
}

}  // namespace mixbits::metal_host
