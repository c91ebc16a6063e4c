// Recomputed pointwise nodes moved next to their sibling (see fuse_recomputation.h).
#include "passes/fuse_recomputation.h"

#include <set>
#include <vector>

#include "decomp/decompositions.h"
#include "graph/op_facts.h"

namespace kiln::passes {

namespace {

constexpr int kLookAhead = 24;  // nodes searched after the recomputed one
constexpr size_t kMaxMoved = 8;  // the node and what depends on it before its sibling

using graph::NodeIndex;
using graph::ValueId;

bool is_pointwise(const graph::Graph& g, const graph::Node& node) {
  if (node.mutates_args || node.outputs.size() != 1) return false;
  const decomp::Decomposition* d = decomp::find_decomposition(g, node);
  return d && !d->reduction_dims && !d->window_sizes;
}

// Nodes that may move past others: deterministic and free of side effects.
bool movable(const graph::Graph& g, const graph::Node& node) {
  if (node.mutates_args) return false;
  return decomp::find_decomposition(g, node) != nullptr || decomp::is_affine_view(g, node) ||
         graph::op_facts(node.qualified_name()).cost == graph::OpCost::kMatmul;
}

// The value a view chain starts from.
ValueId view_root(const graph::Graph& g, ValueId v) {
  for (;;) {
    const graph::Value& value = g.value(v);
    if (value.producer < 0) return v;
    const graph::Node& node = g.nodes[value.producer];
    if (!decomp::is_affine_view(g, node)) return v;
    v = std::get<graph::TensorArg>(node.args[0]).id;
  }
}

std::set<ValueId> operand_roots(const graph::Graph& g, const graph::Node& node) {
  std::set<ValueId> roots;
  for (const graph::ArgValue& arg : node.args)
    graph::for_each_tensor(arg, [&](ValueId id) {
      if (!g.value(id).is_constant) roots.insert(view_root(g, id));
    });
  return roots;
}

bool reads_any(const graph::Node& node, const std::vector<bool>& values) {
  bool hit = false;
  for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId id) { hit = hit || values[id]; });
  return hit;
}

// Tries to move node a (and what depends on it) after its sibling; true when the order changed.
bool move_after_sibling(graph::Graph& g, NodeIndex a) {
  const graph::Node& node = g.nodes[a];
  if (!is_pointwise(g, node)) return false;
  const std::set<ValueId> roots = operand_roots(g, node);
  if (roots.empty()) return false;
  for (ValueId root : roots)  // recomputation: its operands exist before the graph runs
    if (!g.value(root).is_input) return false;
  const std::vector<int64_t>& shape = g.value(node.outputs[0]).meta.sizes;
  std::vector<bool> moved_values(g.values.size(), false);
  moved_values[node.outputs[0]] = true;
  std::vector<NodeIndex> moved = {a};
  const NodeIndex end = std::min<NodeIndex>(static_cast<NodeIndex>(g.nodes.size()), a + 1 + kLookAhead);
  for (NodeIndex b = a + 1; b < end; ++b) {
    const graph::Node& other = g.nodes[b];
    if (other.mutates_args) return false;
    if (reads_any(other, moved_values)) {  // depends on the node: moves with it
      if (!movable(g, other) || moved.size() == kMaxMoved) return false;
      // A reduction moved into the sibling's kernel could not join it when that kernel reduces other dims (a
      // layer norm's weight gradient, summed over rows, next to its input gradient, summed over columns).
      const decomp::Decomposition* d = decomp::find_decomposition(g, other);
      if (d && (d->reduction_dims || d->window_sizes)) return false;
      moved.push_back(b);
      for (ValueId out : other.outputs) moved_values[out] = true;
      continue;
    }
    if (!is_pointwise(g, other) || g.value(other.outputs[0]).meta.sizes != shape) continue;
    bool shares = false;
    for (ValueId root : operand_roots(g, other)) shares = shares || roots.count(root) > 0;
    if (!shares) continue;
    if (b == a + static_cast<NodeIndex>(moved.size())) return false;  // adjacent already
    // New order: the nodes up to b that stay, the sibling, then the moved ones.
    std::vector<graph::Node> reordered;
    std::vector<bool> is_moved(g.nodes.size(), false);
    for (NodeIndex m : moved) is_moved[m] = true;
    for (NodeIndex i = a; i <= b; ++i)
      if (!is_moved[i]) reordered.push_back(std::move(g.nodes[i]));
    for (NodeIndex m : moved) reordered.push_back(std::move(g.nodes[m]));
    for (size_t i = 0; i < reordered.size(); ++i) g.nodes[a + i] = std::move(reordered[i]);
    for (NodeIndex n = a; n <= b; ++n)
      for (ValueId out : g.nodes[n].outputs) g.values[out].producer = n;
    return true;
  }
  return false;
}

// Moves node a down to just before its first reader when that reader is a pointwise node of the same shape and other
// nodes lie between (an extern call: the scheduler keeps graph order, so the two were two kernels). True when moved.
bool sink_to_pointwise_reader(graph::Graph& g, NodeIndex a) {
  const graph::Node& node = g.nodes[a];
  if (!is_pointwise(g, node)) return false;
  std::vector<bool> output(g.values.size(), false);
  output[node.outputs[0]] = true;
  NodeIndex reader = -1;
  for (NodeIndex b = a + 1; b < static_cast<NodeIndex>(g.nodes.size()) && reader < 0; ++b) {
    const graph::Node& other = g.nodes[b];
    if (reads_any(other, output)) reader = b;
    else if (other.mutates_args || other.op.rfind("kiln::", 0) == 0) return false;  // writes or switches a mode
  }
  if (reader <= a + 1 || !is_pointwise(g, g.nodes[reader]) ||
      g.value(g.nodes[reader].outputs[0]).meta.sizes != g.value(node.outputs[0]).meta.sizes)
    return false;
  graph::Node moved = std::move(g.nodes[a]);
  for (NodeIndex i = a; i + 1 < reader; ++i) g.nodes[i] = std::move(g.nodes[i + 1]);
  g.nodes[reader - 1] = std::move(moved);
  for (NodeIndex n = a; n < reader; ++n)
    for (ValueId out : g.nodes[n].outputs) g.values[out].producer = n;
  return true;
}

}  // namespace

void fuse_recomputation(graph::Graph& g) {
  // Pointwise chains split by an extern call first (SwiGLU's silu(gate(x)) * up(x)), from the last node back so that a
  // chain moves together; then recomputed nodes next to their siblings, whose moves take precedence.
  for (NodeIndex a = static_cast<NodeIndex>(g.nodes.size()) - 1; a >= 0; --a) sink_to_pointwise_reader(g, a);
  std::vector<bool> moved_once(g.values.size(), false);  // by output: a node moves at most once
  for (NodeIndex a = 0; a < static_cast<NodeIndex>(g.nodes.size()); ++a) {
    const graph::Node& node = g.nodes[a];
    if (node.outputs.empty() || moved_once[node.outputs[0]]) continue;
    const ValueId out = node.outputs[0];
    if (move_after_sibling(g, a)) moved_once[out] = true;
  }
}

}  // namespace kiln::passes
