// Built without SIMD flags, like cpu.cpp: it only reads cpu_isa().
#include "common/backend.h"

#include <stdexcept>

#include "common/cpu.h"

namespace mixbits {

const std::vector<std::string>& backend_names() {
  static const std::vector<std::string> names{"auto", "ref", "avx2", "neon", "avx512"};
  return names;
}

const char* backend_name(Backend b) {
  const int i = int(b);
  return i >= 0 && i < kNumBackends ? backend_names()[i].c_str() : "?";
}

BackendSet cpu_backends() {
  static const BackendSet s = [] {
    BackendSet r = backend_bit(Backend::Ref);
    const CpuIsa& isa = cpu_isa();  // all false on builds without AVX2 files
    if (isa.avx2) r |= backend_bit(Backend::Avx2);
    if (isa.avx512f) r |= backend_bit(Backend::Avx512);
#if defined(MIXBITS_HAVE_NEON)
    r |= backend_bit(Backend::Neon);
#endif
    return r;
  }();
  return s;
}

std::vector<Backend> available_backends(BackendSet implemented) {
  std::vector<Backend> out;
  for (Backend b : {Backend::Ref, Backend::Neon, Backend::Avx2, Backend::Avx512})
    if (implemented & cpu_backends() & backend_bit(b)) out.push_back(b);
  return out;
}

Backend resolve_backend(const char* op, Backend requested, BackendSet implemented) {
  const BackendSet here = implemented & cpu_backends();
  if (requested == Backend::Auto) {
    for (Backend b : {Backend::Avx512, Backend::Avx2, Backend::Neon})
      if (here & backend_bit(b)) return b;
    return Backend::Ref;
  }
  const int i = int(requested);
  if (i >= 0 && i < kNumBackends && (here & backend_bit(requested))) return requested;
  std::string avail;
  for (Backend b : available_backends(implemented))
    avail += std::string(avail.empty() ? "" : ", ") + backend_name(b);
  const std::string name =
      i >= 0 && i < kNumBackends ? backend_name(requested) : std::to_string(i);
  throw std::invalid_argument(std::string(op) + ": backend '" + name +
                              "' is not available on this CPU (available: " + avail + ")");
}

}  // namespace mixbits
