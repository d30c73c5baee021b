// Pieces shared by the quantized-matmul kernels (qmatmul_gemv.metal,
// qmatmul_tiled.metal, gather_qmv.metal, gather_qmm.metal, and the
// transposed qmatmul_t.metal, gather_qmv_t.metal): how a dispatch
// finishes an output, how it reads an activation through the permutation,
// the switch on a segment's bit width and the [[host_name]] instantiation
// ladder (activation dtype x scale dtype). Included by .metal sources only
// (after mixbits_metal.h).
#pragma once
#include "qmatmul_params.h"
#include "quant_utils.h"

// Finishes one output: adds the partial sum of earlier segments and stores
// either the final value or the new partial sum.
template <typename IO, typename P>
inline void mb_qmm_store(device float* acc, device typename IO::storage* out,
                         constant P& p, size_t idx, float v) {
  if (p.accumulate) v += acc[idx];
  if (p.write_out) {
    out[idx] = IO::store(v);
  } else {
    acc[idx] = v;
  }
}

// Column pc of x for permuted column c: perm[c] with a perm, else c. An
// entry outside [0, K) gives K, which the callers read as NaN rather than
// out-of-bounds memory, so a broken permutation poisons the output (as the
// CPU path does) instead of reading garbage.
inline uint32_t mb_perm_col(const device int32_t* perm, int has_perm, int K, int c) {
  const uint32_t pc = has_perm ? uint32_t(perm[c]) : uint32_t(c);
  return pc < uint32_t(K) ? pc : uint32_t(K);
}

// The dense kernels' per-segment work is a template over the bit width;
// the segment table gives the width at run time, so they switch once per
// segment (uniform over the threadgroup) with this ladder. F(b) is a
// function-like macro that runs the segment for width b.
#define MB_QMM_SWITCH_BITS(bits, F) \
  switch (bits) {                   \
    case 2: F(2); break;            \
    case 3: F(3); break;            \
    case 4: F(4); break;            \
    case 5: F(5); break;            \
    case 6: F(6); break;            \
    default: F(8); break;           \
  }

// The dense kernels' ladder: one instantiation per activation dtype x scale
// dtype, named mixbits_<kind>_<activation dtype>_<scale dtype>
// (qmm_kernel_name in qmatmul_host.h). `inst` is (name, io, sc).
#define MB_QMM_FUSED_SCALES(inst, kind, tn, io)          \
  inst("mixbits_" kind "_" tn "_float32", io, MbF32)     \
  inst("mixbits_" kind "_" tn "_float16", io, MbF16)     \
  inst("mixbits_" kind "_" tn "_bfloat16", io, MbBF16)

#define MB_QMM_FUSED_LADDER(inst, kind)                  \
  MB_QMM_FUSED_SCALES(inst, kind, "float32", MbF32)      \
  MB_QMM_FUSED_SCALES(inst, kind, "float16", MbF16)      \
  MB_QMM_FUSED_SCALES(inst, kind, "bfloat16", MbBF16)
