// RepackedQMatmul: argument checks, graph node, and the CPU evaluation on
// the row-interleaved layout (repack.h); the eager repack / unrepack of a
// segment.
#include "qmatmul_int8/repacked_qmatmul.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "common/cpu_task.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "qmatmul_int8/kernel.h"
#include "qmatmul_int8/repack.h"
#include "mlx/allocator.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("repacked qmatmul: " + msg);
}

// The repacked kernel table for (act, backend) on this CPU, or null where
// calls take the un-repacked path (see the class comment).
const RTable* repacked_table(Activations act, Backend backend) {
  if (activation_code_bits(act) == 0) return nullptr;
  return select_repacked(activation_code_bits(act) == 16, backend);
}

}  // namespace

bool repacked_kernels_available() {
  return repacked_table(Activations::Int8, Backend::Auto) != nullptr;
}

namespace {

mx::array from_bytes(std::vector<char>&& bytes, mx::Shape shape, mx::Dtype dtype) {
  auto* owned = new std::vector<char>(std::move(bytes));
  return mx::array(owned->data(), std::move(shape), dtype,
                   [owned](void*) { delete owned; });
}

// An array of `shape` whose data starts on a 64-byte line, its nbytes
// written by fill(dst): a view (a slice, which MLX evaluates by sharing
// the buffer) into a buffer one line longer. A repacked word is 64 bytes,
// one line, loaded whole by the VNNI kernels; MLX's CPU allocator hands out
// buffers 8 bytes past a 16-byte boundary (a size header), so every such
// load straddled two lines. One thread, 4096^2, warm, alternating
// (bench/README, "blocks on 64-byte lines"): VNNI 4-bit M = 1 0.216-0.246
// -> 0.170-0.227 ms, 8-bit 5-10% faster, the AVX2 row 3-7%; weights read
// from DRAM: no change. The scales and biases are aligned alike. A buffer
// that is already aligned (MLX's Metal allocator's pages) gives an offset
// of zero.
template <class Fill>
mx::array line_aligned(size_t nbytes, mx::Shape shape, mx::Dtype dtype, Fill&& fill) {
  constexpr size_t kLine = 64;
  const size_t item = mx::size_of(dtype);
  const int64_t n = int64_t(nbytes / item), pad = int64_t(kLine / item);
  mx::array flat(mx::allocator::malloc(nbytes + kLine), mx::Shape{int(n + pad)}, dtype);
  char* base = flat.data<char>();
  const size_t skip = (kLine - reinterpret_cast<uintptr_t>(base) % kLine) % kLine;
  if (skip % item) throw std::runtime_error("repack: buffer not aligned to its element size");
  fill(base + skip);
  const int off = int(skip / item);
  const mx::Device cpu(mx::Device::cpu);
  mx::array view = mx::reshape(mx::slice(flat, {off}, {int(off + n)}, cpu), std::move(shape), cpu);
  mx::eval(view);
  return view;
}

}  // namespace

