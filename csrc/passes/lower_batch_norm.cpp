// Inference batch norm as pointwise ATen ops (passes/lower_batch_norm.h).
//
// Design: y = (x - mean) * rsqrt(var + eps) * weight + bias, with the per-channel vectors viewed as
// [C, 1, ..., 1] so that ordinary broadcasting lines them up with dim 1. The new nodes are plain ATen ops
// (view, sub, add, rsqrt, mul) that the decomposition table already knows, so fusion folds them into
// one kernel with whatever follows (the ReLU, the residual add). The last node defines the batch norm's own
// output value, so its consumers are untouched. Only float32 calls whose statistics outputs nobody reads.
#include "passes/lower_batch_norm.h"

#include <optional>

namespace kiln::passes {

using graph::ArgValue;
using graph::Graph;
using graph::Node;
using graph::TensorArg;
using graph::ValueId;

namespace {

struct BatchNormArgs {
  ValueId input, mean, var;
  std::optional<ValueId> weight, bias;
  double eps;
};

std::optional<ValueId> tensor_at(const Node& n, size_t i) {
  if (i >= n.args.size()) return std::nullopt;
  if (const auto* t = std::get_if<TensorArg>(&n.args[i])) return t->id;
  return std::nullopt;
}

std::optional<double> number_at(const Node& n, size_t i) {
  if (i >= n.args.size()) return std::nullopt;
  if (const auto* d = std::get_if<double>(&n.args[i])) return *d;
  if (const auto* l = std::get_if<int64_t>(&n.args[i])) return static_cast<double>(*l);
  return std::nullopt;
}

// The arguments of an inference batch norm that qualifies, or nullopt.
std::optional<BatchNormArgs> inference_batch_norm(const Graph& g, const Node& n) {
  const std::string name = n.qualified_name();
  size_t eps_index;
  if (name == "aten::native_batch_norm.default") {
    const bool* training = n.args.size() > 5 ? std::get_if<bool>(&n.args[5]) : nullptr;
    if (!training || *training) return std::nullopt;
    eps_index = 7;
  } else if (name == "aten::_native_batch_norm_legit_no_training.default") {
    eps_index = 6;
  } else {
    return std::nullopt;
  }
  BatchNormArgs a;
  auto input = tensor_at(n, 0), mean = tensor_at(n, 3), var = tensor_at(n, 4);
  auto eps = number_at(n, eps_index);
  if (!input || !mean || !var || !eps || n.outputs.size() != 3) return std::nullopt;
  a.input = *input, a.mean = *mean, a.var = *var, a.eps = *eps;
  a.weight = tensor_at(n, 1), a.bias = tensor_at(n, 2);
  const auto& x = g.values[a.input].meta;
  if (x.sizes.size() < 2 || x.dtype != graph::ScalarType::Float) return std::nullopt;
  for (auto v : {std::optional<ValueId>(a.mean), std::optional<ValueId>(a.var), a.weight, a.bias}) {
    if (!v) continue;
    const auto& m = g.values[*v].meta;
    if (m.dtype != graph::ScalarType::Float || m.sizes != std::vector<int64_t>{x.sizes[1]} || !(m.device == x.device))
      return std::nullopt;
  }
  if (graph::is_read(g, n.outputs[1]) || graph::is_read(g, n.outputs[2])) return std::nullopt;
  return a;
}

class Lowering {
 public:
  explicit Lowering(Graph& g) : g_(g) {}

  // `plan[i]`: the arguments of node i when it is lowered (found on the graph before any change).
  bool run(const std::vector<std::optional<BatchNormArgs>>& plan) {
    std::vector<Node> old_nodes = std::move(g_.nodes);
    g_.nodes.clear();
    bool changed = false;
    for (size_t i = 0; i < old_nodes.size(); ++i) {
      if (!plan[i]) {
        append(std::move(old_nodes[i]));
        continue;
      }
      lower(*plan[i], old_nodes[i].outputs[0]);
      changed = true;
    }
    return changed;
  }

