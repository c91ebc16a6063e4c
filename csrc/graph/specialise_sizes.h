#pragma once
// A symbolic graph at one binding of its size symbols: the concrete graph the backends compile (issue #25).
#include <memory>

#include "graph/graph.h"
#include "graph/sym_expr.h"

namespace kiln::graph {

/// Needs: `g` with a symbolic table (graph/symbolic_sizes.h) or without one, and `bindings` giving a value to every
/// symbol it defines. The caller checks that the binding satisfies the graph's assumptions and specialisations
/// (runtime/dynamic_graph.h does); this function only evaluates.
/// Guarantees: a copy of `g` without a symbolic table in which every value's TensorMeta is evaluate_meta(g, id,
/// bindings) and every SymbolicIntArg's node argument (an int, or an element of an int list) holds its expression's
/// value; nodes, constants (their tensors shared), inputs and outputs are otherwise as in `g`, value ids included.
/// At the hints the result equals the graph as captured. Throws kiln::Error when a symbol is unbound.
std::shared_ptr<Graph> specialise_sizes(const Graph& g, const sym::Bindings& bindings);

}  // namespace kiln::graph