void check_repacked(const mx::array& x, const std::optional<mx::array>& perm,
                    const std::vector<mx::array>& packed_r, const std::vector<SegSpec>& segs,
                    int n, Activations act, const mx::Shape& batch) {
  if (segs.empty()) fail("at least one segment is required");
  if (!activations_valid(act)) fail(activations_refusal(act));
  if (packed_r.size() != 3 * segs.size())
    fail("expected 3 arrays (wq, scales, biases) per segment");
  if (n <= 0) fail("n (output rows) must be positive, got " + std::to_string(n));
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (!is_float_dtype(x.dtype())) fail("x must be float32, float16 or bfloat16");
  const int64_t NB = repack_blocks(n);
  const mx::Dtype sdt = packed_r[1].dtype();
  int64_t K = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const SegSpec& sg = segs[i];
    const std::string tag = "segment " + std::to_string(i) + ": ";
    if (!repack_supports_bits(sg.bits))
      fail(tag + "bits " + std::to_string(sg.bits) + " have no repacked layout (2, 3, 4, 5, 6, 8 do)");
    if (sg.group_size != 32 && sg.group_size != 64 && sg.group_size != 128)
      fail(tag + "group_size must be 32, 64 or 128");
    if (sg.k <= 0 || sg.k % sg.group_size != 0)
      fail(tag + "column count is not a positive multiple of group_size");
    mx::Shape wshape = batch, gshape = batch;
    for (int d : {int(NB), int(int64_t(sg.k) * sg.bits / 32), kRepackRows}) wshape.push_back(d);
    for (int d : {int(NB), sg.k / sg.group_size, kRepackRows}) gshape.push_back(d);
    const mx::array& wq = packed_r[3 * i];
    if (wq.dtype() != mx::uint32 || wq.shape() != wshape)
      fail(tag + "wq must be uint32 of shape (" + (batch.empty() ? "" : "experts, ") +
           "blocks, words, 16), got " + shape_str(wq));
    for (int j = 1; j < 3; ++j) {
      const mx::array& a = packed_r[3 * i + j];
      if (a.dtype() != sdt || !is_float_dtype(a.dtype()) || a.shape() != gshape)
        fail(tag + (j == 1 ? "scales" : "biases") + " must be (" + (batch.empty() ? "" : "experts, ") +
             "blocks, groups, 16) in segment 0's float dtype, got " + shape_str(a));
    }
    K += sg.k;
  }
  if (x.shape(-1) != K)
    fail("x has " + std::to_string(x.shape(-1)) + " input features but the segments cover K=" +
         std::to_string(K));
  if (perm && ((perm->dtype() != mx::int32 && perm->dtype() != mx::uint32) || perm->ndim() != 1 ||
               perm->shape(0) != K))
    fail("perm must be int32 or uint32 of shape (K,)");
}

mx::Stream repacked_stream(mx::StreamOrDevice s, Backend backend, Activations act) {
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::gpu)
    fail("repacked weights are a CPU layout; unrepack the layer to run it on the GPU");
  select_qmm(backend);
  select_qmm_int(act, backend);
  return stream;
}

mx::array repacked_qmatmul(const mx::array& x, const std::optional<mx::array>& perm,
                           const std::vector<mx::array>& packed_r,
                           const std::vector<SegSpec>& segs, int n, Backend backend,
                           mx::StreamOrDevice s, Activations act) {
  check_repacked(x, perm, packed_r, segs, n, act);
  auto stream = repacked_stream(s, backend, act);
  // An attention output transposed and reshaped back (o_proj's x) is read
  // from the array it views, and a norm or SwiGLU node before x is run
  // inside this one.
  const mx::array src = through_views(x);
  std::vector<mx::array> inputs;
  auto prologue = take_input(src, inputs);
  if (perm) inputs.push_back(*perm);
  for (const auto& a : packed_r) inputs.push_back(a);
  mx::Shape out_shape = x.shape();
  out_shape.back() = n;
  return mx::array(out_shape, x.dtype(),
                   std::make_shared<RepackedQMatmul>(stream, segs, bool(perm), n, backend, act,
                                                     viewed_shape(x, src), std::move(prologue)),
                   std::move(inputs));
}

std::vector<mx::array> repacked_qmatmul_group(const mx::array& x,
                                              const std::vector<RepackedMember>& members,
                                              Backend backend, mx::StreamOrDevice s,
                                              Activations act) {
  if (members.empty()) fail("a group needs at least one weight");
  for (const auto& m : members) check_repacked(x, std::nullopt, m.packed_r, m.segs, m.n, act);
  auto stream = repacked_stream(s, backend, act);
  const mx::array src = through_views(x);
  std::vector<mx::array> inputs;
  auto prologue = take_input(src, inputs);  // the norm before q/k/v or gate/up
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  std::vector<RepackedQMatmulGroup::Member> specs;
  for (const auto& m : members) {
    for (const auto& a : m.packed_r) inputs.push_back(a);
    mx::Shape out_shape = x.shape();
    out_shape.back() = m.n;
    shapes.push_back(out_shape);
    dtypes.push_back(x.dtype());
    specs.push_back({m.segs, m.n});
  }
  return mx::array::make_arrays(
      std::move(shapes), std::move(dtypes),
      std::make_shared<RepackedQMatmulGroup>(stream, std::move(specs), backend, act,
                                             viewed_shape(x, src), std::move(prologue)),
      std::move(inputs));
}

std::vector<mx::Shape> RepackedQMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = read_shape(inputs[0], prologue_, viewed_, "repacked_qmatmul");
  s.back() = n_;
  return {s};
}

