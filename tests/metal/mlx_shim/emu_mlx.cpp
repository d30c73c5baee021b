// MLX's own affine quantized Metal kernels, compiled as C++ for the SIMT
// emulator from the headers of the installed (pinned) mlx package --
// quantized.h and the steel loader/MMA headers it uses, unchanged; nothing
// of MLX's is copied here. mlx_emu.py adds the package's include directory.
// Registered under the names MLX's host code asks for (quantized.cpp):
// 4-bit, group 64, float16, unbatched, the shapes the comparison runs.
#include "mlx_compat.h"

#include "mlx/backend/metal/kernels/steel/gemm/loader.h"
#include "mlx/backend/metal/kernels/steel/gemm/mma.h"
#include "mlx/backend/metal/kernels/quantized_utils.h"
#include "mlx/backend/metal/kernels/quantized.h"

// GEMV kernels: the [[kernel]] functions themselves (no threadgroup memory).
MB_INSTANTIATE_KERNEL("affine_qmv_fast_float16_t_gs_64_b_4_batch_0", affine_qmv_fast, half, 64,
                      4, false)
MB_INSTANTIATE_KERNEL("affine_qmv_float16_t_gs_64_b_4_batch_0", affine_qmv, half, 64, 4, false)
MB_INSTANTIATE_KERNEL("affine_qmv_wide_float16_t_gs_64_b_4_nv_2_kl_8_batch_0", affine_qmv_wide,
                      half, 64, 4, 2, 8, false)
MB_INSTANTIATE_KERNEL("affine_qmv_wide_float16_t_gs_64_b_4_nv_3_kl_8_batch_0", affine_qmv_wide,
                      half, 64, 4, 3, 8, false)
MB_INSTANTIATE_KERNEL("affine_qmv_wide_float16_t_gs_64_b_4_nv_4_kl_8_batch_0", affine_qmv_wide,
                      half, 64, 4, 4, 8, false)
MB_INSTANTIATE_KERNEL("affine_qmv_wide_float16_t_gs_64_b_4_nv_5_kl_8_batch_0", affine_qmv_wide,
                      half, 64, 4, 5, 8, false)

// The tiled kernel: affine_qmm_t declares its tiles as function-local
// `threadgroup` arrays, which the emulator cannot share between the fibers
// of a threadgroup (mlx_compat.h), so the harness calls what that wrapper
// calls for an unbatched launch -- qmm_t_impl<T, gs, bits, aligned_N, T,
// 32, 32, 32> with K_eff = K -- and passes the two tiles itself.
MB_INSTANTIATE_KERNEL("affine_qmm_t_float16_t_gs_64_b_4_alN_true_batch_0", qmm_t_impl, half, 64,
                      4, true, half, 32, 32, 32)
MB_INSTANTIATE_KERNEL("affine_qmm_t_float16_t_gs_64_b_4_alN_false_batch_0", qmm_t_impl, half, 64,
                      4, false, half, 32, 32, 32)

// Split-K (what MLX's host dispatches for most unbatched prefill shapes,
// qmm_splitk): affine_qmm_t_splitk's body is qmm_t_impl with float
// partials, K_eff = the partition, its pointers advanced by partition tid.z
// (done by the harness, as that wrapper does, for the same reason as above).
MB_INSTANTIATE_KERNEL("affine_qmm_t_splitk_float16_t_gs_64_b_4_alN_true", qmm_t_impl, half, 64,
                      4, true, float, 32, 32, 32)
MB_INSTANTIATE_KERNEL("affine_qmm_t_splitk_float16_t_gs_64_b_4_alN_false", qmm_t_impl, half, 64,
                      4, false, float, 32, 32, 32)
