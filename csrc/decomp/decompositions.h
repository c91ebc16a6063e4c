#pragma once
// The decomposition table: "aten::op.overload" -> how the op is written in prims (decomp/prims.h).
// An op (or one particular call of it: an unsupported dtype, a device change, an option kiln does not
// model) that has no entry stays an extern call, run through ATen exactly as the eager backend would.
//
// Torch-free.
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "decomp/prims.h"
#include "graph/graph.h"

namespace kiln::decomp {

struct Decomposition {
  /// False when this call cannot be decomposed (then it is an extern call). Unset: always.
  std::function<bool(const graph::Graph&, const graph::Node&)> supports;
  /// Reductions only: the reduced dims of argument 0 (normalised, ascending; empty = none). Unset for
  /// pointwise ops, whose index space is their output's shape.
  std::function<std::vector<int64_t>(const graph::Graph&, const graph::Node&)> reduction_dims;
  /// Writes the node in prims; must call set_output for every output listed in `outputs_built`.
  std::function<void(PrimBuilder&, const graph::Graph&, const graph::Node&)> build;
  /// How many of the node's outputs the builder defines (native_layer_norm: all 3).
  int outputs_built = 1;
  /// True when the builder reads its tensor arguments through padded_arg only (pooling, padding): each output
  /// element reads other elements of them than its own, so they cannot be values of the same loop.
  bool padded_reads = false;
  /// True when the builder reads its tensor arguments through gather only (embedding, gather, index_select): they
  /// must be tensors before the kernel runs, never values of the same loop.
  bool gathered_reads = false;
  /// Windowed ops only (pooling): the sizes of the window dims, appended to the output's shape to make the
  /// node's index space; reduce() combines over them. Unset for every other op.
  std::function<std::vector<int64_t>(const graph::Graph&, const graph::Node&)> window_sizes;
};

/// The decomposition of `node`, or nullptr when it must stay an extern call (no entry, `supports` says
/// no, or a tensor of a dtype or device that the code generators do not handle).
const Decomposition* find_decomposition(const graph::Graph& g, const graph::Node& node);

/// Nodes that define a 0-d constant from their arguments alone (aten::scalar_tensor): fused kernels use
/// the number directly. Returns the value and sets `dtype`, or nullopt.
std::optional<double> constant_node_value(const graph::Graph& g, const graph::Node& node, graph::ScalarType& dtype);

/// View ops whose output is an affine re-indexing (sizes, strides, offset of the meta) of argument 0's
/// storage: kernels load through them without copying. `reshape`-like ops qualify only on contiguous input.
/// Which ops are such views is the op table's OpView (graph/op_facts.h).
bool is_affine_view(const graph::Graph& g, const graph::Node& node);

/// Dtypes the generated code can load, compute and store.
bool is_codegen_dtype(graph::ScalarType t);
/// The dtype binary arithmetic/comparison on `a` and `b` computes in (PyTorch's promotion for the dtypes
/// kiln generates code for; Python numbers are "weak": they only raise the category).
graph::ScalarType promote_types(graph::ScalarType a, graph::ScalarType b);

/// Names of every op overload in the table (for tests and docs).
std::vector<std::string> decomposed_ops();

}  // namespace kiln::decomp
