#include "common/inline_producer.h"

#include <cstring>

#include "common/inputs.h"

namespace mixbits {

namespace mx = mlx::core;

namespace {

// Producers folded into one another at most this deep (norm, rope, ...).
constexpr int kMaxDepth = 3;

std::optional<Prologue> take(const mx::array& x, std::vector<mx::array>& inputs, int depth) {
  // A lazy node of one output (evaluated arrays have no primitive left).
  if (depth < kMaxDepth && x.has_primitive() && x.siblings().empty()) {
    auto node = x.primitive_ptr();
    // Our own classes: their type info is in this library.
    if (dynamic_cast<const InlineProducer*>(node.get())) {
      const size_t before = inputs.size();
      auto inner = take(x.inputs()[0], inputs, depth + 1);
      for (size_t i = 1; i < x.inputs().size(); ++i) inputs.push_back(x.inputs()[i]);
      return Prologue{node, int(inputs.size() - before), x.shape(), x.dtype(),
                      inner ? std::make_shared<const Prologue>(std::move(*inner)) : nullptr};
    }
  }
  inputs.push_back(x);
  return std::nullopt;
}

mx::array run(const Prologue& p, const std::vector<mx::array>& inputs, size_t first,
              std::vector<char>& storage) {
  std::vector<mx::array> in;
  std::vector<char> inner;  // the nested producer's output, read by compute below
  size_t at = first;
  if (p.first) {
    in.push_back(run(*p.first, inputs, first, inner));
    at += p.first->n_inputs;
  }
  for (; at < first + p.n_inputs; ++at) in.push_back(inputs[at]);
  storage.resize(size_t(element_count(p.shape)) * mx::size_of(p.dtype));
  dynamic_cast<const InlineProducer&>(*p.node).compute(in, p.shape, p.dtype, storage.data());
  return borrowed(storage.data(), p.shape, p.dtype);  // read before storage goes
}

bool same(const Prologue* a, const Prologue* b) {
  if (!a || !b) return !a && !b;
  return a->n_inputs == b->n_inputs && a->shape == b->shape && a->dtype == b->dtype &&
         std::strcmp(a->node->name(), b->node->name()) == 0 &&
         a->node->is_equivalent(*b->node) && same(a->first.get(), b->first.get());
}

}  // namespace

std::optional<Prologue> take_input(const mx::array& x, std::vector<mx::array>& inputs) {
  return take(x, inputs, 0);
}

mx::array run_input(const std::optional<Prologue>& p, const std::vector<mx::array>& inputs,
                    size_t first, std::vector<char>& storage) {
  return p ? run(*p, inputs, first, storage) : inputs[first];
}

mx::Shape read_shape(const mx::array& first_input, const std::optional<Prologue>& p,
                     const std::optional<mx::Shape>& viewed, const char* op) {
  return input_shape(first_input, viewed ? viewed : p ? std::optional<mx::Shape>(p->shape)
                                                      : std::nullopt, op);
}

bool same_prologue(const std::optional<Prologue>& a, const std::optional<Prologue>& b) {
  return same(a ? &*a : nullptr, b ? &*b : nullptr);
}

}  // namespace mixbits
