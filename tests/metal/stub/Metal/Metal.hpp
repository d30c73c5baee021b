// Declarations standing in for metal-cpp (Apple's Metal C++ headers, absent
// on Linux) so that cpp/*/metal.cpp can be type-checked against MLX's real
// Metal backend headers with g++ -fsyntax-only. Only what those headers and
// the eval_gpu sources touch; nothing here is ever linked or run.
#pragma once
#include <cstddef>
#include <cstdint>

namespace NS {
using UInteger = unsigned long;
enum StringEncoding { UTF8StringEncoding = 4, ASCIIStringEncoding = 1 };
struct String {
  static String* string(const char*, StringEncoding);
  const char* utf8String() const;
};
struct AutoreleasePool {};
template <class T>
struct SharedPtr {
  T* get() const;
  T* operator->() const;
  explicit operator bool() const;
};
}  // namespace NS

namespace MTL {
struct Size {
  Size(NS::UInteger w, NS::UInteger h, NS::UInteger d);
  NS::UInteger width, height, depth;
};
enum DataType { DataTypeNone };
struct Resource {};
struct Allocation {};
struct Buffer : Resource {};
struct Library {};
struct Function {};
struct LinkedFunctions {};
struct Fence {};
struct ResidencySet {};
struct Device {};
struct CommandQueue {
  void setLabel(NS::String*);
};
struct CommandBuffer {
  NS::String* label();
  void setLabel(NS::String*);
};
struct ComputePipelineState {
  NS::UInteger maxTotalThreadsPerThreadgroup() const;
};
struct ComputeCommandEncoder {
  void setComputePipelineState(ComputePipelineState*);
  void setBytes(const void*, NS::UInteger, NS::UInteger);
  void setThreadgroupMemoryLength(NS::UInteger, NS::UInteger);
};
}  // namespace MTL
