// Runs what an aarch64 build's CausalAttention, its vjp and Swiglu nodes
// run on the CPU: the attention driver (attn/driver.cpp) with
// select_attn(neon)'s kernels, and select_swiglu(neon) / select_swiglu_vjp
// over each case's buffers, on cases that tests/test_attn_neon_emulated.py
// writes from MLX arrays (K and V as the node holds them: a cache buffer's
// rows, of which a decode step reads a prefix). Built for aarch64, run
// under qemu-user.
//
//   attn_harness CASES OUT
//
// CASES: "MBA1", u32 count, then per case an i32 op:
//   0 attention: i32 dtype (DType), B, H, Hk, T, S, D, rows (the k / v
//     buffers' rows per head, >= S); f32 scale; q [B, H, T, D], k and v
//     [B, Hk, rows, D] in that dtype.
//   1 attention vjp (float32, rows = S): as 0, then dout [B, H, T, D].
//   2 swiglu: i32 n; g, u float32 [n].
//   3 swiglu vjp: as 2, then dy [n].
// OUT gets each case's outputs as float32: out (widened); dq, dk, dv; y;
// dg, du. Exits 3 if a neon selection does not give the NEON kernels.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "act/kernel.h"
#include "attn/kernel.h"
#include "common/half.h"

#include "harness_io.h"

using namespace mixbits;

const char* const kHarnessName = "attn_harness";

namespace {

std::vector<float> take_f32(Reader& r, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  std::memcpy(v.data(), r.take(size_t(n) * 4), size_t(n) * 4);
  return v;
}

// A copy, aligned for its elements as MLX's buffers are.
std::vector<char> take_bytes(Reader& r, size_t n) {
  const char* p = r.take(n);
  return std::vector<char>(p, p + n);
}

void put(std::FILE* f, const std::vector<float>& v) {
  if (std::fwrite(v.data(), 4, v.size(), f) != v.size()) die("write failed");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) die("usage: attn_harness CASES OUT");
  const AttnKernels kern = select_attn(Backend::Neon);
  if (kern.gemm != attn_gemm_neon || kern.gemm_nt != attn_gemm_nt_neon ||
      kern.exp_row != attn_exp_row_neon || kern.gemm_tn_acc != attn_gemm_tn_acc_neon ||
      select_swiglu(Backend::Neon) != swiglu_neon ||
      select_swiglu_vjp(Backend::Neon) != swiglu_vjp_neon || select_attn(Backend::Auto).gemm != attn_gemm_neon)
    die("neon (or auto) does not select the NEON kernels", 3);
  Reader r = read_case_file(argv[1], "MBA1");
  const int32_t count = r.i32();
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!out) die("cannot open the output file");
  for (int32_t c = 0; c < count; ++c) {
    const int32_t op = r.i32();
    if (op == 0 || op == 1) {
      const DType dt = DType(r.i32());
      AttnShape sh{};
      sh.B = r.i32(), sh.H = r.i32(), sh.Hk = r.i32(), sh.T = r.i32(), sh.S = r.i32(), sh.D = r.i32();
      sh.rows = r.i32();
      float scale;
      std::memcpy(&scale, r.take(4), 4);
      const size_t es = dtype_bytes(dt);
      const int64_t nq = sh.B * sh.H * sh.T * sh.D, nkv = sh.B * sh.Hk * sh.kv_rows() * sh.D;
      if (op == 1 && (dt != DType::f32 || sh.kv_rows() != sh.S)) die("a vjp case is float32 with rows = S");
      const std::vector<char> q = take_bytes(r, nq * es), k = take_bytes(r, nkv * es),
                              v = take_bytes(r, nkv * es);
      if (op == 0) {
        std::vector<char> o(static_cast<size_t>(nq) * es);
        causal_attention_cpu(kern, sh, q.data(), k.data(), v.data(), dt, scale, o.data());
        std::vector<float> wide(static_cast<size_t>(nq));
        for (int64_t i = 0; i < nq; ++i) wide[size_t(i)] = load_as_f32(o.data(), i, dt);
        put(out, wide);
      } else {
        const std::vector<float> dout = take_f32(r, nq);
        std::vector<float> dq(static_cast<size_t>(nq)), dk(static_cast<size_t>(nkv)),
            dv(static_cast<size_t>(nkv)), part(static_cast<size_t>(attn_vjp_scratch_floats(sh)));
        causal_attention_vjp_cpu(kern, sh, reinterpret_cast<const float*>(q.data()),
                                 reinterpret_cast<const float*>(k.data()),
                                 reinterpret_cast<const float*>(v.data()), dout.data(), scale,
                                 dq.data(), dk.data(), dv.data(), part.data());
        put(out, dq), put(out, dk), put(out, dv);
      }
    } else if (op == 2 || op == 3) {
      const int32_t n = r.i32();
      const std::vector<float> g = take_f32(r, n), u = take_f32(r, n);
      if (op == 2) {
        std::vector<float> y(static_cast<size_t>(n));
        select_swiglu(Backend::Neon)(g.data(), u.data(), y.data(), n);
        put(out, y);
      } else {
        const std::vector<float> dy = take_f32(r, n);
        std::vector<float> dg(static_cast<size_t>(n)), du(static_cast<size_t>(n));
        select_swiglu_vjp(Backend::Neon)(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
        put(out, dg), put(out, du);
      }
    } else {
      die("unknown op in the case file");
    }
  }
  if (r.at != r.buf.size()) die("trailing bytes in the case file");
  std::fclose(out);
  return 0;
}
