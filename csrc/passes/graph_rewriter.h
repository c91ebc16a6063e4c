#pragma once
// Rebuilds a graph's node list in order while some nodes are replaced by several plain ATen nodes: the
// shared machinery of the lowering passes (lower_batch_norm, split_addmm). Torch-free.
#include <optional>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "graph/op_oracle.h"

namespace kiln::passes {

/// Argument `i` of `n` as the lowering passes read a planned node's arguments: the tensor's value id, or a number
/// (an int or a float); nullopt when the argument is absent or of another kind.
std::optional<graph::ValueId> tensor_at(const graph::Node& n, size_t i);
std::optional<double> number_at(const graph::Node& n, size_t i);

class GraphRewriter {
 public:
  explicit GraphRewriter(graph::Graph& g) : g_(g) {}

  /// Takes the graph's nodes out (to be appended back, or replaced, in order with `append` / `add`).
  std::vector<graph::Node> take_nodes();

  /// Rebuilds the node list in order: node i stays where `plan[i]` (made on the graph before any change) is empty,
  /// else `lower(*plan[i], node)` appends its replacement. Returns true if some node was replaced.
  template <typename Plan, typename Lower>
  bool replace_planned(const std::vector<std::optional<Plan>>& plan, Lower&& lower) {
    std::vector<graph::Node> nodes = take_nodes();
    bool changed = false;
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (!plan[i]) {
        append(std::move(nodes[i]));
        continue;
      }
      lower(*plan[i], nodes[i]);
      changed = true;
    }
    return changed;
  }

  /// Appends a node, recording it as the producer of its outputs.
  void append(graph::Node node);

  /// Appends a new ATen node whose one output is `reuse` (a value some replaced node defined, so its consumers
  /// are untouched) or, when reuse < 0, a new value with `meta`. Returns the output value.
  graph::ValueId add(const std::string& op, const std::string& overload, std::vector<graph::ArgValue> args,
                     std::vector<std::string> names, int32_t positional, const graph::TensorMeta& meta,
                     bool is_view = false, graph::ValueId reuse = -1);

  /// Appends `op.overload(args)` (the schema's full argument list) as `oracle` completes it (names, flags and the one
  /// result's meta): its result is `reuse` (a replaced node's value, whose recorded sizes and dtype it must give) or,
  /// when reuse < 0, a new value that needs grad when `requires_grad`.
  graph::ValueId add_completed(graph::OpOracle& oracle, const std::string& op, const std::string& overload,
                               std::vector<graph::ArgValue> args, bool requires_grad = false, graph::ValueId reuse = -1);

  /// `v` cast to `dtype` through one aten::_to_copy node (layout kept), its output `reuse` or, when reuse < 0, a new
  /// value with v's meta in that dtype.
  graph::ValueId cast(graph::ValueId v, graph::ScalarType dtype, graph::ValueId reuse = -1);

  /// `v` viewed with `expanded_sizes` (a broadcast: new leading dims and size-1 dims get stride 0) through one
  /// aten::expand node; `v` must broadcast to that shape.
  graph::ValueId expand(graph::ValueId v, const std::vector<int64_t>& expanded_sizes);

  graph::Graph& graph() { return g_; }

 private:
  graph::Graph& g_;
};

}  // namespace kiln::passes
