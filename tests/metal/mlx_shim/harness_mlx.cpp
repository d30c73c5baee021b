// C entry points (ctypes, mlx_emu.py) that launch MLX's own quantized
// kernels (emu_mlx.cpp) on the SIMT emulator with the kernel name, grid and
// threadgroup that MLX's host code (mlx/backend/metal/quantized.cpp) picks;
// the choice itself is transcribed in mlx_emu.py. Buffers are bound as
// MLX binds them for an unbatched product: w, scales, biases, x, y, K, N
// (and M), nothing at the batch slots. Inputs end at a guard page (an
// over-read faults), the output and the threadgroup tiles start as NaN and
// an output element never written is an error, as in harness.cpp.
#include "harness_core.h"

namespace {

using QmvFn = void(const uint32_t*, const half*, const half*, const half*, half*, const int&,
                   const int&, const int&, const int*, const int64_t*, const int&, const int*,
                   const int64_t*, const int64_t*, const int64_t*, uint3, uint, uint);
using QmvWideFn = void(const uint32_t*, const half*, const half*, const half*, half*,
                       const int&, const int&, const int&, const int&, const int*,
                       const int64_t*, const int&, const int*, const int64_t*,
                       const int64_t*, const int64_t*, uint3, uint, uint);
using QmmTImplFn = void(const uint32_t*, const half*, const half*, const half*, half*, half*,
                        half*, const int&, const int&, const int&, const int&, uint3, uint,
                        uint, uint);
using QmmTSplitFn = void(const uint32_t*, const half*, const half*, const half*, float*, half*,
                         half*, const int&, const int&, const int&, const int&, uint3, uint,
                         uint, uint);

// The five buffers of one product, guarded; y poisoned.
struct Product {
  Guarded w, s, b, x, y;
  Product(int M, int N, int K, const void* wq, const void* sc, const void* bi, const void* xv)
      : w(size_t(N) * K / 2, wq), s(size_t(N) * (K / 64) * 2, sc),
        b(size_t(N) * (K / 64) * 2, bi), x(size_t(M) * K * 2, xv), y(size_t(M) * N * 2, 16) {
    y.fill_poison(Elem::F16);
  }
  void finish(void* out) {
    if (!y.canary_intact()) throw std::runtime_error("harness: MLX kernel wrote past y");
    if (const size_t n = y.count_poison(Elem::F16))
      throw std::runtime_error("harness: " + std::to_string(n) + " elements of y never written");
    std::memcpy(out, y.data(), y.bytes());
  }
};

simt::Options named(const simt::Options& o, const char* name) {
  simt::Options r = o;
  r.label = name;
  return r;
}

}  // namespace

extern "C" {

// MLX's GEMV kernels for y[M, N] = x[M, K] W^T, W 4-bit g64 [N, K], float16.
// wide: the kernel is affine_qmv_wide (takes M); else affine_qmv(_fast).
int mbmlx_qmv(const char* name, int wide, int M, int N, int K, const uint32_t grid[3],
              const uint32_t group[3], const void* wq, const void* scales, const void* biases,
              const void* x, void* out, int order, uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    Product p(M, N, K, wq, scales, biases, x);
    const int zero = 0;
    const simt::Options o = named(options(order, seed), name);
    if (wide) {
      auto* fn = simt::find_kernel<QmvWideFn>(name);
      simt::dispatch_threadgroups(dim(grid), dim(group), [&](const simt::ThreadIds& t) {
        fn(p.w.as<uint32_t>(), p.s.as<half>(), p.b.as<half>(), p.x.as<half>(), p.y.as<half>(),
           K, N, M, zero, nullptr, nullptr, zero, nullptr, nullptr, nullptr, nullptr,
           u3(t.threadgroup_position_in_grid), t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup);
      }, o);
    } else {
      auto* fn = simt::find_kernel<QmvFn>(name);
      simt::dispatch_threadgroups(dim(grid), dim(group), [&](const simt::ThreadIds& t) {
        fn(p.w.as<uint32_t>(), p.s.as<half>(), p.b.as<half>(), p.x.as<half>(), p.y.as<half>(),
           K, N, zero, nullptr, nullptr, zero, nullptr, nullptr, nullptr, nullptr,
           u3(t.threadgroup_position_in_grid), t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup);
      }, o);
    }
    p.finish(out);
  }, err, errlen);
}

