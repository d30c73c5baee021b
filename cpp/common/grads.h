// Argument plumbing shared by the primitives' vjp / jvp: MLX hands them
// the argnums asked for; the MLX ops they fall back to take every input.
#pragma once
#include <vector>

#include "mlx/ops.h"

namespace mixbits {

// The gradients at `argnums` out of one per input.
inline std::vector<mlx::core::array> pick(const std::vector<mlx::core::array>& all,
                                          const std::vector<int>& argnums) {
  std::vector<mlx::core::array> out;
  for (int a : argnums) out.push_back(all[size_t(a)]);
  return out;
}

// Tangents for every input: the given ones at their argnums, zeros elsewhere.
inline std::vector<mlx::core::array> full_tangents(const std::vector<mlx::core::array>& primals,
                                                   const std::vector<mlx::core::array>& tangents,
                                                   const std::vector<int>& argnums,
                                                   mlx::core::Stream s) {
  std::vector<mlx::core::array> t;
  for (const auto& p : primals) t.push_back(mlx::core::zeros_like(p, s));
  for (size_t j = 0; j < argnums.size(); ++j) t[size_t(argnums[j])] = tangents[j];
  return t;
}

}  // namespace mixbits