bool RepackedWeightPrimitive::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RepackedWeightPrimitive&>(other);
  return segs_ == o.segs_ && has_perm_ == o.has_perm_ && n_ == o.n_ && backend_ == o.backend_ &&
         act_ == o.act_ && viewed_ == o.viewed_ && same_prologue(prologue_, o.prologue_);
}

RepackedView repacked_view(const std::vector<SegSpec>& segs, int N, DType sdtype,
                           const std::vector<const void*>& arrays, int64_t matrix) {
  RepackedView v;
  v.shape.N = N;
  v.shape.sdtype = sdtype;
  v.shape.repacked = true;
  const int64_t NB = repack_blocks(N);
  const size_t sbytes = dtype_bytes(sdtype);
  int k0 = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const int words = int(int64_t(segs[i].k) * segs[i].bits / 32);
    const int ngroups = segs[i].k / segs[i].group_size;
    const int64_t wstep = matrix * NB * words * kRepackRows;
    const int64_t sstep = matrix * NB * ngroups * kRepackRows * int64_t(sbytes);
    v.rsegs.push_back({static_cast<const uint32_t*>(arrays[3 * i]) + wstep,
                       static_cast<const char*>(arrays[3 * i + 1]) + sstep,
                       static_cast<const char*>(arrays[3 * i + 2]) + sstep, sdtype, words, ngroups});
    v.shape.segs.push_back({segs[i].bits, segs[i].group_size, k0, segs[i].k, v.rsegs[i].wq,
                            v.rsegs[i].scales, v.rsegs[i].biases});
    k0 += segs[i].k;
  }
  v.shape.K = k0;
  return v;
}

void run_repacked(const RepackedKernels& k, QmmPath path, const float* xf, int M,
                  const RepackedView& v, float* y) {
  const QMatView& shape = v.shape;
  const std::vector<RSeg>& rsegs = v.rsegs;
  const int N = shape.N;
  if (path == QmmPath::Int && k.table) {
    if (activation_code_bits(k.act) == 8)
      return repacked_int_run<int8_t>(*k.table, xf, M, shape, rsegs.data(), y);
    return repacked_int_run<int16_t>(*k.table, xf, M, shape, rsegs.data(), y);
  }
  // The float kernel reads the blocks itself (prefill on AVX-512: its
  // panel packers), bit for bit what it gives on MLX's layout.
  if (path == QmmPath::Float && k.fn_r.run && M > k.fn_r.min_m && k.fn_r.reads(shape))
    return k.fn_r.run(xf, M, shape, y);
  // MLX's layout in a temporary, then what MixedQMatmul runs. The
  // temporaries are written in full before they are read: no zero fill
  // (at a prompt's 64 rows the un-repack is a tenth to a third of the
  // call), and 3-, 5-, 6-bit words are de-interleaved into a scratch that
  // merge_planes reads, not copied again.
  const size_t sbytes = dtype_bytes(shape.sdtype);
  const size_t nseg = rsegs.size();
  std::vector<std::unique_ptr<uint32_t[]>> wq(nseg);
  std::vector<std::unique_ptr<char[]>> sc(nseg), bi(nseg);
  QMatView w = shape;
  w.repacked = false;
  for (size_t i = 0; i < nseg; ++i) {
    const RSeg& r = rsegs[i];
    const size_t nw = size_t(N) * r.words, ns = size_t(N) * r.ngroups * sbytes;
    wq[i].reset(new uint32_t[nw]);
    sc[i].reset(new char[ns]);
    bi[i].reset(new char[ns]);
    if (repack_splits(shape.segs[i].bits)) {
      std::unique_ptr<uint32_t[]> split(new uint32_t[nw]);
      deinterleave_rows(r.wq, N, r.words, 4, split.get());
      merge_planes(shape.segs[i].bits, split.get(), int64_t(nw), wq[i].get());
    } else {
      deinterleave_rows(r.wq, N, r.words, 4, wq[i].get());
    }
    deinterleave_rows(r.scales, N, r.ngroups, sbytes, sc[i].get());
    deinterleave_rows(r.biases, N, r.ngroups, sbytes, bi[i].get());
    w.segs[i].wq = wq[i].get();
    w.segs[i].scales = sc[i].get();
    w.segs[i].biases = bi[i].get();
  }
  if (path == QmmPath::Int) return run_int_rows(k.fn_int, xf, M, w, y);
  (path == QmmPath::IeeeRef ? qmm_ref_run : k.fn)(xf, M, w, y);
}

