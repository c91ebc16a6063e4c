#pragma once
// Symbolic sizes for a recorded graph: mark input dims dynamic, then compute every value's sizes, strides and
// storage offset as expressions with kiln's shape rules (graph/shape_rules.h), node by node.
#include <cstdint>
#include <vector>

#include "graph/symbolic_sizes.h"

namespace kiln::graph {

/// Makes a fresh symbol for each of `dims` of graph input `input_index` (negative dims count from the end) whose size
/// is not 0 or 1 (those stay concrete: broadcasting and empty tensors decide on them), with range [2, inf) and the
/// concrete size as hint; the input's meta becomes symbolic. Dense strides (contiguous in some dim order) become
/// expressions over the sizes; any other strides stay concrete (a guard on them). Returns the symbols made. One
/// symbol per (input, dim): equal sizes are tied only by the equalities the rules assume. Call before
/// propagate_symbolic_sizes; a user error when the input or dim does not exist.
std::vector<sym::Expr> mark_symbolic_dims(Graph& g, int32_t input_index, const std::vector<int64_t>& dims);

/// Records that an int argument of a node stands for a size expression (`value`, over symbols already made): the
/// hook for a tracer that knows an int came from a size. The propagation then passes it to the rule as that
/// expression. A user error when the argument is not an int (or int list element) equal to `value` at the hints.
void mark_symbolic_int_arg(Graph& g, const SymbolicIntArg& arg);

/// Needs: the dims that may vary marked (nothing marked: nothing to do, the graph stays without symbols).
/// Guarantees: each value's symbolic meta (Graph::symbolic->metas) evaluates to its concrete meta at the hints (a
/// rule that disagrees is a bug: internal error naming the op and both metas); the rules' assumptions are on the
/// graph, with the node in each reason; an equality of a symbol with another expression replaces the symbol by it
/// everywhere (the assumption stays, as the guard), and equality with a constant specialises it. A node without a
/// rule, or whose rule refuses, specialises: every symbol its tensor and int arguments name is pinned to its hint,
/// with the op and the rule's reason, and its outputs are concrete. Run once, after the graph is built.
void propagate_symbolic_sizes(Graph& g);

}  // namespace kiln::graph
