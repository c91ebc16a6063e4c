// Dead-node removal: one backward sweep marking the values each live node reads.
#include "passes/remove_dead_nodes.h"

#include "decomp/decompositions.h"
#include "graph/op_facts.h"

namespace kiln::passes {

bool is_allocation(const graph::Node& node) {
  return graph::op_facts(node.qualified_name()).creates == graph::OpCreates::kAllocation;
}

bool is_pure_node(const graph::Graph& g, const graph::Node& node) {
  if (node.mutates_args) return false;
  if (node.is_view) return true;  // aliases its input and does nothing else (the recorded detach after ReLU)
  if (is_allocation(node)) return true;  // batch norm's meta path records an empty reserve per call
  // Extern ops known to do nothing but compute their result (the backward builder leaves unread gradient
  // pieces of these behind when it merges them: autodiff/build_joint_graphs.cpp).
  if (graph::op_facts(node.qualified_name()).side_effect_free) return true;
  graph::ScalarType unused;
  return decomp::find_decomposition(g, node) != nullptr || decomp::is_affine_view(g, node) ||
         decomp::constant_node_value(g, node, unused).has_value();
}

std::vector<graph::ValueId> renumber_producers(graph::Graph& g) {
  // Values of removed nodes are dropped and the rest renumbered, so the table stays dense and every
  // value is an input, a constant or a node output (the verifier's rule).
  std::vector<bool> defined(g.values.size(), false);
  for (const graph::Value& v : g.values) defined[v.id] = v.is_input || v.is_constant;
  for (const graph::Node& node : g.nodes)
    for (graph::ValueId out : node.outputs) defined[out] = true;
  std::vector<graph::ValueId> new_id(g.values.size(), -1);
  std::vector<graph::Value> values;
  for (graph::Value& v : g.values) {
    if (!defined[v.id]) continue;
    new_id[v.id] = static_cast<graph::ValueId>(values.size());
    v.id = new_id[v.id];
    v.producer = -1;
    values.push_back(std::move(v));
  }
  g.values = std::move(values);
  auto rename = [&](graph::ValueId& id) { id = new_id[id]; };
  for (auto& id : g.inputs) rename(id);
  for (auto& id : g.outputs) rename(id);
  for (graph::NodeIndex n = 0; n < static_cast<graph::NodeIndex>(g.nodes.size()); ++n) {
    graph::Node& node = g.nodes[n];
    for (auto& id : node.outputs) {
      rename(id);
      g.values[id].producer = n;
    }
    for (graph::ArgValue& arg : node.args) {
      if (auto* t = std::get_if<graph::TensorArg>(&arg)) rename(t->id);
      else if (auto* list = std::get_if<graph::TensorListArg>(&arg))
        for (auto& id : list->ids)
          if (id) rename(*id);
    }
  }
  return new_id;
}

void remove_dead_nodes(graph::Graph& g) {
  std::vector<bool> live(g.values.size(), false);
  for (graph::ValueId out : g.outputs) live[out] = true;
  std::vector<bool> keep(g.nodes.size(), false);
  for (size_t i = g.nodes.size(); i-- > 0;) {
    const graph::Node& node = g.nodes[i];
    bool needed = !is_pure_node(g, node);
    for (graph::ValueId out : node.outputs) needed = needed || live[out];
    if (!needed) continue;
    keep[i] = true;
    for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](graph::ValueId id) { live[id] = true; });
  }
  std::vector<graph::Node> kept;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (keep[i]) kept.push_back(std::move(g.nodes[i]));
  g.nodes = std::move(kept);
  renumber_producers(g);
}

}  // namespace kiln::passes