 private:
  void lower(const BatchNormArgs& a, ValueId result) {
    const graph::TensorMeta out = g_.values[result].meta;
    std::vector<int64_t> channel_shape(out.sizes.size() - 1, 1);
    channel_shape[0] = out.sizes[1];
    // A per-channel vector as a [C, 1, ...] view expanded (stride 0) to the output's shape: every node then
    // has the output's index space, so fusion puts the whole normalisation in the consumer's kernel.
    auto per_channel = [&](ValueId v) {
      graph::TensorMeta m = g_.values[v].meta;
      m.sizes = channel_shape;
      m.strides = graph::contiguous_strides(channel_shape);
      m.storage_offset = 0;
      m.requires_grad = false;
      const ValueId viewed = add("aten::view", "default", {TensorArg{v}, channel_shape}, {"self", "size"}, 2, m, true);
      std::vector<int64_t> strides(out.sizes.size(), 0);
      strides[1] = 1;
      m.sizes = out.sizes;
      m.strides = strides;
      return add("aten::expand", "default", {TensorArg{viewed}, out.sizes, false}, {"self", "size", "implicit"}, 2, m,
                 true);
    };
    graph::TensorMeta full = out;  // every new node has the output's index space (see per_channel)
    full.requires_grad = false;
    full.storage_offset = 0;
    const ValueId mean = per_channel(a.mean);
    const ValueId var = per_channel(a.var);
    const ValueId centred = add("aten::sub", "Tensor", {TensorArg{a.input}, TensorArg{mean}, int64_t{1}},
                                {"self", "other", "alpha"}, 2, full);
    const ValueId shifted = add("aten::add", "Tensor", {TensorArg{var}, a.eps, int64_t{1}}, {"self", "other", "alpha"}, 2, full);
    const ValueId rstd = add("aten::rsqrt", "default", {TensorArg{shifted}}, {"self"}, 1, full);
    const bool last_is_scale = !a.weight && !a.bias;
    ValueId y = add("aten::mul", "Tensor", {TensorArg{centred}, TensorArg{rstd}}, {"self", "other"}, 2, full,
                    false, last_is_scale ? result : -1);
    if (a.weight)
      y = add("aten::mul", "Tensor", {TensorArg{y}, TensorArg{per_channel(*a.weight)}}, {"self", "other"}, 2, full, false,
              a.bias ? -1 : result);
    if (a.bias)
      add("aten::add", "Tensor", {TensorArg{y}, TensorArg{per_channel(*a.bias)}, int64_t{1}}, {"self", "other", "alpha"},
          2, full, false, result);
  }

  // Appends a node; its output is `reuse` (the batch norm's result) or a new value with `meta`.
  ValueId add(const std::string& op, const std::string& overload, std::vector<ArgValue> args,
              std::vector<std::string> names, int32_t positional, const graph::TensorMeta& meta, bool is_view = false,
              ValueId reuse = -1) {
    Node node;
    node.op = op;
    node.overload = overload;
    node.args = std::move(args);
    node.arg_names = std::move(names);
    node.num_positional = positional;
    node.is_view = is_view;
    ValueId out = reuse;
    if (out < 0) {
      graph::Value v;
      v.id = static_cast<ValueId>(g_.values.size());
      v.meta = meta;
      g_.values.push_back(std::move(v));
      out = g_.values.back().id;
    }
    node.outputs = {out};
    append(std::move(node));
    return out;
  }

  void append(Node node) {
    for (ValueId out : node.outputs) g_.values[out].producer = static_cast<graph::NodeIndex>(g_.nodes.size());
    g_.nodes.push_back(std::move(node));
  }

  Graph& g_;
};

}  // namespace

bool lower_inference_batch_norm(Graph& g) {
  std::vector<std::optional<BatchNormArgs>> plan;
  bool any = false;
  for (const Node& node : g.nodes) {
    plan.push_back(inference_batch_norm(g, node));
    any = any || plan.back().has_value();
  }
  return any && Lowering(g).run(plan);
}

}  // namespace kiln::passes
