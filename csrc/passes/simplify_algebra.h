#pragma once
// Algebraic identities that are exact in floating point: `x * 1`, `x / 1`, `x - 0` and `x ** 1` are x, bit for
// bit (NaN, infinities and -0.0 included; `x + 0` is not: -0.0 + 0 is +0.0). Torch-free.
#include "graph/graph.h"

namespace kiln::passes {

/// Replaces the uses of such a node's result by its tensor operand where that changes nothing eager could see:
/// the result has the operand's dtype, sizes and strides, is not a graph output (eager returns a new tensor), and
/// every reader is a pure op that neither views nor writes it, and no node of the graph writes in place. The node
/// is left dead for remove_dead_nodes.
/// Returns how many results were replaced.
int simplify_algebra(graph::Graph& g);

}  // namespace kiln::passes
