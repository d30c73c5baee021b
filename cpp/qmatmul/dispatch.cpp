// Picks the CPU backend for the quantized matmul from what this CPU can run.
#include <stdexcept>

#include "qmatmul/kernel.h"

namespace mixbits {

std::vector<Backend> available_qmm_backends() { return {Backend::Ref}; }

QmmFn select_qmm(Backend requested) {
  switch (requested) {
    case Backend::Auto:
    case Backend::Ref:
      return qmm_ref;
    default:
      throw std::invalid_argument(
          "qmatmul: backend " + std::to_string(int(requested)) +
          " is not available on this CPU");
  }
}

}  // namespace mixbits
