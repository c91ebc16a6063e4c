#pragma once
// What graph rewrites that create nodes ask of the layer that knows ATen's schemas and meta kernels (torch-free).
//
// A pass that adds a node (passes/lower_attention, passes/use_cudnn_batch_norm) or a builder that emits many
// (autodiff/backward_builder) never computes the results' metas by hand (DESIGN.md: shapes come from kiln's meta
// rules or PyTorch's meta kernels): it asks an OpOracle, which a LibTorch layer implements over the running torch.
// Kept in graph/, below every layer that asks.
#include <vector>

#include "graph/graph.h"

namespace kiln::graph {

class OpOracle {
 public:
  virtual ~OpOracle() = default;
  /// `node` names an op and holds its full schema argument list (defaults included, schema order).
  /// Fills arg_names, num_positional, mutates_args and is_view from the schema and returns the metas of
  /// the op's results computed by its meta kernel on tensors shaped like `g`'s values. Throws a kiln
  /// error naming the op when it is unknown or the arguments do not fit.
  virtual std::vector<TensorMeta> complete_node(const Graph& g, Node& node) = 0;
};

}  // namespace kiln::graph
