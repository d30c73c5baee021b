// One description of the buffers a Metal kernel launch binds: index, name,
// direction, element type and element count, and which buffer stands in
// for a slot the launch does not use. cpp/*/metal.cpp binds MLX arrays from
// it (checking each array against it) and the emulator harness
// (tests/metal/harness.cpp) allocates and checks its buffers from it, so the
// kernel, the Mac host and the tests cannot disagree about what a buffer
// holds. Plain C++, no MLX.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mixbits::metal_host {

enum class ActType { F32 = 0, F16 = 1, BF16 = 2 };

inline const char* act_type_name(ActType t) {
  switch (t) {
    case ActType::F32: return "float32";
    case ActType::F16: return "float16";
    default: return "bfloat16";
  }
}

enum class Elem { F32, F16, BF16, I32, U32, U8 };  // U8: fp-mode scale bytes

inline Elem elem_of(ActType t) {
  return t == ActType::F32 ? Elem::F32 : t == ActType::F16 ? Elem::F16 : Elem::BF16;
}

inline size_t elem_bytes(Elem e) {
  if (e == Elem::U8) return 1;
  return (e == Elem::F16 || e == Elem::BF16) ? 2 : 4;
}

inline const char* elem_name(Elem e) {
  switch (e) {
    case Elem::F32: return "float32";
    case Elem::F16: return "float16";
    case Elem::BF16: return "bfloat16";
    case Elem::I32: return "int32";
    case Elem::U8: return "uint8";
    default: return "uint32";
  }
}

enum class Dir { In, Out };

struct BufferArg {
  const char* name;
  int index;      // [[buffer(index)]]
  Dir dir;
  Elem elem;      // what the kernel reads or writes there
  size_t count;   // elements; 0: this launch never touches the slot ...
  int stand_in;   // ... and the buffer at this index is bound instead
                  // (always a freshly allocated output, so its offset is 0
                  // and it is aligned for any element type); -1 if used
  bool used() const { return count > 0; }
};

// "what the kernel expects" vs "what it was given", for error messages.
inline std::string describe(const BufferArg& a) {
  return std::string(a.name) + " (buffer " + std::to_string(a.index) + ", " +
         elem_name(a.elem) + "[" + std::to_string(a.count) + "])";
}

struct Launch {
  std::string kernel;
  uint32_t grid[3];           // threadgroups per grid
  uint32_t group[3];          // threads per threadgroup
  size_t threadgroup_bytes;   // length of [[threadgroup(0)]], 0 if none
  std::vector<BufferArg> buffers;  // in index order, 0 .. n-1
  int params_index;           // the constant parameter block's index

  uint32_t threads_per_group() const { return group[0] * group[1] * group[2]; }
};

}  // namespace mixbits::metal_host
