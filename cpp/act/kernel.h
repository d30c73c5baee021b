// Backend-neutral pieces of the fused SwiGLU activation, y = silu(g) * u
// = g * u / (1 + e^-g). MLX's CPU evaluates it as separate scalar
// sigmoid/multiply passes (~70 ms per SmolLM2 MLP on 2048 tokens, more
// than the three matmuls); one vectorized pass is memory-bound.
#pragma once
#include <cstdint>
#include <vector>

#include "common/backend.h"
namespace mixbits {

constexpr BackendSet kActBackends = backend_set({Backend::Ref, Backend::Avx2, Backend::Neon});

// y[i] = silu(g[i]) * u[i] for i in [0, n).
using SwigluFn = void (*)(const float* g, const float* u, float* y, int64_t n);
// The vjp for the cotangent dy, both inputs in one pass:
//   dg[i] = dy[i] u[i] s (1 + g[i] (1 - s)),  du[i] = dy[i] g[i] s,
// with s = sigmoid(g[i]) (silu'(g) = s (1 + g (1 - s))).
using SwigluVjpFn = void (*)(const float* g, const float* u, const float* dy,
                             float* dg, float* du, int64_t n);

void swiglu_ref(const float* g, const float* u, float* y, int64_t n);
void swiglu_vjp_ref(const float* g, const float* u, const float* dy, float* dg,
                    float* du, int64_t n);
#if defined(MIXBITS_HAVE_AVX2)
void swiglu_avx2(const float* g, const float* u, float* y, int64_t n);
void swiglu_vjp_avx2(const float* g, const float* u, const float* dy, float* dg,
                     float* du, int64_t n);
#endif
#if defined(MIXBITS_HAVE_NEON)
void swiglu_neon(const float* g, const float* u, float* y, int64_t n);
void swiglu_vjp_neon(const float* g, const float* u, const float* dy, float* dg,
                     float* du, int64_t n);
#endif

SwigluFn select_swiglu(Backend requested);
SwigluVjpFn select_swiglu_vjp(Backend requested);
std::vector<Backend> available_act_backends();

}  // namespace mixbits
