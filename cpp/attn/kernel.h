// Backend-neutral pieces of the causal attention kernel (CPU). No MLX types.
//
// Attention for one (batch, KV head, block of query positions) is two small
// GEMMs around a row softmax:
//   S = (scale Q) K^T      rows x keys   (K^T packed once per KV head)
//   P = softmax_causal(S)  in place, masked keys set to 0
//   O = P V / rowsum(P)    rows x D
// where "rows" stacks the query block of every query head that shares the
// KV head (grouped-query attention), so K and V are read once per group.
// Every backend supplies the GEMM and the row exp; the driver (driver.cpp) is
// shared, so backends differ only in arithmetic order.
#pragma once
#include "common/half.h"
#include <cstdint>
#include <vector>

#include "common/backend.h"
namespace mixbits {

constexpr BackendSet kAttnBackends = backend_set({Backend::Ref, Backend::Avx2, Backend::Neon});

// C[m x n] = A[m x k] . B[k x n]; row-major, leading dimensions in
// elements. B is float32, float16 or bfloat16 (bt), widened as it is read:
// V straight from a half-precision cache, with no widened copy to write
// and read back.
using AttnGemmFn = void (*)(const float* a, int64_t lda, const void* b, DType bt,
                            int64_t ldb, float* c, int64_t ldc, int64_t m,
                            int64_t n, int64_t k);
// x[0..n) = e^(x - max); returns the sum of the results.
using AttnExpRowFn = float (*)(float* x, int64_t n, float max);
// C[m x n] += A^T . B with A stored k x m (lda), B k x n: the backward's
// key-side products dV += P^T dO and dK += dS^T Q, read straight from the
// row-major P / dS without transposing them.
using AttnGemmTnAccFn = void (*)(const float* a, int64_t lda, const float* b,
                                 int64_t ldb, float* c, int64_t ldc, int64_t m,
                                 int64_t n, int64_t k);

// C[m x n] = A . B^T with B stored n x k (ldb; type bt as above): a decode
// step's scores straight from the key rows, where transposing K for the
// plain GEMM would cost as much as the product itself (one query per head).
using AttnGemmNtFn = void (*)(const float* a, int64_t lda, const void* b, DType bt,
                              int64_t ldb, float* c, int64_t ldc, int64_t m,
                              int64_t n, int64_t k);

struct AttnKernels {
  AttnGemmFn gemm;
  AttnExpRowFn exp_row;
  AttnGemmTnAccFn gemm_tn_acc;
  AttnGemmNtFn gemm_nt;
};

void attn_gemm_ref(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                   float* c, int64_t ldc, int64_t m, int64_t n, int64_t k);
float attn_exp_row_ref(float* x, int64_t n, float max);
void attn_gemm_nt_ref(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k);
void attn_gemm_tn_acc_ref(const float* a, int64_t lda, const float* b,
                          int64_t ldb, float* c, int64_t ldc, int64_t m,
                          int64_t n, int64_t k);
#if defined(MIXBITS_HAVE_AVX2)
void attn_gemm_avx2(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k);
float attn_exp_row_avx2(float* x, int64_t n, float max);
void attn_gemm_nt_avx2(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                       float* c, int64_t ldc, int64_t m, int64_t n, int64_t k);
void attn_gemm_tn_acc_avx2(const float* a, int64_t lda, const float* b,
                           int64_t ldb, float* c, int64_t ldc, int64_t m,
                           int64_t n, int64_t k);
#endif
#if defined(MIXBITS_HAVE_NEON)
void attn_gemm_neon(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k);
float attn_exp_row_neon(float* x, int64_t n, float max);
void attn_gemm_nt_neon(const float* a, int64_t lda, const void* b, DType bt, int64_t ldb,
                       float* c, int64_t ldc, int64_t m, int64_t n, int64_t k);
void attn_gemm_tn_acc_neon(const float* a, int64_t lda, const float* b,
                           int64_t ldb, float* c, int64_t ldc, int64_t m,
                           int64_t n, int64_t k);
#endif

// fn(E{}, b as E's element type) for B's element type bt: a SIMD backend's
// GEMMs are templates over its element loaders (F32, F16, BF16: how that
// ISA widens each type), instantiated once per type here.
template <class F32, class F16, class BF16, class Fn>
void with_b_type(const void* b, DType bt, Fn&& fn) {
  switch (bt) {
    case DType::f16: return fn(F16{}, static_cast<const uint16_t*>(b));
    case DType::bf16: return fn(BF16{}, static_cast<const uint16_t*>(b));
    default: return fn(F32{}, static_cast<const float*>(b));
  }
}

// max(x[0..n)), n >= 1, in 8 independent lanes: a single running maximum is
// a serial chain of 4-cycle maxss, ~5 ms of a 1024-token backward; the
// lanes let the compiler vectorize. Same NaN behaviour as the plain loop
// (a NaN never replaces a lane's maximum; the row's exp carries it).
inline float attn_row_max(const float* x, int64_t n) {
  float lane[8];
  for (int l = 0; l < 8; ++l) lane[l] = x[0];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) lane[l] = lane[l] < x[j + l] ? x[j + l] : lane[l];
  for (; j < n; ++j) lane[0] = lane[0] < x[j] ? x[j] : lane[0];
  float m = lane[0];
  for (int l = 1; l < 8; ++l) m = m < lane[l] ? lane[l] : m;
  return m;
}

// The kernels for `requested` on this CPU; throws if it is forced but
// unavailable. Auto picks the fastest available.
AttnKernels select_attn(Backend requested);
std::vector<Backend> available_attn_backends();

// Shapes of one call: q [B, H, T, D], k and v [B, Hk, S, D], S >= T; query
// t sees keys 0 .. t + (S - T) (the queries are the last T positions).
// `rows`, when set, is the keys' row count per head in the k/v buffers
// (>= S): the call then reads only their first S rows (a decode step's
// filled prefix of a fixed-capacity cache buffer).
struct AttnShape {
  int64_t B, H, Hk, T, S, D;
  int64_t rows = 0;  // 0: S
  int64_t kv_rows() const { return rows ? rows : S; }
};

// out [B, H, T, D] for contiguous q, k, v of type `dt` (out the same):
// float16 / bfloat16 inputs are widened as the kernel copies them (K^T, the
// scaled queries, V) and the float32 result rounded once on the store.
void causal_attention_cpu(const AttnKernels& kern, const AttnShape& sh,
                          const void* q, const void* k, const void* v,
                          DType dt, float scale, void* out);

// The vjp of causal_attention_cpu: dq [B, H, T, D], dk and dv [B, Hk, S, D]
// from contiguous float32 q, k, v and the output cotangent dout [B, H, T, D]
// (driver.cpp says how the work is split). The split and the order of every
// sum depend on the shapes only, so results do not depend on the thread
// count.
void causal_attention_vjp_cpu(const AttnKernels& kern, const AttnShape& sh,
                              const float* q, const float* k, const float* v,
                              const float* dout, float scale, float* dq,
                              float* dk, float* dv, float* partials);
// The floats of scratch the vjp's `partials` must hold (per-chunk dK, dV).
int64_t attn_vjp_scratch_floats(const AttnShape& sh);

}  // namespace mixbits