void refuse_repacked_grad() {
  throw std::invalid_argument(
      "repacked qmatmul: a repacked weight has no gradient; unrepack the layer first");
}

void refuse_repacked_gpu() {
  throw std::runtime_error("repacked qmatmul: repacked weights are a CPU layout");
}

RepackedKernels kernels_for(Activations act, Backend backend) {
  return {act, select_qmm(backend), select_qmm_int(act, backend), repacked_table(act, backend),
          select_qmm_repacked(backend)};
}

namespace {

// What one repacked node computes, inside the dispatched task: y = x · Wᵀ
// for W's 3 arrays per segment at `packed` (row-interleaved), into `out`.
void eval_repacked(const RepackedKernels& k, const mx::array& x, const int32_t* perm,
                   const mx::array* packed, const std::vector<SegSpec>& segs, int N,
                   mx::array& out) {
  std::vector<std::vector<char>> copies(3 * segs.size());
  std::vector<const void*> arrays;
  for (size_t i = 0; i < 3 * segs.size(); ++i) arrays.push_back(row_major(packed[i], copies[i]));
  const RepackedView v = repacked_view(segs, N, to_dtype(packed[1].dtype()), arrays, 0);
  qmatmul_cpu_eval(x, perm, v.shape.K, N, k.fn_int ? activation_int_max_m(k.act) : 0, out,
                   [&](QmmPath path, const float* xf, int M, float* y) {
                     run_repacked(k, path, xf, M, v, y);
                   });
}

}  // namespace

void RepackedQMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  mx::array task_out = begin_cpu_task(enc, inputs, out);
  enc.dispatch([inputs, out = std::move(task_out), segs = segs_, has_perm = has_perm_,
                N = n_, k = kernels_for(act_, backend_), pro = prologue_]() mutable {
    std::vector<char> xbuf, pbuf;
    const mx::array x = run_input(pro, inputs, 0, xbuf);
    const size_t at = input_count(pro);
    const int32_t* perm =
        has_perm ? static_cast<const int32_t*>(row_major(inputs[at], pbuf)) : nullptr;
    eval_repacked(k, x, perm, inputs.data() + at + (has_perm ? 1 : 0), segs, N, out);
  });
}

std::vector<mx::Shape> RepackedQMatmulGroup::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> out;
  for (const auto& m : members_) {
    mx::Shape s = read_shape(inputs[0], prologue_, viewed_, "repacked_qmatmul_group");
    s.back() = m.n;
    out.push_back(s);
  }
  return out;
}

bool RepackedQMatmulGroup::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RepackedQMatmulGroup&>(other);
  if (members_.size() != o.members_.size() || backend_ != o.backend_ || act_ != o.act_ ||
      viewed_ != o.viewed_ || !same_prologue(prologue_, o.prologue_))
    return false;
  for (size_t i = 0; i < members_.size(); ++i)
    if (members_[i].segs != o.members_[i].segs || members_[i].n != o.members_[i].n) return false;
  return true;
}

void RepackedQMatmulGroup::eval_cpu(const std::vector<mx::array>& inputs,
                                    std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> outs = begin_cpu_task(enc, inputs, outputs);
  // One task for every weight: the per-node dispatch is most of a small
  // GEMV's cost (a decode token's q/k/v projections).
  enc.dispatch([inputs, outs, members = members_, k = kernels_for(act_, backend_),
                pro = prologue_]() mutable {
    std::vector<char> xbuf;
    const mx::array x = run_input(pro, inputs, 0, xbuf);
    size_t at = input_count(pro);
    for (size_t i = 0; i < members.size(); ++i) {
      eval_repacked(k, x, nullptr, inputs.data() + at, members[i].segs, members[i].n, outs[i]);
      at += 3 * members[i].segs.size();
    }
  });
}

void RepackedQMatmulGroup::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  refuse_repacked_gpu();
}

void RepackedQMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  refuse_repacked_gpu();
}

