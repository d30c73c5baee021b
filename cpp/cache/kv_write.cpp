// KvWrite: checks, donation, and the row copies on the CPU.
#include "cache/kv_write.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/convert.h"
#include "common/inputs.h"
#include "common/mlx_args.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mixbits {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("kv_write: " + msg);
}

}  // namespace

void KvWrite::refuse_kv_write_grad() {
  throw std::invalid_argument("kv_write: a decode cache write has no derivative");
}

mx::array kv_write(const mx::array& buf, const mx::array& x, const mx::array& slot,
                   mx::StreamOrDevice s) {
  if (buf.ndim() != 4 || !is_float_dtype(buf.dtype()))
    fail("buf must be a 4-D float buffer [B, H, S, D], got shape " + shape_str(buf));
  const mx::Shape row{buf.shape(0), buf.shape(1), 1, buf.shape(3)};
  if (x.shape() != row || !is_float_dtype(x.dtype()))
    fail("x must be float of shape " + shape_str(row) + ", got " + shape_str(x));
  if (slot.size() != 1 || !mx::issubdtype(slot.dtype(), mx::integer))
    fail("slot must be one integer (an array of size 1)");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("CPU only; on the GPU use mx.slice_update");
  // Read as its one int32 element: no reshape node (one per layer).
  auto at = slot.dtype() == mx::int32 ? slot : mx::astype(slot, mx::int32, stream);
  // The new rows are B*H*D elements in [B, H, 1, D] order, which a view
  // that keeps that order (values reshaped to heads and transposed) holds
  // too: read from the array viewed. The keys' RoPE runs inside this node.
  std::vector<mx::array> inputs{buf};
  auto prologue = take_input(through_views(x), inputs);
  inputs.push_back(at);
  return mx::array(buf.shape(), buf.dtype(), std::make_shared<KvWrite>(stream, std::move(prologue)),
                   std::move(inputs));
}

std::vector<mx::Shape> KvWrite::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool KvWrite::is_equivalent(const mx::Primitive& other) const {
  return same_prologue(prologue_, static_cast<const KvWrite&>(other).prologue_);
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const mx::array& buf = inputs[0];
  // In place when the buffer is this node's alone (the decode step hands
  // its buffers over), decided here before dispatch, as MLX's ops do.
  const bool copy = !(buf.is_donatable() && buf.flags().row_contiguous);
  if (copy) out.set_data(mx::allocator::malloc(out.nbytes()));
  else out.copy_shared_buffer(buf);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([inputs, o = mx::array::unsafe_weak_copy(out), copy, pro = prologue_]() mutable {
    const int64_t rows = o.shape(0) * o.shape(1), S = o.shape(2), D = o.shape(3);
    const size_t at_slot = 1 + input_count(pro);
    const int64_t slot = std::clamp<int64_t>(inputs[at_slot].data<int32_t>()[0], 0, S - 1);
    if (copy) {
      std::vector<char> tmp;
      std::memcpy(o.data<char>(), row_major(inputs[0], tmp), o.nbytes());
    }
    std::vector<char> pbuf, xbuf;
    const mx::array xa = run_input(pro, inputs, 1, pbuf);
    const void* x = row_major(xa, xbuf);
    const DType xt = to_dtype(xa.dtype()), ot = to_dtype(o.dtype());
    std::vector<float> row(static_cast<size_t>(D));
    for (int64_t r = 0; r < rows; ++r) {
      widen_to_f32(x, r * D, D, xt, row.data());
      narrow_from_f32(row.data(), D, ot, o.data<void>(), (r * S + slot) * D);
    }
  });
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("kv_write: CPU only; on the GPU use mx.slice_update");
}

}  // namespace mixbits
