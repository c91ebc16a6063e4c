// Exact algebraic identities removed from the ATen graph (passes/simplify_algebra.h).
#include "passes/simplify_algebra.h"

#include <optional>
#include <vector>

#include "graph/op_facts.h"

namespace kiln::passes {

using graph::Node;
using graph::ValueId;

namespace {

// The operand whose value the node's result equals, or -1.
ValueId identity_operand(const Node& n) {
  if (n.outputs.size() != 1 || n.mutates_args || n.is_view || n.args.size() < 2) return -1;
  const auto* x = std::get_if<graph::TensorArg>(&n.args[0]);
  if (!x) return -1;
  const std::optional<double> identity = graph::op_facts(n.qualified_name()).right_identity;
  return identity && graph::is_number(n.args[1], *identity) ? x->id : -1;
}

}  // namespace

int simplify_algebra(graph::Graph& g) {
  // A graph that writes a tensor in place could change the operand after the identity's result was taken.
  for (const Node& n : g.nodes)
    if (n.mutates_args) return 0;
  std::vector<std::vector<graph::NodeIndex>> readers(g.values.size());
  for (graph::NodeIndex i = 0; i < static_cast<graph::NodeIndex>(g.nodes.size()); ++i)
    for (const graph::ArgValue& arg : g.nodes[i].args) graph::for_each_tensor(arg, [&](ValueId v) { readers[v].push_back(i); });
  std::vector<bool> is_output(g.values.size(), false);
  for (ValueId out : g.outputs) is_output[out] = true;
  std::vector<ValueId> replacement(g.values.size());
  for (size_t i = 0; i < replacement.size(); ++i) replacement[i] = static_cast<ValueId>(i);
  int replaced = 0;
  for (Node& n : g.nodes) {
    for (graph::ArgValue& arg : n.args) graph::remap_tensors(arg, [&](ValueId id) { return replacement[id]; });
    const ValueId x = identity_operand(n);
    if (x < 0) continue;
    const ValueId out = n.outputs[0];
    const graph::TensorMeta& xm = g.values[x].meta;
    const graph::TensorMeta& om = g.values[out].meta;
    if (is_output[out] || xm.dtype != om.dtype || xm.sizes != om.sizes || xm.strides != om.strides) continue;
    bool plain_readers = true;
    for (graph::NodeIndex r : readers[out]) plain_readers = plain_readers && !g.nodes[r].is_view && !g.nodes[r].mutates_args;
    if (!plain_readers) continue;
    replacement[out] = x;
    ++replaced;
  }
  return replaced;
}

}  // namespace kiln::passes
