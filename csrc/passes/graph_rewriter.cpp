// Node-list rebuilding for the lowering passes (passes/graph_rewriter.h).
#include "passes/graph_rewriter.h"

#include "common/error.h"

namespace kiln::passes {

using graph::Node;
using graph::TensorArg;
using graph::ValueId;

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

std::vector<Node> GraphRewriter::take_nodes() {
  std::vector<Node> nodes = std::move(g_.nodes);
  g_.nodes.clear();
  return nodes;
}

void GraphRewriter::append(Node node) {
  for (ValueId out : node.outputs) g_.values[out].producer = static_cast<graph::NodeIndex>(g_.nodes.size());
  g_.nodes.push_back(std::move(node));
}

ValueId GraphRewriter::add(const std::string& op, const std::string& overload, std::vector<graph::ArgValue> args,
                           std::vector<std::string> names, int32_t positional, const graph::TensorMeta& meta,
                           bool is_view, ValueId reuse) {
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

ValueId GraphRewriter::add_completed(graph::OpOracle& oracle, const std::string& op, const std::string& overload,
                                     std::vector<graph::ArgValue> args, bool requires_grad, ValueId reuse) {
  Node node;
  node.op = op;
  node.overload = overload;
  node.args = std::move(args);
  std::vector<graph::TensorMeta> metas = oracle.complete_node(g_, node);
  KILN_ASSERT_EQ(metas.size(), 1u) << "results of " << node.qualified_name();
  if (reuse >= 0) {
    const graph::TensorMeta& recorded = g_.value(reuse).meta;
    KILN_ASSERT(metas[0].sizes == recorded.sizes && metas[0].dtype == recorded.dtype)
        << node.qualified_name() << " does not give the recorded result %" << reuse;
    node.outputs = {reuse};
    append(std::move(node));
    return reuse;
  }
  metas[0].requires_grad = requires_grad;
  return g_.add_node(std::move(node), std::move(metas)).at(0);
}

ValueId GraphRewriter::cast(ValueId v, graph::ScalarType dtype, ValueId reuse) {
  graph::TensorMeta m = g_.values[v].meta;
  m.dtype = dtype;
  return add("aten::_to_copy", "default",
             {TensorArg{v}, graph::ScalarTypeArg{dtype}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, false,
              graph::NoneArg{}},
             {"self", "dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"}, 1, m, false, reuse);
}

ValueId GraphRewriter::expand(ValueId v, const std::vector<int64_t>& expanded_sizes) {
  graph::TensorMeta m = g_.values[v].meta;
  m.strides = graph::broadcast_strides(m, expanded_sizes);
  m.sizes = expanded_sizes;
  return add("aten::expand", "default", {TensorArg{v}, expanded_sizes, false}, {"self", "size", "implicit"}, 2, m,
             true);
}

}  // namespace kiln::passes
