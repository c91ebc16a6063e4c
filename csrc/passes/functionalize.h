#pragma once
// In-place ops on tensors the graph itself made, rewritten as their functional forms, so that graphs with
// `nn.ReLU(inplace=True)` or `x.add_(y)` on intermediates can be fused and compiled instead of running op by
// op. Torch-free.
#include "graph/graph.h"

namespace kiln::passes {

/// Rewrites in-place nodes (`relu_`, `add_`, `masked_fill_`, ... see the table in functionalize.cpp) whose
/// mutated tensor was produced in this graph by a non-view op and was never viewed, into their functional
/// ops; later uses of the mutated tensor read the result. In-place ops on inputs, constants, views or viewed
/// tensors stay (they need the eager interpreter). Returns true if it changed the graph.
bool functionalize_inplace_ops(graph::Graph& g);

}  // namespace kiln::passes
