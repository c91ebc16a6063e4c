// Constant folding over the ATen graph (passes/fold_constants.h).
#include "passes/fold_constants.h"

#include "common/error.h"
#include "graph/op_facts.h"
#include "passes/remove_dead_nodes.h"

namespace kiln::passes {

using graph::Node;
using graph::NodeIndex;
using graph::ValueId;

namespace {

// Ops without a decomposition whose result depends on their arguments alone (the ones masks, position tables
// and small constant products are built from).
bool is_deterministic_extern(const Node& n) { return graph::op_facts(n.qualified_name()).deterministic; }

// Nodes left in the graph when a kept node reads them: views, and fills and allocations, which fusion writes
// inside their readers' kernels.
bool is_cheap_to_keep(const Node& n) {
  return n.is_view || graph::op_facts(n.qualified_name()).creates != graph::OpCreates::kNothing;
}

// Which values depend on no graph input, and which nodes compute them from constants alone.
struct Foldability {
  std::vector<bool> value, node;
};

Foldability foldability(const graph::Graph& g) {
  const auto num_values = g.values.size();
  // Storage some node writes in place (through any alias) is not constant.
  const std::vector<ValueId> root = graph::storage_roots(g);
  std::vector<bool> written(num_values, false);
  for (const Node& n : g.nodes)
    if (n.mutates_args)
      for (const graph::ArgValue& arg : n.args) graph::for_each_tensor(arg, [&](ValueId v) { written[root[v]] = true; });

  // So is storage a graph output shares: the caller may write into the tensor it was given.
  for (ValueId out : g.outputs) written[root[out]] = true;

  std::vector<bool> foldable(num_values, false);
  for (const graph::Value& v : g.values) foldable[v.id] = v.is_constant && !written[root[v.id]];
  std::vector<bool> node_foldable(g.nodes.size(), false);
  for (NodeIndex i = 0; i < static_cast<NodeIndex>(g.nodes.size()); ++i) {
    const Node& n = g.nodes[i];
    if (n.mutates_args || !(is_pure_node(g, n) || is_deterministic_extern(n))) continue;
    int tensor_args = 0;
    bool ok = true;
    for (const graph::ArgValue& arg : n.args)
      graph::for_each_tensor(arg, [&](ValueId v) {
        ++tensor_args;
        ok = ok && foldable[v];
      });
    // A view of several tensors may alias any of them (graph::storage_roots follows the first only).
    if (n.is_view && tensor_args > 1) ok = false;
    for (ValueId out : n.outputs) {
      const graph::Value& v = g.values[out];
      ok = ok && !v.meta.requires_grad && !written[root[out]];
    }
    if (!ok) continue;
    node_foldable[i] = true;
    for (ValueId out : n.outputs) foldable[out] = true;
  }

  return {std::move(foldable), std::move(node_foldable)};
}

// The plan that computes the `target` values: every foldable node they depend on, in graph order.
ConstantFolding plan_for(const graph::Graph& g, const std::vector<bool>& node_foldable, const std::vector<bool>& target) {
  std::vector<bool> in_cone = target;
  std::vector<bool> evaluate(g.nodes.size(), false);
  for (NodeIndex i = static_cast<NodeIndex>(g.nodes.size()); i-- > 0;) {
    if (!node_foldable[i]) continue;
    const Node& n = g.nodes[i];
    for (ValueId out : n.outputs) evaluate[i] = evaluate[i] || in_cone[out];
    if (!evaluate[i]) continue;
    for (const graph::ArgValue& arg : n.args) graph::for_each_tensor(arg, [&](ValueId v) { in_cone[v] = true; });
  }
  ConstantFolding plan;
  for (NodeIndex i = 0; i < static_cast<NodeIndex>(g.nodes.size()); ++i) {
    if (!evaluate[i]) continue;
    plan.nodes.push_back(i);
    for (ValueId out : g.nodes[i].outputs)
      if (target[out]) plan.values.push_back(out);
  }
  return plan;
}

}  // namespace

ConstantFolding plan_constant_folding(const graph::Graph& g, int64_t max_bytes) {
  const auto num_values = g.values.size();
  const Foldability f = foldability(g);
  const std::vector<bool>& node_foldable = f.node;

  // Foldable values the rest of the graph reads, walked from the last: each becomes a constant, or keeps its
  // producer (a cheap or too large one), whose own foldable operands are then read by a kept node.
  std::vector<bool> demanded(num_values, false);
  for (NodeIndex i = 0; i < static_cast<NodeIndex>(g.nodes.size()); ++i)
    if (!node_foldable[i])
      for (const graph::ArgValue& arg : g.nodes[i].args) graph::for_each_tensor(arg, [&](ValueId v) { demanded[v] = true; });
  std::vector<bool> target(num_values, false);
  for (NodeIndex i = static_cast<NodeIndex>(g.nodes.size()); i-- > 0;) {
    if (!node_foldable[i]) continue;
    const Node& n = g.nodes[i];
    bool needed = false;
    bool too_large = false;
    for (ValueId out : n.outputs) {
      needed = needed || demanded[out];
      too_large = too_large || (demanded[out] && graph::nbytes(g.values[out].meta) > max_bytes);
    }
    if (!needed) continue;
    if (is_cheap_to_keep(n) || too_large) {
      for (const graph::ArgValue& arg : n.args) graph::for_each_tensor(arg, [&](ValueId v) { demanded[v] = true; });
      continue;
    }
    for (ValueId out : n.outputs) target[out] = demanded[out];
  }

  return plan_for(g, node_foldable, target);
}

ConstantFolding plan_value_folding(const graph::Graph& g, graph::ValueId v) {
  const Foldability f = foldability(g);
  if (!f.value[v] || g.values[v].is_constant) return {};
  std::vector<bool> target(g.values.size(), false);
  target[v] = true;
  return plan_for(g, f.node, target);
}

std::vector<graph::ValueId> fold_constants(graph::Graph& g, const ConstantFolding& plan,
                                          std::vector<graph::PyObjectRef> tensors) {
  KILN_ASSERT(plan.values.size() == tensors.size()) << "constant folding: " << tensors.size() << " tensors for "
                                                    << plan.values.size() << " values";
  std::vector<bool> folded(g.values.size(), false);
  for (size_t i = 0; i < plan.values.size(); ++i) {
    graph::Value& v = g.values[plan.values[i]];
    v.is_constant = true;
    v.constant = std::move(tensors[i]);
    v.producer = -1;
    folded[v.id] = true;
  }
  // The nodes that computed the folded values go, unless a node left in the graph still reads one of their results
  // (a fill both folded into a mask and read by a kernel).
  std::vector<bool> planned(g.nodes.size(), false);
  for (NodeIndex i : plan.nodes) planned[i] = true;
  std::vector<bool> live(g.values.size(), false);
  for (ValueId out : g.outputs) live[out] = true;
  std::vector<bool> keep(g.nodes.size(), false);
  for (size_t i = g.nodes.size(); i-- > 0;) {
    const Node& n = g.nodes[i];
    bool needed = !planned[i];
    for (ValueId out : n.outputs) needed = needed || (live[out] && !folded[out]);
    for (ValueId out : n.outputs) needed = needed && !folded[out];
    if (!needed) continue;
    keep[i] = true;
    for (const graph::ArgValue& arg : n.args) graph::for_each_tensor(arg, [&](ValueId v) { live[v] = true; });
  }
  std::vector<Node> nodes;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (keep[i]) nodes.push_back(std::move(g.nodes[i]));
  g.nodes = std::move(nodes);
  return renumber_producers(g);
}

}  // namespace kiln::passes