// MLX's tiled qmm_t (BM = BN = BK = 32, 2 x 2 simdgroups): its body
// qmm_t_impl with the two threadgroup tiles affine_qmm_t would declare,
// Xs[BM][BK + 8] and Ws[BN][BK + 8] halves, here one buffer each.
int mbmlx_qmm_t(const char* name, int M, int N, int K, const uint32_t grid[3],
                const uint32_t group[3], const void* wq, const void* scales,
                const void* biases, const void* x, void* out, int order, uint64_t seed,
                char* err, int errlen) {
  return guarded_call([&] {
    Product p(M, N, K, wq, scales, biases, x);
    constexpr size_t kTile = 32 * (32 + 8);
    Guarded xs(kTile * 2), ws(kTile * 2);
    xs.threadgroup_space();
    ws.threadgroup_space();
    simt::Options o = named(options(order, seed), name);
    o.group_start = [&](const simt::Dim3&) {
      xs.fill_bytes(0xff);  // float16 NaN
      ws.fill_bytes(0xff);
    };
    auto* fn = simt::find_kernel<QmmTImplFn>(name);
    simt::dispatch_threadgroups(dim(grid), dim(group), [&](const simt::ThreadIds& t) {
      fn(p.w.as<uint32_t>(), p.s.as<half>(), p.b.as<half>(), p.x.as<half>(), p.y.as<half>(),
         xs.as<half>(), ws.as<half>(), K, N, M, K, u3(t.threadgroup_position_in_grid),
         t.thread_index_in_threadgroup, t.simdgroup_index_in_threadgroup,
         t.thread_index_in_simdgroup);
    }, o);
    p.finish(out);
  }, err, errlen);
}

// MLX's split-K qmm_t (affine_qmm_t_splitk): grid.z = split_k partitions of
// K, each writing float partials [M, N] at partition * M * N of `partial`
// ([split_k, M, N], returned; MLX then sums them with its strided-reduce
// kernel, which is not emulated). The wrapper's pointer offsets per tid.z
// are applied here: x += k0, w += k0 / 2 bytes, scales/biases += k0 / 64,
// y += tid.z * M * N, with k0 = tid.z * (K / split_k).
int mbmlx_qmm_t_splitk(const char* name, int M, int N, int K, int split_k,
                       const uint32_t grid[3], const uint32_t group[3], const void* wq,
                       const void* scales, const void* biases, const void* x, void* partial,
                       int order, uint64_t seed, char* err, int errlen) {
  return guarded_call([&] {
    if (split_k < 1 || K % (split_k * 64) != 0 || grid[2] != uint32_t(split_k))
      throw std::runtime_error("harness: split_k must divide K in whole groups, = grid.z");
    Product p(M, N, K, wq, scales, biases, x);
    Guarded part(size_t(split_k) * M * N * 4, 16);
    part.fill_poison(Elem::F32);
    constexpr size_t kTile = 32 * (32 + 8);
    Guarded xs(kTile * 2), ws(kTile * 2);
    xs.threadgroup_space();
    ws.threadgroup_space();
    simt::Options o = named(options(order, seed), name);
    o.group_start = [&](const simt::Dim3&) {
      xs.fill_bytes(0xff);
      ws.fill_bytes(0xff);
    };
    const int kpart = K / split_k;
    auto* fn = simt::find_kernel<QmmTSplitFn>(name);
    simt::dispatch_threadgroups(dim(grid), dim(group), [&](const simt::ThreadIds& t) {
      const int z = int(t.threadgroup_position_in_grid.z), k0 = z * kpart;
      fn(reinterpret_cast<const uint32_t*>(p.w.as<uint8_t>() + k0 / 2), p.s.as<half>() + k0 / 64,
         p.b.as<half>() + k0 / 64, p.x.as<half>() + k0, part.as<float>() + size_t(z) * M * N,
         xs.as<half>(), ws.as<half>(), K, N, M, kpart, u3(t.threadgroup_position_in_grid),
         t.thread_index_in_threadgroup, t.simdgroup_index_in_threadgroup,
         t.thread_index_in_simdgroup);
    }, o);
    if (!part.canary_intact()) throw std::runtime_error("harness: MLX kernel wrote past y");
    if (const size_t n = part.count_poison(Elem::F32))
      throw std::runtime_error("harness: " + std::to_string(n) + " partials never written");
    std::memcpy(partial, part.data(), part.bytes());
  }, err, errlen);
}

}  // extern "C"
