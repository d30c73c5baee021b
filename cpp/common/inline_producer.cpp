#include "common/inline_producer.h"

#include <cstring>

#include "common/inputs.h"

namespace mixbits {

namespace mx = mlx::core;

std::optional<Prologue> take_input(const mx::array& x, std::vector<mx::array>& inputs) {
  // A lazy node of one output (evaluated arrays have no primitive left).
  if (x.has_primitive() && x.siblings().empty()) {
    auto node = x.primitive_ptr();
    // Our own classes: their type info is in this library.
    if (dynamic_cast<const InlineProducer*>(node.get())) {
      for (const auto& a : x.inputs()) inputs.push_back(a);
      return Prologue{node, int(x.inputs().size()), x.shape(), x.dtype()};
    }
  }
  inputs.push_back(x);
  return std::nullopt;
}

mx::array run_input(const std::optional<Prologue>& p, const std::vector<mx::array>& inputs,
                    size_t first, std::vector<char>& storage) {
  if (!p) return inputs[first];
  const std::vector<mx::array> in(inputs.begin() + first, inputs.begin() + first + p->n_inputs);
  size_t n = mx::size_of(p->dtype);
  for (int d : p->shape) n *= size_t(d);
  storage.resize(n);
  dynamic_cast<const InlineProducer&>(*p->node).compute(in, p->shape, p->dtype, storage.data());
  // A view of storage (no copy, no ownership): the consumer reads it before
  // storage goes.
  return mx::array(storage.data(), p->shape, p->dtype, [](void*) {});
}

mx::Shape read_shape(const mx::array& first_input, const std::optional<Prologue>& p,
                     const std::optional<mx::Shape>& viewed, const char* op) {
  return input_shape(first_input, viewed ? viewed : p ? std::optional<mx::Shape>(p->shape)
                                                      : std::nullopt, op);
}

bool same_prologue(const std::optional<Prologue>& a, const std::optional<Prologue>& b) {
  if (!a || !b) return !a && !b;
  return a->n_inputs == b->n_inputs && a->shape == b->shape && a->dtype == b->dtype &&
         std::strcmp(a->node->name(), b->node->name()) == 0 &&
         a->node->is_equivalent(*b->node);
}

}  // namespace mixbits