std::tuple<mx::array, mx::array, mx::array> repack_segment(const mx::array& wq,
                                                           const mx::array& scales,
                                                           const mx::array& biases, int bits,
                                                           int group_size) {
  if (!repack_supports_bits(bits))
    throw std::invalid_argument("repack: bits " + std::to_string(bits) +
                                " have no repacked layout (2, 3, 4, 5, 6, 8 do)");
  if (wq.dtype() != mx::uint32 || wq.ndim() != 2)
    throw std::invalid_argument("repack: wq must be 2-D uint32, got " + shape_str(wq));
  const int N = wq.shape(0);
  const int64_t words = wq.shape(1), ng = words * 32 / bits / group_size;
  for (const mx::array* a : {&scales, &biases})
    if (a->ndim() != 2 || a->shape(0) != N || a->shape(1) != ng || !is_float_dtype(a->dtype()) ||
        a->dtype() != scales.dtype())
      throw std::invalid_argument("repack: scales and biases must be (" + std::to_string(N) +
                                  ", " + std::to_string(ng) + ") in one float dtype, got " +
                                  shape_str(*a));
  mx::array w = wq, s = scales, b = biases;
  mx::eval({w, s, b});
  const int NB = int(repack_blocks(N));
  auto pack = [&](const mx::array& a, int64_t cols) {
    std::vector<char> copy;
    const void* src = row_major(a, copy);
    std::vector<uint32_t> split;
    if (repack_splits(bits) && &a == &w) {  // MLX's bitstream -> planes per chunk (repack.h)
      split.resize(size_t(N) * cols);
      split_planes(bits, static_cast<const uint32_t*>(src), int64_t(split.size()), split.data());
      src = split.data();
    }
    return line_aligned(size_t(NB) * kRepackRows * cols * a.itemsize(), {NB, int(cols), kRepackRows},
                        a.dtype(), [&](char* dst) { interleave_rows(src, N, cols, a.itemsize(), dst); });
  };
  return {pack(w, words), pack(s, ng), pack(b, ng)};
}

std::tuple<mx::array, mx::array, mx::array> unrepack_segment(const mx::array& wq_r,
                                                             const mx::array& scales_r,
                                                             const mx::array& biases_r, int n,
                                                             int bits) {
  if (!repack_supports_bits(bits))
    throw std::invalid_argument("unrepack: bits " + std::to_string(bits) +
                                " have no repacked layout (2, 3, 4, 5, 6, 8 do)");
  const int64_t NB = repack_blocks(n);
  for (const mx::array* a : {&wq_r, &scales_r, &biases_r})
    if (a->ndim() != 3 || a->shape(0) != NB || a->shape(2) != kRepackRows)
      throw std::invalid_argument("unrepack: arrays must be (" + std::to_string(NB) +
                                  ", cols, 16) for n=" + std::to_string(n) + ", got " +
                                  shape_str(*a));
  mx::array w = wq_r, s = scales_r, b = biases_r;
  mx::eval({w, s, b});
  auto unpack = [&](const mx::array& a) {
    std::vector<char> copy;
    const void* src = row_major(a, copy);
    const int64_t cols = a.shape(1);
    std::vector<char> out(size_t(n) * cols * a.itemsize());
    deinterleave_rows(src, n, cols, a.itemsize(), out.data());
    if (repack_splits(bits) && &a == &w) {  // planes -> MLX's bitstream
      std::vector<uint32_t> split(size_t(n) * cols);
      std::memcpy(split.data(), out.data(), split.size() * 4);
      merge_planes(bits, split.data(), int64_t(split.size()), reinterpret_cast<uint32_t*>(out.data()));
    }
    return from_bytes(std::move(out), {n, int(cols)}, a.dtype());
  };
  return {unpack(w), unpack(s), unpack(b)};
}

mx::array line_aligned_stack(const std::vector<mx::array>& parts) {
  if (parts.empty()) throw std::invalid_argument("line_aligned_stack: no arrays");
  std::vector<mx::array> v = parts;
  mx::eval(v);
  for (const mx::array& p : v)
    if (p.shape() != v[0].shape() || p.dtype() != v[0].dtype())
      throw std::invalid_argument("line_aligned_stack: arrays differ in shape or dtype: " +
                                  shape_str(v[0]) + " and " + shape_str(p));
  mx::Shape shape = v[0].shape();
  shape.insert(shape.begin(), int(v.size()));
  const size_t each = v[0].nbytes();
  return line_aligned(each * v.size(), std::move(shape), v[0].dtype(), [&](char* dst) {
    for (size_t e = 0; e < v.size(); ++e) {
      std::vector<char> copy;
      std::memcpy(dst + e * each, row_major(v[e], copy), each);
    }
  });
}

}  // namespace mixbits
