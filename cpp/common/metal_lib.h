// What every cpp/*/metal.cpp needs besides the buffer binding
// (metal_bind.h): the mixbits metallib, and MLX dtypes as the host plans
// (metal/*_host.h) name them. Included only by cpp/*/metal.cpp.
#pragma once
#ifdef _METAL_

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>
#include <string>

#include "kernel_args.h"
#include "mlx/array.h"
#include "mlx/backend/metal/device.h"
#include "qmatmul_params.h"

namespace mixbits {

// mixbits.metallib is installed next to the extension library.
inline const std::string& metal_library_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&metal_library_dir), &info))
      throw std::runtime_error("mixbits: cannot locate the extension library");
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

inline MTL::Library* mixbits_metal_library(mlx::core::metal::Device& d) {
  return d.get_library("mixbits", metal_library_dir());
}

// Activations and outputs (the builders admit only these three dtypes).
inline metal_host::ActType metal_act_type(mlx::core::Dtype t) {
  if (t == mlx::core::float16) return metal_host::ActType::F16;
  if (t == mlx::core::bfloat16) return metal_host::ActType::BF16;
  return metal_host::ActType::F32;
}

// Scales and biases of the quantized matmuls (MbScaleType).
inline int metal_scale_type(mlx::core::Dtype t) {
  if (t == mlx::core::float16) return MB_SCALE_F16;
  if (t == mlx::core::bfloat16) return MB_SCALE_BF16;
  return MB_SCALE_F32;
}

}  // namespace mixbits

#endif  // _METAL_
