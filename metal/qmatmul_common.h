// Pieces shared by the two quantized-matmul kernels (qmatmul_gemv.metal,
// qmatmul_tiled.metal): how a dispatch finishes an output, how it reads an
// activation through the permutation, and the [[host_name]] instantiation
// ladder. Included by .metal sources only (after mixbits_metal.h).
#pragma once
#include "qmatmul_params.h"
#include "quant_utils.h"

// Finishes one output: adds the partial sum of earlier segments and stores
// either the final value or the new partial sum.
template <typename IO>
inline void mb_qmm_store(device float* acc, device typename IO::storage* out,
                         constant MbQmmParams& p, size_t idx, float v) {
  if (p.accumulate) v += acc[idx];
  if (p.write_out) {
    out[idx] = IO::store(v);
  } else {
    acc[idx] = v;
  }
}

// Activation column c of row `xrow` (c in permuted order). A perm entry
// outside [0, K) reads NaN rather than out-of-bounds memory, so a broken
// permutation poisons the output (as the CPU path does) instead of reading
// garbage.
template <typename IO>
inline float mb_load_x(const device typename IO::storage* xrow,
                       const device int32_t* perm, constant MbQmmParams& p,
                       int c) {
  if (!p.has_perm) return IO::load(xrow[c]);
  const uint32_t pc = uint32_t(perm[c]);
  return pc < uint32_t(p.K) ? IO::load(xrow[pc]) : NAN;
}

// Every kernel is instantiated per activation dtype x scale dtype x bits x
// group size, under the name
//   mixbits_<kind>_<activation dtype>_<scale dtype>_b<bits>_g<group size>
// (ladder_kernel_name in qmatmul_host.h builds the same string). `inst` is a
// macro (name, io, sc, bits, gs) that instantiates one kernel.
#define MB_QMM_LADDER_GROUPS(inst, kind, tn, io, sn, sc, bits)                   \
  inst("mixbits_" kind "_" tn "_" sn "_b" #bits "_g32", io, sc, bits, 32)       \
  inst("mixbits_" kind "_" tn "_" sn "_b" #bits "_g64", io, sc, bits, 64)       \
  inst("mixbits_" kind "_" tn "_" sn "_b" #bits "_g128", io, sc, bits, 128)

#define MB_QMM_LADDER_BITS(inst, kind, tn, io, sn, sc)        \
  MB_QMM_LADDER_GROUPS(inst, kind, tn, io, sn, sc, 2)         \
  MB_QMM_LADDER_GROUPS(inst, kind, tn, io, sn, sc, 3)         \
  MB_QMM_LADDER_GROUPS(inst, kind, tn, io, sn, sc, 4)         \
  MB_QMM_LADDER_GROUPS(inst, kind, tn, io, sn, sc, 5)         \
  MB_QMM_LADDER_GROUPS(inst, kind, tn, io, sn, sc, 6)         \
  MB_QMM_LADDER_GROUPS(inst, kind, tn, io, sn, sc, 8)

#define MB_QMM_LADDER_SCALES(inst, kind, tn, io)                      \
  MB_QMM_LADDER_BITS(inst, kind, tn, io, "float32", MbF32)            \
  MB_QMM_LADDER_BITS(inst, kind, tn, io, "float16", MbF16)            \
  MB_QMM_LADDER_BITS(inst, kind, tn, io, "bfloat16", MbBF16)

#define MB_QMM_LADDER(inst, kind)                                \
  MB_QMM_LADDER_SCALES(inst, kind, "float32", MbF32)             \
  MB_QMM_LADDER_SCALES(inst, kind, "float16", MbF16)             \
  MB_QMM_LADDER_SCALES(inst, kind, "bfloat16", MbBF16)
